"""Cleanup and a job still in the PostgreSQL queue: a worker killed between its commit and its
ack leaves the job's message queued with its fence committed. If no worker takes that queue
for longer than the fence TTL (workers stopped through a long outage), cleanup must not delete
the fence while that copy waits, or the copy applies the work a second time when workers come
back. Real PostgreSQL, a real worker process SIGKILLed, the real ``jobfence cleanup``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import PrometheusMetrics, cleanup_expired
from support import run_jobfence, scalar
from test_acceptance_harness import (
    WorkerProcess,
    awards,
    balance,
    fences,
    kill_after_a_commit_before_its_ack,
    processes,  # noqa: F401 (a fixture)
    queued,
    run_recording_attempts,
    workdir,  # noqa: F401 (a fixture)
)


async def days_pass(conn: AsyncConnection[Any], days: int) -> None:
    """Move every fence and queued message ``days`` into the past: what they would look like
    had they been written that long ago (the fence's TTL counted from then)."""
    shift = f"{days} days"
    await conn.execute(
        "UPDATE core.processed_jobs SET processed_at = processed_at - %s::interval,"
        " expires_at = expires_at - %s::interval",
        (shift, shift),
    )
    await conn.execute(
        "UPDATE jobfence_queue.messages SET created_at = created_at - %s::interval,"
        " run_at = run_at - %s::interval",
        (shift, shift),
    )


async def test_cleanup_keeps_the_fence_of_a_committed_job_whose_message_is_still_queued(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    workdir: Path,  # noqa: F811
    processes: list[WorkerProcess],  # noqa: F811
) -> None:
    """A worker SIGKILLed after "late-ack" committed and before its ack; no worker for 8 days
    (the TTL is 7); ``jobfence cleanup`` runs. It keeps that job's fence, and removes the
    expired fences whose jobs are no longer queued. When a worker comes back, the copy is a
    duplicate: acked, no second effect."""
    await points.execute(  # a job done before the two below were enqueued
        "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at)"
        " VALUES ('long-done', 'award_points', now(), now() + interval '7 days')"
    )
    await kill_after_a_commit_before_its_ack(database_url, points, workdir, processes)

    await days_pass(points, 8)
    done = run_jobfence(database_url, "cleanup")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "removed 1 expired fence rows in 1 batch(es)", done.stdout
    assert await fences(points, "long-done") == 0
    assert await fences(points, "late-ack") == 1

    metrics = PrometheusMetrics()
    seen = await run_recording_attempts(pool, "empty", metrics)
    assert seen == [("z-block", 2)], "the handler never sees the committed job again"
    assert metrics.count("duplicate") == 1
    assert await awards(points, "late-ack") == 1
    assert await balance(points, 3) == 5
    assert await queued(points) == 0

    # Its copy gone, the next cleanup removes the expired fence.
    assert (await cleanup_expired(points)).deleted == 1
    assert await fences(points, "late-ack") == 0


async def test_a_job_delayed_for_its_first_run_holds_back_no_fence(
    points: AsyncConnection[Any],
) -> None:
    """A message never delivered and not yet due (enqueued with a delay) cannot be the copy of
    a committed job: however old, it keeps no expired fence of its consumer."""
    app = pointsapp.build_app()
    await app.enqueue(
        points,
        "award_points",
        {"account_id": 3, "points": 5},
        job_id="in-a-month",
        delay_seconds=30 * 86400,
    )
    await points.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at)"
        " VALUES ('done', 'award_points', now(), now() + interval '7 days')"
    )
    await days_pass(points, 8)

    assert (await cleanup_expired(points)).deleted == 1
    assert await fences(points, "done") == 0
    assert await queued(points) == 1


async def test_a_queued_copy_holds_back_only_the_fences_of_its_own_consumer(
    points: AsyncConnection[Any],
) -> None:
    """A message delivered before and still queued (its worker died) keeps the expired fences of
    its consumer written after it was enqueued; another consumer's, and older ones, go."""
    app = pointsapp.build_app()
    await points.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at) VALUES"
        " ('older', 'award_points', now() - interval '1 hour', now() + interval '7 days'),"
        " ('other', 'another_consumer', now(), now() + interval '7 days')"
    )
    await app.enqueue(points, "award_points", {"account_id": 3, "points": 5}, job_id="held")
    await points.execute(
        "UPDATE jobfence_queue.messages SET attempts = 1, lease_token = gen_random_uuid()"
    )
    await points.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at)"
        " VALUES ('held', 'award_points', now(), now() + interval '7 days')"
    )
    await days_pass(points, 8)

    assert (await cleanup_expired(points)).deleted == 2
    rows = await scalar(points, "SELECT string_agg(job_id, ',') FROM core.processed_jobs")
    assert rows == "held"
