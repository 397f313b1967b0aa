"""RabbitMQQueue: the queue contract on the real RabbitMQ, and what only a broker shows."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import pytest

from brokers import rabbitmq_max_message_size
from jobfence import PublishRefused, QueueCapabilities, QueueUnavailable
from jobfence.adapters.rabbitmq import RabbitMQQueue
from jobfence.model import Delivery, Outgoing
from jobfence.ports import QueueSize
from queue_conformance import QUEUE, BrokerConformance, QueueEnv, job_ids, message
from support import wait_until
from tcp_proxy import TcpProxy


class TestRabbitMQConformance(BrokerConformance):
    expected_capabilities = QueueCapabilities(
        transactional=False,
        delayed_publish=False,
        delayed_retry=False,
        exact_stale_ack=False,
        exact_size=False,
        lists_queues=False,
    )

    @pytest.fixture
    async def env(self, amqp_url: str) -> AsyncIterator[QueueEnv]:
        prefix = f"jftest.{uuid.uuid4().hex[:12]}"
        opened: list[RabbitMQQueue] = []

        async def open_queue() -> RabbitMQQueue:
            queue = RabbitMQQueue(amqp_url, prefix=prefix)
            opened.append(queue)
            return queue

        parts = urlsplit(amqp_url)
        async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672) as proxy:
            # The queue under test reaches RabbitMQ through a proxy that can cut it off.
            credentials = parts.netloc.rpartition("@")[0]
            dropped = RabbitMQQueue(
                urlunsplit(parts._replace(netloc=f"{credentials}@127.0.0.1:{proxy.port}")),
                prefix=prefix,
            )
            opened.append(dropped)
            yield QueueEnv(queue=dropped, open_queue=open_queue, drop_connection=proxy.cut)
        for queue in opened:
            await queue.close()
        await delete_queues(amqp_url, prefix)


async def delete_queues(amqp_url: str, prefix: str) -> None:
    """Delete the queues a test declared."""
    connection = await aio_pika.connect(amqp_url)
    try:
        for queue in ("conformance.main", "conformance.other", "conformance.nobody"):
            channel = await connection.channel()
            await channel.queue_delete(f"{prefix}.{queue}")
            await channel.close()
    finally:
        await connection.close()


async def test_a_retry_whose_copy_cannot_be_published_gives_the_original_back(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publishing the copy fails (the broker went away for that call): the retry fails loudly,
    and the original is back in the queue at once, counted, not stuck unacked on the channel
    for its 60 s lease."""
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    queue = RabbitMQQueue(amqp_url, prefix=prefix)
    try:
        await queue.publish(message("copy-refused"))
        (first,) = await queue.receive([QUEUE], max_messages=1, lease_seconds=60)

        async def refused(*args: object, **kwargs: object) -> None:
            raise ConnectionError("the broker refused the copy")

        monkeypatch.setattr(queue, "_publish_one", refused)
        with pytest.raises(QueueUnavailable, match="refused the copy") as raised:
            await queue.retry(first, delay_seconds=0.0, error="Flaky: again")
        assert isinstance(raised.value.__cause__, ConnectionError)
        monkeypatch.undo()

        again = await queue.receive([QUEUE], max_messages=1, lease_seconds=60, wait_seconds=5)
        assert [(d.message, d.attempt) for d in again] == [(first.message, 2)]
        assert await queue.ack(again[0]) is True
    finally:
        await queue.close()
        await delete_queues(amqp_url, prefix)


async def test_acks_sent_just_before_close_are_applied_and_none_come_back(amqp_url: str) -> None:
    """A quorum queue can drop acks that arrive just before the connection closes; close()
    makes sure the broker applied them, so no acked message is delivered again. Five rounds,
    each on a new queue (the loss comes and goes with the queue)."""
    for _ in range(5):
        prefix = f"jftest.{uuid.uuid4().hex[:12]}"
        try:
            queue = RabbitMQQueue(amqp_url, prefix=prefix)
            for i in range(50):
                await queue.publish(message(f"acked-{i}"))
            got: list[Delivery] = []
            while len(got) < 50:
                got += await queue.receive(
                    [QUEUE], max_messages=50 - len(got), lease_seconds=60, wait_seconds=5
                )
            for delivery in got:
                assert await queue.ack(delivery) is True
            await queue.close()

            fresh = RabbitMQQueue(amqp_url, prefix=prefix)
            try:
                back = await fresh.receive(
                    [QUEUE], max_messages=50, lease_seconds=60, wait_seconds=1
                )
                assert job_ids(back) == []
            finally:
                await fresh.close()
        finally:
            await delete_queues(amqp_url, prefix)


