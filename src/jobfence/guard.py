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

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from jobfence.errors import TransactionAborted, TransactionMisuse
from jobfence.pgtx import refused_by_check

ENDED_BY_HANDLER = (
    "the fence transaction is committed by jobfence, with the handler's work and its fence"
    " together; do not call {what}() on the connection (or session) a handler is given"
)

_ENDED_WITH_SQL = "the handler ended the fence transaction itself (a COMMIT or ROLLBACK statement)"
_NEVER_BY_A_HANDLER = "the fence transaction is committed by jobfence, never by a handler"

# Why a job of a group fails when a handler in the group committed the group's transaction.
COMMITTED_IN_GROUP = (
    "a handler in this job's group committed the group's transaction itself (a COMMIT"
    " statement): this job's fence committed with it, and its work may not have (the handlers"
    " after that COMMIT did not run, or ran outside the transaction); review it: a replay is a"
    f" duplicate that applies nothing; {_NEVER_BY_A_HANDLER}"
)

# The attribute of a psycopg connection that holds the guard of the job it is lent to (None
# between jobs); its presence says the refusing shadows below are installed on it.
_GUARD = "_jobfence_guard"

# Settings the server reports to the client each time they change (ParameterStatus), so read
# without a round trip. Their values when a connection is first lent are kept on it: one that
# differs once a job's transaction has ended was set for the whole session (a SET without
# LOCAL; a SET LOCAL ends with its transaction) and would apply to every later job there.
_REPORTED = (
    b"default_transaction_read_only",
    b"session_authorization",
    b"is_superuser",
    b"client_encoding",
    b"DateStyle",
    b"IntervalStyle",
    b"TimeZone",
    b"standard_conforming_strings",
)
_SESSION = "_jobfence_session"

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
    """One job's record of the calls refused to its handler (the first one named). As a
    context manager (:func:`guarded`) it lends ``tx`` for the block: an exception the block
    raises after a refusal becomes the refusal's ``TransactionMisuse``."""

    __slots__ = ("_tx", "refused", "refused_because")

    def __init__(self, tx: object = None) -> None:
        self.refused: str | None = None
        self.refused_because: str | None = None
        self._tx = tx

    def refuse(self, what: str, hint: str = "") -> TransactionMisuse:
        """Record that ``what()`` was refused; the exception to raise at the caller."""
        if self.refused is None:
            self.refused = what
            self.refused_because = ENDED_BY_HANDLER.format(what=what)
        return TransactionMisuse(ENDED_BY_HANDLER.format(what=what) + hint)

    def refuse_because(self, reason: str) -> TransactionMisuse:
        """Record a refusal that is not a call ending the transaction (an integration's own,
        ``reason`` saying why); the exception to raise at the caller."""
        if self.refused is None:
            self.refused, self.refused_because = "write", reason
        return TransactionMisuse(reason)

    def misuse(self) -> TransactionMisuse | None:
        """What the job fails with once the handler is done, if anything was refused."""
        if self.refused_because is None:
            return None
        return TransactionMisuse(
            self.refused_because
            + " (refused; the handler went on after the refusal, so the job fails all the same"
            " and nothing of it is applied)"
        )

    def __enter__(self) -> TxGuard:
        attrs = _lendable(self._tx)
        if attrs is not None:
            attrs[_GUARD] = self
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        attrs = _lendable(self._tx)
        if attrs is not None:
            attrs[_GUARD] = None
        if isinstance(exc, Exception):
            misuse = self.misuse()
            if misuse is not None:
                raise misuse from exc


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


def refuse_because(conn: object, reason: str) -> TransactionMisuse:
    """An integration's refusal of what would escape the transaction lent as ``conn``, for
    ``reason``: recorded on its job's guard when it is lent."""
    guard = guard_of(conn)
    return TransactionMisuse(reason) if guard is None else guard.refuse_because(reason)


def _lendable(tx: object) -> dict[str, Any] | None:
    """The attributes of ``tx`` with its refusals installed (once per connection), or None
    when ``tx`` is not a psycopg connection."""
    if not isinstance(tx, psycopg.Connection | psycopg.AsyncConnection):
        return None
    attrs: dict[str, Any] = tx.__dict__
    if _GUARD not in attrs:
        _install(tx, attrs)
    return attrs


