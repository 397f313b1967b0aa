r"""One delivery, from bytes to exactly one effect or one dead letter.

    decode/validate -> transaction(fence insert, handler) -> commit -> ack (batched)
                    \-> poison: dead letter at once (D6)
    on failure: roll back, then hard -> dead letter; transient -> retry or, exhausted, dead letter
    a retry with a delay on a queue without native delayed retry: outbox row -> commit -> ack
    identifiers that break a limit (jobfence.limits): UnfenceableMessage dead letter at once
    an error inside jobfence itself, again at delivery INTERNAL_FAILURE_DELIVERIES: InternalFailure

While the handler runs, its connection refuses every call that would end the transaction
(jobfence.guard); once one was refused the job fails as TransactionMisuse, decided here after the
handler, whatever the handler did with the refusal.

The fence row is inserted first (``ON CONFLICT DO NOTHING``): a concurrent duplicate blocks on
the uncommitted key and, once the first commits, finds it and skips. There is no "in progress"
state that could get stuck: a crash rolls the whole transaction back, fence included.

A consumer with a plain ``def`` handler (``Consumer.sync``) differs in one step only: its
"transaction(fence insert, handler) -> commit" runs in a worker thread, through the
:class:`~jobfence.sync.SyncExecutor` given as ``sync``; everything else here is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import os
import random
import re
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection, errors
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, ValidationError

from jobfence import outbox, tracing
from jobfence._sql import Queries
from jobfence.acks import AckBatcher
from jobfence.alerts.outbox import record_dead_letter_alerts
from jobfence.app import App, Consumer
from jobfence.blocked_loop import RUNNING_HANDLERS
from jobfence.codec import (
    decode_body,
    describe_validation_error,
    kept_whole,
    stored_payload,
    unfenceable,
)
from jobfence.db import is_connection_loss, is_read_only, refused_after_first_write
from jobfence.errors import HandlerExited, HardFailure, PoisonMessage, TransactionMisuse
from jobfence.guard import (
    COMMITTED_IN_GROUP,
    after_handler,
    check_held_now,
    guarded,
    not_held,
    retire,
    session_changed,
)
from jobfence.limits import (
    MAX_ATTEMPT,
    UNFENCEABLE,
    recordable_attempt,
    shown_value,
    storable_text,
)
from jobfence.model import Delivery, JobMeta
from jobfence.pgtx import SET_READ_COMMITTED, Check, CommitRefused, NextBeginFailed, Tx
from jobfence.ports import MetricsSink, QueuePort
from jobfence.retry import RetryPolicy
from jobfence.sync import RUNNING_JOB, FenceConnection, PsycopgRunner, SyncExecutor, SyncOpen

log = logging.getLogger("jobfence.harness")

SQL = Queries("jobfence.sql", "core.sql")
FENCE_HELD: Check = SQL.text("fence_held").encode()

MAX_ERROR_CHARS = 4000
MAX_TRACEBACK_FRAMES = 15
# jobfence's own transactions beside a job's work (a dead letter with its ack, a retry through the
# outbox) are written for READ COMMITTED, whatever the database's default isolation level
# (SET_READ_COMMITTED); the work transaction (fence and handler) keeps that default: it is the
# application's.
# Serialization failures and deadlocks are retried at once, without counting an attempt (D7).
CONFLICT_RETRIES = 3
UNKNOWN_CONSUMER_LABEL = "<unknown>"
# A job whose handling fails inside jobfence (not in its handler: the dead letter or the retry
# cannot be written, say) stays leased and comes back when its lease runs out. The delivery
# that fails so with this attempt number or a later one is dead-lettered by a fallback that
# keeps the whole message and stores only bounded identifiers.
INTERNAL_FAILURE_DELIVERIES = 3
INTERNAL_FAILURE = "InternalFailure"
# A delivery whose attempt number is above its consumer's max_deliveries by more than this
# follows deliveries that ended with no outcome at all (its worker was killed, or its handler
# hung past the lease, each time): it is dead-lettered without running, unless its fence says
# it succeeded meanwhile. A job that kills its worker thus ends as a dead letter instead of
# taking workers down for ever.
DELIVERY_LIMIT_SLACK = 3
DELIVERY_LIMIT = "DeliveryLimitExceeded"
# Internal-failure ERROR lines: at most this many a minute, then one line counting the rest.
INTERNAL_LOG_PER_MINUTE = 10
# Frames of jobfence's own files are left out of the front of a failure's traceback.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

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
    # Handling failed inside jobfence, not in the handler: the job stays leased and comes back
    # (INTERNAL_FAILURE_DELIVERIES), or its fallback dead letter could not be written either.
    INTERNAL_ERROR = "internal_error"


# The outcome a process span records (jobfence.outcome).
_TRACE_OUTCOMES = {
    Outcome.SUCCEEDED: "succeeded",
    Outcome.DUPLICATE: "duplicate",
    Outcome.RETRIED: "retry",
    Outcome.DEAD_LETTERED: "dead_letter",
    Outcome.POISON: "poison",
}


class InfrastructureError(Exception):
    """The database went away mid-job: the worker releases the job and reconnects (D7)."""


def log_fields(delivery: Delivery, outcome: str | None = None, **more: object) -> dict[str, object]:
    """The structured fields of a job event's log line (pass as ``extra=``): job_id, consumer,
    queue, tenant_id, correlation_id, attempt, and the outcome when there is one."""
    message = delivery.message
    fields: dict[str, object] = {
        "job_id": shown_value(message.job_id),
        "consumer": shown_value(message.consumer),
        "queue": shown_value(message.queue),
        "tenant_id": shown_value(message.tenant_id),
        "correlation_id": shown_value(message.correlation_id),
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


# A data exception (SQLSTATE class 22): PostgreSQL refused a value, and its message quotes it
# (``invalid input syntax for type integer: "alice@example.com"``), often a payload's.
_DATA_EXCEPTION = "22"
_QUOTED = re.compile(r'".*"', re.DOTALL)
_BYTES = re.compile(r"0x[0-9a-fA-F]{2}(?: 0x[0-9a-fA-F]{2})*")


def told_message(exc: BaseException) -> str:
    """An exception's message as jobfence tells it (log lines, a dead letter's ``last_error``,
    the incidents quoting it), never quoting a value of the job: a pydantic ValidationError by
    its fields and errors (:func:`~jobfence.codec.describe_validation_error`); a psycopg data
    exception by its primary message with the value it quotes as ``<value>`` (from the first
    double quote to the last; bytes as ``<bytes>``) and its SQLSTATE, without the detail and
    context lines that quote it too, also when an ORM wraps it (SQLAlchemy's ``orig``, whose
    message quotes the statement's parameters; Django's ``__cause__``). Any other as
    ``str(exc)``."""
    if isinstance(exc, ValidationError):
        return describe_validation_error(exc)
    if isinstance(exc, psycopg.Error):
        if (exc.sqlstate or "").startswith(_DATA_EXCEPTION):
            primary = _BYTES.sub("<bytes>", _QUOTED.sub("<value>", exc.diag.message_primary or ""))
            return f"{' '.join(primary.split())} [SQLSTATE {exc.sqlstate}]"
        return str(exc)
    wrapped = getattr(exc, "orig", None) or exc.__cause__
    if isinstance(wrapped, psycopg.Error) and (wrapped.sqlstate or "").startswith(_DATA_EXCEPTION):
        return f"({error_class_of(wrapped)}) {told_message(wrapped)}"
    return str(exc)


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (:func:`told_message`), at most ``limit``
    characters, for a log line."""
    text = told_message(exc).strip()
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def describe_error(exc: BaseException) -> str:
    """``Class: message`` plus a trimmed traceback, bounded in size, storable as text.

    The traceback starts at the first frame outside jobfence (the handler's own code), unless
    every frame is jobfence's."""
    # Told without the values it quotes (a ValidationError, a data exception): told_message.
    head = f"{error_class_of(exc)}: {told_message(exc)}"
    frames: list[traceback.FrameSummary] = list(traceback.extract_tb(exc.__traceback__))
    skip = 0
    while skip < len(frames) and frames[skip].filename.startswith(_PACKAGE_DIR):
        skip += 1
    if skip < len(frames):
        frames = frames[skip:]
    frames = frames[-MAX_TRACEBACK_FRAMES:]
    tail = "".join(traceback.format_list(frames))
    text = f"{head}\nTraceback (most recent call last, trimmed):\n{tail}" if frames else head
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 20] + "\n... (trimmed)"
    return storable_text(text)


