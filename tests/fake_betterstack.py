"""A local HTTP server that speaks Better Stack Uptime's incidents API, for the alert tests.

It serves, on 127.0.0.1 and a free port, in a thread of its own (so it answers a relay running
in the test's event loop or in a subprocess alike):

* ``POST /api/v3/incidents``: checks ``Authorization: Bearer <token>`` (401 otherwise) and the
  JSON body (422 when it is not an object, ``summary`` is missing, a channel flag is not a
  boolean, ``team_wait`` not an integer or ``metadata`` not an object), stores the incident
  (metadata normalised to lists of ``{"type": "String", "value": ...}``) and answers 201 with
  ``{"data": {"id", "type": "incident", "attributes": {...}}}``;
* ``GET /api/v3/incidents``: the documented filters ``resolved`` and
  ``metadata[KEY][][value]=VALUE``, pages of ``per_page`` (default 10, at most 50) with
  ``pagination.first/last/prev/next``;
* ``GET|POST|HEAD /api/v1/heartbeat/<token>``: 200, recorded.

Every request is recorded (method, path, query, headers, body, time). Responses can be
scripted per route with a list of :class:`Action`: a status with headers and body, a stall (the
answer comes too late for the client, optionally after creating the incident), a hold (the
incident is created, :attr:`FakeBetterStack.created` is set, and the answer waits until
released) or a dropped connection. ``down`` makes every request fail until it is cleared:
``"drop"`` closes the connection at once, ``"stall"`` never answers (the client times out).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

INCIDENTS = "/api/v3/incidents"
HEARTBEAT_PREFIX = "/api/v1/heartbeat/"
CHANNELS = ("call", "sms", "email", "push", "critical_alert")


@dataclass(frozen=True)
class Action:
    """What the server does with one request of a scripted route.

    kind: ``status`` (answer ``status`` with ``headers`` and ``body``), ``stall`` (wait
    ``seconds`` before answering normally; ``create`` first when ``create_first``), ``hold``
    (create, signal, wait for :meth:`FakeBetterStack.release`) or ``drop`` (close the
    connection without an answer).
    """

    kind: str
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    seconds: float = 0.0
    create_first: bool = False


def respond(status: int, body: Any = None, *, create_first: bool = False, **headers: str) -> Action:
    """Answer ``status``; with ``create_first`` the incident is created anyway (a 409 for an
    incident that exists, a 500 after the write...)."""
    return Action(
        "status", status=status, body=body, headers=dict(headers), create_first=create_first
    )


def stall(seconds: float, *, create_first: bool = False) -> Action:
    return Action("stall", seconds=seconds, create_first=create_first)


def hold() -> Action:
    return Action("hold", create_first=True)


def drop() -> Action:
    return Action("drop")


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() when the request arrived
    status: int | None = None  # what was answered (None: dropped or stalled away)

    def json(self) -> Any:
        return json.loads(self.body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    fake: FakeBetterStack


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.server.fake._handle(self)

    def do_POST(self) -> None:
        self.server.fake._handle(self)

    def do_HEAD(self) -> None:
        self.server.fake._handle(self)


class FakeBetterStack:
    def __init__(self, token: str = "test-token") -> None:
        self.token = token
        self.requests: list[Recorded] = []
        self.incidents: dict[str, dict[str, Any]] = {}
        self.heartbeats: list[Recorded] = []
        self.created = threading.Event()  # set when a held request has created its incident
        self.down: str | None = None  # "drop" (connection closed) or "stall" (no answer)
        self.stall_seconds = 5.0
        self._release = threading.Event()
        self._closing = threading.Event()
        self._scripts: dict[tuple[str, str], list[Action]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1001)
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.fake = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> FakeBetterStack:
        self._thread.start()
        return self

    def close(self) -> None:
        self._release.set()
        self._closing.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def heartbeat_url(self, name: str) -> str:
        return f"{self.base_url}{HEARTBEAT_PREFIX}{name}-secret-token"

    # -- programming ------------------------------------------------------------------------

    def script(self, method: str, path: str, actions: list[Action]) -> None:
        """Answer the next requests of ``method path`` with ``actions``, in order; requests
        after them get the normal behaviour."""
        with self._lock:
            self._scripts.setdefault((method, path), []).extend(actions)

    def release(self) -> None:
        self._release.set()

    # -- views ------------------------------------------------------------------------------

    def posts(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.method == "POST" and r.path == INCIDENTS]

    def lists(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.method == "GET" and r.path == INCIDENTS]

    def incident_list(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.incidents.values())

    def by_dedup_key(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for incident in self.incident_list():
            for value in incident["attributes"]["metadata"].get("jobfence_dedup_key", []):
                found.setdefault(value["value"], []).append(incident["id"])
        return found

    # -- serving ----------------------------------------------------------------------------

    def _next_action(self, method: str, path: str) -> Action | None:
        with self._lock:
            queue = self._scripts.get((method, path))
            return queue.pop(0) if queue else None

    def _handle(self, h: _Handler) -> None:
        split = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        record = Recorded(
            method=h.command,
            path=split.path,
            query=parse_qs(split.query, keep_blank_values=True),
            headers={k.lower(): v for k, v in h.headers.items()},
            body=body,
            at=time.monotonic(),
        )
        with self._lock:
            self.requests.append(record)
        if self.down == "drop":
            self._drop(h)
            return
        if self.down == "stall":  # a black hole: the client times out
            self._closing.wait(timeout=self.stall_seconds)
            self._drop(h)
            return
        if split.path.startswith(HEARTBEAT_PREFIX):
            with self._lock:
                self.heartbeats.append(record)
            self._send(h, record, 200, "OK")
            return
        action = self._next_action(h.command, split.path)
        if action is not None:
            if action.kind == "drop":
                self._drop(h)
                return
            if action.kind == "status":
                if action.create_first:
                    self._route(record)
                self._send(h, record, action.status, action.body, action.headers)
                return
            if action.create_first:
                status, answer = self._route(record)
                if action.kind == "hold":
                    self.created.set()
                    self._release.wait(timeout=60)
                else:
                    time.sleep(action.seconds)
                self._send(h, record, status, answer)
                return
            time.sleep(action.seconds)  # stall, then behave normally
        status, answer = self._route(record)
        self._send(h, record, status, answer)

    def _route(self, record: Recorded) -> tuple[int, Any]:
        if record.path != INCIDENTS:
            return 404, {"errors": "Resource not found"}
        if record.headers.get("authorization") != f"Bearer {self.token}":
            return 401, {"errors": "Invalid Team API token. How to find your Team API token: ..."}
        if record.method == "POST":
            return self._create(record)
        if record.method == "GET":
            return self._list(record)
        return 405, {"errors": "Method not allowed"}

    def _create(self, record: Recorded) -> tuple[int, Any]:
        if not record.headers.get("content-type", "").startswith("application/json"):
            return 422, {"errors": ["Content-Type must be application/json"]}
        try:
            body = json.loads(record.body)
        except ValueError:
            return 422, {"errors": ["body is not JSON"]}
        problems = []
        if not isinstance(body, dict):
            return 422, {"errors": ["body must be an object"]}
        if not isinstance(body.get("summary"), str) or not body["summary"].strip():
            problems.append("Summary can't be blank")
        for channel in CHANNELS:
            if channel in body and not isinstance(body[channel], bool):
                problems.append(f"{channel} must be a boolean")
        if "team_wait" in body and not isinstance(body["team_wait"], int):
            problems.append("team_wait must be an integer")
        if "requester_email" in body and "@" not in str(body["requester_email"]):
            problems.append("Requester email is invalid")
        metadata = body.get("metadata", {})
        if not isinstance(metadata, dict):
            problems.append("metadata must be an object")
        if problems:
            return 422, {"errors": problems}
        normalised = {
            key: (
                [{"type": "String", "value": value}]
                if isinstance(value, str)
                else [dict(item) for item in value]
            )
            for key, value in metadata.items()
        }
        with self._lock:
            incident_id = str(next(self._ids))
            incident = {
                "id": incident_id,
                "type": "incident",
                "attributes": {
                    "name": body.get("name"),
                    "summary": body.get("summary"),
                    "description": body.get("description"),
                    "cause": body.get("summary"),
                    "started_at": datetime.now(UTC).isoformat(),
                    "acknowledged_at": None,
                    "resolved_at": None,
                    "status": "Started",
                    "team_name": body.get("team_name"),
                    "requester_email": body.get("requester_email"),
                    "policy_id": body.get("policy_id"),
                    "team_wait": body.get("team_wait"),
                    **{c: body.get(c) for c in ("call", "sms", "email", "push")},
                    "metadata": normalised,
                },
            }
            self.incidents[incident_id] = incident
        return 201, {"data": incident}

    def _list(self, record: Recorded) -> tuple[int, Any]:
        wanted: dict[str, str] = {}
        for name, values in record.query.items():
            if name.startswith("metadata[") and name.endswith("][][value]"):
                wanted[name[len("metadata[") : -len("][][value]")]] = values[-1]
        resolved = record.query.get("resolved", [None])[-1]
        per_page = min(int(record.query.get("per_page", ["10"])[-1]), 50)
        page = max(int(record.query.get("page", ["1"])[-1]), 1)

        def matches(incident: dict[str, Any]) -> bool:
            attributes = incident["attributes"]
            if resolved == "true" and attributes["resolved_at"] is None:
                return False
            if resolved == "false" and attributes["resolved_at"] is not None:
                return False
            for key, value in wanted.items():
                values = [v.get("value") for v in attributes["metadata"].get(key, [])]
                if value not in values:
                    return False
            return True

        found = [i for i in self.incident_list() if matches(i)]
        pages = max((len(found) + per_page - 1) // per_page, 1)
        chunk = found[(page - 1) * per_page : page * per_page]

        def link(n: int) -> str:
            query = {k: v[-1] for k, v in record.query.items() if k != "page"}
            return f"{self.base_url}{INCIDENTS}?{urlencode({**query, 'page': n})}"

        return 200, {
            "data": chunk,
            "pagination": {
                "first": link(1),
                "last": link(pages),
                "prev": link(page - 1) if page > 1 else None,
                "next": link(page + 1) if page < pages else None,
            },
        }

    def _send(
        self,
        h: _Handler,
        record: Recorded,
        status: int,
        body: Any,
        headers: dict[str, str] | None = None,
    ) -> None:
        payload = (
            b""
            if body is None
            else body.encode()
            if isinstance(body, str)
            else json.dumps(body).encode()
        )
        try:
            h.send_response(status)
            h.send_header("Content-Type", "application/json; charset=utf-8")
            h.send_header("Content-Length", str(len(payload)))
            h.send_header("Connection", "close")
            for name, value in (headers or {}).items():
                h.send_header(name, value)
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(payload)
            h.wfile.flush()
            record.status = status
        except OSError:
            pass  # the client gave up (timeout) or was killed
        h.close_connection = True

    @staticmethod
    def _drop(h: _Handler) -> None:
        h.close_connection = True
        with contextlib.suppress(OSError):
            h.connection.shutdown(2)


def running(token: str = "test-token") -> Iterator[FakeBetterStack]:
    """For fixtures: a started server, closed afterwards."""
    server = FakeBetterStack(token).start()
    try:
        yield server
    finally:
        server.close()
