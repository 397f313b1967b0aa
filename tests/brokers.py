"""Open a broker queue adapter by broker name, and delete what a test created on the broker."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest

from jobfence import QueuePort

BROKERS = ("redis", "nats", "rabbitmq")


def broker_url(request: pytest.FixtureRequest, broker: str) -> str:
    """The URL of ``broker`` from its session fixture (skipped locally, failed under CI, when
    the broker does not answer)."""
    url: str = request.getfixturevalue({"rabbitmq": "amqp_url"}.get(broker, f"{broker}_url"))
    return url


@contextlib.asynccontextmanager
async def on_broker(
    request: pytest.FixtureRequest, queues: Sequence[str], *, prefix: str = "jftest"
) -> AsyncIterator[tuple[str, str, str]]:
    """For a fixture parametrised by broker name: (broker, URL, fresh name for its keys,
    stream or queues); on exit, deletes what the test created under that name for ``queues``."""
    broker: str = request.param
    url = broker_url(request, broker)
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    try:
        yield broker, url, name
    finally:
        await delete_everything(broker, url, name, queues)


def make_queue(broker: str, url: str, name: str) -> QueuePort:
    """An adapter on ``broker`` whose keys, stream or queues are all named after ``name``
    (lower-case letters and digits)."""
    if broker == "redis":
        from jobfence.adapters.redis_streams import RedisStreamsQueue

        return RedisStreamsQueue(url, prefix=name)
    if broker == "nats":
        from jobfence.adapters.nats import NatsQueue

        return NatsQueue(url, stream=name.upper(), subject_prefix=name)
    if broker == "rabbitmq":
        from jobfence.adapters.rabbitmq import RabbitMQQueue

        return RabbitMQQueue(url, prefix=name)
    raise ValueError(f"unknown broker {broker!r}")


async def delete_everything(broker: str, url: str, name: str, queues: Sequence[str]) -> None:
    """Delete the keys, stream or queues named after ``name``."""
    if broker == "redis":
        import redis.asyncio as aioredis

        admin = aioredis.Redis.from_url(url)
        keys = [key async for key in admin.scan_iter(match=f"{name}:*")]
        if keys:
            await admin.delete(*keys)
        await admin.aclose()
    elif broker == "nats":
        import nats
        from nats.js.errors import NotFoundError

        nc = await nats.connect(url)
        with contextlib.suppress(NotFoundError):  # nothing was published
            await nc.jetstream().delete_stream(name.upper())
        await nc.close()
    else:
        import aio_pika

        connection = await aio_pika.connect(url)
        for queue in queues:
            channel = await connection.channel()
            await channel.queue_delete(f"{name}.{queue}")
            await channel.close()
        await connection.close()


@contextlib.contextmanager
def rabbitmq_max_message_size(max_bytes: int) -> Iterator[None]:
    """The local RabbitMQ's ``max_message_size`` set to ``max_bytes`` for the block (a broker
    setting: the test is marked serial, and runs alone), then put back."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.skip(
            "sets the broker's max_message_size for every test: runs alone (pytest -m serial)"
        )
    rabbitmqctl = shutil.which("rabbitmqctl")
    if rabbitmqctl is None:
        pytest.skip("rabbitmqctl is not installed")

    def evaluate(expression: str) -> str:
        done = subprocess.run(
            [rabbitmqctl, "-q", "eval", expression],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout.strip()

    before = evaluate("application:get_env(rabbit, max_message_size).")
    found = re.fullmatch(r"\{ok,(\d+)\}", before.replace(" ", ""))
    assert found is not None, before
    evaluate(f"application:set_env(rabbit, max_message_size, {max_bytes}).")
    try:
        yield
    finally:
        evaluate(f"application:set_env(rabbit, max_message_size, {found.group(1)}).")
