"""A broker-side setting someone else put there (an operator, an older deploy, another
producer) must never drop or strand a job that jobfence accepted in silence: jobfence refuses
at start-up what it can see, and says so when the broker dropped a job it held."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import aio_pika
import nats
import pytest
import redis.asyncio as aioredis
from aiormq.exceptions import ChannelPreconditionFailed
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from jobfence.adapters.nats import NatsQueue
from jobfence.adapters.rabbitmq import RabbitMQQueue
from jobfence.adapters.redis_streams import GROUP, RedisStreamsQueue
from jobfence.errors import ConfigError
from queue_conformance import message
from support import wait_until

Q = "retention"

# -- NATS JetStream -------------------------------------------------------------------------


@pytest.fixture
async def nats_stream(nats_url: str) -> AsyncIterator[str]:
    """A fresh stream name, deleted afterwards."""
    name = f"JFRET_{uuid.uuid4().hex[:12]}"
    yield name
    nc = await nats.connect(nats_url)
    with contextlib.suppress(NotFoundError):
        await nc.jetstream().delete_stream(name)
    await nc.close()


async def _make_stream(nats_url: str, name: str, **settings: object) -> None:
    config = {
        "name": name,
        "subjects": [f"{name.lower()}.>"],
        "storage": StorageType.FILE,
        "retention": RetentionPolicy.WORK_QUEUE,
        **settings,
    }
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().add_stream(StreamConfig(**config))  # type: ignore[arg-type]
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"max_age": 60.0}, "max_age"),
        ({"max_msgs": 1000}, "max_msgs"),
        ({"max_bytes": 1_000_000}, "max_bytes"),
        ({"max_msgs_per_subject": 10}, "max_msgs_per_subject"),
        ({"retention": RetentionPolicy.LIMITS}, "retention"),
        ({"retention": RetentionPolicy.INTEREST}, "retention"),
        ({"allow_rollup_hdrs": True}, "allow_rollup_hdrs"),
    ],
)
async def test_an_existing_nats_stream_that_can_discard_jobs_is_refused_at_start_up(
    nats_url: str, nats_stream: str, settings: dict[str, object], named: str
) -> None:
    """A stream made earlier (by an operator, an older deploy) whose limits or retention could
    drop a job jobfence accepted: the adapter refuses to open it, naming the stream and the
    setting, before anything is published."""
    await _make_stream(nats_url, nats_stream, **settings)
    queue = NatsQueue(nats_url, stream=nats_stream, subject_prefix=nats_stream.lower())
    try:
        with pytest.raises(ConfigError) as refused:
            await queue.publish(message("a", queue=Q))
    finally:
        await queue.close()
    text = str(refused.value)
    assert nats_stream in text
    assert named in text
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().stream_info(nats_stream)
    finally:
        await nc.close()
    assert info.state.messages == 0  # nothing was published into it


async def test_an_existing_nats_stream_with_a_discard_new_limit_is_accepted(
    nats_url: str, nats_stream: str
) -> None:
    """A limit that refuses new messages (discard new) drops nothing: a publish over it fails
    and the job stays in the outbox. Such a stream is used."""
    await _make_stream(nats_url, nats_stream, max_msgs=1000, discard=DiscardPolicy.NEW)
    queue = NatsQueue(nats_url, stream=nats_stream, subject_prefix=nats_stream.lower())
    try:
        await queue.publish(message("a", queue=Q))
        (got,) = await queue.receive([Q], max_messages=5, lease_seconds=5)
        assert got.message.job_id == "a"
        assert await queue.ack(got)
    finally:
        await queue.close()


async def test_a_nats_stream_edited_to_discard_jobs_while_workers_run_is_logged(
    nats_url: str, nats_stream: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A running adapter hears JetStream's advisory when its stream is edited, and logs an
    ERROR naming the setting that can now drop jobs."""
    queue = NatsQueue(nats_url, stream=nats_stream, subject_prefix=nats_stream.lower())
    try:
        await queue.publish(message("a", queue=Q))
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            config = (await js.stream_info(nats_stream)).config
            config.max_age = 3600.0
            await js.update_stream(config)
        finally:
            await nc.close()

        async def logged() -> bool:
            return any(
                r.levelno == logging.ERROR and "max_age" in r.getMessage() for r in caplog.records
            )

        await wait_until(logged, timeout=10, message="the ERROR about max_age")
    finally:
        await queue.close()


