"""``async def`` handlers and cancellation: a ``CancelledError`` raised by a handler while
nothing cancelled the worker is the handler's own, one failure of its job
(``test_sync_edges.py``); the worker's own cancellation is not, and must go on up. Real
PostgreSQL, real workers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from psycopg import AsyncConnection

import pointsapp
from jobfence import JobMeta, PgQueue, PrometheusMetrics, db
from support import wait_until
from test_acceptance_harness import awards, balance, dead_letter_ids, fences, queued, worker
from test_sync_edges import run_worker_apart
from test_sync_handlers import CONSUMER, app_with


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
