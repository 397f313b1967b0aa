"""A queue on RabbitMQ quorum queues (``pip install 'jobfence[rabbitmq]'``).

Each jobfence queue is a durable quorum queue ``<prefix>.<queue>`` on the default exchange.
Every publish waits for the broker's publisher confirm; messages are persistent.

- **Lease**: an unacked delivery (``basic.get``) on this adapter's channel. The adapter holds
  it for ``lease_seconds`` by its own timer and then gives it back (``basic.reject`` with
  requeue), so a hung async handler loses its message after its lease. If the process dies or
  its connection drops, the broker requeues every unacked delivery at once; if the event loop
  itself is blocked, the broker closes the connection when heartbeats stop (60 s by default),
  and its ``consumer_timeout`` (30 min by default) is the last backstop.
- **Attempt**: the quorum queue's ``x-delivery-count`` header (raised by the broker on every
  return: reject, nack, channel or connection loss) + 1, plus the deliveries of earlier copies
  of the same job (the ``x-jobfence-prior`` header of a republished message).
- **Stale receipts**: a delivery whose lease timer fired, or whose channel closed, refuses
  ack, retry and release (``capabilities.exact_stale_ack`` is False: after its lease a
  delivery is refused even if nobody took the message over yet; the broker has it again).
- **Retry and release** republish a copy with ``x-jobfence-prior`` set (waiting for the
  confirm) and then ack the original; a crash in between leaves one more delivery, which the
  fence absorbs. A release's copy carries the count so far minus one: it does not count.
- **Delays** without a plugin: a delayed publish or retry goes to a wait queue
  ``<prefix>.<queue>.wait.<ms>`` (a quorum queue with that message TTL, dead-lettering
  at-least-once back into the queue, expiring a minute after its last use). Delays are rounded
  up to a ladder of steps 5% apart (from 100 ms), so a delay is kept within +5% (plus up to a
  second for the broker's TTL check and the receiver's poll), and a queue has at most about 220
  wait queues, each existing only while in use.
- **Size**: AMQP shows a queue's ready messages only. ``size`` adds what this adapter instance
  holds (leases) and scheduled (counted until 5 s after each falls due, to cover its way back
  from the wait queue); leases and delayed messages of other instances are not seen
  (``capabilities.exact_size`` is False).
- A waiting ``receive`` polls with ``basic.get`` every 50 ms.

Not transactional: ``publish`` and ``ack`` refuse a database transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg import AsyncConnection

from jobfence.errors import ConfigError
from jobfence.model import Delivery, Message
from jobfence.ports import QueueCapabilities, QueueSize

try:
    import aio_pika
    from aio_pika.abc import (
        AbstractChannel,
        AbstractConnection,
        AbstractIncomingMessage,
        AbstractQueue,
    )
    from aiormq.exceptions import ChannelNotFoundEntity
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "jobfence.adapters.rabbitmq needs aio-pika: pip install 'jobfence[rabbitmq]'"
    ) from exc

_H_CONSUMER = "x-jobfence-consumer"
_H_JOB_ID = "x-jobfence-job-id"
_H_TENANT = "x-jobfence-tenant-id"
_H_CORRELATION = "x-jobfence-correlation-id"
_SHORTSTR_BYTES = 255  # AMQP's message-id and correlation-id properties hold no more
_H_PRIOR = "x-jobfence-prior"
_NAME = re.compile(r"^[A-Za-z0-9_.\-:]+$")
_POLL_SECONDS = 0.05
_WAIT_STEP = 1.05
_WAIT_BASE_MS = 100
_WAIT_EXPIRES_EXTRA_MS = 60_000
_ARRIVAL_GRACE = 5.0


def _lost(conn: AbstractConnection) -> bool:
    """True when ``conn`` is closed, or was lost: aio-pika's ``is_closed`` stays False after the
    broker or the network drops the connection (only ``close()`` sets it), while ``connected``
    is cleared and the transport's own connection is closed."""
    if conn.is_closed or not conn.connected.is_set():
        return True
    transport = conn.transport
    return transport is None or transport.connection.is_closed


