"""A queue, stream or key deleted on the broker while a worker and the outbox relay run (an
operator's cleanup, a broker restored without its data): the jobs enqueued afterwards are
applied, by the same processes, without a restart. The relay runs inside the worker (one
adapter for both) or beside it with an adapter of its own, as ``jobfence outbox-relay`` does."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from brokers import BROKERS, make_queue, on_broker
from jobfence import Worker
from jobfence.outbox import OutboxRelay, OutboxRelaySettings, record_queue
from jobfence.queues import parse_queue_url
from support import scalar, wait_until


@pytest.fixture(params=BROKERS)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    async with on_broker(request, [pointsapp.QUEUE], prefix="jfgone") as found:
        yield found


async def _delete_on_broker(kind: str, url: str, name: str) -> None:
    """What an operator would delete: the stream's key on Redis, the stream on NATS, the
    queue on RabbitMQ."""
    if kind == "redis":
        import redis.asyncio as aioredis

        admin = aioredis.Redis.from_url(url)
        keys = [key async for key in admin.scan_iter(match=f"{name}:*")]
        assert keys
        await admin.delete(*keys)
        await admin.aclose()
    elif kind == "nats":
        import nats

        nc = await nats.connect(url)
        await nc.jetstream().delete_stream(name.upper())
        await nc.close()
    else:
        connection = await aio_pika.connect(url)
        channel = await connection.channel()
        await channel.queue_delete(f"{name}.{pointsapp.QUEUE}")
        await connection.close()


async def _stop(relay: OutboxRelay, task: asyncio.Task[Any], conn: Any) -> None:
    relay.stop()
    await conn.execute("SELECT pg_notify('jobfence_outbox', '')")  # wakes it to see the stop
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, 30)


@pytest.mark.parametrize("relay", ["in_the_worker", "beside_it"])
async def test_a_queue_deleted_on_the_broker_under_a_running_worker_and_relay_is_made_again(  # noqa: PLR0917
    relay: str,
    broker: tuple[str, str, str],
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Jobs applied, then the queue (stream, key) deleted on the broker: the jobs enqueued next
    are published and applied by the same worker and relay within seconds, each once, and the
    log says what was made again."""
    kind, url, name = broker
    await conn.execute(pointsapp.SCHEMA_SQL)
    target = parse_queue_url(url)
    await record_queue(conn, target.kind, target.location)
    queue = make_queue(kind, url, name)
    settings = OutboxRelaySettings(poll_seconds=0.05)
    worker = Worker(
        pointsapp.build_app(),
        pool,
        queue,
        poll_seconds=0.05,
        outbox_relay=relay == "in_the_worker",
        outbox_settings=settings,
    )
    running = asyncio.create_task(worker.run())
    own = None if relay == "in_the_worker" else make_queue(kind, url, name)
    beside = None if own is None else OutboxRelay(database_url, own, settings=settings)
    relaying = None if beside is None else asyncio.create_task(beside.run())

    async def applied(n: int) -> Any:
        async def check() -> bool:
            assert not running.done(), running
            assert relaying is None or not relaying.done(), relaying
            return await scalar(conn, "SELECT count(*) FROM public.awards") == n

        return check

    try:
        await pointsapp.enqueue_awards(database_url, [f"before-{n}" for n in range(3)])
        await wait_until(await applied(3), timeout=20, message="the first jobs applied")

        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jobfence"):
            await _delete_on_broker(kind, url, name)
            loop = asyncio.get_running_loop()
            deleted_at = loop.time()
            await pointsapp.enqueue_awards(database_url, [f"after-{n}" for n in range(3)])
            await wait_until(await applied(6), timeout=30, message="the jobs enqueued after")
            took = loop.time() - deleted_at
        print(f"\n{kind}, relay {relay}: applied {took:.2f}s after the deletion")
    finally:
        worker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 30)
        if beside is not None and relaying is not None and own is not None:
            await _stop(beside, relaying, conn)
            await own.close()
        await queue.close()
    assert await scalar(conn, "SELECT count(DISTINCT job_id) FROM public.awards") == 6
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 6
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
    assert took < 15, took
    made_again = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("jobfence.adapters.")
    ]
    assert any("deleted on the server" in line for line in made_again), made_again


async def test_a_queue_deleted_on_the_broker_under_a_relay_alone_is_made_again_by_the_relay(
    broker: tuple[str, str, str],
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No worker runs (stopped for a deploy): the relay alone makes the deleted queue (stream,
    key) again, publishes the jobs enqueued after the deletion, and empties the outbox."""
    kind, url, name = broker
    await conn.execute(pointsapp.SCHEMA_SQL)
    target = parse_queue_url(url)
    await record_queue(conn, target.kind, target.location)
    queue = make_queue(kind, url, name)
    relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
    relaying = asyncio.create_task(relay.run())

    async def published(n: int) -> Any:
        async def check() -> bool:
            assert not relaying.done(), relaying
            left = await scalar(conn, "SELECT count(*) FROM jobfence.outbox")
            return bool(left == 0 and (await queue.size([pointsapp.QUEUE])).total == n)

        return check

    try:
        await pointsapp.enqueue_awards(database_url, [f"before-{n}" for n in range(3)])
        await wait_until(await published(3), timeout=20, message="the first jobs published")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jobfence"):
            await _delete_on_broker(kind, url, name)
            await pointsapp.enqueue_awards(database_url, [f"after-{n}" for n in range(3)])
            await wait_until(await published(3), timeout=15, message="the jobs enqueued after")
    finally:
        await _stop(relay, relaying, conn)
        await queue.close()
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0


async def test_a_nats_consumer_deleted_under_a_running_worker_is_made_again(
    nats_url: str,
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only the queue's durable consumer deleted (``nats consumer rm``), the stream kept: the
    worker's pulls go unanswered, it asks, finds the consumer gone and makes it again; the jobs
    enqueued after the deletion are applied, with one WARNING naming the queue."""
    import nats

    from jobfence.adapters.nats import NatsQueue

    name = f"jfgone{uuid.uuid4().hex[:12]}"
    await conn.execute(pointsapp.SCHEMA_SQL)
    await record_queue(conn, "nats", nats_url)
    queue = NatsQueue(nats_url, stream=name.upper(), subject_prefix=name)
    worker = Worker(
        pointsapp.build_app(),
        pool,
        queue,
        poll_seconds=0.05,
        outbox_settings=OutboxRelaySettings(poll_seconds=0.05),
    )
    running = asyncio.create_task(worker.run())

    async def applied(n: int) -> Any:
        async def check() -> bool:
            assert not running.done(), running
            return await scalar(conn, "SELECT count(*) FROM public.awards") == n

        return check

    nc = await nats.connect(nats_url)
    try:
        await pointsapp.enqueue_awards(database_url, [f"before-{n}" for n in range(3)])
        await wait_until(await applied(3), timeout=20, message="the first jobs applied")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jobfence"):
            await nc.jetstream().delete_consumer(name.upper(), NatsQueue._durable(pointsapp.QUEUE))
            await pointsapp.enqueue_awards(database_url, [f"after-{n}" for n in range(3)])
            await wait_until(await applied(6), timeout=15, message="the jobs enqueued after")
    finally:
        worker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 30)
        await queue.close()
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(name.upper())
        await nc.close()
    assert await scalar(conn, "SELECT count(DISTINCT job_id) FROM public.awards") == 6
    warnings = [r.getMessage() for r in caplog.records if r.name == "jobfence.adapters.nats"]
    assert any(
        f"consumer of queue {pointsapp.QUEUE}" in w and "made again" in w for w in warnings
    ), warnings
