"""Sync handlers: the work transaction of a plain ``def`` handler, run in a worker thread.

The harness stays the one core: it decodes, applies the failure policy (retry, dead letter,
poison, the internal-failure rule) and acks, on the event loop, for async and sync consumers
alike. For a sync consumer only one step moves to a thread: "transaction(fence insert,
handler) -> commit". That step is a :class:`SyncTransactionRunner`, a small port:

- :class:`PsycopgRunner` (this module) runs it on a sync psycopg connection pool, which the
  worker opens only when its queues have sync consumers, sized by its concurrency;
- a framework can plug in its own runner (Django's ``transaction.atomic()`` on Django's own
  connection, say) and give it to :class:`jobfence.Worker` as ``sync_runner``.

:class:`SyncExecutor` is the bridge: it runs a runner's ``run`` in a thread pool of
``concurrency`` threads and awaits it from the event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import psycopg
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from jobfence import tracing
from jobfence.db import looks_broken, reconnect_attempt, session_read_only
from jobfence.guard import check_still_open, refuse_on, retire, session_changed
from jobfence.pgtx import (
    Check,
    NextBeginFailed,
    begin_sync,
    commit_checked_sync,
    commit_then_begin_sync,
)

if TYPE_CHECKING:
    from jobfence.model import JobMeta

log = logging.getLogger("jobfence.sync")

# The job whose sync handler is running in this thread, None between handlers: set by the
# harness around each call, so that a runner can tell which job of its transaction (one job, or
# a group) did something (the Django runner: which job registered a transaction.on_commit
# callback).
RUNNING_JOB: contextvars.ContextVar[JobMeta | None] = contextvars.ContextVar(
    "jobfence_running_job", default=None
)

T = TypeVar("T")

# What the work of a transaction gets: the fence statement's rows and the object the handlers
# receive as their third argument (``tx``); what it returns, run() returns.
Work = Callable[[Sequence[Sequence[object]], object], T]


class SyncTransactionRunner(Protocol):
    """Runs one work transaction for sync handlers. The port a framework implements.

    ``run(fence_sql, params, work)`` is called in a worker thread, by up to ``concurrency``
    threads at once; each call must use a connection no other call uses meanwhile. It must:

    1. begin a transaction on its connection;
    2. execute ``fence_sql`` with ``params`` (a mapping for its ``%(name)s`` placeholders) as
       the transaction's first statement, and fetch all its rows;
    3. call ``work(rows, tx)`` once, where ``tx`` is what the handlers get as their third
       argument (:class:`PsycopgRunner` passes its ``psycopg.Connection``; a Django runner
       would pass ``django.db.connection``, its ORM using the same transaction), and keep what
       ``work`` returns;
    4. check that the transaction is still open and usable: raise
       :class:`~jobfence.TransactionMisuse` when the handler ended it (committed, rolled back,
       closed the connection) and :class:`~jobfence.TransactionAborted` when a database error
       the handler caught aborted it;
       (``work`` itself ends by checking, when ``tx`` is a psycopg connection, that the
       transaction still holds the job's fence: a round trip, which :class:`PsycopgRunner`
       saves by sending the check with its COMMIT);
    5. commit, and return ``work``'s result.

    On any exception in steps 2 to 5 it rolls back (when the connection still can) and
    re-raises the exception unchanged: the harness classifies it, by class, into a lost
    database (``psycopg.OperationalError``, ``psycopg_pool.PoolTimeout``), a conflict retried at
    once (``SerializationFailure``, ``DeadlockDetected``), a permanent or a transient failure.
    It never commits a transaction in which ``work`` raised, and never commits anything before
    step 5: the fence and the handler's work commit together or not at all.
    """

    def run(self, fence_sql: str, params: Mapping[str, Any], work: Work[T]) -> T: ...


class FenceConnection(psycopg.Connection[TupleRow]):
    """The sync connections a :class:`PsycopgRunner` lends: while one holds a work transaction,
    ``commit()``, ``rollback()`` and ``close()`` raise :class:`~jobfence.TransactionMisuse`
    before anything is sent, so no part of the job can commit on its own."""

    _jobfence_lent = False
    # What the harness asks to send ahead of this transaction's COMMIT (jobfence.pgtx.Check):
    # set by the work of a job whose handler ran, read and cleared by PsycopgRunner.
    _jobfence_commit_check: Check | None = None

    def commit(self) -> None:
        if self._jobfence_lent:
            raise refuse_on(self, "commit")
        super().commit()

    def rollback(self) -> None:
        if self._jobfence_lent:
            raise refuse_on(self, "rollback")
        super().rollback()

    def close(self) -> None:
        if self._jobfence_lent:
            raise refuse_on(self, "close")
        super().close()


class CheckedSyncPool(ConnectionPool[FenceConnection]):
    """A sync pool that lends only connections not known to be broken (:func:`looks_broken`,
    no round trip; as :class:`jobfence.db.CheckedPool` does for async pools): after the
    database cut its connections, a job does not fail again on one the pool still holds idle,
    which would start a second outage recovery for the same outage. It replaces a lost
    connection at least every :data:`jobfence.db.RECONNECT_MAX_DELAY_SECONDS`, so that after
    an outage no job waits for psycopg_pool's growing backoff."""

    def _add_connection(self, attempt: Any, growing: bool = False) -> None:
        super()._add_connection(attempt or reconnect_attempt(self.reconnect_timeout), growing)

    def getconn(self, timeout: float | None = None) -> FenceConnection:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for _ in range(self.max_size):
            conn = super().getconn(max(deadline - time.monotonic(), 0.0))
            if not looks_broken(conn):
                return conn
            log.info("pool %s: discarding a broken connection", self.name)
            conn.close()
            try:
                # Returned as found broken when lent: the pool replaces it, logging at INFO.
                self._putconn(conn, from_getconn=True)
            except (AttributeError, TypeError):  # pragma: no cover - psycopg_pool < 3.3
                self.putconn(conn)  # the same, with a WARNING
        return super().getconn(max(deadline - time.monotonic(), 0.0))


