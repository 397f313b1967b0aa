"""A local HTTP server that speaks Better Stack Uptime's incidents API, for the alert tests.

It serves, on 127.0.0.1 and a free port, in a thread of its own (so it answers a relay running
in the test's event loop or in a subprocess alike):

* ``POST /api/v3/incidents``: checks ``Authorization: Bearer <token>`` (401 otherwise) and the
  JSON body strictly: 422 for a field the documentation does not list, a field of the wrong
  type (a channel flag that is not a boolean, ``team_wait`` not an integer, a ``metadata`` value
  that is neither a string nor a list of ``{"type", "value"}``...) or a blank ``summary``;
  stores the incident (metadata normalised to lists of ``{"type": "String", "value": ...}``)
  and answers 201 with ``{"data": {"id", "type": "incident", "attributes": {...}}}``;
* ``GET /api/v3/incidents``: the documented filters ``resolved`` and
  ``metadata[KEY][][value]=VALUE``, pages of ``per_page`` (default 10, at most 50) with
  ``pagination.first/last/prev/next``;
* ``GET /api/v3/incidents/{id}``: the incident (404 when unknown);
* ``POST /api/v3/incidents/{id}/acknowledge`` (``acknowledged_by``), ``.../resolve``
  (``resolved_by``): 200 with the incident; 409 when it was acknowledged / resolved already
  (``{"errors": "Incident was already resolved"}``, as documented);
* ``POST /api/v3/incidents/{id}/escalate``: ``escalation_type`` (User, Team, Schedule, Policy,
  Organization) with the target its type needs, typed as documented (``policy_id``,
  ``team_id``... integers); 200 and the escalation recorded. Escalating a resolved incident is
  not documented; the fake answers 409 like a resolve;
* ``POST /api/v2/incidents/{id}/comments`` (``content``, required): 201, recorded;
* ``GET|POST|HEAD /api/v1/heartbeat/<token>``: 200, recorded; ``.../<token>/fail`` records a
  failure.

Incident state: open (``Started``), acknowledged, resolved by a person
(:meth:`FakeBetterStack.resolve_by_person`, as someone in Better Stack's UI would) or resolved
through the API (by us): see :meth:`FakeBetterStack.state`.

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
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

INCIDENTS = "/api/v3/incidents"
COMMENTS = "/api/v2/incidents"
HEARTBEAT_PREFIX = "/api/v1/heartbeat/"
CHANNELS = ("call", "sms", "email", "push", "critical_alert")
_INCIDENT_PATH = re.compile(r"^/api/v3/incidents/([^/]+)(?:/(acknowledge|resolve|escalate))?$")
_COMMENTS_PATH = re.compile(r"^/api/v2/incidents/([^/]+)/comments$")

# The documented request bodies: field name -> accepted JSON types (bool is not an int here).
CREATE_FIELDS: dict[str, tuple[type, ...]] = {
    "requester_email": (str,),
    "name": (str,),
    "summary": (str,),
    "description": (str,),
    **{c: (bool,) for c in CHANNELS},
    "team_wait": (int,),
    "policy_id": (str, int),
    "team_name": (str,),
    "metadata": (dict,),
}
ESCALATE_FIELDS: dict[str, tuple[type, ...]] = {
    "escalation_type": (str,),
    "user_email": (str,),
    "user_id": (int,),
    "team_name": (str,),
    "team_id": (int,),
    "schedule_id": (int,),
    "policy_id": (int,),
    **{c: (bool,) for c in CHANNELS},
}
ESCALATION_TARGETS = {
    "User": ("user_email", "user_id"),
    "Team": ("team_name", "team_id"),
    "Schedule": ("schedule_id",),
    "Policy": ("policy_id",),
    "Organization": (),
}
RESOLVE_FIELDS: dict[str, tuple[type, ...]] = {"resolved_by": (str,)}
ACKNOWLEDGE_FIELDS: dict[str, tuple[type, ...]] = {"acknowledged_by": (str,)}
COMMENT_FIELDS: dict[str, tuple[type, ...]] = {"content": (str,)}
METADATA_TYPES = ("String", "Number", "Boolean", "User", "Team", "Policy", "Schedule")


def _shape_problems(body: Any, fields: dict[str, tuple[type, ...]]) -> list[str]:
    """What a strict server says of ``body``: not an object, unknown fields, wrong types."""
    if not isinstance(body, dict):
        return ["body must be a JSON object"]
    problems = []
    for name, value in body.items():
        accepted = fields.get(name)
        if accepted is None:
            problems.append(f"Unknown parameter: {name}")
        elif value is not None and (
            not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted)
        ):
            kinds = " or ".join(t.__name__ for t in accepted)
            problems.append(f"{name} must be of type {kinds}")
    return problems


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
        self.escalations: dict[str, list[dict[str, Any]]] = {}
        self.comments: dict[str, list[str]] = {}
        self._resolved_via: dict[str, str] = {}  # incident id -> "person" or "api"
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

    def unscript(self) -> None:
        """Forget the scripted answers not used yet: the normal behaviour again."""
        with self._lock:
            self._scripts.clear()

    def resolve_by_person(self, incident_id: str, who: str = "alice@example.com") -> None:
        """What a person does in Better Stack's UI."""
        with self._lock:
            attributes = self.incidents[incident_id]["attributes"]
            assert attributes["resolved_at"] is None, "already resolved"
            attributes.update(resolved_at=_now(), resolved_by=who, status="Resolved")
            self._resolved_via[incident_id] = "person"

    def acknowledge_by_person(self, incident_id: str, who: str = "alice@example.com") -> None:
        with self._lock:
            attributes = self.incidents[incident_id]["attributes"]
            attributes.update(acknowledged_at=_now(), acknowledged_by=who, status="Acknowledged")

    def state(self, incident_id: str) -> str:
        """open, acknowledged, resolved_by_person or resolved_by_api."""
        with self._lock:
            attributes = self.incidents[incident_id]["attributes"]
            if attributes["resolved_at"] is not None:
                return f"resolved_by_{self._resolved_via[incident_id]}"
            return "acknowledged" if attributes["acknowledged_at"] is not None else "open"

    # -- views ------------------------------------------------------------------------------

    def posts(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.method == "POST" and r.path == INCIDENTS]

    def lists(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.method == "GET" and r.path == INCIDENTS]

    def calls(self, action: str) -> list[Recorded]:
        """Requests on one incident: ``get``, ``acknowledge``, ``resolve``, ``escalate`` or
        ``comment``."""
        found = []
        with self._lock:
            for r in self.requests:
                incident = _INCIDENT_PATH.match(r.path)
                if (incident and (incident.group(2) or "get") == action) or (
                    action == "comment" and _COMMENTS_PATH.match(r.path)
                ):
                    found.append(r)
        return found

    def api_requests(self) -> list[Recorded]:
        """Every request except heartbeats."""
        with self._lock:
            return [r for r in self.requests if not r.path.startswith(HEARTBEAT_PREFIX)]

    def heartbeat_kinds(self) -> list[str]:
        """``success`` or ``fail`` for each heartbeat received, in order."""
        with self._lock:
            return ["fail" if r.path.endswith("/fail") else "success" for r in self.heartbeats]

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
        incident = _INCIDENT_PATH.match(record.path)
        comments = _COMMENTS_PATH.match(record.path)
        if record.path != INCIDENTS and not incident and not comments:
            return 404, {"errors": "Resource not found"}
        if record.headers.get("authorization") != f"Bearer {self.token}":
            return 401, {"errors": "Invalid Team API token. How to find your Team API token: ..."}
        if record.path == INCIDENTS:
            if record.method == "POST":
                return self._create(record)
            if record.method == "GET":
                return self._list(record)
            return 405, {"errors": "Method not allowed"}
        match = incident or comments
        assert match is not None
        with self._lock:
            found = self.incidents.get(match.group(1))
        if found is None:
            return 404, {"errors": "Resource not found"}
        if comments:
            if record.method != "POST":
                return 405, {"errors": "Method not allowed"}
            return self._comment(record, found)
        assert incident is not None
        action = incident.group(2)
        if action is None:
            if record.method != "GET":
                return 405, {"errors": "Method not allowed"}
            with self._lock:
                return 200, {"data": json.loads(json.dumps(found))}
        if record.method != "POST":
            return 405, {"errors": "Method not allowed"}
        return self._act(record, found, action)

    @staticmethod
    def _json_body(record: Recorded) -> tuple[Any, tuple[int, Any] | None]:
        if not record.body:
            return {}, None
        if not record.headers.get("content-type", "").startswith("application/json"):
            return None, (422, {"errors": ["Content-Type must be application/json"]})
        try:
            return json.loads(record.body), None
        except ValueError:
            return None, (422, {"errors": ["body is not JSON"]})

    def _act(self, record: Recorded, incident: dict[str, Any], action: str) -> tuple[int, Any]:
        body, refused = self._json_body(record)
        if refused is not None:
            return refused
        fields = {
            "acknowledge": ACKNOWLEDGE_FIELDS,
            "resolve": RESOLVE_FIELDS,
            "escalate": ESCALATE_FIELDS,
        }[action]
        problems = _shape_problems(body, fields)
        if action == "escalate" and not problems:
            kind = body.get("escalation_type")
            if kind not in ESCALATION_TARGETS:
                problems.append("escalation_type must be one of " + ", ".join(ESCALATION_TARGETS))
            elif ESCALATION_TARGETS[kind] and not any(
                body.get(name) is not None for name in ESCALATION_TARGETS[kind]
            ):
                problems.append(
                    f"{' or '.join(ESCALATION_TARGETS[kind])} required when escalating to {kind}"
                )
        if problems:
            return 422, {"errors": problems}
        with self._lock:
            attributes = incident["attributes"]
            if attributes["resolved_at"] is not None:
                return 409, {"errors": "Incident was already resolved"}
            if action == "acknowledge":
                if attributes["acknowledged_at"] is not None:
                    return 409, {"errors": "Incident was already acknowledged"}
                attributes.update(
                    acknowledged_at=_now(),
                    acknowledged_by=body.get("acknowledged_by") or "API",
                    status="Acknowledged",
                )
            elif action == "resolve":
                attributes.update(
                    resolved_at=_now(),
                    resolved_by=body.get("resolved_by") or "API",
                    status="Resolved",
                )
                self._resolved_via[incident["id"]] = "api"
            else:
                self.escalations.setdefault(incident["id"], []).append(dict(body))
            return 200, {"data": json.loads(json.dumps(incident))}

    def _comment(self, record: Recorded, incident: dict[str, Any]) -> tuple[int, Any]:
        body, refused = self._json_body(record)
        if refused is not None:
            return refused
        problems = _shape_problems(body, COMMENT_FIELDS)
        if not problems and not str(body.get("content") or "").strip():
            problems.append("Content can't be blank")
        if problems:
            return 422, {"errors": problems}
        with self._lock:
            comments = self.comments.setdefault(incident["id"], [])
            comments.append(body["content"])
            number = len(comments)
        return 201, {
            "data": {
                "id": str(number),
                "type": "incident_comment",
                "attributes": {"id": number, "content": body["content"], "created_at": _now()},
            }
        }

    def _create(self, record: Recorded) -> tuple[int, Any]:
        if not record.headers.get("content-type", "").startswith("application/json"):
            return 422, {"errors": ["Content-Type must be application/json"]}
        try:
            body = json.loads(record.body)
        except ValueError:
            return 422, {"errors": ["body is not JSON"]}
        problems = _shape_problems(body, CREATE_FIELDS)
        if problems:
            return 422, {"errors": problems}
        if not isinstance(body.get("summary"), str) or not body["summary"].strip():
            problems.append("Summary can't be blank")
        if "requester_email" in body and "@" not in str(body["requester_email"]):
            problems.append("Requester email is invalid")
        metadata = body.get("metadata") or {}
        for key, value in metadata.items():
            entries = [value] if isinstance(value, str) else value
            if not isinstance(entries, list) or not all(
                isinstance(e, str)
                or (
                    isinstance(e, dict)
                    and set(e) == {"type", "value"}
                    and e["type"] in METADATA_TYPES
                    and isinstance(e["value"], str)
                )
                for e in entries
            ):
                problems.append(
                    f"metadata[{key}] must be a string or a list of {{type, value}} objects"
                )
        if problems:
            return 422, {"errors": problems}
        normalised = {
            key: (
                [{"type": "String", "value": value}]
                if isinstance(value, str)
                else [
                    {"type": "String", "value": item} if isinstance(item, str) else dict(item)
                    for item in value
                ]
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
                    "started_at": _now(),
                    "acknowledged_at": None,
                    "acknowledged_by": None,
                    "resolved_at": None,
                    "resolved_by": None,
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


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def running(token: str = "test-token") -> Iterator[FakeBetterStack]:
    """For fixtures: a started server, closed afterwards."""
    server = FakeBetterStack(token).start()
    try:
        yield server
    finally:
        server.close()
