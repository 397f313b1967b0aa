"""A job whose deliveries keep ending with no outcome (its worker is killed, or its handler
hangs past the lease, every time) is dead-lettered by the delivery limit instead of being
delivered for ever: ``max_deliveries + DELIVERY_LIMIT_SLACK`` deliveries, then a
``DeliveryLimitExceeded`` dead letter written without running the handler again; a job whose
fence shows it succeeded meanwhile is a duplicate instead."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import killer_job_worker
import pointsapp
from jobfence import PgQueue, PrometheusMetrics, RetryPolicy, Worker
from jobfence.harness import DELIVERY_LIMIT, DELIVERY_LIMIT_SLACK
from support import scalar

KILLER_WORKER = Path(__file__).with_name("killer_job_worker.py")
ONE_ATTEMPT = RetryPolicy(max_retries=0, rationale="the test counts deliveries, not retries")


async def test_a_job_that_kills_its_worker_every_time_ends_as_one_dead_letter(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    tmp_path: Path,
) -> None:
    app = killer_job_worker.build_app(tmp_path)
    await PgQueue(pool).publish(app.message("killer", {"n": 1}, job_id="doom-1"))
    limit = ONE_ATTEMPT.max_deliveries + DELIVERY_LIMIT_SLACK
    runs = tmp_path / "runs"
    exits = []
    for _ in range(limit + 3):  # a supervisor restarting the worker
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, str(KILLER_WORKER), database_url, str(tmp_path)],
            check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            capture_output=True,
            timeout=60,
        )
        exits.append(proc.returncode)
        if proc.returncode == 0:
            break

    assert exits[:-1] == [-9] * limit, "each run until the limit was SIGKILLed by its job"
    assert exits[-1] == 0, proc.stderr.decode(errors="replace")
    assert runs.read_text().split() == [str(n) for n in range(1, limit + 1)]
    row = await (
        await conn.execute(
            "SELECT error_class, attempts, status, last_error FROM core.dead_letters"
            " WHERE job_id = 'doom-1'"
        )
    ).fetchall()
    assert len(row) == 1
    error_class, attempts, status, last_error = row[0]
    assert (error_class, attempts, status) == (DELIVERY_LIMIT, limit + 1, "pending_review")
    assert last_error.startswith(f"{DELIVERY_LIMIT}: delivered {limit + 1} times")
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
    assert b"dead-lettered without running" in proc.stderr


async def _over_the_limit(conn: psycopg.AsyncConnection[Any], job_id: str) -> None:
    """As if the message had been delivered up to the limit with no outcome (lease expiries)."""
    attempts = pointsapp.build_app(ONE_ATTEMPT).consumers["award_points"].retry.max_deliveries
    await conn.execute(
        "UPDATE jobfence_queue.messages SET attempts = %s WHERE job_id = %s",
        (attempts + DELIVERY_LIMIT_SLACK, job_id),
    )


@pytest.mark.parametrize("jobs_per_transaction", [1, 10])
async def test_a_delivery_over_the_limit_is_dead_lettered_without_running_its_handler(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    jobs_per_transaction: int,
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app(ONE_ATTEMPT, jobs_per_transaction=jobs_per_transaction)
    queue = PgQueue(pool)
    for job_id in ("before", "doomed", "after"):
        await queue.publish(
            app.message("award_points", {"account_id": 1, "points": 5}, job_id=job_id)
        )
    await _over_the_limit(conn, "doomed")
    metrics = PrometheusMetrics()

    stats = await Worker(app, pool, queue, metrics=metrics, outbox_relay=False).run(until="empty")

    assert stats.outcomes["succeeded"] == 2
    assert stats.outcomes["dead_lettered"] == 1
    assert await scalar(conn, "SELECT string_agg(job_id, ',' ORDER BY job_id) FROM awards") == (
        "after,before"
    ), "the doomed job's handler never ran; the others did, once"
    assert (
        await scalar(conn, "SELECT error_class || ':' || attempts FROM core.dead_letters")
        == f"{DELIVERY_LIMIT}:{ONE_ATTEMPT.max_deliveries + DELIVERY_LIMIT_SLACK + 1}"
    )
    dead = metrics.jobs.labels(pointsapp.QUEUE, "award_points", "dead_lettered")._value.get()
    assert dead == 1


async def test_a_delivery_over_the_limit_whose_fence_exists_is_a_duplicate_not_a_dead_letter(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app(ONE_ATTEMPT)
    queue = PgQueue(pool)
    await queue.publish(app.message("award_points", {"account_id": 1, "points": 5}, job_id="j"))
    # A copy of the job committed (its worker died before the ack): the fence row exists.
    await conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('j', 'award_points', now() + interval '1 day')"
    )
    await _over_the_limit(conn, "j")

    stats = await Worker(app, pool, queue, outbox_relay=False).run(until="empty")

    assert stats.outcomes["duplicate"] == 1
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0
    assert await scalar(conn, "SELECT count(*) FROM awards") == 0
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
