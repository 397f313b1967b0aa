"""A broker short of a resource, or set up to free memory by deleting keys, must neither lose a
job nor hide what is happening: jobfence refuses at start-up a Redis that can evict its
streams, warns once about a Redis without AOF, and when the broker refuses every message for a
while (Redis out of memory, a RabbitMQ resource alarm, a RabbitMQ queue full under
``reject-publish``) the outbox relay keeps the jobs, says what the broker said, and publishes
them once it takes messages again; none becomes a dead letter.

The tests that change a setting of the whole broker are marked ``serial`` (they run alone) and
put back what they found in a ``finally``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis

import pointsapp
from brokers import delete_everything, make_queue
from jobfence import QueueUnavailable
from jobfence.adapters import redis_streams
from jobfence.adapters.redis_streams import RedisStreamsQueue
from jobfence.errors import ConfigError
from jobfence.model import Outgoing
from jobfence.outbox import OutboxRelay, OutboxRelaySettings, record_queue
from jobfence.queues import parse_queue_url
from queue_conformance import message
from support import scalar, wait_until

Q = pointsapp.QUEUE
# A message that fails on its own is dead-lettered at its second failure, within a second: a
# refusal of every message that were taken for the message's own would show at once.
QUICK_DEAD_LETTERS = OutboxRelaySettings(
    poll_seconds=0.05,
    retry_base_seconds=0.05,
    retry_cap_seconds=0.1,
    probe_cap_seconds=0.2,
    max_publish_failures=2,
)


def _alone() -> None:
    """Skip unless the test runs alone: it changes a setting every test of the broker sees."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.skip("changes a setting of the whole broker: runs alone (pytest -m serial)")


# -- Redis ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def redis_memory(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An admin client; ``maxmemory`` and ``maxmemory-policy`` put back as found on exit."""
    _alone()
    admin = aioredis.Redis.from_url(redis_url, decode_responses=True)
    before = {key: (await admin.config_get(key))[key] for key in ("maxmemory", "maxmemory-policy")}
    try:
        yield admin
    finally:
        await admin.config_set("maxmemory", before["maxmemory"])
        await admin.config_set("maxmemory-policy", before["maxmemory-policy"])
        await admin.aclose()


async def _used_memory(admin: aioredis.Redis) -> int:
    return int((await admin.info("memory"))["used_memory"])


@pytest.fixture
async def redis_prefix(redis_url: str) -> AsyncIterator[str]:
    name = f"jfres{uuid.uuid4().hex[:12]}"
    yield name
    await delete_everything("redis", redis_url, name, [Q])


@pytest.mark.serial
@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
async def test_a_redis_that_can_evict_the_streams_is_refused_at_start_up(
    redis_url: str, redis_prefix: str, policy: str
) -> None:
    """An eviction policy over every key with a ``maxmemory``: under memory pressure Redis
    deletes a whole stream, every job in it lost with no dead letter. The queue does not open
    (``JOBFENCE_QUEUE_URL``'s factory), a directly built adapter publishes nothing, and the
    relay's publish is an outage (nothing dead-lettered), each naming the setting and what to
    set. Far above the memory used, so nothing is evicted while the test runs."""
    from jobfence.adapters.redis_streams import open_queue

    async with redis_memory(redis_url) as admin:
        await admin.config_set("maxmemory", str(await _used_memory(admin) + 512 * 1024 * 1024))
        await admin.config_set("maxmemory-policy", policy)
        with pytest.raises(ConfigError) as refused:
            await open_queue(f"{redis_url}?prefix={redis_prefix}")
        text = str(refused.value)
        assert f"maxmemory-policy is {policy}" in text, text
        assert "noeviction" in text, text
        queue = RedisStreamsQueue(redis_url, prefix=redis_prefix)
        try:
            with pytest.raises(ConfigError, match="maxmemory-policy"):
                await queue.publish(message("a", queue=Q))
            (result,) = await queue.publish_many([Outgoing(message("b", queue=Q))])
            assert isinstance(result, QueueUnavailable), result
            assert f"maxmemory-policy is {policy}" in str(result)
        finally:
            await queue.close()
        assert await admin.exists(f"{redis_prefix}:{{{Q}}}:stream") == 0


