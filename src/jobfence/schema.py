"""Versioned migrations shipped in the package, applied under an advisory lock."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from psycopg import AsyncConnection, errors
from psycopg.pq import TransactionStatus
from psycopg.sql import SQL

from jobfence._sql import Queries
from jobfence.errors import ConfigError, JobfenceError
from jobfence.pgtx import SET_READ_COMMITTED

log = logging.getLogger("jobfence.schema")

CORE_SQL = Queries("jobfence.sql", "core.sql")

# Any constant works; it only has to be the same for every jobfence deploy.
MIGRATION_LOCK_KEY = 0x6A6F6266656E6365  # "jobfence"
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

BOOKKEEPING = """\
CREATE SCHEMA IF NOT EXISTS jobfence;
CREATE TABLE IF NOT EXISTS jobfence.schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);"""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()


def migrations() -> list[Migration]:
    """Every migration shipped with this version of jobfence, in order."""
    found = []
    for entry in resources.files("jobfence.migrations").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(
                Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8"))
            )
    found.sort(key=lambda m: m.version)
    return found


def latest_version() -> int:
    return migrations()[-1].version


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def render_sql() -> str:
    """All migrations as one SQL script, for teams that apply SQL with their own tool.

    It records each version in ``jobfence.schema_migrations`` like ``jobfence migrate`` does,
    so workers recognise the schema; run it in one transaction. Like ``jobfence migrate``, it
    reads at READ COMMITTED, waits at most the default lock timeout for a table's lock (after
    the advisory lock, which it waits for as long as it takes), and lifts the session's
    statement timeout; a lock timeout fails it whole, to be run again.
    """
    parts = [
        "-- jobfence schema, all migrations, in one transaction under jobfence's advisory lock.",
        "BEGIN;",
        "SET TRANSACTION ISOLATION LEVEL READ COMMITTED;",
        f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY});",
        f"SET LOCAL lock_timeout = '{DEFAULT_LOCK_TIMEOUT:g}s';",
        "SET LOCAL statement_timeout = 0;",
        BOOKKEEPING,
    ]
    for m in migrations():
        parts.append(f"\n-- migration {m.version:04d}_{m.name}\n{m.sql.strip()}")
        parts.append(
            "INSERT INTO jobfence.schema_migrations (version, name, checksum) VALUES "
            f"({m.version}, {_literal(m.name)}, {_literal(m.checksum)});"
        )
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"


async def applied_versions(conn: AsyncConnection[Any]) -> dict[int, str]:
    cur = await conn.execute("SELECT to_regclass('jobfence.schema_migrations') IS NOT NULL")
    row = await cur.fetchone()
    if not row or not row[0]:
        return {}
    cur = await conn.execute("SELECT version, checksum FROM jobfence.schema_migrations")
    return {int(version): str(checksum) for version, checksum in await cur.fetchall()}


# How long one statement of a migration may wait for a table's lock, how many times a
# migration is tried, and the first pause between tries (doubled each time, at most
# _MAX_PAUSE). While a migration waits for a lock, every new statement on that table queues
# behind it: a bounded wait keeps a long transaction from stalling the queue behind it.
DEFAULT_LOCK_TIMEOUT = 2.0
DEFAULT_LOCK_ATTEMPTS = 10
_FIRST_PAUSE = 1.0
_MAX_PAUSE = 30.0

# Sessions of other backends that have held a lock on a table of jobfence's schemas for longer
# than the lock timeout: what a migration that timed out was (most likely) waiting behind. A
# role without pg_read_all_stats sees other roles' sessions without their state and times.
_HOLDERS = """
SELECT a.pid, string_agg(DISTINCT l.relation::regclass::text, ', ') AS tables,
       coalesce(nullif(a.application_name, ''), 'no application_name') AS application,
       coalesce(a.state, 'state hidden') AS state,
       extract(epoch FROM now() - a.xact_start)::bigint AS seconds
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
JOIN pg_class c ON c.oid = l.relation
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE l.granted AND l.locktype = 'relation' AND a.pid <> pg_backend_pid()
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND n.nspname IN ('core', 'jobfence', 'jobfence_queue')
  AND c.relkind IN ('r', 'p')
  AND (a.xact_start IS NULL OR a.xact_start < now() - make_interval(secs => %s))
