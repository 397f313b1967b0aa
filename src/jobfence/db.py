"""Finding the database: JOBFENCE_DATABASE_URL, which is required (``embedded`` asks for an
embedded PostgreSQL, pgserver, an optional extra imported only then)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import select
import time
import warnings
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import ConnStatus
from psycopg_pool import AsyncConnectionPool, PoolTimeout

try:  # the backoff psycopg_pool applies to reconnecting (not part of its public API)
    from psycopg_pool.base import AttemptWithBackoff
except ImportError:  # pragma: no cover - another psycopg_pool layout: its own backoff applies
    AttemptWithBackoff = None  # type: ignore[assignment,misc]

from jobfence.config import (
    EMBEDDED,
    ENV_DATABASE_POOL_MODE,
    ENV_DATABASE_URL,
    EXAMPLE_DATABASE_URL,
    POOL_MODE_TRANSACTION,
    database_pool_mode_from_env,
    database_url_from_env,
    embedded_dir_from_env,
    is_embedded,
    missing_database_url_message,
    similar_database_variables,
)
from jobfence.errors import ConfigError, DatabaseUnavailable, QueueUnavailable
from jobfence.redact import redact_url

log = logging.getLogger("jobfence.db")


def validate_url(url: str) -> str:
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else "invalid"
        first_line = redact_url(url, first_line)  # libpq quotes the URL, or a piece of it
        raise _invalid_url(first_line) from None
    except UnicodeDecodeError:
        # libpq decoded a percent-escape (%82, say: a password holding "%", unescaped) into
        # bytes that are not UTF-8, which psycopg cannot read back. Neither the value nor
        # the byte is named: it is most likely part of a password.
        raise _invalid_url("a percent-escape in it decodes to bytes that are not UTF-8") from None
    return url


def _invalid_url(why: str) -> ConfigError:
    return ConfigError(
        f"{ENV_DATABASE_URL} is not a valid libpq connection string or URL ({why}); "
        f"expected e.g. {EXAMPLE_DATABASE_URL}"
    )


EMBEDDED_EXTRA = "pip install 'jobfence[embedded]'"


def _embedded_missing(*, unset: bool) -> ConfigError:
    if unset:
        return ConfigError(
            f"{ENV_DATABASE_URL} is not set, so the embedded PostgreSQL is used, but "
            f"pgserver is not installed: {EMBEDDED_EXTRA} (or set {ENV_DATABASE_URL} to your "
            f"database, e.g. {EXAMPLE_DATABASE_URL})"
        )
    return ConfigError(
        f"{ENV_DATABASE_URL}={EMBEDDED} asks for the embedded PostgreSQL, but pgserver is not "
        f"installed: {EMBEDDED_EXTRA}"
    )


def embedded_available() -> bool:
    """Whether pgserver can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("pgserver") is not None
    except (ImportError, ValueError):
        return False


