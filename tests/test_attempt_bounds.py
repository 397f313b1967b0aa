"""A delivery whose attempt is out of what ``core.dead_letters.attempts`` can hold (below 1, or
above 2^31-1: an adapter outside jobfence, or one with a bug) is still dead-lettered, once,
with its attempt kept within the column's bounds. Without that, the dead letter's insert
failed (CHECK attempts >= 1, integer out of range), and so did the internal-failure fallback:
"fallback dead letter could not be written either", on every delivery, forever."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import (
    Delivery,
    MemoryQueue,
    Message,
    PgQueue,
    PrometheusMetrics,
    Worker,
    replay_dead_letter,
)
from jobfence.harness import INTERNAL_FAILURE, Harness, Outcome
from jobfence.limits import UNFENCEABLE
from support import scalar

INT_MAX = 2**31 - 1
BODY = b'{"account_id": 1, "points": 5}'


class SkewedQueue(MemoryQueue):
    """A queue adapter whose deliveries of job ``skewed`` carry a given attempt."""

    def __init__(self, attempt: int) -> None:
        super().__init__(poll_interval_seconds=0.05)
        self.attempt = attempt

    async def receive(self, queues: Sequence[str], **kwargs: Any) -> list[Delivery]:
        got = await super().receive(queues, **kwargs)
        return [
            dataclasses.replace(d, attempt=self.attempt) if d.message.job_id == "skewed" else d
            for d in got
        ]


@pytest.mark.parametrize(
    ("attempt", "recorded"),
    [(0, 1), (-100, 1), (2**40, INT_MAX), (10**12, INT_MAX)],
    ids=["zero", "minus-100", "2e40", "10e12"],
)
async def test_a_delivery_with_an_attempt_out_of_bounds_is_one_dead_letter_and_the_rest_run(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    attempt: int,
    recorded: int,
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    queue = SkewedQueue(attempt)
    for job_id in ("before", "skewed", "after"):
        await queue.publish(Message(pointsapp.QUEUE, "award_points", job_id, BODY))
    metrics = PrometheusMetrics()
    worker = Worker(
        pointsapp.build_app(), pool, queue, concurrency=1, poll_seconds=0.05, metrics=metrics
    )
    await asyncio.wait_for(worker.run(until="empty"), 30)

    assert (metrics.count("succeeded"), metrics.count("poison")) == (2, 1)
    cur = await conn.execute(
        "SELECT job_id, error_class, attempts, last_error FROM core.dead_letters"
    )
    ((job_id, error_class, attempts, last_error),) = await cur.fetchall()
    assert (job_id, error_class, attempts) == ("skewed", UNFENCEABLE, recorded)
    assert f"its attempt {attempt} is not from 1 to {INT_MAX}" in last_error
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == 2


@pytest.mark.parametrize("attempt", [-5, 0, 2**40], ids=["minus-5", "zero", "2e40"])
async def test_the_internal_failure_fallback_writes_a_delivery_with_an_attempt_out_of_bounds(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any], attempt: int
) -> None:
    """The fallback runs at once for such a delivery (its attempt would never reach
    INTERNAL_FAILURE_DELIVERIES), and its dead letter can be written."""
    queue = PgQueue(pool)
    try:
        await queue.publish(Message(pointsapp.QUEUE, "award_points", "j-1", BODY))
        (delivery,) = await queue.receive([pointsapp.QUEUE], max_messages=1, lease_seconds=30)
        harness = Harness(pointsapp.build_app(), pool, queue, metrics=PrometheusMetrics())
        skewed = dataclasses.replace(delivery, attempt=attempt)
        outcome = await harness.internal_failure(skewed, RuntimeError("induced"))
    finally:
        await queue.close()
    assert outcome == Outcome.DEAD_LETTERED
    cur = await conn.execute("SELECT error_class, attempts FROM core.dead_letters")
    assert await cur.fetchall() == [(INTERNAL_FAILURE, 1 if attempt < 1 else INT_MAX)]
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0


async def test_an_unfenceable_dead_letter_with_identifiers_within_limits_replays_and_runs(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    """Dead-lettered for a count it could not read, not for its identifiers: the replay
    publishes it with a fresh count, and it runs once."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    skewed = SkewedQueue(0)
    await skewed.publish(Message(pointsapp.QUEUE, "award_points", "skewed", BODY))
    await asyncio.wait_for(
        Worker(pointsapp.build_app(), pool, skewed, poll_seconds=0.05).run(until="empty"), 30
    )
    dead_letter_id = await scalar(conn, "SELECT id FROM core.dead_letters")
    queue = PgQueue(pool)
    try:
        replayed = await replay_dead_letter(pool, queue, dead_letter_id, resolved_by="ops@test")
        assert replayed.published
        stats = await asyncio.wait_for(
            Worker(pointsapp.build_app(), pool, queue, poll_seconds=0.05).run(until="empty"), 30
        )
    finally:
        await queue.close()
    assert dict(stats.outcomes) == {"succeeded": 1}
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 5
    assert await scalar(conn, "SELECT status FROM core.dead_letters") == "replayed"
