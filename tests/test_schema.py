"""Migrations: idempotent, safe to run from several deploys at once, and the printed SQL is
equivalent to ``jobfence migrate`` for teams that apply SQL with their own tool."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pointsapp
from jobfence import ConfigError, PgQueue, Worker, open_pool
from jobfence.schema import ensure_migrated, migrate, migrations
from support import scalar, with_dbname

ALL_VERSIONS = [m.version for m in migrations()]
ALL_NAMES = [f"{m.version:04d}_{m.name}" for m in migrations()]
SCHEMAS = ("core", "jobfence", "jobfence_queue")

# What a schema consists of, as comparable text: tables and columns, indexes, constraints,
# triggers and functions of jobfence's schemas.
CATALOG_QUERIES = {
    "columns": """
        SELECT table_schema, table_name, column_name, data_type, is_nullable,
               coalesce(column_default, ''), is_identity, coalesce(identity_generation, '')
        FROM information_schema.columns
        WHERE table_schema = ANY(%(schemas)s)
        ORDER BY 1, 2, 3""",
    "indexes": """
        SELECT schemaname, tablename, indexname, indexdef
        FROM pg_indexes WHERE schemaname = ANY(%(schemas)s) ORDER BY 1, 2, 3""",
    "constraints": """
        SELECT n.nspname, c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid)
        FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
        WHERE n.nspname = ANY(%(schemas)s) ORDER BY 1, 2, 3""",
    "triggers": """
        SELECT t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid)
        FROM pg_trigger t JOIN pg_class r ON r.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = r.relnamespace
        WHERE n.nspname = ANY(%(schemas)s) AND NOT t.tgisinternal ORDER BY 1, 2""",
    # Ordered by the definition too: overloads (jobfence.enqueue) share a name.
    "functions": """
        SELECT n.nspname, p.proname, pg_get_functiondef(p.oid)
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = ANY(%(schemas)s) ORDER BY 1, 2, 3""",
    "migrations": "SELECT version, name, checksum FROM jobfence.schema_migrations ORDER BY 1",
}


def _catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(url, autocommit=True) as db:
        return {
            name: db.execute(query, {"schemas": list(SCHEMAS)}).fetchall()  # type: ignore[arg-type]
            for name, query in CATALOG_QUERIES.items()
        }


def _psql() -> str:
    """The psql that ships with pgserver (the ``embedded`` extra), or the machine's."""
    try:
        import pgserver
    except ImportError:
        bundled = None
    else:
        bundled = Path(pgserver.__file__).parent / "pginstall" / "bin" / "psql"
    found = str(bundled) if bundled is not None and bundled.exists() else shutil.which("psql")
    if found is None:  # pragma: no cover - pgserver always ships one
        pytest.fail("no psql found (neither pgserver's nor on PATH)")
    return found


@pytest.fixture
def second_empty_database_url(server_url: str) -> Iterator[str]:
    name = f"jobfence_schema_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
    yield with_dbname(server_url, name)
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # type: ignore[arg-type]


def _cli(*args: str, url: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JOBFENCE_DATABASE_URL": url}
    tests_dir = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", *args],
        env=env,
        cwd=cwd or tests_dir,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_migrations_applied_twice_apply_nothing_the_second_time(
    empty_database_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(empty_database_url, autocommit=True) as conn:
        first = await migrate(conn)
        second = await migrate(conn)
        recorded = await (
            await conn.execute("SELECT version FROM jobfence.schema_migrations ORDER BY version")
        ).fetchall()
    assert [m.version for m in first] == ALL_VERSIONS
    assert second == []
    assert [r[0] for r in recorded] == ALL_VERSIONS


async def test_migrations_applied_concurrently_from_several_connections(
    empty_database_url: str,
) -> None:
    deploys = 4
    conns = [
        await psycopg.AsyncConnection.connect(empty_database_url, autocommit=True)
        for _ in range(deploys)
    ]
    try:
        results = await asyncio.gather(*(migrate(c) for c in conns))
    finally:
        for c in conns:
            await c.close()

    # Exactly one deploy applied everything; the others waited on the lock and found it done.
    applied = sorted(([m.version for m in r] for r in results), key=len)
    assert applied == [[]] * (deploys - 1) + [ALL_VERSIONS]
    async with await psycopg.AsyncConnection.connect(empty_database_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT version, count(*) FROM jobfence.schema_migrations GROUP BY version ORDER BY 1"
        )
        assert await cur.fetchall() == [(v, 1) for v in ALL_VERSIONS]
        await ensure_migrated(conn)  # a worker would start


def test_printed_sql_applied_with_psql_gives_the_same_schema_as_jobfence_migrate(
    empty_database_url: str, second_empty_database_url: str
) -> None:
    printed = _cli("migrate", "--print-sql", url="not used: printing needs no database")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith("-- jobfence schema")

    applied = subprocess.run(
        [_psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "--single-transaction", "-f", "-",
         "-d", empty_database_url],
        input=printed.stdout,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert applied.returncode == 0, applied.stderr

    migrated = _cli("migrate", url=second_empty_database_url)
    assert migrated.returncode == 0, migrated.stderr

    by_psql = _catalog(empty_database_url)
    by_migrate = _catalog(second_empty_database_url)
    for part in CATALOG_QUERIES:
        assert by_psql[part] == by_migrate[part], part
    assert len(by_psql["triggers"]) == 4 and len(by_psql["functions"]) == 17

    # jobfence recognises the hand-applied schema: nothing to apply, and workers may start.
    again = _cli("migrate", url=empty_database_url)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("already up to date")


async def test_ensure_migrated_refuses_an_unmigrated_database_with_a_clear_message(
    empty_database_url: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(empty_database_url, autocommit=True) as conn:
        with pytest.raises(ConfigError) as refused:
            await ensure_migrated(conn)
        assert str(refused.value) == (
            f"the database is not migrated (missing {', '.join(ALL_NAMES)}): run `jobfence migrate`"
        )
        # Nothing was created by checking.
        assert await scalar(conn, "SELECT to_regnamespace('jobfence') IS NULL")


async def test_ensure_migrated_names_the_one_missing_migration(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await ensure_migrated(conn)
        last = migrations()[-1]
        await conn.execute(
            "DELETE FROM jobfence.schema_migrations WHERE version = %s", (last.version,)
        )
        with pytest.raises(ConfigError, match=f"missing {last.version:04d}_{last.name}\\)"):
            await ensure_migrated(conn)


async def test_a_worker_on_an_unmigrated_database_refuses_to_start(
    empty_database_url: str,
) -> None:
    pool = await open_pool(empty_database_url, min_size=1, max_size=2)
    queue = PgQueue(pool)
    try:
        with pytest.raises(ConfigError, match=r"not migrated .*run `jobfence migrate`"):
            # Promptly: not a loop of failing fetches that never returns.
            await asyncio.wait_for(Worker(pointsapp.build_app(), pool, queue).run(until="idle"), 10)
    finally:
        await queue.close()
        await pool.close()


def test_jobfence_worker_on_an_unmigrated_database_prints_one_clear_line(
    empty_database_url: str,
) -> None:
    done = _cli("worker", "pointsapp:app", "--until", "idle", url=empty_database_url)

    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"jobfence: error: the database is not migrated (missing {', '.join(ALL_NAMES)}): "
        "run `jobfence migrate`"
    ]
    with psycopg.connect(empty_database_url, autocommit=True) as db:
        # The refusal created nothing: the database is as empty as it was.
        assert db.execute("SELECT to_regnamespace('jobfence') IS NULL").fetchone() == (True,)
