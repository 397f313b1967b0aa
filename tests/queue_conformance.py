"""The contract every queue adapter passes (STYLE habit 3), as a base class to inherit.

An adapter's test module subclasses :class:`QueueConformance`, sets ``expected_capabilities``
and provides an ``env`` fixture returning a :class:`QueueEnv`: the queue under test, a
:class:`FakeClock` when the adapter accepts one (then leases and delays pass without waiting),
and for transactional adapters an autocommit connection to the work database. An adapter on
real time gets short leases and delays, and the tests poll with deadlines instead of sleeping.

A capability an adapter lacks is declared, never skipped: the capability-gated tests check the
behaviour where it is declared and the refusal (``ConfigError``, nothing changed), or the
documented weaker behaviour, where it is not (``delayed_publish`` and ``delayed_retry``: a
delayed publish or retry; without them the delay waits in the PostgreSQL outbox).

A broker adapter's test class subclasses :class:`BrokerConformance` instead, which adds what a
broker shows and the PostgreSQL queue never had (a connection cut while holding a lease, a
delivery count kept by the broker, an ack after the lease was lost); its env also provides
``open_queue`` (another client on the same broker) and ``drop_connection``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, cast

import psycopg
import pytest

from jobfence import (
    ConfigError,
    Delivery,
    Message,
    PublishRefused,
    QueueCapabilities,
    QueuePort,
    QueueSize,
)
from jobfence.model import Outgoing
from support import wait_until

QUEUE = "conformance.main"
OTHER_QUEUE = "conformance.other"

# Handed to a non-transactional adapter's publish/ack when the env has no database at all:
# the adapter must refuse any tx before touching it.
_STAND_IN_TX = cast("psycopg.AsyncConnection[Any]", object())


class FakeClock:
    """A :class:`jobfence.Clock` that moves only when told to."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start if start is not None else datetime.now(UTC)

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)


async def _yield_to_the_loop() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@dataclass
class QueueEnv:
    """One adapter under test, and what the suite needs to drive it."""

    queue: QueuePort
    # None: the adapter runs on real time, so leases and delays are short and the tests poll.
    clock: FakeClock | None = None
    # Transactional adapters: an autocommit connection to the work database for the caller's tx.
    work_conn: psycopg.AsyncConnection[Any] | None = None
    # Returns once a receiver started in a task is really waiting (e.g. its listener is up).
    until_receiver_waits: Callable[[], Awaitable[None]] = _yield_to_the_loop
    # Brokers: open another adapter instance on the same broker and names (another worker), and
    # cut ``queue``'s broker connection abruptly, as a crash or a network fault would.
    open_queue: Callable[[], Awaitable[QueuePort]] | None = None
    drop_connection: Callable[[], Awaitable[None]] | None = None
    lease_seconds: float = 0.0  # 0: the default for the clock (30 s fake, 0.5 s real)
    delay_seconds: float = 0.0  # 0: the default for the clock (60 s fake, 0.5 s real)

    def __post_init__(self) -> None:
        fake = self.clock is not None
        self.lease_seconds = self.lease_seconds or (30.0 if fake else 0.5)
        self.delay_seconds = self.delay_seconds or (60.0 if fake else 0.5)

    async def elapse(self, seconds: float) -> None:
        """Let ``seconds`` pass: at once on a fake clock; on real time, the tests poll."""
        if self.clock is not None:
            self.clock.advance(seconds)

    async def outlive_lease(self) -> None:
        """Let a delivery's lease run out with nobody taking the message over: at once on a
        fake clock; on real time by waiting past the lease (time itself must pass)."""
        await self.elapse(self.lease_seconds + 1)
        if self.clock is None:
            await asyncio.sleep(self.lease_seconds * 1.2)

    async def receive(
        self,
        queues: Sequence[str] = (QUEUE,),
        *,
        max_messages: int = 10,
        on: QueuePort | None = None,
    ) -> list[Delivery]:
        queue = on if on is not None else self.queue
        return await queue.receive(
            queues, max_messages=max_messages, lease_seconds=self.lease_seconds
        )

    async def watch(self, seconds: float, *, on: QueuePort | None = None) -> list[Delivery]:
        """What ``on`` (default: the queue) receives while ``seconds`` pass: on a fake clock the
        clock moves and one receive looks; on real time, a receive waits that long for one."""
        queue = on if on is not None else self.queue
        if self.clock is not None:
            self.clock.advance(seconds)
            return await self.receive(on=queue)
        return await queue.receive(
            [QUEUE], max_messages=10, lease_seconds=self.lease_seconds, wait_seconds=seconds
        )

    async def receive_soon(
        self,
        queues: Sequence[str] = (QUEUE,),
        *,
        max_messages: int = 10,
        on: QueuePort | None = None,
    ) -> list[Delivery]:
        """Receive what is due now (fake clock) or falls due within a few seconds (real time)."""
        got: list[Delivery] = []

        async def some() -> bool:
            got.extend(await self.receive(queues, max_messages=max_messages, on=on))
            return bool(got)

        timeout = 0.0 if self.clock is not None else 10.0
        await wait_until(some, timeout=timeout, message="a due message")
        return got