async def test_messages_buffered_but_never_received_go_back_uncounted_at_close(
    amqp_url: str,
) -> None:
    """The consumer prefetched 5, the worker received 1: at close the 4 others go back with
    their attempt unchanged; the one received (and not settled) comes back counted."""
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    queue = RabbitMQQueue(amqp_url, prefix=prefix, prefetch=5)
    fresh = RabbitMQQueue(amqp_url, prefix=prefix)
    try:
        for i in range(5):
            await queue.publish(message(f"buffered-{i}"))
        (held,) = await queue.receive([QUEUE], max_messages=1, lease_seconds=60, wait_seconds=5)

        async def all_buffered() -> bool:
            return await queue.size([QUEUE]) == QueueSize(due=4, total=5)

        await wait_until(all_buffered, timeout=10.0, message="4 messages buffered")
        await queue.close()

        back: list[Delivery] = []

        async def all_back() -> bool:
            back.extend(
                await fresh.receive([QUEUE], max_messages=10, lease_seconds=60, wait_seconds=0.2)
            )
            return len(back) == 5

        await wait_until(all_back, timeout=10.0, message="5 messages back")
        attempts = {d.message.job_id: d.attempt for d in back}
        assert attempts == {
            f"buffered-{i}": 2 if f"buffered-{i}" == held.message.job_id else 1 for i in range(5)
        }
        for delivery in back:
            assert await fresh.ack(delivery) is True
    finally:
        await queue.close()
        await fresh.close()
        await delete_queues(amqp_url, prefix)


async def test_messages_buffered_behind_a_busy_receiver_go_back_to_the_queue_uncounted(
    amqp_url: str,
) -> None:
    """The consumer prefetched 5 and its worker took 1 and stays busy: within a few seconds the
    4 others go back to the queue, where another client receives them at attempt 1."""
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    busy = RabbitMQQueue(amqp_url, prefix=prefix, prefetch=5)
    other = RabbitMQQueue(amqp_url, prefix=prefix)
    try:
        for i in range(5):
            await busy.publish(message(f"waiting-{i}"))
        (held,) = await busy.receive([QUEUE], max_messages=1, lease_seconds=60, wait_seconds=5)

        taken: list[Delivery] = []

        async def all_taken() -> bool:
            taken.extend(
                await other.receive([QUEUE], max_messages=10, lease_seconds=60, wait_seconds=0.2)
            )
            return len(taken) == 4

        await wait_until(all_taken, timeout=15.0, message="4 buffered messages back")
        assert {d.message.job_id for d in taken} | {held.message.job_id} == {
            f"waiting-{i}" for i in range(5)
        }
        assert [d.attempt for d in taken] == [1, 1, 1, 1]
        assert await busy.ack(held) is True
        for delivery in taken:
            assert await other.ack(delivery) is True
    finally:
        await busy.close()
        await other.close()
        await delete_queues(amqp_url, prefix)


