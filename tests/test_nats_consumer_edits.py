"""A jobfence NATS consumer edited on the server while workers run (``nats consumer edit``, the
JetStream API, or deleted and made again by someone else), and a stream that is full: no job
may be stranded in the stream, and what happened is said in the words of what happened."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from jobfence import QueueUnavailable
from jobfence.adapters import nats as nats_adapter
from jobfence.adapters.nats import NatsQueue
from jobfence.errors import ConfigError
from jobfence.model import Delivery, Outgoing
from queue_conformance import QUEUE, job_ids, message
from support import wait_until

DURABLE = NatsQueue._durable(QUEUE)


@dataclasses.dataclass
class Env:
    name: str
    queue: NatsQueue
    js: JetStreamContext

    async def config(self) -> ConsumerConfig:
        return (await self.js.consumer_info(self.name, DURABLE)).config

    async def edit(self, **changes: Any) -> None:
        """What ``nats consumer edit`` does: the consumer's configuration sent again, changed."""
        await self.js.add_consumer(self.name, dataclasses.replace(await self.config(), **changes))

    async def stranded(self) -> str:
        stream = await self.js.stream_info(self.name)
        consumer = await self.js.consumer_info(self.name, DURABLE)
        return (
            f"job stranded: the stream holds {stream.state.messages} message(s), the consumer"
            f" has {consumer.num_pending} pending and {consumer.num_ack_pending} ack-pending,"
            f" config {consumer.config.max_deliver=} {consumer.config.filter_subject=}"
            f" {consumer.config.deliver_policy=}"
        )


@pytest.fixture
async def env(nats_url: str) -> AsyncIterator[Env]:
    name = f"JFEDIT_{uuid.uuid4().hex[:12]}"
    queue = NatsQueue(nats_url, stream=name, subject_prefix=name.lower())
    nc = await nats.connect(nats_url)
    try:
        yield Env(name, queue, nc.jetstream())
    finally:
        await queue.close()
        with contextlib.suppress(NotFoundError):
            await nc.jetstream().delete_stream(name)
        await nc.close()


async def _receive_until(env: Env, job_id: str, *, timeout: float, lease: float = 30) -> Delivery:
    """Receive (as a worker does, again and again) until ``job_id`` comes; the others are
    acked. Fails with what the stream and the consumer hold when it does not come."""
    found: list[Delivery] = []

    async def came() -> bool:
        for delivery in await env.queue.receive(
            [QUEUE], max_messages=10, lease_seconds=lease, wait_seconds=0.5
        ):
            if delivery.message.job_id == job_id:
                found.append(delivery)
            else:
                assert await env.queue.ack(delivery)
        return bool(found)

    try:
        await wait_until(came, timeout=timeout, message=f"job {job_id!r} to be delivered")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {await env.stranded()}") from None
    return found[0]


def _errors(caplog: pytest.LogCaptureFixture, *words: str, level: int = logging.ERROR) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == level and all(w in r.getMessage() for w in words)
    ]


# -- item 1: a consumer edited while workers run -----------------------------------------------