def message(
    job_id: str,
    *,
    queue: str = QUEUE,
    body: bytes | None = None,
    tenant_id: str | None = None,
    correlation_id: str | None = None,
) -> Message:
    return Message(
        queue=queue,
        consumer="conformance_consumer",
        job_id=job_id,
        body=body if body is not None else b'{"n": 1}',
        tenant_id=tenant_id,
        correlation_id=correlation_id,
    )


def job_ids(deliveries: Sequence[Delivery]) -> list[str]:
    return [d.message.job_id for d in deliveries]


class QueueConformance:
    """Inherit this in ``TestXxxConformance`` and provide the ``env`` fixture."""

    expected_capabilities: ClassVar[QueueCapabilities]

    @pytest.fixture
    def env(self) -> QueueEnv:
        raise NotImplementedError("a conformance subclass provides the env fixture")

    async def test_declares_its_capabilities(self, env: QueueEnv) -> None:
        assert env.queue.capabilities == self.expected_capabilities

    async def test_a_published_message_is_received_with_every_field_and_attempt_1(
        self, env: QueueEnv
    ) -> None:
        full = message(
            "job-full",
            body=b'{"a": 1}\x00\xff\xfe\xc3\x28 not UTF-8',
            tenant_id="tenant-7",
            correlation_id="corr-42",
        )
        bare = message("job-bare", body=b"")
        await env.queue.publish(full)
        await env.queue.publish(bare)

        got = await env.receive()

        assert sorted((d.message for d in got), key=lambda m: m.job_id) == [bare, full]
        for delivery in got:
            assert type(delivery.message.body) is bytes
            assert delivery.attempt == 1

    async def test_ids_with_line_breaks_percent_signs_and_non_ascii_arrive_unchanged(
        self, env: QueueEnv
    ) -> None:
        odd = message(
            " job\r\nX-Injected: 1 %41 ü ",
            tenant_id="tenant: ü\n%",
            correlation_id="corr\r\n%0A €",
        )
        await env.queue.publish(odd)
        got = await env.receive()
        assert [(d.message, d.attempt) for d in got] == [(odd, 1)]

    async def test_ids_of_a_thousand_characters_arrive_unchanged(self, env: QueueEnv) -> None:
        long = message("j" * 1000, tenant_id="t" * 1000, correlation_id="c" * 1000)
        await env.queue.publish(long)
        got = await env.receive()
        assert [(d.message, d.attempt) for d in got] == [(long, 1)]

    async def test_receive_takes_at_most_max_messages_from_the_named_queues_only(
        self, env: QueueEnv
    ) -> None:
        for i in range(5):
            await env.queue.publish(message(f"main-{i}"))
        for i in range(2):
            await env.queue.publish(message(f"other-{i}", queue=OTHER_QUEUE))

        first = await env.receive([QUEUE], max_messages=3)
        assert set(job_ids(first)) == {"main-0", "main-1", "main-2"}
        assert set(job_ids(await env.receive([OTHER_QUEUE], max_messages=10))) == {
            "other-0",
            "other-1",
        }
        assert set(job_ids(await env.receive([QUEUE, OTHER_QUEUE], max_messages=10))) == {
            "main-3",
            "main-4",
        }
        assert await env.receive(["conformance.nobody"], max_messages=10) == []
        assert await env.receive([], max_messages=10) == []

    async def test_a_leased_message_is_not_received_again_before_its_lease_ends(
        self, env: QueueEnv
    ) -> None:
        await env.queue.publish(message("leased"))
        assert job_ids(await env.receive()) == ["leased"]

        assert await env.receive() == []
        await env.elapse(env.lease_seconds * 0.5)
        assert await env.receive() == []
        assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=1)

    async def test_a_message_whose_lease_ends_is_received_again_with_the_next_attempt(
        self, env: QueueEnv
    ) -> None:
        await env.queue.publish(message("abandoned"))
        first = await env.receive()
        assert [(d.message.job_id, d.attempt) for d in first] == [("abandoned", 1)]

        await env.elapse(env.lease_seconds + 1)
        second = await env.receive_soon()
        assert [(d.message, d.attempt) for d in second] == [(first[0].message, 2)]

        await env.elapse(env.lease_seconds + 1)
        third = await env.receive_soon()
        assert [d.attempt for d in third] == [3]

    async def test_ack_removes_the_message_for_good(self, env: QueueEnv) -> None:
        await env.queue.publish(message("done"))
        await env.queue.publish(message("kept"))
        got = await env.receive(max_messages=1)
        assert job_ids(got) == ["done"]

        assert await env.queue.ack(got[0]) is True
        assert await env.queue.ack(got[0]) is False  # a second ack is a no-op, and says so

        assert await env.queue.size([QUEUE]) == QueueSize(due=1, total=1)
        await env.elapse(env.lease_seconds + 1)
        assert job_ids(await env.receive()) == ["kept"]

    async def test_ack_many_removes_a_batch_and_skips_stale_or_acked_deliveries(
        self, env: QueueEnv
    ) -> None:
        for job_id in ("a", "b", "c", "stale"):
            await env.queue.publish(message(job_id))
        got = await env.receive()
        assert job_ids(got) == ["a", "b", "c", "stale"]
        await env.queue.ack(got[0])  # acked already: skipped by the batch
        await env.queue.release(got[3])
        (current,) = await env.receive()
        assert current.message.job_id == "stale"  # released: got[3] is now a stale delivery
        await env.queue.publish(message("kept"))

        await env.queue.ack_many(got)
        await env.queue.ack_many([])

        assert await env.queue.size([QUEUE]) == QueueSize(due=1, total=2), (
            "a, b and c are gone; the new holder of 'stale' keeps it; 'kept' was never taken"
        )
        await env.queue.ack_many([current])
        assert job_ids(await env.receive()) == ["kept"]

    async def test_ack_many_of_a_large_batch_acks_every_held_delivery_and_no_other(
        self, env: QueueEnv
    ) -> None:
        # Larger than any adapter's chunk, with a released delivery in the middle and its new
        # holder's delivery after the batch: adapters that ack runs at once (one RabbitMQ
        # basic.ack with multiple, one Redis script, one JetStream round trip) must skip both.
        total = 250
        for i in range(total):
            await env.queue.publish(message(f"m{i:03d}"))
        got: list[Delivery] = []

        async def all_held() -> bool:
            got.extend(
                await env.queue.receive([QUEUE], max_messages=total - len(got), lease_seconds=60.0)
            )
            return len(got) == total

        await wait_until(all_held, timeout=0.0 if env.clock else 10.0, message="all 250 held")
        await env.queue.release(got[100])
        current: list[Delivery] = []

        async def taken_again() -> bool:
            current.extend(await env.queue.receive([QUEUE], max_messages=1, lease_seconds=60.0))
            return bool(current)

        await wait_until(taken_again, timeout=0.0 if env.clock else 10.0, message="released")
        assert job_ids(current) == [got[100].message.job_id]

        await env.queue.ack_many(got)

        assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=1), (
            "every delivery of the batch is gone; the released one's new holder keeps it"
        )
        assert await env.queue.ack(current[0]) is True
        assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=0)

    async def test_a_stale_delivery_cannot_ack_retry_or_release_the_new_holders_message(
        self, env: QueueEnv
    ) -> None:
        await env.queue.publish(message("contended"))
        (stale,) = await env.receive()
        await env.elapse(env.lease_seconds + 1)
        (current,) = await env.receive_soon()
        assert current.attempt == 2

        assert await env.queue.ack(stale) is False, "a lost lease is reported"
        assert await env.queue.retry(stale, delay_seconds=0.0, error="stale worker") is False
        await env.queue.release(stale)

        held = await env.queue.size([QUEUE])
        assert held == QueueSize(due=0, total=1), "the new holder's lease must be untouched"
        assert await env.receive() == []
        await env.queue.ack(current)
        assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=0)

    async def test_an_ack_after_the_lease_ran_out_before_a_takeover_follows_the_capability(
        self, env: QueueEnv
    ) -> None:
        await env.queue.publish(message("overdue"))
        (overdue,) = await env.receive()
        await env.outlive_lease()

        if env.queue.capabilities.exact_stale_ack:
            assert await env.queue.ack(overdue) is True, "nobody took it over: the ack stands"
            assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=0)
            return
        assert await env.queue.ack(overdue) is False, "refused by the client's lease clock"
        (again,) = await env.receive_soon()
        assert (again.message, again.attempt) == (overdue.message, 2)
        assert await env.queue.ack(again) is True

    async def test_extend_keeps_a_delivery_from_being_delivered_again_past_its_lease(
        self, env: QueueEnv
    ) -> None:
        await env.queue.publish(message("long-running"))
        (held,) = await env.receive()
        other = await env.open_queue() if env.open_queue is not None else env.queue

        # Three leases long, extended every quarter of a lease: nobody else receives it.
        for _ in range(12):
            assert await env.queue.extend(held, lease_seconds=env.lease_seconds) is True
            assert await env.watch(env.lease_seconds / 4, on=other) == []
        assert await env.receive() == []

        assert await env.queue.ack(held) is True
        assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=0)

    async def test_extend_does_not_count_a_delivery(self, env: QueueEnv) -> None:
        await env.queue.publish(message("extended"))
        (first,) = await env.receive()
        for _ in range(3):
            assert await env.queue.extend(first, lease_seconds=env.lease_seconds) is True

        await env.queue.release(first)
        (second,) = await env.receive()
        assert (second.message, second.attempt) == (first.message, 1), "released: not counted"

        assert await env.queue.extend(second, lease_seconds=env.lease_seconds) is True
        await env.elapse(env.lease_seconds + 1)
        (third,) = await env.receive_soon()  # once the extended lease ran out
        assert (third.message, third.attempt) == (first.message, 2), "one lease ran out: one more"
        assert await env.queue.ack(third) is True

    async def test_extend_from_a_stale_or_settled_delivery_is_refused_and_changes_nothing(
        self, env: QueueEnv
    ) -> None:
        await env.queue.publish(message("contended"))
        (stale,) = await env.receive()
        await env.elapse(env.lease_seconds + 1)
        (current,) = await env.receive_soon()
        assert current.attempt == 2

        assert await env.queue.extend(stale, lease_seconds=env.lease_seconds * 20) is False
        assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=1)

        # The new holder's lease was not extended by the stale delivery: it runs out as usual.
        await env.elapse(env.lease_seconds + 1)
        (third,) = await env.receive_soon()
        assert third.attempt == 3
        assert await env.queue.ack(third) is True
        assert await env.queue.extend(third, lease_seconds=env.lease_seconds) is False, "acked"

        await env.queue.publish(message("retried"))
        (retried,) = await env.receive()
        assert await env.queue.retry(retried, delay_seconds=0.0, error="Flaky: again") is True
        assert await env.queue.extend(retried, lease_seconds=env.lease_seconds) is False

    async def test_an_extend_after_the_lease_ran_out_before_a_takeover_follows_the_capability(
        self, env: QueueEnv
    ) -> None:
        await env.queue.publish(message("overdue"))
        (overdue,) = await env.receive()
        await env.outlive_lease()

        if env.queue.capabilities.exact_stale_ack:
            assert await env.queue.extend(overdue, lease_seconds=env.lease_seconds) is True, (
                "nobody took it over: the delivery holds it again"
            )
            assert await env.receive() == []
            assert await env.queue.ack(overdue) is True
            assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=0)
            return
        assert await env.queue.extend(overdue, lease_seconds=env.lease_seconds) is False, (
            "refused by the client's lease clock"
        )
        (again,) = await env.receive_soon()
        assert (again.message, again.attempt) == (overdue.message, 2)
        assert await env.queue.ack(again) is True

    async def test_retry_makes_the_message_due_only_after_the_delay_and_counts_the_attempt(
        self, env: QueueEnv
    ) -> None:
        await env.queue.publish(message("flaky"))
        (first,) = await env.receive()
        assert first.attempt == 1
        if not env.queue.capabilities.delayed_retry:
            with pytest.raises(ConfigError, match=r"has no delayed retry.*PostgreSQL outbox"):
                await env.queue.retry(first, delay_seconds=env.delay_seconds, error="Flaky")
            assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=1), (
                "a refused retry changes nothing: the delivery still holds its lease"
            )
            assert await env.receive() == []
            assert await env.queue.retry(first, delay_seconds=0.0, error="Flaky: now") is True
            (second,) = await env.receive_soon()
            assert (second.message, second.attempt) == (first.message, 2)
            assert await env.queue.ack(second) is True
            assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=0)
            return

        scheduled = await env.queue.retry(
            first, delay_seconds=env.delay_seconds, error="Flaky: timeout"
        )
        assert scheduled is True
        assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=1)
        assert await env.receive() == []
        await env.elapse(env.delay_seconds * 0.5)
        assert await env.receive() == []

        await env.elapse(env.delay_seconds * 0.6)
        (second,) = await env.receive_soon()
        assert (second.message, second.attempt) == (first.message, 2)

        await env.queue.retry(second, delay_seconds=0.0, error="Flaky: again")
        (third,) = await env.receive_soon()
        assert third.attempt == 3

    async def test_release_makes_the_message_due_at_once_without_counting_the_delivery(
        self, env: QueueEnv
    ) -> None:
        await env.queue.publish(message("given-back"))
        (first,) = await env.receive()

        await env.queue.release(first)
        assert await env.queue.size([QUEUE]) == QueueSize(due=1, total=1)
        (second,) = await env.receive()
        assert (second.message, second.attempt) == (first.message, 1)

        await env.queue.release(second)
        (third,) = await env.receive()
        assert third.attempt == 1

        await env.elapse(env.lease_seconds + 1)
        (fourth,) = await env.receive_soon()
        assert fourth.attempt == 2, "a lease that ran out still counts"

    async def test_a_delayed_publish_is_received_only_after_the_delay(self, env: QueueEnv) -> None:
        if not env.queue.capabilities.delayed_publish:
            with pytest.raises(ConfigError, match="delayed publish"):
                await env.queue.publish(message("delayed"), delay_seconds=env.delay_seconds)
            assert (await env.queue.size([QUEUE])).total == 0, "a refused publish adds nothing"
            return
        await env.queue.publish(message("delayed"), delay_seconds=env.delay_seconds)

        assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=1)
        assert await env.receive() == []
        await env.elapse(env.delay_seconds * 0.5)
        assert await env.receive() == []

        await env.elapse(env.delay_seconds * 0.6)
        got = await env.receive_soon()
        assert [(d.message.job_id, d.attempt) for d in got] == [("delayed", 1)]

    async def test_a_message_published_with_prior_attempts_is_delivered_with_the_next_attempt(
        self, env: QueueEnv
    ) -> None:
        """What the outbox relay does with a retry written to the outbox: the copy it publishes
        carries the deliveries the job already had, and the count goes on from there."""
        await env.queue.publish(message("carried-on"), prior_attempts=3)
        await env.queue.publish(message("fresh"))
        got = await env.receive()
        assert sorted((d.message.job_id, d.attempt) for d in got) == [
            ("carried-on", 4),
            ("fresh", 1),
        ]
        carried = next(d for d in got if d.message.job_id == "carried-on")
        assert await env.queue.ack(next(d for d in got if d is not carried)) is True

        await env.queue.release(carried)
        (released,) = await env.receive_soon()
        assert (released.message, released.attempt) == (carried.message, 4), "not counted"

        assert await env.queue.retry(released, delay_seconds=0.0, error="Flaky: again") is True
        (retried,) = await env.receive_soon()
        assert (retried.message, retried.attempt) == (carried.message, 5)

        await env.elapse(env.lease_seconds + 1)
        (redelivered,) = await env.receive_soon()
        assert (redelivered.message, redelivered.attempt) == (carried.message, 6)
        assert await env.queue.ack(redelivered) is True

    async def test_publish_many_confirms_each_message_with_its_prior_attempts(
        self, env: QueueEnv
    ) -> None:
        """What the outbox relay publishes through: one result per message, ``None`` once
        confirmed; every message then arrives as a single publish would have sent it."""
        outgoing = [
            Outgoing(message(f"many-{n}", queue=QUEUE if n % 2 else OTHER_QUEUE), n % 3)
            for n in range(40)
        ]
        assert await env.queue.publish_many([]) == []
        assert await env.queue.publish_many(outgoing) == [None] * 40

        got: list[Delivery] = []

        async def all_of_them() -> bool:
            got.extend(await env.receive([QUEUE, OTHER_QUEUE], max_messages=100))
            return len(got) >= 40

        await wait_until(all_of_them, timeout=0 if env.clock else 10, message="40 messages")
        by_job = {d.message.job_id: (d.message, d.attempt) for d in got}
        assert len(got) == 40
        assert by_job == {
            item.message.job_id: (item.message, item.prior_attempts + 1) for item in outgoing
        }

    async def test_publish_many_with_one_bad_message_publishes_the_others(
        self, env: QueueEnv
    ) -> None:
        """A message the adapter cannot take (a queue name no queue can have) is that
        message's error alone: the others are confirmed."""
        outgoing = [
            Outgoing(message("before")),
            Outgoing(message("odd", queue="a queue {with} spaces and braces")),
            Outgoing(message("after")),
        ]
        results = await env.queue.publish_many(outgoing)
        assert len(results) == 3 and results[0] is None and results[2] is None
        got = await env.receive_soon(max_messages=10)
        names = set(job_ids(got))
        if results[1] is None:  # an adapter that takes any queue name (memory, PostgreSQL)
            assert names == {"before", "after"}
        else:
            assert isinstance(results[1], PublishRefused | ConfigError), results[1]
            assert names == {"before", "after"}

    async def test_size_counts_due_and_total_messages_per_queue(self, env: QueueEnv) -> None:
        """A message held back (by a delayed publish, else by a retry with a delay) counts in
        ``total``; an adapter with neither holds nothing back (delays wait in the outbox)."""
        capabilities = env.queue.capabilities
        assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=0)
        scheduled = capabilities.delayed_publish or capabilities.delayed_retry
        if not capabilities.delayed_publish and capabilities.delayed_retry:
            await env.queue.publish(message("scheduled"))
            (held,) = await env.receive(max_messages=1)
            assert await env.queue.retry(held, delay_seconds=60.0, error="later") is True
        for name in ("leased", "due-1", "due-2"):
            await env.queue.publish(message(name))
        if capabilities.delayed_publish:
            await env.queue.publish(message("scheduled"), delay_seconds=env.delay_seconds)
        await env.queue.publish(message("elsewhere", queue=OTHER_QUEUE))
        assert job_ids(await env.receive(max_messages=1)) == ["leased"]

        total = 4 if scheduled else 3
        assert await env.queue.size([QUEUE]) == QueueSize(due=2, total=total)
        assert await env.queue.size([QUEUE, OTHER_QUEUE]) == QueueSize(due=3, total=total + 1)
        assert await env.queue.size(["conformance.nobody"]) == QueueSize(due=0, total=0)

    async def test_backlog_counts_every_message_held_until_it_is_acked(self, env: QueueEnv) -> None:
        """What a move away from this queue would leave: ready, scheduled and leased messages
        of every queue, or of the queues named where the adapter cannot list them."""
        lists = env.queue.capabilities.lists_queues
        assert await env.queue.backlog([QUEUE, OTHER_QUEUE]) == 0
        for name in ("leased", "ready"):
            await env.queue.publish(message(name))
        if env.queue.capabilities.delayed_publish:
            await env.queue.publish(message("scheduled"), delay_seconds=env.delay_seconds)
        await env.queue.publish(message("elsewhere", queue=OTHER_QUEUE))
        (leased,) = await env.receive(max_messages=1)
        assert leased.message.job_id == "leased"
        held = 4 if env.queue.capabilities.delayed_publish else 3

        assert await env.queue.backlog([QUEUE, OTHER_QUEUE]) == held
        assert await env.queue.backlog([QUEUE]) == (held if lists else held - 1)
        assert await env.queue.backlog([]) == (held if lists else 0)

        assert await env.queue.ack(leased) is True
        assert await env.queue.backlog([QUEUE, OTHER_QUEUE]) == held - 1

    async def test_receive_with_wait_returns_as_soon_as_a_message_is_published(
        self, env: QueueEnv
    ) -> None:
        loop = asyncio.get_running_loop()
        receiver = asyncio.create_task(
            env.queue.receive(
                [QUEUE], max_messages=5, lease_seconds=env.lease_seconds, wait_seconds=10.0
            )
        )
        try:
            await env.until_receiver_waits()
            assert not receiver.done()
            published = loop.time()
            await env.queue.publish(message("awaited"))
            got = await asyncio.wait_for(receiver, timeout=5.0)
        finally:
            receiver.cancel()
        assert job_ids(got) == ["awaited"]
        assert loop.time() - published < 2.0

    async def test_receive_with_wait_returns_empty_when_nothing_arrives(
        self, env: QueueEnv
    ) -> None:
        await env.queue.publish(message("elsewhere", queue=OTHER_QUEUE))
        loop = asyncio.get_running_loop()
        started = loop.time()
        got = await env.queue.receive(
            [QUEUE], max_messages=5, lease_seconds=env.lease_seconds, wait_seconds=0.3
        )
        elapsed = loop.time() - started
        assert got == []
        assert 0.29 <= elapsed < 3.0

    async def test_messages_are_received_in_order_of_due_time(self, env: QueueEnv) -> None:
        if not env.queue.capabilities.delayed_publish:
            with pytest.raises(ConfigError, match="delayed publish"):
                await env.queue.publish(message("due-last"), delay_seconds=env.delay_seconds)
            assert (await env.queue.size([QUEUE])).total == 0, "a refused publish adds nothing"
            for name in ("due-first", "due-second", "due-third"):
                await env.queue.publish(message(name))
            order = [job_ids(await env.receive(max_messages=1)) for _ in range(3)]
            assert order == [["due-first"], ["due-second"], ["due-third"]]
            return
        await env.queue.publish(message("due-last"), delay_seconds=env.delay_seconds)
        await env.queue.publish(message("due-fourth"), delay_seconds=env.delay_seconds / 2)
        for name in ("due-first", "due-second", "due-third"):
            await env.queue.publish(message(name))
        await env.elapse(env.delay_seconds + 1)

        async def all_due() -> bool:
            return (await env.queue.size([QUEUE])).due == 5

        await wait_until(all_due, timeout=0.0 if env.clock is not None else 10.0, message="all due")
        order = [job_ids(await env.receive(max_messages=1)) for _ in range(5)]
        assert order == [["due-first"], ["due-second"], ["due-third"], ["due-fourth"], ["due-last"]]

    async def test_publish_joins_the_callers_transaction_or_is_refused(self, env: QueueEnv) -> None:
        if not env.queue.capabilities.transactional:
            tx = env.work_conn if env.work_conn is not None else _STAND_IN_TX
            with pytest.raises(ConfigError, match="not transactional"):
                await env.queue.publish(message("refused"), tx=tx)
            assert (await env.queue.size([QUEUE])).total == 0
            return
        conn = env.work_conn
        assert conn is not None, "a transactional adapter's env provides work_conn"

        async with conn.transaction():
            await env.queue.publish(message("rolled-back"), tx=conn)
            raise psycopg.Rollback()
        async with conn.transaction():
            await env.queue.publish(message("committed"), tx=conn)
            assert await env.receive() == [], "visible before the caller's commit"

        assert job_ids(await env.receive()) == ["committed"]
        assert (await env.queue.size([QUEUE])).total == 1

    async def test_ack_joins_the_callers_transaction_or_is_refused(self, env: QueueEnv) -> None:
        await env.queue.publish(message("worked"))
        (delivery,) = await env.receive()
        if not env.queue.capabilities.transactional:
            tx = env.work_conn if env.work_conn is not None else _STAND_IN_TX
            with pytest.raises(ConfigError, match="not transactional"):
                await env.queue.ack(delivery, tx=tx)
            assert (await env.queue.size([QUEUE])).total == 1
            await env.queue.ack(delivery)
            assert (await env.queue.size([QUEUE])).total == 0
            return
        conn = env.work_conn
        assert conn is not None, "a transactional adapter's env provides work_conn"

        async with conn.transaction():
            await env.queue.ack(delivery, tx=conn)
            raise psycopg.Rollback()
        assert (await env.queue.size([QUEUE])).total == 1, "a rolled-back ack must not remove"

        async with conn.transaction():
            assert await env.queue.ack(delivery, tx=conn) is True
        assert (await env.queue.size([QUEUE])).total == 0

    async def test_close_wakes_a_waiting_receiver(self, env: QueueEnv) -> None:
        receiver = asyncio.create_task(
            env.queue.receive(
                [QUEUE], max_messages=5, lease_seconds=env.lease_seconds, wait_seconds=10.0
            )
        )
        try:
            await env.until_receiver_waits()
            assert not receiver.done()
            await env.queue.close()
            got = await asyncio.wait_for(receiver, timeout=3.0)
        finally:
            receiver.cancel()
        assert got == []
        await env.queue.close()  # closing twice is harmless


