"""A worker given a connection pool smaller than it needs (``concurrency + 2``: one per running
job, plus fetches and acks) says so at start-up, with the numbers and the size to give it, and
still processes every job: fewer connections make it slower, never lose or repeat a job."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from psycopg import AsyncConnection

import pointsapp
from jobfence import PgQueue, PrometheusMetrics, Worker, open_pool
from support import scalar

JOBS = 60


async def _run(
    database_url: str, conn: AsyncConnection[Any], max_size: int, caplog: pytest.LogCaptureFixture
) -> list[str]:
    """Enqueue JOBS awards, run a worker with concurrency 4 on a pool of ``max_size`` until
    idle; the worker's warnings about the pool."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    for i in range(JOBS):
        payload = {"account_id": 1 + i % 3, "points": 1}
        await app.enqueue(conn, "award_points", payload, job_id=f"j{i}")
    pool = await open_pool(database_url, min_size=1, max_size=max_size, name="small")
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    try:
        worker = Worker(
            app, pool, queue, concurrency=4, metrics=PrometheusMetrics(), poll_seconds=0.05
        )
        with caplog.at_level(logging.WARNING, logger="jobfence"):
            stats = await asyncio.wait_for(worker.run(until="idle"), timeout=60)
    finally:
        await queue.close()
        await pool.close()
    assert stats.outcomes == {"succeeded": JOBS}
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == JOBS
    assert await scalar(conn, "SELECT count(DISTINCT job_id) FROM public.awards") == JOBS
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "jobfence.worker" and "connection pool" in r.getMessage()
    ]


async def test_a_worker_on_a_pool_smaller_than_concurrency_plus_two_warns_and_runs_every_job(
    database_url: str, conn: AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    warnings = await _run(database_url, conn, 2, caplog)
    assert warnings == [
        "the connection pool holds at most 2 connections for concurrency 4: jobs wait for a"
        " connection, and so do fetches, acks and lease extensions behind them; size the pool"
        " concurrency + 2 (6)"
    ]


async def test_a_worker_on_a_pool_of_concurrency_plus_two_does_not_warn(
    database_url: str, conn: AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    assert await _run(database_url, conn, 6, caplog) == []