# -- RabbitMQ -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [
        {"x-queue-type": "quorum", "x-message-ttl": 1000},
        {"x-queue-type": "quorum", "x-max-length": 10, "x-overflow": "drop-head"},
        {"x-queue-type": "quorum", "x-delivery-limit": 3},
        {"x-queue-type": "classic"},
    ],
)
async def test_an_existing_rabbitmq_queue_declared_with_other_arguments_is_refused(
    amqp_url: str, arguments: dict[str, object]
) -> None:
    """RabbitMQ refuses jobfence's declaration of a queue that exists with other arguments
    (inequivalent arg): nothing is published into it, and the error names the argument and
    the queue."""
    prefix = f"jfret{uuid.uuid4().hex[:12]}"
    name = f"{prefix}.{Q}"
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True, arguments=arguments)
        queue = RabbitMQQueue(amqp_url, prefix=prefix)
        try:
            with pytest.raises(ChannelPreconditionFailed) as publishing:
                await queue.publish(message("a", queue=Q))
            with pytest.raises(ChannelPreconditionFailed):
                await queue.receive([Q], max_messages=1, lease_seconds=5)
        finally:
            await queue.close()
        assert "inequivalent arg" in str(publishing.value)
        assert name in str(publishing.value)
        channel = await connection.channel()
        declared = await channel.declare_queue(name, passive=True)
        assert declared.declaration_result.message_count == 0
    finally:
        channel = await connection.channel()
        await channel.queue_delete(name)
        await connection.close()


# -- Redis Streams --------------------------------------------------------------------------


@pytest.fixture
async def redis_prefix(redis_url: str) -> AsyncIterator[str]:
    prefix = f"jfret{uuid.uuid4().hex[:12]}"
    yield prefix
    admin = aioredis.Redis.from_url(redis_url)
    keys = [key async for key in admin.scan_iter(match=f"{prefix}:*")]
    if keys:
        await admin.delete(*keys)
    await admin.aclose()


def _stream(prefix: str) -> str:
    return f"{prefix}:{{{Q}}}:stream"


@pytest.mark.parametrize("settle", ["retry", "release"])
async def test_a_redis_entry_trimmed_while_held_is_published_again_by_its_retry_or_release(
    redis_url: str, redis_prefix: str, settle: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another client trims the stream (XTRIM MAXLEN 0) while a worker holds an entry: the
    worker's retry (or release) publishes the job again from its own copy, with its
    deliveries so far, and says so, the job's id as its stand-in (this one has an escape
    sequence in it); the job is not lost."""
    queue = RedisStreamsQueue(redis_url, prefix=redis_prefix)
    admin = aioredis.Redis.from_url(redis_url)
    job_id = "held\x1b[2J"
    try:
        await queue.publish(message(job_id, queue=Q))
        (held,) = await queue.receive([Q], max_messages=5, lease_seconds=30)
        assert await admin.xtrim(_stream(redis_prefix), maxlen=0, approximate=False) == 1
        if settle == "retry":
            assert await queue.retry(held, delay_seconds=0, error="transient")
        else:
            await queue.release(held)
        got = await queue.receive([Q], max_messages=5, lease_seconds=30)
        assert [d.message.job_id for d in got] == [job_id], "job lost: held"
        assert got[0].attempt == (2 if settle == "retry" else 1)
        [line] = [
            r.getMessage()
            for r in caplog.records
            if "deleted from its stream" in r.getMessage() and r.levelno == logging.WARNING
        ]
        assert "[8 bytes, sha256 " in line, line  # its stand-in (the formatter escapes it)
    finally:
        await queue.close()
        await admin.aclose()


async def test_a_redis_entry_trimmed_while_held_is_published_again_by_its_extension(
    redis_url: str, redis_prefix: str
) -> None:
    """An extension of an entry trimmed meanwhile publishes the job again from the holder's
    copy (an XCLAIM of a deleted entry would drop it from the pending list, and the holder's
    retry would then be refused as stale): the extension says the lease is no longer held,
    and the job is delivered again."""
    queue = RedisStreamsQueue(redis_url, prefix=redis_prefix)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        await queue.publish(message("held", queue=Q))
        (held,) = await queue.receive([Q], max_messages=5, lease_seconds=30)
        await admin.xtrim(_stream(redis_prefix), maxlen=0, approximate=False)
        assert not await queue.extend(held, lease_seconds=30)
        assert not await queue.retry(held, delay_seconds=0, error="transient")
        got = await queue.receive([Q], max_messages=5, lease_seconds=30)
        assert [d.message.job_id for d in got] == ["held"], "job lost: held"
    finally:
        await queue.close()
        await admin.aclose()


async def test_a_redis_entry_trimmed_after_its_holder_died_is_logged_as_lost(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The holder died; the entry was trimmed meanwhile. The next worker's claim finds the
    pending id without an entry (Redis drops it from the pending list): an ERROR names the
    queue and the entry id, instead of nothing."""
    dead = RedisStreamsQueue(redis_url, prefix=redis_prefix)
    queue = RedisStreamsQueue(redis_url, prefix=redis_prefix)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        await dead.publish(message("orphan", queue=Q))
        (held,) = await dead.receive([Q], max_messages=5, lease_seconds=0.2)
        entry_id = held.receipt.entry_id  # type: ignore[attr-defined]
        await admin.xtrim(_stream(redis_prefix), maxlen=0, approximate=False)

        async def claimed() -> bool:
            await queue.receive([Q], max_messages=5, lease_seconds=0.2)
            pending = await admin.xpending(_stream(redis_prefix), GROUP)
            return int(pending["pending"]) == 0

        await wait_until(claimed, timeout=10, message="the pending id claimed")
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any(entry_id in text and Q in text for text in errors), errors
    finally:
        await dead.close()
        await queue.close()
        await admin.aclose()


