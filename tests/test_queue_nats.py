"""NatsQueue: the queue contract on the real NATS JetStream, and what only a broker shows."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import nats
import pytest
from nats.js.errors import NotFoundError

from jobfence import QueueCapabilities
from jobfence.adapters.nats import NatsQueue
from queue_conformance import BrokerConformance, QueueEnv
from support import TcpProxy


class TestNatsConformance(BrokerConformance):
    expected_capabilities = QueueCapabilities(
        transactional=False, delayed_publish=False, exact_stale_ack=False
    )

    @pytest.fixture
    async def env(self, nats_url: str) -> AsyncIterator[QueueEnv]:
        name = f"JFTEST_{uuid.uuid4().hex[:12]}"
        opened: list[NatsQueue] = []

        async def open_queue() -> NatsQueue:
            queue = NatsQueue(nats_url, stream=name, subject_prefix=name.lower())
            opened.append(queue)
            return queue

        parts = urlsplit(nats_url)
        async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 4222) as proxy:
            # The queue under test reaches NATS through a proxy that can cut it off.
            dropped = NatsQueue(
                f"nats://127.0.0.1:{proxy.port}", stream=name, subject_prefix=name.lower()
            )
            opened.append(dropped)
            yield QueueEnv(
                queue=dropped, open_queue=open_queue, drop_connection=proxy.cut, lease_seconds=2.0
            )
        for queue in opened:
            await queue.close()
        nc = await nats.connect(nats_url)
        with contextlib.suppress(NotFoundError):  # a test that never connected made none
            await nc.jetstream().delete_stream(name)
        await nc.close()
