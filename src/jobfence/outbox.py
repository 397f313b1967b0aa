"""The transactional outbox: jobs for an external queue, written in the caller's transaction.

A broker (RabbitMQ, NATS, Redis) cannot join a PostgreSQL transaction. So when this database's
queue is external (``jobfence.settings``, set by :func:`record_queue`), every producer writes a
``jobfence.outbox`` row in the caller's own transaction instead of a queue row: the job exists
exactly when that transaction commits, as with the PostgreSQL queue. A replay writes its outbox
row in the transaction that moves the dead letter to ``replayed``.

The :class:`OutboxRelay` then publishes the rows, oldest first, with no transaction open while
the broker works: a short transaction claims a batch of due rows (``claimed_until``), the relay
publishes them with the :class:`~jobfence.ports.QueuePort`'s ``publish_many`` (their confirms
outstanding together; ``None`` for a message means the broker confirmed it), and a second short
transaction deletes the confirmed rows. A relay that dies after a publish and before that
delete leaves the rows in place, and the next relay publishes them again: at least once, and
the fence (``core.processed_jobs``) makes a duplicate delivery a skipped duplicate. A broker
that is unreachable is one outage (the relay backs off as a whole and probes it); a message the
broker refuses for good becomes a dead letter (``PublishRefused``); nothing is dropped.

A message can wait in the outbox until a given time (``due_at``): a delayed enqueue does, and
on a broker without native delayed retry (``capabilities.delayed_retry`` False: RabbitMQ, Redis
Streams) so does a retry with a delay. The harness writes it with :func:`schedule`, carrying the
deliveries the job already had (``prior_attempts``), commits, and only then acks the delivery;
the relay publishes it when due with ``publish(..., prior_attempts=...)``, so the retry waits in
PostgreSQL rather than in a busy loop or a broker plugin and its attempt count goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Protocol

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import dict_row

from jobfence import tracing
from jobfence._sql import Queries
from jobfence.adapters._shared import check_prior_attempts
from jobfence.alerts.outbox import record_dead_letter_alerts
from jobfence.codec import kept_whole, stored_payload, unfenceable
from jobfence.errors import ConfigError, PublishRefused, QueueUnavailable
from jobfence.limits import (
    MAX_PRIOR_ATTEMPTS,
    UNFENCEABLE,
    checked_delay,
    shown_value,
    storable_text,
)
from jobfence.model import Message, Outgoing
from jobfence.outage_log import stay_connected
from jobfence.ports import Clock, QueuePort
from jobfence.redact import redact_text
from jobfence.schema import ensure_migrated
from jobfence.tracing import valid_traceparent, valid_tracestate

log = logging.getLogger("jobfence.outbox")

SQL = Queries("jobfence.sql", "outbox.sql")
NOTIFY_CHANNEL = "jobfence_outbox"
# Session advisory lock of the active outbox relay ("jfoutbox"); distinct from the others.
RELAY_LOCK_KEY = 0x6A666F7574626F78
POSTGRESQL = "postgresql"


class OutboxMetricsSink(Protocol):
    """Where the outbox relay reports: messages published, failed publishes, and the rows
    waiting with the age of the oldest (as the relay last saw them). Never a job id."""

    def outbox_published(self, count: int) -> None: ...

    def outbox_failed(self) -> None: ...

    def outbox_waiting(self, count: int, oldest_age_seconds: float) -> None: ...


def _params(
    message: Message, delay_seconds: float, clock: Clock | None, prior_attempts: int
) -> dict[str, object]:
    check_prior_attempts(prior_attempts)
    return {
        "queue": message.queue,
        "consumer": message.consumer,
        "job_id": message.job_id,
        "body": message.body,
        "tenant_id": message.tenant_id,
        "correlation_id": message.correlation_id,
        "traceparent": message.traceparent,
        "tracestate": message.tracestate,
        "now": clock.now() if clock is not None else None,
        "delay": timedelta(seconds=checked_delay(delay_seconds)),
        "prior_attempts": prior_attempts,
    }


async def write(
    conn: AsyncConnection[Any],
    message: Message,
    *,
    delay_seconds: float = 0.0,
    prior_attempts: int = 0,
    clock: Clock | None = None,
) -> int:
    """Write ``message`` to the outbox on ``conn``, never committing it; returns the row's id.

    Inside the caller's transaction the message goes out exactly when that transaction
    commits, and never if it rolls back. The relay publishes it once ``delay_seconds`` have
    passed, with ``prior_attempts`` (the deliveries its job already had): its first delivery
    has attempt ``prior_attempts + 1``."""
    cur = await conn.execute(
        SQL["outbox_insert"], _params(message, delay_seconds, clock, prior_attempts)
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def schedule(
    conn: AsyncConnection[Any],
    message: Message,
    delay: float | timedelta,
    *,
    prior_attempts: int = 0,
    clock: Clock | None = None,
) -> int:
    """Publish ``message`` to the external queue ``delay`` from now, through PostgreSQL.

    A delayed retry on a broker without native delay (``capabilities.delayed_retry`` False):
    the harness writes it here with ``prior_attempts=delivery.attempt``, commits, then acks the
    delivery; the relay publishes it when it falls due, and its delivery has the next attempt.
    Same as :func:`write` with ``delay_seconds``; never commits ``conn``."""
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    return await write(
        conn, message, delay_seconds=seconds, prior_attempts=prior_attempts, clock=clock
    )


async def withdraw(conn: AsyncConnection[Any], row_id: int) -> bool:
    """Delete outbox row ``row_id`` if the relay has not published it and is not publishing it
    now; True when it was deleted. For a retry written for a delivery whose ack then said its
    lease was lost: the job belongs to the delivery that holds it now."""
    cur = await conn.execute(SQL["outbox_withdraw"], {"id": row_id})
    return await cur.fetchone() is not None


@dataclass(frozen=True, slots=True)
class OutboxCounts:
    """Rows waiting in the outbox (``due`` of them publishable now), and how long the
    longest-waiting publishable row has waited since it first fell due."""

    waiting: int
    due: int
    oldest_age_seconds: float


async def outbox_counts(conn: AsyncConnection[Any], *, clock: Clock | None = None) -> OutboxCounts:
    cur = await conn.execute(
        SQL["outbox_counts"], {"now": clock.now() if clock is not None else None}
    )
    row = await cur.fetchone()
    assert row is not None
    waiting, oldest, due = row
    return OutboxCounts(waiting=int(waiting), due=int(due), oldest_age_seconds=float(oldest))


# -- where this database's jobs go ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueueSetting:
    """``kind`` is ``postgresql`` (the queue table in this database) or an external broker's
    kind (``rabbitmq``, ``nats``, ``redis``); ``location`` its URL without the
    password, for people."""

    kind: str
    location: str | None

    @property
    def external(self) -> bool:
        return self.kind != POSTGRESQL


async def queue_setting(conn: AsyncConnection[Any]) -> QueueSetting:
    cur = await conn.execute(SQL["queue_setting"])
    row = await cur.fetchone()
    assert row is not None
    return QueueSetting(kind=row[0], location=row[1])


async def external_after_moves(conn: AsyncConnection[Any]) -> bool:
    """Whether this database's jobs go to an external queue, read in the transaction open on
    ``conn`` once a move away from the PostgreSQL queue is over (``jobfence migrate
    --queue-url`` locks its table while it changes the record): what a write to the queue
    table must check first. The lock is held to the commit, so no such move starts before
    then either."""
    cur = await conn.execute(SQL["queue_kind_after_moves"])
    row = await cur.fetchone()
    assert row is not None
    return bool(row[0] != POSTGRESQL)


async def record_queue(conn: AsyncConnection[Any], kind: str, location: str | None) -> str:
    """Make ``kind`` where this database's producers send jobs; returns the kind before.

    The low-level write under :func:`jobfence.queue_record.move_queue` (which also checks a broker
    left behind): moving away from a queue is refused (:class:`~jobfence.errors.ConfigError`)
    while that queue still holds messages in this database (the PostgreSQL queue's table, or
    the outbox), and ``memory`` is never recorded."""
    try:
        cur = await conn.execute(SQL["queue_set"], {"kind": kind, "location": location})
    except (
        psycopg.errors.ObjectNotInPrerequisiteState,
        psycopg.errors.InvalidParameterValue,
    ) as exc:
        raise ConfigError(exc.diag.message_primary or str(exc)) from None
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def broker_queues(conn: AsyncConnection[Any]) -> list[str]:
    """The queues the outbox relay published to on this database's broker (what a move away
    from a broker that cannot list its queues counts)."""
    cur = await conn.execute(SQL["broker_queues"])
    return [str(row[0]) for row in await cur.fetchall()]


# -- the relay --------------------------------------------------------------------------------

# Error classes of the dead letters the relay writes: a message the broker refuses for good, and
# one whose publishes kept failing (the broker answered each time, so it is not an outage).
PUBLISH_REFUSED = "PublishRefused"
PUBLISH_FAILED = "PublishFailed"
_STILL_DOWN_EVERY = 30.0  # seconds between two "broker still unavailable" lines
_UNRECORDED = object()


@dataclass(frozen=True, slots=True)
class OutboxRelaySettings:
    """How the relay paces itself (seconds).

    - ``batch_size``: rows claimed and published together, their confirms outstanding at once.
    - A message whose publish fails while the broker answers (not an outage) waits
      ``min(retry_base * 2^(n-1), retry_cap) * U(0.5, 1)`` after its n-th failure (its row's
      own count), and becomes a dead letter (``PublishFailed``) at the
      ``max_publish_failures``-th.
    - A broker that is unreachable is one outage: the relay stops publishing and probes it with
      one message after ``min(retry_base * 2^(k-1), probe_cap) * U(0.5, 1)`` (k: failed
      probes so far), so it is used again within ``probe_cap`` of its return.
    - ``claim_seconds``: how long a claimed row is left to the relay that claimed it (a relay
      that takes over clears the claims at once).
    """

    batch_size: int = 500
    poll_seconds: float = 1.0
    retry_base_seconds: float = 0.5
    retry_cap_seconds: float = 30.0
    reconnect_cap_seconds: float = 30.0
    probe_cap_seconds: float = 2.0
    claim_seconds: float = 30.0
    max_publish_failures: int = 10

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_publish_failures < 1:
            raise ConfigError(f"max_publish_failures must be >= 1, got {self.max_publish_failures}")
        for name in (
            "poll_seconds",
            "retry_base_seconds",
            "retry_cap_seconds",
            "reconnect_cap_seconds",
            "probe_cap_seconds",
            "claim_seconds",
        ):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")


@dataclass
class OutboxRelayStats:
    """``failed``: failed publish attempts (a batch or a probe that met a broker outage counts
    once; a message that failed on its own, once each). ``dead_lettered``: messages the broker
    refused for good, or that failed ``max_publish_failures`` times."""

    rounds: int = 0
    published: int = 0
    failed: int = 0
    dead_lettered: int = 0
    outages: int = 0

    def summary(self) -> str:
        return (
            f"published {self.published}, failed publishes {self.failed}, dead letters"
            f" {self.dead_lettered}, broker outages {self.outages}"
        )


@dataclass(slots=True)
class _Outage:
    since: float  # loop time
    failed_probes: int = 0
    failed_attempts: int = 1
    next_still_down: float = 0.0


def _error_text(exc: BaseException) -> str:
    """Stored and logged: a broker client's error may quote its URL."""
    return redact_text(" ".join(f"{type(exc).__name__}: {exc}".split()))[:500]


