"""Versioned migrations shipped in the package, applied under an advisory lock."""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from psycopg import AsyncConnection, errors
from psycopg.sql import SQL

from jobfence._sql import Queries
from jobfence.errors import ConfigError
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
    so workers recognise the schema; run it in one transaction.
    """
    parts = [
        "-- jobfence schema, all migrations, in one transaction under jobfence's advisory lock.",
        "BEGIN;",
        f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY});",
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


async def migrate(conn: AsyncConnection[Any]) -> list[Migration]:
    """Apply pending migrations in one transaction, under an advisory lock; return them.

    Idempotent: a second run applies nothing. Two concurrent runs serialise on the lock; the
    second finds everything applied. A migration whose file changed after it was applied is
    refused (its checksum no longer matches).
    """
    applied: list[Migration] = []
    conn.add_notice_handler(_log_warning)
    try:
        await _apply(conn, applied)
    finally:
        conn.remove_notice_handler(_log_warning)
    return applied


def _log_warning(diag: errors.Diagnostic) -> None:
    """A WARNING a migration raises (a check left NOT VALID, say) is logged, not dropped."""
    if diag.severity_nonlocalized == "WARNING":
        log.warning("%s", diag.message_primary)


async def _apply(conn: AsyncConnection[Any], applied: list[Migration]) -> None:
    async with conn.transaction():
        # READ COMMITTED whatever the database's default: after waiting for the lock, what a
        # concurrent migrate committed is read (a snapshot taken before the wait would miss it,
        # and apply everything again).
        await conn.execute(SET_READ_COMMITTED)
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
        await conn.execute(BOOKKEEPING)
        done = await applied_versions(conn)
        for m in migrations():
            if m.version in done:
                if done[m.version] != m.checksum:
                    raise ConfigError(
                        f"migration {m.version:04d}_{m.name} was applied with different SQL "
                        "(checksum mismatch); the database and this jobfence version disagree"
                    )
                continue
            await conn.execute(SQL(m.sql))  # our own shipped file
            await conn.execute(
                "INSERT INTO jobfence.schema_migrations (version, name, checksum)"
                " VALUES (%s, %s, %s)",
                (m.version, m.name, m.checksum),
            )
            applied.append(m)


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