def _install(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], attrs: dict[str, Any]
) -> None:
    """Shadow each call that ends a transaction on ``conn`` with one that is refused while the
    connection is lent (its guard set) and otherwise does what it did. Installed once: lending
    then sets one attribute, which keeps the job path cheap."""
    cls = type(conn)
    asynchronous = isinstance(conn, psycopg.AsyncConnection)
    for name, what in _ENDERS.items():
        original = getattr(cls, name)
        if asynchronous and name not in _ASYNC_PLAIN:
            attrs[name] = _async_shadow(conn, original, what)
        else:
            attrs[name] = _sync_shadow(conn, original, what)
    attrs[_GUARD] = None
    attrs[_SESSION] = _reported(conn)


def _reported(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> tuple[Any, ...]:
    return tuple(map(conn.pgconn.parameter_status, _REPORTED))


def session_changed(conn: object) -> list[str]:
    """After a job's transaction ended on ``conn``: the reported settings whose value is not
    the one they had when ``conn`` was first lent to a handler (set for the session by a
    handler); empty when none, or when ``conn`` was never lent."""
    first = getattr(conn, "__dict__", {}).get(_SESSION)
    if first is None or conn.closed:  # type: ignore[attr-defined]
        return []
    now = _reported(conn)  # type: ignore[arg-type]
    if now == first:
        return []
    return [
        name.decode() for name, was, is_ in zip(_REPORTED, first, now, strict=True) if was != is_
    ]


def retire(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Have ``conn``'s pool close it when it comes back, instead of lending it again (a pool
    replaces a connection past its lifetime, logging at INFO); a connection no psycopg_pool
    opened is closed at once. :func:`retired` tells."""
    conn.__dict__["_jobfence_retired"] = True
    if hasattr(conn, "_expire_at"):  # set by psycopg_pool on the connections it opens
        conn._expire_at = 0.0
    elif not conn.closed:  # without it: closed now, so that no pool lends it again
        conn.pgconn.finish()


def retired(conn: object) -> bool:
    """:func:`retire` was called on ``conn``."""
    return bool(getattr(conn, "__dict__", {}).get("_jobfence_retired"))


def _sync_shadow(conn: object, original: Callable[..., Any], what: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        guard = conn.__dict__[_GUARD]
        if guard is not None:
            raise guard.refuse(what)
        return original(conn, *args, **kwargs)

    return call


def _async_shadow(conn: object, original: Callable[..., Any], what: str) -> Callable[..., Any]:
    async def call(*args: Any, **kwargs: Any) -> Any:
        guard = conn.__dict__[_GUARD]
        if guard is not None:
            raise guard.refuse(what)
        return await original(conn, *args, **kwargs)

    return call


def guarded(tx: object) -> TxGuard:
    """Run a handler on ``tx``, lent (``with guarded(tx) as guard: ...``); the caller then
    calls :func:`after_handler` once it returned."""
    return TxGuard(tx)


def after_handler(tx: object, guard: TxGuard) -> None:
    """Once a handler returned: raise what the job fails with when it misused or doomed its
    transaction (``tx``, when a psycopg connection, must still be open and usable)."""
    misuse = guard.misuse()
    if misuse is not None:
        raise misuse
    if isinstance(tx, psycopg.Connection | psycopg.AsyncConnection):
        if tx.closed:
            raise TransactionMisuse(ENDED_BY_HANDLER.format(what="close"))
        check_still_open(TransactionStatus(tx.pgconn.transaction_status), closed=False)


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
            f"{_ENDED_WITH_SQL}: what it did up to there committed or rolled back with the fence,"
            f" and anything after ran outside it; {_NEVER_BY_A_HANDLER}"
        )


def not_held() -> TransactionMisuse:
    """What a job fails with when the transaction its handler returned in is not the one that
    holds its fence (the ``fence_held`` check sent with the COMMIT refused it)."""
    return TransactionMisuse(
        "the transaction the handler returned in does not hold the job's fence:"
        f" {_ENDED_WITH_SQL} and began another (or ran RESET ALL, which clears the mark the"
        " check reads): what it did before committed or rolled back with the fence, and what it"
        f" did after, in a transaction without the fence, was rolled back; {_NEVER_BY_A_HANDLER}"
    )


def check_held_now(tx: object, check: bytes) -> None:
    """For a runner that commits on its own (not through :mod:`jobfence.pgtx` or
    :class:`~jobfence.sync.PsycopgRunner`, which send the check with the COMMIT): run the
    ``fence_held`` check on ``tx`` when it is a psycopg connection, before the runner commits.
    One round trip more; its failure aborts the transaction, so nothing of it can commit."""
    if not isinstance(tx, psycopg.Connection):
        return
    try:
        tx.execute(check)
    except psycopg.Error as exc:
        if refused_by_check(exc):
            raise not_held() from None
        raise
