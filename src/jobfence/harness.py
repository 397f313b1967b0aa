r"""One delivery, from bytes to exactly one effect or one dead letter.

    decode/validate -> transaction(fence insert, handler) -> commit -> ack (batched)
                    \-> poison: dead letter at once (D6)
    on failure: roll back, then hard -> dead letter; transient -> retry or, exhausted, dead letter

The fence row is inserted first (``ON CONFLICT DO NOTHING``): a concurrent duplicate blocks on
the uncommitted key and, once the first commits, finds it and skips. There is no "in progress"
state that could get stuck: a crash rolls the whole transaction back, fence included.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import random
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection, errors
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from pydantic import BaseModel, ValidationError

from jobfence._sql import Queries
from jobfence.acks import AckBatcher
from jobfence.alerts.outbox import record_dead_letter_alerts
from jobfence.app import App, Consumer
from jobfence.codec import decode_body, stored_payload
from jobfence.errors import HardFailure, PoisonMessage, TransactionAborted
from jobfence.model import Delivery, JobMeta
from jobfence.pgtx import NextBeginFailed, Tx
from jobfence.ports import MetricsSink, QueuePort
from jobfence.retry import RetryPolicy

log = logging.getLogger("jobfence.harness")

SQL = Queries("jobfence.sql", "core.sql")

MAX_ERROR_CHARS = 4000
MAX_TRACEBACK_FRAMES = 15
# Serialization failures and deadlocks are retried at once, without counting an attempt (D7).
CONFLICT_RETRIES = 3
UNKNOWN_CONSUMER_LABEL = "<unknown>"

T = TypeVar("T")


class Outcome(enum.StrEnum):
    SUCCEEDED = "succeeded"
    DUPLICATE = "duplicate"
    RETRIED = "retried"
    DEAD_LETTERED = "dead_lettered"
    POISON = "poison"
    # The job failed after its lease ran out and another worker took it: its failure is left to
    # that worker (no retry scheduled, no dead letter written by this one).
    LEASE_LOST = "lease_lost"


class InfrastructureError(Exception):
    """The database went away mid-job: the worker releases the job and reconnects (D7)."""


def log_fields(delivery: Delivery, outcome: str | None = None, **more: object) -> dict[str, object]:
    """The structured fields of a job event's log line (pass as ``extra=``): job_id, consumer,
    queue, tenant_id, correlation_id, attempt, and the outcome when there is one."""
    message = delivery.message
    fields: dict[str, object] = {
        "job_id": message.job_id,
        "consumer": message.consumer,
        "queue": message.queue,
        "tenant_id": message.tenant_id,
        "correlation_id": message.correlation_id,
        "attempt": delivery.attempt,
    }
    if outcome is not None:
        fields["outcome"] = str(outcome)
    fields.update(more)
    return fields


def error_class_of(exc: BaseException) -> str:
    cls = type(exc)
    if cls.__module__ in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def describe_error(exc: BaseException) -> str:
    """``Class: message`` plus a trimmed traceback, bounded in size."""
    head = f"{error_class_of(exc)}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)[-MAX_TRACEBACK_FRAMES:]
    tail = "".join(traceback.format_list(frames))
    text = f"{head}\nTraceback (most recent call last, trimmed):\n{tail}" if frames else head
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 20] + "\n... (trimmed)"
    return text


# SQLSTATEs that mean "the server or the connection went away", not "this statement failed":
# class 08 (connection exception) and the operator-intervention shutdowns.
_CONNECTION_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})


def is_connection_loss(exc: BaseException, conn: AsyncConnection[Any] | None) -> bool:
    """True when ``exc`` means the database is unreachable rather than that the job failed."""
    if isinstance(exc, PoolTimeout):
        return True
    if isinstance(exc, psycopg.OperationalError):
        state = exc.sqlstate
        return (
            state is None
            or state.startswith("08")
            or state in _CONNECTION_SQLSTATES
            or (conn is not None and conn.broken)
        )
    return False


def _is_permanent(exc: BaseException, policy: RetryPolicy) -> bool:
    return isinstance(exc, HardFailure) or (
        bool(policy.permanent) and isinstance(exc, policy.permanent)
    )


@dataclass(frozen=True, slots=True)
class Job:
    """A delivery decoded and validated, ready to run."""

    delivery: Delivery
    consumer: Consumer[Any]
    payload: BaseModel
    meta: JobMeta


@dataclass(frozen=True, slots=True)
class Started:
    """A job whose transaction is open with its fence insert done (``fresh``: inserted)."""

    job: Job
    tx: Tx
    fresh: bool


class Lookahead:
    """What a worker's processor lends the harness while it holds a connection across jobs:
    ``take`` gives the next waiting delivery (or None), already counted as the processor's.

    When a job commits and another is waiting, the harness sends the COMMIT together with the
    next job's BEGIN and fence insert (one round trip instead of two) and holds the next job
    here, started or not; the processor handles :meth:`next` right after, on the same
    connection, and gives it back if it cannot."""

    __slots__ = ("_held", "_started", "_take")

    def __init__(self, take: Callable[[], Delivery | None]) -> None:
        self._take = take
        self._held: Delivery | None = None
        self._started: Started | None = None

    def take(self) -> Delivery | None:
        if self._held is not None:
            return None  # one job ahead at most
        return self._take()

    def hold(self, delivery: Delivery, started: Started | None = None) -> None:
        self._held = delivery
        self._started = started

    def next(self) -> Delivery | None:
        """The delivery held for the processor to handle next (it stays held until then)."""
        return self._held

    def resume(self, delivery: Delivery) -> Started | None:
        """Hand ``delivery`` over for handling: its open transaction, when it has one."""
        if self._held is not delivery:
            return None
        started = self._started
        self._held = self._started = None
        return started

    async def abandon(self) -> Delivery | None:
        """Give up the held delivery, rolling back its open transaction if it has one (quietly:
        this runs when the connection is lost or the processor is stopping)."""
        held, started = self._held, self._started
        if started is not None:
            # Cancelled here, it stays held: the caller's cleanup abandons it again.
            with contextlib.suppress(Exception):
                await started.tx.rollback()
        self._held = self._started = None
        return held


def _fence_params(job: Job) -> dict[str, Any]:
    meta = job.meta
    return {
        "job_id": meta.job_id,
        "consumer": meta.consumer,
        "tenant_id": meta.tenant_id,
        "ttl": job.consumer.fence_ttl,
    }


class Harness:
    """Runs deliveries through the fence, the handler and the failure policy."""

    def __init__(
        self,
        app: App,
        pool: AsyncConnectionPool[Any],
        queue: QueuePort,
        *,
        metrics: MetricsSink,
        rng: random.Random | None = None,
        acks: AckBatcher | None = None,
    ) -> None:
        """``acks`` batches the acknowledgements of finished jobs; without it each is acked
        right after its commit."""
        self._app = app
        self._pool = pool
        self._queue = queue
        self._metrics = metrics
        self._rng = rng if rng is not None else random.Random()
        self._acks = acks
        self._transactional = queue.capabilities.transactional

    async def handle(
        self,
        delivery: Delivery,
        conn: AsyncConnection[Any] | None = None,
        ahead: Lookahead | None = None,
    ) -> Outcome:
        """Process one delivery; raises :class:`InfrastructureError` if the database is gone.

        The work transaction runs on ``conn`` when given (an idle autocommit connection the
        caller holds across jobs), else on a connection from the pool. With ``ahead`` (only
        with ``conn``), a job's COMMIT travels with the next waiting job's BEGIN and fence
        insert; the caller then handles ``ahead.next()`` on the same connection."""
        started = ahead.resume(delivery) if ahead is not None else None
        if started is not None:
            job = started.job
        else:
            prepared = self._prepare(delivery)
            if isinstance(prepared, PoisonMessage):
                return await self._poison(conn, delivery, prepared)
            job = prepared

        failure: BaseException | None = None
        for conflict_try in range(CONFLICT_RETRIES + 1):
            try:
                return await self._run(job, conn, ahead, started)
            except (errors.SerializationFailure, errors.DeadlockDetected) as exc:
                failure = exc
                started = None
                if conflict_try < CONFLICT_RETRIES:
                    log.info(
                        "job %s: %s, retrying at once",
                        job.meta.job_id,
                        type(exc).__name__,
                        extra=log_fields(delivery, error_class=type(exc).__name__),
                    )
                    continue
            except InfrastructureError:
                raise
            except Exception as exc:
                failure = exc
            break
        assert failure is not None
        return await self._fail(conn, job.consumer, delivery, failure)

    async def handle_group(
        self, deliveries: Sequence[Delivery], conn: AsyncConnection[Any]
    ) -> list[Outcome] | None:
        """Run several deliveries of consumers with ``jobs_per_transaction`` > 1 in one
        transaction on ``conn`` (an idle autocommit connection): every fence in one statement,
        then each fresh job's handler, then one commit; the outcomes, in order.

        None when nothing committed and nothing was acked, because a delivery is poison or a
        handler (or the commit) failed: the caller then runs each delivery with :meth:`handle`,
        whose failure policy applies to each job on its own. Raises :class:`InfrastructureError`
        if the database is gone (nothing committed, or the commit's fate went with it)."""
        jobs: list[Job] = []
        for delivery in deliveries:
            prepared = self._prepare(delivery)
            if isinstance(prepared, PoisonMessage):
                return None
            jobs.append(prepared)
        first = jobs[0].meta
        try:
            fresh = await self._group_transaction(jobs, conn)
        except Exception as exc:
            if is_connection_loss(exc, conn):
                raise InfrastructureError(str(exc)) from exc
            self._metrics.job_group(first.queue, first.consumer, "rolled_back")
            text = str(exc).strip()
            log.info(
                "a group of %d jobs rolled back (%s: %s); running them one transaction each",
                len(jobs),
                error_class_of(exc),
                text.splitlines()[0][:300] if text else "",
                extra={"group_size": len(jobs), "error_class": error_class_of(exc)},
            )
            return None
        self._metrics.job_group(first.queue, first.consumer, "committed")
        outcomes: list[Outcome] = []
        for job, ran in zip(jobs, fresh, strict=True):
            await self._ack(job.delivery)
            outcomes.append(self._succeeded(job, ran))
        return outcomes

    async def _group_transaction(self, jobs: list[Job], conn: AsyncConnection[Any]) -> list[bool]:
        """Fences, handlers, commit, for a group; which jobs ran (the others are duplicates)."""
        metas = [job.meta for job in jobs]
        tx, cur = await Tx.begin(
            conn,
            SQL["fence_insert_group"],
            {
                "job_ids": [meta.job_id for meta in metas],
                "consumers": [meta.consumer for meta in metas],
                "tenant_ids": [meta.tenant_id for meta in metas],
                "ttls": [job.consumer.fence_ttl for job in jobs],
            },
        )
        try:
            inserted = {(job_id, consumer) for job_id, consumer in await cur.fetchall()}
            fresh: list[bool] = []
            for job, meta in zip(jobs, metas, strict=True):
                key = (meta.job_id, meta.consumer)
                ran = key in inserted
                inserted.discard(key)  # the same key again in this group is a duplicate
                fresh.append(ran)
                if ran:
                    await self._run_handler(job, conn)
        except BaseException as exc:
            await tx.rollback(exc)
            raise
        await tx.commit()
        return fresh

    async def _run_handler(self, job: Job, conn: AsyncConnection[Any]) -> None:
        """The handler, timed; a database error it caught leaves nothing to commit."""
        meta = job.meta
        begun = time.perf_counter()
        try:
            await job.consumer.handler(job.payload, meta, conn)
        finally:
            self._metrics.handler_duration(meta.queue, meta.consumer, time.perf_counter() - begun)
        if conn.pgconn.transaction_status == TransactionStatus.INERROR:
            raise TransactionAborted(
                "the handler returned after a database error aborted its transaction"
                " (caught, not raised): nothing of this job can commit"
            )

    def _prepare(self, delivery: Delivery) -> Job | PoisonMessage:
        """Decode and validate: the job to run, or why the delivery is poison (D6)."""
        message = delivery.message
        consumer = self._app.get(message.consumer)
        if consumer is None:
            return PoisonMessage(
                f"no consumer named {message.consumer!r} is registered",
                error_class="UnknownConsumer",
            )
        try:
            payload = consumer.schema.model_validate(decode_body(message.body))
        except PoisonMessage as exc:
            return exc
        except ValidationError as exc:
            return PoisonMessage(
                f"payload does not match {consumer.schema.__name__}: {exc}",
                error_class="SchemaInvalid",
            )
        meta = JobMeta(
            job_id=message.job_id,
            consumer=consumer.name,
            queue=message.queue,
            tenant_id=message.tenant_id,
            correlation_id=message.correlation_id,
            attempt=delivery.attempt,
        )
        return Job(delivery, consumer, payload, meta)

    async def _run(
        self,
        job: Job,
        held: AsyncConnection[Any] | None,
        ahead: Lookahead | None,
        started: Started | None,
    ) -> Outcome:
        conn = held
        try:
            if conn is not None:
                fresh = await self._transaction(job, conn, ahead, started)
            else:
                async with self._pool.connection() as conn:
                    fresh = await self._transaction(job, conn, None, None)
        except Exception as exc:
            if is_connection_loss(exc, conn):
                raise InfrastructureError(str(exc)) from exc
            raise
        # Committed: now the message can go ("commit; ack"). A crash before the ack lands
        # redelivers it after its lease, and the fence turns that delivery into a duplicate.
        await self._ack(job.delivery)
        return self._succeeded(job, fresh)

    def _succeeded(self, job: Job, fresh: bool) -> Outcome:
        """Count and log a committed job: it ran (``fresh``) or was a duplicate."""
        meta = job.meta
        outcome = Outcome.SUCCEEDED if fresh else Outcome.DUPLICATE
        self._metrics.job_outcome(meta.queue, meta.consumer, outcome)
        # A duplicate is normal operation (spec behaviour 2): DEBUG, like a success. The hot
        # path builds the log record's fields only when DEBUG is on.
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "job %s for %s %s",
                meta.job_id,
                meta.consumer,
                "succeeded" if fresh else "already processed: skipped",
                extra=log_fields(job.delivery, outcome),
            )
        return outcome

    async def _transaction(
        self,
        job: Job,
        conn: AsyncConnection[Any],
        ahead: Lookahead | None,
        started: Started | None,
    ) -> bool:
        """Fence, handler, commit; True if the handler ran (False: a duplicate). ``started``:
        the transaction and fence result a previous job's commit opened for this one."""
        if started is not None:
            tx, fresh = started.tx, started.fresh
        else:
            tx, cur = await Tx.begin(conn, SQL["fence_insert"], _fence_params(job))
            fresh = await cur.fetchone() is not None
        try:
            if fresh:
                await self._run_handler(job, conn)
        except BaseException as exc:
            if await tx.rollback(exc):
                return fresh  # a psycopg.Rollback, swallowed as conn.transaction() does
            raise
        following = self._next_job(ahead)
        if following is None:
            await tx.commit()
            return fresh
        assert ahead is not None
        try:
            next_tx, cur = await tx.commit_then_begin(SQL["fence_insert"], _fence_params(following))
            next_fresh = await cur.fetchone() is not None
        except NextBeginFailed:
            ahead.hold(following.delivery)  # committed; the next job starts on its own
            return fresh
        except BaseException:
            ahead.hold(following.delivery)
            raise  # this job's COMMIT failed, or its outcome went with the connection
        ahead.hold(following.delivery, Started(following, next_tx, next_fresh))
        return fresh

    def _next_job(self, ahead: Lookahead | None) -> Job | None:
        """The next waiting job, valid, to start with this one's commit; a poison one, or one
        of a consumer that commits jobs in groups, is held for the caller to handle."""
        if ahead is None:
            return None
        delivery = ahead.take()
        if delivery is None:
            return None
        prepared = self._prepare(delivery)
        if isinstance(prepared, PoisonMessage) or prepared.consumer.jobs_per_transaction > 1:
            ahead.hold(delivery)  # poison, or the first of a group: the caller's to start
            return None
        return prepared

    async def _ack(self, delivery: Delivery) -> None:
        if self._acks is not None:
            self._acks.add(delivery)
        else:
            await self._guard(self._queue.ack(delivery))

    async def _fail(
        self,
        conn: AsyncConnection[Any] | None,
        consumer: Consumer[Any],
        delivery: Delivery,
        exc: BaseException,
    ) -> Outcome:
        policy = consumer.retry
        message = delivery.message
        text = describe_error(exc)
        if not _is_permanent(exc, policy) and delivery.attempt < policy.max_deliveries:
            delay = policy.delay(delivery.attempt, self._rng)
            if not await self._guard(self._queue.retry(delivery, delay_seconds=delay, error=text)):
                return self._lease_lost(delivery, exc)
            self._metrics.job_outcome(message.queue, message.consumer, Outcome.RETRIED)
            log.info(
                "job %s for %s failed (attempt %d of %d), retrying in %.1fs: %s",
                message.job_id,
                message.consumer,
                delivery.attempt,
                policy.max_deliveries,
                delay,
                error_class_of(exc),
                extra=log_fields(
                    delivery,
                    Outcome.RETRIED,
                    error_class=error_class_of(exc),
                    retry_in_seconds=round(delay, 3),
                ),
            )
            return Outcome.RETRIED
        if not await self._write_dead_letter(conn, delivery, error_class_of(exc), text):
            return self._lease_lost(delivery, exc)
        self._metrics.job_outcome(message.queue, message.consumer, Outcome.DEAD_LETTERED)
        log.warning(
            "job %s for %s dead-lettered after %d attempt(s): %s",
            message.job_id,
            message.consumer,
            delivery.attempt,
            error_class_of(exc),
            extra=log_fields(delivery, Outcome.DEAD_LETTERED, error_class=error_class_of(exc)),
        )
        return Outcome.DEAD_LETTERED

    async def _poison(
        self, conn: AsyncConnection[Any] | None, delivery: Delivery, exc: PoisonMessage
    ) -> Outcome:
        message = delivery.message
        written = await self._write_dead_letter(
            conn, delivery, exc.error_class, f"{exc.error_class}: {exc.reason}"
        )
        # Metric labels stay bounded: a message may name any consumer, registered or not.
        label = message.consumer if self._app.get(message.consumer) else UNKNOWN_CONSUMER_LABEL
        if not written:
            return self._lease_lost(delivery, exc, label=label)
        self._metrics.job_outcome(message.queue, label, Outcome.POISON)
        log.warning(
            "job %s for %s is poison, dead-lettered without retry: %s",
            message.job_id,
            message.consumer,
            exc.reason[:300],
            extra=log_fields(delivery, Outcome.POISON, error_class=exc.error_class),
        )
        return Outcome.POISON

    def _lease_lost(
        self, delivery: Delivery, exc: BaseException, *, label: str | None = None
    ) -> Outcome:
        message = delivery.message
        self._metrics.job_outcome(message.queue, label or message.consumer, Outcome.LEASE_LOST)
        log.warning(
            "job %s for %s failed after its lease ran out (%s): another worker holds it now,"
            " so this one neither retries nor dead-letters it; raise --lease-seconds above the"
            " handler's longest run",
            message.job_id,
            message.consumer,
            error_class_of(exc),
            extra=log_fields(delivery, Outcome.LEASE_LOST, error_class=error_class_of(exc)),
        )
        return Outcome.LEASE_LOST

    async def _write_dead_letter(
        self, held: AsyncConnection[Any] | None, delivery: Delivery, error_class: str, text: str
    ) -> bool:
        """Write the dead letter (and its alert, and the ack with a transactional queue) in one
        transaction, on ``held`` when the caller holds a connection, else on a pooled one.

        With a transactional queue the ack goes first: if this delivery's lease was lost (the
        message went to another worker), nothing is written and it returns False. Another
        queue is acked after the commit, and a lost lease there is not seen."""
        message = delivery.message
        payload_text, encoding = stored_payload(message.body)
        params = {
            "job_id": message.job_id,
            "queue": message.queue,
            "consumer": message.consumer,
            "tenant_id": message.tenant_id,
            "payload": payload_text,
            "payload_encoding": encoding,
            "attempts": delivery.attempt,
            "last_error": text[:MAX_ERROR_CHARS],
            "error_class": error_class[:200],
            "correlation_id": message.correlation_id,
        }

        async def write() -> bool:
            lease = self._pool.connection() if held is None else contextlib.nullcontext(held)
            async with lease as conn, conn.transaction():
                if self._transactional and not await self._queue.ack(delivery, tx=conn):
                    return False
                cur = await conn.execute(SQL["dead_letter_insert"], params)
                inserted = await cur.fetchone()
                if inserted is not None:  # not a redelivered failure already pending (D5)
                    # Behaviour 4: the alert is recorded with the dead letter, same commit.
                    await record_dead_letter_alerts(conn, [inserted[0]])
            if not self._transactional:
                await self._queue.ack(delivery)
            return True

        return await self._guard(write())

    @staticmethod
    async def _guard(action: Awaitable[T]) -> T:
        """Run a queue or database action; turn a lost connection into InfrastructureError."""
        try:
            return await action
        except Exception as exc:
            if is_connection_loss(exc, None):
                raise InfrastructureError(str(exc)) from exc
            raise
