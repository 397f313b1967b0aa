"""Better Stack Uptime: incidents (API v3) and heartbeats, over httpx.

* ``POST {api_url}/api/v3/incidents`` opens an incident. The body carries ``summary``, ``name``,
  ``description``, the notification channels (``call``, ``sms``, ``email``, ``push``), the
  optional ``requester_email``, ``team_name``, ``policy_id`` and ``team_wait``, and a
  ``metadata`` object whose values are lists of ``{"type": "String", "value": ...}``; the alert's
  dedup key is one of them (``jobfence_dedup_key``).
* ``GET {api_url}/api/v3/incidents?metadata[jobfence_dedup_key][][value]=KEY`` finds the incident
  a previous attempt may have opened (resolved ones included); the answer is checked again
  here, and ``pagination.next`` is followed only on the same origin.
* ``GET {api_url}/api/v3/incidents/{id}`` reads an incident's state (``resolved_at``,
  ``resolved_by``, ``acknowledged_at``, ``acknowledged_by``).
* ``POST {api_url}/api/v3/incidents/{id}/resolve`` with ``{"resolved_by": ...}`` resolves it; 409
  means it was resolved already (by whom: read back with a ``GET``).
* ``POST {api_url}/api/v3/incidents/{id}/escalate`` with ``escalation_type`` (``Policy`` with
  ``policy_id`` when a policy is configured, else ``Team`` with ``team_name`` when a team is,
  else ``Organization``) and the channel booleans.
* ``POST {api_url}/api/v2/incidents/{id}/comments`` with ``{"content": ...}`` adds a comment.
* A heartbeat is a ``GET`` on its own URL (``https://uptime.betterstack.com/api/v1/heartbeat/...``);
  the same URL with ``/fail`` appended reports a failure.

Requests carry ``Authorization: Bearer <token>``; the client is the same whatever ``api_url`` is
(tests point it at a local server). Neither the token nor a heartbeat URL (which holds a
secret) ever appears in an error message or a log line.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any
from urllib.parse import urlsplit

import httpx

from jobfence.alerts.model import (
    DEDUP_METADATA_KEY,
    DeliveryError,
    IncidentRequest,
    IncidentState,
)
from jobfence.errors import ConfigError
from jobfence.ports import CleanupMetricsSink
from jobfence.redact import printable
from jobfence.transport import is_loopback

log = logging.getLogger("jobfence.alerts")

DEFAULT_API_URL = "https://uptime.betterstack.com"
INCIDENTS_PATH = "api/v3/incidents"
COMMENTS_PATH = "api/v2/incidents/{id}/comments"
MAX_LOOKUP_PAGES = 20
MAX_ERROR_BODY_CHARS = 300
USER_AGENT = "jobfence-alert-relay"


@dataclass(frozen=True, slots=True)
class BetterStackSettings:
    """How incidents are opened. ``token`` is a Better Stack Uptime API token (never shown).

    ``team_name`` is required by Better Stack with a global API token; ``policy_id`` routes the
    incident through an escalation policy; ``team_wait`` (seconds) escalates to the whole team
    when nobody acknowledges. ``call``/``sms``/``email``/``push`` choose how the on-call person
    is alerted. ``timeout_seconds`` bounds each request (connect, read, write and pool).
    """

    token: str = field(repr=False)
    api_url: str = DEFAULT_API_URL
    requester_email: str | None = None
    team_name: str | None = None
    policy_id: str | None = None
    team_wait: int | None = None
    call: bool = False
    sms: bool = False
    email: bool = True
    push: bool = True
    timeout_seconds: float = 10.0

    def __post_init__(self) -> None:
        if not self.token.strip():
            raise ConfigError("the Better Stack token is empty")
        parts = urlsplit(self.api_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                "the Better Stack API URL must be http(s)://host[:port], "
                f"got {_origin(self.api_url)!r}"
            )
        if not 0 < self.timeout_seconds < float("inf"):
            raise ConfigError("timeout_seconds must be a positive number")
        if self.team_wait is not None and self.team_wait < 0:
            raise ConfigError("team_wait must be >= 0 seconds")
        if self.policy_id is not None and not self.policy_id.isdigit():
            raise ConfigError(f"policy_id must be a number, got {self.policy_id!r}")


def _origin(url: str) -> str:
    """scheme://host[:port] of ``url``, without credentials, path or query (safe to log)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}" if parts.scheme else "<invalid URL>"


