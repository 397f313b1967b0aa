"""Transactions whose BEGIN travels with their first statement, and whose COMMIT can travel with
the next transaction's BEGIN: one round trip each on the job path.

``conn.transaction()`` sends BEGIN and waits for the answer before the first statement goes out,
and sends COMMIT alone at the end. On the job path both are round trips for nothing:

- :meth:`Tx.begin` sends ``BEGIN; <first statement>`` as one query;
- :meth:`Tx.commit_then_begin` sends ``COMMIT; BEGIN; <first statement>`` as one query: a
  worker with another job waiting finishes one job and starts the next in a single round trip.
  Each job still has its own transaction.

Both can send a *check* ahead of the COMMIT, in the same query: a constant statement that fails
when the transaction must not commit (``fence_held`` in ``core.sql``: the transaction still
holds the job's fence). Its failure aborts the transaction, the server skips the COMMIT and all
after it, the transaction is rolled back and :class:`CommitRefused` raised: the check costs no
round trip.

Each is one simple-protocol query, its parameters merged client-side by psycopg's
:class:`~psycopg.ClientCursor` (psycopg quotes each value for the connection's encoding and
``standard_conforming_strings``). The server runs the statements in order and skips the rest
after one fails, so which one failed is known from the state it leaves: the check's own error
(:func:`refused_by_check`), the previous transaction ended (a failed COMMIT), or the next one
aborted (:class:`NextBeginFailed`, the COMMIT done). Against three statements pipelined with
their parameters bound by the server, the client spends about 0.85 of the CPU on this part
of a job (``benchmarks/commit_path.py``).

In between, a :class:`Tx` behaves like ``conn.transaction()``: statements run one at a time as
usual (their ``rowcount`` and results as usual), ``conn.commit()`` inside it is refused, a nested
``conn.transaction()`` is a savepoint. :func:`begin_with` wraps it as a context manager that
commits on leaving, or rolls back on an exception.

It enters psycopg's :class:`~psycopg.AsyncTransaction` itself, for psycopg's bookkeeping, while
the query sends the BEGIN and COMMIT (:class:`_Quiet`). A chained BEGIN is entered before the
server has seen the COMMIT before it, so :class:`_Chained` tells psycopg it is a main
transaction, not a savepoint (``tests/test_pgtx.py`` holds this to psycopg's behaviour).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

import psycopg
from psycopg import AsyncClientCursor, AsyncConnection, AsyncCursor, ClientCursor
from psycopg.pq import TransactionStatus
from psycopg.sql import SQL, Composed
from psycopg.transaction import BaseTransaction

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


def refused_by_check(exc: BaseException) -> bool:
    """``exc`` is the error of a check refusing a COMMIT (see :data:`Check`)."""
    return _refusal(exc) is not None


def refusal_reason(exc: BaseException) -> str:
    """The reason a check gave, from its error."""
    return _refusal(exc) or ""


def _refusal(exc: BaseException) -> str | None:
    if not isinstance(exc, psycopg.errors.UndefinedObject):
        return None
    found = _REFUSAL.search(exc.diag.message_primary or "")
    return None if found is None else found.group(1).rstrip(" ,")


def _push_chained(tx: psycopg.AsyncTransaction | psycopg.Transaction) -> None:
    if tx._conn._num_transactions:
        raise psycopg.ProgrammingError("a chained transaction needs the previous one ended")
    tx._outer_transaction = True
    tx._stack_index = 0
    tx._conn._num_transactions = 1


class _Quiet(BaseTransaction[Any]):
    """A main transaction whose BEGIN, COMMIT or ROLLBACK jobfence may send itself, inside a
    query of its own: while ``quiet``, entering or leaving it keeps psycopg's bookkeeping (its
    status, the connection's count of open transactions) and sends nothing."""

    quiet = False

    def _get_enter_commands(self) -> Iterator[bytes]:
        return iter(()) if self.quiet else super()._get_enter_commands()

    def _get_commit_commands(self) -> Iterator[bytes]:
        return iter(()) if self.quiet else super()._get_commit_commands()

    def _get_rollback_commands(self) -> Iterator[bytes]:
        return iter(()) if self.quiet else super()._get_rollback_commands()


class _Main(_Quiet, psycopg.AsyncTransaction):
    """The transaction :meth:`Tx.begin` opens."""


class _MainSync(_Quiet, psycopg.Transaction):
    """The transaction a sync runner opens (:func:`main_transaction_sync`)."""


