"""What a worker logs about an outage of its database or of its queue's broker: one line when it
goes away, one when it is back (how long it was gone, how many jobs were given back), and between
them at most one line every ``still_down_every`` seconds. Each line names what is unreachable:
``broker`` when the error is a :class:`~jobfence.errors.QueueUnavailable`, else ``database``.
psycopg's and psycopg_pool's own warnings about each broken connection, pipeline and failed
reconnection are held back meanwhile and counted in the line that says it is back. No line shows
an object's repr (``<psycopg.AsyncConnection [BAD] at 0x...>``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg import AsyncConnection

from jobfence.db import (
    READ_ONLY_HINT,
    RECONNECT_MAX_DELAY_SECONDS,
    check_writable,
    is_connection_loss,
    is_read_only,
)
from jobfence.errors import QueueUnavailable
from jobfence.redact import redact_text

STILL_DOWN_EVERY = 30.0  # seconds between two "still unreachable" lines
PSYCOPG_LOGGERS = ("psycopg", "psycopg.pool")  # a filter applies to its own logger's records

# An object's repr names its class with its module (``<psycopg.AsyncConnection [BAD] at 0x...>``,
# ``<jobfence.pgtx._Chained ...>``); reprs nest, so they are removed from the inside out.
# Held back even outside an outage: each follows an error the worker reports itself (the
# connection broke; a pipeline's block failed and psycopg drops the second error).
_ALWAYS_HELD_BACK = (
    "discarding broken connection",
    "discarding closed connection",
    "error ignored terminating",
)
_REPR = re.compile(r"<[A-Za-z_]\w*(?:\.\w+)+[^<>]*>")


def reason(exc: BaseException) -> str:
    """``Class: first line`` of the error that says the database is unreachable (``exc`` or
    what caused it), without any object's repr."""
    root, seen = exc, set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if is_connection_loss(cause, None):
            root = cause
            break
        cause = cause.__cause__ or cause.__context__
    text = str(root).strip()
    first = text.splitlines()[0] if text else ""
    while (cleaned := _REPR.sub("", first)) != first:
        first = cleaned
    first = " ".join(first.split()).rstrip(" :")
    return f"{type(root).__name__}: {first}" if first else type(root).__name__


def subject(exc: BaseException) -> str:
    """``broker`` when ``exc`` (or what it came from) says the queue's broker is unreachable,
    else ``database``."""
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, QueueUnavailable):
            return "broker"
        cause = cause.__cause__ or cause.__context__
    return "database"