async def test_the_adapter_reconnects_after_its_connection_was_dropped(amqp_url: str) -> None:
    """The network drops the connection (aio-pika then still says it is not closed): the next
    call fails, and a later one opens a new connection instead of failing forever. The message
    the dropped connection held comes back, counted."""
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    parts = urlsplit(amqp_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    await proxy.start()
    credentials = parts.netloc.rpartition("@")[0]
    queue = RabbitMQQueue(
        urlunsplit(parts._replace(netloc=f"{credentials}@127.0.0.1:{proxy.port}")), prefix=prefix
    )
    try:
        await queue.publish(message("before"))
        (held,) = await queue.receive([QUEUE], max_messages=1, lease_seconds=60)
        proxy.down()
        with pytest.raises(Exception):  # noqa: B017 - whatever the client raises
            await queue.receive([QUEUE], max_messages=1, lease_seconds=60)
        proxy.up()

        await queue.publish(message("after"))
        got = await queue.receive([QUEUE], max_messages=2, lease_seconds=60, wait_seconds=5)
        assert sorted((d.message.job_id, d.attempt) for d in got) == [("after", 1), ("before", 2)]
        for delivery in got:
            assert await queue.ack(delivery) is True
        assert await queue.ack(held) is False  # its connection is gone
    finally:
        await queue.close()
        await proxy.close()
        await delete_queues(amqp_url, prefix)


@pytest.mark.parametrize("noticed_by", ["receive", "size"])
async def test_a_connection_whose_reader_stopped_is_an_outage_at_the_next_receive_or_count(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch, noticed_by: str
) -> None:
    """aiormq's reader stops at a frame pamqp cannot decode, and the connection is dead, though
    aio-pika may still say its channel is open. jobfence's connections read every frame
    RabbitMQ passes on from a producer (see ``tests/test_hostile_broker_messages.py``), so
    the failure is made here: pamqp fails on one marked body frame, as it would on a frame
    no one foresaw. The next receive, or the next count (``size``, which a worker running
    until the queue is empty calls between receives), says so (``QueueUnavailable``, which the
    worker logs as an outage) instead of returning nothing, or reconnecting, in silence; once
    that message is gone, the adapter works on a new connection."""
    import pamqp.frame
    from pamqp.exceptions import UnmarshalingException

    marker = b"pamqp-cannot-read-this"
    unmarshal_body = pamqp.frame._unmarshal_body_frame

    def failing_on_the_marker(frame_data: bytes) -> Any:
        if frame_data == marker:
            raise UnmarshalingException("ContentBody", "a frame no one foresaw")
        return unmarshal_body(frame_data)

    monkeypatch.setattr(pamqp.frame, "_unmarshal_body_frame", failing_on_the_marker)
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    name = f"{prefix}.{QUEUE}"
    queue = RabbitMQQueue(amqp_url, prefix=prefix)
    connection = await aio_pika.connect(amqp_url)
    try:
        await queue.publish(message("before"))
        await queue.ack_many(await _receive_until(queue, [QUEUE], 1))
        channel = await connection.channel()
        amqp_queue = await channel.declare_queue(name, passive=True)
        await channel.default_exchange.publish(aio_pika.Message(marker), routing_key=name)

        raised: list[QueueUnavailable] = []

        async def outage() -> bool:
            try:
                if noticed_by == "receive":
                    await queue.receive([QUEUE], max_messages=1, lease_seconds=60, wait_seconds=0.2)
                else:
                    await queue.size([QUEUE])
                    await asyncio.sleep(0.05)
            except QueueUnavailable as exc:
                raised.append(exc)
            return bool(raised)

        await wait_until(outage, timeout=10, message="the lost connection raised")
        assert "InvalidFrameError" in str(raised[0]), raised[0]

        async def purged() -> bool:  # back in the queue once the broker saw the connection go
            return bool((await amqp_queue.purge()).message_count)

        await wait_until(purged, timeout=10, message="the undecodable message purged")
        await queue.publish(message("after"))
        got = await _receive_until(queue, [QUEUE], 1)
        assert job_ids(got) == ["after"]
        await queue.ack_many(got)
    finally:
        await queue.close()
        await connection.close()
        await delete_queues(amqp_url, prefix)


@pytest.mark.serial  # sets the broker's max_message_size for every connection
async def test_a_publish_over_max_message_size_is_refused_for_good_and_the_next_goes_through(
    amqp_url: str,
) -> None:
    """``publish`` of a body over the broker's ``max_message_size``: ``PublishRefused`` naming
    the limit (the broker closed the channel), and the next publish goes through on a new one;
    a second body over it, within the minute, is refused without being sent."""
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    queue = RabbitMQQueue(amqp_url, prefix=prefix)
    try:
        with rabbitmq_max_message_size(4096):
            await queue.publish(message("before"))
            with pytest.raises(PublishRefused, match="max_message_size of 4,096 bytes"):
                await queue.publish(message("too-big", body=b"x" * 5000))
            await queue.publish(message("after"))
            channel = queue._channel
            with pytest.raises(PublishRefused, match="body is 6,000 bytes"):
                await queue.publish(message("too-big-2", body=b"x" * 6000))
            assert queue._channel is channel and channel is not None
            assert not channel.is_closed
        got = await queue.receive([QUEUE], max_messages=10, lease_seconds=30, wait_seconds=5)
        assert sorted(d.message.job_id for d in got) == ["after", "before"]
        for delivery in got:
            assert await queue.ack(delivery) is True
    finally:
        await queue.close()
        await delete_queues(amqp_url, prefix)


async def _receive_until(queue: RabbitMQQueue, queues: list[str], count: int) -> list[Delivery]:
    """Receive from ``queues`` until ``count`` deliveries came (10 s at most)."""
    got: list[Delivery] = []

    async def enough() -> bool:
        got.extend(await queue.receive(queues, max_messages=count, lease_seconds=60))
        return len(got) >= count

    await wait_until(enough, timeout=10, message=f"{count} messages")
    return got


async def test_publish_many_with_a_queue_declared_otherwise_publishes_the_others(
    amqp_url: str,
) -> None:
    """A queue someone declared with other arguments (a classic queue where jobfence declares
    a quorum one) closes the channel at its declaration: that queue's messages fail, and the
    messages for the other queues are confirmed and delivered."""
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    admin = await aio_pika.connect(amqp_url)
    queue = RabbitMQQueue(amqp_url, prefix=prefix)
    try:
        channel = await admin.channel()
        await channel.declare_queue(f"{prefix}.conformance.nobody", durable=True)
        outgoing = [
            Outgoing(message(f"m{n}", queue="conformance.nobody" if n % 3 == 1 else QUEUE))
            for n in range(6)
        ]

        results = await queue.publish_many(outgoing)

        assert [r is None for r in results] == [True, False, True, True, False, True]
        assert all("PRECONDITION_FAILED" in str(r) for r in results if r is not None)
        got = await _receive_until(queue, [QUEUE], 4)
        assert job_ids(got) == ["m0", "m2", "m3", "m5"]
        assert await channel.declare_queue(f"{prefix}.conformance.nobody", passive=True)
    finally:
        await queue.close()
        await admin.close()
        await delete_queues(amqp_url, prefix)


async def test_a_queue_name_too_long_for_rabbitmq_is_refused_alone_in_publish_many(
    amqp_url: str,
) -> None:
    """RabbitMQ names a queue in at most 255 bytes, prefix included. A longer one is that
    message's refusal for good, before anything is declared or sent; the messages beside it
    are confirmed and delivered. A name of exactly 255 bytes is a queue like any other."""
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    longest = "q" * (255 - len(prefix) - 1)
    queue = RabbitMQQueue(amqp_url, prefix=prefix)
    try:
        outgoing = [
            Outgoing(message("before")),
            Outgoing(message("too-long", queue=longest + "q")),
            Outgoing(message("longest", queue=longest)),
            Outgoing(message("after")),
        ]

        results = await queue.publish_many(outgoing)

        assert [r is None for r in results] == [True, False, True, True]
        assert isinstance(results[1], PublishRefused)
        assert "at most 255 bytes with its prefix, got 256" in str(results[1])
        got = await _receive_until(queue, [QUEUE, longest], 3)
        assert sorted(job_ids(got)) == ["after", "before", "longest"]
    finally:
        await queue.close()
        await delete_queues(amqp_url, prefix)
        connection = await aio_pika.connect(amqp_url)
        channel = await connection.channel()
        await channel.queue_delete(f"{prefix}.{longest}")
        await connection.close()


async def test_a_message_rabbitmq_returns_as_unroutable_fails_alone_in_publish_many(
    amqp_url: str,
) -> None:
    """A queue deleted behind the adapter's back (it declared it before and remembers that):
    RabbitMQ returns its messages as unroutable (they are published as mandatory), and each
    such message is a failure of its own, not confirmed; the messages around it, for a queue
    that exists, are confirmed and delivered, and the channel goes on."""
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    queue = RabbitMQQueue(amqp_url, prefix=prefix)
    connection = await aio_pika.connect(amqp_url)
    try:
        first = [
            Outgoing(message("warm-up")),
            Outgoing(message("gone-1", queue="conformance.other")),
        ]
        assert await queue.publish_many(first) == [None, None]
        channel = await connection.channel()
        await channel.queue_delete(f"{prefix}.conformance.other")
        outgoing = [
            Outgoing(message(f"m{n}", queue="conformance.other" if n % 2 else QUEUE))
            for n in range(6)
        ]

        results = await queue.publish_many(outgoing)

        assert [r is None for r in results] == [True, False, True, False, True, False]
        assert all("did not confirm" in str(r) for r in results if r is not None), results
        assert await queue.publish_many([Outgoing(message("next"))]) == [None]
        got = await _receive_until(queue, [QUEUE], 5)
        assert job_ids(got) == ["warm-up", "m0", "m2", "m4", "next"]
    finally:
        await queue.close()
        await connection.close()
        await delete_queues(amqp_url, prefix)


async def test_a_job_for_two_consumers_in_one_batch_is_confirmed_or_returned_each_as_its_own(
    amqp_url: str,
) -> None:
    """One job id for two consumers in the same batch (a fan-out), one on a queue deleted
    behind the adapter's back, one on a queue that exists, in both orders. RabbitMQ returns the
    first as unroutable and confirms the second: the returned one fails and the delivered one
    succeeds, each by its own publish, so the outbox keeps the row of the message the broker
    dropped. (A message id shared by two outstanding publishes once matched the return to the
    wrong one: the dropped message counted as published, and its job was lost.)"""
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    queue = RabbitMQQueue(amqp_url, prefix=prefix)
    connection = await aio_pika.connect(amqp_url)
    try:
        first = [Outgoing(message("warm-up")), Outgoing(message("warm-up", queue="gone"))]
        assert await queue.publish_many(first) == [None, None]
        channel = await connection.channel()
        await channel.queue_delete(f"{prefix}.gone")

        def fan_out(job_id: str, gone_first: bool) -> list[Outgoing]:
            to_gone = replace(message(job_id, queue="gone"), consumer="audit")
            to_queue = message(job_id)
            return (
                [Outgoing(to_gone), Outgoing(to_queue)]
                if gone_first
                else [
                    Outgoing(to_queue),
                    Outgoing(to_gone),
                ]
            )

        outgoing = fan_out("j1", True) + fan_out("j2", False) + fan_out("j3", True)
        results = await queue.publish_many(outgoing)

        assert [r is None for r in results] == [False, True, True, False, False, True]
        assert all("did not confirm" in str(r) for r in results if r is not None), results
        got = await _receive_until(queue, [QUEUE], 4)
        assert job_ids(got) == ["warm-up", "j1", "j2", "j3"]
    finally:
        await queue.close()
        await connection.close()
        await delete_queues(amqp_url, prefix)


async def test_a_consumer_the_broker_cancels_is_started_again_at_the_next_receive(
    amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The queue deleted on the server (an operator's cleanup) and made again by a producer
    before the worker's next receive: RabbitMQ cancelled the worker's consumer
    (``basic.cancel``). The adapter says so once and consumes the queue again at its next
    receive, so what is published next is pushed to it, as before the deletion, instead of
    being fetched one round trip per message for as long as the worker runs."""
    prefix = f"jftest.{uuid.uuid4().hex[:12]}"
    worker = RabbitMQQueue(amqp_url, prefix=prefix)
    producer = RabbitMQQueue(amqp_url, prefix=prefix)
    connection = await aio_pika.connect(amqp_url)
    name = f"{prefix}.{QUEUE}"

    async def consumers() -> int:
        channel = await connection.channel()
        declared = await channel.declare_queue(name, passive=True)
        await channel.close()
        count = declared.declaration_result.consumer_count
        assert isinstance(count, int)
        return count

    async def publish(job_id: str) -> None:
        async def published() -> bool:  # the first try after the deletion is returned
            return await producer.publish_many([Outgoing(message(job_id))]) == [None]

        await wait_until(published, timeout=10, message=f"{job_id} published")

    try:
        await publish("before")
        await worker.ack_many(await _receive_until(worker, [QUEUE], 1))
        assert await consumers() == 1
        with caplog.at_level(logging.WARNING, logger="jobfence"):
            channel = await connection.channel()
            await channel.queue_delete(name)
            await channel.close()

            async def cancelled() -> bool:
                return any("cancelled the consumer" in r.getMessage() for r in caplog.records)

            await wait_until(cancelled, timeout=10, message="the consumer cancelled")
            await publish("after")
            got = await _receive_until(worker, [QUEUE], 1)
        assert job_ids(got) == ["after"]
        await worker.ack_many(got)
        assert await consumers() == 1
        cancels = [r.getMessage() for r in caplog.records if "cancelled the" in r.getMessage()]
        assert cancels == [
            f"RabbitMQ cancelled the consumer of queue {name} (the queue was deleted on the"
            " server): it is declared and consumed again at the next receive",
        ]
    finally:
        await worker.close()
        await producer.close()
        await connection.close()
        await delete_queues(amqp_url, prefix)
