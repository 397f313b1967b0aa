"""The API's interactive documentation works without internet, and its OpenAPI text speaks
to users."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from test_api_support import Api, assert_problem, running_api


@pytest.fixture
async def api(pool: AsyncConnectionPool[Any]) -> AsyncIterator[Api]:
    async with running_api(pool) as running:
        yield running


class _Links(HTMLParser):
    """Every URL a page makes the browser load: src and href attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]


CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}


async def test_docs_page_loads_only_same_origin_assets_that_the_api_serves(api: Api) -> None:
    page = await api.client.get("/docs")
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html")
    links = _Links()
    links.feed(page.text)
    assert len(links.urls) == 3, links.urls  # the script, the stylesheet, the icon
    # No other host anywhere on the page: no CDN, no validator.
    assert not re.search(r"(?i)\b(https?:)?//", page.text), page.text
    assert "url: '/openapi.json'" in page.text
    for url in links.urls:
        assert url.startswith("/") and not url.startswith("//"), url
        asset = await api.client.get(url)
        assert asset.status_code == 200, url
        [expected] = [t for ext, t in CONTENT_TYPES.items() if url.endswith(ext)]
        assert asset.headers["content-type"].startswith(expected), (url, asset.headers)
        assert len(asset.content) > 500, url
    bundle = await api.client.get(next(u for u in links.urls if u.endswith(".js")))
    assert b"SwaggerUIBundle" in bundle.content
    # The document the page loads is served, without a token.
    assert (await api.client.get("/openapi.json")).status_code == 200


async def test_docs_asset_that_does_not_exist_is_a_404_problem(api: Api) -> None:
    assert_problem(await api.client.get("/docs/assets/nothing.js"), 404)
    assert (await api.client.get("/redoc")).status_code == 404  # no page that needs a CDN


async def test_openapi_text_has_no_project_jargon(api: Api) -> None:
    text = (await api.client.get("/openapi.json")).text
    assert not re.findall(r"\bD(?:[1-9]|10)\b", text)
    assert not re.findall(r"(?i)\bsession\b|\bissue\s*#?\d+", text)


async def test_openapi_description_states_the_time_rule(api: Api) -> None:
    document = (await api.client.get("/openapi.json")).json()
    assert "without an offset, a bare date included, is UTC" in document["info"]["description"]
    bulk = document["components"]["schemas"]["BulkReplayRequest"]["properties"]
    assert "UTC without an offset" in json.dumps(bulk["created_from"])