def read_only(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it came from) is a write the database refused as read-only
    (:func:`jobfence.db.is_read_only`): an outage for writing, not a lost connection."""
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if is_read_only(cause):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class OutageLog:
    """The log lines of one worker's outages; also a :class:`logging.Filter` for psycopg's
    loggers (see :meth:`filter`)."""

    def __init__(
        self,
        log: logging.Logger,
        *,
        still_down_every: float = STILL_DOWN_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._every = still_down_every
        self._clock = clock
        self._since: float | None = None
        self._what = "database"  # what went away: database or broker
        self._read_only = False  # the outage is the database refusing writes
        self._next_still_down = 0.0
        self._held_back = 0

    @property
    def down(self) -> bool:
        return self._since is not None

    @property
    def read_only(self) -> bool:
        """The outage under way is the database refusing writes (a standby, or
        default_transaction_read_only on)."""
        return self._since is not None and self._read_only

    def went_away(self, exc: BaseException) -> None:
        """The database or the broker is unreachable, or the database refuses writes: one
        WARNING for the outage, DEBUG for the rest."""
        what = subject(exc)
        refused = what == "database" and read_only(exc)
        if self._since is not None:
            self._log.debug(
                "%s %s: %s", what, "read-only" if refused else "unreachable", reason(exc)
            )
            return
        self._since = self._clock()
        self._what = what
        self._read_only = refused
        self._next_still_down = self._since + self._every
        if refused:
            self._log.warning(
                "database is read-only (%s; %s): pausing; the jobs in hand go back to the queue"
                " when it accepts writes again",
                reason(exc),
                READ_ONLY_HINT,
            )
            return
        self._log.warning(
            "%s went away (%s): pausing; the jobs in hand go back to the queue when it is back",
            what,
            reason(exc),
        )

    def still_down(self, exc: BaseException) -> None:
        """A probe failed: a WARNING at most every ``still_down_every`` seconds."""
        now = self._clock()
        since = now if self._since is None else self._since
        what = subject(exc)
        state = "read-only" if what == "database" and read_only(exc) else "unreachable"
        if now < self._next_still_down:
            self._log.debug("%s still %s: %s", what, state, reason(exc))
            return
        self._next_still_down = now + self._every
        self._log.warning(
            "%s still %s after %.0fs (%s); retrying", what, state, now - since, reason(exc)
        )

    def back(self, released: int) -> None:
        """The database and the broker answer again (the database accepts writes) and
        ``released`` held jobs were given back."""
        gone = 0.0 if self._since is None else self._clock() - self._since
        held_back, self._held_back = self._held_back, 0
        self._since = None
        self._log.info(
            "%s after %.1fs, %d job(s) released: resuming%s",
            "database writable again" if self._read_only else f"{self._what} back",
            gone,
            released,
            f" ({held_back} psycopg warning(s) held back)" if held_back else "",
        )
        self._read_only = False

    def filter(self, record: logging.LogRecord) -> bool:
        """For the ``psycopg`` and ``psycopg.pool`` loggers: hold back their WARNINGs during an
        outage, and always those in ``_ALWAYS_HELD_BACK``; they are counted in the next
        :meth:`back` line. With that logger at DEBUG (``jobfence -v``), all pass."""
        if record.levelno < logging.WARNING or logging.getLogger(record.name).isEnabledFor(
            logging.DEBUG
        ):
            return True
        if self.down or str(record.msg).startswith(_ALWAYS_HELD_BACK):
            self._held_back += 1
            return False
        return True


READ_COMMITTED_SESSION = (
    b"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED"
)


async def stay_connected(
    conninfo: str,
    serve: Callable[[AsyncConnection[Any]], Awaitable[None]],
    *,
    who: str,
    doing: tuple[str, str],
    log: logging.Logger,
    stopping: asyncio.Event,
    reconnect_cap_seconds: float,
    on_lost: Callable[[], None],
) -> None:
    """Run ``serve`` on a connection of its own to ``conninfo`` (autocommit) until ``stopping``
    is set, connecting again whenever it fails with a database error (a relay's loop). Its
    transactions run at READ COMMITTED, whatever the database's default isolation level.

    A lost or refused connection is one outage: ``WHO: database went away (...): PAUSED`` at
    its start, ``WHO: database still unreachable after Ns`` at most every 30 s, INFO ``WHO:
    database back after Ns: RESUMED`` once connected again (``doing`` is the pair PAUSED,
    RESUMED); tries are 0.5 s, 1 s, then at most :data:`~jobfence.db.RECONNECT_MAX_DELAY_SECONDS`
    apart, so the part resumes within seconds of the database's return. Another database error
    (a revoked grant) is logged at each try, and tries back off from 0.5 s doubling to
    ``reconnect_cap_seconds``; only a connection that served a minute resets the backoff.
    ``on_lost`` is called after each failure (the part is no longer active)."""
    paused, resumed = doing
    backoff = 0.5
    loop = asyncio.get_running_loop()
    since: float | None = None  # the database's outage, while it lasts
    refused = False  # that outage is the database refusing writes
    next_still_down = 0.0
    while not stopping.is_set():
        started = loop.time()
        try:
            async with await psycopg.AsyncConnection.connect(
                conninfo, autocommit=True, connect_timeout=10
            ) as conn:
                # Everything a relay runs is jobfence's own, written for READ COMMITTED: a
                # database's stricter default (default_transaction_isolation) is not for it.
                await conn.execute(READ_COMMITTED_SESSION)
                if since is not None:
                    if refused:  # back only once it accepts writes (else: still read-only)
                        await check_writable(conn)
                    log.info(
                        "%s: database %s after %.1fs: %s",
                        who,
                        "writable again" if refused else "back",
                        loop.time() - since,
                        resumed,
                    )
                    since, backoff, refused = None, 0.5, False
                await serve(conn)
        except psycopg.Error as exc:
            on_lost()
            now = loop.time()
            if now - started > 60:
                backoff = 0.5
            delay = backoff
            if is_connection_loss(exc, None):
                # A read-only refusal too: the connection is closed, and the next one resolves
                # the host again (after a failover, the new primary's address).
                delay = min(backoff, RECONNECT_MAX_DELAY_SECONDS)
                state = "read-only" if is_read_only(exc) else "unreachable"
                if since is None:
                    since, next_still_down = now, now + STILL_DOWN_EVERY
                    refused = state == "read-only"
                    log.warning(
                        "%s: database %s (%s%s): %s; reconnecting at least every %.1fs",
                        who,
                        "is read-only" if refused else "went away",
                        _one_line(exc),
                        f"; {READ_ONLY_HINT}" if refused else "",
                        paused,
                        RECONNECT_MAX_DELAY_SECONDS,
                    )
                elif now >= next_still_down:
                    next_still_down = now + STILL_DOWN_EVERY
                    log.warning(
                        "%s: database still %s after %.0fs (%s); reconnecting",
                        who,
                        state,
                        now - since,
                        _one_line(exc),
                    )
                else:
                    log.debug("%s: database still %s: %s", who, state, _one_line(exc))
            else:
                log.warning(
                    "%s: database error (%s); retrying in %.1fs", who, _one_line(exc), backoff
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay)
            backoff = min(backoff * 2, reconnect_cap_seconds)


def _one_line(exc: BaseException) -> str:
    """``Class: message`` on one line, at most 200 characters of the message, credentials
    redacted (a connection error may quote its URL)."""
    text = redact_text(" ".join(str(exc).split()))
    return f"{type(exc).__name__}: {text[:200]}"
