"""D7: when the database connection is lost, the worker pauses, reconnects and gives back the
jobs it held, without burning their retries or losing them."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

import pointsapp
from jobfence import App, JobMeta, PgQueue, PrometheusMetrics, Worker
from jobfence.model import Delivery
from jobfence.sync import PsycopgRunner
from support import job_groups, scalar, wait_until

JOBS = 40


@pytest.mark.parametrize("flavour", ["async", "sync"])
@pytest.mark.parametrize("jobs_per_transaction", [1, 5])
async def test_database_connections_killed_mid_run_lose_no_job_and_burn_no_retry(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    jobs_per_transaction: int,
    flavour: str,
) -> None:
    """With one job per transaction, and with groups of 5 (group commit) cut mid-group; for
    async handlers and for sync ones (their transactions on the worker's sync pool, whose
    connections are cut too)."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app(jobs_per_transaction=jobs_per_transaction, flavour=flavour)
    async with conn.transaction():
        for i in range(JOBS):
            await app.enqueue(
                conn, "award_points", {"account_id": 1, "points": 1, "mode": "slow"}, job_id=f"j{i}"
            )
    metrics = PrometheusMetrics()
    queue = PgQueue(pool, poll_interval_seconds=0.1)
    worker = Worker(app, pool, queue, concurrency=3, poll_seconds=0.1, metrics=metrics)
    run = asyncio.create_task(worker.run(until="empty"))

    async def some_done() -> bool:
        return metrics.count("succeeded") >= 5

    await wait_until(some_done, message="the first jobs to succeed")
    # Cut every connection the worker holds (handlers mid-transaction, fetcher, listener).
    killed = await scalar(
        conn,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    assert killed >= 1
    stats = await asyncio.wait_for(run, timeout=60)
    await queue.close()
    # The jobs cut off mid-transaction were given back without counting the delivery.
    assert stats.released >= 1

    assert await scalar(conn, "SELECT count(*) FROM awards") == JOBS
    assert await scalar(conn, "SELECT count(DISTINCT job_id) FROM awards") == JOBS
    assert await scalar(conn, "SELECT points FROM accounts WHERE id = 1") == JOBS
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == JOBS
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0
    assert metrics.count("retried") == 0
    assert metrics.count("dead_lettered") == 0
    assert job_groups(metrics, "committed") >= (1 if jobs_per_transaction > 1 else 0)


class Step(BaseModel):
    pass


async def test_a_job_lost_while_recovery_gives_back_the_others_is_given_back_too(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two running jobs lose their connections, the second only once recovery has begun giving
    back the first (a processor that finds out late its connection was cut). The second is
    given back too, at once: it does not wait out its lease, nor burn a delivery."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    caplog.set_level(logging.INFO, logger="jobfence.worker")
    second_running = asyncio.Event()
    giving_back = asyncio.Event()
    cut: set[str] = set()
    runs: list[tuple[str, int]] = []
    app = App()

    @app.consumer("step", queue="steps", schema=Step)
    async def step(payload: Step, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
        if job.job_id not in cut:
            cut.add(job.job_id)
            if job.job_id == "first":
                await second_running.wait()
            else:
                second_running.set()
                await giving_back.wait()  # lost only once recovery gives "first" back
            await tx.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        runs.append((job.job_id, job.attempt))
        await tx.execute(
            "INSERT INTO public.awards (job_id, account_id, points) VALUES (%s, 1, 1)",
            (job.job_id,),
        )

    class GivingBackSlowly(PgQueue):
        async def release(self, delivery: Delivery) -> None:
            if not giving_back.is_set():
                giving_back.set()

                async def second_lost() -> bool:
                    return worker.running == 0

                await wait_until(second_lost, message="the second job to be lost")
            await super().release(delivery)

    async with conn.transaction():
        for job_id in ("first", "second"):
            await app.enqueue(conn, "step", {}, job_id=job_id)
    metrics = PrometheusMetrics()
    queue = GivingBackSlowly(pool, poll_interval_seconds=0.1)
    worker = Worker(app, pool, queue, concurrency=2, poll_seconds=0.1, metrics=metrics)
    run = asyncio.create_task(worker.run(until="empty"))
    done, _ = await asyncio.wait({run}, timeout=20)
    if not done:
        worker.stop(now=True)
        await asyncio.wait_for(run, timeout=10)
        await queue.close()
        pytest.fail("the worker never finished: the job lost during recovery stayed leased")
    stats = run.result()
    await queue.close()

    assert sorted(runs) == [("first", 1), ("second", 1)]  # no delivery burnt
    assert await scalar(conn, "SELECT count(*) FROM awards") == 2
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 2
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
    assert stats.released == 2
    assert metrics.count("retried") == 0
    backs = [r.getMessage() for r in caplog.records if "database back" in r.getMessage()]
    assert len(backs) == 1 and "2 job(s) released" in backs[0], backs


async def test_a_lasting_fetch_error_backs_off_instead_of_spinning_and_recovers(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    metrics = PrometheusMetrics()
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    worker = Worker(app, pool, queue, concurrency=1, poll_seconds=0.05, metrics=metrics)
    caplog.set_level(logging.WARNING, logger="jobfence.worker")
    run = asyncio.create_task(worker.run())
    try:
        # Break fetching for good: the queue table disappears under the running worker.
        await conn.execute("ALTER TABLE jobfence_queue.messages RENAME TO messages_gone")

        def failures() -> int:
            return sum("cannot fetch jobs" in r.getMessage() for r in caplog.records)

        async def failing() -> bool:
            return failures() >= 1

        await wait_until(failing, message="the first fetch failure")

        async def backed_off_3_times() -> bool:
            return failures() >= 4

        await wait_until(backed_off_3_times, timeout=15, message="four fetch failures")
        # 0.5 + 1 + 2 s of backoff lie between the first and the fourth failure: no spinning.
        # Measured between the failures' own log records, not when this test saw them.
        logged = [r.created for r in caplog.records if "cannot fetch jobs" in r.getMessage()]
        assert logged[3] - logged[0] >= 3.5 - 0.05, logged
        assert "UndefinedTable" in caplog.text

        await conn.execute("ALTER TABLE jobfence_queue.messages_gone RENAME TO messages")
        await app.enqueue(conn, "award_points", {"account_id": 2, "points": 3}, job_id="after")

        async def processed() -> bool:
            return metrics.count("succeeded") == 1

        await wait_until(processed, timeout=20, message="the worker to resume")
    finally:
        worker.stop()
        await asyncio.wait_for(run, timeout=10)
        await queue.close()
    assert await scalar(conn, "SELECT points FROM accounts WHERE id = 2") == 3


async def test_a_sync_job_takes_a_fresh_connection_when_the_server_closed_the_idle_ones(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server closed the sync pool's idle connections (a restart, an idle timeout): the
    next sync job does not fail on one of them, which would send the worker through an outage
    recovery; the pool's other users never touch these connections to find out first."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app(flavour="sync")
    runner = PsycopgRunner(database_url, size=2, kwargs={"application_name": "sync-side"})
    await asyncio.to_thread(runner.open)
    metrics = PrometheusMetrics()
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    worker = Worker(
        app, pool, queue, concurrency=2, poll_seconds=0.05, metrics=metrics, sync_runner=runner
    )
    caplog.set_level(logging.INFO, logger="jobfence")
    run = asyncio.create_task(worker.run())
    sync_side = (
        "SELECT count(%s(pid)) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'sync-side'"
    )
    try:
        await app.enqueue(conn, "award_points", {"account_id": 1, "points": 1}, job_id="before")

        async def succeeded(n: int) -> bool:
            return metrics.count("succeeded") == n

        await wait_until(lambda: succeeded(1), message="the first job")
        assert await scalar(conn, sync_side % "pg_terminate_backend") >= 1

        async def gone() -> bool:
            return await scalar(conn, sync_side % "") == 0

        await wait_until(gone, message="the sync pool's connections to close")
        await app.enqueue(conn, "award_points", {"account_id": 1, "points": 1}, job_id="after")
        await wait_until(lambda: succeeded(2), message="the job after")
    finally:
        worker.stop()
        stats = await asyncio.wait_for(run, timeout=10)
        await queue.close()
        await asyncio.to_thread(runner.close)
    assert "database went away" not in caplog.text
    assert stats.released == 0
    assert await scalar(conn, "SELECT points FROM accounts WHERE id = 1") == 2