def start_embedded(data_dir: Path, *, unset: bool = False) -> str:
    """Start (or find running) an embedded PostgreSQL in ``data_dir`` and return its URL.
    ``unset``: the demo's default, JOBFENCE_DATABASE_URL being unset, asked for it (rather than
    ``JOBFENCE_DATABASE_URL=embedded``); the log line and the errors say which."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import when XDG_RUNTIME_DIR is unset (containers, CI).
            warnings.simplefilter("ignore")
            from pgserver import get_server  # type: ignore[attr-defined]
    except ImportError:
        raise _embedded_missing(unset=unset) from None
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    asked = f"{ENV_DATABASE_URL} not set" if unset else f"{ENV_DATABASE_URL}={EMBEDDED}"
    log.info("%s: using the embedded PostgreSQL in %s", asked, data_dir)
    if unset and (similar := similar_database_variables()):
        log.warning("%s set: did you mean %s?", " and ".join(similar), ENV_DATABASE_URL)
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI): harmless here.
        warnings.simplefilter("ignore")
        server = get_server(str(data_dir))
    return str(server.get_uri())


def check_database_setting(*, embedded_when_unset: bool = False) -> None:
    """Refuse, before any work, a JOBFENCE_DATABASE_URL that cannot work: unset or blank
    (unless ``embedded_when_unset``), not a valid URL, or ``embedded`` without pgserver.
    Starts nothing and connects nowhere."""
    url = database_url_from_env()
    if url is None and not embedded_when_unset:
        raise ConfigError(missing_database_url_message())
    if url is None or is_embedded(url):
        if not embedded_available():
            raise _embedded_missing(unset=url is None)
        return
    validate_url(url)


def resolve_database_url(*, embedded_when_unset: bool = False) -> str:
    """The database's URL: JOBFENCE_DATABASE_URL (validated), or the URL of the embedded
    PostgreSQL (started in JOBFENCE_EMBEDDED_DIR) when it says ``embedded``. Unset or blank, it
    is a :class:`ConfigError` that says how to set it, unless ``embedded_when_unset`` (the
    demo's default): then the embedded PostgreSQL too."""
    url = database_url_from_env()
    if url is None and not embedded_when_unset:
        raise ConfigError(missing_database_url_message())
    if url is None or is_embedded(url):
        return start_embedded(embedded_dir_from_env(), unset=url is None)
    return validate_url(url)


async def check_connection(
    url: str, *, connect_timeout: int = 5, needs_session: str | None = None
) -> None:
    """Connect once; turn failure into one clear line without the password. Then refuse, with
    a :class:`ConfigError`, a connection pooler (PgBouncer) that JOBFENCE_DATABASE_POOL_MODE
    does not declare (:func:`behind_pooler`), and, under ``transaction`` pooling, a part that
    ``needs_session`` (named by it: a session advisory lock, LISTEN, session settings)."""
    mode = database_pool_mode_from_env()
    if mode == POOL_MODE_TRANSACTION and needs_session is not None:
        raise ConfigError(transaction_pooling_refused(needs_session))
    try:
        conn = await psycopg.AsyncConnection.connect(url, connect_timeout=connect_timeout)
    except psycopg.OperationalError as exc:
        reason = redact_url(url, " ".join(str(exc).split()))
        raise DatabaseUnavailable(
            f"cannot connect to the database at {redact_url(url)}: {reason}"
        ) from None
    from jobfence.transport import warn_about_database

    try:
        warn_about_database(conn)  # a WARNING, once, for a remote host without verified TLS
        if mode is None and await behind_pooler(conn):
            raise ConfigError(
                f"{ENV_DATABASE_URL} reaches PostgreSQL through a connection pooler (PgBouncer):"
                f" set {ENV_DATABASE_POOL_MODE} to its pool mode, session or transaction"
                " (operations.md, Behind PgBouncer)"
            )
    finally:
        await conn.close()


def transaction_pooling() -> bool:
    """Whether JOBFENCE_DATABASE_POOL_MODE says ``transaction``: each transaction may run on
    another server connection, so nothing may rely on the session (prepared statements,
    LISTEN, session advisory locks, session settings)."""
    return database_pool_mode_from_env() == POOL_MODE_TRANSACTION


def connect_options() -> dict[str, Any]:
    """Keyword arguments for the psycopg connections jobfence opens: under transaction pooling,
    ``prepare_threshold=None`` (a statement prepared on one server connection does not exist
    on the next one, and a statement of another client's of the same name may); else none."""
    return {"prepare_threshold": None} if transaction_pooling() else {}


def transaction_pooling_refused(what: str) -> str:
    """The one line refusing ``what`` (a part that needs a session) under transaction
    pooling."""
    return (
        f"{what} needs a database session of its own, which a pooler in transaction mode does"
        f" not keep ({ENV_DATABASE_POOL_MODE}=transaction): run it with {ENV_DATABASE_URL}"
        " pointing at PostgreSQL directly or at a pool in session mode, and"
        f" {ENV_DATABASE_POOL_MODE} unset or session"
    )


async def behind_pooler(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether ``conn`` reaches PostgreSQL through a connection pooler, in one round trip: the
    process id that the connection's start reported (a pooler such as PgBouncer makes its own
    up) is not the server process's."""
    cur = await conn.execute("SELECT pg_backend_pid()")
    row = await cur.fetchone()
    return row is None or row[0] != conn.info.backend_pid


# libpq receives a result into an input buffer of 16 KiB, and each read from the socket takes
# at most the buffer's free space: a 420 KB list page arrives in 27 or more reads, each a round
# trip through the event loop (psycopg's asynchronous wait registers and removes the socket
# every time). The buffer grows to hold the largest single message received and never
# shrinks, so one row of this size, received once per connection, lets every later read take
# whatever has arrived, up to this size: reading a 500-row page then costs about half the CPU,
# a 50-row page a fifth less (benchmarks/read_buffer.py). Not larger: with 1 MiB, a query of
# one small row cost the client 7-20% more CPU than with the default, with 256 KiB no more.
READ_BUFFER_BYTES = 256 * 1024
_GROW_READ_BUFFER = f"SELECT repeat(' ', {READ_BUFFER_BYTES - 64})".encode()


async def grow_read_buffer(conn: psycopg.AsyncConnection[Any]) -> None:
    """Receive one row of almost :data:`READ_BUFFER_BYTES` on ``conn``, so that its libpq input
    buffer holds that much from then on (a pool's ``configure`` callback)."""
    cur = await conn.execute(_GROW_READ_BUFFER)
    await cur.fetchall()


# SQLSTATEs that mean "the server or the connection went away", not "this statement failed":
# class 08 (connection exception) and the operator-intervention shutdowns.
_CONNECTION_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})


