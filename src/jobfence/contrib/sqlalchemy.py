"""SQLAlchemy ORM inside a sync handler's fence transaction (the ``sqlalchemy`` extra).

::

    from jobfence.contrib.sqlalchemy import session_for

    @app.consumer("award_points", queue="loyalty", schema=Award)
    def award_points(payload: Award, job: JobMeta, tx: psycopg.Connection) -> None:
        with session_for(tx) as session:
            session.add(AwardRow(job_id=job.job_id, points=payload.points))

The session runs on the very connection and transaction jobfence lent the handler, the fence
already inserted in it: its changes are flushed when the ``with`` block ends and commit with the
fence, or not at all. SQLAlchemy never owns that transaction:

- the engine behind these sessions (one per process, created on first use) gets its DBAPI
  connection from the handler (``creator``), never pools, resets or closes it, and its dialect
  (psycopg's, subclassed) never commits or rolls back on it: only jobfence ends the transaction;
- ``session.commit()``, ``session.rollback()`` and ``session.close()`` (inside the block),
  and ``commit()``, ``rollback()`` and ``close()`` on the session's ``Connection``, raise
  :class:`jobfence.TransactionMisuse`; once one was refused the
  job fails with it even if the handler catches it: nothing of it is applied and it is
  dead-lettered at once (a handler that does this does it every time). To give up the job,
  raise: jobfence rolls the whole transaction back, fence included, and applies the consumer's
  retry policy;
- a database error during a flush aborts the transaction; the handler's exception (or, if it
  catches it, :class:`jobfence.TransactionAborted`) fails the job and nothing of it commits.

``app.enqueue_sync(session, ...)`` inside the block enqueues a follow-up job in the same
transaction.

An ``async def`` handler gets the same with :func:`async_session_for` (an ``AsyncSession`` on
its ``AsyncConnection``; ``await app.enqueue(session, ...)`` for a follow-up job)::

    async with async_session_for(tx) as session:
        session.add(AwardRow(job_id=job.job_id, points=payload.points))
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
from sqlalchemy import create_engine
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg, PGDialectAsync_psycopg
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from jobfence.guard import refuse_on

__all__ = ["FenceAsyncSession", "FenceSession", "async_session_for", "session_for"]

_DIALECT_NAME = "jobfence_fence"
_lent = threading.local()
_lent_async: contextvars.ContextVar[psycopg.AsyncConnection[Any] | None] = contextvars.ContextVar(
    "jobfence_lent_async", default=None
)
_engine_lock = threading.Lock()
_engine: Engine | None = None
_async_engine: AsyncEngine | None = None


def _psycopg_of(dbapi_connection: object) -> object:
    """The psycopg connection under what SQLAlchemy hands a dialect (a pool's proxy, or the
    asyncio extension's adapter)."""
    conn = dbapi_connection
    for _ in range(3):
        inner = getattr(conn, "driver_connection", None)
        if inner is None or inner is conn:
            break
        conn = inner
    return conn


class FenceDialect(PGDialect_psycopg):
    """psycopg's dialect, on a connection whose transaction jobfence owns: no commit, no
    rollback, no close, no per-connection set-up (the connection is reused job after job)."""

    supports_statement_cache = True

    def do_commit(self, dbapi_connection: Any) -> None:
        raise refuse_on(_psycopg_of(dbapi_connection), "commit")

    def do_rollback(self, dbapi_connection: Any) -> None:
        """SQLAlchemy ends its own view of the transaction; the transaction itself stays for
        jobfence to commit or roll back (aborted by an error, it cannot commit)."""

    def do_close(self, dbapi_connection: Any) -> None:
        """The connection is jobfence's, returned to its pool after the job."""

    def do_terminate(self, dbapi_connection: Any) -> None:
        """As :meth:`do_close`: a broken connection is jobfence's to discard."""

    def on_connect(self) -> None:
        return None

    @classmethod
    def get_async_dialect_cls(cls, url: Any) -> type[FenceAsyncDialect]:
        return FenceAsyncDialect


class FenceAsyncDialect(PGDialectAsync_psycopg):
    """:class:`FenceDialect` for SQLAlchemy's asyncio extension (an ``AsyncConnection``)."""

    supports_statement_cache = True

    def do_commit(self, dbapi_connection: Any) -> None:
        raise refuse_on(_psycopg_of(dbapi_connection), "commit")

    def do_rollback(self, dbapi_connection: Any) -> None:
        """As :meth:`FenceDialect.do_rollback`."""

    def do_close(self, dbapi_connection: Any) -> None:
        """As :meth:`FenceDialect.do_close`."""

    def do_terminate(self, dbapi_connection: Any) -> None:
        """As :meth:`FenceDialect.do_terminate`."""

    def on_connect(self) -> None:
        return None


registry.register(f"postgresql.{_DIALECT_NAME}", __name__, "FenceDialect")


_ROLLBACK_HINT = "; raise an exception to roll the job back, fence included"


def _dbapi_of(sa_conn: Connection) -> object:
    """The psycopg connection under a SQLAlchemy ``Connection`` of these engines."""
    return _psycopg_of(sa_conn.connection)


class FenceSAConnection(Connection):
    """The ``Connection`` of these engines (``session.connection()``): ``commit()`` and
    ``rollback()`` raise :class:`jobfence.TransactionMisuse`, and so does ``close()`` inside
    the ``session_for`` block (the rollback SQLAlchemy does when the block lets the connection
    go stays silent: the transaction is jobfence's to end)."""

    _jobfence_open = False  # inside the session_for block

    def commit(self) -> None:
        raise refuse_on(_dbapi_of(self), "commit")

    def rollback(self) -> None:
        raise refuse_on(_dbapi_of(self), "rollback", _ROLLBACK_HINT)

    def close(self) -> None:
        if self._jobfence_open:
            raise refuse_on(_dbapi_of(self), "close")
        super().close()


class FenceSession(Session):
    """A ``Session`` that refuses to end the fence transaction: ``commit()`` and
    ``rollback()`` raise :class:`jobfence.TransactionMisuse`."""

    _jobfence_tx: object = None  # the psycopg connection of the handler (set by session_for)
    _jobfence_open = False  # inside the session_for block

    def commit(self) -> None:
        raise refuse_on(self._jobfence_tx, "commit")

    def rollback(self) -> None:
        raise refuse_on(self._jobfence_tx, "rollback", _ROLLBACK_HINT)

    def close(self) -> None:
        """Refused inside the ``session_for`` block (it would roll back SQLAlchemy's view of
        the transaction and leave the flushed rows to commit); the block closes it."""
        if self._jobfence_open:
            raise refuse_on(self._jobfence_tx, "close")
        super().close()

    def reset(self) -> None:
        """As :meth:`close`."""
        if self._jobfence_open:
            raise refuse_on(self._jobfence_tx, "reset")
        super().reset()


class FenceAsyncSession(AsyncSession):
    """An ``AsyncSession`` that refuses to end the fence transaction, like
    :class:`FenceSession` (which it runs on)."""

    sync_session_class = FenceSession

    async def commit(self) -> None:
        raise refuse_on(getattr(self.sync_session, "_jobfence_tx", None), "commit")

    async def rollback(self) -> None:
        raise refuse_on(
            getattr(self.sync_session, "_jobfence_tx", None), "rollback", _ROLLBACK_HINT
        )


def _end_of_block(session: Session) -> None:
    """Leaving a ``session_for`` (or ``async_session_for``) block normally: release each
    savepoint the handler left open (``begin_nested()`` never committed), as
    ``Session.commit()`` does, then flush, so that all of its changes commit with the fence.
    Closing the session would otherwise roll them back to the savepoint, and the job would
    commit its fence without them. One a failed flush already rolled back (inactive) stays
    rolled back."""
    while (nested := session.get_nested_transaction()) is not None:
        if nested.is_active:
            nested.commit()
        else:
            nested.rollback()
    session.flush()


async def _lent_async_connection() -> psycopg.AsyncConnection[Any]:
    conn = _lent_async.get()
    if conn is None:  # pragma: no cover - only async_session_for connects this engine
        raise RuntimeError("the jobfence SQLAlchemy engine connects only in async_session_for()")
    return conn


def fence_async_engine() -> AsyncEngine:
    """The process's engine for :func:`async_session_for` (created on first use)."""
    global _async_engine  # noqa: PLW0603 - one engine per process, created lazily
    with _engine_lock:
        if _async_engine is None:
            _async_engine = create_async_engine(
                f"postgresql+{_DIALECT_NAME}://",
                async_creator=_lent_async_connection,
                poolclass=NullPool,
                pool_reset_on_return=None,
            )
            _async_engine.sync_engine._connection_cls = FenceSAConnection
        return _async_engine


@asynccontextmanager
async def async_session_for(
    tx: psycopg.AsyncConnection[Any], **session_kwargs: Any
) -> AsyncIterator[AsyncSession]:
    """:func:`session_for` for an ``async def`` handler: a :class:`FenceAsyncSession` on ``tx``,
    its ``AsyncConnection``, inside its fence transaction; flushed when the block ends."""
    if not isinstance(tx, psycopg.AsyncConnection):
        raise TypeError(
            "async_session_for needs the psycopg.AsyncConnection an async handler is given (its"
            f" third argument), got {type(tx).__module__}.{type(tx).__qualname__}"
        )
    engine = fence_async_engine()
    token = _lent_async.set(tx)
    try:
        sa_conn = await engine.connect()
    finally:
        _lent_async.reset(token)
    try:
        session = FenceAsyncSession(bind=sa_conn, **session_kwargs)
        sync_session, sync_conn = session.sync_session, sa_conn.sync_connection
        assert isinstance(sync_session, FenceSession)
        assert isinstance(sync_conn, FenceSAConnection)
        sync_session._jobfence_tx = tx
        sync_session._jobfence_open = sync_conn._jobfence_open = True
        try:
            yield session
            await session.run_sync(_end_of_block)
        finally:
            sync_session._jobfence_open = sync_conn._jobfence_open = False
            await session.close()
    finally:
        await sa_conn.close()


def _lent_connection() -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_lent, "conn", None)
    if conn is None:  # pragma: no cover - only session_for connects this engine
        raise RuntimeError("the jobfence SQLAlchemy engine connects only inside session_for()")
    return conn