class _Chained(_Main):
    """A main transaction begun in the same query as the previous one's COMMIT: psycopg's
    bookkeeping enters it while the connection still reports "in transaction", which psycopg
    would otherwise read as "open a savepoint"."""

    def _push_savepoint(self) -> None:
        _push_chained(self)


class _ChainedSync(_MainSync):
    """:class:`_Chained` on a sync connection."""

    def _push_savepoint(self) -> None:
        _push_chained(self)


def main_transaction_sync(conn: psycopg.Connection[Any]) -> psycopg.Transaction:
    """A transaction for ``conn`` (not entered) that :func:`commit_then_begin_sync` can end."""
    return _MainSync(conn)


def _chain_query(
    conn: psycopg.Connection[Any] | AsyncConnection[Any], check: Check | None, query: Query
) -> bytes:
    """``check``, COMMIT, the connection's BEGIN and ``query`` as one simple-protocol query
    (its parameters merged client-side: ``%`` in the check is no placeholder)."""
    head = b"COMMIT; " if check is None else check.replace(b"%", b"%%") + b"; COMMIT; "
    return head + conn._get_tx_start_command() + b"; " + _query_bytes(conn, query)


def _query_bytes(conn: psycopg.Connection[Any] | AsyncConnection[Any], query: Query) -> bytes:
    if isinstance(query, bytes):
        return query
    if isinstance(query, str):
        return query.encode()
    return query.as_bytes(conn)


def _chain_failed(
    exc: BaseException, check: Check | None, conn: psycopg.Connection[Any] | AsyncConnection[Any]
) -> tuple[bool, bool]:
    """After a chain query failed with ``exc``: (refused by the check, previous committed).
    The server skips what follows a failed statement. A refused check leaves the previous
    transaction aborted; a failed COMMIT ends it (the connection idle); a failure of the next
    transaction's statement leaves that one aborted, the COMMIT done. Both an aborted previous
    transaction and an aborted next one read "in error": after a check, an error the check
    itself can raise (:func:`_check_can_raise`: a cancel, a resource or internal error) leaves
    it unknown which, and it never counts as committed."""
    refused = check is not None and refused_by_check(exc)
    committed = (
        not refused
        and conn.info.transaction_status == TransactionStatus.INERROR
        and not (check is not None and _check_can_raise(exc))
    )
    return refused, committed


# The errors a constant check (a SELECT of settings, no table) can fail with besides its refusal:
# operator intervention (a cancel, statement_timeout), insufficient resources, system and internal
# errors, and a transaction already aborted. SQLSTATE classes, or whole codes.
_CHECK_ERROR_CLASSES = ("57", "53", "58", "XX")


def _check_can_raise(exc: BaseException) -> bool:
    sqlstate = getattr(exc, "sqlstate", None)
    return not sqlstate or sqlstate == "25P02" or sqlstate.startswith(_CHECK_ERROR_CLASSES)


