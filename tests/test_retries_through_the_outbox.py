"""On a broker without native delayed retry (RabbitMQ, Redis Streams), a retry with a delay goes
through the PostgreSQL outbox: the harness commits an outbox row carrying the delivery's attempt
and the delay, then acks the delivery; the relay publishes the retry when it falls due.

Real PostgreSQL, the real brokers, real time: the attempts survive (D1), each retry arrives no
earlier than its delay and at most ``TOLERANCE_SECONDS`` late (D2, the tolerance documented in
docs/queues.md), exhausted retries end as one pending dead letter, a delivery that lost its
lease takes its retry back, and a process SIGKILLed between the commit and the ack ends with the
job applied once or one pending dead letter.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import retry_crash_worker as crash
from brokers import make_queue, on_broker
from jobfence import App, JobMeta, Message, PrometheusMetrics, QueuePort, RetryPolicy, Worker
from jobfence.harness import Harness, Outcome
from jobfence.model import Delivery
from retry_crash_worker import CONSUMER, EFFECTS_SQL, QUEUE, Flaky, Job, build_app
from support import scalar, wait_until

TESTS = Path(__file__).parent
BROKERS_WITHOUT_DELAY = ("rabbitmq", "redis")
# docs/queues.md: a retry through the outbox arrives no earlier than its delay and, with the
# relay running, at most this late (the relay's wake-up, one publish, one delivery).
TOLERANCE_SECONDS = 1.0
QUICK = RetryPolicy(
    max_retries=5, base_seconds=0.5, cap_seconds=10.0, rationale="a test needs quick retries"
)


@pytest.fixture(params=BROKERS_WITHOUT_DELAY)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    async with on_broker(request, [QUEUE]) as found:
        yield found


@pytest.fixture
async def queue(broker: tuple[str, str, str]) -> AsyncIterator[QueuePort]:
    kind, url, name = broker
    opened = make_queue(kind, url, name)
    assert not opened.capabilities.delayed_retry
    yield opened
    await opened.close()


@pytest.fixture
async def effects(conn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncConnection[Any]:
    await conn.execute(EFFECTS_SQL)
    return conn


def job(job_id: str, fail_times: int) -> Message:
    return Message(QUEUE, CONSUMER, job_id, Job(fail_times=fail_times).model_dump_json().encode())


async def outbox_rows(conn: psycopg.AsyncConnection[Any]) -> int:
    return int(await scalar(conn, "SELECT count(*) FROM jobfence.outbox"))


async def test_a_job_failing_twice_succeeds_on_attempt_3_with_each_retry_on_time(
    broker: tuple[str, str, str],
    queue: QueuePort,
    pool: AsyncConnectionPool[Any],
    effects: psycopg.AsyncConnection[Any],
) -> None:
    """Base 0.5 s: the handler sees attempts 1, 2, 3; retry n arrives after its delay (the
    one the policy drew with the worker's seeded random source) and within the tolerance."""
    seen: list[tuple[str, int, float, str]] = []
    await queue.publish(job("twice", fail_times=2))
    worker = Worker(
        build_app(QUICK, seen),
        pool,
        queue,
        concurrency=2,
        poll_seconds=0.05,
        lease_seconds=30,
        rng=random.Random(7),
    )
    stats = await asyncio.wait_for(worker.run(until="empty"), 60)

    assert stats.outcomes == {"retried": 2, "succeeded": 1}
    arrived = [(attempt, at) for _, attempt, at, what in seen if what == "arrived"]
    failed = [at for _, _, at, what in seen if what == "failed"]
    assert [attempt for attempt, _ in arrived] == [1, 2, 3]
    drawn = random.Random(7)
    delays = [QUICK.delay(1, drawn), QUICK.delay(2, drawn)]
    late = [arrived[n + 1][1] - failed[n] - delays[n] for n in range(2)]
    print(f"{broker[0]}: delays {delays}, late by {[round(s, 3) for s in late]} s")
    for lateness in late:
        assert 0 <= lateness <= TOLERANCE_SECONDS
    assert await scalar(effects, "SELECT count(*) FROM public.retry_effects") == 1
    fences = await effects.execute("SELECT job_id FROM core.processed_jobs")
    assert await fences.fetchall() == [("twice",)]
    assert await outbox_rows(effects) == 0
    assert (await queue.size([QUEUE])).total == 0


async def test_exhausted_retries_through_the_outbox_end_as_one_pending_dead_letter(
    queue: QueuePort,
    pool: AsyncConnectionPool[Any],
    effects: psycopg.AsyncConnection[Any],
) -> None:
    seen: list[tuple[str, int, float, str]] = []
    policy = RetryPolicy(
        max_retries=2, base_seconds=0.2, cap_seconds=1.0, rationale="a test needs quick retries"
    )
    await queue.publish(job("doomed", fail_times=-1))
    worker = Worker(
        build_app(policy, seen), pool, queue, concurrency=2, poll_seconds=0.05, lease_seconds=30
    )
    stats = await asyncio.wait_for(worker.run(until="empty"), 60)

    assert stats.outcomes == {"retried": 2, "dead_lettered": 1}
    assert [attempt for _, attempt, _, what in seen if what == "arrived"] == [1, 2, 3]
    dead = await effects.execute(
        "SELECT job_id, attempts, status, error_class, last_error FROM core.dead_letters"
    )
    ((job_id, attempts, status, error_class, last_error),) = await dead.fetchall()
    assert (job_id, attempts, status) == ("doomed", 3, "pending_review")
    assert error_class == "retry_crash_worker.Flaky"
    assert last_error.startswith("retry_crash_worker.Flaky: ledger timeout on attempt 3\n")
    assert await scalar(effects, "SELECT count(*) FROM public.retry_effects") == 0
    assert await outbox_rows(effects) == 0
    assert (await queue.size([QUEUE])).total == 0


async def test_a_retry_whose_delivery_lost_its_lease_leaves_no_copy_in_the_outbox(
    broker: tuple[str, str, str],
    queue: QueuePort,
    pool: AsyncConnectionPool[Any],
    effects: psycopg.AsyncConnection[Any],
) -> None:
    """The handler fails after another client took the job over (its lease ran out): the
    retry's outbox row is committed, the ack says the lease was lost, and the row is taken
    back. The new holder's delivery is untouched and decides the job's fate."""
    kind, url, name = broker
    other = make_queue(kind, url, name)
    taken: list[Delivery] = []

    async def taken_over() -> bool:
        taken.extend(await other.receive([QUEUE], max_messages=1, lease_seconds=3.0))
        return bool(taken)

    app = App()

    @app.consumer(CONSUMER, queue=QUEUE, schema=Job, retry=QUICK)
    async def handle(payload: Job, meta: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
        await wait_until(taken_over, timeout=20, interval=0.05, message="the takeover")
        raise Flaky(f"failed after its lease ran out, on attempt {meta.attempt}")

    try:
        await queue.publish(job("contended", fail_times=1))
        (stale,) = await queue.receive([QUEUE], max_messages=1, lease_seconds=1.0)
        harness = Harness(app, pool, queue, metrics=PrometheusMetrics())

        assert await harness.handle(stale) == Outcome.LEASE_LOST

        assert [(d.message.job_id, d.attempt) for d in taken] == [("contended", 2)]
        written = await scalar(effects, "SELECT pg_sequence_last_value('jobfence.outbox_id_seq')")
        assert written is not None, "the retry's row was written (and committed) first"
        assert await outbox_rows(effects) == 0, "and taken back once the ack was refused"
        assert await other.ack(taken[0]) is True, "the new holder still holds the job"
        assert (await other.size([QUEUE])).total == 0
    finally:
        await other.close()


@pytest.mark.parametrize("ending", ["applied once", "dead letter"])
async def test_a_process_killed_between_the_outbox_commit_and_the_ack_ends_once(  # noqa: PLR0917
    broker: tuple[str, str, str],
    queue: QueuePort,
    pool: AsyncConnectionPool[Any],
    effects: psycopg.AsyncConnection[Any],
    database_url: str,
    tmp_path: Path,
    ending: str,
) -> None:
    """SIGKILL after the retry's outbox row committed and before the delivery's ack: the broker
    delivers the original again and the relay publishes the retry, two copies of the job. A job
    that then succeeds is applied once (the fence skips the second copy); one that keeps
    failing ends as exactly one pending dead letter."""
    kind, url, name = broker
    await queue.publish(job("crashed", fail_times=1 if ending == "applied once" else -1))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(TESTS / "retry_crash_worker.py"),
        kind,
        url,
        name,
        database_url,
        str(tmp_path),
        cwd=TESTS,
    )
    try:

        async def before_ack() -> bool:
            assert proc.returncode is None, "the crash worker exited early"
            return (tmp_path / "before_ack").exists()

        await wait_until(before_ack, timeout=60, interval=0.05, message="the retry's commit")
        row = await effects.execute("SELECT job_id, prior_attempts FROM jobfence.outbox")
        assert await row.fetchall() == [("crashed", 1)], "committed before the ack"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL

    worker = Worker(
        build_app(crash.POLICY),
        pool,
        queue,
        concurrency=2,
        poll_seconds=0.05,
        lease_seconds=crash.LEASE_SECONDS,
    )
    stats = await asyncio.wait_for(worker.run(until="empty"), 90)

    applied = await scalar(effects, "SELECT count(*) FROM public.retry_effects")
    dead = await effects.execute("SELECT job_id, attempts, status FROM core.dead_letters")
    if ending == "applied once":
        assert applied == 1
        assert await dead.fetchall() == []
        assert stats.outcomes["succeeded"] == 1
    else:
        assert applied == 0
        assert await dead.fetchall() == [("crashed", 3, "pending_review")]
    assert await outbox_rows(effects) == 0
    assert (await queue.size([QUEUE])).total == 0