class _Throttle:
    """At most ``per_minute`` log lines a minute; counts the ones it holds back."""

    def __init__(self, per_minute: int) -> None:
        self._per_minute = per_minute
        self._window = -60.0
        self._sent = 0
        self._held = 0

    def allow(self) -> tuple[bool, int]:
        """Whether to log now, and how many lines were held back since the last one logged."""
        now = time.monotonic()
        if now - self._window >= 60.0:
            self._window, self._sent = now, 0
        if self._sent >= self._per_minute:
            self._held += 1
            return False, 0
        self._sent += 1
        held, self._held = self._held, 0
        return True, held


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


def _over_limit(job: Job) -> bool:
    """The delivery's attempt is past what its consumer's policy can reach with outcomes."""
    return job.delivery.attempt > job.consumer.retry.max_deliveries + DELIVERY_LIMIT_SLACK


@dataclass(frozen=True, slots=True)
class Started:
    """A job whose transaction is open with its fence insert done (``fresh``: inserted): on the
    processor's connection (``Tx``), or, for a sync handler, on a connection of the sync pool."""

    job: Job
    tx: Tx | SyncOpen
    fresh: bool


class Lookahead:
    """What a worker's processor lends the harness while it holds a connection across jobs:
    ``take`` gives the next waiting delivery (or None), already counted as the processor's.

    When a job commits and another is waiting, the harness sends the COMMIT together with the
    next job's BEGIN and fence insert (one round trip instead of two) and holds the next job
    here, started or not; the processor handles :meth:`next` right after, on the same
    connection, and gives it back if it cannot.

    A sync handler's job must know the next one before its thread runs the handler:
    ``take_spare`` gives a waiting delivery only when taking it early cannot keep it from
    another processor that would be idle (the worker: when the buffer holds one for each)."""

    __slots__ = ("_held", "_spare", "_started", "_take")

    def __init__(
        self,
        take: Callable[[], Delivery | None],
        take_spare: Callable[[], Delivery | None] | None = None,
    ) -> None:
        self._take = take
        self._spare = take_spare
        self._held: Delivery | None = None
        self._started: Started | None = None

    def take(self) -> Delivery | None:
        if self._held is not None:
            return None  # one job ahead at most
        return self._take()

    def take_spare(self) -> Delivery | None:
        """:meth:`take`, before the current job's handler runs: only a spare delivery."""
        if self._held is not None or self._spare is None:
            return None
        return self._spare()

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
                if isinstance(started.tx, SyncOpen):
                    await asyncio.to_thread(started.tx.abandon)  # at most once
                else:
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