class Tx:
    """An open transaction on an autocommit connection, started with its first statement.

    End it with exactly one of :meth:`commit`, :meth:`commit_then_begin` or :meth:`rollback`."""

    __slots__ = ("_conn", "_tx")

    def __init__(self, conn: AsyncConnection[Any], tx: psycopg.AsyncTransaction) -> None:
        self._conn = conn
        self._tx = tx

    @classmethod
    async def begin(
        cls,
        conn: AsyncConnection[Any],
        query: Query,
        params: Mapping[str, Any],
        *,
        isolation: psycopg.IsolationLevel | None = None,
    ) -> tuple[Tx, AsyncCursor[Any]]:
        """Open a transaction on ``conn`` with ``query`` as its first statement, in one round
        trip; if the statement fails, the transaction is rolled back and the error raised.
        ``isolation``: the transaction's level, whatever the connection's or the server's
        default (``default_transaction_isolation``); None keeps the connection's."""
        tx = _Main(conn)
        cur = AsyncClientCursor(conn)
        tx.quiet = True  # psycopg's bookkeeping: begun; the query sends the BEGIN
        await tx.__aenter__()
        tx.quiet = False
        try:
            await cur.execute(
                _begin_command(conn, isolation) + b"; " + _query_bytes(conn, query), params
            )
        except BaseException as exc:
            tx.quiet = conn.info.transaction_status == TransactionStatus.IDLE
            await tx.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        cur.nextset()  # the statement's result, after BEGIN's
        return cls(conn, tx), cur

    async def commit(self, check: Check | None = None) -> None:
        """Commit; with ``check``, send it ahead of the COMMIT in one round trip and raise
        :class:`CommitRefused` (the transaction rolled back) when it fails."""
        if check is None:
            await self._tx.__aexit__(None, None, None)
            return
        conn, tx = self._conn, self._tx
        if not isinstance(tx, _Quiet):  # pragma: no cover - Tx opens only _Main ones
            raise TypeError("commit() of a transaction Tx did not open")
        tx.quiet = True  # psycopg's bookkeeping: committed; the query sends the COMMIT
        await tx.__aexit__(None, None, None)
        try:
            await conn.execute(check + b"; COMMIT")
        except BaseException as exc:
            await _end_aborted(conn)
            if refused_by_check(exc):
                raise CommitRefused(refusal_reason(exc)) from exc
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
        leaves this transaction's outcome to the error: the COMMIT failed, or the outcome is
        unknown (the connection was lost; or, after a check, an error the check itself could
        have raised, such as a cancel, came from it or from the next statement)."""
        conn, previous, tx = self._conn, self._tx, _Chained(self._conn)
        if not isinstance(previous, _Quiet):  # pragma: no cover - Tx opens only _Main ones
            raise TypeError("commit_then_begin() of a transaction Tx did not open")
        text = _chain_query(conn, check, query)
        cur = AsyncClientCursor(conn)
        # psycopg's bookkeeping: this one committed, the next begun; the query sends both.
        previous.quiet = tx.quiet = True
        await previous.__aexit__(None, None, None)
        await tx.__aenter__()
        tx.quiet = False
        try:
            await cur.execute(text, params)
        except BaseException as exc:
            refused, committed = _chain_failed(exc, check, conn)
            # A failed COMMIT left nothing open; else ROLLBACK ends the aborted transaction.
            tx.quiet = conn.info.transaction_status == TransactionStatus.IDLE
            await tx.__aexit__(type(exc), exc, exc.__traceback__)
            if refused:
                raise CommitRefused(refusal_reason(exc)) from exc
            if committed and isinstance(exc, Exception):
                raise NextBeginFailed(str(exc)) from exc
            raise
        while cur.nextset():  # the check's, COMMIT's and BEGIN's results, then the statement's
            pass
        return Tx(conn, tx), cur


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
    of :func:`main_transaction_sync`, entered on ``conn``, ``check`` first), begin the next with
    ``query`` and fetch its rows, in one round trip. It raises as :meth:`Tx.commit_then_begin`
    does: :class:`NextBeginFailed` (``previous`` committed, the next rolled back),
    :class:`CommitRefused` (neither committed), or the COMMIT's own error."""
    if not isinstance(previous, _Quiet):
        raise TypeError("commit_then_begin_sync() needs a transaction of main_transaction_sync()")
    tx = _ChainedSync(conn)
    text = _chain_query(conn, check, query)
    cur = ClientCursor(conn)
    previous.quiet = tx.quiet = True  # as in Tx.commit_then_begin
    previous.__exit__(None, None, None)
    tx.__enter__()
    tx.quiet = False
    try:
        cur.execute(text, params)
    except BaseException as exc:
        refused, committed = _chain_failed(exc, check, conn)
        tx.quiet = conn.info.transaction_status == TransactionStatus.IDLE
        tx.__exit__(type(exc), exc, exc.__traceback__)
        if refused:
            raise CommitRefused(refusal_reason(exc)) from exc
        if committed and isinstance(exc, Exception):
            raise NextBeginFailed(str(exc)) from exc
        raise
    while cur.nextset():
        pass
    return tx, cur.fetchall()


def begin_sync(
    conn: psycopg.Connection[Any], query: Query, params: Mapping[str, Any]
) -> tuple[psycopg.Transaction, list[Any]]:
    """:meth:`Tx.begin` on a sync connection: BEGIN and ``query`` in one query; the
    transaction (of :func:`main_transaction_sync`) and the statement's rows. If the statement
    fails, the transaction is rolled back and the error raised."""
    tx = _MainSync(conn)
    cur = ClientCursor(conn)
    tx.quiet = True  # as in Tx.begin
    tx.__enter__()
    tx.quiet = False
    try:
        cur.execute(conn._get_tx_start_command() + b"; " + _query_bytes(conn, query), params)
    except BaseException as exc:
        if not conn.closed:
            tx.quiet = conn.info.transaction_status == TransactionStatus.IDLE
            tx.__exit__(type(exc), exc, exc.__traceback__)
        raise
    cur.nextset()
    return tx, cur.fetchall()