def _http_date(text: str | None) -> float | None:
    """An HTTP date as seconds since the epoch (None when absent or not a date)."""
    if text is None or not text.strip():
        return None
    try:
        when = email.utils.parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def parse_retry_after(
    value: str | None, *, now: float | None = None, date: str | None = None
) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date).

    An HTTP date is the server's clock: it is measured from the response's ``Date`` header
    (``date``, the same clock) when that is a date, so that this host's clock being off plays
    no part; only without one from ``now`` (this host's clock by default)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        return max(float(text), 0.0)
    except ValueError:
        pass
    when = _http_date(text)
    if when is None:
        return None
    current = _http_date(date)
    if current is None:
        current = time.time() if now is None else now
    return max(when - current, 0.0)


def _error_detail(response: httpx.Response) -> str:
    """Better Stack's error text, trimmed to one short line."""
    try:
        body: Any = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        text = response.text
    else:
        errors = body.get("errors", body) if isinstance(body, dict) else body
        text = json.dumps(errors, ensure_ascii=False) if not isinstance(errors, str) else errors
    text = " ".join(text.split())
    if len(text) > MAX_ERROR_BODY_CHARS:
        text = text[: MAX_ERROR_BODY_CHARS - 3] + "..."
    return text or "(empty body)"


def _failure(what: str, response: httpx.Response) -> DeliveryError:
    status = response.status_code
    detail = _error_detail(response)
    retryable = status in {408, 429} or status >= 500
    retry_after = (
        parse_retry_after(response.headers.get("Retry-After"), date=response.headers.get("Date"))
        if retryable
        else None
    )
    return DeliveryError(
        f"{what}: HTTP {status}: {detail}",
        retryable=retryable,
        status=status,
        retry_after=retry_after,
    )


def _transport_failure(what: str, exc: httpx.HTTPError) -> DeliveryError:
    reason = " ".join(str(exc).split()) or "no detail"
    return DeliveryError(f"{what}: {type(exc).__name__}: {reason[:200]}", retryable=True)


def incident_id_of(value: object) -> str | None:
    """``value`` as an incident id, when it is one Better Stack gives (a whole number, in JSON
    as a string of ASCII digits or a number); else None. An answer's id becomes a request's
    path and a stored row: nothing else is taken."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = str(value)
    if isinstance(value, str) and _INCIDENT_ID.fullmatch(value) is not None:
        return value
    return None


_INCIDENT_ID = re.compile(r"[0-9]{1,19}")


def _object(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _objects(value: object) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _metadata_values(raw: Any) -> list[str]:
    """The string values of one metadata entry, whichever shape Better Stack returns."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list):
        found = []
        for item in raw:
            if isinstance(item, str):
                found.append(item)
            elif isinstance(item, dict) and isinstance(item.get("value"), str):
                found.append(item["value"])
        return found
    return []


class BetterStackIncidents:
    """The :class:`~jobfence.alerts.model.IncidentSink` for Better Stack Uptime."""

    def __init__(
        self,
        settings: BetterStackSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self._origin = _origin(settings.api_url)
        base = settings.api_url if settings.api_url.endswith("/") else settings.api_url + "/"
        self._client = httpx.AsyncClient(
            base_url=base,
            timeout=httpx.Timeout(settings.timeout_seconds),
            headers={"Accept": "application/json", "User-Agent": USER_AGENT},
            follow_redirects=False,
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"BetterStackIncidents({self._origin})"

    @property
    def origin(self) -> str:
        return self._origin

    def _auth(self) -> dict[str, str]:
        # Per request, not a client default: the header goes to the API and nowhere else.
        return {"Authorization": f"Bearer {self.settings.token}"}

    def body(self, request: IncidentRequest) -> dict[str, Any]:
        """The JSON body of ``POST /api/v3/incidents`` for ``request``."""
        s = self.settings
        metadata = {
            key: [{"type": "String", "value": value}] for key, value in request.metadata.items()
        }
        metadata[DEDUP_METADATA_KEY] = [{"type": "String", "value": request.dedup_key}]
        body: dict[str, Any] = {
            "name": request.name,
            "summary": request.summary,
            "description": request.description,
            "call": s.call,
            "sms": s.sms,
            "email": s.email,
            "push": s.push,
            "metadata": metadata,
        }
        if s.requester_email:
            body["requester_email"] = s.requester_email
        if s.team_name:
            body["team_name"] = s.team_name
        if s.policy_id:
            body["policy_id"] = s.policy_id
        if s.team_wait is not None:
            body["team_wait"] = s.team_wait
        return body

    async def create_incident(self, request: IncidentRequest) -> str:
        what = "Better Stack create incident"
        try:
            response = await self._client.post(
                INCIDENTS_PATH, json=self.body(request), headers=self._auth()
            )
        except httpx.HTTPError as exc:
            raise _transport_failure(what, exc) from None
        if response.status_code == 409:
            # "Already exists": it must be ours from an earlier attempt; find it.
            found = await self.find_incident(request.dedup_key)
            if found is not None:
                return found
            raise DeliveryError(
                f"{what}: HTTP 409 ({_error_detail(response)}) and no incident carries the "
                "dedup key",
                retryable=False,
                status=409,
            )
        if not response.is_success:
            raise _failure(what, response)
        incident_id = self._incident_id(response)
        if incident_id is None:
            # Created (2xx) but unreadable: the next attempt looks the dedup key up first.
            raise DeliveryError(
                f"{what}: HTTP {response.status_code} without an incident id (digits)",
                retryable=True,
                status=response.status_code,
            )
        return incident_id

    @staticmethod
    def _incident_id(response: httpx.Response) -> str | None:
        try:
            data = response.json().get("data")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return None
        return incident_id_of(data.get("id")) if isinstance(data, dict) else None

    async def find_incident(self, dedup_key: str) -> str | None:
        what = "Better Stack list incidents"
        url: str = INCIDENTS_PATH
        params: Mapping[str, str] | None = {f"metadata[{DEDUP_METADATA_KEY}][][value]": dedup_key}
        for _ in range(MAX_LOOKUP_PAGES):
            try:
                response = await self._client.get(url, params=params, headers=self._auth())
            except httpx.HTTPError as exc:
                raise _transport_failure(what, exc) from None
            if not response.is_success:
                raise _failure(what, response)
            try:
                page = response.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise DeliveryError(f"{what}: answer is not JSON", retryable=True) from None
            if not isinstance(page, dict):
                raise DeliveryError(f"{what}: answer is not a JSON object", retryable=True)
            for incident in _objects(page.get("data")):
                metadata = _object(_object(incident.get("attributes")).get("metadata"))
                found = incident_id_of(incident.get("id"))
                if found and dedup_key in _metadata_values(metadata.get(DEDUP_METADATA_KEY)):
                    return found
            following = _object(page.get("pagination")).get("next")
            if following is not None and not isinstance(following, str):
                raise DeliveryError(f"{what}: pagination is not a URL", retryable=True)
            if not following:
                return None
            if _origin(following) != self._origin:
                log.warning("Better Stack pagination points to another host; not followed")
                return None
            url, params = following, None
        raise DeliveryError(f"{what}: more than {MAX_LOOKUP_PAGES} pages", retryable=False)

    def escalation_body(self) -> dict[str, Any]:
        """The JSON body of ``POST /api/v3/incidents/{id}/escalate``."""
        s = self.settings
        body: dict[str, Any]
        if s.policy_id:
            body = {"escalation_type": "Policy", "policy_id": int(s.policy_id)}
        elif s.team_name:
            body = {"escalation_type": "Team", "team_name": s.team_name}
        else:
            body = {"escalation_type": "Organization"}
        body.update(call=s.call, sms=s.sms, email=s.email, push=s.push)
        return body

    @staticmethod
    def _path(incident_id: str, action: str = "") -> str:
        if incident_id_of(incident_id) is None:  # never lets an answer choose another path
            # Recorded before ids were checked where they arrive: no incident has it, as a 404
            # says (the relay opens a new one).
            raise DeliveryError(
                f"incident id {printable(incident_id[:40])!r} is not one Better Stack gives"
                " (digits): no incident has it",
                retryable=False,
                status=404,
            )
        return f"{INCIDENTS_PATH}/{incident_id}" + (f"/{action}" if action else "")

    async def _call(
        self, what: str, method: str, path: str, body: dict[str, Any] | None = None
    ) -> httpx.Response:
        try:
            return await self._client.request(method, path, json=body, headers=self._auth())
        except httpx.HTTPError as exc:
            raise _transport_failure(what, exc) from None

    @staticmethod
    def _state(incident_id: str, response: httpx.Response, what: str) -> IncidentState:
        try:
            data = response.json().get("data")
            attributes = data.get("attributes") or {}
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise DeliveryError(f"{what}: unreadable answer", retryable=True) from None

        def text(name: str) -> str | None:
            value = attributes.get(name)
            return str(value) if value not in (None, "") else None

        return IncidentState(
            incident_id=incident_id,
            resolved_at=text("resolved_at"),
            resolved_by=text("resolved_by"),
            acknowledged_at=text("acknowledged_at"),
            acknowledged_by=text("acknowledged_by"),
        )

    async def get_incident(self, incident_id: str) -> IncidentState:
        what = "Better Stack get incident"
        response = await self._call(what, "GET", self._path(incident_id))
        if not response.is_success:
            raise _failure(what, response)
        return self._state(incident_id, response, what)

    async def resolve_incident(self, incident_id: str, resolved_by: str) -> IncidentState:
        what = "Better Stack resolve incident"
        response = await self._call(
            what, "POST", self._path(incident_id, "resolve"), {"resolved_by": resolved_by}
        )
        if response.status_code == 409:  # "Incident was already resolved": by whom, we read
            return await self.get_incident(incident_id)
        if not response.is_success:
            raise _failure(what, response)
        return self._state(incident_id, response, what)

    async def escalate_incident(self, incident_id: str) -> None:
        what = "Better Stack escalate incident"
        response = await self._call(
            what, "POST", self._path(incident_id, "escalate"), self.escalation_body()
        )
        if not response.is_success:
            raise _failure(what, response)

    async def comment_incident(self, incident_id: str, content: str) -> None:
        what = "Better Stack comment on incident"
        self._path(incident_id)  # the same check of the id
        response = await self._call(
            what, "POST", COMMENTS_PATH.format(id=incident_id), {"content": content}
        )
        if not response.is_success:
            raise _failure(what, response)

    async def aclose(self) -> None:
        await self._client.aclose()


class _RedactHeartbeatUrls(logging.Filter):
    """httpx logs every request's URL at INFO ("HTTP Request: GET https://..."); a heartbeat
    URL holds a secret, so its path is masked in the records of the ``httpx`` logger."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: dict[str, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if self.urls and isinstance(record.args, tuple):
            record.args = tuple(self._clean(arg) for arg in record.args)
        return True

    def _clean(self, value: object) -> object:
        if isinstance(value, (str, httpx.URL)):
            text = str(value)
            for url, masked in self.urls.items():
                text = text.replace(url, masked)
            return text
        return value


_HEARTBEAT_REDACTION = _RedactHeartbeatUrls()


def _mask_in_httpx_logs(url: str) -> None:
    masked = f"{_origin(url)}/***"
    # url/fail (the failure beat) starts with url: it is masked as origin/***/fail.
    _HEARTBEAT_REDACTION.urls[url] = masked
    _HEARTBEAT_REDACTION.urls[str(httpx.URL(url))] = masked  # as httpx prints it
    httpx_log = logging.getLogger("httpx")
    if _HEARTBEAT_REDACTION not in httpx_log.filters:
        httpx_log.addFilter(_HEARTBEAT_REDACTION)


class BetterStackHeartbeat:
    """A Better Stack heartbeat: a ``GET`` on its URL. The URL holds a secret and is never
    logged; failures are logged by ``name`` and never raised."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        timeout_seconds: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        allow_http: bool = False,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"the {name} heartbeat URL must be an http(s) URL")
        # The URL's path is the heartbeat's token: plain http:// only to this host, or with
        # allow_http (JOBFENCE_BETTERSTACK_ALLOW_HTTP=1, a trusted network), as for the API URL.
        if parts.scheme == "http" and not allow_http and not is_loopback(parts.hostname or ""):
            raise ConfigError(
                f"the {name} heartbeat URL is plain http:// to {parts.hostname}: its token would"
                " travel in clear text. Use https://, or set JOBFENCE_BETTERSTACK_ALLOW_HTTP=1 if"
                " the network in between is trusted"
            )
        self._url = url
        self.name = name
        _mask_in_httpx_logs(url)
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_seconds),
            headers={"User-Agent": USER_AGENT},
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"BetterStackHeartbeat({self.name}, {_origin(self._url)})"

    async def beat(self, ok: bool = True) -> bool:
        """A success beat (``GET url``) or, with ``ok=False``, a failure (``GET url/fail``)."""
        url = self._url if ok else self._url.rstrip("/") + "/fail"
        try:
            response = await self._client.get(url)
        except httpx.HTTPError as exc:
            log.warning("%s heartbeat failed (%s)", self.name, type(exc).__name__)
            return False
        if not response.is_success:
            log.warning("%s heartbeat refused: HTTP %d", self.name, response.status_code)
            return False
        return True

    async def aclose(self) -> None:
        await self._client.aclose()


class HeartbeatOnSuccess:
    """A :class:`~jobfence.ports.CleanupMetricsSink` that forwards to ``inner`` and sends the
    cleanup's Better Stack heartbeat after each round: success after a successful one
    (``cleanup_succeeded``), failure (``/fail``) after a failed one (``cleanup_failed``), so a
    cleanup that stopped running or keeps failing is noticed. :meth:`aclose` waits for the last
    heartbeat."""

    def __init__(self, inner: CleanupMetricsSink, heartbeat: BetterStackHeartbeat | None) -> None:
        self._inner = inner
        self._heartbeat = heartbeat
        self._pending: set[asyncio.Task[bool]] = set()

    def cleanup_rows_removed(self, count: int) -> None:
        self._inner.cleanup_rows_removed(count)

    def cleanup_succeeded(self) -> None:
        self._inner.cleanup_succeeded()
        self._beat(ok=True)

    def cleanup_failed(self) -> None:
        self._inner.cleanup_failed()
        self._beat(ok=False)

    def _beat(self, *, ok: bool) -> None:
        if self._heartbeat is not None:
            task = asyncio.get_running_loop().create_task(self._heartbeat.beat(ok))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending)
        if self._heartbeat is not None:
            await self._heartbeat.aclose()