# A write refused because the session is read-only: the server is a standby (hot standby, after
# a failover the name still points at), or default_transaction_read_only is on for the
# database, the role or the server (a maintenance window). psycopg raises it as an
# InternalError (ReadOnlySqlTransaction), not as an OperationalError.
READ_ONLY_SQLSTATE = "25006"
READ_ONLY_HINT = "a standby, or default_transaction_read_only is on; SQLSTATE 25006"


def is_connection_loss(exc: BaseException, conn: psycopg.AsyncConnection[Any] | None) -> bool:
    """True when ``exc`` means the database or the queue's broker cannot be used rather than
    that the job failed: unreachable, or refusing writes (:func:`is_read_only`), which is an
    outage for writing."""
    if isinstance(exc, (PoolTimeout, QueueUnavailable)):
        return True
    if isinstance(exc, psycopg.OperationalError):
        state = exc.sqlstate
        return (
            state is None
            or state.startswith("08")
            or state in _CONNECTION_SQLSTATES
            or (conn is not None and conn.broken)
        )
    return is_read_only(exc, conn)


def is_read_only(exc: BaseException, conn: Any = None) -> bool:
    """True when ``exc`` is a write the database refused as read-only (SQLSTATE 25006) because
    of the server, not of the statement's own transaction: with ``conn`` (the connection it was
    raised on), only when that session reports itself read-only (:func:`session_read_only`;
    a handler's ``SET TRANSACTION READ ONLY`` on a writable session is its own failure).
    Without ``conn`` (jobfence's own statements, which never make a transaction read-only),
    always. Never for a refusal :func:`refused_after_first_write` marked."""
    if not isinstance(exc, psycopg.Error) or exc.sqlstate != READ_ONLY_SQLSTATE:
        return False
    if getattr(exc, _TRANSACTIONS_OWN, False):
        return False
    return conn is None or session_read_only(conn) is not False


_TRANSACTIONS_OWN = "_jobfence_transactions_own"


def refused_after_first_write(exc: BaseException) -> None:
    """Record that ``exc``, when it is a read-only refusal (SQLSTATE 25006), came after its
    transaction's first write (jobfence's fence insert) succeeded: :func:`is_read_only` is
    then False. A session's read-only state cannot change inside a transaction (a standby
    and ``default_transaction_read_only`` take effect when one begins), so the transaction
    made itself read-only (a handler's ``SET TRANSACTION READ ONLY``): the job's failure,
    not an outage, whatever the server reports, or does not report (before PostgreSQL 14)."""
    if isinstance(exc, psycopg.Error) and exc.sqlstate == READ_ONLY_SQLSTATE:
        setattr(exc, _TRANSACTIONS_OWN, True)


