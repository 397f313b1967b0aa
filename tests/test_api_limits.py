"""The Ops API's edges over real HTTP: the request body limit (413 before a large body is read,
401 before any body is read) and the methods ``/metrics`` allows.

The API runs under uvicorn on a loopback port, behind a meter that counts the request body
bytes uvicorn hands it: what the server took in, whatever the client offered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobfence import PgQueue
from jobfence.api import ApiSettings, create_app
from jobfence.api.limits import MAX_BODY_BYTES
from jobfence.observability import MetricsApp
from support import wait_until
from test_api_support import (
    PREFIX,
    SECRET,
    assert_problem,
    auth,
    dead_letter_row,
    insert_dead_letter,
    loopback_socket,
)

CHUNK = 64 * 1024
OFFERED = 50 * 1024 * 1024  # what a hostile client streams: far more than any socket buffer


class BodyMeter:
    """The app as it is, counting the body bytes of every request it receives."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.received = 0
        self.largest_message = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def metered() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                self.received += size
                self.largest_message = max(self.largest_message, size)
            return message

        await self.app(scope, metered, send)


@contextlib.asynccontextmanager
async def served(app: ASGIApp) -> AsyncIterator[httpx.AsyncClient]:
    sock = loopback_socket()
    config = uvicorn.Config(app, lifespan="on", log_config=None, log_level="warning", ws="none")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="test-uvicorn")

    async def started() -> bool:
        if task.done():
            task.result()
            raise AssertionError("uvicorn stopped before it started")
        return server.started

    try:
        await wait_until(started, timeout=10, message="uvicorn to start")
        base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            yield client
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=15)
        sock.close()


@dataclass
class MeteredApi:
    client: httpx.AsyncClient
    meter: BodyMeter


@pytest.fixture
async def api(pool: AsyncConnectionPool[Any]) -> AsyncIterator[MeteredApi]:
    queue = PgQueue(pool)
    meter = BodyMeter(create_app(pool=pool, queue=queue, settings=ApiSettings(jwt_secret=SECRET)))
    try:
        async with served(meter) as client:
            yield MeteredApi(client, meter)
    finally:
        await queue.close()


def discard_body(size: int) -> bytes:
    """A valid discard body of exactly ``size`` bytes (JSON padded with spaces)."""
    body = json.dumps({"reason": "duplicate order"}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


class Stream:
    """A chunked body (no Content-Length) of just over ``OFFERED`` bytes; ``sent`` counts what
    the client handed over."""

    def __init__(self) -> None:
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks():
            self.sent += len(chunk)
            yield chunk

    @staticmethod
    def _chunks() -> Iterator[bytes]:
        yield b'{"reason": "'
        filler = b"a" * CHUNK
        for _ in range(OFFERED // CHUNK):
            yield filler
        yield b'"}'


async def test_a_body_whose_content_length_is_over_the_limit_is_413_before_it_is_read(
    api: MeteredApi, conn: AsyncConnection[Any]
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="big-cl")
    before = await dead_letter_row(conn, dl_id)

    response = await api.client.post(
        f"{PREFIX}/{dl_id}/discard",
        content=discard_body(MAX_BODY_BYTES + 1),
        headers={**auth("core.dead_letters.discard"), "Content-Type": "application/json"},
    )

    problem = assert_problem(response, 413, type="urn:jobfence:problem:body-too-large")
    assert str(MAX_BODY_BYTES) in problem["detail"]
    assert "duplicate order" not in response.text
    assert api.meter.received == 0
    assert await dead_letter_row(conn, dl_id) == before
    assert before["status"] == "pending_review"


async def test_a_chunked_body_over_the_limit_is_413_once_the_limit_is_passed(
    api: MeteredApi, conn: AsyncConnection[Any]
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="big-chunked")
    before = await dead_letter_row(conn, dl_id)
    stream = Stream()

    response = await api.client.post(
        f"{PREFIX}/{dl_id}/discard",
        content=stream,
        headers={**auth("core.dead_letters.discard"), "Content-Type": "application/json"},
    )

    problem = assert_problem(response, 413, type="urn:jobfence:problem:body-too-large")
    assert "aaaa" not in problem["detail"]
    assert stream.sent > OFFERED
    # The app took in the limit and at most one more message of what uvicorn had buffered;
    # uvicorn dropped the rest of the 50 MB as it came, once the answer had gone.
    assert 0 < api.meter.received <= MAX_BODY_BYTES + api.meter.largest_message
    assert api.meter.largest_message <= 1024 * 1024
    assert await dead_letter_row(conn, dl_id) == before


async def test_a_request_without_a_token_is_401_before_any_of_its_body_is_read(
    api: MeteredApi, conn: AsyncConnection[Any]
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="big-anonymous")
    stream = Stream()

    response = await api.client.post(
        f"{PREFIX}/{dl_id}/discard",
        content=stream,
        headers={"Content-Type": "application/json"},
    )

    assert_problem(response, 401, type="urn:jobfence:problem:unauthorized")
    assert stream.sent > OFFERED
    assert api.meter.received == 0
    assert (await dead_letter_row(conn, dl_id))["status"] == "pending_review"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_of_exactly_the_limit_is_served_as_before(
    api: MeteredApi, conn: AsyncConnection[Any], framing: str
) -> None:
    dl_id = await insert_dead_letter(conn, job_id=f"at-limit-{framing}")
    body = discard_body(MAX_BODY_BYTES)

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    response = await api.client.post(
        f"{PREFIX}/{dl_id}/discard",
        content=body if framing == "content-length" else chunks(),
        headers={**auth("core.dead_letters.discard"), "Content-Type": "application/json"},
    )

    assert response.status_code == 200, response.text
    assert response.json()["status"] == "discarded"
    assert api.meter.received == MAX_BODY_BYTES
    row = await dead_letter_row(conn, dl_id)
    assert (row["status"], row["discard_reason"]) == ("discarded", "duplicate order")


@pytest.mark.parametrize("method", ["POST", "DELETE"])
async def test_a_wrong_method_on_metrics_is_a_405_problem_allowing_get_and_head(
    api: MeteredApi, method: str
) -> None:
    response = await api.client.request(method, "/metrics")

    assert_problem(response, 405, type="about:blank")
    assert response.headers["allow"] == "GET, HEAD"
    assert (await api.client.head("/metrics")).status_code == 200


async def test_the_metrics_app_served_alone_names_the_methods_it_allows() -> None:
    async with served(MetricsApp(CollectorRegistry())) as client:
        response = await client.post("/metrics")

        assert response.status_code == 405
        assert response.headers["allow"] == "GET, HEAD"
        assert (await client.get("/metrics")).status_code == 200