class PsycopgRunner:
    """:class:`SyncTransactionRunner` on a sync psycopg pool of :class:`FenceConnection`.

    Each ``run`` borrows a connection (autocommit, so the transaction is explicit), sends
    BEGIN and the fence statement as one query (one round trip), hands the connection to
    the work, checks it, and commits. :meth:`open` and :meth:`close` bracket its use; a worker
    calls them around its run."""

    def __init__(
        self, conninfo: str, *, size: int, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        self._conninfo = conninfo
        self._size = size
        self._kwargs = {**(kwargs or {}), "autocommit": True}
        self._pool: ConnectionPool[FenceConnection] | None = None

    def open(self, *, timeout: float = 30.0) -> None:
        pool = CheckedSyncPool(
            self._conninfo,
            connection_class=FenceConnection,
            min_size=1,
            max_size=self._size,
            kwargs=dict(self._kwargs),
            open=False,
            name="jobfence-sync",
            timeout=30.0,
        )
        pool.open(wait=True, timeout=timeout)
        self._pool = pool

    def close(self, *, timeout: float = 5.0) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout=timeout)

    def run(self, fence_sql: str, params: Mapping[str, Any], work: Work[T]) -> T:
        return self.run_ahead(fence_sql, params, work)[0]

    def run_ahead(
        self,
        fence_sql: str,
        params: Mapping[str, Any],
        work: Work[T],
        *,
        opened: SyncOpen | None = None,
        then: tuple[str, Mapping[str, Any]] | None = None,
    ) -> tuple[T, SyncOpen | None, list[str]]:
        """:meth:`run`, chained to the jobs around it on one connection. With ``opened``, the
        transaction was begun already, its fence statement done (by the previous job's
        commit). With ``then`` (the next job's fence statement and parameters), the COMMIT
        travels with the next transaction's BEGIN and fence statement in one round trip
        (:func:`jobfence.pgtx.commit_then_begin_sync`), and that transaction is returned with
        ``work``'s result, its connection held out of the pool until it runs or is abandoned.
        None in its place: the next job begins on its own (nothing was chained, or its fence
        statement failed after this COMMIT).

        Third, the settings a handler changed for the whole session
        (:func:`jobfence.guard.session_changed`): the connection is then retired (its pool
        closes it) and a transaction begun on it for the next job rolled back."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("PsycopgRunner.run() before open()")
        claimed = opened.claim() if opened is not None else None
        if claimed is not None:
            conn, tx, rows = claimed
        else:
            conn = pool.getconn()
            try:
                tx, rows = begin_sync(conn, fence_sql, params)
            except BaseException:
                _put_back(pool, conn)
                raise
        following: SyncOpen | None = None
        changed: list[str] = []
        try:
            result = _work_in(conn, tx, rows, work)
            check, conn._jobfence_commit_check = conn._jobfence_commit_check, None
            begun = None
            if then is not None:
                with suppress(NextBeginFailed):  # committed; the next job begins on its own
                    begun = commit_then_begin_sync(conn, tx, check, *then)
            elif check is None:
                tx.__exit__(None, None, None)
            else:
                commit_checked_sync(conn, tx, check)
            if check is not None and (changed := session_changed(conn)):  # a handler ran
                retire(conn)
                if begun is not None:  # begun on the changed session: it starts on another
                    with suppress(psycopg.Error):
                        begun[0].__exit__(psycopg.Rollback, psycopg.Rollback(), None)
                    begun = None
            if begun is not None:
                following = SyncOpen(pool, conn, *begun)
        finally:
            if following is None:
                _put_back(pool, conn)
        return result, following, changed


def _put_back(pool: ConnectionPool[FenceConnection], conn: FenceConnection) -> None:
    """Return ``conn`` to ``pool``, closed first when its session is read-only (a standby, or
    default_transaction_read_only on): the pool replaces it with a new connection, which
    resolves the host again and is writable once the database is (D7)."""
    if not conn.closed and session_read_only(conn):
        with suppress(Exception):
            conn.close()
    pool.putconn(conn)


class SyncOpen:
    """A sync work transaction begun ahead of its job (BEGIN and its fence statement done) on a
    connection held out of its pool: :meth:`PsycopgRunner.run_ahead` runs the job in it, or
    :meth:`abandon` rolls it back and gives the connection back, whichever comes first."""

    __slots__ = ("_conn", "_lock", "_pool", "_rows", "_taken", "_tx")

    def __init__(
        self,
        pool: ConnectionPool[FenceConnection],
        conn: FenceConnection,
        tx: psycopg.Transaction,
        rows: list[Any],
    ) -> None:
        self._pool = pool
        self._conn = conn
        self._tx = tx
        self._rows = rows
        self._lock = threading.Lock()
        self._taken = False

    @property
    def fresh(self) -> bool:
        """The fence statement returned a row: a single job's fence was inserted."""
        return bool(self._rows)

    def claim(self) -> tuple[FenceConnection, psycopg.Transaction, list[Any]] | None:
        """The connection, transaction and fence rows, for the one caller that runs the job;
        None when it was claimed or abandoned before."""
        with self._lock:
            if self._taken:
                return None
            self._taken = True
        return self._conn, self._tx, self._rows

    def abandon(self) -> None:
        """Roll back (quietly: the connection may be gone) and give the connection back to
        its pool; a no-op once claimed or abandoned. Blocks for a round trip."""
        claimed = self.claim()
        if claimed is None:
            return
        conn, tx, _rows = claimed
        try:
            if not conn.closed:
                with suppress(psycopg.Error):
                    tx.__exit__(psycopg.Rollback, psycopg.Rollback(), None)
        finally:
            self._pool.putconn(conn)


