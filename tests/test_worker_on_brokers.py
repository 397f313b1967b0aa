"""The worker runs unchanged on each broker's queue adapter: jobs apply once, a duplicate
job_id is fenced in PostgreSQL, poison and a hard failure become dead letters, and every message
leaves the broker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from brokers import BROKERS, make_queue, on_broker
from jobfence import Message, QueuePort, RetryPolicy, Worker
from support import scalar


@pytest.fixture(params=BROKERS)
async def broker_queue(request: pytest.FixtureRequest) -> AsyncIterator[QueuePort]:
    async with on_broker(request, [pointsapp.QUEUE]) as (kind, url, name):
        queue = make_queue(kind, url, name)
        yield queue
        await queue.close()


async def test_the_worker_runs_unchanged_on_a_broker(
    broker_queue: QueuePort,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    award = "award_points"
    for msg in (
        app.message(award, {"account_id": 1, "points": 5}, job_id="a1"),
        app.message(award, {"account_id": 1, "points": 5}, job_id="a1"),
        app.message(award, {"account_id": 2, "points": 7}, job_id="a2", tenant_id="t1"),
        app.message(award, {"account_id": 3, "points": 1, "mode": "hard"}, job_id="hard"),
        Message(queue=pointsapp.QUEUE, consumer=award, job_id="poison", body=b'{"account_id":'),
    ):
        await broker_queue.publish(msg)

    worker = Worker(app, pool, broker_queue, concurrency=2, poll_seconds=0.05, lease_seconds=30)
    stats = await worker.run(until="empty")

    assert stats.outcomes == {"succeeded": 2, "duplicate": 1, "dead_lettered": 1, "poison": 1}
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == 2
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 5
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 2") == 7
    fences = await conn.execute("SELECT job_id, tenant_id FROM core.processed_jobs ORDER BY 1")
    assert await fences.fetchall() == [("a1", None), ("a2", "t1")]
    dead = await conn.execute(
        "SELECT job_id, error_class, attempts, status FROM core.dead_letters ORDER BY job_id"
    )
    assert await dead.fetchall() == [
        ("hard", "jobfence.HardFailure", 1, "pending_review"),
        ("poison", "InvalidJson", 1, "pending_review"),
    ]
    assert (await broker_queue.size([pointsapp.QUEUE])).total == 0


async def test_a_job_failing_transiently_is_delivered_max_retries_plus_one_times_on_a_broker(
    broker_queue: QueuePort,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """D1 on a broker: the attempt count survives each delayed retry (the broker's delivery
    count plus the adapter's header; on RabbitMQ and Redis the retry goes through the outbox,
    whose row carries the attempts so far), so the dead letter records every delivery."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    policy = RetryPolicy(
        max_retries=2, base_seconds=0.2, cap_seconds=1.0, rationale="a test needs quick retries"
    )
    app = pointsapp.build_app(policy)
    await broker_queue.publish(
        app.message("award_points", {"account_id": 1, "points": 1, "mode": "transient"}, job_id="t")
    )

    worker = Worker(app, pool, broker_queue, concurrency=1, poll_seconds=0.05, lease_seconds=30)
    stats = await worker.run(until="empty")

    assert stats.outcomes == {"retried": 2, "dead_lettered": 1}
    dead = await conn.execute("SELECT job_id, attempts, last_error FROM core.dead_letters")
    ((job_id, attempts, last_error),) = await dead.fetchall()
    assert (job_id, attempts) == ("t", 3)
    assert last_error.startswith("pointsapp.Flaky: ledger timeout on attempt 3\n")
    assert (await broker_queue.size([pointsapp.QUEUE])).total == 0