def _id_array(ids: list[int]) -> str:
    """``ids`` as a PostgreSQL array literal, which the statements cast to ``bigint[]``:
    cheaper than adapting a list of ints element by element."""
    return "{" + ",".join(map(str, ids)) + "}"


class _Unfenceable(Exception):
    """A claimed row whose identifiers break jobfence's limits (written straight into the
    outbox, past the producers' checks): no worker could take it, and a broker may not even
    carry it (a subject over NATS's control line closes the connection), so it is never
    published; it becomes an ``UnfenceableMessage`` dead letter, kept whole, as a worker would
    make it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _unfenceable(message: Message) -> _Unfenceable | None:
    reason = unfenceable(message)
    return None if reason is None else _Unfenceable(reason)


def _outgoing(row: dict[str, Any]) -> Outgoing:
    return Outgoing(
        Message(
            queue=row["queue"],
            consumer=row["consumer"],
            job_id=row["job_id"],
            body=bytes(row["body"]),
            tenant_id=row["tenant_id"],
            correlation_id=row["correlation_id"],
            traceparent=valid_traceparent(row["traceparent"]),
            tracestate=valid_tracestate(row["tracestate"]),
        ),
        # A count a producer wrote beyond what a delivery can carry goes as the highest: that
        # delivery is dead-lettered (DeliveryLimitExceeded).
        prior_attempts=min(row["prior_attempts"], MAX_PRIOR_ATTEMPTS),
        publish_id=row["publish_id"],  # made by outbox_claim
    )


class OutboxRelay:
    """Publishes the outbox to ``queue``. Run it as ``jobfence outbox-relay``, or embedded
    (workers on an external queue run one): ``task = asyncio.create_task(relay.run())`` ...
    ``relay.stop(); await task``.

    It holds one connection of its own to ``conninfo``, with a session advisory lock: one relay
    publishes per database, the others stand by and take over when it goes away. ``queue`` is
    the caller's to close.

    Each round is three steps, no transaction open while the broker is waited for: claim up to
    ``batch_size`` due rows (a short transaction), publish them with ``queue.publish_many``
    (their confirms outstanding together), then, in one short transaction, delete the confirmed
    rows, turn the refused ones into dead letters and give the others back.
    """

    def __init__(
        self,
        conninfo: str,
        queue: QueuePort,
        *,
        settings: OutboxRelaySettings | None = None,
        metrics: OutboxMetricsSink | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._conninfo = conninfo
        self._queue = queue
        self.settings = settings if settings is not None else OutboxRelaySettings()
        self._metrics = metrics
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._stopping = asyncio.Event()
        self._outage: _Outage | None = None
        self._claimed: list[dict[str, Any]] = []  # claimed ahead for the next round
        # The next batch, its publish under way while the one before is settled.
        self._in_flight: tuple[list[dict[str, Any]], asyncio.Future[list[Exception | None]]] | None
        self._in_flight = None
        self._recorded_limit: object = _UNRECORDED
        self._adopted: QueueSetting | None = None
        self.stats = OutboxRelayStats()
        self.active = False

    def stop(self) -> None:
        """Finish the current batch and return from :meth:`run`."""
        self._stopping.set()

    @property
    def broker_down(self) -> bool:
        """True during a broker outage (from a failed publish to the next confirmed one)."""
        return self._outage is not None

    def _now(self) -> object:
        return self._clock.now() if self._clock is not None else None

    async def run(self) -> OutboxRelayStats:
        """Publish until :meth:`stop`. A lost database connection is one outage, logged as two
        lines and retried at least every 2 s; another database error is logged and retried
        with backoff (:func:`jobfence.outage_log.stay_connected`); a database without this
        version's schema is refused (``ConfigError``)."""
        await stay_connected(
            self._conninfo,
            self._serve,
            who="outbox relay",
            doing=("publishing paused, the messages stay in the outbox", "publishing resumed"),
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
        if self._adopted is None:  # where the jobs went when this relay's queue was chosen
            self._adopted = await queue_setting(conn)
        standby_logged = False
        while not await self._try_lock(conn):
            if not standby_logged:
                log.info("outbox relay: another relay is active on this database; standing by")
                standby_logged = True
            await self._sleep(self.settings.poll_seconds)
            if self._stopping.is_set():
                return
        # A move to another queue (jobfence migrate --queue-url) holds this lock while it
        # changes the record: a relay that waited for it checks the record again, or it would
        # publish the rows written for the new queue to the one left behind.
        moved = await queue_setting(conn)
        if moved != self._adopted:
            await conn.execute(SQL["outbox_unlock"], {"key": RELAY_LOCK_KEY})
            text = (
                f"outbox relay: this database's jobs now go to {moved.kind} at"
                f" {moved.location or 'this database'}, not to the {self._adopted.kind} queue"
                " this relay publishes to (the database was moved while it waited): it stops;"
                " start it again with the new queue URL"
            )
            log.error(text)
            raise ConfigError(text)
        self.active = True
        # Nothing the relay writes needs to wait for the disk: a commit lost in a crash of the
        # server is a row published again (fenced where it is consumed), a claim that lapses,
        # or a dead letter written again when its message is refused again.
        await conn.execute("SET synchronous_commit = off")
        self._recorded_limit = _UNRECORDED  # a server that crashed may have lost it
        # The relay that held the lock before is gone: what it claimed is due again now.
        await conn.execute(SQL["outbox_release_claims"])
        log.info("outbox relay active")
        await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        try:
            while not self._stopping.is_set():
                wait = await self.run_round(conn)
                if self._outage is not None:
                    # One backoff for the whole broker: a producer's NOTIFY does not wake it.
                    await self._sleep(wait)
                elif wait > 0:
                    await self._wait(conn, wait)
        finally:
            self.active = False
            await self._release_claimed(conn)
            if not conn.closed and not conn.broken:
                with contextlib.suppress(psycopg.Error):
                    await conn.execute(SQL["outbox_unlock"], {"key": RELAY_LOCK_KEY})

    async def _try_lock(self, conn: AsyncConnection[Any]) -> bool:
        cur = await conn.execute(SQL["outbox_try_lock"], {"key": RELAY_LOCK_KEY})
        row = await cur.fetchone()
        return bool(row and row[0])

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _wait(self, conn: AsyncConnection[Any], seconds: float) -> None:
        """Until a producer's NOTIFY (sent at its commit) or ``seconds``; :meth:`stop` is seen
        at the latest after ``seconds`` (at most ``poll_seconds``)."""
        async for _ in conn.notifies(timeout=seconds, stop_after=1):
            pass

    async def run_round(self, conn: AsyncConnection[Any]) -> float:
        """Publish one batch of due rows on ``conn`` (which should hold the relay lock; it must
        not be in a transaction); returns the seconds until the next round is useful (0: more
        are due now). During a broker outage the batch is one message, a probe.

        A full batch overlaps the database's part of a round with the broker's: while the
        broker confirms it, the next batch is claimed; once its confirms are in, the next
        batch's publish starts before its rows are settled. The next round settles that one
        (:meth:`run` does, at the latest, when it stops)."""
        probing = self._outage is not None
        limit = 1 if probing else self.settings.batch_size
        publishing: asyncio.Future[list[Exception | None]] | None
        if self._in_flight is not None:
            (rows, publishing), self._in_flight = self._in_flight, None
        else:
            rows, self._claimed = self._claimed or await self._claim(conn, limit), []
            publishing = asyncio.ensure_future(self._publish_many(rows)) if rows else None
        if publishing is not None:
            try:
                if not probing and len(rows) >= limit and not self._claimed:
                    self._claimed = await self._claim(conn, limit)
            finally:
                results = await publishing
            away = any(isinstance(result, QueueUnavailable) for result in results)
            if self._claimed and not away:
                following, self._claimed = self._claimed, []
                self._in_flight = (following, asyncio.ensure_future(self._publish_many(following)))
            await self._settle_results(conn, rows, results)
            if self._outage is not None and self._claimed:
                claimed, self._claimed = self._claimed, []
                await conn.execute(
                    SQL["outbox_unclaim"],
                    {"ids": _id_array([row["id"] for row in claimed]), "error": None},
                )
        self.stats.rounds += 1
        await self._record_limit(conn)
        if self._metrics is not None:
            counts = await outbox_counts(conn, clock=self._clock)
            self._metrics.outbox_waiting(counts.waiting, counts.oldest_age_seconds)
        if self._outage is not None:
            return self._probe_delay(self._outage)
        if len(rows) >= limit or self._claimed or self._in_flight is not None:
            return 0.0  # more may be due (those that failed on their own wait their backoff)
        found = await conn.execute(SQL["outbox_next_due"], {"now": self._now()})
        next_due = await found.fetchone()
        wait = self.settings.poll_seconds
        if next_due is not None and next_due[0] is not None:
            wait = min(wait, max(float(next_due[0]), 0.0))
        return wait

    async def _record_limit(self, conn: AsyncConnection[Any]) -> None:
        """Record the largest message the broker accepts, once known and when it changes (the
        queue's optional ``max_message_bytes``: NATS's ``max_payload`` once connected), so
        that producers refuse a job over it (:class:`~jobfence.JobRefused`)."""
        limit = getattr(self._queue, "max_message_bytes", None)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            limit = None
        if limit is None and self._recorded_limit is _UNRECORDED:
            return  # nothing known yet: leave what is recorded until the broker says
        if limit != self._recorded_limit:
            await conn.execute(SQL["queue_limit_set"], {"max_bytes": limit})
            self._recorded_limit = limit

    async def _claim(self, conn: AsyncConnection[Any], limit: int) -> list[dict[str, Any]]:
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(
                SQL["outbox_claim"],
                {
                    "now": self._now(),
                    "limit": limit,
                    "claim_seconds": self.settings.claim_seconds,
                },
            )
            return sorted(await cur.fetchall(), key=lambda r: (r["due_order"], r["id"]))

    async def _release_claimed(self, conn: AsyncConnection[Any]) -> None:
        """The relay stops: settle the batch whose publish is under way (its confirmed rows
        leave the outbox), and give back the rows claimed ahead for the next round."""
        if self._in_flight is not None:
            (rows, publishing), self._in_flight = self._in_flight, None
            results = await publishing
            if not conn.closed and not conn.broken:
                with contextlib.suppress(psycopg.Error):
                    await self._settle_results(conn, rows, results)
        claimed, self._claimed = self._claimed, []
        if claimed and not conn.closed and not conn.broken:
            with contextlib.suppress(psycopg.Error):
                await conn.execute(
                    SQL["outbox_unclaim"],
                    {"ids": _id_array([row["id"] for row in claimed]), "error": None},
                )

    def _probe_delay(self, outage: _Outage) -> float:
        s = self.settings
        exponent = max(outage.failed_probes - 1, 0)
        nominal = min(
            min(s.retry_base_seconds, s.probe_cap_seconds) * 2.0**exponent, s.probe_cap_seconds
        )
        return nominal * self._rng.uniform(0.5, 1.0)

    def _row_backoff(self, failures: int) -> float:
        """The wait of a message after its ``failures``-th failed publish (its row's count)."""
        s = self.settings
        nominal: float = min(
            s.retry_base_seconds * 2.0 ** max(failures - 1, 0), s.retry_cap_seconds
        )
        return nominal * self._rng.uniform(0.5, 1.0)

    async def _publish_many(self, rows: list[dict[str, Any]]) -> list[Exception | None]:
        outgoing = [_outgoing(row) for row in rows]
        refused = [_unfenceable(item.message) for item in outgoing]
        if any(refused):  # published: the others; the refused rows are dead-lettered
            sendable = [n for n, refusal in enumerate(refused) if refusal is None]
            results: list[Exception | None] = list(refused)
            sent = await self._publish_outgoing([outgoing[n] for n in sendable])
            for n, result in zip(sendable, sent, strict=True):
                results[n] = result
            return results
        return await self._publish_outgoing(outgoing)

    async def _publish_outgoing(self, outgoing: list[Outgoing]) -> list[Exception | None]:
        if not outgoing:
            return []
        # One send span per message, child of its create span; the message carries it.
        sends = tracing.start_sends([o.message for o in outgoing])
        if sends is not None:
            outgoing = [
                replace(o, message=m) for o, m in zip(outgoing, sends.messages, strict=True)
            ]
        try:
            results: list[Exception | None] = await self._queue.publish_many(outgoing)
        except Exception as exc:  # an adapter that raised instead of reporting per message
            results = [exc] * len(outgoing)
        if sends is not None:
            sends.end(results)
        return results

    async def _settle_results(
        self,
        conn: AsyncConnection[Any],
        rows: list[dict[str, Any]],
        results: list[Exception | None],
    ) -> int:
        """Settle each of the claimed ``rows`` by its publish result, in one short
        transaction; returns how many were confirmed."""
        sent: list[int] = []
        away: list[int] = []
        away_error: Exception | None = None
        refused: list[tuple[dict[str, Any], Exception]] = []
        failed: list[tuple[dict[str, Any], Exception]] = []
        for row, result in zip(rows, results, strict=True):
            if result is None:
                sent.append(row["id"])
            elif isinstance(result, QueueUnavailable):
                away.append(row["id"])
                away_error = away_error or result
            elif isinstance(result, PublishRefused | _Unfenceable):
                refused.append((row, result))
            else:
                failed.append((row, result))
        dead_lettered = await self._settle(
            conn, sent=sent, away=away, away_error=away_error, refused=refused, failed=failed
        )
        self.stats.published += len(sent)
        self.stats.dead_lettered += dead_lettered
        failed_attempts = len(failed) + (1 if away else 0)
        self.stats.failed += failed_attempts
        if self._metrics is not None:
            if sent:
                self._metrics.outbox_published(len(sent))
            for _ in range(failed_attempts):
                self._metrics.outbox_failed()
        if away_error is not None:
            self._went_away(away_error, probe=not sent and self._outage is not None)
        elif sent or refused or failed:
            self._back()
        return len(sent)

    async def _settle(
        self,
        conn: AsyncConnection[Any],
        *,
        sent: list[int],
        away: list[int],
        away_error: Exception | None,
        refused: list[tuple[dict[str, Any], Exception]],
        failed: list[tuple[dict[str, Any], Exception]],
    ) -> int:
        """One short transaction: delete the confirmed rows, give back those the outage
        caught, dead-letter the refused ones, push back those that failed on their own;
        returns the dead letters written."""
        dead_letters: list[tuple[dict[str, Any], str, str, int | None]] = []
        if sent and not (away or refused or failed):  # the usual round: one statement
            await conn.execute(SQL["outbox_delete_sent"], {"ids": _id_array(sent)})
            return 0
        async with conn.transaction():
            if sent:
                await conn.execute(SQL["outbox_delete_sent"], {"ids": _id_array(sent)})
            if away:
                assert away_error is not None
                await conn.execute(
                    SQL["outbox_unclaim"],
                    {"ids": _id_array(away), "error": _error_text(away_error)},
                )
            for row, refusal in refused:
                if isinstance(refusal, _Unfenceable):
                    text = f"{UNFENCEABLE}: {refusal.reason}"
                    dl = await self._dead_letter(
                        conn, row, UNFENCEABLE, text, whole_message=refusal.reason
                    )
                    dead_letters.append((row, UNFENCEABLE, text, dl))
                    continue
                text = _error_text(refusal)
                dl = await self._dead_letter(conn, row, PUBLISH_REFUSED, text)
                dead_letters.append((row, PUBLISH_REFUSED, text, dl))
            for row, failure in failed:
                failures = int(row["attempts"]) + 1
                text = _error_text(failure)
                if failures >= self.settings.max_publish_failures:
                    dl = await self._dead_letter(conn, row, PUBLISH_FAILED, text)
                    dead_letters.append((row, PUBLISH_FAILED, text, dl))
                    continue
                delay = self._row_backoff(failures)
                await conn.execute(
                    SQL["outbox_mark_failed"],
                    {"id": row["id"], "error": text, "now": self._now(), "delay_seconds": delay},
                )
                log.warning(
                    "outbox relay: publishing job %s to queue %s failed (%s); it stays in the"
                    " outbox and is tried again in %.1fs (failure %d of %d)",
                    shown_value(row["job_id"]),
                    shown_value(row["queue"]),
                    text,
                    delay,
                    failures,
                    self.settings.max_publish_failures,
                )
        for row, error_class, text, dl in dead_letters:
            log.warning(
                "outbox relay: job %s for queue %s is a dead letter of class %s (%s)%s",
                shown_value(row["job_id"]),
                shown_value(row["queue"]),
                error_class,
                text,
                f", id {dl}" if dl is not None else ", beside the one already pending review",
            )
        return len(dead_letters)

    async def _dead_letter(
        self,
        conn: AsyncConnection[Any],
        row: dict[str, Any],
        error_class: str,
        text: str,
        *,
        whole_message: str | None = None,
    ) -> int | None:
        """The row leaves the outbox for a dead letter; ``whole_message`` (a note saying why)
        keeps the whole message, with bounded stand-ins for the identifiers (as a worker keeps
        an unfenceable delivery)."""
        message = _outgoing(row).message
        if whole_message is None:
            ids = message
            payload, encoding = stored_payload(message.body)
        else:
            ids, payload, encoding = kept_whole(message, whole_message)
        cur = await conn.execute(
            SQL["outbox_dead_letter"],
            {
                "id": row["id"],
                "job_id": ids.job_id,
                "queue": ids.queue,
                "consumer": ids.consumer,
                "tenant_id": ids.tenant_id,
                "correlation_id": ids.correlation_id,
                "payload": payload,
                "payload_encoding": encoding,
                "last_error": storable_text(text),
                "error_class": error_class,
            },
        )
        inserted = await cur.fetchone()
        if inserted is None:
            return None
        await record_dead_letter_alerts(conn, [inserted[0]])
        return int(inserted[0])

    def _went_away(self, exc: Exception, *, probe: bool) -> None:
        loop_time = asyncio.get_running_loop().time()
        outage = self._outage
        if outage is None:
            self._outage = _Outage(since=loop_time, next_still_down=loop_time + _STILL_DOWN_EVERY)
            self.stats.outages += 1
            log.warning(
                "outbox relay: broker went away (%s): publishing paused, the messages stay in"
                " the outbox; probing it with one message at most every %.1fs",
                _error_text(exc),
                self.settings.probe_cap_seconds,
            )
            return
        outage.failed_attempts += 1
        if probe:
            outage.failed_probes += 1
        if loop_time >= outage.next_still_down:
            outage.next_still_down = loop_time + _STILL_DOWN_EVERY
            log.warning(
                "outbox relay: broker still unavailable after %.0fs (%s); probing",
                loop_time - outage.since,
                _error_text(exc),
            )
        else:
            log.debug("outbox relay: broker still unavailable: %s", _error_text(exc))

    def _back(self) -> None:
        outage, self._outage = self._outage, None
        if outage is None:
            return
        gone = asyncio.get_running_loop().time() - outage.since
        log.info(
            "outbox relay: broker back after %.1fs: publishing resumed (%d failed publish"
            " attempt(s) during the outage)",
            gone,
            outage.failed_attempts,
        )
