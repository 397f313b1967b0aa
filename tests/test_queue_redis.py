"""RedisStreamsQueue: the queue contract on the real Redis, and what only a broker shows."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis.asyncio as aioredis

from jobfence import QueueCapabilities, QueueUnavailable
from jobfence.adapters import redis_streams
from jobfence.adapters.redis_streams import RedisStreamsQueue
from jobfence.model import Delivery, Outgoing
from queue_conformance import QUEUE, BrokerConformance, QueueEnv, job_ids, message
from support import wait_until
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


@dataclass
class Prefixed:
    """A queue under a prefix of its own, and a plain client to do what no adapter does."""

    prefix: str
    queue: RedisStreamsQueue
    admin: aioredis.Redis


@pytest.fixture
async def prefixed(redis_url: str) -> AsyncIterator[Prefixed]:
    prefix = f"jftest-{uuid.uuid4().hex[:12]}"
    admin = aioredis.Redis.from_url(redis_url)
    queue = RedisStreamsQueue(redis_url, prefix=prefix)
    yield Prefixed(prefix, queue, admin)
    await queue.close()
    keys = [key async for key in admin.scan_iter(match=f"{prefix}:*")]
    if keys:
        await admin.delete(*keys)
    await admin.aclose()


async def _receive_all(queue: RedisStreamsQueue, queues: list[str], count: int) -> list[str]:
    got: list[str] = []
    for _ in range(50):
        got += job_ids(await queue.receive(queues, max_messages=500, lease_seconds=60))
        if len(got) >= count:
            break
    return got


@pytest.mark.parametrize("when", ["before its group exists", "after its group was made"])
async def test_publish_many_with_a_stream_key_of_another_type_publishes_the_others(
    prefixed: Prefixed, when: str
) -> None:
    """A key someone made a string where a queue's stream goes is that queue's messages'
    error alone: the messages for the other queues are confirmed and delivered."""
    queue, broken = prefixed.queue, f"{prefixed.prefix}:{{broken}}:stream"
    outgoing = [
        Outgoing(message(f"m{n}", queue="broken" if n % 3 == 1 else QUEUE)) for n in range(6)
    ]
    if when == "after its group was made":
        assert await queue.publish_many(outgoing) == [None] * 6
        await _receive_all(queue, [QUEUE, "broken"], 6)
    await prefixed.admin.delete(broken)
    await prefixed.admin.set(broken, "not a stream")

    results = await queue.publish_many(outgoing)

    assert [r is None for r in results] == [True, False, True, True, False, True]
    assert all("WRONGTYPE" in str(r) for r in results if r is not None), results
    assert await _receive_all(queue, [QUEUE], 4) == ["m0", "m2", "m3", "m5"]


async def test_publish_many_after_redis_lost_its_scripts_publishes_every_message_once(
    prefixed: Prefixed,
) -> None:
    """A Redis that restarted forgets its scripts: the next publish_many loads its script
    again and publishes each message once, none twice."""
    queue = prefixed.queue
    assert await queue.publish_many([Outgoing(message("first"))]) == [None]
    await prefixed.admin.script_flush()
    outgoing = [Outgoing(message(f"after-{n}")) for n in range(3)]
    assert await queue.publish_many(outgoing) == [None] * 3
    assert await _receive_all(queue, [QUEUE], 4) == ["first", "after-0", "after-1", "after-2"]
    assert await prefixed.admin.xlen(f"{prefixed.prefix}:{{{QUEUE}}}:stream") == 4


async def test_publish_many_carries_every_byte_of_bodies_and_ids_the_packing_uses_itself(
    prefixed: Prefixed,
) -> None:
    """The script call's one argument is a string of ``<length>:<bytes>`` tokens: bodies and
    ids holding colons, digits, NUL bytes, bytes that are not UTF-8 and characters of several
    bytes arrive as they were sent, an empty body included."""
    bodies = [b"", b"12:34:", b"\x00\xff\xfe:0:", "\u00e9\u6f22:\U0001f600".encode(), b"9" * 5000]
    outgoing = [
        Outgoing(
            message(
                f"{n}:\u00e9\u6f22:{n}",
                body=body,
                tenant_id="t:\u00e9" if n % 2 else None,
                correlation_id=f"5:{n}" if n % 2 == 0 else None,
            ),
            n,
        )
        for n, body in enumerate(bodies)
    ]
    assert await prefixed.queue.publish_many(outgoing) == [None] * len(bodies)
    got = await prefixed.queue.receive([QUEUE], max_messages=10, lease_seconds=60)
    assert [d.message for d in got] == [o.message for o in outgoing]
    assert [d.attempt for d in got] == [n + 1 for n in range(len(bodies))]


async def test_publish_many_of_more_messages_than_one_script_call_keeps_their_order(
    prefixed: Prefixed,
) -> None:
    """Messages for one stream go in script calls of at most 200 each, in one round trip:
    450 messages arrive once each, in the order given."""
    outgoing = [Outgoing(message(f"n{n:03d}"), n % 4) for n in range(450)]
    assert await prefixed.queue.publish_many(outgoing) == [None] * 450
    got = await prefixed.queue.receive([QUEUE], max_messages=500, lease_seconds=60)
    assert job_ids(got) == [f"n{n:03d}" for n in range(450)]
    assert [d.attempt for d in got] == [n % 4 + 1 for n in range(450)]


async def test_entries_a_read_took_when_its_reply_was_lost_come_back_within_seconds(
    prefixed: Prefixed, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read whose reply the network lost has made its entries pending to this consumer, and
    nobody holds them: before, they waited out the lease (300 s by default). A later read takes
    them back once they are idle for a few seconds, counted as a lease's end counts them, and
    leaves alone the entries this instance's deliveries hold."""
    monkeypatch.setattr(redis_streams, "_TAKE_BACK_EVERY_SECONDS", 0.2)
    monkeypatch.setattr(redis_streams, "_TAKE_BACK_IDLE_MS", 1000)
    parts = urlsplit(redis_url)
    stream = f"{prefixed.prefix}:{{{QUEUE}}}:stream"
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379) as proxy:
        queue = RedisStreamsQueue(
            urlunsplit(parts._replace(netloc=f"127.0.0.1:{proxy.port}")), prefix=prefixed.prefix
        )
        # Each reply is held back long enough to be cut (on the connections opened from now).
        proxy.reply_delay = 0.3
        try:
            for n in range(2):
                await prefixed.queue.publish(message(f"held-{n}"))
            held = await queue.receive([QUEUE], max_messages=10, lease_seconds=300.0)
            assert sorted(job_ids(held)) == ["held-0", "held-1"]
            expected = {f"lost-{n}" for n in range(5)}
            for job_id in sorted(expected):
                await prefixed.queue.publish(message(job_id))
            fetch = asyncio.create_task(
                queue.receive([QUEUE], max_messages=10, lease_seconds=300.0)
            )

            async def pending() -> bool:
                summary = await prefixed.admin.xpending(stream, "jobfence")
                return bool(summary["pending"] == 2 + len(expected))

            await wait_until(pending, message="the read to take the entries on the server")
            await proxy.cut()
            proxy.reply_delay = 0.0
            proxy.up()
            with pytest.raises(QueueUnavailable):
                await fetch  # the read failed; Redis made its entries pending all the same
            loop = asyncio.get_running_loop()
            cut_at = loop.time()
            again: list[Delivery] = []

            async def back() -> bool:
                again.extend(await queue.receive([QUEUE], max_messages=10, lease_seconds=300.0))
                return len(again) >= len(expected)

            await wait_until(back, timeout=10, message="the lost entries to come back")
            took = loop.time() - cut_at
            assert sorted(job_ids(again)) == sorted(expected)
            assert {d.attempt for d in again} == {2}
            for delivery in [*held, *again]:
                assert await queue.ack(delivery)
            assert await queue.receive([QUEUE], max_messages=10, lease_seconds=300.0) == []
        finally:
            await queue.close()
    print(f"\nlost entries back {took:.2f}s after the cut")
    assert took < 5