def session_read_only(conn: Any) -> bool | None:
    """Whether the server says ``conn``'s session is read-only, from what it reported, without
    a round trip: ``in_hot_standby`` (a standby) or ``default_transaction_read_only`` (set on
    the database, the role or the server) ``on``. None when the server reports neither
    (PostgreSQL before 14) or the connection cannot say."""
    try:
        pgconn = conn.pgconn
        standby = pgconn.parameter_status(b"in_hot_standby")
        default = pgconn.parameter_status(b"default_transaction_read_only")
    except Exception:
        return None
    if standby is None and default is None:
        return None
    return bool(standby == b"on" or default == b"on")


class DatabaseReadOnly(psycopg.errors.ReadOnlySqlTransaction):
    """A probe found the database refusing writes (``transaction_read_only`` on)."""


async def check_writable(conn: psycopg.AsyncConnection[Any]) -> None:
    """One round trip: raise :class:`DatabaseReadOnly` when ``conn``'s transactions are
    read-only (a standby, or default_transaction_read_only on), after closing ``conn``, so
    that its pool replaces it with a new connection, which resolves the host again."""
    cur = await conn.execute("SELECT current_setting('transaction_read_only')")
    row = await cur.fetchone()
    if row is not None and row[0] == "on":
        await conn.close()
        raise DatabaseReadOnly("the database refuses writes: transaction_read_only is on")


async def drop_read_only_connections(pool: Any) -> None:
    """After a read-only outage: replace the connections ``pool`` holds idle (psycopg_pool's
    ``drain()``, where it has one), since a session opened while the database was read-only
    stays so after it is writable again, and one to an old primary keeps talking to it."""
    drain = getattr(pool, "drain", None)
    if drain is not None:
        await drain()


