"""The transactional outbox: jobs for an external queue, written in the caller's transaction.

A broker (RabbitMQ, NATS, Redis) cannot join a PostgreSQL transaction. So when this database's
queue is external (``jobfence.settings``, set by :func:`record_queue`), every producer writes a
``jobfence.outbox`` row in the caller's own transaction instead of a queue row: the job exists
exactly when that transaction commits, as with the PostgreSQL queue. A replay writes its outbox
row in the transaction that moves the dead letter to ``replayed``.

The :class:`OutboxRelay` then publishes the rows, oldest first: it takes a batch ``FOR UPDATE
SKIP LOCKED``, publishes each message to the :class:`~jobfence.ports.QueuePort` (an adapter's
``publish`` returning means the broker confirmed it) and deletes the published rows in the same
transaction. A relay that dies after a publish and before its commit leaves the rows in place,
and the next relay publishes them again: at least once, and the fence (``core.processed_jobs``)
makes a duplicate delivery a skipped duplicate. A publish that fails keeps its row, due again
after a backoff; nothing is dropped.

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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import dict_row

from jobfence import tracing
from jobfence._sql import Queries
from jobfence.adapters._shared import check_prior_attempts
from jobfence.errors import ConfigError
from jobfence.limits import MAX_PRIOR_ATTEMPTS, checked_delay
from jobfence.model import Message
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


@dataclass(frozen=True, slots=True)
class OutboxRelaySettings:
    """How the relay paces itself (seconds). A failed publish waits
    ``min(retry_base * 2^(n-1), retry_cap) * U(0.5, 1)`` after the n-th failure in a row, and
    so does its row."""

    batch_size: int = 100
    poll_seconds: float = 1.0
    retry_base_seconds: float = 0.5
    retry_cap_seconds: float = 30.0
    reconnect_cap_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        for name in (
            "poll_seconds",
            "retry_base_seconds",
            "retry_cap_seconds",
            "reconnect_cap_seconds",
        ):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")


@dataclass
class OutboxRelayStats:
    rounds: int = 0
    published: int = 0
    failed: int = 0

    def summary(self) -> str:
        return f"published {self.published}, failed publishes {self.failed}"


class OutboxRelay:
    """Publishes the outbox to ``queue``. Run it as ``jobfence outbox-relay``, or embedded
    (workers on an external queue run one): ``task = asyncio.create_task(relay.run())`` ...
    ``relay.stop(); await task``.

    It holds one connection of its own to ``conninfo``, with a session advisory lock: one relay
    publishes per database, the others stand by and take over when it goes away. ``queue`` is
    the caller's to close.
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
        self._failures = 0
        self.stats = OutboxRelayStats()
        self.active = False

    def stop(self) -> None:
        """Finish the current batch and return from :meth:`run`."""
        self._stopping.set()

    def _now(self) -> object:
        return self._clock.now() if self._clock is not None else None

    async def run(self) -> OutboxRelayStats:
        """Publish until :meth:`stop`. A lost database connection is logged and retried with
        backoff; a database without this version's schema is refused (``ConfigError``)."""
        backoff = 0.5
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            started = loop.time()
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._conninfo, autocommit=True, connect_timeout=10
                ) as conn:
                    await self._serve(conn)
            except psycopg.Error as exc:
                self.active = False
                if loop.time() - started > 60:
                    backoff = 0.5
                text = " ".join(str(exc).split())
                log.warning(
                    "outbox relay: database error (%s: %s); retrying in %.1fs",
                    type(exc).__name__,
                    text[:200],
                    backoff,
                )
                await self._sleep(backoff)
                backoff = min(backoff * 2, self.settings.reconnect_cap_seconds)
        return self.stats

    async def _serve(self, conn: AsyncConnection[Any]) -> None:
        await ensure_migrated(conn)
        standby_logged = False
        while not await self._try_lock(conn):
            if not standby_logged:
                log.info("outbox relay: another relay is active on this database; standing by")
                standby_logged = True
            await self._sleep(self.settings.poll_seconds)
            if self._stopping.is_set():
                return
        self.active = True
        log.info("outbox relay active")
        await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        try:
            while not self._stopping.is_set():
                wait = await self.run_round(conn)
                if wait > 0:
                    await self._wait(conn, wait)
        finally:
            self.active = False
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
        """Publish one batch of due rows on ``conn`` (which should hold the relay lock);
        returns the seconds until the next round is useful (0: more are due now)."""
        published, failed = await self._publish_batch(conn)
        self.stats.rounds += 1
        if self._metrics is not None:
            counts = await outbox_counts(conn, clock=self._clock)
            self._metrics.outbox_waiting(counts.waiting, counts.oldest_age_seconds)
        if failed:
            return self._backoff()
        if published >= self.settings.batch_size:
            return 0.0
        cur = await conn.execute(SQL["outbox_next_due"], {"now": self._now()})
        row = await cur.fetchone()
        wait = self.settings.poll_seconds
        if row is not None and row[0] is not None:
            wait = min(wait, max(float(row[0]), 0.0))
        return wait

    def _backoff(self) -> float:
        s = self.settings
        exponent = max(self._failures - 1, 0)
        nominal: float = min(s.retry_base_seconds * 2.0**exponent, s.retry_cap_seconds)
        return nominal * self._rng.uniform(0.5, 1.0)

    async def _publish_batch(self, conn: AsyncConnection[Any]) -> tuple[int, bool]:
        """Publish due rows in order until one fails; delete the published ones and push the
        failed one back by the backoff, all in one transaction."""
        sent: list[int] = []
        failed = False
        async with conn.transaction():
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(
                    SQL["outbox_take"], {"now": self._now(), "limit": self.settings.batch_size}
                )
                rows = await cur.fetchall()
            for row in rows:
                message = Message(
                    queue=row["queue"],
                    consumer=row["consumer"],
                    job_id=row["job_id"],
                    body=bytes(row["body"]),
                    tenant_id=row["tenant_id"],
                    correlation_id=row["correlation_id"],
                    traceparent=valid_traceparent(row["traceparent"]),
                    tracestate=valid_tracestate(row["tracestate"]),
                )
                try:
                    # Returning means the broker confirmed it (the adapter's contract).
                    # A count a producer wrote beyond what a delivery can carry goes as the
                    # highest: that delivery is dead-lettered (DeliveryLimitExceeded).
                    with tracing.send(message) as sent_message:
                        await self._queue.publish(
                            sent_message,
                            prior_attempts=min(row["prior_attempts"], MAX_PRIOR_ATTEMPTS),
                        )
                except Exception as exc:
                    failed = True
                    self._failures += 1
                    delay = self._backoff()
                    # Stored and logged: a broker client's error may quote its URL.
                    text = redact_text(" ".join(f"{type(exc).__name__}: {exc}".split()))[:500]
                    log.warning(
                        "outbox relay: publishing job %s to queue %s failed (%s); it stays in"
                        " the outbox and is tried again in %.1fs",
                        message.job_id,
                        message.queue,
                        text,
                        delay,
                    )
                    await conn.execute(
                        SQL["outbox_mark_failed"],
                        {
                            "id": row["id"],
                            "error": text,
                            "now": self._now(),
                            "delay_seconds": delay,
                        },
                    )
                    self.stats.failed += 1
                    if self._metrics is not None:
                        self._metrics.outbox_failed()
                    break
                sent.append(row["id"])
                self._failures = 0
            if sent:
                await conn.execute(SQL["outbox_delete_sent"], {"ids": sent})
        self.stats.published += len(sent)
        if sent and self._metrics is not None:
            self._metrics.outbox_published(len(sent))
        return len(sent), failed