def _short(value: str | None) -> str | None:
    if value is None or len(value.encode()) > _SHORTSTR_BYTES:
        return None
    return value


def wait_bucket_ms(delay_seconds: float) -> int:
    """The wait queue TTL for ``delay_seconds``: the smallest ladder step at or above it."""
    wanted = max(delay_seconds * 1000.0, _WAIT_BASE_MS)
    step = math.ceil(math.log(wanted / _WAIT_BASE_MS, _WAIT_STEP) - 1e-9)
    return math.ceil(_WAIT_BASE_MS * _WAIT_STEP**step)


@dataclass(slots=True, eq=False)
class RabbitReceipt:
    incoming: AbstractIncomingMessage
    channel: AbstractChannel
    queue_name: str
    prior: int
    delivery_count: int
    settled: bool = False
    lost: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


def _receipt(delivery: Delivery) -> RabbitReceipt:
    receipt = delivery.receipt
    if not isinstance(receipt, RabbitReceipt):
        raise TypeError("this delivery did not come from RabbitMQQueue")
    return receipt


def _refuse_tx(operation: str) -> ConfigError:
    return ConfigError(
        f"RabbitMQQueue is not transactional (capabilities.transactional is False): it cannot "
        f"{operation} inside a database transaction; call it without tx= after the "
        "transaction commits"
    )


