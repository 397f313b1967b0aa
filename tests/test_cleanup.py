"""Acceptance 6 and D3: TTL cleanup removes expired fence rows, never one still inside its TTL.

Expiry is measured by the database clock (``expires_at < now()``), in bounded batches that each
commit on their own.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import App, Consumer, PgQueue, PrometheusMetrics, Worker, cleanup_expired
from support import run_jobfence, scalar

# Fence rows straddling the boundary, relative to the database clock at insert time.
EXPIRED_1MS_AGO = "now() - interval '1 millisecond'"
EXPIRES_IN_1S = "now() + interval '1 second'"


async def _insert_fences(
    conn: psycopg.AsyncConnection[Any], prefix: str, count: int, expires_at_sql: str
) -> None:
    await conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at)"
        f" SELECT %s || g, 'cleanup_test', now() - interval '8 days', {expires_at_sql}"
        " FROM generate_series(1, %s) AS g",
        (prefix, count),
    )


async def _job_ids(conn: psycopg.AsyncConnection[Any]) -> set[str]:
    cur = await conn.execute("SELECT job_id FROM core.processed_jobs")
    return {row[0] for row in await cur.fetchall()}


async def test_acceptance_6_ttl_cleanup_removes_expired_rows_and_never_one_inside_its_retry_window(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    # A fence written by a real job whose consumer has the shortest TTL D3 allows.
    await conn.execute(pointsapp.SCHEMA_SQL)
    minimum = Consumer(
        "award_points", pointsapp.QUEUE, pointsapp.Award, pointsapp.apply_award
    ).minimum_fence_ttl
    app = App()
    app.consumer("award_points", queue=pointsapp.QUEUE, schema=pointsapp.Award, fence_ttl=minimum)(
        pointsapp.apply_award
    )
    consumer = app.consumers["award_points"]
    await app.enqueue(conn, "award_points", {"account_id": 1, "points": 5}, job_id="real-job")
    queue = PgQueue(pool)
    try:
        stats = await Worker(app, pool, queue, metrics=PrometheusMetrics()).run(until="idle")
    finally:
        await queue.close()
    assert dict(stats.outcomes) == {"succeeded": 1}

    window = consumer.retry.retry_window_seconds
    assert minimum == timedelta(seconds=2 * window + 3600)
    lifetime = await scalar(
        conn, "SELECT expires_at - processed_at FROM core.processed_jobs WHERE job_id = 'real-job'"
    )
    assert lifetime == minimum
    assert lifetime >= timedelta(seconds=2 * window) + timedelta(hours=1)

    # The boundary, by the database clock: 1 ms past expiry goes, 1 s before expiry stays.
    await _insert_fences(conn, "expired-", 3, EXPIRED_1MS_AGO)
    await _insert_fences(conn, "live-", 3, EXPIRES_IN_1S)

    result = await cleanup_expired(conn)

    assert (result.deleted, result.batches) == (3, 1)
    assert await _job_ids(conn) == {"real-job", "live-1", "live-2", "live-3"}
    # The kept rows were still inside their TTL when cleanup ran (it ran before this check).
    assert await scalar(
        conn, "SELECT min(expires_at) > now() FROM core.processed_jobs WHERE job_id LIKE 'live-%'"
    ), "inconclusive: the machine took over a second between the insert and this check"


async def test_cleanup_works_in_bounded_batches_with_exact_counts(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await _insert_fences(conn, "expired-", 2500, EXPIRED_1MS_AGO)
    await _insert_fences(conn, "live-", 10, "now() + interval '1 hour'")

    result = await cleanup_expired(conn, batch_size=1000)

    # 1000 + 1000 + 500: the short third batch says there is nothing left.
    assert (result.deleted, result.batches) == (2500, 3)
    assert await _job_ids(conn) == {f"live-{i}" for i in range(1, 11)}


async def test_cleanup_with_max_batches_commits_each_batch_and_stops(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await _insert_fences(conn, "expired-", 25, EXPIRED_1MS_AGO)

    result = await cleanup_expired(conn, batch_size=10, max_batches=2)

    assert (result.deleted, result.batches) == (20, 2)
    # Another session sees the two batches committed: no transaction was left open.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as other:
        assert await scalar(other, "SELECT count(*) FROM core.processed_jobs") == 5
    assert (await cleanup_expired(conn, batch_size=10)).deleted == 5


async def test_cleanup_refuses_a_connection_that_is_not_autocommit_and_deletes_nothing(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await _insert_fences(conn, "expired-", 5, EXPIRED_1MS_AGO)
    async with await psycopg.AsyncConnection.connect(database_url) as in_transaction:
        with pytest.raises(ValueError, match="cleanup needs an autocommit connection"):
            await cleanup_expired(in_transaction)
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 5


async def test_cleanup_refuses_a_batch_size_below_one_and_deletes_nothing(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await _insert_fences(conn, "expired-", 5, EXPIRED_1MS_AGO)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        await cleanup_expired(conn, batch_size=0)
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 5


async def test_cleanup_never_touches_dead_letters(conn: psycopg.AsyncConnection[Any]) -> None:
    # D4: a pending_review dead letter never expires and is never deleted.
    await conn.execute(
        "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts, last_error,"
        " error_class, created_at) VALUES ('old', 'q', 'c', '{}', 1, 'E: x', 'E',"
        " now() - interval '400 days')"
    )
    await _insert_fences(conn, "expired-", 2, EXPIRED_1MS_AGO)
    assert (await cleanup_expired(conn)).deleted == 2
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 1


def test_jobfence_cleanup_cli_prints_how_many_rows_it_removed(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as db:
        db.execute(
            "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at)"
            " SELECT 'expired-' || g, 'c', now() - interval '8 days', now() - interval '1 day'"
            " FROM generate_series(1, 5) AS g"
        )
        db.execute(
            "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
            " VALUES ('live', 'c', now() + interval '1 day')"
        )

    done = run_jobfence(database_url, "cleanup", "--batch-size", "2")

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "removed 5 expired fence rows in 3 batch(es)"
    assert "Traceback" not in done.stderr
    with psycopg.connect(database_url, autocommit=True) as db:
        rows = db.execute("SELECT job_id FROM core.processed_jobs").fetchall()
    assert rows == [("live",)]
