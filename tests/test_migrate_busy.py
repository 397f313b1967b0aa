"""``jobfence migrate`` on a busy database: a migration that needs a hot table's lock waits
behind a long transaction at most its lock timeout (the statements queued behind it with it),
is rolled back and tried again, and in the end either applies or leaves nothing half-applied;
a DBA's timeouts on the role or the database do not cancel it half-way."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection, errors, sql

from jobfence.schema import BOOKKEEPING, MIGRATION_LOCK_KEY, migrations
from support import scalar, wait_until

ALL_VERSIONS = [m.version for m in migrations()]
# 0021_trace_context adds columns to jobfence_queue.messages (an ACCESS EXCLUSIVE lock);
# 0019 and 0020 touch no table a worker holds.
BEFORE_QUEUE_CHANGE = 18
QUEUE_CHANGE = 21
# What a worker may be held up by a migration waiting for the queue's lock, at most: the
# default lock timeout (2 s), with room for a slow machine.
WORKER_BOUND = 8.0
MIGRATE_APP = "migrate-under-test"


async def _migrated_to(url: str, version: int) -> None:
    """The database as a jobfence of migration ``version`` left it."""
    async with await AsyncConnection.connect(url, autocommit=True) as conn, conn.transaction():
        await conn.execute(BOOKKEEPING)
        for m in migrations():
            if m.version <= version:
                await conn.execute(sql.SQL(m.sql))  # type: ignore[arg-type]
                await conn.execute(
                    "INSERT INTO jobfence.schema_migrations (version, name, checksum)"
                    " VALUES (%s, %s, %s)",
                    (m.version, m.name, m.checksum),
                )


def _migrate(url: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "JOBFENCE_DATABASE_URL": url}
    env.pop("JOBFENCE_QUEUE_URL", None)
    env["PGAPPNAME"] = MIGRATE_APP  # to tell its session in pg_stat_activity
    return subprocess.Popen(
        [sys.executable, "-m", "jobfence.cli", "migrate", *args],
        env=env,
        cwd=Path(__file__).parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def _finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[str, str]:
    return await asyncio.to_thread(proc.communicate, timeout=timeout)


@asynccontextmanager
async def _long_transaction_on_the_queue(url: str) -> AsyncIterator[AsyncConnection[Any]]:
    """A worker's long handler transaction: it enqueued (ROW EXCLUSIVE on the queue table) and
    has not committed. Rolled back when the block ends, whatever happened."""
    holder = await AsyncConnection.connect(url, application_name="slow-handler")
    try:
        await holder.execute(
            "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body)"
            " VALUES ('q', 'c', 'held', '{}')"
        )
        yield holder
    finally:
        await holder.close()


async def _waiting_for_a_lock(conn: AsyncConnection[Any], application: str) -> bool:
    return bool(
        await scalar(
            conn,
            "SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND application_name = %s",
            (application,),
        )
    )


async def _worker_statement_seconds(url: str) -> float:
    """How long a worker's next statement on the queue table takes (an enqueue); cancelled
    after 20 s rather than hang (then the time it waited)."""
    async with await AsyncConnection.connect(url, autocommit=True) as worker:
        await worker.execute("SET statement_timeout = '20s'")
        started = time.monotonic()
        with contextlib.suppress(errors.QueryCanceled):
            await worker.execute(
                "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body)"
                " VALUES ('q', 'c', 'next', '{}')"
            )
        return time.monotonic() - started


async def _versions(conn: AsyncConnection[Any]) -> list[int]:
    cur = await conn.execute("SELECT version FROM jobfence.schema_migrations ORDER BY version")
    return [int(row[0]) for row in await cur.fetchall()]


async def _has_column(conn: AsyncConnection[Any], table: str, column: str) -> bool:
    return bool(
        await scalar(
            conn,
            "SELECT count(*) > 0 FROM information_schema.columns"
            " WHERE table_schema || '.' || table_name = %s AND column_name = %s",
            (table, column),
        )
    )


async def test_migrate_behind_a_long_transaction_holds_up_workers_at_most_its_lock_timeout(
    empty_database_url: str,
) -> None:
    """A handler transaction stays open on the queue table while ``jobfence migrate`` must
    alter it: the workers' next statements get through within the lock timeout (not after
    the handler commits), migrate logs what it waits for, and applies everything once the
    handler has committed."""
    url = empty_database_url
    await _migrated_to(url, BEFORE_QUEUE_CHANGE)
    async with await AsyncConnection.connect(url, autocommit=True) as watch:
        proc = None
        try:
            async with _long_transaction_on_the_queue(url) as holder:
                proc = _migrate(url)
                await wait_until(
                    lambda: _waiting_for_a_lock(watch, MIGRATE_APP),
                    timeout=30,
                    message="migrate to wait for the queue table's lock",
                )
                seconds = await _worker_statement_seconds(url)
                assert seconds < WORKER_BOUND, (
                    f"a worker's enqueue waited {seconds:.1f} s behind jobfence migrate"
                )
                # Its next try (so it has logged what held it up), then the handler commits.
                await wait_until(
                    lambda: _waiting_for_a_lock(watch, MIGRATE_APP),
                    timeout=30,
                    message="migrate to try again",
                )
                await holder.commit()
            out, err = await _finish(proc)
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, err
        assert "applied 0021_trace_context" in out
        warning = next(line for line in err.splitlines() if "waited" in line)
        assert "migration 0021_trace_context waited 2 s for a table lock" in warning
        assert "slow-handler" in warning and "jobfence_queue.messages" in warning
        assert await _versions(watch) == ALL_VERSIONS


async def test_migrate_that_never_gets_its_lock_exits_1_with_one_line_and_applies_it_not_at_all(
    empty_database_url: str,
) -> None:
    """The long transaction outlasts every try: migrate ends with exit status 1 and one line
    naming the migration and what held the table; the migrations before it are applied and
    recorded, the one that needed the lock neither, and a later run applies the rest. A DBA's
    idle_session_timeout shorter than the pause between tries does not end its session."""
    url = empty_database_url
    await _migrated_to(url, BEFORE_QUEUE_CHANGE)
    async with await AsyncConnection.connect(url, autocommit=True) as watch:
        await _set_on_database(watch, "idle_session_timeout", "500ms")
        async with _long_transaction_on_the_queue(url):
            proc = _migrate(url, "--lock-timeout", "0.2", "--lock-attempts", "2")
            try:
                out, err = await _finish(proc, timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        assert proc.returncode == 1, (out, err)
        assert out.splitlines() == ["applied 0019_producer_functions", "applied 0020_alert_bounds"]
        last = err.strip().splitlines()[-1]
        assert last.startswith(
            "jobfence: error: migration 0021_trace_context could not get a table lock within"
            " 0.2 s in 2 tries, and was not applied: pid "
        ), err
        assert "(slow-handler, idle in transaction" in last and "jobfence_queue.messages" in last
        assert await _versions(watch) == [v for v in ALL_VERSIONS if v < QUEUE_CHANGE]
        assert not await _has_column(watch, "jobfence_queue.messages", "traceparent")
        assert not await _has_column(watch, "jobfence.outbox", "traceparent")

        again = _migrate(url)
        out, err = await _finish(again)
        assert again.returncode == 0, err
        assert out.splitlines()[0] == "applied 0021_trace_context"
        assert await _versions(watch) == ALL_VERSIONS


async def test_migrate_killed_while_waiting_for_a_lock_stalls_no_worker_and_can_be_run_again(
    empty_database_url: str,
) -> None:
    """SIGKILL of a migrate that waits for the queue's lock: its server session's queued lock
    request does not stay in front of the workers' statements until the long transaction ends;
    nothing of the migration is applied, and migrate run again applies it once."""
    url = empty_database_url
    await _migrated_to(url, BEFORE_QUEUE_CHANGE)
    async with await AsyncConnection.connect(url, autocommit=True) as watch:
        async with _long_transaction_on_the_queue(url) as holder:
            proc = _migrate(url)
            try:
                await wait_until(
                    lambda: _waiting_for_a_lock(watch, MIGRATE_APP),
                    timeout=30,
                    message="migrate to wait for the queue table's lock",
                )
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.communicate()
            seconds = await _worker_statement_seconds(url)
            assert seconds < WORKER_BOUND, (
                f"a worker's enqueue waited {seconds:.1f} s behind a killed jobfence migrate"
            )
            await holder.commit()
        assert await _versions(watch) == [v for v in ALL_VERSIONS if v < QUEUE_CHANGE]
        assert not await _has_column(watch, "jobfence_queue.messages", "traceparent")
        again = _migrate(url)
        out, err = await _finish(again)
        assert again.returncode == 0, err
        assert out.splitlines()[0] == "applied 0021_trace_context"
        assert await _versions(watch) == ALL_VERSIONS


async def _set_on_database(conn: AsyncConnection[Any], setting: str, value: str) -> None:
    dbname = await scalar(conn, "SELECT current_database()")
    await conn.execute(
        sql.SQL("ALTER DATABASE {} SET {} = {}").format(
            sql.Identifier(dbname), sql.Identifier(setting), sql.Literal(value)
        )
    )


async def test_a_dba_statement_timeout_does_not_cancel_a_long_migration_half_way(
    empty_database_url: str,
) -> None:
    """The database's ``statement_timeout`` (meant for the application's queries) is shorter
    than an upgrade's index builds and backfill over many dead letters: migrate still applies
    every migration, and leaves the setting in force for the other sessions."""
    url = empty_database_url
    await _migrated_to(url, 5)
    async with await AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts,"
            " last_error, error_class)"
            " SELECT 'job-' || i, 'q' || (i % 20), 'c', '{}', 1, 'boom', 'E' || (i % 7)"
            " FROM generate_series(1, 100000) AS i"
        )
        await _set_on_database(conn, "statement_timeout", "100ms")
    proc = _migrate(url)
    out, err = await _finish(proc)
    assert proc.returncode == 0, err
    assert out.splitlines()[-1] == f"applied {ALL_VERSIONS[-1]:04d}_{migrations()[-1].name}"
    async with await AsyncConnection.connect(url, autocommit=True) as conn:
        assert await _versions(conn) == ALL_VERSIONS
        assert await scalar(conn, "SELECT count(*) FROM jobfence.dead_letter_renderings") == 100000
        assert await scalar(conn, "SHOW statement_timeout") == "100ms"


async def test_a_dba_lock_timeout_does_not_fail_a_migrate_waiting_for_another_migrate(
    empty_database_url: str,
) -> None:
    """The database's ``lock_timeout`` is short; another deploy's migrate holds the migration
    lock for longer: this migrate waits for it (no statement queues behind that wait) and then
    finds everything applied, instead of failing with a lock timeout."""
    url = empty_database_url
    async with await AsyncConnection.connect(url, autocommit=True) as conn:
        await _set_on_database(conn, "lock_timeout", "100ms")
    other = await AsyncConnection.connect(url)
    proc = None
    try:
        await other.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        proc = _migrate(url)
        async with await AsyncConnection.connect(url, autocommit=True) as watch:
            await wait_until(
                lambda: _waiting_for_a_lock(watch, MIGRATE_APP),
                timeout=30,
                message="migrate to wait for the migration lock",
            )
            # Longer than the database's lock_timeout, measured by the server's own clock.
            started = await scalar(watch, "SELECT clock_timestamp()")
            await wait_until(
                lambda: _elapsed_over(watch, started, 0.5),
                timeout=10,
                message="half a second to pass",
            )
            assert proc.poll() is None, proc.communicate()
        await other.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
        out, err = await _finish(proc)
    finally:
        await other.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.splitlines()[0] == "applied 0001_core"


async def _elapsed_over(conn: AsyncConnection[Any], since: Any, seconds: float) -> bool:
    return bool(
        await scalar(
            conn,
            "SELECT clock_timestamp() - %s > make_interval(secs => %s)",
            (since, seconds),
        )
    )


def test_migrate_refuses_a_lock_timeout_out_of_range() -> None:
    for value in ("-1", "nan", "inf", "3601"):
        done = subprocess.run(
            [sys.executable, "-m", "jobfence.cli", "migrate", "--lock-timeout", value],
            env={**os.environ, "JOBFENCE_DATABASE_URL": "postgresql://127.0.0.1:1/unused"},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2
        assert (
            "argument --lock-timeout: must be 0 (no limit) or a number of seconds up to 3600,"
            f" got {value!r}"
        ) in done.stderr


def test_printed_sql_bounds_its_lock_waits_and_reads_at_read_committed() -> None:
    script = subprocess.run(
        [sys.executable, "-m", "jobfence.cli", "migrate", "--print-sql"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    head = script.split("CREATE SCHEMA", 1)[0].splitlines()
    assert head[1:] == [
        "BEGIN;",
        "SET TRANSACTION ISOLATION LEVEL READ COMMITTED;",
        f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY});",
        "SET LOCAL lock_timeout = '2s';",
        "SET LOCAL statement_timeout = 0;",
    ]


async def test_migrate_on_a_connection_without_autocommit_commits_each_migration_and_unlocks(
    empty_database_url: str,
) -> None:
    """A library caller's connection in its default mode (no autocommit): each migration still
    commits on its own, and the advisory lock and the session's settings are given back, as on
    an autocommit connection; the connection is left as it was given."""
    from jobfence.schema import migrate

    await _migrated_to(empty_database_url, BEFORE_QUEUE_CHANGE)
    async with await AsyncConnection.connect(empty_database_url) as conn:
        applied = await migrate(conn)
        assert [m.version for m in applied] == ALL_VERSIONS[BEFORE_QUEUE_CHANGE:]
        assert conn.autocommit is False
        await conn.rollback()
    async with await AsyncConnection.connect(empty_database_url, autocommit=True) as check:
        assert await _versions(check) == ALL_VERSIONS
        held = await scalar(
            check,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s::bigint",
            (MIGRATION_LOCK_KEY & 0xFFFFFFFF,),
        )
        assert held == 0