def looks_broken(conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> bool:
    """Whether an idle connection is known to be unusable, found without a round trip: it is
    closed, or its socket reports the server's side gone (the end of the stream or an error
    when libpq reads what is waiting there). A connection whose peer vanished without a word
    (a cable cut) still looks usable here; its first statement fails instead."""
    if conn.closed or conn.broken:
        return True
    pgconn = conn.pgconn
    if pgconn.status != ConnStatus.OK:
        return True
    try:
        fd = pgconn.socket
        # Something arrived while idle: a notice, a parameter change, or the end of the stream,
        # which libpq turns into an error. A server that ended the session (a restart,
        # pg_terminate_backend) sends its FATAL message and then closes: the first read takes
        # the message, the next one finds the end of the stream, given a few milliseconds to
        # arrive (waited only when something did arrive while idle).
        for wait_ms in (0, 20, 20):
            if hasattr(select, "poll"):
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                waiting = bool(poller.poll(wait_ms))
            else:  # pragma: no cover - Windows
                waiting = bool(select.select([fd], [], [], wait_ms / 1000)[0])
            if not waiting:
                break
            pgconn.consume_input()
    except (OSError, ValueError, psycopg.Error):
        return True
    return pgconn.status != ConnStatus.OK


# The longest a pool opened by jobfence waits between two attempts to replace a connection it
# lost. psycopg_pool doubles the wait after each failed attempt (1, 2, 4, 8 s...) until its
# reconnect_timeout: a connection lost in an outage came back up to about as long again after
# the database did (3 s after a 4 s outage, a minute after a minute), and a job waiting for one
# waited that long, or failed on the pool's timeout and started a second outage. Capped, they
# come back within this many seconds; a down server is tried at most once per this many
# seconds per missing connection.
RECONNECT_MAX_DELAY_SECONDS = 2.0


def reconnect_attempt(timeout: float) -> Any:
    """A psycopg_pool reconnection attempt whose wait between tries is capped at
    :data:`RECONNECT_MAX_DELAY_SECONDS` (it still gives up after ``timeout``, the pool's
    ``reconnect_timeout``); None where psycopg_pool has no such object (its backoff then
    applies)."""
    if AttemptWithBackoff is None:  # pragma: no cover
        return None
    return _CappedAttempt(timeout=timeout)


if AttemptWithBackoff is not None:

    class _CappedAttempt(AttemptWithBackoff):
        def update_delay(self, now: float) -> None:
            super().update_delay(now)
            self.delay = min(self.delay, RECONNECT_MAX_DELAY_SECONDS)


class ReconnectingPool(AsyncConnectionPool[psycopg.AsyncConnection[Any]]):
    """An async pool that replaces a lost connection at least every
    :data:`RECONNECT_MAX_DELAY_SECONDS`, not with psycopg_pool's growing backoff: after an
    outage it is whole again within that long of the database's return."""

    async def _add_connection(
        self, attempt: AttemptWithBackoff | None, growing: bool = False
    ) -> None:
        await super()._add_connection(attempt or reconnect_attempt(self.reconnect_timeout), growing)

    async def putconn(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Take ``conn`` back, closing it first when its session is read-only
        (:func:`session_read_only`): the pool replaces it with a new connection, which resolves
        the host again (after a failover, not the old primary) and takes the database's
        settings as they are then (a session opened during a read-only window stays so)."""
        if not conn.closed and session_read_only(conn):
            log.debug("pool %s: closing a read-only connection", self.name)
            with contextlib.suppress(Exception):
                await conn.close()
        await super().putconn(conn)


class CheckedPool(ReconnectingPool):
    """A pool that lends only connections not known to be broken (:func:`looks_broken`, no
    round trip): a broken one is discarded and the next one taken at once, so after a network
    blip no request pays for a stale connection. (psycopg_pool's own ``check`` callback waits
    with a growing backoff after each failed check: with a pool of stale connections a request
    would wait out most of its timeout.)"""

    async def getconn(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - psycopg_pool's signature
    ) -> psycopg.AsyncConnection[Any]:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for _ in range(self.max_size):
            conn = await super().getconn(max(deadline - time.monotonic(), 0.0))
            if not looks_broken(conn):
                return conn
            log.info("pool %s: discarding a broken connection", self.name)
            await conn.close()
            try:
                # Returned as found broken when lent: the pool replaces it, logging at INFO.
                await self._putconn(conn, from_getconn=True)
            except (AttributeError, TypeError):  # pragma: no cover - psycopg_pool < 3.3
                await self.putconn(conn)  # the same, with a WARNING
        return await super().getconn(max(deadline - time.monotonic(), 0.0))


async def open_pool(
    url: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    name: str = "jobfence",
    large_reads: bool = False,
    lend_checked: bool = False,
) -> AsyncConnectionPool[Any]:
    """An open autocommit pool: the harness opens its own transactions explicitly.
    ``large_reads``: each connection reads large results in large pieces (see
    :func:`grow_read_buffer`; 256 KiB of memory per connection), for pools that list dead
    letters. ``lend_checked``: the pool lends only connections not known to be broken (see
    :class:`CheckedPool`), for the API: after a network blip no request fails on a stale
    connection. (A worker's pool lends as psycopg_pool does: a stale connection fails its
    statement at once, which starts the worker's outage recovery without waiting for the
    pool's timeout.) Either way the pool replaces a lost connection at least every
    :data:`RECONNECT_MAX_DELAY_SECONDS` (:class:`ReconnectingPool`)."""
    await check_connection(url)
    pool_class = CheckedPool if lend_checked else ReconnectingPool
    pool: AsyncConnectionPool[Any] = pool_class(
        url,
        min_size=min_size,
        max_size=max_size,
        kwargs={"autocommit": True, **connect_options()},
        configure=grow_read_buffer if large_reads else None,
        open=False,
        name=name,
        timeout=30.0,
    )
    await pool.open(wait=True, timeout=30.0)
    return pool