def fence_engine() -> Engine:
    """The process's engine for :func:`session_for` (created on first use)."""
    global _engine  # noqa: PLW0603 - one engine per process, created lazily
    with _engine_lock:
        if _engine is None:
            _engine = create_engine(
                f"postgresql+{_DIALECT_NAME}://",
                creator=_lent_connection,
                poolclass=NullPool,
                pool_reset_on_return=None,
            )
            _engine._connection_cls = FenceSAConnection
        return _engine


@contextmanager
def session_for(tx: psycopg.Connection[Any], **session_kwargs: Any) -> Iterator[Session]:
    """A :class:`FenceSession` on ``tx``, the connection a sync handler is given, inside its
    fence transaction. Leaving the block normally flushes the session (its changes then commit
    with the fence, when the handler returns), savepoints it left open released first; an
    exception leaves them unflushed and the job fails. ``session_kwargs`` go to the
    ``Session`` (``info``, ``autoflush``...)."""
    if not isinstance(tx, psycopg.Connection):
        raise TypeError(
            "session_for needs the psycopg.Connection a sync handler is given (its third"
            f" argument), got {type(tx).__module__}.{type(tx).__qualname__}"
        )
    engine = fence_engine()
    _lent.conn = tx
    try:
        sa_conn = engine.connect()
    finally:
        _lent.conn = None
    try:
        session = FenceSession(bind=sa_conn, **session_kwargs)
        session._jobfence_tx = tx
        assert isinstance(sa_conn, FenceSAConnection)
        session._jobfence_open = sa_conn._jobfence_open = True
        try:
            yield session
            _end_of_block(session)
        finally:
            session._jobfence_open = sa_conn._jobfence_open = False
            session.close()
    finally:
        sa_conn.close()