class BrokerConformance(QueueConformance):
    """What a broker shows and the PostgreSQL queue never had: a client connection that drops
    while it holds a lease, a delivery count kept by the broker (a fresh client sees it), and an
    ack that comes after the lease was lost. The env provides ``open_queue`` and
    ``drop_connection``."""

    async def test_a_delivery_whose_connection_drops_comes_back_with_the_next_attempt(
        self, env: QueueEnv
    ) -> None:
        assert env.open_queue is not None and env.drop_connection is not None
        await env.queue.publish(message("dropped"))
        (first,) = await env.receive()
        assert first.attempt == 1

        await env.drop_connection()
        other = await env.open_queue()
        (second,) = await env.receive_soon(on=other)

        assert (second.message, second.attempt) == (first.message, 2)
        assert await other.ack(second) is True
        assert await other.size([QUEUE]) == QueueSize(due=0, total=0)

    async def test_the_delivery_count_is_kept_by_the_broker_not_the_client(
        self, env: QueueEnv
    ) -> None:
        assert env.open_queue is not None
        await env.queue.publish(message("counted"))
        (first,) = await env.receive()
        await env.elapse(env.lease_seconds + 1)
        (second,) = await env.receive_soon()
        assert second.attempt == 2
        await env.queue.close()  # the client that counted goes away, holding the lease

        fresh = await env.open_queue()
        (third,) = await env.receive_soon(on=fresh)
        assert (third.message, third.attempt) == (first.message, 3)
        assert await fresh.retry(third, delay_seconds=0.0, error="Flaky: again") is True
        await fresh.close()

        later = await env.open_queue()
        (fourth,) = await env.receive_soon(on=later)
        assert (fourth.message, fourth.attempt) == (first.message, 4)
        assert await later.ack(fourth) is True

    async def test_an_ack_after_the_lease_was_lost_is_refused_and_the_new_holder_keeps_it(
        self, env: QueueEnv
    ) -> None:
        assert env.open_queue is not None
        await env.queue.publish(message("late"))
        (late,) = await env.receive()
        other = await env.open_queue()
        (current,) = await env.receive_soon(on=other)  # once the first lease has run out
        assert current.attempt == 2

        assert await env.queue.ack(late) is False
        assert await env.queue.extend(late, lease_seconds=env.lease_seconds) is False
        assert await env.queue.retry(late, delay_seconds=0.0, error="late worker") is False
        await env.queue.release(late)

        assert await other.size([QUEUE]) == QueueSize(due=0, total=1)
        assert await env.receive(on=other) == []
        assert await other.ack(current) is True
        assert await other.size([QUEUE]) == QueueSize(due=0, total=0)

    async def test_a_delayed_retry_arrives_no_sooner_than_its_delay_and_within_the_tolerance(
        self, env: QueueEnv
    ) -> None:
        """D2 on a broker with native delayed retry: a retry's delay holds, within +5% and a
        second of polling. A broker without it refuses the delay and keeps the lease; its
        retries go through the outbox (tests/test_retries_through_the_outbox.py)."""
        loop = asyncio.get_running_loop()
        await env.queue.publish(message("scheduled-retry"))
        (first,) = await env.receive()
        delay = 1.5
        if not env.queue.capabilities.delayed_retry:
            with pytest.raises(ConfigError, match="has no delayed retry"):
                await env.queue.retry(first, delay_seconds=delay, error="Flaky: later")
            assert await env.queue.ack(first) is True, "the refused retry left the lease held"
            assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=0)
            return
        retried_at = loop.time()
        assert await env.queue.retry(first, delay_seconds=delay, error="Flaky: later") is True

        (second,) = await env.receive_soon()
        waited = loop.time() - retried_at

        assert second.attempt == 2
        assert delay <= waited <= delay * 1.05 + 1.0

    async def test_size_sees_another_clients_lease_or_declares_that_it_does_not(
        self, env: QueueEnv
    ) -> None:
        assert env.open_queue is not None
        other = await env.open_queue()
        await env.queue.publish(message("theirs"))
        (theirs,) = await env.receive(on=other)

        if env.queue.capabilities.exact_size:
            assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=1)
        else:
            assert await env.queue.size([QUEUE]) == QueueSize(due=0, total=0), (
                "declared: another client's lease is not seen"
            )
        assert await other.size([QUEUE]) == QueueSize(due=0, total=1)
        assert await other.ack(theirs) is True
