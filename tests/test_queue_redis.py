"""RedisStreamsQueue: the queue contract on the real Redis, and what only a broker shows."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis.asyncio as aioredis

from jobfence import QueueCapabilities
from jobfence.adapters.redis_streams import RedisStreamsQueue
from queue_conformance import QUEUE, BrokerConformance, QueueEnv, message
from tcp_proxy import TcpProxy


class TestRedisStreamsConformance(BrokerConformance):
    expected_capabilities = QueueCapabilities(
        transactional=False, delayed_publish=False, delayed_retry=False
    )

    @pytest.fixture
    async def env(self, redis_url: str) -> AsyncIterator[QueueEnv]:
        prefix = f"jftest-{uuid.uuid4().hex[:12]}"
        opened: list[RedisStreamsQueue] = []

        async def open_queue() -> RedisStreamsQueue:
            queue = RedisStreamsQueue(redis_url, prefix=prefix)
            opened.append(queue)
            return queue

        parts = urlsplit(redis_url)
        async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379) as proxy:
            # The queue under test reaches Redis through a proxy that can cut it off.
            dropped = RedisStreamsQueue(
                urlunsplit(parts._replace(netloc=f"127.0.0.1:{proxy.port}")), prefix=prefix
            )
            opened.append(dropped)
            yield QueueEnv(queue=dropped, open_queue=open_queue, drop_connection=proxy.cut)
        for queue in opened:
            await queue.close()
        admin = aioredis.Redis.from_url(redis_url)
        keys = [key async for key in admin.scan_iter(match=f"{prefix}:*")]
        if keys:
            await admin.delete(*keys)
        await admin.aclose()


async def test_a_closed_instance_leaves_the_consumer_group_only_when_it_holds_nothing(
    redis_url: str,
) -> None:
    prefix = f"jftest-{uuid.uuid4().hex[:12]}"
    admin = aioredis.Redis.from_url(redis_url)
    stream = f"{prefix}:{{{QUEUE}}}:stream"
    try:
        idle = RedisStreamsQueue(redis_url, prefix=prefix, consumer_name="idle")
        holder = RedisStreamsQueue(redis_url, prefix=prefix, consumer_name="holder")
        await idle.publish(message("held"))
        (given_back,) = await idle.receive([QUEUE], max_messages=1, lease_seconds=60)
        await idle.release(given_back)
        assert len(await holder.receive([QUEUE], max_messages=1, lease_seconds=60)) == 1
        await idle.close()
        await holder.close()

        consumers = await admin.xinfo_consumers(stream, "jobfence")
        assert [(c["name"], c["pending"]) for c in consumers] == [(b"holder", 1)]
    finally:
        keys = [key async for key in admin.scan_iter(match=f"{prefix}:*")]
        if keys:
            await admin.delete(*keys)
        await admin.aclose()
