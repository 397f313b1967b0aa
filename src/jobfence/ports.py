"""The ports the core talks through: the queue, the metrics sink and the clock.

Adapters implement them; the core never imports an adapter. Every queue adapter passes the
shared conformance suite in ``tests/queue_conformance.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from psycopg import AsyncConnection

from jobfence.model import Delivery, Message, Outgoing


@dataclass(frozen=True, slots=True)
class QueueCapabilities:
    """What an adapter can do beyond the minimum, declared rather than discovered.

    ``transactional`` means the queue lives in the work database: ``publish`` and ``ack`` can
    join a caller's transaction, so a job's ack commits (or rolls back) with its work, and a
    replay's publish commits with the dead letter's status change.
    """

    transactional: bool
    # True: a database records this queue as where its jobs go (jobfence.settings), and a
    # process on it must publish nowhere else once the database moved. False for memory://,
    # which lives inside one process and is never recorded.
    recorded: bool = True
    # True: ``publish(..., delay_seconds>0)`` holds the message back in the queue itself.
    # False: refused (``ConfigError``); a producer's delayed enqueue waits in the PostgreSQL
    # outbox instead (jobfence.outbox).
    delayed_publish: bool = True
    # True: ``retry(..., delay_seconds>0)`` holds the message back in the queue itself. False:
    # refused (``ConfigError``), and the harness writes a delayed retry to the PostgreSQL outbox
    # instead, acking the delivery after that commit (docs/outbox.md).
    delayed_retry: bool = True
    # True: the queue itself knows which delivery holds a message, so an ack, retry or release
    # is refused exactly when another delivery took it over. False: the adapter refuses them
    # once the delivery's lease ran out by the client's clock, even if nobody took the message
    # over yet (the message is then delivered again).
    exact_stale_ack: bool = True
    # True: ``size`` counts every message of the queue, whoever holds or scheduled it. False:
    # it counts the messages ready in the queue plus those this adapter instance holds or
    # scheduled; other clients' leases and scheduled messages are not seen.
    exact_size: bool = True
    # True: ``backlog`` counts every queue this adapter's place holds (it can list them) and
    # ignores the names it is given. False: it counts the queues it is given (RabbitMQ: AMQP
    # has no way to list a virtual host's queues).
    lists_queues: bool = True


@dataclass(frozen=True, slots=True)
class QueueSize:
    due: int
    total: int


class QueuePort(Protocol):
    """An at-least-once queue that delivers messages under a lease.

    A broker adapter raises :class:`~jobfence.errors.QueueUnavailable` from ``publish``,
    ``receive``, ``ack``, ``ack_many``, ``extend``, ``retry``, ``release`` and ``size`` when its
    broker connection is lost, refused or timed out (the client's error is its ``__cause__``);
    the worker treats that as an outage (D7): it pauses, probes, reconnects and gives back what
    it held, without counting a job's attempt as an error inside jobfence. The PostgreSQL queue
    raises psycopg's own connection errors, which the worker treats the same way.
    """

    @property
    def capabilities(self) -> QueueCapabilities: ...

    async def publish(
        self,
        message: Message,
        *,
        delay_seconds: float = 0.0,
        tx: AsyncConnection[object] | None = None,
        prior_attempts: int = 0,
    ) -> None:
        """Enqueue ``message``, visible after ``delay_seconds``.

        With ``tx`` (transactional adapters only) the message is part of that transaction and
        the adapter never commits it. ``prior_attempts`` counts deliveries of this job already
        made elsewhere (a retry the outbox relay publishes): the first delivery of this message
        has attempt ``prior_attempts + 1``. A delay on an adapter without
        ``capabilities.delayed_publish`` is refused with ``ConfigError``, nothing published.
        """

    async def publish_many(self, outgoing: Sequence[Outgoing]) -> list[Exception | None]:
        """Publish several messages at once (no delay, no transaction), their confirms
        outstanding together: one entry per message, in order, ``None`` once the broker
        confirmed that message, else the error it met (``QueueUnavailable`` when the broker is
        unreachable, :class:`~jobfence.errors.PublishRefused` when the broker refuses that
        message for good). It does not raise for one message's failure; a message it returns
        ``None`` for is confirmed, as after :meth:`publish` returned. The outbox relay
        publishes through it."""

    async def receive(
        self,
        queues: Sequence[str],
        *,
        max_messages: int,
        lease_seconds: float,
        wait_seconds: float = 0.0,
    ) -> list[Delivery]:
        """Take up to ``max_messages`` due messages, each under a lease of ``lease_seconds``.

        Waits up to ``wait_seconds`` for one to arrive when none is due. A delivery not acked,
        retried or released before its lease runs out is delivered again, with its attempt
        count one higher.
        """

    async def ack(self, delivery: Delivery, *, tx: AsyncConnection[object] | None = None) -> bool:
        """Remove a delivered message for good (within ``tx`` for transactional adapters).

        False when this delivery's lease was lost (the message was delivered again, or is gone
        already): nothing is removed. An adapter that cannot tell returns True."""

    async def extend(self, delivery: Delivery, *, lease_seconds: float) -> bool:
        """Keep holding ``delivery``: its lease now runs ``lease_seconds`` from now. The
        delivery is not counted (the next delivery's attempt is the same as without it).

        False, changing nothing, when this delivery's lease was lost or it was settled (acked,
        retried, released), by the same rule as :meth:`ack` (``capabilities.exact_stale_ack``).
        A broker whose lease is its own setting renews that setting instead of taking
        ``lease_seconds`` (NATS: the consumer's AckWait; Redis: the receivers' idle time), so
        extend with the lease the delivery was received with."""

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """Remove several delivered messages for good, outside any transaction (the worker acks
        finished jobs in batches after their commit). Like :meth:`ack`, a delivery whose lease
        was lost or that was already acked is skipped."""

    async def retry(self, delivery: Delivery, *, delay_seconds: float, error: str) -> bool:
        """Deliver the message again after ``delay_seconds``; the next attempt counts.

        False, changing nothing, when this delivery's lease was lost (as for :meth:`ack`). A
        delay on an adapter without ``capabilities.delayed_retry`` is refused with
        ``ConfigError``, changing nothing (the delivery still holds its lease)."""

    async def release(self, delivery: Delivery) -> None:
        """Give the message back at once without counting this delivery (shutdown, outage)."""

    async def size(self, queues: Sequence[str]) -> QueueSize:
        """How many messages are due now and held in total (due, scheduled or leased)."""

    async def backlog(self, queues: Sequence[str]) -> int:
        """Every message this queue still holds, whoever holds it (ready, scheduled, leased):
        what a move of the database away from it would leave behind.

        An adapter that can list its queues (``capabilities.lists_queues``) counts all of them
        and ignores ``queues``; one that cannot counts the queues named. Where
        ``capabilities.exact_size`` is False, messages other clients hold under a lease are not
        seen (they count again once given back)."""

    async def close(self) -> None: ...


class Clock(Protocol):
    """Wall-clock time for scheduling. Inject a fake one in tests instead of sleeping."""

    def now(self) -> datetime: ...


class MetricsSink(Protocol):
    """Where the harness reports outcomes. Labels stay bounded: never job ids or attempts."""

    def job_outcome(self, queue: str, consumer: str, outcome: str) -> None: ...

    def handler_duration(self, queue: str, consumer: str, seconds: float) -> None: ...

    # A group of jobs in one transaction (group commit) ended: ``result`` is ``committed`` or
    # ``rolled_back`` (its jobs then run one transaction each).
    def job_group(self, queue: str, consumer: str, result: str) -> None: ...


class LeaseMetricsSink(Protocol):
    """Where the worker reports the leases it keeps alive (``max_handler_seconds``).

    ``result`` is ``extended``, ``lost`` (the queue refused: the lease was gone) or ``failed``
    (an error; tried again while the lease lasts). Labels stay bounded: never job ids."""

    def lease_extension(self, queue: str, consumer: str, result: str) -> None: ...

    def handler_over_limit(self, queue: str, consumer: str) -> None:
        """A handler ran past ``max_handler_seconds``: its lease is no longer extended."""


class LoopMetricsSink(Protocol):
    """Where the worker reports its event loop blocked past ``blocked_loop_seconds``
    (:mod:`jobfence.blocked_loop`): ``queue`` and ``consumer`` are those of the async handler
    that held it, both empty when none did. Labels stay bounded: never job ids."""

    def event_loop_blocked(self, queue: str, consumer: str) -> None:
        """A block was noticed (once per block, while it lasts). Called from the watchdog's
        own thread, not from the event loop (which is blocked)."""

    def event_loop_unblocked(self, queue: str, consumer: str, seconds: float) -> None:
        """The loop runs again after a block noticed, ``seconds`` long in all (on the loop)."""


class CleanupMetricsSink(Protocol):
    """Where the fence cleanup reports: rows removed (per committed batch), each success and
    each failed round."""

    def cleanup_rows_removed(self, count: int) -> None: ...

    def cleanup_succeeded(self) -> None: ...

    def cleanup_failed(self) -> None: ...


class AlertMetricsSink(Protocol):
    """Where the alert relay reports. ``kind`` is the alert's kind (dead_letters, escalation);
    ``reason`` one of network, rate_limited, server_error, rejected. Never a dead letter id."""

    def alert_sent(self, kind: str) -> None: ...

    def alert_failed(self, kind: str, reason: str) -> None: ...

    def alerts_pending(self, count: int) -> None: ...

    def incident_action(self, action: str) -> None:
        """One step of an incident's lifecycle at Better Stack: opened, merged (a group's dead
        letters counted on the open incident), updated (a comment), resolved (by the relay),
        resolved_by_person (seen), escalated."""

    def alerts_refused(self, count: int) -> None:
        """Alerts and resolves refused for good, as the relay last counted them."""

    def heartbeat_state(self, ok: bool) -> None:
        """What the relay's heartbeat last reported: success (True) or failure."""