class RabbitMQQueue:
    """The RabbitMQ queue adapter. ``url`` is an ``amqp://`` or ``amqps://`` URL; ``prefix``
    starts the name of every queue it declares."""

    capabilities = QueueCapabilities(
        transactional=False, delayed_publish=True, exact_stale_ack=False, exact_size=False
    )

    def __init__(
        self, url: str = "amqp://guest:guest@127.0.0.1:5672/", *, prefix: str = "jobfence"
    ) -> None:
        if not _NAME.match(prefix):
            raise ConfigError(f"prefix must be letters, digits, _ . - or :, got {prefix!r}")
        self._url = url
        self._prefix = prefix
        self._conn: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()
        self._declared: dict[str, AbstractQueue] = {}
        self._held: set[RabbitReceipt] = set()
        # queue -> when each message this instance scheduled falls due (loop time)
        self._scheduled: dict[str, list[float]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    # -- connection and queues -----------------------------------------------------------

    async def _open_channel(self) -> AbstractChannel:
        async with self._lock:
            if self._closed:
                raise ConfigError("this RabbitMQQueue is closed")
            if self._channel is None or self._channel.is_closed:
                if self._conn is None or _lost(self._conn):
                    if self._conn is not None:
                        with contextlib.suppress(Exception):
                            await self._conn.close()
                    self._conn = await aio_pika.connect(self._url)
                self._channel = await self._conn.channel(publisher_confirms=True)
                self._declared.clear()
            return self._channel

    def _name(self, queue: str) -> str:
        if not _NAME.match(queue):
            raise ConfigError(
                f"a RabbitMQ queue name is letters, digits, _ . - or :, got {queue!r}"
            )
        return f"{self._prefix}.{queue}"

    async def _queue(self, queue: str) -> AbstractQueue:
        channel = await self._open_channel()
        name = self._name(queue)
        declared = self._declared.get(name)
        if declared is None:
            declared = await channel.declare_queue(
                name, durable=True, arguments={"x-queue-type": "quorum"}
            )
            self._declared[name] = declared
        return declared

    async def _wait_queue(self, queue: str, delay_seconds: float) -> str:
        channel = await self._open_channel()
        ttl = wait_bucket_ms(delay_seconds)
        name = f"{self._name(queue)}.wait.{ttl}"
        # Declared on every use: that restarts its expiry, which always outlasts the TTL.
        await channel.declare_queue(
            name,
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-message-ttl": ttl,
                "x-expires": ttl + _WAIT_EXPIRES_EXTRA_MS,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": self._name(queue),
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
            },
        )
        return name

    # -- the port -----------------------------------------------------------------------

    async def publish(
        self,
        message: Message,
        *,
        delay_seconds: float = 0.0,
        tx: AsyncConnection[Any] | None = None,
    ) -> None:
        if tx is not None:
            raise _refuse_tx("publish")
        await self._publish(message, prior=0, delay_seconds=delay_seconds)

    async def _publish(self, message: Message, *, prior: int, delay_seconds: float) -> None:
        await self._queue(message.queue)
        if delay_seconds > 0:
            routing_key = await self._wait_queue(message.queue, delay_seconds)
            due_at = asyncio.get_running_loop().time() + wait_bucket_ms(delay_seconds) / 1000
            self._scheduled.setdefault(message.queue, []).append(due_at)
        else:
            routing_key = self._name(message.queue)
        # The ids travel in headers (any length); the AMQP properties repeat them for tools
        # when they fit.
        headers: dict[str, Any] = {
            _H_CONSUMER: message.consumer,
            _H_JOB_ID: message.job_id,
            _H_PRIOR: prior,
        }
        if message.tenant_id is not None:
            headers[_H_TENANT] = message.tenant_id
        if message.correlation_id is not None:
            headers[_H_CORRELATION] = message.correlation_id
        channel = await self._open_channel()
        await channel.default_exchange.publish(  # returns once the broker confirmed it
            aio_pika.Message(
                message.body,
                headers=headers,
                message_id=_short(message.job_id),
                correlation_id=_short(message.correlation_id),
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=routing_key,
            mandatory=True,
        )

    async def receive(
        self,
        queues: Sequence[str],
        *,
        max_messages: int,
        lease_seconds: float,
        wait_seconds: float = 0.0,
    ) -> list[Delivery]:
        if max_messages <= 0 or self._closed:
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        try:
            while True:
                got: list[Delivery] = []
                for queue in queues:
                    amqp_queue = await self._queue(queue)
                    while len(got) < max_messages:
                        incoming = await amqp_queue.get(no_ack=False, fail=False)
                        if incoming is None:
                            break
                        got.append(self._delivery(queue, incoming, lease_seconds))
                if got or self._closed or loop.time() >= deadline:
                    return got
                await asyncio.sleep(min(_POLL_SECONDS, max(deadline - loop.time(), 0)))
        except Exception:
            if self._closed:
                return []
            raise

    def _delivery(
        self, queue: str, incoming: AbstractIncomingMessage, lease_seconds: float
    ) -> Delivery:
        headers = incoming.headers or {}
        prior = int(str(headers.get(_H_PRIOR, 0)))
        count = int(str(headers.get("x-delivery-count", 0)))
        tenant, correlation = headers.get(_H_TENANT), headers.get(_H_CORRELATION)
        message = Message(
            queue=queue,
            consumer=str(headers.get(_H_CONSUMER, "")),
            job_id=str(headers.get(_H_JOB_ID, "")),
            body=bytes(incoming.body),
            tenant_id=None if tenant is None else str(tenant),
            correlation_id=None if correlation is None else str(correlation),
        )
        assert incoming.channel is not None  # a basic.get delivery always has its channel
        channel = self._channel
        assert channel is not None
        receipt = RabbitReceipt(
            incoming=incoming,
            channel=channel,
            queue_name=self._name(queue),
            prior=prior,
            delivery_count=count,
        )
        loop = asyncio.get_running_loop()
        receipt.timer = loop.call_later(lease_seconds, self._lease_ran_out, receipt)
        self._held.add(receipt)
        return Delivery(message=message, attempt=prior + count + 1, receipt=receipt)

    def _lease_ran_out(self, receipt: RabbitReceipt) -> None:
        if receipt.settled or receipt.lost:
            return
        receipt.lost = True
        self._held.discard(receipt)
        if not receipt.channel.is_closed:
            task = asyncio.get_running_loop().create_task(self._give_back(receipt))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    @staticmethod
    async def _give_back(receipt: RabbitReceipt) -> None:
        with contextlib.suppress(Exception):  # a closed channel gives it back by itself
            await receipt.incoming.reject(requeue=True)

    def _take_hold(self, receipt: RabbitReceipt) -> bool:
        """Settle ``receipt`` if it still holds its lease; False for a stale one."""
        if receipt.settled or receipt.lost or receipt.channel.is_closed:
            return False
        receipt.settled = True
        if receipt.timer is not None:
            receipt.timer.cancel()
        self._held.discard(receipt)
        return True

    async def ack(self, delivery: Delivery, *, tx: AsyncConnection[Any] | None = None) -> bool:
        if tx is not None:
            raise _refuse_tx("ack")
        receipt = _receipt(delivery)
        if not self._take_hold(receipt):
            return False
        await receipt.incoming.ack()
        return True

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        for delivery in deliveries:
            await self.ack(delivery)

    async def retry(self, delivery: Delivery, *, delay_seconds: float, error: str) -> bool:
        receipt = _receipt(delivery)
        if not self._take_hold(receipt):
            return False
        await self._republish(
            receipt, delivery.message, prior=delivery.attempt, delay_seconds=delay_seconds
        )
        return True

    async def release(self, delivery: Delivery) -> None:
        receipt = _receipt(delivery)
        if not self._take_hold(receipt):
            return
        await self._republish(
            receipt, delivery.message, prior=delivery.attempt - 1, delay_seconds=0.0
        )

    async def _republish(
        self, receipt: RabbitReceipt, message: Message, *, prior: int, delay_seconds: float
    ) -> None:
        """Publish a copy (confirmed), then ack the original. If the copy cannot be published,
        the original goes back to the queue (and counts), so it never sits unacked."""
        try:
            await self._publish(message, prior=prior, delay_seconds=max(delay_seconds, 0.0))
        except BaseException:
            await self._give_back(receipt)
            raise
        await receipt.incoming.ack()

    async def size(self, queues: Sequence[str]) -> QueueSize:
        """Ready messages (due), plus this instance's leases and scheduled messages (total)."""
        due = total = 0
        now = asyncio.get_running_loop().time()
        for queue in queues:
            name = self._name(queue)
            ready = await self._ready(name)
            held = sum(1 for r in self._held if r.queue_name == name)
            # Counted until a while after they fall due: once expired from its wait queue, a
            # message is on its way back (dead-lettering) and counted by neither queue.
            pending = [t for t in self._scheduled.get(queue, []) if t + _ARRIVAL_GRACE > now]
            self._scheduled[queue] = pending
            due += ready
            total += ready + held + len(pending)
        return QueueSize(due=due, total=total)

    async def _ready(self, name: str) -> int:
        """Messages ready in queue ``name`` (0 when it does not exist), on a channel of its own
        so a missing queue (which closes the channel) leaves the main one open."""
        await self._open_channel()
        assert self._conn is not None
        probe = await self._conn.channel(publisher_confirms=False)
        try:
            declared = await probe.declare_queue(name, passive=True)
        except ChannelNotFoundEntity:
            return 0
        finally:
            with contextlib.suppress(Exception):
                await probe.close()
        return int(declared.declaration_result.message_count or 0)

    async def close(self) -> None:
        """Close the connection (the broker requeues what this instance held); a waiting
        receiver returns an empty list."""
        if self._closed:
            return
        self._closed = True
        for receipt in self._held:
            if receipt.timer is not None:
                receipt.timer.cancel()
        self._held.clear()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()


async def open_queue(url: str) -> RabbitMQQueue:
    """The factory ``JOBFENCE_QUEUE_URL=amqp://...`` uses (``jobfence.queues``): the adapter,
    connected (with its confirming channel), so a bad or unreachable URL fails here."""
    queue = RabbitMQQueue(url)
    try:
        await queue._open_channel()
    except BaseException:
        await queue.close()
        raise
    return queue
