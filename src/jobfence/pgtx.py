"""Transactions whose BEGIN travels with their first statement, and whose COMMIT can travel with
the next transaction's BEGIN: fewer round trips on the job path.

``conn.transaction()`` sends BEGIN and waits for the answer before the first statement goes out,
and sends COMMIT alone at the end. On the job path both are round trips for nothing:

- :meth:`Tx.begin` queues BEGIN and the first statement in psycopg's pipeline mode and leaves
  the pipeline once both have answered;
- :meth:`Tx.commit_then_begin` queues this transaction's COMMIT, the next one's BEGIN and its
  first statement in one pipeline: a worker with another job waiting finishes one job and starts
  the next in a single round trip. Each job still has its own transaction.

Both can send a *check* ahead of the COMMIT, in the same pipeline: a constant statement that
fails when the transaction must not commit (``fence_held`` in ``core.sql``: the transaction
still holds the job's fence). Its failure aborts the transaction, the server skips the COMMIT,
the transaction is rolled back and :class:`CommitRefused` raised: the check costs no round
trip. It is queued as psycopg queues its own COMMIT (``_exec_command``: no cursor, no
parameters), which costs the client about a tenth of a cursor's ``execute``.

In between, a :class:`Tx` behaves like ``conn.transaction()``: statements run one at a time as
usual (their ``rowcount`` and results as usual), ``conn.commit()`` inside it is refused, a nested
``conn.transaction()`` is a savepoint. :func:`begin_with` wraps it as a context manager that
commits on leaving, or rolls back on an exception.

It enters psycopg's :class:`~psycopg.AsyncTransaction` itself: entering ``conn.transaction()``
inside a pipeline would also open nested pipelines that outlive ours, and every later statement
would then run pipelined (``rowcount`` of -1). A chained BEGIN is queued before the server has
seen the COMMIT before it, so :class:`_Chained` tells psycopg it is a main transaction, not a
savepoint (``tests/test_pgtx.py`` holds this to psycopg's behaviour).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

import psycopg
from psycopg import AsyncConnection, AsyncCursor
from psycopg.pq import TransactionStatus
from psycopg.sql import SQL, Composed

Query = str | bytes | SQL | Composed
# A constant statement sent ahead of a COMMIT that fails when the transaction must not commit.
Check = bytes

# A check fails by reading a setting named after its reason, "jobfence: <reason>": no setting
# can have such a name, so the error (SQLSTATE 42704) is the check's own (tests/test_pgtx.py).
# The server words its message in its own language (lc_messages) and quotes the name its own
# way, but never translates the name: the refusal is found by it, whatever the language.
_REFUSAL = re.compile(r"jobfence: ([a-z][a-z ,]*)")


class NextBeginFailed(Exception):
    """:meth:`Tx.commit_then_begin` committed, but the next transaction's first statement
    failed (it was rolled back); ``__cause__`` is that statement's error."""


class CommitRefused(Exception):
    """The check sent ahead of a COMMIT failed: the COMMIT was skipped and the transaction
    rolled back, so nothing of it committed. ``__cause__`` is the check's error."""


def first_error(exc: BaseException) -> BaseException:
    """The error a pipeline failed with first: psycopg raises ``PipelineAborted`` for a
    statement the server skipped, and when the first error was raised earlier in the block,
    the pipeline's exit raises that instead, the first error as its ``__context__``."""
    seen = 0
    while (
        isinstance(exc, psycopg.errors.PipelineAborted)
        and exc.__context__ is not None
        and seen < 10
    ):
        exc = exc.__context__
        seen += 1
    return exc


def raise_first(exc: BaseException) -> None:
    """After a checked COMMIT's pipeline failed with ``exc``: raise :class:`CommitRefused`
    when the check refused it, else the pipeline's first error when ``exc`` is not that one;
    return when ``exc`` is the error to raise."""
    first = first_error(exc)
    if refused_by_check(first):
        raise CommitRefused(refusal_reason(first)) from first
    if first is not exc:
        raise first from None


def refused_by_check(exc: BaseException) -> bool:
    """``exc`` is (or is raised after, in the same pipeline) the error of a check refusing a
    COMMIT (see :data:`Check`)."""
    return _refusal(exc) is not None


def refusal_reason(exc: BaseException) -> str:
    """The reason a check gave, from its error."""
    return _refusal(exc) or ""


