"""Dead letter payloads go out exactly as PostgreSQL stores them, never parsed in between.

A dead letter's payload is whatever failed: possibly nested hundreds of levels deep, or holding
numbers beyond a float (``1e400`` is valid JSON and jsonb keeps it exactly). Parsing it into
Python and serialising it again would lose such numbers or fail on the nesting. So while the
API reads dead letters, jsonb columns load as :class:`RawJson` (their text), and the response
is rendered with each payload's text spliced in where its placeholder stands.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.adapt import Buffer, Loader
from psycopg.pq import Format
from pydantic import BaseModel
from starlette.responses import Response


@dataclass(frozen=True, slots=True)
class RawJson:
    """A JSON document as text, as PostgreSQL wrote it."""

    text: str


class _RawJsonbLoader(Loader):
    def load(self, data: Buffer) -> RawJson:
        return RawJson(bytes(data).decode("utf-8"))


class _RawJsonbBinaryLoader(Loader):
    format = Format.BINARY

    def load(self, data: Buffer) -> RawJson:
        return RawJson(bytes(data[1:]).decode("utf-8"))  # after the version byte


@contextlib.asynccontextmanager
async def raw_jsonb(conn: AsyncConnection[Any]) -> AsyncIterator[None]:
    """Within: ``conn`` loads jsonb as :class:`RawJson`; its loaders are restored after."""
    adapters = conn.adapters
    oid = adapters.types["jsonb"].oid
    previous = [adapters.get_loader(oid, fmt) for fmt in (Format.TEXT, Format.BINARY)]
    adapters.register_loader(oid, _RawJsonbLoader)
    adapters.register_loader(oid, _RawJsonbBinaryLoader)
    try:
        yield
    finally:
        for loader in previous:
            if loader is not None:
                adapters.register_loader(oid, loader)


# NUL cannot occur in PostgreSQL text or jsonb strings, so no stored value can look like this.
_PLACEHOLDER = "\x00payload-{}\x00"
_PLACEHOLDER_JSON = re.compile(r'"\\u0000payload-(\d+)\\u0000"')


class Splicer:
    """Hands out placeholders for raw payloads, then renders a model with them spliced in."""

    def __init__(self) -> None:
        self._texts: list[str] = []

    def hold(self, payload: object) -> str | None:
        """The placeholder to put in the model for ``payload`` (None stays None)."""
        if payload is None:
            return None
        if not isinstance(payload, RawJson):
            raise TypeError("payloads must be read inside raw_jsonb()")
        self._texts.append(payload.text)
        return _PLACEHOLDER.format(len(self._texts) - 1)

    def render(self, model: BaseModel) -> str:
        body = model.model_dump_json()
        return _PLACEHOLDER_JSON.sub(lambda m: self._texts[int(m.group(1))], body)

    def response(self, model: BaseModel, *, status_code: int = 200) -> Response:
        return Response(self.render(model), status_code=status_code, media_type="application/json")
