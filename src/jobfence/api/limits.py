"""The request body limit: no request makes the API hold more than :data:`MAX_BODY_BYTES` of
its body.

A body whose ``Content-Length`` is over the limit is refused before any of it is read; a body
without one (``Transfer-Encoding: chunked``) is counted as it arrives and refused as soon as
it passes the limit, holding at most the limit meanwhile. The refusal is a 413 problem; the
connection stays open, so the client reads it whole: uvicorn drops whatever the client still
sends of that body as it arrives, holding none of it.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobfence.api.problems import TYPE_BODY_TOO_LARGE, problem, respond

# The largest request body the API reads, in bytes. Its largest valid body (a bulk replay's
# filter, a discard reason of 2,000 characters) is about 10 KB.
MAX_BODY_BYTES = 64 * 1024


def _content_length(scope: Scope) -> int | None:
    """The request's ``Content-Length``, or None when it has none (or none readable)."""
    for name, value in scope["headers"]:  # names are lower case (ASGI)
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class LimitBody:
    """ASGI middleware: a request body over ``max_bytes`` is a 413 problem (see the module).
    Runs inside :class:`jobfence.api.auth.Authenticate`: a request without a valid token is
    refused before its body is even counted."""

    def __init__(self, app: ASGIApp, *, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:
            # The server delivers exactly Content-Length bytes: nothing to count.
            if length > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # No length given: read the body here, up to the limit, and hand it on whole.
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                messages.clear()
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"the request body is larger than the limit of {self.max_bytes} bytes"
        body = problem(413, detail, type_=TYPE_BODY_TOO_LARGE, title="Content Too Large")
        await respond(Request(scope), body)(scope, receive, send)