@pytest.mark.serial
@pytest.mark.parametrize(
    ("maxmemory", "policy"), [(0, "allkeys-lru"), (512 * 1024 * 1024, "volatile-lru")]
)
async def test_a_redis_that_cannot_evict_the_streams_is_accepted(
    redis_url: str,
    redis_prefix: str,
    caplog: pytest.LogCaptureFixture,
    maxmemory: int,
    policy: str,
) -> None:
    """No ``maxmemory`` (never evicts), or a ``volatile-*`` policy (evicts only keys with a TTL,
    and jobfence's streams have none): published and received as usual, nothing said about
    eviction."""
    async with redis_memory(redis_url) as admin:
        await admin.config_set(
            "maxmemory", str(maxmemory and await _used_memory(admin) + maxmemory)
        )
        await admin.config_set("maxmemory-policy", policy)
        queue = RedisStreamsQueue(redis_url, prefix=redis_prefix)
        try:
            await queue.publish(message("a", queue=Q))
            got = await queue.receive([Q], max_messages=1, lease_seconds=30)
            assert [d.message.job_id for d in got] == ["a"]
            assert await admin.ttl(f"{redis_prefix}:{{{Q}}}:stream") == -1  # no TTL: volatile
        finally:
            await queue.close()
    assert not [r for r in caplog.records if "evict" in r.getMessage()], caplog.text