GROUP BY a.pid, a.application_name, a.state, a.xact_start
ORDER BY a.xact_start NULLS LAST
LIMIT 5"""


class MigrationLockTimeout(JobfenceError):
    """A migration could not get a table's lock within its lock timeout, try after try:
    nothing of it was applied (the migrations before it were)."""


async def migrate(
    conn: AsyncConnection[Any],
    *,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    lock_attempts: int = DEFAULT_LOCK_ATTEMPTS,
    first_pause: float = _FIRST_PAUSE,
    on_applied: Callable[[Migration], None] | None = None,
) -> list[Migration]:
    """Apply pending migrations under an advisory lock; return them.

    Each migration is its own transaction, recorded in ``jobfence.schema_migrations`` by that
    transaction; on a database without jobfence's schema, all of them are one transaction (a
    first setup is all or nothing). A statement waits at most ``lock_timeout`` seconds for a
    table's lock (0: as long as it takes); then that migration is rolled back, a WARNING names
    what held the table, and it is tried again after a pause (1 s, doubled each time, at most
    30 s), ``lock_attempts`` times in all before :class:`MigrationLockTimeout`. The session's
    ``statement_timeout``, ``transaction_timeout`` and ``idle_session_timeout`` are lifted
    meanwhile (and restored after): a long statement (an index build) is not killed half-way.

    Idempotent: a second run applies nothing. Two concurrent runs serialise on the lock; the
    second finds everything applied. A migration whose file changed after it was applied is
    refused (its checksum no longer matches). ``on_applied`` is called with each migration
    once its transaction has committed (so what it was told stays true if a later one fails).
    """
    if not (lock_timeout >= 0 and math.isfinite(lock_timeout)):
        raise ConfigError(f"lock_timeout must be a number of seconds from 0, got {lock_timeout!r}")
    if lock_attempts < 1:
        raise ConfigError(f"lock_attempts must be at least 1, got {lock_attempts!r}")
    applied: list[Migration] = []
    # Each migration commits on its own, and the advisory lock is the session's: on a
    # connection without autocommit every statement would run inside one implicit
    # transaction, the caller's to commit or roll back. Autocommit for the while.
    given_autocommit = conn.autocommit
    if not given_autocommit:
        if conn.info.transaction_status != TransactionStatus.IDLE:
            raise ConfigError(
                "migrate() needs a connection outside a transaction: each migration commits"
                " on its own"
            )
        await conn.set_autocommit(True)
    conn.add_notice_handler(_log_warning)
    try:
        await _apply(
            conn,
            applied,
            lock_timeout=lock_timeout,
            lock_attempts=lock_attempts,
            first_pause=first_pause,
            on_applied=on_applied,
        )
    finally:
        conn.remove_notice_handler(_log_warning)
        if not given_autocommit and not conn.closed:
            await conn.set_autocommit(False)
    return applied


def _log_warning(diag: errors.Diagnostic) -> None:
    """A WARNING a migration raises (a check left NOT VALID, say) is logged, not dropped."""
    if diag.severity_nonlocalized == "WARNING":
        log.warning("%s", diag.message_primary)


# The settings of a DBA (on the role or the database) that would cancel a migration half-way,
# bound its wait for the advisory lock, or end its session during a pause between tries:
# lifted for migrate's session and restored after it (those a server lacks are skipped).
_SESSION_SETTINGS = (
    "statement_timeout",
    "lock_timeout",
    "transaction_timeout",
    "idle_session_timeout",
)


async def _apply(
    conn: AsyncConnection[Any],
    applied: list[Migration],
    *,
    lock_timeout: float,
    lock_attempts: int,
    first_pause: float,
    on_applied: Callable[[Migration], None] | None,
) -> None:
    cur = await conn.execute(
        "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", (list(_SESSION_SETTINGS),)
    )
    lifted = [(str(name), str(setting)) for name, setting in await cur.fetchall()]
    for name, _ in lifted:
        await conn.execute("SELECT set_config(%s, '0', false)", (name,))
    # A session lock: held across the migrations' transactions, so that a concurrent migrate
    # waits for all of them (and then finds them applied), and released when the session ends
    # (a migrate killed half-way holds nothing). Waiting for it stalls no other statement.
    await conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
    try:
        done = await applied_versions(conn)
        for m in migrations():
            if m.version in done and done[m.version] != m.checksum:
                raise ConfigError(
                    f"migration {m.version:04d}_{m.name} was applied with different SQL "
                    "(checksum mismatch); the database and this jobfence version disagree"
                )
        pending = [m for m in migrations() if m.version not in done]
        # A first setup creates its tables: nothing can hold them, and it is all or nothing.
        batches = [pending] if not done and pending else [[m] for m in pending]
        for batch in batches:
            await _apply_batch(conn, batch, lock_timeout, lock_attempts, first_pause)
            applied.extend(batch)
            for m in batch:
                if on_applied is not None:
                    on_applied(m)
    finally:
        # Unless the connection was lost (the server then released the lock itself).
        if conn.info.transaction_status == TransactionStatus.IDLE:
            await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
            for name, setting in lifted:
                await conn.execute("SELECT set_config(%s, %s, false)", (name, setting))


async def _apply_batch(
    conn: AsyncConnection[Any],
    batch: list[Migration],
    lock_timeout: float,
    lock_attempts: int,
    first_pause: float,
) -> None:
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in batch)
    if len(batch) > 1:
        names = f"{len(batch)} migrations ({batch[0].version:04d}_{batch[0].name} to "
        names += f"{batch[-1].version:04d}_{batch[-1].name})"
    pause = first_pause
    for attempt in range(1, lock_attempts + 1):
        try:
            async with conn.transaction():
                # READ COMMITTED whatever the database's default: each statement reads what
                # was committed before it (a migration that copies existing rows copies all).
                await conn.execute(SET_READ_COMMITTED)
                await conn.execute(
                    "SELECT set_config('lock_timeout', %s, true)",
                    # 0 is no limit; any other value is at least a millisecond.
                    (f"{max(round(lock_timeout * 1000), 1 if lock_timeout else 0)}ms",),
                )
                await conn.execute(BOOKKEEPING)
                for m in batch:
                    await conn.execute(SQL(m.sql))  # our own shipped file
                    await conn.execute(
                        "INSERT INTO jobfence.schema_migrations (version, name, checksum)"
                        " VALUES (%s, %s, %s)",
                        (m.version, m.name, m.checksum),
                    )
            return
        except errors.LockNotAvailable:
            holders = await _holders(conn, lock_timeout)
            if attempt == lock_attempts:
                raise MigrationLockTimeout(
                    f"migration {names} could not get a table lock within {lock_timeout:g} s"
                    f" in {lock_attempts} tries, and was not applied: {holders}; end that"
                    " transaction, or run jobfence migrate again at a quieter time"
                ) from None
            log.warning(
                "migration %s waited %g s for a table lock and was rolled back (try %d of %d),"
                " so as not to stall the statements queued behind it: %s; trying again in %g s"
                " (end that transaction to let it through)",
                names,
                lock_timeout,
                attempt,
                lock_attempts,
                holders,
                pause,
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE)


async def _holders(conn: AsyncConnection[Any], lock_timeout: float) -> str:
    """The long transactions holding jobfence's tables, as one phrase for a log line."""
    cur = await conn.execute(_HOLDERS, (lock_timeout,))
    rows = await cur.fetchall()
    if not rows:
        return "no transaction holds a jobfence table now (the lock was in demand)"
    return "; ".join(
        f"pid {pid} ({application}, {state}, "
        + ("transaction open" if seconds is None else f"transaction open {seconds} s")
        + f") holds {tables}"
        for pid, tables, application, state, seconds in rows
    )