async def test_an_ack_whose_reply_was_lost_is_never_reported_as_a_lost_lease(
    prefixed: Prefixed, redis_url: str
) -> None:
    """The ack script ran and its reply was lost. Reported as "the lease was lost" (False) -
    as a second run of the script would find the entry gone, were the client to send it again
    on a new connection - the harness would withdraw the retry it had just written to the
    outbox for a failed job, and that job would vanish. The outcome is unknown, and the adapter
    says so (QueueUnavailable), so the retry stays."""
    parts = urlsplit(redis_url)
    stream = f"{prefixed.prefix}:{{{QUEUE}}}:stream"
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 6379) as proxy:
        proxy.reply_delay = 0.3  # on the connections opened from now: long enough to be cut
        queue = RedisStreamsQueue(
            urlunsplit(parts._replace(netloc=f"127.0.0.1:{proxy.port}")), prefix=prefixed.prefix
        )
        try:
            await prefixed.queue.publish(message("acked-once"))
            (delivery,) = await queue.receive([QUEUE], max_messages=1, lease_seconds=300.0)
            acking = asyncio.create_task(queue.ack(delivery))

            async def applied() -> bool:
                return int(await prefixed.admin.xlen(stream)) == 0

            await wait_until(applied, message="the ack to run on the server")
            await proxy.cut()
            proxy.reply_delay = 0.0
            proxy.up()
            with pytest.raises(QueueUnavailable):
                await acking
        finally:
            await queue.close()


async def test_an_entry_published_without_prior_keeps_its_deliveries_when_released_or_retried(
    prefixed: Prefixed,
) -> None:
    """An entry another producer wrote with no ``prior`` field, delivered three times (two
    leases ran out): the copy a release makes (the worker's give-back at shutdown) is its
    fourth delivery still to come, attempt 3, and a retry's copy counts on from there. The
    copy used to carry no count at all (attempt 1 again), so a job that kept killing workers
    never reached its delivery limit."""
    queue = prefixed.queue
    stream = f"{prefixed.prefix}:{{{QUEUE}}}:stream"
    assert await queue.receive([QUEUE], max_messages=1, lease_seconds=60) == []  # the group
    await prefixed.admin.xadd(
        stream, {"consumer": "award_points", "job_id": "no-prior", "body": b"{}"}
    )
    attempts: list[int] = []
    held: list[Delivery] = []

    async def delivered_again() -> bool:
        held[:] = await queue.receive([QUEUE], max_messages=1, lease_seconds=0.2)
        attempts.extend(d.attempt for d in held)
        return bool(held)

    for _ in range(3):  # the first delivery, then two whose lease ran out
        await wait_until(delivered_again, timeout=5, message="the entry to be delivered")
    assert attempts == [1, 2, 3]

    await queue.release(held[0])
    (released,) = await queue.receive([QUEUE], max_messages=1, lease_seconds=60)
    assert released.attempt == 3  # a release does not count
    assert await queue.retry(released, delay_seconds=0, error="failed")
    (retried,) = await queue.receive([QUEUE], max_messages=1, lease_seconds=60)
    assert retried.attempt == 4
    assert await queue.ack(retried)
