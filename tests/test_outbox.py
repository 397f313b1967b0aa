"""The transactional outbox, with the in-process MemoryQueue standing in for a broker.

MemoryQueue is an honest non-transactional QueuePort: nothing a database transaction does can
roll it back, so with it every producer must go through the outbox to keep "the job exists
exactly when the caller's transaction commits".
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import MemoryQueue, Message, Producer, Worker
from jobfence.adapters.prometheus import PrometheusOutboxMetrics
from jobfence.errors import ConfigError
from jobfence.outbox import (
    OutboxRelay,
    OutboxRelaySettings,
    outbox_counts,
    queue_setting,
    record_queue,
    schedule,
    write,
)
from support import scalar, wait_until

AWARD = "award_points"


class FixedClock:
    def __init__(self, now: datetime) -> None:
        self.at = now

    def now(self) -> datetime:
        return self.at


@pytest.fixture
async def external(conn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncConnection[Any]:
    """This database's queue is external (a RabbitMQ the tests stand in for with the memory
    queue), and the points app's tables."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    await record_queue(conn, "rabbitmq", "amqp://broker/")
    return conn


async def _rows(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
    cur = await conn.execute(
        "SELECT queue, consumer, job_id, tenant_id, correlation_id FROM jobfence.outbox ORDER BY id"
    )
    return await cur.fetchall()


async def _relay_once(database_url: str, queue: Any, **kwargs: Any) -> OutboxRelay:
    relay = OutboxRelay(database_url, queue, **kwargs)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
        await relay.run_round(c)
    return relay


async def test_enqueue_in_a_committed_transaction_is_one_outbox_row_published_then_applied_once(
    external: psycopg.AsyncConnection[Any],
    database_url: str,
    pool: AsyncConnectionPool[Any],
) -> None:
    app = pointsapp.build_app()
    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        await app.enqueue(
            tx, AWARD, {"account_id": 1, "points": 5}, job_id="o-1", correlation_id="c-1"
        )
        # Not visible before the commit, neither in the outbox nor in any queue.
        assert await scalar(external, "SELECT count(*) FROM jobfence.outbox") == 0
        await tx.commit()
    assert await _rows(external) == [(pointsapp.QUEUE, AWARD, "o-1", None, "c-1")]
    assert await scalar(external, "SELECT count(*) FROM jobfence_queue.messages") == 0

    queue = MemoryQueue(poll_interval_seconds=0.05)
    relay = await _relay_once(database_url, queue)
    assert relay.stats.published == 1
    assert await _rows(external) == []  # a published row is gone: the table never grows
    assert (await queue.size([pointsapp.QUEUE])).total == 1

    stats = await Worker(app, pool, queue, poll_seconds=0.05, outbox_relay=False).run(until="empty")
    assert stats.outcomes == {"succeeded": 1}
    assert await scalar(external, "SELECT count(*) FROM public.awards WHERE job_id = 'o-1'") == 1


async def test_a_rolled_back_transaction_leaves_no_outbox_row_and_no_job(
    external: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    app = pointsapp.build_app()
    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        await app.enqueue(tx, AWARD, {"account_id": 1, "points": 5}, job_id="gone")
        await tx.rollback()
    queue = MemoryQueue()
    relay = await _relay_once(database_url, queue)
    assert relay.stats.published == 0
    assert await _rows(external) == []
    assert (await queue.size([pointsapp.QUEUE])).total == 0
    assert await scalar(external, "SELECT count(*) FROM jobfence_queue.messages") == 0


async def test_every_producer_path_writes_the_outbox_when_the_queue_is_external(
    external: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    """App.enqueue_sync, Producer (async and sync) and SQL's jobfence.enqueue: one row each."""
    app = pointsapp.build_app()
    producer = Producer(routes={AWARD: pointsapp.QUEUE})
    with psycopg.connect(database_url) as sync:
        app.enqueue_sync(sync, AWARD, {"account_id": 1, "points": 1}, job_id="sync-app")
        producer.enqueue_sync(sync, AWARD, {"account_id": 1, "points": 1}, job_id="sync-prod")
        sync.execute(
            "SELECT jobfence.enqueue('award_points', 'loyalty', 'sql-1',"
            ' \'{"account_id": 1, "points": 1}\'::jsonb)'
        )
    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        await producer.enqueue(tx, AWARD, {"account_id": 1, "points": 1}, job_id="async-prod")
        await tx.commit()
    assert [row[2] for row in await _rows(external)] == [
        "sync-app",
        "sync-prod",
        "sql-1",
        "async-prod",
    ]
    assert await scalar(external, "SELECT count(*) FROM jobfence_queue.messages") == 0
    body = await scalar(external, "SELECT body FROM jobfence.outbox WHERE job_id = 'sql-1'")
    assert bytes(body) == b'{"points":1,"account_id":1}'


async def test_with_the_postgresql_queue_producers_write_the_queue_not_the_outbox(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    app = pointsapp.build_app()
    assert (await queue_setting(conn)).kind == "postgresql"
    await app.enqueue(conn, AWARD, {"account_id": 1, "points": 1}, job_id="pg-1")
    await conn.execute(
        "SELECT jobfence.enqueue('award_points', 'loyalty', 'pg-2', '{\"account_id\": 1,"
        ' "points": 1}\'::jsonb)'
    )
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 2
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0


async def test_a_delayed_message_waits_in_postgresql_until_due(
    external: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    message = Message(queue="loyalty", consumer=AWARD, job_id="later", body=b"{}")
    await schedule(external, message, timedelta(hours=1))
    queue = MemoryQueue()
    now = datetime.now(UTC)
    await _relay_once(database_url, queue, clock=FixedClock(now))
    assert (await queue.size(["loyalty"])).total == 0
    assert [row[2] for row in await _rows(external)] == ["later"]
    relay = await _relay_once(database_url, queue, clock=FixedClock(now + timedelta(hours=1.01)))
    assert relay.stats.published == 1
    assert (await queue.size(["loyalty"])).total == 1
    assert await _rows(external) == []


async def test_the_relay_publishes_a_row_with_its_prior_attempts_so_the_count_goes_on(
    external: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    """A retry written to the outbox after delivery 2 is delivered as attempt 3; a producer's
    row (prior_attempts 0) as attempt 1."""
    retried = Message(queue="loyalty", consumer=AWARD, job_id="retried", body=b"{}")
    fresh = Message(queue="loyalty", consumer=AWARD, job_id="fresh", body=b"{}")
    await schedule(external, retried, 0, prior_attempts=2)
    await write(external, fresh)
    cur = await external.execute("SELECT job_id, prior_attempts FROM jobfence.outbox ORDER BY id")
    assert await cur.fetchall() == [("retried", 2), ("fresh", 0)]
    with pytest.raises(ValueError, match="prior_attempts must be from 0 to 2147483646, got -1"):
        await write(external, fresh, prior_attempts=-1)

    queue = MemoryQueue()
    relay = await _relay_once(database_url, queue)

    assert relay.stats.published == 2
    got = await queue.receive(["loyalty"], max_messages=5, lease_seconds=30)
    assert sorted((d.message.job_id, d.attempt) for d in got) == [("fresh", 1), ("retried", 3)]


async def test_a_delayed_row_written_while_the_relay_waits_is_published_when_due(
    external: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    """The relay waits for the next due row or a producer's NOTIFY, not for its next poll: a
    row due in 0.6 s, written while it waits (polling every 30 s), is published no earlier
    than due and at most the documented second late."""
    queue = MemoryQueue(poll_interval_seconds=0.01)
    relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=30))
    task = asyncio.create_task(relay.run())
    loop = asyncio.get_running_loop()
    try:

        async def waiting() -> bool:
            return relay.active and relay.stats.rounds >= 1

        await wait_until(waiting, message="the relay to wait")
        message = Message(queue="loyalty", consumer=AWARD, job_id="due-soon", body=b"{}")
        written = loop.time()
        await schedule(external, message, 0.6, prior_attempts=1)
        got = await queue.receive(["loyalty"], max_messages=1, lease_seconds=30, wait_seconds=10.0)
        waited = loop.time() - written
    finally:
        relay.stop()
        await external.execute("SELECT pg_notify('jobfence_outbox', '')")  # wakes it now
        await task
    assert [(d.message.job_id, d.attempt) for d in got] == [("due-soon", 2)]
    assert 0.6 <= waited <= 0.6 + 1.0


class FailingQueue(MemoryQueue):
    """A broker that refuses the next ``fail`` publishes (down, or not confirming)."""

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.fail = fail

    async def publish(self, message: Message, **kwargs: Any) -> None:
        if self.fail > 0:
            self.fail -= 1
            raise ConnectionError("broker unreachable")
        await super().publish(message, **kwargs)


async def test_a_failed_publish_keeps_its_row_and_is_retried_after_a_backoff(
    external: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    """A message whose publish fails while the broker answers waits out its own backoff; the
    others of its batch are published."""
    app = pointsapp.build_app()
    for n in (1, 2):
        await app.enqueue(external, AWARD, {"account_id": 1, "points": 1}, job_id=f"f-{n}")
    queue = FailingQueue(fail=1)
    metrics = PrometheusOutboxMetrics()
    settings = OutboxRelaySettings(retry_base_seconds=0.05, poll_seconds=0.05)
    relay = OutboxRelay(database_url, queue, settings=settings, metrics=metrics)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
        wait = await relay.run_round(c)
        assert 0 < wait <= 0.05
        assert relay.stats.failed == 1 and relay.stats.published == 1
        cur = await external.execute(
            "SELECT job_id, attempts, last_error FROM jobfence.outbox ORDER BY id"
        )
        assert await cur.fetchall() == [("f-1", 1, "ConnectionError: broker unreachable")]
        assert metrics.registry.get_sample_value("jobfence_outbox_failed_total") == 1
        assert metrics.registry.get_sample_value("jobfence_outbox_waiting") == 1

        async def drained() -> bool:
            await relay.run_round(c)
            return await scalar(external, "SELECT count(*) FROM jobfence.outbox") == 0

        await wait_until(drained, timeout=10, message="the outbox to drain")
    assert relay.stats.published == 2
    assert (await queue.size(["loyalty"])).total == 2
    assert metrics.registry.get_sample_value("jobfence_outbox_published_total") == 2
    assert metrics.registry.get_sample_value("jobfence_outbox_waiting") == 0


async def test_the_oldest_age_counts_from_when_a_row_fell_due_never_its_delay(
    external: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    """jobfence_outbox_oldest_age_seconds is how long the longest-waiting publishable row has
    waited since it fell due: a retry waiting out its delay reads 0 (no false alarm), and a row
    the broker keeps refusing goes on ageing from its first due time although each failure
    moves its next try forward."""
    now = datetime.now(UTC)
    later = Message(queue="loyalty", consumer=AWARD, job_id="later", body=b"{}")
    await schedule(external, later, 3600, prior_attempts=1, clock=FixedClock(now))
    counts = await outbox_counts(external, clock=FixedClock(now + timedelta(minutes=30)))
    assert (counts.waiting, counts.due, counts.oldest_age_seconds) == (1, 0, 0.0)
    counts = await outbox_counts(external, clock=FixedClock(now + timedelta(seconds=3610)))
    assert (counts.waiting, counts.due) == (1, 1)
    assert counts.oldest_age_seconds == pytest.approx(10.0)
    await external.execute("DELETE FROM jobfence.outbox")

    refused = Message(queue="loyalty", consumer=AWARD, job_id="refused", body=b"{}")
    await write(external, refused, clock=FixedClock(now))
    settings = OutboxRelaySettings(retry_base_seconds=60, retry_cap_seconds=60, poll_seconds=0.05)
    for minutes in (0, 5):  # two failed publishes, each moving the next try 30-60 s on
        at = FixedClock(now + timedelta(minutes=minutes))
        relay = await _relay_once(database_url, FailingQueue(fail=1), settings=settings, clock=at)
        assert relay.stats.failed == 1
    cur = await external.execute("SELECT attempts, due_at > %s FROM jobfence.outbox", (now,))
    assert await cur.fetchall() == [(2, True)]
    counts = await outbox_counts(external, clock=FixedClock(now + timedelta(minutes=10)))
    assert counts.oldest_age_seconds == pytest.approx(600.0)
    assert [row[2] for row in await _rows(external)] == ["refused"]  # still there, nothing lost


async def test_two_relays_on_one_database_one_is_active(
    external: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    settings = OutboxRelaySettings(poll_seconds=0.05)
    first = OutboxRelay(database_url, MemoryQueue(), settings=settings)
    second = OutboxRelay(database_url, MemoryQueue(), settings=settings)
    tasks = [asyncio.create_task(first.run()), asyncio.create_task(second.run())]
    try:

        async def one_active() -> bool:
            return first.active or second.active

        await wait_until(one_active, message="a relay to become active")
        await asyncio.sleep(0.3)  # both have tried the lock many times by now
        assert [first.active, second.active].count(True) == 1
        active, standby = (first, second) if first.active else (second, first)
        active.stop()

        async def took_over() -> bool:
            return standby.active

        await wait_until(took_over, message="the standby relay to take over")
    finally:
        first.stop()
        second.stop()
        await asyncio.gather(*tasks)


async def test_moving_to_a_broker_is_refused_while_the_postgresql_queue_holds_jobs(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    app = pointsapp.build_app()
    await app.enqueue(conn, AWARD, {"account_id": 1, "points": 1}, job_id="left")
    with pytest.raises(ConfigError, match=r"PostgreSQL queue still holds 1 message"):
        await record_queue(conn, "rabbitmq", "amqp://broker:5672/")
    assert (await queue_setting(conn)).kind == "postgresql"
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 1


async def test_moving_back_is_refused_while_the_outbox_holds_jobs(
    external: psycopg.AsyncConnection[Any],
) -> None:
    app = pointsapp.build_app()
    await app.enqueue(external, AWARD, {"account_id": 1, "points": 1}, job_id="waiting")
    with pytest.raises(ConfigError, match=r"outbox still holds 1 message"):
        await record_queue(external, "postgresql", None)
    assert (await queue_setting(external)).kind == "rabbitmq"
    assert (await outbox_counts(external)).waiting == 1


async def test_a_worker_on_an_external_queue_runs_the_relay_and_applies_each_job_once(
    external: psycopg.AsyncConnection[Any], pool: AsyncConnectionPool[Any]
) -> None:
    """The relay runs inside the worker by default; --until empty waits for the outbox too.
    The same job_id enqueued twice (two committed transactions) applies once."""
    app = pointsapp.build_app()
    for job_id in ("w-1", "w-2", "w-1"):
        await app.enqueue(external, AWARD, {"account_id": 2, "points": 3}, job_id=job_id)
    # Still in the outbox when the queue first runs empty: the worker waits for it.
    await app.enqueue(
        external, AWARD, {"account_id": 2, "points": 3}, job_id="w-3", delay_seconds=0.5
    )
    queue = MemoryQueue(poll_interval_seconds=0.05)
    metrics = PrometheusOutboxMetrics()
    worker = Worker(
        app,
        pool,
        queue,
        poll_seconds=0.05,
        outbox_metrics=metrics,
        outbox_settings=OutboxRelaySettings(poll_seconds=0.05),
    )
    stats = await asyncio.wait_for(worker.run(until="empty"), 30)
    assert stats.outcomes == {"succeeded": 3, "duplicate": 1}
    assert await scalar(external, "SELECT points FROM public.accounts WHERE id = 2") == 9
    assert await scalar(external, "SELECT count(*) FROM jobfence.outbox") == 0
    assert metrics.registry.get_sample_value("jobfence_outbox_published_total") == 4


async def test_a_producer_racing_the_move_to_a_broker_writes_the_outbox_never_the_old_queue(
    conn: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    """The move locks the PostgreSQL queue's table; a producer's statement waits for it and
    then reads the new setting, so its job cannot land in the queue nobody reads any more."""
    app = pointsapp.build_app()
    async with (
        await psycopg.AsyncConnection.connect(database_url) as mover,
        await psycopg.AsyncConnection.connect(database_url) as producer,
    ):
        await record_queue(mover, "rabbitmq", "amqp://broker/")  # in mover's open transaction
        enqueue = asyncio.create_task(
            app.enqueue(producer, AWARD, {"account_id": 1, "points": 1}, job_id="racer")
        )

        async def producer_waits() -> bool:
            waiting = await scalar(
                conn,
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                (producer.info.backend_pid,),
            )
            return bool(waiting)

        await wait_until(producer_waits, message="the producer to wait for the move's lock")
        await mover.commit()
        await asyncio.wait_for(enqueue, 10)
        await producer.commit()
    assert await _rows(conn) == [(pointsapp.QUEUE, AWARD, "racer", None, None)]
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
