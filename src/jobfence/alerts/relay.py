"""The alert relay: from the outbox to one incident per group, after commit, exactly once.

Each round, on its own database connection, under a session advisory lock (one active relay
per database; another one stands by):

1. **group**: outbox rows are filed under their alert key (``outbox_classify``: one key per
   queue for consumers that are not registered, ``(queue, consumer, '*')`` for a consumer's
   error classes beyond ``max_error_classes``), then join their key's open group while they
   fall inside its window (window starting at the first one's ``created_at``); a
   group whose window is over is closed, its members counted, and its alert row created with
   a fresh dedup key;
2. **escalate** (D4): a closed group whose window ended ``escalate_after`` ago gets one
   escalation alert if some of its dead letters are still ``pending_review`` (never otherwise);
3. **deliver**: each due alert's attempt is counted and committed *before* the request goes
   out. A later attempt (an earlier request may have reached Better Stack before a crash or a
   timeout) first looks the dedup key up and records the incident it finds instead of opening a
   second one; it waits until the earlier attempt is ``lost_answer_wait`` old (the request
   timeout plus a margin), so that Better Stack has finished any create still in flight.
   Then, **one incident per key**: when the key already has an unresolved incident (its state
   confirmed by ``GET /api/v3/incidents/{id}`` when what we know is older than
   ``state_max_age``), a dead letters alert is merged into it (counted) and an escalation
   escalates it (``POST .../escalate``, once per incident); only a key without one (none yet,
   or the last one resolved, by a person or by us) gets a new incident, unless
   ``max_new_incidents`` opened within ``incident_period`` (or a storm alert was counted
   within it): then it is counted on the one storm incident (opened for it if needed).
   Network errors,
   timeouts, 429 (honouring ``Retry-After``) and 5xx are retried with backoff, pausing all
   deliveries meanwhile; other 4xx are logged, counted and the alert is marked failed;
4. **resolve**: a key whose dead letters were all replayed or discarded has its incident
   resolved (``POST .../resolve``), the request recorded before it goes out (409, resolved
   already, counts as done, and says by whom);
5. **update**: an open incident whose count grew gets a comment with the new count, at most
   once per ``update_interval``;
6. **heartbeat**: success while delivery works; failure (``/fail``) while an alert or a resolve
   was refused for good or has waited longer than ``delivery_bound``.

The relay never touches the queue or the workers: when Better Stack is down, dead letters keep
being recorded in the outbox and go out once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import dict_row

from jobfence.alerts.model import (
    DeliveryError,
    Heartbeat,
    IncidentRequest,
    IncidentSink,
    IncidentState,
)
from jobfence.alerts.outbox import SQL, alert_counts
from jobfence.config import secrets_from_env
from jobfence.errors import ConfigError
from jobfence.limits import MAX_DELAY_DAYS, MAX_DELAY_SECONDS
from jobfence.outage_log import stay_connected
from jobfence.ports import AlertMetricsSink, Clock
from jobfence.redact import Redactor, printable, url_secrets
from jobfence.schema import ensure_migrated

if TYPE_CHECKING:
    from jobfence.config import AlertConfig

log = logging.getLogger("jobfence.alerts")

# Session advisory lock of the active relay ("jfalerts"); distinct from the migration lock.
RELAY_LOCK_KEY = 0x6A66616C65727473
MAX_GROUPING_PASSES = 100
#: Outbox rows filed under their alert key per statement (repeated until none is left).
CLASSIFY_BATCH = 1000
#: The error classes of dead letters whose consumer is not one of the application's (or whose
#: identifiers could not be stored as named), and of messages the outbox relay could not publish
#: (the broker refused them for good, or kept failing): their consumer name is the producer's
#: choice, never checked against a worker's, so they are filed under one key per queue,
#: whatever the name.
UNKNOWN_CONSUMER_CLASSES = (
    "UnknownConsumer",
    "UnfenceableMessage",
    "PublishRefused",
    "PublishFailed",
)
#: The consumer and error class of a key that stands for many (unknown consumers, the error
#: classes beyond the limit, the storm).
ANY = "*"
STORM_BREAKDOWN_KEYS = 10
SAMPLE_DEAD_LETTERS = 5
MAX_NAME_CHARS = 200
MAX_SUMMARY_CHARS = 300
#: How much of a dead letter's first error line an incident quotes, and how much of it is read
#: to redact it first (a secret across the cut is hidden before the cut).
MAX_ERROR_CHARS = 300
FETCHED_ERROR_CHARS = 4096
DEFAULT_POLL_SECONDS = 1.0
#: Who the relay says resolved an incident (Better Stack's ``resolved_by``: an e-mail or a
#: custom identifier); an incident resolved by anyone else was resolved by a person.
RESOLVED_BY = "jobfence alert relay"
#: Added to the request timeout: how much older than it a lost attempt must be before the
#: relay looks its dedup key up and may create again.
LOST_ANSWER_MARGIN_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """How the relay groups, escalates, retries and paces itself (seconds throughout).

    ``escalate_after_seconds=None`` turns escalation off. A retryable failure waits
    ``Retry-After`` when the service sent one (at most ``retry_after_cap_seconds``), otherwise
    ``min(retry_base * 2^(attempt-1), retry_cap) * U(0.5, 1)``; a lost answer (no HTTP status:
    timeout, dropped connection) at least ``lost_answer_wait_seconds``, which should exceed the
    request timeout. Heartbeats go out at most once per ``heartbeat_interval_seconds`` (and at
    once when what they report changes): failure while an alert or resolve was refused for good
    or has waited more than ``delivery_bound_seconds``, success otherwise. What the relay knows
    of an incident's state is refreshed from Better Stack when it is older than
    ``state_max_age_seconds`` and a decision depends on it; a growing count is reported as a
    comment at most once per ``update_interval_seconds``.

    Bounds on what a producer can page (docs/operations.md, "Bounded incidents"): a consumer's
    error classes get their own key up to ``max_error_classes`` at a time (a class counts while
    one of its dead letters is pending review), the others share ``(queue, consumer, '*')``;
    dead letters of unknown consumers share ``(queue, '*', '*')``; at most
    ``max_new_incidents`` new incidents open per ``incident_period_seconds`` (a sliding
    window), beyond which one storm incident counts every alert that would have opened one,
    until a whole period passes without such an alert.
    """

    group_window_seconds: float = 60.0
    escalate_after_seconds: float | None = 72 * 3600.0
    poll_seconds: float = DEFAULT_POLL_SECONDS
    retry_base_seconds: float = 2.0
    retry_cap_seconds: float = 300.0
    retry_after_cap_seconds: float = 3600.0
    heartbeat_interval_seconds: float = 30.0
    batch_size: int = 100
    reconnect_cap_seconds: float = 30.0
    state_max_age_seconds: float = 60.0
    update_interval_seconds: float = 600.0
    delivery_bound_seconds: float = 600.0
    lost_answer_wait_seconds: float = 15.0
    max_error_classes: int = 5
    max_new_incidents: int = 10
    incident_period_seconds: float = 600.0

    def __post_init__(self) -> None:
        for name in (
            "group_window_seconds",
            "poll_seconds",
            "state_max_age_seconds",
            "update_interval_seconds",
            "delivery_bound_seconds",
            "lost_answer_wait_seconds",
            "retry_base_seconds",
            "retry_cap_seconds",
            "retry_after_cap_seconds",
            "reconnect_cap_seconds",
            "incident_period_seconds",
        ):
            value = getattr(self, name)
            if not 0 < value <= MAX_DELAY_SECONDS:
                raise ConfigError(
                    f"{name} must be a positive number of seconds, at most {MAX_DELAY_SECONDS:,}"
                    f" ({MAX_DELAY_DAYS:,} days), got {value}"
                )
        if self.escalate_after_seconds is not None and not (
            0 < self.escalate_after_seconds <= MAX_DELAY_SECONDS
        ):
            raise ConfigError(
                "escalate_after_seconds must be a positive number of seconds, at most"
                f" {MAX_DELAY_SECONDS:,} ({MAX_DELAY_DAYS:,} days), or None (off), "
                f"got {self.escalate_after_seconds}"
            )
        if not 0 <= self.heartbeat_interval_seconds < float("inf"):
            raise ConfigError("heartbeat_interval_seconds must be >= 0")
        if self.batch_size < 1:
            raise ConfigError("batch_size must be >= 1")
        if self.max_error_classes < 1:
            raise ConfigError(f"max_error_classes must be >= 1, got {self.max_error_classes}")
        if self.max_new_incidents < 1:
            raise ConfigError(f"max_new_incidents must be >= 1, got {self.max_new_incidents}")


@dataclass
class RelayStats:
    """What this relay did since it started, by alert kind (dead_letters, escalation)."""

    rounds: int = 0
    sent: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    retried: Counter[str] = field(default_factory=Counter)
    cancelled: Counter[str] = field(default_factory=Counter)
    found_existing: int = 0
    opened: int = 0
    merged: int = 0
    updated: int = 0
    resolved: int = 0
    resolved_by_person: int = 0
    escalated: int = 0
    storms: int = 0
    state_checks: int = 0
    heartbeats: int = 0
    heartbeat_failures: int = 0
    heartbeat_ok: bool = True

    def summary(self) -> str:
        return (
            f"sent {sum(self.sent.values())}, failed {sum(self.failed.values())}, "
            f"retries {sum(self.retried.values())}, cancelled {sum(self.cancelled.values())}, "
            f"found already open {self.found_existing}, opened {self.opened}, "
            f"merged {self.merged}, updates {self.updated}, resolved {self.resolved}, "
            f"escalated {self.escalated}, storms {self.storms}"
        )


@dataclass(frozen=True, slots=True)
class _Claimed:
    id: int
    group_id: int
    kind: str
    dedup_key: str
    dead_letters: int
    attempts: int
    storm: bool


@dataclass(frozen=True, slots=True)
class _Group:
    queue: str
    consumer: str
    error_class: str
    scope: str
    window_start: datetime
    window_end: datetime
    dead_letters: int
    still_pending: int
    first_dead_letter_id: int | None
    last_dead_letter_id: int | None
    last_created_at: datetime | None


@dataclass(frozen=True, slots=True)
class _Incident:
    id: int
    incident_id: str
    state: str
    escalated_at: datetime | None
    stale: bool


@dataclass(frozen=True, slots=True)
class _Resolving:
    id: int
    incident_id: str
    queue: str
    consumer: str
    error_class: str
    dead_letters: int
    resolve_attempts: int
    still_pending: int


def _timestamp(text: str | None) -> datetime | None:
    """An ISO 8601 time from Better Stack, or None when absent or unreadable."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a Better Stack API token (never quoting it); None when it can."""
    if not token.strip():
        return "is blank: set it to the Better Stack Uptime API token"
    if any(ch.isspace() or not ch.isprintable() for ch in token):
        return (
            "contains a space, a line break or another control character (a token has none; "
            "was it read from a file with its final newline?)"
        )
    return None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _duration(seconds: float) -> str:
    if seconds >= 86400 and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _trim(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class AlertRelay:
    """Delivers recorded alerts to an :class:`IncidentSink`. Run it as ``jobfence alert-relay``
    or embed it: ``task = asyncio.create_task(relay.run())`` ... ``relay.stop(); await task``.

    ``clock`` (default: the database's clock) decides when windows close and escalations are
    due; tests inject one. ``conninfo`` is a libpq URL: the relay holds one connection of its
    own (the lock lives on it) and reconnects with backoff when it is lost.
    """

    def __init__(
        self,
        conninfo: str,
        sink: IncidentSink,
        *,
        settings: RelaySettings | None = None,
        clock: Clock | None = None,
        heartbeat: Heartbeat | None = None,
        metrics: AlertMetricsSink | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._conninfo = conninfo
        self._sink = sink
        self.settings = settings if settings is not None else RelaySettings()
        self._clock = clock
        self._heartbeat = heartbeat
        self._metrics = metrics
        self._rng = rng if rng is not None else random.Random()
        self._stopping = asyncio.Event()
        self._pause_until = 0.0
        self._next_beat = 0.0
        self._owned: list[Any] = []
        self.stats = RelayStats()
        self.active = False
        # Error texts quoted in an incident leave our systems: what logs never show (configured
        # secrets, those of the database URL, any URL's password or password=-like value) is
        # hidden there too, as in the logs.
        self._redact = Redactor([*secrets_from_env(), *url_secrets(conninfo)])

    @classmethod
    def from_config(
        cls,
        conninfo: str,
        config: AlertConfig,
        *,
        poll_seconds: float | None = None,
        metrics: AlertMetricsSink | None = None,
    ) -> AlertRelay:
        """The relay ``jobfence alert-relay`` runs: Better Stack as configured in the
        environment (see :func:`jobfence.config.alert_config_from_env`). Close it with
        :meth:`aclose` when done."""
        from jobfence.adapters.betterstack import (
            BetterStackHeartbeat,
            BetterStackIncidents,
            BetterStackSettings,
        )
        from jobfence.config import (
            ENV_BETTERSTACK_ALLOW_HTTP,
            ENV_BETTERSTACK_API_URL,
            ENV_BETTERSTACK_REQUESTER_EMAIL,
            ENV_BETTERSTACK_TOKEN,
        )

        if config.token is None:
            raise ConfigError(
                f"{ENV_BETTERSTACK_TOKEN} is not set: the alert relay needs a Better Stack "
                "Uptime API token"
            )
        token_problem = _token_problem(config.token)
        if token_problem is not None:
            raise ConfigError(f"{ENV_BETTERSTACK_TOKEN} {token_problem}")
        if not config.requester_email:
            raise ConfigError(
                f"{ENV_BETTERSTACK_REQUESTER_EMAIL} is not set: with a token, Better Stack "
                "needs the e-mail of the person the relay's incidents are opened for "
                "(requester_email)"
            )
        parts = urlsplit(config.api_url)
        if (
            parts.scheme == "http"
            and not _is_loopback(parts.hostname or "")
            and not config.allow_http
        ):
            raise ConfigError(
                f"{ENV_BETTERSTACK_API_URL} is plain http:// to {parts.hostname}: the token "
                f"would travel in clear text. Use https://, or set {ENV_BETTERSTACK_ALLOW_HTTP}=1 "
                "if the network in between is trusted"
            )
        sink = BetterStackIncidents(
            BetterStackSettings(
                token=config.token,
                api_url=config.api_url,
                requester_email=config.requester_email,
                team_name=config.team_name,
                policy_id=config.policy_id,
                team_wait=config.team_wait,
                call="call" in config.notify,
                sms="sms" in config.notify,
                email="email" in config.notify,
                push="push" in config.notify,
                timeout_seconds=config.timeout_seconds,
            )
        )
        heartbeat = (
            BetterStackHeartbeat(
                config.relay_heartbeat_url,
                name="alert relay",
                timeout_seconds=config.timeout_seconds,
                allow_http=config.allow_http,
            )
            if config.relay_heartbeat_url
            else None
        )
        settings = RelaySettings(
            group_window_seconds=config.group_window_seconds,
            escalate_after_seconds=config.escalate_after_seconds,
            poll_seconds=poll_seconds if poll_seconds is not None else DEFAULT_POLL_SECONDS,
            state_max_age_seconds=config.state_max_age_seconds,
            update_interval_seconds=config.update_interval_seconds,
            delivery_bound_seconds=config.delivery_bound_seconds,
            lost_answer_wait_seconds=config.timeout_seconds + LOST_ANSWER_MARGIN_SECONDS,
            max_error_classes=config.max_error_classes,
            max_new_incidents=config.max_new_incidents,
            incident_period_seconds=config.incident_period_seconds,
        )
        relay = cls(conninfo, sink, settings=settings, heartbeat=heartbeat, metrics=metrics)
        relay._owned = [sink, *([heartbeat] if heartbeat else [])]
        log.info(
            "alert relay: Better Stack at %s, group window %s, escalation %s, at most %d new "
            "incidents per %s, %d error classes per consumer",
            sink.origin,
            _duration(settings.group_window_seconds),
            "off"
            if settings.escalate_after_seconds is None
            else f"after {_duration(settings.escalate_after_seconds)}",
            settings.max_new_incidents,
            _duration(settings.incident_period_seconds),
            settings.max_error_classes,
        )
        return relay

    async def aclose(self) -> None:
        """Close the HTTP clients :meth:`from_config` created (nothing otherwise)."""
        for resource in self._owned:
            await resource.aclose()
        self._owned = []

    def _quoted(self, error_line: str) -> str:
        """A dead letter's error line as an incident quotes it: redacted as a log line is,
        then cut to :data:`MAX_ERROR_CHARS` and escaped. The statement fetched at most
        :data:`FETCHED_ERROR_CHARS` of it; when it was cut there, the word it cut (maybe a piece
        of a secret, which would no longer match) is left out before redacting."""
        if len(error_line) >= FETCHED_ERROR_CHARS:
            error_line = error_line[: max(error_line.rfind(" "), 0)] + " ..."
        return printable(_trim(self._redact(error_line), MAX_ERROR_CHARS))

    def stop(self) -> None:
        """Finish the current step and return from :meth:`run`."""
        self._stopping.set()

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> RelayStats:
        """Deliver until :meth:`stop`. A lost database connection is one outage, logged as two
        lines and retried at least every 2 s; another database error (a permission revoked) is
        logged and retried with backoff (:func:`jobfence.outage_log.stay_connected`); a
        database without this version's schema is refused (``ConfigError``)."""
        await stay_connected(
            self._conninfo,
            self._serve,
            who="alert relay",
            doing=("delivering paused, the alerts wait in their tables", "delivering resumed"),
            log=log,
            stopping=self._stopping,
            reconnect_cap_seconds=self.settings.reconnect_cap_seconds,
            on_lost=self._inactive,
        )
        return self.stats

    def _inactive(self) -> None:
        self.active = False

    async def _serve(self, conn: AsyncConnection[Any]) -> None:
        await ensure_migrated(conn)
        standby_logged = False
        while not await self._try_lock(conn):
            if not standby_logged:
                log.info("alert relay: another relay is active on this database; standing by")
                standby_logged = True
            await self._sleep(self.settings.poll_seconds)
            if self._stopping.is_set():
                return
        self.active = True
        log.info("alert relay active")
        try:
            while not self._stopping.is_set():
                wait = await self.run_round(conn)
                if wait > 0:
                    await self._sleep(wait)
        finally:
            self.active = False
            if not conn.closed and not conn.broken:
                with contextlib.suppress(psycopg.Error):
                    await conn.execute(SQL["relay_unlock"], {"key": RELAY_LOCK_KEY})

    async def _try_lock(self, conn: AsyncConnection[Any]) -> bool:
        cur = await conn.execute(SQL["relay_try_lock"], {"key": RELAY_LOCK_KEY})
        row = await cur.fetchone()
        return bool(row and row[0])

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    def _now(self) -> datetime | None:
        return self._clock.now() if self._clock is not None else None

    async def run_round(self, conn: AsyncConnection[Any]) -> float:
        """One round (group, escalate, deliver, heartbeat) on ``conn``, which must hold the
        relay lock; returns the seconds until the next round is useful."""
        await self._group(conn)
        if self.settings.escalate_after_seconds is not None:
            await self._schedule_escalations(conn, self.settings.escalate_after_seconds)
        await self._request_resolves(conn)
        more = await self._deliver(conn)
        more = await self._resolve_due(conn) or more
        await self._send_updates(conn)
        self.stats.rounds += 1
        if self._metrics is not None:
            self._metrics.alerts_pending((await alert_counts(conn)).pending)
        await self._maybe_heartbeat(await self._healthy(conn))
        return 0.0 if more else await self._until_next(conn)

    async def _until_next(self, conn: AsyncConnection[Any]) -> float:
        cur = await conn.execute(SQL["relay_next_wake"], {"now": self._now()})
        row = await cur.fetchone()
        seconds = row[0] if row else None
        wait = self.settings.poll_seconds
        if seconds is not None:
            wait = min(wait, max(float(seconds), 0.0))
        paused = self._pause_until - asyncio.get_running_loop().time()
        if paused > 0:
            wait = max(wait, min(paused, self.settings.poll_seconds))
        return wait

    # -- grouping and escalation ------------------------------------------------------------

    async def _group(self, conn: AsyncConnection[Any]) -> None:
        now = self._now()
        async with conn.transaction():
            while True:
                cur = await conn.execute(
                    SQL["outbox_classify"],
                    {
                        "unknown_consumer_classes": list(UNKNOWN_CONSUMER_CLASSES),
                        "max_error_classes": self.settings.max_error_classes,
                        "limit": CLASSIFY_BATCH,
                    },
                )
                if len(await cur.fetchall()) < CLASSIFY_BATCH:
                    break
            for _ in range(MAX_GROUPING_PASSES):
                await conn.execute(SQL["group_attach"])
                cur = await conn.execute(SQL["group_close_due"], {"now": now})
                closed = len(await cur.fetchall())
                if closed:
                    log.debug("alert relay: %d group(s) closed", closed)
                cur = await conn.execute(
                    SQL["group_open_new"], {"window_seconds": self.settings.group_window_seconds}
                )
                if not await cur.fetchall():
                    break

    async def _schedule_escalations(self, conn: AsyncConnection[Any], after: float) -> None:
        cur = await conn.execute(
            SQL["escalation_schedule"],
            {
                "now": self._now(),
                "escalate_after_seconds": after,
                "limit": self.settings.batch_size,
            },
        )
        scheduled = len(await cur.fetchall())
        if scheduled:
            log.info("alert relay: %d escalation(s) due (D4)", scheduled)

    # -- delivery ---------------------------------------------------------------------------

    async def _deliver(self, conn: AsyncConnection[Any]) -> bool:
        """Deliver due alerts; True when the batch was full (more may be due)."""
        loop = asyncio.get_running_loop()
        for _ in range(self.settings.batch_size):
            if loop.time() < self._pause_until or self._stopping.is_set():
                return False
            cur = await conn.execute(
                SQL["alert_claim_next"],
                {
                    "now": self._now(),
                    "lost_answer_wait_seconds": self.settings.lost_answer_wait_seconds,
                },
            )
            row = await cur.fetchone()
            if row is None:
                return False
            await self._deliver_one(conn, _Claimed(*row))
        return True

    async def _deliver_one(self, conn: AsyncConnection[Any], alert: _Claimed) -> None:
        group = await self._group_context(conn, alert.group_id)
        request = await self._request(conn, alert, group)
        try:
            if alert.attempts > 1:
                # An earlier request may have reached Better Stack before a crash or timeout.
                found = await self._sink.find_incident(alert.dedup_key)
                if found is not None:
                    self.stats.found_existing += 1
                    log.info(
                        "alert %d: incident %s was opened by an earlier attempt; recording it",
                        alert.id,
                        found,
                    )
                    await self._record_sent(conn, alert, found, request, "found")
                    return
            if alert.kind == "escalation" and group.still_pending == 0:
                await self._cancel(conn, alert)
                return
            current = None
            if alert.kind == "escalation":
                current = await self._unresolved_incident(
                    conn, "incident_unresolved_of_group", alert.group_id
                )
            if current is None:
                current = await self._unresolved_incident(
                    conn, "incident_unresolved_for_key", alert.group_id
                )
            if current is None and (alert.storm or await self._storm_under_way(conn)):
                # Beyond the cap of new incidents: counted on the storm incident instead.
                current = await self._unresolved_incident(conn, "incident_unresolved_storm", None)
                if current is None:
                    if not alert.storm:
                        await conn.execute(SQL["alert_mark_storm"], {"id": alert.id})
                        alert = replace(alert, storm=True)
                    request = await self._storm_request(conn, alert, group)
            if current is not None and alert.kind == "dead_letters":
                await self._record_merged(conn, alert, current)
                return
            if current is not None:
                await self._escalate(conn, alert, current)
                return
            incident_id = await self._sink.create_incident(request)
        except DeliveryError as exc:
            await self._delivery_failed(conn, alert, exc)
            return
        except Exception as exc:  # a defect in a sink: keep the alert, retry later, loudly
            log.exception("alert %d: unexpected error from the incident sink", alert.id)
            await self._delivery_failed(
                conn, alert, DeliveryError(f"{type(exc).__name__}: {exc}", retryable=True)
            )
            return
        await self._record_sent(conn, alert, incident_id, request, "opened")

    async def _storm_under_way(self, conn: AsyncConnection[Any]) -> bool:
        """Whether a new incident must not open now (see :class:`RelaySettings`)."""
        cur = await conn.execute(
            SQL["storm_under_way"],
            {
                "now": self._now(),
                "period_seconds": self.settings.incident_period_seconds,
                "max_new": self.settings.max_new_incidents,
            },
        )
        row = await cur.fetchone()
        return bool(row and row[0])

    async def _unresolved_incident(
        self, conn: AsyncConnection[Any], query: str, group_id: int | None
    ) -> _Incident | None:
        """The incident ``query`` finds that is not resolved (the key's, the one the group's
        alert was counted on, the storm's), its state confirmed by Better Stack when what we
        know is older than ``state_max_age``; None when there is none (any more)."""
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                SQL[query],
                {
                    "group_id": group_id,
                    "now": self._now(),
                    "max_age_seconds": self.settings.state_max_age_seconds,
                },
            )
            row = await cur.fetchone()
        if row is None:
            return None
        incident = _Incident(**row)
        if not incident.stale:
            return incident
        self.stats.state_checks += 1
        try:
            state = await self._sink.get_incident(incident.incident_id)
        except DeliveryError as exc:
            if exc.status != 404:
                raise
            state = IncidentState(incident.incident_id, resolved_by="deleted in Better Stack")
            await self._record_resolved(conn, incident.id, state, gone=True)
            return None
        if state.resolved:
            await self._record_resolved(conn, incident.id, state)
            return None
        await conn.execute(
            SQL["incident_checked"],
            {
                "id": incident.id,
                "now": self._now(),
                "acknowledged_at": _timestamp(state.acknowledged_at),
                "acknowledged_by": state.acknowledged_by,
            },
        )
        return incident

    async def _escalate(
        self, conn: AsyncConnection[Any], alert: _Claimed, incident: _Incident
    ) -> None:
        """D4 on the key's unresolved incident: escalate it (once per incident)."""
        already = incident.escalated_at is not None
        if not already:
            try:
                await self._sink.escalate_incident(incident.incident_id)
            except DeliveryError as exc:
                if exc.status in (404, 409):
                    # Resolved (or gone) since we looked: look again, then try again soon;
                    # the next attempt opens a new incident if it is resolved.
                    await conn.execute(SQL["incident_checked_expire"], {"id": incident.id})
                    raise DeliveryError(str(exc), retryable=True, status=exc.status) from None
                raise
        await self._record_escalated(conn, alert, incident, already=already)

    async def _record_escalated(
        self, conn: AsyncConnection[Any], alert: _Claimed, incident: _Incident, *, already: bool
    ) -> None:
        await conn.execute(
            SQL["alert_mark_escalated"],
            {
                "alert_id": alert.id,
                "id": incident.id,
                "incident_id": incident.incident_id,
                "now": self._now(),
            },
        )
        self.stats.sent[alert.kind] += 1
        if self._metrics is not None:
            self._metrics.alert_sent(alert.kind)
        if already:
            log.info(
                "escalation %d: incident %s was escalated already (once per incident)",
                alert.id,
                incident.incident_id,
            )
            return
        self.stats.escalated += 1
        if self._metrics is not None:
            self._metrics.incident_action("escalated")
        log.info(
            "Better Stack incident %s escalated (D4, alert %d)", incident.incident_id, alert.id
        )

    async def _record_merged(
        self, conn: AsyncConnection[Any], alert: _Claimed, incident: _Incident
    ) -> None:
        cur = await conn.execute(
            SQL["alert_mark_merged"],
            {
                "alert_id": alert.id,
                "id": incident.id,
                "incident_id": incident.incident_id,
                "now": self._now(),
            },
        )
        row = await cur.fetchone()
        self.stats.sent[alert.kind] += 1
        self.stats.merged += 1
        if self._metrics is not None:
            self._metrics.alert_sent(alert.kind)
            self._metrics.incident_action("merged")
        log.info(
            "alert %d: %s counted on the open incident %s (%s in all); no new incident",
            alert.id,
            _plural(alert.dead_letters, "dead letter"),
            incident.incident_id,
            row[0] if row else "?",
        )

    async def _record_resolved(
        self,
        conn: AsyncConnection[Any],
        incident_row_id: int,
        state: IncidentState,
        *,
        gone: bool = False,
    ) -> None:
        by_relay = not gone and state.resolved_by in (None, RESOLVED_BY)
        cur = await conn.execute(
            SQL["incident_mark_resolved"],
            {
                "id": incident_row_id,
                "now": self._now(),
                "resolved_at": None,
                "resolved_by": state.resolved_by or RESOLVED_BY,
                "resolution": "jobfence" if by_relay else "person",
            },
        )
        if await cur.fetchone() is None:
            return
        if by_relay:
            self.stats.resolved += 1
        else:
            self.stats.resolved_by_person += 1
        if self._metrics is not None:
            self._metrics.incident_action("resolved" if by_relay else "resolved_by_person")
        log.info(
            "Better Stack incident %s resolved by %s",
            state.incident_id,
            "the relay" if by_relay else (state.resolved_by or "a person"),
        )

    # -- resolving ----------------------------------------------------------------------------

    async def _request_resolves(self, conn: AsyncConnection[Any]) -> None:
        cur = await conn.execute(SQL["incident_resolve_request"], {"now": self._now()})
        requested = len(await cur.fetchall())
        if requested:
            log.info(
                "alert relay: %d incident(s) to resolve (every dead letter replayed or discarded)",
                requested,
            )

    async def _resolve_due(self, conn: AsyncConnection[Any]) -> bool:
        """Resolve the due incidents; True when the batch was full."""
        loop = asyncio.get_running_loop()
        for _ in range(self.settings.batch_size):
            if loop.time() < self._pause_until or self._stopping.is_set():
                return False
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(SQL["incident_resolve_claim"], {"now": self._now()})
                row = await cur.fetchone()
            if row is None:
                return False
            await self._resolve_one(conn, _Resolving(**row))
        return True

    async def _resolve_one(self, conn: AsyncConnection[Any], item: _Resolving) -> None:
        if item.still_pending > 0:
            await conn.execute(SQL["incident_resolve_cancel"], {"id": item.id})
            log.info(
                "incident %s stays open: %s of its key arrived since",
                item.incident_id,
                _plural(item.still_pending, "dead letter"),
            )
            return
        try:
            state = await self._sink.resolve_incident(item.incident_id, RESOLVED_BY)
        except DeliveryError as exc:
            if exc.status == 404:
                gone = IncidentState(item.incident_id, resolved_by="deleted in Better Stack")
                await self._record_resolved(conn, item.id, gone, gone=True)
                return
            await self._resolve_failed(conn, item, exc)
            return
        await self._record_resolved(conn, item.id, state)

    async def _resolve_failed(
        self, conn: AsyncConnection[Any], item: _Resolving, exc: DeliveryError
    ) -> None:
        if self._metrics is not None:
            self._metrics.alert_failed("resolve", exc.reason)
        if exc.retryable:
            delay = self._retry_delay(item.resolve_attempts, exc.retry_after)
            await conn.execute(
                SQL["incident_resolve_retry"],
                {"id": item.id, "now": self._now(), "delay_seconds": delay, "error": str(exc)},
            )
            self._pause_until = asyncio.get_running_loop().time() + delay
            log.warning(
                "incident %s not resolved on attempt %d: %s; retrying in %.1fs",
                item.incident_id,
                item.resolve_attempts,
                exc,
                delay,
            )
            return
        await conn.execute(SQL["incident_resolve_refused"], {"id": item.id, "error": str(exc)})
        log.error(
            "resolving incident %s REFUSED and not retried: %s. Fix the Better Stack settings, "
            "then run `jobfence alert-relay --retry-failed`",
            item.incident_id,
            exc,
        )

    # -- updates ------------------------------------------------------------------------------

    async def _send_updates(self, conn: AsyncConnection[Any]) -> None:
        loop = asyncio.get_running_loop()
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                SQL["incident_updates_due"],
                {
                    "now": self._now(),
                    "update_interval_seconds": self.settings.update_interval_seconds,
                    "limit": self.settings.batch_size,
                },
            )
            rows = await cur.fetchall()
        for row in rows:
            if loop.time() < self._pause_until or self._stopping.is_set():
                return
            total = int(row["dead_letters"])
            new = total - int(row["reported_dead_letters"])
            if row["scope"] == "storm":
                content = await self._storm_update(conn, str(row["incident_id"]), total, new)
            else:
                consumer = printable(row["consumer"])
                where = f"consumer {consumer} ({printable(row['error_class'])})"
                if row["scope"] == "unknown_consumers":
                    where = "consumers that are not registered"
                elif row["scope"] == "other_error_classes":
                    where = f"consumer {consumer} (other error classes)"
                content = (
                    f"jobfence: {_plural(total, 'dead letter')} so far on queue "
                    f"{printable(row['queue'])}, {where}, {new} since the last count. This"
                    " incident stays "
                    "open until every one is replayed or discarded (runbook: "
                    "dead-letter-replay); it is then resolved automatically."
                )
            reported: int | None = total
            try:
                await self._sink.comment_incident(str(row["incident_id"]), content)
            except DeliveryError as exc:
                reported = None  # tried again one interval later
                if self._metrics is not None:
                    self._metrics.alert_failed("update", exc.reason)
                log.warning("incident %s: update not sent: %s", row["incident_id"], exc)
            await conn.execute(
                SQL["incident_mark_updated"],
                {"id": row["id"], "now": self._now(), "reported": reported},
            )
            if reported is not None:
                self.stats.updated += 1
                if self._metrics is not None:
                    self._metrics.incident_action("updated")

    async def _storm_update(
        self, conn: AsyncConnection[Any], incident_id: str, total: int, new: int
    ) -> str:
        cur = await conn.execute(
            SQL["storm_breakdown"], {"incident_id": incident_id, "limit": STORM_BREAKDOWN_KEYS}
        )
        rows = await cur.fetchall()
        lines = [
            f"jobfence: alert storm: {_plural(total, 'dead letter')} counted here so far, "
            f"{new} since the last count. Largest keys:"
        ]
        lines += [
            f"- queue {printable(queue)}, consumer {printable(consumer)}, error class"
            f" {printable(error_class)}: "
            f"{_plural(int(count), 'dead letter')} in {_plural(int(alerts), 'group')}"
            for queue, consumer, error_class, _scope, count, alerts in rows
        ]
        lines.append(
            "This incident stays open until every one is replayed or discarded (runbook: "
            "dead-letter-replay); it is then resolved automatically."
        )
        return "\n".join(lines)

    async def _cancel(self, conn: AsyncConnection[Any], alert: _Claimed) -> None:
        """An escalation whose dead letters were all resolved before it went out (D4: never
        escalate resolved ones)."""
        await conn.execute(
            SQL["alert_mark_cancelled"],
            {
                "id": alert.id,
                "now": self._now(),
                "reason": "every dead letter of the group was resolved before it went out",
            },
        )
        self.stats.cancelled[alert.kind] += 1
        log.info("escalation %d cancelled: its dead letters were all resolved", alert.id)

    async def _record_sent(
        self,
        conn: AsyncConnection[Any],
        alert: _Claimed,
        incident_id: str,
        request: IncidentRequest,
        outcome: str = "opened",
    ) -> None:
        """The alert opened ``incident_id`` (or found it opened by an earlier attempt): it
        becomes the key's unresolved incident (the storm's, for a storm alert), in the same
        transaction."""
        async with conn.transaction():
            await conn.execute(
                SQL["alert_mark_sent"],
                {
                    "id": alert.id,
                    "incident_id": incident_id,
                    "outcome": outcome,
                    "now": self._now(),
                },
            )
            await conn.execute(
                SQL["incident_register"],
                {
                    "group_id": alert.group_id,
                    "incident_id": incident_id,
                    "alert_id": alert.id,
                    "dead_letters": alert.dead_letters,
                    "storm": alert.storm,
                    "now": self._now(),
                },
            )
        self.stats.sent[alert.kind] += 1
        self.stats.opened += 1
        if alert.storm:
            self.stats.storms += 1
            if self._metrics is not None:
                self._metrics.incident_action("storm")
        if self._metrics is not None:
            self._metrics.alert_sent(alert.kind)
            self._metrics.incident_action("opened")
        log.info("Better Stack incident %s: %s", incident_id, request.name)

    async def _delivery_failed(
        self, conn: AsyncConnection[Any], alert: _Claimed, exc: DeliveryError
    ) -> None:
        if exc.retryable:
            delay = self._retry_delay(alert.attempts, exc.retry_after)
            if exc.status is None:
                # The answer was lost: Better Stack may still be working on the request. The
                # next attempt looks the dedup key up; it waits until this one is surely over.
                delay = max(delay, self.settings.lost_answer_wait_seconds)
            await conn.execute(
                SQL["alert_mark_retry"],
                {"id": alert.id, "now": self._now(), "delay_seconds": delay, "error": str(exc)},
            )
            # The service is down or rate-limiting: every delivery waits, not just this one.
            self._pause_until = asyncio.get_running_loop().time() + delay
            self.stats.retried[alert.kind] += 1
            if self._metrics is not None:
                self._metrics.alert_failed(alert.kind, exc.reason)
            log.warning(
                "alert %d (%s) not delivered on attempt %d: %s; retrying in %.1fs",
                alert.id,
                alert.kind,
                alert.attempts,
                exc,
                delay,
            )
            return
        await conn.execute(
            SQL["alert_mark_failed"], {"id": alert.id, "now": self._now(), "error": str(exc)}
        )
        self.stats.failed[alert.kind] += 1
        if self._metrics is not None:
            self._metrics.alert_failed(alert.kind, exc.reason)
        log.error(
            "alert %d (%s, %s) REFUSED and not retried: %s. Fix the Better Stack settings, then "
            "run `jobfence alert-relay --retry-failed` to send the failed alerts again",
            alert.id,
            alert.kind,
            _plural(alert.dead_letters, "dead letter"),
            exc,
        )

    def _retry_delay(self, attempts: int, retry_after: float | None) -> float:
        s = self.settings
        if retry_after is not None and retry_after > 0:
            return min(retry_after, s.retry_after_cap_seconds)
        exponent = min(max(attempts - 1, 0), 30)
        nominal = min(s.retry_base_seconds * float(2**exponent), s.retry_cap_seconds)
        return nominal * self._rng.uniform(0.5, 1.0)

    async def _healthy(self, conn: AsyncConnection[Any]) -> bool:
        """Whether delivery works: nothing refused for good, nothing waiting longer than
        ``delivery_bound``."""
        cur = await conn.execute(SQL["relay_health"], {"now": self._now()})
        row = await cur.fetchone()
        assert row is not None
        refused, oldest_waiting = row
        if self._metrics is not None:
            self._metrics.alerts_refused(int(refused))
        ok = int(refused) == 0 and (
            oldest_waiting is None or float(oldest_waiting) <= self.settings.delivery_bound_seconds
        )
        if ok != self.stats.heartbeat_ok:
            if ok:
                log.info("alert relay: delivery works again; the heartbeat reports success")
            else:
                log.error(
                    "alert relay: the heartbeat reports FAILURE: %s refused for good, oldest "
                    "waiting %s (bound %s). See the runbook dead-letter-replay",
                    _plural(int(refused), "alert"),
                    "none" if oldest_waiting is None else f"{float(oldest_waiting):.0f}s",
                    _duration(self.settings.delivery_bound_seconds),
                )
        return ok

    async def _maybe_heartbeat(self, ok: bool) -> None:
        changed = ok != self.stats.heartbeat_ok
        self.stats.heartbeat_ok = ok
        if self._metrics is not None:
            self._metrics.heartbeat_state(ok)
        if self._heartbeat is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_beat and not changed:
            return
        self._next_beat = loop.time() + self.settings.heartbeat_interval_seconds
        if await self._heartbeat.beat(ok):
            self.stats.heartbeats += 1
        else:
            self.stats.heartbeat_failures += 1

    # -- what an incident says ----------------------------------------------------------------

    async def _group_context(self, conn: AsyncConnection[Any], group_id: int) -> _Group:
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(SQL["alert_group_context"], {"group_id": group_id})
            row = await cur.fetchone()
        assert row is not None, f"alert group {group_id} vanished"
        # Shown in incidents: a name stored from a message jobfence could not fence may hold
        # any character; escaped, as in the logs (jobfence.redact.printable).
        for key in ("queue", "consumer", "error_class"):
            row[key] = printable(row[key])
        return _Group(**row)

    async def _request(
        self, conn: AsyncConnection[Any], alert: _Claimed, group: _Group
    ) -> IncidentRequest:
        escalation = alert.kind == "escalation"
        cur = await conn.execute(
            SQL["alert_group_samples"],
            {
                "group_id": alert.group_id,
                "pending_only": escalation,
                "limit": SAMPLE_DEAD_LETTERS,
                "chars": FETCHED_ERROR_CHARS,
            },
        )
        samples = await cur.fetchall()
        where = f"{group.queue}/{group.consumer}"
        what = f"consumer {group.consumer} ({group.error_class})"
        if group.scope == "unknown_consumers":
            where = f"{group.queue} (unknown consumers)"
            what = "consumers that are not registered (any name)"
        elif group.scope == "other_error_classes":
            what = (
                f"consumer {group.consumer} (error classes beyond its first "
                f"{self.settings.max_error_classes})"
            )
        if escalation:
            count = group.still_pending
            delay = self.settings.escalate_after_seconds  # None: turned off after scheduling
            after = _duration(delay) if delay else "the escalation delay"
            dead = _plural(count, "dead letter")
            name = f"jobfence: {dead} still pending review after {after} on {where}"
            summary = (
                f"Escalation: {dead} of queue {group.queue}, {what} still pending review "
                f"after {after}"
            )
            opening = (
                f"{dead} of {group.dead_letters} in this group (queue {group.queue}, {what}) "
                f"are still pending review more than {after} after they were written. They "
                "were alerted once already; this is the one escalation (D4)."
            )
        else:
            count = alert.dead_letters
            dead = _plural(count, "dead letter")
            if group.scope == "error_class":
                name = f"jobfence: {dead} on {where} ({group.error_class})"
            elif group.scope == "other_error_classes":
                name = f"jobfence: {dead} on {where} (other error classes)"
            else:
                name = f"jobfence: {dead} on {where}"
            summary = f"{dead} on queue {group.queue}, {what}"
            if group.scope == "error_class":
                summary = (
                    f"{dead} on queue {group.queue}, consumer {group.consumer}: {group.error_class}"
                )
            opening = (
                f"{dead} of queue {group.queue}, {what}, written between "
                f"{group.window_start.isoformat()} and "
                f"{(group.last_created_at or group.window_start).isoformat()} (grouping "
                f"window {_duration(self.settings.group_window_seconds)})."
            )
            if group.scope == "unknown_consumers":
                opening += (
                    " Every consumer name that is not registered shares this one incident per "
                    "queue: the name is the producer's choice."
                )
            elif group.scope == "other_error_classes":
                opening += (
                    f" The consumer already has {self.settings.max_error_classes} error classes "
                    "with an incident of their own: the others share this one (their classes "
                    "are in the lines below and in the dead letters)."
                )
        lines = [
            opening,
            "",
            "They wait for review: replay or discard them (runbook: dead-letter-replay).",
            f"Dead letter ids {group.first_dead_letter_id} to {group.last_dead_letter_id}.",
            "",
            "First of them:" if samples else "",
        ]
        lines += [
            f"- #{dl_id} job {printable(job_id)}, {_plural(attempts, 'attempt')}:"
            f" {self._quoted(error)}" + (f" (trace {trace_id})" if trace_id else "")
            for dl_id, job_id, attempts, error, trace_id in samples
        ]
        metadata = {
            "jobfence_alert": alert.kind,
            "queue": group.queue,
            "consumer": group.consumer,
            "error_class": group.error_class,
            "scope": group.scope,
            "dead_letters": str(count),
        }
        return IncidentRequest(
            dedup_key=alert.dedup_key,
            name=_trim(name, MAX_NAME_CHARS),
            summary=_trim(summary, MAX_SUMMARY_CHARS),
            description="\n".join(lines).strip(),
            metadata=metadata,
        )

    async def _storm_request(
        self, conn: AsyncConnection[Any], alert: _Claimed, group: _Group
    ) -> IncidentRequest:
        """The one incident that says an alert storm is under way, with the counts."""
        s = self.settings
        cur = await conn.execute(
            SQL["storm_under_way"],
            {
                "now": self._now(),
                "period_seconds": s.incident_period_seconds,
                "max_new": s.max_new_incidents,
            },
        )
        row = await cur.fetchone()
        opened = int(row[1]) if row else 0
        count = alert.dead_letters if alert.kind == "dead_letters" else group.still_pending
        dead = _plural(count, "dead letter")
        period = _duration(s.incident_period_seconds)
        name = f"jobfence: alert storm: over {s.max_new_incidents} new incidents in {period}"
        summary = (
            f"Alert storm: {_plural(opened, 'incident')} opened in the last {period} (the cap "
            f"is {s.max_new_incidents}); no new incident opens until {period} pass without "
            "one. Every further group is counted here."
        )
        lines = [
            summary,
            "",
            f"First counted here: {dead} of queue {group.queue}, consumer {group.consumer}, "
            f"error class {group.error_class}. Each group counted later is added to this "
            f"incident's count and reported in its comments (at most once per "
            f"{_duration(s.update_interval_seconds)}), with the largest keys.",
            "",
            "The dead letters wait for review: replay or discard them (runbook: "
            "dead-letter-replay); this incident is resolved once every one of them is.",
        ]
        return IncidentRequest(
            dedup_key=alert.dedup_key,
            name=_trim(name, MAX_NAME_CHARS),
            summary=_trim(summary, MAX_SUMMARY_CHARS),
            description="\n".join(lines),
            metadata={
                "jobfence_alert": "storm",
                "queue": ANY,
                "consumer": ANY,
                "error_class": ANY,
                "scope": "storm",
                "dead_letters": str(count),
                "new_incidents_in_period": str(opened),
            },
        )


async def retry_failed_alerts(conn: AsyncConnection[Any], *, clock: Clock | None = None) -> int:
    """Put every failed alert (and every refused resolve) back to pending, after fixing what
    made Better Stack refuse them; returns how many. Their earlier attempts count: the relay
    looks for an existing incident before creating one."""
    now = clock.now() if clock is not None else None
    cur = await conn.execute(SQL["alerts_retry_failed"], {"now": now})
    alerts = len(await cur.fetchall())
    cur = await conn.execute(SQL["incidents_retry_refused"], {"now": now})
    return alerts + len(await cur.fetchall())