async def test_a_job_that_reaches_a_max_deliver_set_on_the_server_is_delivered_again_with_its_count(
    env: Env, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_deliver lowered to 2 on the server while a worker runs: the job's second failed
    attempt would be its last delivery, left in the work-queue stream for ever, with no dead
    letter. JetStream's MAX_DELIVERIES advisory makes the adapter publish it again from its
    copy with its deliveries so far (attempt 3 next), delete the stranded one, put max_deliver
    back, and log an ERROR naming the setting."""
    # The settings check (every 5 s) would put max_deliver back before the job reaches it in
    # some runs: this test is about the advisory alone.
    monkeypatch.setattr(nats_adapter, "_CONSUMER_CHECK_SECONDS", 3600.0)
    await env.queue.publish(message("strand-me"))
    (first,) = await env.queue.receive([QUEUE], max_messages=1, lease_seconds=30)
    await env.edit(max_deliver=2)
    assert await env.queue.retry(first, delay_seconds=0, error="boom")
    second = await _receive_until(env, "strand-me", timeout=5)
    assert second.attempt == 2
    assert await env.queue.retry(second, delay_seconds=0, error="boom")

    third = await _receive_until(env, "strand-me", timeout=10)

    assert third.attempt == 3
    assert third.message == first.message
    assert (await env.config()).max_deliver == -1

    async def logged() -> bool:  # the copy can be delivered before its publisher logs it
        return bool(_errors(caplog, "stopped delivering job strand-me", "after 2 deliveries"))

    await wait_until(logged, timeout=5, message="the ERROR line naming the job")
    assert _errors(caplog, "stopped delivering job strand-me", env.name), caplog.text
    assert await env.queue.ack(third)

    async def empty() -> bool:
        return (await env.js.stream_info(env.name)).state.messages == 0

    await wait_until(empty, timeout=5, message="the stream to be empty (the original deleted)")


async def test_a_forged_max_deliveries_advisory_moves_no_job_and_logs_no_raw_id(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """The advisory's subject is one any client allowed to publish there can write to: an
    advisory whose delivery count or stream sequence is out of range, or not a number, is
    ignored (the message stays where it is), and the job id of a message published by hand
    reaches the ERROR line only as its bounded stand-in, as in every other line."""
    await env.queue.publish(message("kept"))
    assert await env.queue.receive([QUEUE], max_messages=1, lease_seconds=30)  # subscribed now
    kept_seq = (await env.js.stream_info(env.name)).state.last_seq
    normal = await env.js.get_msg(env.name, kept_seq)
    hostile = {**(normal.headers or {}), "Jobfence-Job-Id": "e" * 300}
    await env.js.publish(normal.subject or "", normal.data or b"", headers=hostile)
    hostile_seq = (await env.js.stream_info(env.name)).state.last_seq
    subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{env.name}.{DURABLE}"
    nc = env.js._nc
    for seq, deliveries in ((kept_seq, -5), (kept_seq, 10**15), (-1, 2), (kept_seq, "2")):
        advisory = {"stream_seq": seq, "deliveries": deliveries, "consumer": DURABLE}
        await nc.publish(subject, json.dumps(advisory).encode())
    # In order on the same subscription: once this one is handled, so were those before it.
    await nc.publish(
        subject,
        json.dumps({"stream_seq": hostile_seq, "deliveries": 2, "consumer": DURABLE}).encode(),
    )

    async def handled() -> bool:
        return bool(_errors(caplog, "stopped delivering job"))

    await wait_until(handled, timeout=10, message="the valid advisory to be handled")
    assert (await env.js.get_msg(env.name, kept_seq)).data == normal.data
    [line] = _errors(caplog, "stopped delivering job")
    assert "e" * 201 not in line and "[300 bytes, sha256 " in line, line  # its stand-in


@pytest.mark.parametrize(
    ("changes", "named", "level"),
    [
        ({"max_deliver": 3}, "max_deliver is 3", logging.ERROR),
        ({"backoff": [1.0, 5.0], "max_deliver": 5}, "backoff is [1.0, 5.0]", logging.ERROR),
        ({"max_ack_pending": 1}, "max_ack_pending is 1", logging.WARNING),
    ],
)
async def test_a_consumer_setting_edited_while_workers_run_is_put_back_and_logged(
    env: Env,
    caplog: pytest.LogCaptureFixture,
    changes: dict[str, Any],
    named: str,
    level: int,
) -> None:
    """An edit made after the workers started is found by a running worker (within about 5 s of
    receiving), logged with the setting and its value (ERROR when it can strand a job, WARNING
    when it cannot), and put back to jobfence's settings (unlimited max_deliver, no backoff,
    no max_ack_pending; the worker's lease as AckWait)."""
    assert await env.queue.receive([QUEUE], max_messages=1, lease_seconds=30) == []
    await env.edit(**changes)

    async def put_back() -> bool:
        await env.queue.receive([QUEUE], max_messages=1, lease_seconds=30, wait_seconds=0.2)
        config = await env.config()
        return (
            config.max_deliver == -1
            and config.ack_wait == 30.0
            and not config.backoff
            and config.max_ack_pending == -1
        )

    try:
        await wait_until(put_back, timeout=15, message=f"{named} to be put back")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: still {await env.config()}") from None
    assert _errors(caplog, named, DURABLE, level=level), caplog.text


async def test_workers_with_different_leases_leave_the_consumers_ack_wait_to_each_other(
    env: Env, nats_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers of one queue started with different leases (a deploy changing the lease):
    the consumer's AckWait is the lease of the one that set it last, and neither sets it back
    at each settings check, nor logs it."""
    monkeypatch.setattr(nats_adapter, "_CONSUMER_CHECK_SECONDS", 0.05)
    other = NatsQueue(nats_url, stream=env.name, subject_prefix=env.name.lower())
    try:
        assert await env.queue.receive([QUEUE], max_messages=1, lease_seconds=30) == []
        assert await other.receive([QUEUE], max_messages=1, lease_seconds=10) == []
        checks = 0

        async def checked_often() -> bool:
            nonlocal checks
            for queue, lease in ((env.queue, 30), (other, 10)):
                await queue.receive([QUEUE], max_messages=1, lease_seconds=lease, wait_seconds=0.1)
            checks += 1
            return checks >= 10

        await wait_until(checked_often, timeout=20, message="ten rounds of receives")
        assert (await env.config()).ack_wait == 10.0
        assert "ack_wait" not in caplog.text, caplog.text
    finally:
        await other.close()


async def test_a_job_skipped_while_the_filter_subject_was_edited_is_delivered(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """The filter subject edited away while a worker pulls: the job published meanwhile is
    skipped by the consumer, and stays skipped once the filter is put back (measured on
    nats-server 2.9). The worker finds the filter changed, logs an ERROR and makes the consumer
    again from the stream's start: the skipped job is delivered."""
    await env.queue.publish(message("before"))
    (before,) = await env.queue.receive([QUEUE], max_messages=1, lease_seconds=30)
    assert await env.queue.ack(before)
    await env.edit(filter_subject=f"{env.name.lower()}.elsewhere")
    await env.queue.publish(message("skipped"))
    assert await env.queue.receive([QUEUE], max_messages=1, lease_seconds=30) == []

    skipped = await _receive_until(env, "skipped", timeout=15)

    assert (await env.config()).filter_subject == f"{env.name.lower()}.{QUEUE}"
    assert _errors(caplog, "filter_subject", DURABLE), caplog.text
    assert await env.queue.ack(skipped)


async def test_a_consumer_made_again_elsewhere_with_deliver_policy_new_is_refused_by_jetstream(
    env: Env,
) -> None:
    """Someone deletes the queue's consumer and makes it again by hand with deliver policy
    ``new`` (which would start after the jobs already in the stream): JetStream refuses it on
    a work-queue stream (measured on nats-server 2.9), and the adapter makes the consumer again
    with jobfence's settings: the stored job is delivered."""
    assert await env.queue.receive([QUEUE], max_messages=1, lease_seconds=30) == []
    await env.queue.publish(message("stored"))
    await env.js.delete_consumer(env.name, DURABLE)
    with pytest.raises(BadRequestError, match="deliver all on workqueue stream"):
        await env.js.add_consumer(
            env.name,
            ConsumerConfig(
                durable_name=DURABLE,
                filter_subject=f"{env.name.lower()}.{QUEUE}",
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.NEW,
                ack_wait=30.0,
            ),
        )

    stored = await _receive_until(env, "stored", timeout=15)

    assert (await env.config()).deliver_policy == DeliverPolicy.ALL
    assert await env.queue.ack(stored)


# -- item 2: a stream full under a discard-new limit -------------------------------------------


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        ({"max_msgs": 1}, "max_msgs"),
        ({"max_msgs_per_subject": 1, "discard_new_per_subject": True}, "max_msgs_per_subject"),
    ],
)
async def test_a_publish_to_a_stream_full_under_discard_new_says_the_stream_is_full(
    nats_url: str, limits: dict[str, Any], named: str
) -> None:
    """A stream made by someone else with a limit and discard ``new``: once full, JetStream
    refuses each publish (503, err_code 10077). That is ``QueueUnavailable`` (every message
    would fail the same way: the relay backs off as for an outage, the jobs wait in the
    outbox), but its text says the stream is full and which limit, not "unreachable"."""
    name = f"JFFULL_{uuid.uuid4().hex[:12]}"
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=name,
            subjects=[f"{name.lower()}.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            discard=DiscardPolicy.NEW,
            **limits,
        )
    )
    queue = NatsQueue(nats_url, stream=name, subject_prefix=name.lower())
    try:
        await queue.publish(message("fits"))
        with pytest.raises(QueueUnavailable) as raised:
            for n in range(10):
                await queue.publish(message(f"over-{n}"))
        (result,) = await queue.publish_many([Outgoing(message("over-many"))])

        for error in (raised.value, result):
            assert isinstance(error, QueueUnavailable), error
            text = str(error)
            assert "unreachable" not in text, text
            assert f"stream {name} is full" in text, text
            assert named in text, text
        got = await queue.receive([QUEUE], max_messages=10, lease_seconds=30)
        assert job_ids(got)[0] == "fits"
    finally:
        await queue.close()
        await js.delete_stream(name)
        await nc.close()


# -- item 3: max_bytes with discard new drops the oldest job -----------------------------------


async def test_a_stream_with_max_bytes_and_discard_new_is_refused_as_it_drops_the_oldest_job(
    nats_url: str,
) -> None:
    """A stream made by someone else with ``max_bytes`` and discard ``new``: nats-server checks
    a new message's payload against the limit but stores it with its subject and overhead,
    then deletes the oldest message to fit (measured on 2.9.10: five acked publishes, one job
    left; nats-server issue 4771). Such a stream is refused at start-up like one with discard
    old, naming max_bytes, and nothing is published into it."""
    name = f"JFFULL_{uuid.uuid4().hex[:12]}"
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=name,
            subjects=[f"{name.lower()}.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            discard=DiscardPolicy.NEW,
            max_bytes=400,
        )
    )
    queue = NatsQueue(nats_url, stream=name, subject_prefix=name.lower())
    try:
        with pytest.raises(ConfigError, match="max_bytes is 400"):
            for n in range(5):
                await queue.publish(message(f"job-{n}"))
        assert (await js.stream_info(name)).state.last_seq == 0
    finally:
        await queue.close()
        await js.delete_stream(name)
        await nc.close()
