"""The transaction a handler is lent, and the record of what it was refused.

jobfence ends the work transaction, never the handler. While a handler runs, the psycopg
connection it was given is *lent*: ``commit()``, ``rollback()``, ``close()``,
``set_autocommit()`` (and setting ``autocommit``) and the two-phase ``tpc_*()`` calls raise
:class:`~jobfence.TransactionMisuse` before anything is sent, and each refusal is recorded on the
job's :class:`TxGuard`. The integrations refuse their own ways of ending it the same way, through
:func:`refuse_on` (a SQLAlchemy session's ``commit()``, Django's ``transaction.commit()``...).

The harness checks the guard once the handler is done (:func:`after_handler`): once anything was
refused, the job fails as ``TransactionMisuse`` whatever the handler did with the exception
(caught it, raised another): its transaction rolls back, fence included, and it is
dead-lettered at once. A refusal the handler could swallow would otherwise let a job that asked
to throw its work away commit it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import psycopg
from psycopg.pq import TransactionStatus

from jobfence.errors import TransactionAborted, TransactionMisuse

ENDED_BY_HANDLER = (
    "the fence transaction is committed by jobfence, with the handler's work and its fence"
    " together; do not call {what}() on the connection (or session) a handler is given"
)

# The attribute of a lent psycopg connection that holds its job's guard.
_GUARD = "_jobfence_guard"

# What a lent connection refuses: attribute shadowed -> the call named in the error. The
# ``autocommit`` setter goes through ``_set_autocommit``.
_ENDERS = {
    "commit": "commit",
    "rollback": "rollback",
    "close": "close",
    "set_autocommit": "set_autocommit",
    "_set_autocommit": "set_autocommit",
    "tpc_begin": "tpc_begin",
    "tpc_prepare": "tpc_prepare",
    "tpc_commit": "tpc_commit",
    "tpc_rollback": "tpc_rollback",
}
# Of those, the ones that are plain methods on an AsyncConnection (the others are coroutines).
_ASYNC_PLAIN = frozenset({"_set_autocommit"})


class TxGuard:
    """One job's record of the calls refused to its handler (the first one named)."""

    __slots__ = ("refused",)

    def __init__(self) -> None:
        self.refused: str | None = None

    def refuse(self, what: str, hint: str = "") -> TransactionMisuse:
        """Record that ``what()`` was refused; the exception to raise at the caller."""
        if self.refused is None:
            self.refused = what
        return TransactionMisuse(ENDED_BY_HANDLER.format(what=what) + hint)

    def misuse(self) -> TransactionMisuse | None:
        """What the job fails with once the handler is done, if anything was refused."""
        if self.refused is None:
            return None
        return TransactionMisuse(
            ENDED_BY_HANDLER.format(what=self.refused)
            + " (refused; the handler went on after the refusal, so the job fails all the same"
            " and nothing of it is applied)"
        )


def guard_of(conn: object) -> TxGuard | None:
    """The guard of the job ``conn`` is lent to, if it is lent."""
    found = getattr(conn, "__dict__", {}).get(_GUARD)
    return found if isinstance(found, TxGuard) else None


def refuse_on(conn: object, what: str, hint: str = "") -> TransactionMisuse:
    """The refusal of ``what()`` by an integration whose handler holds ``conn`` (the psycopg
    connection jobfence lent): recorded on its job's guard when it is lent."""
    guard = guard_of(conn)
    if guard is None:
        return TransactionMisuse(ENDED_BY_HANDLER.format(what=what) + hint)
    return guard.refuse(what, hint)


def _sync_refuser(guard: TxGuard, what: str) -> Callable[..., NoReturn]:
    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise guard.refuse(what)

    return refuse


def _async_refuser(guard: TxGuard, what: str) -> Callable[..., Any]:
    async def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise guard.refuse(what)

    return refuse


@contextmanager
def lend(tx: object, guard: TxGuard) -> Iterator[None]:
    """While the block runs, ``tx`` (a psycopg ``Connection`` or ``AsyncConnection``; anything
    else is lent as it is) refuses every call that would end its transaction, recording each on
    ``guard``."""
    if isinstance(tx, psycopg.AsyncConnection):
        shadows = {
            name: (_sync_refuser if name in _ASYNC_PLAIN else _async_refuser)(guard, what)
            for name, what in _ENDERS.items()
        }
    elif isinstance(tx, psycopg.Connection):
        shadows = {name: _sync_refuser(guard, what) for name, what in _ENDERS.items()}
    else:
        yield
        return
    attrs = tx.__dict__
    attrs.update(shadows)
    attrs[_GUARD] = guard
    try:
        yield
    finally:
        for name in shadows:
            attrs.pop(name, None)
        attrs.pop(_GUARD, None)


def after_handler(tx: object, guard: TxGuard) -> None:
    """Once a handler returned: raise what the job fails with when it misused or doomed its
    transaction (``tx``, when a psycopg connection, must still be open and usable)."""
    misuse = guard.misuse()
    if misuse is not None:
        raise misuse
    if isinstance(tx, psycopg.Connection | psycopg.AsyncConnection):
        check_still_open(tx.info.transaction_status, tx.closed)


def check_still_open(status: TransactionStatus, closed: bool) -> None:
    """The transaction a handler returned from is still open and can commit."""
    if closed:
        raise TransactionMisuse(ENDED_BY_HANDLER.format(what="close"))
    if status == TransactionStatus.INERROR:
        raise TransactionAborted(
            "the handler returned after a database error aborted its transaction"
            " (caught, not raised): nothing of this job can commit"
        )
    if status != TransactionStatus.INTRANS:
        raise TransactionMisuse(
            "the handler ended the fence transaction itself (a COMMIT or ROLLBACK statement):"
            " what it did up to there committed or rolled back with the fence, and anything after"
            " ran outside it; the fence transaction is committed by jobfence, never by a handler"
        )


@contextmanager
def guarded(tx: object) -> Iterator[TxGuard]:
    """Run a handler on ``tx``, lent: an exception it raises after a refusal becomes the
    refusal's ``TransactionMisuse`` (the original one its cause); the caller then calls
    :func:`after_handler` once it returned."""
    guard = TxGuard()
    with lend(tx, guard):
        try:
            yield guard
        except Exception as exc:
            misuse = guard.misuse()
            if misuse is not None:
                raise misuse from exc
            raise
