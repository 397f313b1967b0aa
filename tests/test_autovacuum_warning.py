"""Workers and ``jobfence cleanup`` warn at start-up when autovacuum cannot clean the tables every
job leaves dead rows in (core.processed_jobs, jobfence_queue.messages), and carry on."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import PgQueue, PrometheusMetrics, Worker
from jobfence.schema import autovacuum_warning
from support import run_jobfence, scalar

TABLES = ("core.processed_jobs", "jobfence_queue.messages")


async def _server_autovacuum_on(conn: AsyncConnection[Any]) -> bool:
    on = await scalar(
        conn,
        "SELECT current_setting('autovacuum')::boolean"
        " AND current_setting('track_counts')::boolean",
    )
    return bool(on)


async def test_the_warning_says_whether_the_server_or_a_table_turned_autovacuum_off(
    conn: AsyncConnection[Any],
) -> None:
    # The server's setting is whatever this PostgreSQL has (CI's has autovacuum off, the
    # embedded one on): the warning must say which.
    server_on = await _server_autovacuum_on(conn)
    warning = await autovacuum_warning(conn)
    if server_on:
        assert warning is None
    else:
        assert warning is not None
        assert warning.startswith("autovacuum is off on this server: ")
        assert all(table in warning for table in TABLES)

    await conn.execute("ALTER TABLE jobfence_queue.messages SET (autovacuum_enabled = off)")
    warning = await autovacuum_warning(conn)
    assert warning is not None
    assert "jobfence_queue.messages" in warning and "VACUUM" in warning
    if server_on:
        assert warning.startswith("autovacuum is off for jobfence_queue.messages: ")
        assert "core.processed_jobs" not in warning

    await conn.execute("ALTER TABLE jobfence_queue.messages RESET (autovacuum_enabled)")
    assert (await autovacuum_warning(conn) is None) == server_on


async def test_a_worker_warns_at_start_when_autovacuum_is_off_and_processes_its_jobs(
    conn: AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    await conn.execute("ALTER TABLE core.processed_jobs SET (autovacuum_enabled = false)")
    app = pointsapp.build_app()
    for i in range(3):
        await app.enqueue(conn, "award_points", {"account_id": 1, "points": 1}, job_id=f"j{i}")
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    worker = Worker(app, pool, queue, metrics=PrometheusMetrics(), poll_seconds=0.05)
    with caplog.at_level(logging.WARNING, logger="jobfence"):
        stats = await asyncio.wait_for(worker.run(until="idle"), timeout=20)
    await queue.close()

    warnings = [
        r.getMessage() for r in caplog.records if r.name == "jobfence.worker" and "VACUUM" in r.msg
    ]
    assert len(warnings) == 1, caplog.text
    assert "autovacuum is off" in warnings[0] and "core.processed_jobs" in warnings[0]
    assert stats.outcomes == {"succeeded": 3}
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == 3


def test_jobfence_cleanup_warns_at_start_when_autovacuum_is_off(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as db:
        db.execute("ALTER TABLE core.processed_jobs SET (autovacuum_enabled = false)")
        db.execute(
            "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at)"
            " VALUES ('old', 'c', now() - interval '8 days', now() - interval '1 day')"
        )

    done = run_jobfence(database_url, "cleanup")

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "removed 1 expired fence rows in 1 batch(es)"
    (line,) = [line for line in done.stderr.splitlines() if "autovacuum is off" in line]
    assert "WARNING" in line and "core.processed_jobs" in line and "VACUUM" in line


async def test_the_check_does_not_fail_when_a_table_is_missing(
    conn: AsyncConnection[Any],
) -> None:
    # A worker may start while an operator has the queue table away (tests/test_outage.py
    # renames it under a starting worker): the check lists what is there, it does not raise.
    await conn.execute("ALTER TABLE jobfence_queue.messages RENAME TO messages_gone")
    await conn.execute("ALTER TABLE core.processed_jobs SET (autovacuum_enabled = false)")
    warning = await autovacuum_warning(conn)
    assert warning is not None and "core.processed_jobs" in warning
    assert "jobfence_queue" not in warning