def _work_in(conn: FenceConnection, tx: psycopg.Transaction, rows: list[Any], work: Work[T]) -> T:
    """``work`` on ``conn`` lent, in ``tx``, then the check that the transaction is still
    open and usable; on any exception ``tx`` is rolled back."""
    try:
        conn._jobfence_lent = True
        try:
            result = work(rows, conn)
        finally:
            conn._jobfence_lent = False
        check_still_open(conn.info.transaction_status, conn.closed)
    except BaseException as exc:
        conn._jobfence_commit_check = None
        if not conn.closed:
            # Rolls back; a psycopg.Rollback is not swallowed: nothing of the job committed,
            # the fence included, so it fails the job like any other exception.
            tx.__exit__(type(exc), exc, exc.__traceback__)
        raise
    return result


class SyncExecutor:
    """Runs a :class:`SyncTransactionRunner` in a pool of ``threads`` threads, awaited from the
    event loop. The harness's only door to sync handlers."""

    def __init__(self, runner: SyncTransactionRunner, *, threads: int) -> None:
        self.runner = runner
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="jobfence-sync")

    async def run(self, fence_sql: str, params: Mapping[str, Any], work: Work[T]) -> T:
        loop = asyncio.get_running_loop()
        if tracing.ENABLED:  # the handler's thread sees the job's process span as current
            context = contextvars.copy_context()
            return await loop.run_in_executor(
                self._threads, context.run, self.runner.run, fence_sql, params, work
            )
        return await loop.run_in_executor(self._threads, self.runner.run, fence_sql, params, work)

    @property
    def chains(self) -> bool:
        """The runner can send a job's COMMIT with the next job's BEGIN (:meth:`run_ahead`)."""
        return isinstance(self.runner, PsycopgRunner)

    async def run_ahead(
        self,
        fence_sql: str,
        params: Mapping[str, Any],
        work: Work[T],
        opened: SyncOpen | None,
        then: tuple[str, Mapping[str, Any]] | None,
    ) -> tuple[T, SyncOpen | None, list[str]]:
        """:meth:`PsycopgRunner.run_ahead` in a thread (only when :attr:`chains`). Cancelled
        while it runs, a transaction it begins for the next job is abandoned when it returns,
        and ``opened``, if the thread never took it, at once: no connection stays held."""
        runner = self.runner
        if not isinstance(runner, PsycopgRunner):
            raise TypeError("run_ahead() needs a PsycopgRunner")
        call: Callable[[], tuple[T, SyncOpen | None, list[str]]] = functools.partial(
            runner.run_ahead, fence_sql, params, work, opened=opened, then=then
        )
        if tracing.ENABLED:
            call = functools.partial(contextvars.copy_context().run, call)
        future = self._threads.submit(call)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(functools.partial(_abandon_after, opened))
            raise

    def shutdown(self) -> None:
        """Stop taking work; a transaction still running in a thread finishes there (cut off
        by shutdown, its delivery is released and comes back as a duplicate if it committed)."""
        self._threads.shutdown(wait=False, cancel_futures=True)


def _abandon_after(
    opened: SyncOpen | None, future: Future[tuple[Any, SyncOpen | None, list[str]]]
) -> None:
    """Once a :meth:`SyncExecutor.run_ahead` nobody awaits any more is done: abandon the
    transaction it was given (a no-op if its thread took it) and the one it began."""
    if opened is not None:
        opened.abandon()
    if not future.cancelled() and future.exception() is None:
        following = future.result()[1]
        if following is not None:
            following.abandon()