def commit_checked_sync(
    conn: psycopg.Connection[Any], tx: psycopg.Transaction, check: Check
) -> None:
    """:meth:`Tx.commit` with a check, on a sync connection: ``check``, then COMMIT, in one
    query; when the check fails, the server skips the COMMIT: the transaction is rolled back
    and :class:`CommitRefused` raised."""
    if not isinstance(tx, _Quiet):
        raise TypeError("commit_checked_sync() needs a transaction of main_transaction_sync()")
    tx.quiet = True  # psycopg's bookkeeping: committed; the query sends the COMMIT
    tx.__exit__(None, None, None)
    try:
        conn.execute(check + b"; COMMIT")
    except BaseException as exc:
        end_aborted_sync(conn)
        if refused_by_check(exc):
            raise CommitRefused(refusal_reason(exc)) from exc
        raise


def end_aborted_sync(conn: psycopg.Connection[Any]) -> None:
    """:func:`_end_aborted` on a sync connection."""
    if conn.closed or conn.info.transaction_status not in (
        TransactionStatus.INTRANS,
        TransactionStatus.INERROR,
    ):
        return
    with suppress(psycopg.Error):  # the connection went with it: the server rolls back
        psycopg.Connection.rollback(conn)


def _begin_command(conn: AsyncConnection[Any], isolation: psycopg.IsolationLevel | None) -> bytes:
    if isolation is None:
        return conn._get_tx_start_command()
    return b"BEGIN ISOLATION LEVEL " + isolation.name.replace("_", " ").encode()


# jobfence's own statements (a queue's fetch, completion and retry, the fence cleanup) are written
# for READ COMMITTED: one that locks a row another worker changed since it began re-reads that row
# and skips it. At REPEATABLE READ or SERIALIZABLE, which a database (or role) may set as its
# default (default_transaction_isolation) for the application's own code, it fails instead with a
# serialization failure. So on a connection whose default is another level (asked once per
# connection, and kept on it), they run in a transaction of that level, begun and committed in
# the same query; on the others, as they are (prepared by psycopg once used often).
_READ_COMMITTED = b"BEGIN ISOLATION LEVEL READ COMMITTED; "
# The same, as the first statement of a transaction already begun (``conn.transaction()``): a
# dead letter with its ack, a retry through the outbox, a bulk replay's chunk, a migration.
SET_READ_COMMITTED = b"SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
_OTHER_DEFAULT = "_jobfence_default_isolation_is_not_read_committed"


async def execute_read_committed(
    conn: AsyncConnection[Any], query: Query, params: Mapping[str, Any] | None = None
) -> AsyncCursor[Any]:
    """Run ``query`` alone, as its own transaction at READ COMMITTED whatever the connection's
    or the database's default, on ``conn`` (an autocommit connection, idle). The cursor holds
    the statement's result (its rows, its ``rowcount``). If the statement fails, nothing of it
    commits and its error is raised. Where the default is READ COMMITTED (the first call on a
    connection asks), this is ``conn.execute``; elsewhere BEGIN, the statement and COMMIT go
    in one round trip."""
    other = getattr(conn, _OTHER_DEFAULT, None)
    if other is None:
        cur = await conn.execute("SHOW default_transaction_isolation")
        row = await cur.fetchone()
        other = row is None or row[0] != "read committed"
        setattr(conn, _OTHER_DEFAULT, other)
    if not other:
        return await conn.execute(query, params)
    cur = AsyncClientCursor(conn)
    try:
        await cur.execute(_READ_COMMITTED + _query_bytes(conn, query) + b"\n; COMMIT", params)
    except BaseException:
        await _end_aborted(conn)  # the failed statement left its transaction aborted
        raise
    cur.nextset()  # the statement's result, after BEGIN's
    return cur


@asynccontextmanager
async def begin_with(
    conn: AsyncConnection[Any],
    query: Query,
    params: Mapping[str, Any],
    *,
    isolation: psycopg.IsolationLevel | None = None,
) -> AsyncIterator[AsyncCursor[Any]]:
    """Open a transaction on ``conn`` (an autocommit connection) with ``query`` as its first
    statement; yield that statement's cursor. Leaving the block commits; an exception rolls
    back (a :class:`psycopg.Rollback` is swallowed, as with ``conn.transaction()``).
    ``isolation`` as for :meth:`Tx.begin`."""
    tx, cur = await Tx.begin(conn, query, params, isolation=isolation)
    try:
        yield cur
    except BaseException as exc:
        if await tx.rollback(exc):
            return
        raise
    await tx.commit()
