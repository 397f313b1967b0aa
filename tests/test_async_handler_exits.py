"""``async def`` handlers raising what is not an ``Exception``: a handler's own
``CancelledError`` (no one cancelled the worker), ``SystemExit``, ``KeyboardInterrupt`` or
``GeneratorExit`` ends as one failure of its own job, and the jobs behind it go on. Real
PostgreSQL, real workers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from psycopg import AsyncConnection

import pointsapp
from jobfence import JobMeta, PgQueue, PrometheusMetrics, RetryPolicy, db, get_dead_letter
from support import wait_until
from test_acceptance_harness import awards, balance, dead_letter_ids, fences, queued, worker
from test_sync_edges import EXITS, run_worker_apart
from test_sync_handlers import CONSUMER, app_with


@pytest.mark.parametrize("per_transaction", [1, 5])
@pytest.mark.parametrize("raised", EXITS, ids=lambda exc: exc.__name__)
async def test_an_async_handler_raising_a_base_exception_is_one_dead_letter_and_the_jobs_behind_run(
    database_url: str,
    points: AsyncConnection[Any],
    raised: type[BaseException],
    per_transaction: int,
) -> None:
    """Raised by an ``async def`` handler (the ``CancelledError`` with no cancellation of the
    worker's task requested), each stops nothing but its job: its transaction rolls back,
    fence included, the job fails like any other error (here with no retry left: one dead
    letter naming what was raised), and the worker runs the jobs behind it. In a group
    (``jobs_per_transaction``) the group rolls back and its jobs run one transaction each."""

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        if job.job_id == "exits":
            raise raised("bye")

    app = app_with(
        award,
        retry=RetryPolicy(max_retries=0, rationale="no retry in this test"),
        jobs_per_transaction=per_transaction,
    )
    job_ids = ["exits", *(f"after-{n}" for n in range(4))]
    for job_id in job_ids:
        await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id=job_id)

    stats = run_worker_apart(database_url, app, concurrency=1)

    assert stats.outcomes == {"dead_lettered": 1, "succeeded": 4}, dict(stats.outcomes)
    assert await awards(points, "exits") == 0
    assert await fences(points, "exits") == 0
    [dl_id] = await dead_letter_ids(points, "exits")
    dl = await get_dead_letter(points, dl_id)
    assert (dl.attempts, dl.error_class) == (1, "jobfence.HandlerExited")
    assert f"raised {raised.__name__}" in dl.last_error, dl.last_error
    for job_id in job_ids[1:]:
        assert await awards(points, job_id) == 1, job_id
    assert await balance(points, 1) == 2 * 4
    assert await queued(points) == 0


async def test_cancelling_the_worker_while_an_async_handler_waits_gives_the_job_back_unfailed(
    database_url: str, points: AsyncConnection[Any]
) -> None:
    """The worker's own cancellation is not the handler's: its ``CancelledError`` goes on up,
    the job is neither failed nor dead-lettered, nothing of it commits, and the next worker
    applies it once."""
    started = asyncio.Event()

    async def waits(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        started.set()
        await asyncio.Event().wait()  # until cancelled

    await app_with(waits).enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id="w")
    pool = await db.open_pool(database_url, min_size=1, max_size=6)
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    try:
        running = asyncio.ensure_future(
            worker(
                app_with(waits), pool, queue, PrometheusMetrics(), shutdown_grace_seconds=0.2
            ).run(until="idle")
        )

        async def has_started() -> bool:
            return started.is_set()

        await wait_until(has_started, message="the handler started")
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, 10)
    finally:
        await queue.close()
        await pool.close()

    assert await dead_letter_ids(points, "w") == []
    assert (await awards(points, "w"), await fences(points, "w")) == (0, 0)
    assert await queued(points) == 1

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)

    stats = run_worker_apart(database_url, app_with(award), concurrency=1, lease_seconds=1)
    assert stats.outcomes == {"succeeded": 1}, dict(stats.outcomes)
    assert (await awards(points, "w"), await balance(points, 1)) == (1, 2)