@pytest.mark.parametrize("how", ["setid", "recreated"])
async def test_redis_entries_stranded_behind_the_group_are_delivered(
    redis_url: str, redis_prefix: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The group's last-delivered id moved past entries nobody received (XGROUP SETID ... $,
    or the group deleted and created again at $ by another client): those entries would never
    be read again. The adapter finds them (at most 5 s later), delivers them, and says so."""
    queue = RedisStreamsQueue(redis_url, prefix=redis_prefix)
    admin = aioredis.Redis.from_url(redis_url)
    stream = _stream(redis_prefix)
    try:
        await queue.publish(message("first", queue=Q))
        (first,) = await queue.receive([Q], max_messages=5, lease_seconds=60)
        assert await queue.ack(first)
        for n in range(3):
            await queue.publish(message(f"stranded-{n}", queue=Q))
        if how == "setid":
            await admin.xgroup_setid(stream, GROUP, "$")
        else:
            await admin.xgroup_destroy(stream, GROUP)
            await admin.xgroup_create(stream, GROUP, "$")
        seen: list[str] = []

        async def delivered() -> bool:
            for delivery in await queue.receive([Q], max_messages=10, lease_seconds=60):
                seen.append(delivery.message.job_id)
                assert delivery.attempt == 1
                assert await queue.ack(delivery)
            return len(seen) >= 3

        await wait_until(delivered, timeout=15, message="the stranded entries")
        assert sorted(seen) == ["stranded-0", "stranded-1", "stranded-2"]
        assert await admin.xlen(stream) == 0
        assert any("stranded" in r.getMessage() for r in caplog.records)
    finally:
        await queue.close()
        await admin.aclose()


async def test_redis_entries_trimmed_before_delivery_are_logged_as_lost(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another producer's XADD ... MAXLEN (or an XTRIM) deletes entries nobody received yet:
    the adapter cannot get them back, and logs an ERROR with how many were lost (at most 5 s
    later), once."""
    queue = RedisStreamsQueue(redis_url, prefix=redis_prefix)
    admin = aioredis.Redis.from_url(redis_url)
    stream = _stream(redis_prefix)
    try:
        await queue.publish(message("first", queue=Q))
        (first,) = await queue.receive([Q], max_messages=5, lease_seconds=60)
        assert await queue.ack(first)
        for n in range(5):
            await queue.publish(message(f"j{n}", queue=Q))
        await admin.xadd(stream, {"x": "y"}, maxlen=2, approximate=False)
        seen: list[str] = []

        def lost_lines() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.levelno == logging.ERROR and "never delivered" in r.getMessage()
            ]

        async def reported() -> bool:
            for delivery in await queue.receive([Q], max_messages=10, lease_seconds=60):
                seen.append(delivery.message.job_id)
                await queue.ack(delivery)
            return bool(lost_lines())

        await wait_until(reported, timeout=15, message="the ERROR about lost entries")
        (line,) = lost_lines()
        assert line.startswith("4 entries of queue retention "), line
        for _ in range(3):  # once: later checks do not report the same loss again
            await queue.receive([Q], max_messages=10, lease_seconds=60)
        assert len(lost_lines()) == 1
        assert "j4" in seen
    finally:
        await queue.close()
        await admin.aclose()
