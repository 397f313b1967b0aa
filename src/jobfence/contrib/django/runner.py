"""The work transaction of a sync handler inside ``transaction.atomic()`` on Django's own
connection: a :class:`~jobfence.sync.SyncTransactionRunner` for ``manage.py jobfence_worker``.

The fence is inserted as the atomic block's first statement, then the handler runs: its ORM
writes and raw SQL belong to the same transaction, which commits with the fence when the block
exits, or not at all. Its ``transaction.on_commit`` callbacks run once the block has committed,
each job's on its own, and none of them can fail a committed job (jobfence.contrib.django.
on_commit).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, NoReturn, TypeVar

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db import Error as DjangoDatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from jobfence.contrib.django import on_commit
from jobfence.errors import ConfigError, TransactionAborted, TransactionMisuse
from jobfence.guard import ENDED_BY_HANDLER, check_still_open, refuse_because, refuse_on
from jobfence.sync import Work

T = TypeVar("T")


class DjangoRunner:
    """Runs each work transaction in ``transaction.atomic(using=...)`` on the calling thread's
    Django connection (Django keeps one per thread, so each of the worker's threads has its
    own). The handler gets that connection's ``psycopg.Connection``; the ORM uses the same one.

    Before each job a connection that had an error and no longer works, or that outlived a
    non-zero ``CONN_MAX_AGE``, is closed and a new one opened, as Django does between
    requests; with ``CONN_MAX_AGE = 0`` (Django's default) a worker thread keeps its connection,
    as any long-running management command does.

    Database errors reach the worker as psycopg's (the cause Django wraps), so it tells a lost
    database, a serialization failure or a deadlock from a failure of the job.

    The handlers' ``transaction.on_commit`` callbacks run after the commit, in this thread,
    before ``run`` returns (so before the job is acked); what they raise is logged, never
    raised (:func:`jobfence.contrib.django.on_commit.run_after_commit`).
    """

    def __init__(self, using: str = DEFAULT_DB_ALIAS) -> None:
        self.using = using

    def run(self, fence_sql: str, params: Mapping[str, Any], work: Work[T]) -> T:
        wrapper = connections[self.using]
        _refresh(wrapper)
        raw: psycopg.Connection[Any] | None = None
        try:
            with transaction.atomic(using=self.using):
                raw = _psycopg_connection(wrapper)
                with psycopg.Cursor(raw) as cur:  # server-side binding, as jobfence's own
                    cur.execute(fence_sql, params)
                    rows = cur.fetchall()
                with _lent(wrapper, raw):
                    result = work(rows, raw)
                _check_still_open(wrapper, raw)
                callbacks = on_commit.take(wrapper)  # run below, once the block committed
        except DjangoDatabaseError as exc:
            _drop_abandoned(wrapper, raw)
            cause = exc.__cause__
            if isinstance(cause, psycopg.Error):
                raise cause from None  # classified by its class (lost, conflict, failure)
            raise
        except BaseException:
            _drop_abandoned(wrapper, raw)
            raise
        if callbacks:
            on_commit.run_after_commit(wrapper, callbacks)
        return result


# Django's own ways of ending the transaction, on its connection wrapper: ``transaction.commit()``,
# ``transaction.rollback()`` and ``transaction.set_autocommit()`` call these, and
# ``connection.close()`` is one. (The psycopg connection under it is lent by the harness, whose
# guard refuses its own commit(), rollback(), close()...)
_ENDERS = ("commit", "rollback", "set_autocommit", "close")


@contextmanager
def _lent(wrapper: BaseDatabaseWrapper, raw: psycopg.Connection[Any]) -> Iterator[None]:
    """While the handler runs, ``transaction.on_commit`` records which job registers each
    callback (:mod:`jobfence.contrib.django.on_commit`), and the calls that would end the
    transaction through Django raise
    :class:`~jobfence.TransactionMisuse` before anything is sent, recorded on the job's guard
    (jobfence.guard), so that the job fails even if the handler catches the error; so does a
    write through another of ``DATABASES``' aliases, which would commit outside the job's
    transaction (:func:`_elsewhere`)."""
    for name in _ENDERS:
        setattr(wrapper, name, _refuse(raw, name))
    wrapper.on_commit = on_commit.registering(wrapper)  # type: ignore[method-assign]
    try:
        with ExitStack() as others:
            for alias in connections:
                if alias != wrapper.alias:
                    other = connections[alias]
                    others.enter_context(other.execute_wrapper(_elsewhere(raw, wrapper, alias)))
            yield
    finally:
        for name in (*_ENDERS, "on_commit"):
            wrapper.__dict__.pop(name, None)


# A statement that only reads: what a handler may run through another alias (a replica, say).
# Anything else there (an ORM save, a raw INSERT, a CTE that writes) is refused.
_READS = re.compile(
    r"(?:\s|/\*.*?\*/|--[^\n]*\n)*\(*\s*(SELECT|SHOW|EXPLAIN|VALUES|TABLE|WITH)\b",
    re.IGNORECASE | re.DOTALL,
)
_WRITES = re.compile(
    r"\b(INSERT|UPDATE|DELETE|MERGE|TRUNCATE|COPY|CREATE|ALTER|DROP|CALL|DO|ANALYZE)\b",
    re.IGNORECASE,
)


def writes(sql: str) -> bool:
    """Whether ``sql`` may write: anything but a plain read (a ``SELECT``, ``SHOW``, ``VALUES``,
    ``TABLE``, or a ``WITH`` or ``EXPLAIN`` naming no writing statement)."""
    found = _READS.match(sql)
    if found is None:
        return True
    return found[1].upper() in ("WITH", "EXPLAIN") and _WRITES.search(sql) is not None


def _elsewhere(
    raw: psycopg.Connection[Any], wrapper: BaseDatabaseWrapper, alias: str
) -> Callable[..., Any]:
    """Django's ``execute_wrapper`` for ``alias`` while a handler runs on ``wrapper``: a write
    there is refused before it is sent, and the job fails (nothing of it applied)."""

    def refuse_writes(
        execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        if writes(sql):
            raise refuse_because(
                raw,
                f"a handler wrote through the database alias {alias!r}, outside the job's"
                f" transaction on {wrapper.alias!r} (JOBFENCE['DATABASE_ALIAS']): it would"
                " commit on its own, whatever became of the job; write through"
                f" {wrapper.alias!r} (route the handler's models to it, or use"
                f" .using({wrapper.alias!r}))",
            )
        return execute(sql, params, many, context)

    return refuse_writes


def _refuse(raw: psycopg.Connection[Any], what: str) -> Callable[..., NoReturn]:
    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise refuse_on(raw, what)

    return refuse


def _drop_abandoned(wrapper: BaseDatabaseWrapper, raw: psycopg.Connection[Any] | None) -> None:
    """After a failed job: a connection Django let go of (closed in the atomic block) is
    closed, rolling back on the server; a broken one is replaced at the next job."""
    if raw is not None and wrapper.connection is not raw and not raw.closed:
        raw.close()
    if wrapper.connection is not None and getattr(wrapper.connection, "broken", False):
        wrapper.close()


def _refresh(wrapper: BaseDatabaseWrapper) -> None:
    if wrapper.connection is None:
        return
    if wrapper.settings_dict.get("CONN_MAX_AGE") == 0:
        if wrapper.errors_occurred and not wrapper.is_usable():
            wrapper.close()
        return
    wrapper.close_if_unusable_or_obsolete()


def _psycopg_connection(wrapper: BaseDatabaseWrapper) -> psycopg.Connection[Any]:
    raw = wrapper.connection
    if not isinstance(raw, psycopg.Connection):
        raise ConfigError(
            f"the database {wrapper.alias!r} is not on psycopg 3 (found"
            f" {type(raw).__module__}.{type(raw).__name__}): jobfence's Django worker needs"
            " `pip install 'psycopg[binary]'`, which Django's postgresql backend then uses"
        )
    return raw


def _check_still_open(wrapper: BaseDatabaseWrapper, raw: psycopg.Connection[Any]) -> None:
    """Inside the atomic block, after the handler: raise (so that the block rolls back) when
    the handler ended, broke or doomed the transaction."""
    if wrapper.closed_in_transaction or wrapper.connection is not raw:
        raise TransactionMisuse(ENDED_BY_HANDLER.format(what="close"))
    check_still_open(raw.info.transaction_status, raw.closed)
    if wrapper.needs_rollback:
        raise TransactionAborted(
            "the handler returned with the atomic block marked for rollback (a database error"
            " caught inside it, or transaction.set_rollback(True)): nothing of this job can"
            " commit; raise an exception to fail a job"
        )
