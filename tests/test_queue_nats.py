"""NatsQueue: the queue contract on the real NATS JetStream, and what only a broker shows."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import quote, urlsplit

import nats
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.js.api import RetentionPolicy, StreamConfig
from nats.js.errors import NotFoundError

from jobfence import QueueCapabilities, QueueUnavailable
from jobfence.adapters import nats as nats_adapter
from jobfence.adapters.nats import NatsQueue
from jobfence.errors import PublishRefused
from jobfence.model import Outgoing
from queue_conformance import OTHER_QUEUE, QUEUE, BrokerConformance, QueueEnv, job_ids, message
from support import wait_until
from tcp_proxy import TcpProxy


class TestNatsConformance(BrokerConformance):
    expected_capabilities = QueueCapabilities(
        transactional=False, delayed_publish=False, delayed_retry=True, exact_stale_ack=False
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

    # nats-py drops the stream writer of a connection that broke without closing it (its
    # reconnect, within half a second, opens a new one), which Python reports as an
    # unraisable ResourceWarning when it is collected.
    @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
    async def test_a_delivery_whose_connection_drops_comes_back_with_the_next_attempt(
        self, env: QueueEnv
    ) -> None:
        await super().test_a_delivery_whose_connection_drops_comes_back_with_the_next_attempt(env)


async def test_a_release_whose_copy_cannot_be_published_gives_the_original_back(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publishing the copy fails: the release fails loudly, and the original is delivered again
    at once (counted), not after its 60 s AckWait."""
    name = f"JFTEST_{uuid.uuid4().hex[:12]}"
    queue = NatsQueue(nats_url, stream=name, subject_prefix=name.lower())
    try:
        await queue.publish(message("copy-refused"))
        (first,) = await queue.receive([QUEUE], max_messages=1, lease_seconds=60)

        async def refused(*args: object, **kwargs: object) -> None:
            raise ConnectionError("the server refused the copy")

        monkeypatch.setattr(queue, "_publish", refused)
        with pytest.raises(QueueUnavailable, match="refused the copy") as raised:
            await queue.release(first)
        assert isinstance(raised.value.__cause__, ConnectionError)
        monkeypatch.undo()

        again = await queue.receive([QUEUE], max_messages=1, lease_seconds=60, wait_seconds=5)
        assert [(d.message, d.attempt) for d in again] == [(first.message, 2)]
        assert await queue.ack(again[0]) is True
    finally:
        await queue.close()
        nc = await nats.connect(nats_url)
        await nc.jetstream().delete_stream(name)
        await nc.close()


async def test_a_publisher_keeps_the_lease_the_workers_set(nats_url: str) -> None:
    """The outbox relay (or a replay) publishes with an adapter of its own, which knows no
    lease: it must not reset the consumer's AckWait to its default, or a dead worker's jobs
    would come back after 30 s instead of the workers' lease (and a long handler's job would
    go to another worker while it still runs)."""
    name = f"JFTEST_{uuid.uuid4().hex[:12]}"
    worker = NatsQueue(nats_url, stream=name, subject_prefix=name.lower())
    relay = NatsQueue(nats_url, stream=name, subject_prefix=name.lower())
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        assert await worker.receive([QUEUE], max_messages=1, lease_seconds=4) == []
        await relay.publish(message("from-the-relay"))
        info = await js.consumer_info(name, NatsQueue._durable(QUEUE))
        assert info.config.ack_wait == 4.0
        (got,) = await worker.receive([QUEUE], max_messages=1, lease_seconds=4, wait_seconds=5)
        assert await worker.ack(got) is True
    finally:
        await worker.close()
        await relay.close()
        await js.delete_stream(name)
        await nc.close()


@contextlib.asynccontextmanager
async def _stream_made_elsewhere(nats_url: str, **limits: int) -> AsyncIterator[NatsQueue]:
    """A work-queue stream created by someone else with ``limits``, and a queue on it."""
    name = f"JFTEST_{uuid.uuid4().hex[:12]}"
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=name,
            subjects=[f"{name.lower()}.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            **limits,  # type: ignore[arg-type]
        )
    )
    queue = NatsQueue(nats_url, stream=name, subject_prefix=name.lower())
    try:
        yield queue
    finally:
        await queue.close()
        await js.delete_stream(name)
        await nc.close()


async def test_publish_many_with_a_queue_whose_consumer_cannot_be_made_publishes_the_others(
    nats_url: str,
) -> None:
    """A stream that allows one consumer (created so by someone else): the second queue's
    consumer is refused, that queue's messages fail, and the first queue's messages are
    confirmed and delivered."""
    async with _stream_made_elsewhere(nats_url, max_consumers=1) as queue:
        outgoing = [
            Outgoing(message(f"m{n}", queue=OTHER_QUEUE if n % 3 == 1 else QUEUE)) for n in range(6)
        ]

        results = await queue.publish_many(outgoing)

        assert [r is None for r in results] == [True, False, True, True, False, True]
        assert all("maximum consumers limit reached" in str(r) for r in results if r is not None), [
            str(r) for r in results
        ]
        got = await queue.receive([QUEUE], max_messages=10, lease_seconds=30, wait_seconds=5)
        assert job_ids(got) == ["m0", "m2", "m3", "m5"]