def _group_params(jobs: Sequence[Job]) -> dict[str, Any]:
    metas = [job.meta for job in jobs]
    return {
        "job_ids": [meta.job_id for meta in metas],
        "consumers": [meta.consumer for meta in metas],
        "tenant_ids": [meta.tenant_id for meta in metas],
        "ttls": [job.consumer.fence_ttl for job in jobs],
    }


def _held_check(fresh: Sequence[bool]) -> Check | None:
    """The ``fence_held`` check to send with the COMMIT once a handler ran (None when none
    did: a transaction of duplicates only). The fence statement marked the transaction when it
    inserted a row; a handler that ended the transaction took the mark with it."""
    return FENCE_HELD if any(fresh) else None


def _group_fresh(jobs: Sequence[Job], rows: Sequence[Sequence[object]]) -> list[bool]:
    """Which jobs of a group ``fence_insert_group`` inserted (its rows); the others, and the
    same key listed again in the group, are duplicates."""
    inserted = {(job_id, consumer) for job_id, consumer, _held in rows}
    fresh: list[bool] = []
    for job in jobs:
        key = (job.meta.job_id, job.meta.consumer)
        fresh.append(key in inserted)
        inserted.discard(key)
    return fresh


def refuse_unrun(consumer: str, returned: object, *, sync: bool) -> None:
    """Raise ``TypeError`` when a handler returned work it did not run: an awaitable (an
    ``async def`` handler's ``return tx.execute(...)`` without ``await``, or a sync handler
    returning a coroutine) or a generator. Its job would otherwise be fenced and acked with
    nothing applied; it fails instead, its transaction rolled back. Anything else a handler
    returns is ignored."""
    if inspect.isawaitable(returned):
        if inspect.iscoroutine(returned):
            returned.close()  # never run: no "never awaited" warning on top
        if sync:
            raise TypeError(
                f"the sync handler of consumer {consumer!r} returned an awaitable: declare"
                " it `async def` to get an AsyncConnection"
            )
        raise TypeError(
            f"the handler of consumer {consumer!r} returned an awaitable it did not await:"
            " `await` it (its work never ran)"
        )
    if inspect.isgenerator(returned) or inspect.isasyncgen(returned):
        if inspect.isgenerator(returned):
            returned.close()
        raise TypeError(
            f"the handler of consumer {consumer!r} returned a generator, whose body never ran:"
            " run the work in the handler"
        )


def _handler_exited(consumer: str, exc: BaseException, *, sync: bool) -> HandlerExited:
    """The failure of a job whose handler raised ``exc``, which is not an ``Exception``
    (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``, or an ``asyncio.CancelledError``
    of its own): it stops nothing but its job, which fails like with any other error."""
    text = str(exc).strip()
    own = " while its worker was not cancelled" if isinstance(exc, asyncio.CancelledError) else ""
    return HandlerExited(
        f"the {'sync ' if sync else ''}handler of consumer {consumer!r} raised"
        f" {type(exc).__name__}{own}{': ' + text.splitlines()[0][:200] if text else ''}; it stops"
        " nothing but its job, which fails (its transaction rolled back, fence included)"
    )


def _being_cancelled() -> bool:
    """Whether the running task has a cancellation requested (``Task.cancelling()``): a
    ``CancelledError`` is then the worker's own, which must go on up, not a handler's."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _call_sync(job: Job, tx: object) -> object:
    """A sync handler's call, in its worker thread. What it raises that is not an ``Exception``
    (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``, ``asyncio.CancelledError``) can
    stop nothing there but its job: it fails the job as :class:`~jobfence.HandlerExited`
    instead of reaching the event loop, where it would stop the worker or end a processor.
    While it runs, :data:`jobfence.sync.RUNNING_JOB` is the job's meta."""
    running = RUNNING_JOB.set(job.meta)
    try:
        return job.consumer.handler(job.payload, job.meta, tx)  # type: ignore[arg-type]
    except Exception:
        raise
    except BaseException as exc:
        raise _handler_exited(job.consumer.name, exc, sync=True) from exc
    finally:
        RUNNING_JOB.reset(running)