async def test_a_redis_without_aof_is_named_in_one_warning_per_process(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """AOF off: a restart of Redis loses what was published since the last snapshot (or
    everything), with no dead letter. One WARNING per process, naming ``appendonly``; never a
    refusal (RDB alone is a choice some make knowingly)."""
    admin = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        aof = int((await admin.info("persistence"))["aof_enabled"])
    finally:
        await admin.aclose()
    if aof:
        pytest.skip("this Redis runs with AOF: nothing to warn about")
    monkeypatch.setattr(redis_streams, "_WARNED", set(), raising=False)
    caplog.set_level(logging.WARNING, logger="jobfence.adapters.redis_streams")
    queues = [RedisStreamsQueue(redis_url, prefix=redis_prefix) for _ in range(2)]
    try:
        for n, queue in enumerate(queues):
            await queue.publish(message(f"j{n}", queue=Q))
            await queue.receive([Q], max_messages=1, lease_seconds=30)
    finally:
        for queue in queues:
            await queue.close()
    lines = [r.getMessage() for r in caplog.records if "appendonly" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "appendonly yes" in lines[0], lines[0]
    assert all(r.levelno == logging.WARNING for r in caplog.records if "appendonly" in r.msg)


async def _relay_on(database_url: str, conn: psycopg.AsyncConnection[Any], url: str) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    target = parse_queue_url(url)
    await record_queue(conn, target.kind, target.location)


async def _start(relay: OutboxRelay) -> asyncio.Task[Any]:
    task = asyncio.create_task(relay.run())

    async def active() -> bool:
        assert not task.done(), task
        return relay.active

    await wait_until(active, timeout=20, message="the relay to be active")
    return task


async def _stop(relay: OutboxRelay, task: asyncio.Task[Any], conn: Any) -> None:
    relay.stop()
    await conn.execute("SELECT pg_notify('jobfence_outbox', '')")
    await asyncio.wait_for(task, 30)


async def _dead_letters(conn: psycopg.AsyncConnection[Any]) -> int:
    return int(await scalar(conn, "SELECT count(*) FROM core.dead_letters"))


async def _outage_or_dead_letter(
    relay: OutboxRelay, conn: psycopg.AsyncConnection[Any], timeout: float
) -> None:
    """Until the relay is in an outage, or wrote a dead letter (what it must not do)."""

    async def either() -> bool:
        return relay.broker_down or await _dead_letters(conn) > 0

    await wait_until(either, timeout=timeout, message="an outage or a dead letter")


async def _outbox_empty(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0


@pytest.mark.serial
async def test_a_redis_out_of_memory_pauses_the_relay_saying_so_and_loses_nothing(
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``noeviction`` at ``maxmemory``: Redis refuses every XADD (``OOM command not allowed``).
    The relay backs off as for an outage, with a line saying Redis is out of memory (not
    unreachable, and no dead letter), and publishes every job once memory is free again."""
    caplog.set_level(logging.INFO, logger="jobfence")
    await _relay_on(database_url, conn, redis_url)
    jobs = [f"oom-{n}" for n in range(5)]
    await pointsapp.enqueue_awards(database_url, jobs)
    queue = RedisStreamsQueue(redis_url, prefix=redis_prefix)
    relay = OutboxRelay(database_url, queue, settings=QUICK_DEAD_LETTERS)
    task: asyncio.Task[Any] | None = None
    async with redis_memory(redis_url) as admin:
        try:
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", str(await _used_memory(admin) // 2))
            task = await _start(relay)
            await _outage_or_dead_letter(relay, conn, timeout=10)
            assert await _dead_letters(conn) == 0
            assert relay.broker_down

            async def probed() -> bool:
                return relay.stats.failed >= 3

            await wait_until(probed, timeout=10, message="probes of the full Redis")
            assert await _dead_letters(conn) == 0
            assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == len(jobs)
        finally:
            await admin.config_set("maxmemory", "0")
        try:
            await wait_until(lambda: _outbox_empty(conn), timeout=20, message="the outbox")
        finally:
            if task is not None:
                await _stop(relay, task, conn)
            await queue.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "jobfence.outbox"]
    went = [line for line in lines if "broker went away" in line]
    assert len(went) == 1, lines
    assert "Redis is out of memory" in went[0], went[0]
    assert "maxmemory" in went[0], went[0]
    assert not [line for line in lines if "unreachable" in line], lines
    assert len([line for line in lines if "broker back after" in line]) == 1, lines
    assert await _dead_letters(conn) == 0
    admin = aioredis.Redis.from_url(redis_url)
    try:
        assert await admin.xlen(f"{redis_prefix}:{{{Q}}}:stream") == len(jobs)
    finally:
        await admin.aclose()


# -- RabbitMQ -------------------------------------------------------------------------------


def _rabbitmqctl(*args: str) -> str:
    rabbitmqctl = shutil.which("rabbitmqctl")
    if rabbitmqctl is None:
        pytest.skip("rabbitmqctl is not installed")
    done = subprocess.run(
        [rabbitmqctl, "-q", *args], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout


@contextlib.contextmanager
def memory_alarm() -> Iterator[None]:
    """A memory alarm on the local RabbitMQ for the block (its high watermark far below what it
    uses), then the watermark put back as ``rabbitmqctl environment`` showed it."""
    _alone()
    environment = _rabbitmqctl("environment")
    found = re.search(r"\{vm_memory_high_watermark,\s*([^}]+?)\}", environment)
    absolute = re.search(r"\{vm_memory_high_watermark,\s*\{absolute,\s*([^}]+?)\}\}", environment)
    if absolute is not None:
        restore = ["absolute", absolute.group(1)]
    else:
        assert found is not None, environment
        restore = [found.group(1)]
    _rabbitmqctl("set_vm_memory_high_watermark", "0.000001")
    try:
        yield
    finally:
        _rabbitmqctl("set_vm_memory_high_watermark", *restore)


@pytest.fixture
async def amqp_prefix(amqp_url: str) -> AsyncIterator[str]:
    name = f"jfres{uuid.uuid4().hex[:12]}"
    yield name
    await delete_everything("rabbitmq", amqp_url, name, [Q])


async def _ready_in(amqp_url: str, name: str) -> int:
    import aio_pika

    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(name, passive=True)
        return int(declared.declaration_result.message_count or 0)
    finally:
        await connection.close()


@pytest.mark.serial
async def test_a_rabbitmq_memory_alarm_pauses_the_relay_with_a_line_naming_it(
    amqp_url: str,
    amqp_prefix: str,
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RabbitMQ blocks a publishing connection while a resource alarm is raised
    (``connection.blocked``): the adapter logs a WARNING naming the alarm, the relay's
    publishes wait (no dead letter, no "unreachable"), and once the alarm clears an INFO says
    so and every job is published."""
    caplog.set_level(logging.INFO, logger="jobfence")
    await _relay_on(database_url, conn, amqp_url)
    queue = make_queue("rabbitmq", amqp_url, amqp_prefix)
    relay = OutboxRelay(database_url, queue, settings=QUICK_DEAD_LETTERS)
    await pointsapp.enqueue_awards(database_url, ["before"])
    task = await _start(relay)
    jobs = [f"alarm-{n}" for n in range(5)]
    try:
        await wait_until(lambda: _outbox_empty(conn), timeout=20, message="the first job")
        with memory_alarm():
            await pointsapp.enqueue_awards(database_url, jobs)

            async def blocked_said() -> bool:
                return (
                    any(
                        r.name == "jobfence.adapters.rabbitmq" and "alarm" in r.getMessage()
                        for r in caplog.records
                    )
                    or await _dead_letters(conn) > 0
                )

            await wait_until(blocked_said, timeout=20, message="a line naming the alarm")
            assert await _dead_letters(conn) == 0
            assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == len(jobs)
        await wait_until(lambda: _outbox_empty(conn), timeout=30, message="the outbox")
    finally:
        await _stop(relay, task, conn)
        await queue.close()
    lines = [r for r in caplog.records if r.name == "jobfence.adapters.rabbitmq"]
    blocked = [r.getMessage() for r in lines if r.levelno == logging.WARNING]
    assert len(blocked) == 1, blocked
    assert "memory" in blocked[0] and "alarm" in blocked[0], blocked[0]
    unblocked = [r.getMessage() for r in lines if r.levelno == logging.INFO]
    assert len(unblocked) == 1 and "unblocked" in unblocked[0], unblocked
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()], caplog.text
    assert not [r for r in caplog.records if r.name == "aiormq.connection"], caplog.text
    assert await _dead_letters(conn) == 0
    assert await _ready_in(amqp_url, f"{amqp_prefix}.{Q}") == len(jobs) + 1


async def test_a_rabbitmq_queue_full_under_reject_publish_pauses_the_relay_and_never_dead_letters(
    amqp_url: str,
    amqp_prefix: str,
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A policy (matching this test's queue only) with ``max-length`` and ``overflow:
    reject-publish``: the broker nacks every publish while the queue is full. The relay backs
    off as for an outage, saying the queue is full (not unreachable), dead-letters nothing,
    and publishes every job as a consumer makes room."""
    caplog.set_level(logging.INFO, logger="jobfence")
    await _relay_on(database_url, conn, amqp_url)
    name = f"{amqp_prefix}.{Q}"
    policy = f"jfres-{uuid.uuid4().hex[:12]}"
    queue = make_queue("rabbitmq", amqp_url, amqp_prefix)
    consumer = make_queue("rabbitmq", amqp_url, amqp_prefix)
    # One message a round: the queue fills after the first ones (a quorum queue takes a batch
    # that arrives while it is under its limit whole).
    relay = OutboxRelay(database_url, queue, settings=replace(QUICK_DEAD_LETTERS, batch_size=1))
    jobs = [f"full-{n}" for n in range(6)]
    task: asyncio.Task[Any] | None = None
    _rabbitmqctl(
        "set_policy",
        policy,
        f"^{re.escape(name)}$",
        json.dumps({"max-length": 2, "overflow": "reject-publish"}),
        "--apply-to",
        "queues",
    )
    try:
        await pointsapp.enqueue_awards(database_url, jobs)
        task = await _start(relay)
        await _outage_or_dead_letter(relay, conn, timeout=20)
        assert await _dead_letters(conn) == 0
        assert relay.broker_down
        left = await scalar(conn, "SELECT count(*) FROM jobfence.outbox")
        assert 0 < left < len(jobs)  # the queue took some before it was full
        consumed: list[str] = []

        async def all_consumed() -> bool:
            got = await consumer.receive([Q], max_messages=10, lease_seconds=30)
            await consumer.ack_many(got)
            consumed.extend(d.message.job_id for d in got)
            return await _outbox_empty(conn) and len(consumed) >= len(jobs)

        await wait_until(all_consumed, timeout=30, message="every job consumed")
        assert sorted(consumed) == sorted(jobs)
    finally:
        _rabbitmqctl("clear_policy", policy)
        if task is not None:
            await _stop(relay, task, conn)
        await queue.close()
        await consumer.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "jobfence.outbox"]
    went = [line for line in lines if "broker went away" in line]
    assert went, lines
    assert "is full" in went[0] and "reject-publish" in went[0], went[0]
    assert not [line for line in lines if "unreachable" in line], lines
    assert not [line for line in lines if "dead letter" in line], lines
    assert await _dead_letters(conn) == 0
