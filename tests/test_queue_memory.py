"""MemoryQueue: the queue contract without a database, and the harness running on it unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import MemoryQueue, Message, QueueCapabilities, Worker
from queue_conformance import FakeClock, QueueConformance, QueueEnv
from support import scalar


class TestMemoryQueueConformance(QueueConformance):
    """On a fake clock: leases and delays pass without waiting."""

    expected_capabilities = QueueCapabilities(
        transactional=False, recorded=False, delayed_publish=True, delayed_retry=True
    )

    @pytest.fixture
    async def env(self) -> AsyncIterator[QueueEnv]:
        clock = FakeClock()
        # A long poll interval, so only a wake-up can make a waiting receiver return early.
        queue = MemoryQueue(clock=clock, poll_interval_seconds=30.0)
        yield QueueEnv(queue=queue, clock=clock)
        await queue.close()


class TestMemoryQueueRealClockConformance(QueueConformance):
    """On its default real clock, with short leases: a waiting receiver wakes when one falls due."""

    expected_capabilities = QueueCapabilities(
        transactional=False, recorded=False, delayed_publish=True, delayed_retry=True
    )

    @pytest.fixture
    async def env(self) -> AsyncIterator[QueueEnv]:
        queue = MemoryQueue(poll_interval_seconds=30.0)
        yield QueueEnv(queue=queue, lease_seconds=0.3, delay_seconds=0.3)
        await queue.close()


async def test_a_waiting_receiver_wakes_when_a_delayed_message_falls_due() -> None:
    queue = MemoryQueue(poll_interval_seconds=30.0)
    await queue.publish(
        Message(queue="q", consumer="c", job_id="later", body=b"{}"), delay_seconds=0.2
    )
    got = await queue.receive(["q"], max_messages=1, lease_seconds=10.0, wait_seconds=5.0)
    assert [(d.message.job_id, d.attempt) for d in got] == [("later", 1)]


async def test_the_worker_runs_unchanged_on_the_memory_queue(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    """Jobs apply once, a duplicate job_id is skipped by the fence in PostgreSQL, poison and a
    hard failure are dead-lettered, and every message leaves the queue."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    queue = MemoryQueue()
    award = "award_points"
    for msg in (
        app.message(award, {"account_id": 1, "points": 5}, job_id="a1"),
        app.message(award, {"account_id": 1, "points": 5}, job_id="a1"),
        app.message(award, {"account_id": 2, "points": 7}, job_id="a2", tenant_id="t1"),
        app.message(award, {"account_id": 3, "points": 1, "mode": "hard"}, job_id="hard"),
        Message(queue=pointsapp.QUEUE, consumer=award, job_id="poison", body=b'{"account_id":'),
    ):
        await queue.publish(msg)

    stats = await Worker(app, pool, queue, concurrency=2, poll_seconds=0.05).run(until="empty")
    await queue.close()

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
    assert (await queue.size([pointsapp.QUEUE])).total == 0
