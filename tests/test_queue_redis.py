"""RedisStreamsQueue: the queue contract on the real Redis, and what only a broker shows."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from jobfence import QueueCapabilities
from jobfence.adapters.redis_streams import RedisStreamsQueue
from queue_conformance import BrokerConformance, QueueEnv


class TestRedisStreamsConformance(BrokerConformance):
    expected_capabilities = QueueCapabilities(transactional=False, delayed_publish=True)

    @pytest.fixture
    async def env(self, redis_url: str) -> AsyncIterator[QueueEnv]:
        prefix = f"jftest-{uuid.uuid4().hex[:12]}"
        opened: list[RedisStreamsQueue] = []

        async def open_queue() -> RedisStreamsQueue:
            queue = RedisStreamsQueue(redis_url, prefix=prefix)
            opened.append(queue)
            return queue

        async def drop_connection(queue: object) -> None:
            assert isinstance(queue, RedisStreamsQueue)
            await queue._redis.connection_pool.disconnect()  # abrupt: no ack, no goodbye

        yield QueueEnv(
            queue=await open_queue(), open_queue=open_queue, drop_connection=drop_connection
        )
        for queue in opened:
            await queue.close()
        admin = aioredis.Redis.from_url(redis_url)
        keys = [key async for key in admin.scan_iter(match=f"{prefix}:*")]
        if keys:
            await admin.delete(*keys)
        await admin.aclose()
