"""A queue in PostgreSQL itself (schema ``jobfence_queue``), the default transport.

Receiving takes due rows with ``FOR UPDATE SKIP LOCKED`` and moves their ``run_at`` forward by
the lease, so a crashed worker's message comes back when the lease runs out; ``extend`` moves it
forward again while the same delivery holds the row. Publishing sends a NOTIFY that wakes idle
workers at commit; a poll interval covers scheduled retries. Because the queue shares the work
database, ``ack`` can join a transaction (the dead-letter write uses that); finished jobs are
acked after their commit, in batches (``ack_many``). The queue's own statements (fetch, ack,
extend, retry, release) run at READ COMMITTED whatever the database's default isolation level
(:func:`jobfence.pgtx.execute_read_committed`); a publish joins its caller's transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from jobfence._sql import Queries
from jobfence.adapters._shared import check_prior_attempts, publish_each
from jobfence.db import RECONNECT_MAX_DELAY_SECONDS, transaction_pooling
from jobfence.errors import ConfigError
from jobfence.limits import checked_delay
from jobfence.model import Delivery, Message, Outgoing
from jobfence.pgtx import execute_read_committed
from jobfence.ports import Clock, QueueCapabilities, QueueSize
from jobfence.tracing import valid_traceparent, valid_tracestate

log = logging.getLogger("jobfence.pg_queue")

# Fetches whose reply was lost that a queue remembers, to give back what they leased: a lease
# token each (older ones are forgotten; their messages come back when their lease runs out).
LOST_FETCHES_KEPT = 64

SQL = Queries("jobfence.adapters", "pg_queue.sql")
NOTIFY_CHANNEL = "jobfence_queue"


@dataclass(frozen=True, slots=True)
class PgReceipt:
    id: int
    lease_token: UUID


def _now(clock: Clock | None) -> datetime | None:
    return clock.now() if clock is not None else None


async def publish_on(
    conn: AsyncConnection[Any],
    message: Message,
    *,
    delay_seconds: float = 0.0,
    clock: Clock | None = None,
    prior_attempts: int = 0,
) -> None:
    """Insert ``message`` on ``conn`` without committing: it joins the caller's transaction.
    Its first delivery has attempt ``prior_attempts + 1``.

    Any other kind of connection is refused before a statement runs (a sync one has its own
    entry points, :func:`jobfence.producer.publish_sync`)."""
    require_async_connection(conn)
    params = publish_params(message, delay_seconds, clock)
    params["prior_attempts"] = check_prior_attempts(prior_attempts)
    await conn.execute(SQL["publish"], params)


def require_async_connection(conn: object) -> None:
    """Refuse anything but a psycopg ``AsyncConnection``, saying what to pass instead."""
    if not isinstance(conn, AsyncConnection):
        raise TypeError(
            f"enqueue needs a psycopg.AsyncConnection (or a SQLAlchemy AsyncSession or"
            f" AsyncConnection), got {_kind(conn)}; for a sync connection (psycopg.Connection,"
            " psycopg2, SQLAlchemy Session or Connection) use app.enqueue_sync(conn, ...) or"
            " jobfence.Producer(...).enqueue_sync(conn, ...)"
        )


def publish_params(
    message: Message, delay_seconds: float = 0.0, clock: Clock | None = None
) -> dict[str, object]:
    """The parameters of the ``publish`` query: every producer, async or sync, runs it. A
    delay that is not a finite number of seconds within ``MAX_DELAY_SECONDS`` is refused here
    (:class:`~jobfence.JobRefused` naming ``delay_seconds``), before any statement."""
    return {
        "queue": message.queue,
        "consumer": message.consumer,
        "job_id": message.job_id,
        "body": message.body,
        "tenant_id": message.tenant_id,
        "correlation_id": message.correlation_id,
        "traceparent": message.traceparent,
        "tracestate": message.tracestate,
        "now": _now(clock),
        "delay": timedelta(seconds=checked_delay(delay_seconds)),
    }


def _kind(conn: object) -> str:
    """``module.Class`` of a connection, for errors that say what was passed."""
    cls = type(conn)
    return f"{cls.__module__}.{cls.__qualname__}"


def _receipt(delivery: Delivery) -> PgReceipt:
    receipt = delivery.receipt
    if not isinstance(receipt, PgReceipt):
        raise TypeError("this delivery did not come from PgQueue")
    return receipt


class PgQueue:
    """The PostgreSQL queue adapter. ``clock`` defaults to the database's own clock.
    ``listen=False``: no LISTEN connection, new jobs are found by the poll alone (behind a
    pooler in transaction mode, which delivers no NOTIFY); the default (None) is False when
    JOBFENCE_DATABASE_POOL_MODE is ``transaction``, else True."""

    capabilities = QueueCapabilities(transactional=True, delayed_publish=True, delayed_retry=True)

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        clock: Clock | None = None,
        poll_interval_seconds: float = 1.0,
        listen_conninfo: str | None = None,
        listen: bool | None = None,
    ) -> None:
        if not 0 < poll_interval_seconds < float("inf"):  # NaN fails too
            # A delayed job falls due with no NOTIFY: only the poll finds it.
            raise ConfigError(
                "poll_interval_seconds must be a positive, finite number of seconds, got"
                f" {poll_interval_seconds}"
            )
        if listen_conninfo is None:
            if not isinstance(pool.conninfo, str):
                raise TypeError("pass listen_conninfo when the pool's conninfo is not a string")
            listen_conninfo = pool.conninfo
        self._listen_conninfo = listen_conninfo
        # False behind a pooler in transaction mode, which cannot deliver a NOTIFY: receivers
        # then find new jobs by the poll alone.
        self._listens = not transaction_pooling() if listen is None else listen
        self._pool = pool
        self._clock = clock
        self._poll_interval = poll_interval_seconds
        self._wakeup = asyncio.Event()
        self._listener: asyncio.Task[None] | None = None
        self._closed = False
        # The lease tokens and queues of fetches that failed after they were sent: they may have
        # leased messages on the server whose rows never arrived (see _give_back_lost).
        self._lost_fetches: list[tuple[UUID, tuple[str, ...]]] = []

    async def publish(
        self,
        message: Message,
        *,
        delay_seconds: float = 0.0,
        tx: AsyncConnection[Any] | None = None,
        prior_attempts: int = 0,
    ) -> None:
        if tx is not None:
            await publish_on(
                tx,
                message,
                delay_seconds=delay_seconds,
                clock=self._clock,
                prior_attempts=prior_attempts,
            )
            return
        async with self._pool.connection() as conn:
            await publish_on(
                conn,
                message,
                delay_seconds=delay_seconds,
                clock=self._clock,
                prior_attempts=prior_attempts,
            )

    async def publish_many(self, outgoing: Sequence[Outgoing]) -> list[Exception | None]:
        """Each message with :meth:`publish`, one after the other (no round trip to wait for
        that pipelining would save)."""

        async def one(item: Outgoing) -> None:
            await self.publish(item.message, prior_attempts=item.prior_attempts)

        return await publish_each(one, outgoing)

    async def receive(
        self,
        queues: Sequence[str],
        *,
        max_messages: int,
        lease_seconds: float,
        wait_seconds: float = 0.0,
    ) -> list[Delivery]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        if wait_seconds > 0 and self._listens:
            self._ensure_listener()
        while True:
            self._wakeup.clear()
            deliveries = await self._take(queues, max_messages, lease_seconds)
            remaining = deadline - loop.time()
            if deliveries or remaining <= 0 or self._closed:
                return deliveries
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), min(remaining, self._poll_interval))

    async def _take(
        self, queues: Sequence[str], max_messages: int, lease_seconds: float
    ) -> list[Delivery]:
        # Chosen here, not by the server: if the reply is lost, this queue still knows which
        # messages the fetch leased.
        token = uuid4()
        async with self._pool.connection() as conn:
            if self._lost_fetches:
                await self._give_back_lost(conn)
            try:
                cur = await execute_read_committed(
                    conn,
                    SQL["receive"],
                    {
                        "queues": list(queues),
                        "limit": max_messages,
                        "now": _now(self._clock),
                        "lease": timedelta(seconds=lease_seconds),
                        "lease_token": token,
                    },
                )
                rows = await cur.fetchall()
            except BaseException:
                # Committed or not, nobody knows: its messages are given back at the next fetch.
                self._lost_fetches = [*self._lost_fetches, (token, tuple(queues))][
                    -LOST_FETCHES_KEPT:
                ]
                raise
        return [
            Delivery(
                message=Message(
                    queue=queue,
                    consumer=consumer,
                    job_id=job_id,
                    body=bytes(body),
                    tenant_id=tenant_id,
                    correlation_id=correlation_id,
                    traceparent=valid_traceparent(traceparent),
                    tracestate=(
                        valid_tracestate(tracestate) if valid_traceparent(traceparent) else None
                    ),
                ),
                attempt=attempts,
                receipt=PgReceipt(id=row_id, lease_token=lease_token),
            )
            for (
                row_id,
                queue,
                consumer,
                job_id,
                body,
                tenant_id,
                correlation_id,
                attempts,
                lease_token,
                traceparent,
                tracestate,
            ) in sorted(rows, key=lambda r: r[0])
        ]

    async def _give_back_lost(self, conn: AsyncConnection[Any]) -> None:
        """Give back what the fetches whose reply was lost leased (the database cut the
        connection after the lease committed, say): nobody holds those messages, and they would
        otherwise wait out their lease. Not counted as a delivery. Raises as a fetch does; the
        fetches stay remembered until this succeeds."""
        lost = self._lost_fetches
        cur = await execute_read_committed(
            conn,
            SQL["release_lost"],
            {
                "queues": sorted({queue for _token, queues in lost for queue in queues}),
                "lease_tokens": [token for token, _queues in lost],
                "now": _now(self._clock),
            },
        )
        self._lost_fetches = [fetch for fetch in self._lost_fetches if fetch not in lost]
        if cur.rowcount:
            log.info(
                "gave back %d job(s) that a fetch leased when its reply was lost", cur.rowcount
            )

    async def ack(self, delivery: Delivery, *, tx: AsyncConnection[Any] | None = None) -> bool:
        receipt = _receipt(delivery)
        params = {"id": receipt.id, "lease_token": receipt.lease_token}
        if tx is not None:
            cur = await tx.execute(SQL["ack"], params)
            return bool(cur.rowcount == 1)
        async with self._pool.connection() as conn:
            cur = await execute_read_committed(conn, SQL["ack"], params)
            return bool(cur.rowcount == 1)

    async def extend(self, delivery: Delivery, *, lease_seconds: float) -> bool:
        receipt = _receipt(delivery)
        async with self._pool.connection() as conn:
            cur = await execute_read_committed(
                conn,
                SQL["extend"],
                {
                    "id": receipt.id,
                    "lease_token": receipt.lease_token,
                    "now": _now(self._clock),
                    "lease": timedelta(seconds=lease_seconds),
                },
            )
            return bool(cur.rowcount == 1)

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        receipts = [_receipt(delivery) for delivery in deliveries]
        async with self._pool.connection() as conn:
            await execute_read_committed(
                conn,
                SQL["ack_many"],
                {
                    "ids": [r.id for r in receipts],
                    "lease_tokens": [r.lease_token for r in receipts],
                },
            )

    async def retry(self, delivery: Delivery, *, delay_seconds: float, error: str) -> bool:
        receipt = _receipt(delivery)
        async with self._pool.connection() as conn:
            cur = await execute_read_committed(
                conn,
                SQL["retry"],
                {
                    "id": receipt.id,
                    "lease_token": receipt.lease_token,
                    "now": _now(self._clock),
                    "delay": timedelta(seconds=delay_seconds),
                    "last_error": error[:4000],
                },
            )
            return bool(cur.rowcount == 1)

    async def release(self, delivery: Delivery) -> None:
        receipt = _receipt(delivery)
        async with self._pool.connection() as conn:
            await execute_read_committed(
                conn,
                SQL["release"],
                {"id": receipt.id, "lease_token": receipt.lease_token, "now": _now(self._clock)},
            )

    async def size(self, queues: Sequence[str]) -> QueueSize:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                SQL["size"], {"queues": list(queues), "now": _now(self._clock)}
            )
            row = await cur.fetchone()
        assert row is not None
        return QueueSize(due=int(row[0]), total=int(row[1]))

    async def backlog(self, queues: Sequence[str]) -> int:
        """Every message in the table, of every queue (``queues`` is not needed)."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(SQL["backlog"])
            row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    def _ensure_listener(self) -> None:
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen(), name="jobfence-pg-queue-listen")

    async def _listen(self) -> None:
        """Hold a LISTEN connection; reconnect with backoff when it drops."""
        backoff = 0.5
        while not self._closed:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._listen_conninfo, autocommit=True
                ) as conn:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    backoff = 0.5
                    # A publish committed before LISTEN notified nobody: waiting receivers look
                    # again now instead of at the next poll.
                    self._wakeup.set()
                    async for _ in conn.notifies():
                        self._wakeup.set()
            except asyncio.CancelledError:
                raise
            except psycopg.Error as exc:
                # Once per loss (an outage would repeat it at every retry), then DEBUG.
                log.log(
                    logging.WARNING if backoff == 0.5 else logging.DEBUG,
                    "queue listener lost its connection, retrying: %s",
                    type(exc).__name__,
                )
                self._wakeup.set()  # fall back to polling meanwhile
                await asyncio.sleep(backoff)
                # At least every 2 s, as the pools reconnect: listening again within seconds
                # of the database's return, however long it was away.
                backoff = min(backoff * 2, RECONNECT_MAX_DELAY_SECONDS)

    async def close(self) -> None:
        self._closed = True
        self._wakeup.set()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                await self._listener
            self._listener = None
