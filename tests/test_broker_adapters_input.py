"""Broker adapters: bad names are refused with a clear message before anything is sent, and a
missing client library names the extra to install; ``import jobfence`` loads no broker client."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from brokers import delete_everything
from jobfence import ConfigError, Message


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("module", "client", "extra"),
    [
        ("jobfence.adapters.redis_streams", "redis", "redis"),
        ("jobfence.adapters.nats", "nats", "nats"),
        ("jobfence.adapters.rabbitmq", "aio_pika", "rabbitmq"),
    ],
)
def test_an_adapter_without_its_client_names_the_extra_to_install(
    module: str, client: str, extra: str
) -> None:
    result = run_python(f"import sys; sys.modules[{client!r}] = None; import {module}")
    assert result.returncode == 1
    assert f"pip install 'jobfence[{extra}]'" in result.stderr


def test_import_jobfence_loads_no_broker_client() -> None:
    result = run_python(
        "import sys, jobfence; "
        "print(sorted(m for m in ('redis', 'nats', 'aio_pika') if m in sys.modules))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


async def test_redis_refuses_braces_in_a_prefix_or_queue_name(redis_url: str) -> None:
    from jobfence.adapters.redis_streams import RedisStreamsQueue

    with pytest.raises(ConfigError, match=r"prefix must be non-empty and without braces"):
        RedisStreamsQueue(redis_url, prefix="app{1}")
    name = f"jftest{uuid.uuid4().hex[:12]}"
    queue = RedisStreamsQueue(redis_url, prefix=name)
    try:
        await queue.publish(Message(queue="ok", consumer="c", job_id="kept", body=b"{}"))
        with pytest.raises(ConfigError, match=r"a queue name must not contain braces, got 'a\{b'"):
            await queue.publish(Message(queue="a{b", consumer="c", job_id="j", body=b"{}"))
        assert (await queue.size(["ok"])).total == 1, "the earlier message is still there"
    finally:
        await queue.close()
        await delete_everything("redis", redis_url, name, [])


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan"), float("inf")])
def test_nats_refuses_a_stream_wait_that_is_not_a_finite_positive_time(seconds: float) -> None:
    from jobfence.adapters.nats import NatsQueue

    with pytest.raises(ConfigError, match=r"stream_wait_seconds must be a finite number above 0"):
        NatsQueue("nats://127.0.0.1:4222", stream_wait_seconds=seconds)


async def test_nats_refuses_a_queue_name_that_is_not_a_subject(nats_url: str) -> None:
    from jobfence.adapters.nats import NatsQueue

    with pytest.raises(ConfigError, match=r"stream must be letters, digits, _ or -, got 'A.B'"):
        NatsQueue(nats_url, stream="A.B")
    name = f"jftest{uuid.uuid4().hex[:12]}"
    queue = NatsQueue(nats_url, stream=name.upper(), subject_prefix=name)
    try:
        await queue.publish(Message(queue="ok", consumer="c", job_id="kept", body=b"{}"))
        with pytest.raises(ConfigError, match=r"a NATS queue name is dot-separated .*'a b'"):
            await queue.publish(Message(queue="a b", consumer="c", job_id="j", body=b"{}"))
        with pytest.raises(ConfigError, match=r"NatsQueue has no delayed publish"):
            await queue.publish(
                Message(queue="ok", consumer="c", job_id="later", body=b"{}"), delay_seconds=5
            )
        assert (await queue.size(["ok"])).total == 1, "the earlier message is still there"
    finally:
        await queue.close()
        await delete_everything("nats", nats_url, name, [])


async def test_rabbitmq_refuses_a_queue_name_it_cannot_declare(amqp_url: str) -> None:
    from jobfence.adapters.rabbitmq import RabbitMQQueue

    with pytest.raises(ConfigError, match=r"prefix must be letters, digits, _ \. - or :"):
        RabbitMQQueue(amqp_url, prefix="my app")
    name = f"jftest{uuid.uuid4().hex[:12]}"
    queue = RabbitMQQueue(amqp_url, prefix=name)
    try:
        await queue.publish(Message(queue="ok", consumer="c", job_id="kept", body=b"{}"))
        with pytest.raises(ConfigError, match=r"a RabbitMQ queue name is .*'a b'"):
            await queue.publish(Message(queue="a b", consumer="c", job_id="j", body=b"{}"))
        assert (await queue.size(["ok"])).total == 1, "the earlier message is still there"
    finally:
        await queue.close()
        await delete_everything("rabbitmq", amqp_url, name, ["ok"])


def test_rabbitmq_refuses_a_prefetch_out_of_range(amqp_url: str) -> None:
    from jobfence.adapters.rabbitmq import RabbitMQQueue

    for bad in (0, -5, 65536):
        with pytest.raises(ConfigError, match=rf"prefetch must be from 1 to 65535 .*got {bad}"):
            RabbitMQQueue(amqp_url, prefetch=bad)
    assert RabbitMQQueue(amqp_url, prefetch=65535) is not None