def _refusal(exc: BaseException) -> str | None:
    first = first_error(exc)
    if not isinstance(first, psycopg.errors.UndefinedObject):
        return None
    found = _REFUSAL.search(first.diag.message_primary or "")
    return None if found is None else found.group(1).rstrip(" ,")


def _push_chained(tx: psycopg.AsyncTransaction | psycopg.Transaction) -> None:
    if tx._conn._num_transactions:
        raise psycopg.ProgrammingError("a chained transaction needs the previous one ended")
    tx._outer_transaction = True
    tx._stack_index = 0
    tx._conn._num_transactions = 1


class _Chained(psycopg.AsyncTransaction):
    """A main transaction whose BEGIN is queued right after the previous one's COMMIT, in the
    same pipeline: the connection still reports "in transaction", which psycopg would otherwise
    read as "open a savepoint"."""

    def _push_savepoint(self) -> None:
        _push_chained(self)


class _ChainedSync(psycopg.Transaction):
    """:class:`_Chained` on a sync connection."""

    def _push_savepoint(self) -> None:
        _push_chained(self)


class Tx:
    """An open transaction on an autocommit connection, started with its first statement.

    End it with exactly one of :meth:`commit`, :meth:`commit_then_begin` or :meth:`rollback`."""

    __slots__ = ("_conn", "_tx")

    def __init__(self, conn: AsyncConnection[Any], tx: psycopg.AsyncTransaction) -> None:
        self._conn = conn
        self._tx = tx

    @classmethod
    async def begin(
        cls, conn: AsyncConnection[Any], query: Query, params: Mapping[str, Any]
    ) -> tuple[Tx, AsyncCursor[Any]]:
        """Open a transaction on ``conn`` with ``query`` as its first statement, in one round
        trip; if the statement fails, the transaction is rolled back and the error raised."""
        return await cls._start(conn, psycopg.AsyncTransaction(conn), None, query, params)

    async def commit(self, check: Check | None = None) -> None:
        """Commit; with ``check``, send it ahead of the COMMIT in one round trip and raise
        :class:`CommitRefused` (the transaction rolled back) when it fails."""
        if check is None:
            await self._tx.__aexit__(None, None, None)
            return
        conn = self._conn
        try:
            async with conn.pipeline():
                await _queue_check(conn, check)
                await self._tx.__aexit__(None, None, None)  # queues COMMIT
        except BaseException as exc:
            if self._tx.status == self._tx.Status.ACTIVE:
                await self._tx.__aexit__(type(exc), exc, exc.__traceback__)
            await _end_aborted(conn)
            raise_first(exc)
            raise

    async def rollback(self, exc: BaseException | None = None) -> bool:
        """Roll back; True when psycopg swallows ``exc`` (a :class:`psycopg.Rollback`)."""
        if exc is None:
            exc = psycopg.Rollback()
        return await self._tx.__aexit__(type(exc), exc, exc.__traceback__)

    async def commit_then_begin(
        self, query: Query, params: Mapping[str, Any], check: Check | None = None
    ) -> tuple[Tx, AsyncCursor[Any]]:
        """Commit this transaction (``check`` first, as :meth:`commit` sends it) and open the
        next one with ``query`` as its first statement, all in one round trip.

        If it raises :class:`NextBeginFailed`, this transaction committed and the next one
        was rolled back; :class:`CommitRefused`, neither committed. Any other exception
        leaves this transaction's outcome to the error: the COMMIT failed (or the connection
        was lost, and with it the knowledge)."""
        return await self._start(
            self._conn, _Chained(self._conn), self._tx, query, params, check=check
        )

    @classmethod
    async def _start(
        cls,
        conn: AsyncConnection[Any],
        tx: psycopg.AsyncTransaction,
        previous: psycopg.AsyncTransaction | None,
        query: Query,
        params: Mapping[str, Any],
        *,
        check: Check | None = None,
    ) -> tuple[Tx, AsyncCursor[Any]]:
        entered = False
        try:
            async with conn.pipeline():
                if previous is not None:
                    if check is not None:
                        await _queue_check(conn, check)
                    await previous.__aexit__(None, None, None)  # queues COMMIT
                await tx.__aenter__()  # queues BEGIN
                entered = True
                cur = await conn.execute(query, params)
        except BaseException as exc:
            # COMMIT done and BEGIN done: only the first statement failed. A failed COMMIT
            # ends the transaction and the pipeline skips what follows: the connection is idle.
            # A failed check aborted this transaction: the server skipped all that followed, and
            # the next one's ROLLBACK below ends the aborted one.
            refused = check is not None and refused_by_check(exc)
            committed = (
                previous is not None
                and not refused
                and conn.info.transaction_status == TransactionStatus.INERROR
            )
            if entered:
                await tx.__aexit__(type(exc), exc, exc.__traceback__)
            first = first_error(exc)
            if refused:
                await _end_aborted(conn)
                raise CommitRefused(refusal_reason(first)) from first
            if committed and isinstance(exc, Exception):
                raise NextBeginFailed(str(first)) from first
            if first is not exc:
                raise first from None  # the COMMIT's own error, not the skipped BEGIN's
            raise
        return cls(conn, tx), cur