async def test_publish_many_a_message_over_the_streams_own_size_limit_fails_alone(
    nats_url: str,
) -> None:
    """A stream created by someone else with ``max_msg_size`` 200 bytes: JetStream answers the
    one larger message with an error in its ack; that message is refused for good
    (``PublishRefused``, with JetStream's words: the relay makes it a dead letter), not taken
    for an outage, and the others are confirmed and delivered in order."""
    async with _stream_made_elsewhere(nats_url, max_msg_size=200) as queue:
        outgoing = [
            Outgoing(message(f"m{n}", body=b'{"n": "' + b"x" * 300 + b'"}' if n == 2 else None))
            for n in range(5)
        ]

        results = await queue.publish_many(outgoing)

        assert [r is None for r in results] == [True, True, False, True, True]
        assert isinstance(results[2], PublishRefused), results[2]
        assert "message size exceeds maximum allowed" in str(results[2])
        got = await queue.receive([QUEUE], max_messages=10, lease_seconds=30, wait_seconds=5)
        assert job_ids(got) == ["m0", "m1", "m3", "m4"]


async def test_publish_many_after_the_stream_was_deleted_is_an_outage_at_once(
    nats_url: str,
) -> None:
    """The stream deleted under a connected queue: no stream answers the subject (NATS's "no
    responders"), and every message of the batch is ``QueueUnavailable`` as soon as that
    answer comes, not after the wait for acks."""
    name = f"JFTEST_{uuid.uuid4().hex[:12]}"
    queue = NatsQueue(nats_url, stream=name, subject_prefix=name.lower())
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        assert await queue.publish_many([Outgoing(message("first"))]) == [None]
        await js.delete_stream(name)

        started = time.monotonic()
        results = await queue.publish_many([Outgoing(message(f"m{n}")) for n in range(3)])

        assert all(isinstance(r, QueueUnavailable) for r in results), results
        assert time.monotonic() - started < 2.0
    finally:
        await queue.close()
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(name)
        await nc.close()


@given(st.text())
def test_a_header_value_is_percent_encoded_where_needed_and_reads_back_as_it_was(
    value: str,
) -> None:
    """Any text, ids with line breaks, ``%`` and non-ASCII included: written as
    ``urllib.parse.quote`` with the header-safe characters writes it (values that need nothing
    encoded go as they are, without calling it), ASCII with no space or line break, and read
    back unchanged."""
    written = nats_adapter._header(value)
    assert written == quote(value, safe=nats_adapter._HEADER_SAFE)
    assert written.isascii() and not any(c.isspace() for c in written)
    try:
        value.encode()
    except UnicodeEncodeError:
        return  # a lone surrogate: no UTF-8 to read back
    assert nats_adapter._unquote(written) == value


async def test_only_a_jetstream_ack_confirms_a_publish_anything_else_on_its_inbox_fails_it() -> (
    None
):
    """What comes back on a publish's reply subject is read as JetStream's ack only when it is
    one (``{"stream": ..., "seq": ...}``); an error ack is that error; anything else (another
    responder on the subject, a forged reply) fails the publish, which is tried again, rather
    than confirm a message nobody stored."""
    inbox = nats_adapter._AckInbox("_INBOX.test")
    answers = [
        b'{"stream":"JOBS", "seq":7}',
        b'{"stream":"JOBS","seq":8,"duplicate":true}',
        b'{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum"}}',
        b"ok",
        b'{"ok":true}',
        b'["stream","seq"]',
        b"",
    ]
    futures = []
    for data in answers:
        reply, future = inbox.expect()
        await inbox._on_ack(Msg(None, subject=reply, data=data))  # type: ignore[arg-type]
        futures.append(future)

    assert [f.exception() is None for f in futures] == [True, True] + [False] * 5
    assert isinstance(futures[2].exception(), PublishRefused)
    assert all("not a JetStream ack" in str(f.exception()) for f in futures[3:]), [
        str(f.exception()) for f in futures[3:]
    ]


async def test_a_connection_whose_read_loop_ended_is_replaced_at_the_next_receive(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A message on the adapter's own inbox whose subject is not UTF-8 ends nats-py's read
    loop (``UnicodeDecodeError`` in its ``_build_message``, logged, no error callback); the
    connection still says it is connected and would receive nothing, for ever. The next
    receive sees the loop ended, says so at WARNING and connects again: the job published
    after it is received."""
    name = f"JFTEST_{uuid.uuid4().hex[:12]}"
    queue = NatsQueue(nats_url, stream=name, subject_prefix=name.lower())
    parts = urlsplit(nats_url)
    try:
        await queue.publish(message("before"))
        assert queue._inbox is not None
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 4222)
        await reader.readline()  # INFO
        subject = queue._inbox._prefix.encode() + b".\xff"
        writer.write(b'CONNECT {"verbose":false}\r\nPUB %s 0\r\n\r\nPING\r\n' % subject)
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 5)).strip() == b"PONG"
        writer.close()
        await queue.publish(message("after"))

        got: list[str] = []

        async def received() -> bool:
            for delivery in await queue.receive(
                [QUEUE], max_messages=10, lease_seconds=30, wait_seconds=0.5
            ):
                got.append(delivery.message.job_id)
                assert await queue.ack(delivery)
            return len(got) >= 2

        await wait_until(received, timeout=15, message="both jobs to be received")
        assert sorted(got) == ["after", "before"]
        assert "the NATS connection stopped reading" in caplog.text
    finally:
        await queue.close()
        nc = await nats.connect(nats_url)
        await nc.jetstream().delete_stream(name)
        await nc.close()
