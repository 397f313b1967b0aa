"""A job whose lease ran out while its handler failed belongs to the worker that took it next.

The stale worker schedules no retry and writes no dead letter (they would reschedule or
dead-letter a job another worker is running, maybe to success); it counts ``lease_lost`` and
says so. The new holder's delivery decides the job's fate, exactly as if the stale one had not
existed. Real PostgreSQL queue, real harness; the lease runs out in real time (0.2 s).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

from jobfence import App, HardFailure, JobMeta, Message, PgQueue, PrometheusMetrics
from jobfence.harness import Harness, Outcome
from jobfence.model import Delivery
from support import scalar, wait_until

QUEUE = "leases"
CONSUMER = "lease_test"


class Job(BaseModel):
    n: int


def build_app(fail_first: type[BaseException]) -> App:
    app = App()

    @app.consumer(CONSUMER, queue=QUEUE, schema=Job)
    async def handle(payload: Job, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
        await tx.execute("INSERT INTO public.lease_effects (job_id) VALUES (%s)", (job.job_id,))
        if job.attempt == 1:
            raise fail_first("the first delivery fails, after its lease ran out")

    return app


async def stale_and_current(queue: PgQueue, body: bytes) -> tuple[Delivery, Delivery]:
    """Publish one message and take it twice: under a 0.2 s lease, then, once that lease ran
    out, again (the current delivery, attempt 2)."""
    await queue.publish(Message(QUEUE, CONSUMER, "job-1", body))
    (stale,) = await queue.receive([QUEUE], max_messages=1, lease_seconds=0.2)
    current: list[Delivery] = []

    async def taken_again() -> bool:
        current.extend(await queue.receive([QUEUE], max_messages=1, lease_seconds=60))
        return bool(current)

    await wait_until(taken_again, timeout=10, interval=0.05)
    assert (stale.attempt, current[0].attempt) == (1, 2)
    return stale, current[0]


@pytest.fixture
async def queue(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> AsyncIterator[PgQueue]:
    await conn.execute("CREATE TABLE public.lease_effects (job_id text NOT NULL)")
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    yield queue
    await queue.close()


@pytest.mark.parametrize(
    ("fail_first", "body"),
    [
        pytest.param(HardFailure, b'{"n": 1}', id="hard failure"),
        pytest.param(RuntimeError, b'{"n": 1}', id="transient failure"),
        pytest.param(RuntimeError, b'{"n": "not a number"}', id="poison"),
    ],
)
async def test_a_failure_after_the_lease_ran_out_is_left_to_the_worker_holding_the_job(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    queue: PgQueue,
    fail_first: type[BaseException],
    body: bytes,
    *,
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = PrometheusMetrics()
    harness = Harness(build_app(fail_first), pool, queue, metrics=metrics)
    stale, current = await stale_and_current(queue, body)

    assert await harness.handle(stale) == Outcome.LEASE_LOST
    # The operator reads what happened and both ways out: a longer lease, or its extension.
    (line,) = [r.getMessage() for r in caplog.records if r.name == "jobfence.harness"]
    assert "failed after its lease ran out" in line
    assert "raise --lease-seconds" in line and "set --max-handler-seconds" in line
    assert metrics.count("lease_lost", consumer=CONSUMER) == 1
    for outcome in ("retried", "dead_lettered", "poison"):
        assert metrics.count(outcome) == 0, outcome
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0
    row = await (
        await conn.execute("SELECT lease_token, last_error FROM jobfence_queue.messages")
    ).fetchone()
    assert row == (current.receipt.lease_token, None), "the new holder's lease is untouched"  # type: ignore[attr-defined]

    # The current delivery runs as if the stale one had never been.
    expected = Outcome.POISON if b"not a number" in body else Outcome.SUCCEEDED
    assert await harness.handle(current) == expected
    effects = await scalar(conn, "SELECT count(*) FROM public.lease_effects")
    dead = await scalar(conn, "SELECT count(*) FROM core.dead_letters")
    assert (effects, dead) == ((0, 1) if expected == Outcome.POISON else (1, 0))
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0


async def test_a_failure_with_the_lease_still_held_is_retried_and_counted_as_before(
    pool: AsyncConnectionPool[Any], queue: PgQueue
) -> None:
    # The check can fail: the same first delivery, its lease still held, is retried.
    metrics = PrometheusMetrics()
    harness = Harness(build_app(RuntimeError), pool, queue, metrics=metrics)
    await queue.publish(Message(QUEUE, CONSUMER, "job-1", json.dumps({"n": 1}).encode()))
    (delivery,) = await queue.receive([QUEUE], max_messages=1, lease_seconds=60)
    assert await harness.handle(delivery) == Outcome.RETRIED
    assert metrics.count("retried") == 1 and metrics.count("lease_lost") == 0