async def ensure_migrated(conn: AsyncConnection[Any]) -> None:
    """Refuse to run on a database that lacks this version's schema."""
    done = await applied_versions(conn)
    changed = [m for m in migrations() if m.version in done and done[m.version] != m.checksum]
    if changed:
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in changed)
        raise ConfigError(
            f"the database's migration {names} differs from this jobfence version's "
            "(checksum mismatch): the schema and the code disagree"
        )
    missing = [m for m in migrations() if m.version not in done]
    if missing:
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in missing)
        raise ConfigError(f"the database is not migrated (missing {names}): run `jobfence migrate`")


async def autovacuum_warning(conn: AsyncConnection[Any]) -> str | None:
    """Why autovacuum cannot clean the tables every job leaves dead rows in, or None.

    Workers and ``jobfence cleanup`` log it at start-up: nothing fails without autovacuum, but
    the dead rows pile up (one or more per job) and every fetch and fence insert walks past
    them, slower by the hour, until someone runs VACUUM."""
    cur = await conn.execute(CORE_SQL["tables_without_autovacuum"])
    rows = await cur.fetchall()
    if not rows:
        return None
    tables = ", ".join(str(row[0]) for row in rows)
    why = (
        "autovacuum is off on this server" if not rows[0][1] else f"autovacuum is off for {tables}"
    )
    return (
        f"{why}: the dead rows every job leaves in {tables} are reclaimed only by VACUUM, and "
        "the queue's fetches and the fence's inserts slow down as they pile up; turn "
        f"autovacuum on, or run VACUUM on {tables} on a schedule"
    )