def _sync_work(
    jobs: list[Job],
    fenced: list[bool] | None,
    timings: list[tuple[JobMeta, float]],
    with_commit: bool,
) -> Callable[[Sequence[Sequence[object]], object], list[bool]]:
    """The work of a sync transaction (:data:`jobfence.sync.Work`): the handlers of ``jobs``
    whose fences were inserted, timed into ``timings``, then the ``fence_held`` check, left
    for the COMMIT when ``with_commit`` (a :class:`PsycopgRunner`), else sent now."""

    def work(rows: Sequence[Sequence[object]], tx: object) -> list[bool]:
        """In the worker thread, inside the transaction, the fences inserted."""
        fresh = [bool(rows)] if len(jobs) == 1 else _group_fresh(jobs, rows)
        if fenced is not None:
            fenced[:] = fresh
        for job, ran in zip(jobs, fresh, strict=True):
            if ran:
                begun = time.perf_counter()
                try:
                    with guarded(tx) as guard:
                        returned = _call_sync(job, tx)
                finally:
                    timings.append((job.meta, time.perf_counter() - begun))
                if returned is not None:
                    refuse_unrun(job.consumer.name, returned, sync=True)
                after_handler(tx, guard)
        check = _held_check(fresh)
        if check is None:
            pass
        elif with_commit and isinstance(tx, FenceConnection):
            tx._jobfence_commit_check = check
        else:
            check_held_now(tx, check)
        return fresh

    return work


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
        sync: SyncExecutor | None = None,
        trace_child: bool = False,
    ) -> None:
        """``acks`` batches the acknowledgements of finished jobs; without it each is acked
        right after its commit. ``sync`` runs the transactions of sync consumers (a worker
        sets it when its queues have any)."""
        self._app = app
        self._pool = pool
        self._queue = queue
        self._metrics = metrics
        self._rng = rng if rng is not None else random.Random()
        self._acks = acks
        self.sync = sync
        self._transactional = queue.capabilities.transactional
        self._delayed_retry = queue.capabilities.delayed_retry
        self._internal_log = _Throttle(INTERNAL_LOG_PER_MINUTE)
        # True: a job's process span is the child of its producer's context, not linked to it.
        self.trace_child = trace_child
        # The deliveries of a group that failed as TransactionMisuse and whose fences its
        # statement inserted (by id, the delivery kept so the id is not reused): each runs
        # alone next, and is dead-lettered there if its fence committed after all.
        self._committed_in_group: dict[int, Delivery] = {}

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
        insert; the caller then handles ``ahead.next()`` on the same connection.

        A failure inside jobfence itself (not the handler's: writing the retry or the dead
        letter failed) goes to :meth:`internal_failure`.

        The job runs under its ``process`` span (:mod:`jobfence.tracing`), which carries its
        outcome."""
        with tracing.process(delivery, child=self.trace_child) as span:
            try:
                outcome = await self._handle(delivery, conn, ahead)
            except InfrastructureError:
                raise
            except Exception as exc:
                if is_connection_loss(exc, conn):
                    raise InfrastructureError(str(exc)) from exc
                tracing.note_error(error_class_of(exc))
                outcome = await self.internal_failure(delivery, exc, conn)
            if span is not None:
                tracing.finish(span, _TRACE_OUTCOMES.get(outcome, str(outcome)))
            return outcome

    async def _handle(
        self,
        delivery: Delivery,
        conn: AsyncConnection[Any] | None,
        ahead: Lookahead | None,
    ) -> Outcome:
        started = ahead.resume(delivery) if ahead is not None else None
        if started is not None:
            job = started.job
        else:
            prepared = self._prepare(delivery)
            if isinstance(prepared, PoisonMessage):
                return await self._poison(conn, delivery, prepared)
            job = prepared
            if _over_limit(job) and not await self._fenced(job, conn):
                return await self._delivery_limit(conn, job)

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
                        shown_value(job.meta.job_id),
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
            if isinstance(prepared, PoisonMessage) or _over_limit(prepared):
                return None
            jobs.append(prepared)
        first = jobs[0].meta
        with tracing.process_group(deliveries) as span:
            fresh = await self._group_run(jobs, conn)
            if span is not None:
                tracing.finish(span, "rolled_back" if fresh is None else "committed")
        if fresh is None:
            return None
        self._metrics.job_group(first.queue, first.consumer, "committed")
        outcomes: list[Outcome] = []
        for job, ran in zip(jobs, fresh, strict=True):
            await self._ack(job.delivery)
            outcomes.append(self._succeeded(job, ran))
        return outcomes

    async def _group_run(self, jobs: list[Job], conn: AsyncConnection[Any]) -> list[bool] | None:
        """The group's transaction; which jobs ran, or None when it rolled back."""
        first = jobs[0].meta
        fenced: list[bool] = []  # which fences the group's statement inserted, once it ran
        try:
            if jobs[0].consumer.sync:  # a group holds one consumer's jobs
                return await self._sync_transaction(jobs, fenced)
            return await self._group_transaction(jobs, conn, fenced)
        except Exception as exc:
            if is_connection_loss(exc, conn) or (jobs[0].consumer.sync and is_read_only(exc)):
                raise InfrastructureError(str(exc)) from exc
            if isinstance(exc, TransactionMisuse):
                # A handler may have committed the group's transaction itself, fences included:
                # each fresh job found fenced when it runs alone was not a duplicate (_run).
                for job, ran in zip(jobs, fenced, strict=False):
                    if ran:
                        self._committed_in_group[id(job.delivery)] = job.delivery
            self._metrics.job_group(first.queue, first.consumer, "rolled_back")
            log.info(
                "a group of %d jobs rolled back (%s: %s); running them one transaction each",
                len(jobs),
                error_class_of(exc),
                first_line(exc, 300),
                extra={"group_size": len(jobs), "error_class": error_class_of(exc)},
            )
            return None

    async def _group_transaction(
        self, jobs: list[Job], conn: AsyncConnection[Any], fenced: list[bool]
    ) -> list[bool]:
        """Fences, handlers, commit, for a group; which jobs ran (the others are duplicates),
        also put in ``fenced`` as soon as the fences are inserted."""
        tx, cur = await Tx.begin(conn, SQL["fence_insert_group"], _group_params(jobs))
        try:
            try:
                fresh = _group_fresh(jobs, await cur.fetchall())
                fenced[:] = fresh
                for job, ran in zip(jobs, fresh, strict=True):
                    if ran:
                        await self._run_handler(job, conn)
            except BaseException as exc:
                await tx.rollback(exc)
                raise
            try:
                await tx.commit(_held_check(fresh))
            except CommitRefused:
                raise not_held() from None
        except BaseException as exc:
            refused_after_first_write(exc)  # after the fence insert: the transaction's own
            raise
        if any(fresh):
            self._keep_session(jobs, conn)
        return fresh

    async def _sync_transaction(
        self,
        jobs: list[Job],
        fenced: list[bool] | None = None,
        *,
        ahead: Lookahead | None = None,
        started: Started | None = None,
    ) -> list[bool]:
        """Fence(s), sync handler(s), commit, in a worker thread through ``self.sync`` (one job,
        or a group of one consumer's jobs); which jobs ran (the others are duplicates), also
        put in ``fenced`` as soon as the fences are inserted.

        One job with ``ahead``, on a runner that chains (:attr:`SyncExecutor.chains`): its
        COMMIT travels with the next spare sync job's BEGIN and fence insert, as
        :meth:`_transaction` does; ``started``: the transaction a previous job's commit
        opened for this one."""
        if self.sync is None:
            raise RuntimeError(
                f"consumer {jobs[0].consumer.name!r} has a sync handler, and this harness has no"
                " sync executor (a Worker sets one up)"
            )
        if len(jobs) == 1:
            fence_sql, params = SQL.text("fence_insert"), _fence_params(jobs[0])
        else:
            fence_sql, params = SQL.text("fence_insert_group"), _group_params(jobs)
        timings: list[tuple[JobMeta, float]] = []
        if fenced is None:
            fenced = []  # filled when the work begins: the fence insert was done
        # PsycopgRunner sends the fence_held check with its COMMIT; another runner commits on
        # its own, so the check runs at the end of the work, a round trip more.
        work = _sync_work(jobs, fenced, timings, isinstance(self.sync.runner, PsycopgRunner))
        opened = started.tx if started is not None and isinstance(started.tx, SyncOpen) else None
        following = None
        if len(jobs) == 1 and self.sync.chains:
            following = self._next_job(ahead, sync=True)
        try:
            if not self.sync.chains:
                return await self.sync.run(fence_sql, params, work)
            then = None if following is None else (fence_sql, _fence_params(following))
            fresh, begun, changed = await self.sync.run_ahead(fence_sql, params, work, opened, then)
        except CommitRefused:
            if following is not None:
                assert ahead is not None
                ahead.hold(following.delivery)  # nothing committed; it starts on its own
            raise not_held() from None
        except BaseException as exc:
            if fenced:
                refused_after_first_write(exc)
            if following is not None:
                assert ahead is not None
                ahead.hold(following.delivery)
            raise
        finally:
            for meta, seconds in list(timings):
                self._metrics.handler_duration(meta.queue, meta.consumer, seconds)
        if changed:
            self._session_changed(jobs, changed)  # the runner retired its connection
        if following is not None:
            assert ahead is not None
            started_next = None if begun is None else Started(following, begun, begun.fresh)
            ahead.hold(following.delivery, started_next)
        return fresh

    async def _run_handler(self, job: Job, conn: AsyncConnection[Any]) -> None:
        """The handler, timed, on ``conn`` lent (jobfence.guard): a call it was refused, or a
        transaction it ended or doomed, fails the job whatever the handler did afterwards."""
        meta = job.meta
        begun = time.perf_counter()
        running = None
        try:
            with guarded(conn) as guard:
                running = job.consumer.handler(job.payload, meta, conn)  # type: ignore[arg-type]
                # Names the job to the blocked-loop watchdog while the handler runs.
                RUNNING_HANDLERS[id(running)] = (running, meta)
                returned = await running  # type: ignore[misc]
        except Exception:
            raise
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and _being_cancelled():
                raise  # the worker's own cancellation (shutdown, a lost lease): not the job's
            raise _handler_exited(meta.consumer, exc, sync=False) from exc
        finally:
            RUNNING_HANDLERS.pop(id(running), None)
            self._metrics.handler_duration(meta.queue, meta.consumer, time.perf_counter() - begun)
        if returned is not None:
            refuse_unrun(meta.consumer, returned, sync=False)
        after_handler(conn, guard)

    def _prepare(self, delivery: Delivery) -> Job | PoisonMessage:
        """Decode and validate: the job to run, or why the delivery is poison (D6)."""
        message = delivery.message
        if delivery.unreadable is not None:
            return PoisonMessage(
                f"the message cannot be read as it was published: {delivery.unreadable}",
                error_class=UNFENCEABLE,
            )
        attempt = delivery.attempt
        if (
            isinstance(attempt, bool)
            or not isinstance(attempt, int)
            or not 1 <= attempt <= MAX_ATTEMPT
        ):
            return PoisonMessage(
                f"its attempt {attempt!r} is not from 1 to {MAX_ATTEMPT} (the queue adapter"
                " gave a delivery count it cannot have)",
                error_class=UNFENCEABLE,
            )
        reason = unfenceable(message)
        if reason is not None:
            return PoisonMessage(reason, error_class=UNFENCEABLE)
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
            # Names the fields and the errors, never a value: the dead letter keeps the payload.
            return PoisonMessage(
                f"payload does not match {consumer.schema.__name__}:"
                f" {describe_validation_error(exc, consumer.schema)}",
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
        in_group = self._committed_in_group.pop(id(job.delivery), None) is job.delivery
        try:
            if job.consumer.sync:
                fresh = (await self._sync_transaction([job], ahead=ahead, started=started))[0]
            elif conn is not None:
                fresh = await self._transaction(job, conn, ahead, started)
            else:
                async with self._pool.connection() as conn:
                    fresh = await self._transaction(job, conn, None, None)
        except Exception as exc:
            # A sync handler's transaction ran on a connection of the sync pool, not on
            # ``conn``: a read-only refusal there is judged without it (jobfence's fence insert
            # is the transaction's first write, so on a read-only server it is refused first).
            if is_connection_loss(exc, conn) or (job.consumer.sync and is_read_only(exc)):
                raise InfrastructureError(str(exc)) from exc
            raise
        if in_group and not fresh:
            raise TransactionMisuse(COMMITTED_IN_GROUP)
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
                shown_value(meta.job_id),
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
        if started is not None and isinstance(started.tx, Tx):
            tx, fresh = started.tx, started.fresh
        else:
            tx, cur = await Tx.begin(conn, SQL["fence_insert"], _fence_params(job))
            fresh = await cur.fetchone() is not None
        try:
            try:
                if fresh:
                    await self._run_handler(job, conn)
            except BaseException as exc:
                # A psycopg.Rollback too: it rolled back the fence with the work, so nothing of
                # the job committed; it fails the job like any other exception (docs/concepts.md).
                await tx.rollback(exc)
                raise
            check = _held_check([fresh])
            following = self._next_job(ahead)
            if following is None:
                try:
                    await tx.commit(check)
                except CommitRefused:
                    raise not_held() from None
                if fresh:
                    self._keep_session([job], conn)
                return fresh
            assert ahead is not None
            try:
                next_tx, cur = await tx.commit_then_begin(
                    SQL["fence_insert"], _fence_params(following), check
                )
                next_fresh = await cur.fetchone() is not None
            except NextBeginFailed:
                ahead.hold(following.delivery)  # committed; the next job starts on its own
                if fresh:
                    self._keep_session([job], conn)
                return fresh
            except CommitRefused:
                ahead.hold(following.delivery)  # nothing committed; the next job starts on its own
                raise not_held() from None
            except BaseException:
                ahead.hold(following.delivery)
                raise  # this job's COMMIT failed, or its outcome went with the connection
            if fresh and not self._keep_session([job], conn):
                # Begun on the session the handler changed: rolled back, it starts on another.
                with contextlib.suppress(psycopg.Error):
                    await next_tx.rollback()
                ahead.hold(following.delivery)
                return fresh
            ahead.hold(following.delivery, Started(following, next_tx, next_fresh))
            return fresh
        except BaseException as exc:
            refused_after_first_write(exc)  # after the fence insert: the transaction's own
            raise

    def _keep_session(self, jobs: Sequence[Job], conn: AsyncConnection[Any]) -> bool:
        """After the transaction of ``jobs`` committed on ``conn``: False, ``conn`` retired and
        the change logged, when a handler changed a setting for the whole session."""
        changed = session_changed(conn)
        if not changed:
            return True
        retire(conn)
        self._session_changed(jobs, changed)
        return False

    def _session_changed(self, jobs: Sequence[Job], changed: Sequence[str]) -> None:
        """Log a change :func:`session_changed` found once ``jobs`` committed (one job, or
        a group: one of its handlers); names the settings, never their values."""
        job = jobs[0]
        which = (
            f"job {shown_value(job.meta.job_id)}: the handler"
            if len(jobs) == 1
            else f"a group of {len(jobs)} jobs from {shown_value(job.meta.job_id)}: a handler"
        )
        log.warning(
            "%s of consumer %s changed %s for the whole session (a SET without LOCAL); the"
            " jobs after it on that connection would run with it, so the connection is closed"
            " and replaced (the job itself committed); use SET LOCAL",
            which,
            job.consumer.name,
            ", ".join(changed),
            extra=log_fields(job.delivery, setting=",".join(changed)),
        )

    def _next_job(self, ahead: Lookahead | None, *, sync: bool = False) -> Job | None:
        """The next waiting job, valid, to start with this one's commit (``sync``: this one's
        handler is sync, and the next is taken before it runs, only a spare one); a poison one,
        one of a consumer that commits jobs in groups or whose handler is not of this one's
        kind, is held for the caller to handle."""
        if ahead is None:
            return None
        delivery = ahead.take_spare() if sync else ahead.take()
        if delivery is None:
            return None
        prepared = self._prepare(delivery)
        if (
            isinstance(prepared, PoisonMessage)
            or prepared.consumer.jobs_per_transaction > 1
            or prepared.consumer.sync != sync
            or _over_limit(prepared)
        ):
            # Poison, the first of a group, another kind, over the delivery limit: the caller's.
            ahead.hold(delivery)
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
        tracing.note_error(error_class_of(exc))
        if not _is_permanent(exc, policy) and delivery.attempt < policy.max_deliveries:
            delay = policy.delay(delivery.attempt, self._rng)
            if delay > 0 and not self._delayed_retry:
                retried = await self._guard(self._retry_through_outbox(conn, delivery, delay))
            else:
                retried = await self._guard(
                    self._queue.retry(delivery, delay_seconds=delay, error=text)
                )
            if not retried:
                return self._lease_lost(delivery, exc)
            self._metrics.job_outcome(message.queue, message.consumer, Outcome.RETRIED)
            log.info(
                "job %s for %s failed (attempt %d of %d), retrying in %.1fs: %s",
                shown_value(message.job_id),
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
            "job %s for %s dead-lettered after %d attempt(s): %s: %s",
            shown_value(message.job_id),
            message.consumer,
            delivery.attempt,
            error_class_of(exc),
            first_line(exc),
            extra=log_fields(delivery, Outcome.DEAD_LETTERED, error_class=error_class_of(exc)),
        )
        return Outcome.DEAD_LETTERED

    async def _retry_through_outbox(
        self, held: AsyncConnection[Any] | None, delivery: Delivery, delay: float
    ) -> bool:
        """A retry with a delay on a queue that cannot hold a message back itself: the outbox
        row (due in ``delay``, carrying this delivery's attempt) commits first, on ``held``
        when the caller holds a connection, else on a pooled one; then the delivery is acked.

        If the ack says the lease was lost (another delivery holds the job now), the row is
        taken back unless the relay has it already, and it returns False. A crash between the
        commit and the ack leaves two copies, the broker's redelivery and the retry: the fence
        skips whichever comes second after a success, and a second failure's dead letter is the
        same pending one (D5)."""
        lease = self._pool.connection() if held is None else contextlib.nullcontext(held)
        async with lease as conn:
            async with conn.transaction():
                await conn.execute(SET_READ_COMMITTED)
                row_id = await outbox.schedule(
                    conn, delivery.message, delay, prior_attempts=delivery.attempt
                )
            if await self._queue.ack(delivery):
                return True
            async with conn.transaction():
                await conn.execute(SET_READ_COMMITTED)
                await outbox.withdraw(conn, row_id)
            return False

    async def _poison(
        self, conn: AsyncConnection[Any] | None, delivery: Delivery, exc: PoisonMessage
    ) -> Outcome:
        message = delivery.message
        whole = exc.error_class == UNFENCEABLE
        tracing.note_error(exc.error_class)
        written = await self._write_dead_letter(
            conn,
            delivery,
            exc.error_class,
            f"{exc.error_class}: {exc.reason}",
            whole_message=exc.reason if whole else None,
        )
        # Metric labels stay bounded: a message may name any consumer, registered or not.
        queue, label = self._labels(delivery)
        if not written:
            return self._lease_lost(delivery, exc)
        self._metrics.job_outcome(queue, label, Outcome.POISON)
        log.warning(
            "job %s for %s is poison, dead-lettered without retry: %s",
            shown_value(message.job_id),
            shown_value(message.consumer),
            exc.reason[:300],
            extra=log_fields(delivery, Outcome.POISON, error_class=exc.error_class),
        )
        return Outcome.POISON

    async def _fenced(self, job: Job, conn: AsyncConnection[Any] | None) -> bool:
        """True when the job's fence row exists (a copy of it succeeded)."""
        params = {"job_id": job.meta.job_id, "consumer": job.meta.consumer}
        if conn is not None:
            cur = await conn.execute(SQL["fence_exists"], params)
            row = await cur.fetchone()
        else:
            async with self._pool.connection() as pooled:
                cur = await pooled.execute(SQL["fence_exists"], params)
                row = await cur.fetchone()
        return bool(row and row[0])

    async def _delivery_limit(self, conn: AsyncConnection[Any] | None, job: Job) -> Outcome:
        """Dead-letter a job delivered too often with no outcome, without running it."""
        delivery, meta = job.delivery, job.meta
        allowed = job.consumer.retry.max_deliveries
        text = (
            f"{DELIVERY_LIMIT}: delivered {delivery.attempt} times, and its retry policy allows"
            f" {allowed} attempts: earlier deliveries ended with no outcome (the worker was"
            " killed or lost its connection, or the handler ran past its lease). Not run again;"
            " replay it once the cause is fixed."
        )
        if not await self._write_dead_letter(conn, delivery, DELIVERY_LIMIT, text):
            return self._lease_lost(delivery, RuntimeError(text))
        self._metrics.job_outcome(meta.queue, meta.consumer, Outcome.DEAD_LETTERED)
        log.warning(
            "job %s for %s dead-lettered without running: delivered %d times with no outcome"
            " (its retry policy allows %d attempts)",
            shown_value(meta.job_id),
            meta.consumer,
            delivery.attempt,
            allowed,
            extra=log_fields(delivery, Outcome.DEAD_LETTERED, error_class=DELIVERY_LIMIT),
        )
        return Outcome.DEAD_LETTERED

    def _labels(self, delivery: Delivery) -> tuple[str, str]:
        """The (queue, consumer) metric labels of a delivery: bounded to registered names."""
        message = delivery.message
        consumer = self._app.get(message.consumer)
        if consumer is None:
            return (
                message.queue if message.queue in self._app.queues else UNKNOWN_CONSUMER_LABEL,
                UNKNOWN_CONSUMER_LABEL,
            )
        return consumer.queue, consumer.name

    async def internal_failure(
        self, delivery: Delivery, exc: Exception, conn: AsyncConnection[Any] | None = None
    ) -> Outcome:
        """Handling ``delivery`` failed inside jobfence (``exc``), not in its handler.

        Before delivery ``INTERNAL_FAILURE_DELIVERIES`` the job stays leased and comes back when
        its lease runs out (the failure may pass: a revoked grant restored, say). From then on
        it is dead-lettered as ``InternalFailure`` by a fallback that cannot fail the same way:
        the whole message kept as base64, bounded identifiers. Either way it is counted
        (``internal_error``) and logged at ERROR, at most ``INTERNAL_LOG_PER_MINUTE`` lines a
        minute. Never raises, except :class:`InfrastructureError`."""
        message = delivery.message
        queue, label = self._labels(delivery)
        self._metrics.job_outcome(queue, label, Outcome.INTERNAL_ERROR)
        fields = log_fields(delivery, Outcome.INTERNAL_ERROR, error_class=error_class_of(exc))
        # An attempt out of bounds (an adapter's bad count) never grows: the fallback at once.
        if recordable_attempt(delivery.attempt) == delivery.attempt < INTERNAL_FAILURE_DELIVERIES:
            self._log_internal(
                "internal error handling job %s for %s (delivery %d): %s: %s; it stays leased"
                " and comes back when its lease runs out; at delivery %d it is dead-lettered as"
                " InternalFailure",
                shown_value(message.job_id),
                shown_value(message.consumer),
                delivery.attempt,
                error_class_of(exc),
                first_line(exc),
                INTERNAL_FAILURE_DELIVERIES,
                exc=exc,
                extra=fields,
            )
            return Outcome.INTERNAL_ERROR
        text = (
            f"{INTERNAL_FAILURE}: handling failed inside jobfence at delivery {delivery.attempt}"
            f" ({INTERNAL_FAILURE_DELIVERIES} or more fail so before this fallback):"
            f" {describe_error(exc)}"
        )
        note = f"kept whole: handling failed inside jobfence ({error_class_of(exc)})"
        try:
            if conn is not None and conn.info.transaction_status != TransactionStatus.IDLE:
                await conn.rollback()
            written = await self._write_dead_letter(
                conn, delivery, INTERNAL_FAILURE, text, whole_message=note
            )
        except InfrastructureError:
            raise
        except Exception as fallback_exc:
            if is_connection_loss(fallback_exc, conn):
                raise InfrastructureError(str(fallback_exc)) from fallback_exc
            self._log_internal(
                "job %s for %s failed inside jobfence at delivery %d (%s: %s) and its fallback"
                " dead letter could not be written either (%s: %s); it stays leased and comes"
                " back when its lease runs out",
                shown_value(message.job_id),
                shown_value(message.consumer),
                delivery.attempt,
                error_class_of(exc),
                first_line(exc),
                error_class_of(fallback_exc),
                first_line(fallback_exc),
                exc=fallback_exc,
                extra=fields,
            )
            return Outcome.INTERNAL_ERROR
        if not written:
            return self._lease_lost(delivery, exc)
        self._metrics.job_outcome(queue, label, Outcome.DEAD_LETTERED)
        log.error(
            "job %s for %s dead-lettered as InternalFailure: handling failed inside jobfence"
            " at delivery %d: %s: %s",
            shown_value(message.job_id),
            shown_value(message.consumer),
            delivery.attempt,
            error_class_of(exc),
            first_line(exc),
            extra=log_fields(delivery, Outcome.DEAD_LETTERED, error_class=INTERNAL_FAILURE),
        )
        return Outcome.DEAD_LETTERED

    def _log_internal(
        self, msg: str, *args: object, exc: BaseException, extra: dict[str, object]
    ) -> None:
        allowed, held = self._internal_log.allow()
        if not allowed:
            return
        if held:
            msg += " (%d more internal-error lines held back in the last minute)"
            args = (*args, held)
        log.error(msg, *args, exc_info=exc, extra=extra)

    def _lease_lost(self, delivery: Delivery, exc: BaseException) -> Outcome:
        message = delivery.message
        queue, label = self._labels(delivery)
        self._metrics.job_outcome(queue, label, Outcome.LEASE_LOST)
        log.warning(
            "job %s for %s failed after its lease ran out (%s): another worker holds it now,"
            " so this one neither retries nor dead-letters it; raise --lease-seconds above the"
            " handler's longest run, or set --max-handler-seconds so that the worker extends"
            " the lease while the handler runs",
            shown_value(message.job_id),
            shown_value(message.consumer),
            error_class_of(exc),
            extra=log_fields(delivery, Outcome.LEASE_LOST, error_class=error_class_of(exc)),
        )
        return Outcome.LEASE_LOST

    async def _write_dead_letter(
        self,
        held: AsyncConnection[Any] | None,
        delivery: Delivery,
        error_class: str,
        text: str,
        *,
        whole_message: str | None = None,
    ) -> bool:
        """Write the dead letter (and its alert, and the ack with a transactional queue) in one
        transaction, on ``held`` when the caller holds a connection, else on a pooled one.

        ``whole_message`` (a note saying why) keeps the whole message as base64 in the payload
        (``payload_encoding`` ``message``), with each identifier that cannot be stored as it
        is replaced by a bounded stand-in (jobfence.limits.bounded): the row can always be
        inserted, listed and understood.

        With a transactional queue the ack goes first: if this delivery's lease was lost (the
        message went to another worker), nothing is written and it returns False. Another
        queue is acked after the commit, and a lost lease there is not seen."""
        message = delivery.message
        if whole_message is None:
            payload_text, encoding = stored_payload(message.body)
            ids = message
        else:
            ids, payload_text, encoding = kept_whole(message, whole_message)
        params = {
            "job_id": ids.job_id,
            "queue": ids.queue,
            "consumer": ids.consumer,
            "tenant_id": ids.tenant_id,
            "payload": payload_text,
            "payload_encoding": encoding,
            # Within the column's bounds whatever a queue adapter said (the check above
            # dead-letters a delivery whose attempt is out of them, and must not loop).
            "attempts": recordable_attempt(delivery.attempt),
            "last_error": storable_text(text[:MAX_ERROR_CHARS]),
            "error_class": error_class[:200],
            "correlation_id": ids.correlation_id,
            "traceparent": tracing.current_traceparent(),
        }

        async def write() -> bool:
            lease = self._pool.connection() if held is None else contextlib.nullcontext(held)
            async with lease as conn, conn.transaction():
                await conn.execute(SET_READ_COMMITTED)
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