async def _queue_check(conn: AsyncConnection[Any], check: Check) -> None:
    """Queue ``check`` in the open pipeline as psycopg queues its COMMIT: its error, if any,
    is raised when the pipeline's results are read."""
    async with conn.lock:
        await conn.wait(conn._exec_command(check))


async def _end_aborted(conn: AsyncConnection[Any]) -> None:
    """Roll back what a skipped COMMIT left open on the server (psycopg already counts the
    transaction as ended); a lost connection has nothing left to end."""
    if conn.closed or conn.info.transaction_status not in (
        TransactionStatus.INTRANS,
        TransactionStatus.INERROR,
    ):
        return
    with suppress(psycopg.Error):  # the connection went with it: the server rolls back
        await psycopg.AsyncConnection.rollback(conn)


def commit_then_begin_sync(
    conn: psycopg.Connection[Any],
    previous: psycopg.Transaction,
    check: Check | None,
    query: Query,
    params: Mapping[str, Any],
) -> tuple[psycopg.Transaction, list[Any]]:
    """:meth:`Tx.commit_then_begin` on a sync connection: commit ``previous`` (a transaction
    entered on ``conn``, ``check`` first), begin the next with ``query`` and fetch its rows,
    in one round trip. It raises as :meth:`Tx.commit_then_begin` does: :class:`NextBeginFailed`
    (``previous`` committed, the next rolled back), :class:`CommitRefused` (neither committed),
    or the COMMIT's own error."""
    tx = _ChainedSync(conn)
    entered = False
    try:
        with conn.pipeline():
            if check is not None:
                with conn.lock:  # queued as psycopg queues its COMMIT
                    conn.wait(conn._exec_command(check))
            previous.__exit__(None, None, None)  # queues COMMIT
            tx.__enter__()  # queues BEGIN
            entered = True
            cur = conn.execute(query, params)
        rows = cur.fetchall()
    except BaseException as exc:
        # As in Tx._start: a refused check skipped all that followed; a failed COMMIT ended
        # its transaction and skipped the rest; else only the next first statement failed.
        refused = check is not None and refused_by_check(exc)
        committed = not refused and conn.info.transaction_status == TransactionStatus.INERROR
        if entered:
            tx.__exit__(type(exc), exc, exc.__traceback__)
        first = first_error(exc)
        if refused:
            end_aborted_sync(conn)
            raise CommitRefused(refusal_reason(first)) from first
        if committed and isinstance(exc, Exception):
            raise NextBeginFailed(str(first)) from first
        if first is not exc:
            raise first from None
        raise
    return tx, rows


def end_aborted_sync(conn: psycopg.Connection[Any]) -> None:
    """:func:`_end_aborted` on a sync connection."""
    if conn.closed or conn.info.transaction_status not in (
        TransactionStatus.INTRANS,
        TransactionStatus.INERROR,
    ):
        return
    with suppress(psycopg.Error):  # the connection went with it: the server rolls back
        psycopg.Connection.rollback(conn)


@asynccontextmanager
async def begin_with(
    conn: AsyncConnection[Any], query: Query, params: Mapping[str, Any]
) -> AsyncIterator[AsyncCursor[Any]]:
    """Open a transaction on ``conn`` (an autocommit connection) with ``query`` as its first
    statement; yield that statement's cursor. Leaving the block commits; an exception rolls
    back (a :class:`psycopg.Rollback` is swallowed, as with ``conn.transaction()``)."""
    tx, cur = await Tx.begin(conn, query, params)
    try:
        yield cur
    except BaseException as exc:
        if await tx.rollback(exc):
            return
        raise
    await tx.commit()
