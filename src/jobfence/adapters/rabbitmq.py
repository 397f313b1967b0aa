"""A queue on RabbitMQ quorum queues (``pip install 'jobfence[rabbitmq]'``).

Each jobfence queue is a durable quorum queue ``<prefix>.<queue>`` on the default exchange.
Every publish waits for the broker's publisher confirm; messages are persistent.

- **Receiving**: one push consumer (``basic.consume``) per queue, started by the first
  ``receive`` naming it, with a prefetch (``basic.qos``, per consumer) of that call's
  ``max_messages`` plus 100 (room for the worker's batched acks: a finished job stays unacked
  until its ack batch goes), or ``prefetch=`` if given. The adapter buffers what the broker
  pushes and ``receive`` hands it out; when the buffer is empty, a ``receive`` makes one round
  trip and then takes what is ready with ``basic.get`` (a consumer whose prefetch is all
  leased). A buffered message not handed out within 5 s (or the latest ``receive``'s lease,
  if shorter) means the receiver is busy: the consumer pauses (``basic.cancel``; the next
  ``receive`` starts it again) and its buffer goes back to the queue as uncounted copies (as
  ``release`` does), for other workers to take. ``close`` returns the buffer the same way.
  Deliveries are read straight from aiormq's frames (:class:`_Incoming`); ``ack_many`` acks a
  run of them with one ``basic.ack`` (``multiple``).
- **Lease**: an unacked delivery handed out by ``receive``. The adapter holds it for
  ``lease_seconds`` by its own timer and then gives it back (``basic.reject`` with requeue),
  so a hung async handler loses its message after its lease; ``extend`` restarts that timer.
  If the process dies or its connection drops, the broker requeues every unacked delivery at
  once; if the event loop itself is blocked, the broker closes the connection when heartbeats
  stop (60 s by default), and its ``consumer_timeout`` (30 min by default, counted from the
  delivery: an extended lease does not move it) is the last backstop.
- **Attempt**: the quorum queue's ``x-delivery-count`` header (raised by the broker on every
  return: reject, nack, channel or connection loss) + 1, plus the deliveries of earlier copies
  of the same job (the ``x-jobfence-prior`` header of a republished message, or of one
  published with ``prior_attempts``). A message
  buffered but never handed out is returned as a copy that keeps its count, so it does not
  count; if the connection drops (or the process dies) the broker returns it counted, so an
  attempt can then be one higher than the handler runs.
- **Reading**: every header is read once, with its bounds, by ``read_delivery`` (at delivery
  and when a buffered message is given back); a message whose header does not parse is a
  delivery marked ``unreadable`` (the harness dead-letters it, whole), and a release or a
  give-back returns it as it was published, never as a copy with rewritten headers.
- **Stale receipts**: a delivery whose lease timer fired, or whose channel closed, refuses
  ack, extend, retry and release (``capabilities.exact_stale_ack`` is False: after its lease a
  delivery is refused even if nobody took the message over yet; the broker has it again).
- **Retry and release** republish a copy with ``x-jobfence-prior`` set (waiting for the
  confirm) and then ack the original; a crash in between leaves one more delivery, which the
  fence absorbs. A release's copy carries the count so far minus one: it does not count.
- **Delays**: RabbitMQ holds a message back only with a plugin or TTL queues, and the adapter
  uses neither: ``capabilities.delayed_publish`` and ``delayed_retry`` are False, and a publish
  or a retry with a delay is refused. A delayed enqueue, and a retry with a delay (the harness
  writes it), wait in the PostgreSQL outbox until due; the outbox relay then publishes them
  here.
- **Size**: AMQP shows a queue's ready messages only. ``size`` adds what this adapter instance
  buffered (due) and holds (leases); the buffers and leases of other instances are not seen
  (``capabilities.exact_size`` is False).
- A waiting ``receive`` wakes when the consumer delivers.
- **Close** cancels the consumers, returns the buffered messages, and makes one more round trip
  (``basic.qos``) on the channel before closing the connection: a quorum queue can otherwise
  drop acks sent just before the connection closes (those messages would come back).

Not transactional: ``publish`` and ``ack`` refuse a database transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from psycopg import AsyncConnection

from jobfence.adapters._shared import (
    FieldNames,
    check_prior_attempts,
    read_delivery,
    receipt_of,
    refuse_delay,
    refuse_tx,
)
from jobfence.adapters._unavailable import as_unavailable, hold_back, unavailable_on
from jobfence.errors import ConfigError, PublishRefused, QueueUnavailable
from jobfence.limits import checked_delay, shown_value
from jobfence.model import Delivery, Message, Outgoing
from jobfence.ports import QueueCapabilities, QueueSize

try:
    import aio_pika
    import aiormq.abc
    from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractQueue
    from aiormq import spec
    from aiormq.abc import ChannelFrame
    from aiormq.exceptions import (
        AMQPConnectionError,
        ChannelClosed,
        ChannelNotFoundEntity,
        ChannelPreconditionFailed,
        DeliveryError,
        InvalidFrameError,
        ProtocolSyntaxError,
    )

    from jobfence.adapters._amqp import UnreadableHeader, content_frames, tolerant_headers
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "jobfence.adapters.rabbitmq needs aio-pika: pip install 'jobfence[rabbitmq]'"
    ) from exc


log = logging.getLogger("jobfence.adapters.rabbitmq")

# A lost or refused connection (aiormq's AMQPConnectionError, the socket's ConnectionError), a
# timeout, or aio-pika's "closed" RuntimeError: the broker is unreachable (D7). A frame aiormq's
# reader could not decode (ProtocolSyntaxError, InvalidFrameError) stopped that reader: the
# connection is as lost, and the calls waiting on it fail with that error.
_CONNECTION_ERRORS = (AMQPConnectionError, ConnectionError, TimeoutError, ProtocolSyntaxError)
_unavailable = unavailable_on("RabbitMQ", _CONNECTION_ERRORS)
# aiormq handles RabbitMQ's connection.blocked and connection.unblocked (a resource alarm) in
# these methods of its Connection, and logs each with the connection's repr; the adapter wraps
# them on its connections (_watch_blocking) to say what the alarm means for jobs instead.
_BLOCKED_HANDLER = "_Connection__handle_connection_blocked"
_UNBLOCKED_HANDLER = "_Connection__handle_connection_unblocked"
_UNBLOCKED_EVENT = "_Connection__connection_unblocked"
_CAN_WATCH_BLOCKING = all(
    callable(getattr(aiormq.Connection, name, None))
    for name in (_BLOCKED_HANDLER, _UNBLOCKED_HANDLER)
)
# aiormq logs a refused or failed connection at ERROR before raising it, and with every lost
# connection and failed reconnection its ERROR "Unexpected connection close from remote" and
# WARNING "Cancelling cause reader exited abnormally"; the adapter raises each as its own error
# (one line at start-up, or the worker's and the relay's outage lines), so the client's lines
# are held back (shown with `jobfence -v`); and so are its lines for a blocked connection when
# the adapter says it itself.
hold_back(
    "aiormq.connection",
    (
        "error when creating transport",
        "Unexpected connection close from remote",
        "Cancelling cause reader",
    )
    + (("Connection %r was blocked", "Connection %r was unblocked") if _CAN_WATCH_BLOCKING else ()),
)

_H_CONSUMER = "x-jobfence-consumer"
_H_JOB_ID = "x-jobfence-job-id"
_H_TENANT = "x-jobfence-tenant-id"
_H_CORRELATION = "x-jobfence-correlation-id"
_SHORTSTR_BYTES = 255  # AMQP's message-id and correlation-id properties hold no more
_H_PRIOR = "x-jobfence-prior"
_H_TRACEPARENT = "traceparent"  # the W3C names, as other OpenTelemetry clients use
_H_TRACESTATE = "tracestate"
_H_COUNT = "x-delivery-count"  # set by the broker: the deliveries before this one
_NAMES = FieldNames(
    consumer=f"header {_H_CONSUMER}",
    job_id=f"header {_H_JOB_ID}",
    tenant_id=f"header {_H_TENANT}",
    correlation_id=f"header {_H_CORRELATION}",
    prior=f"header {_H_PRIOR}",
    delivered=f"header {_H_COUNT}",
)
_NAME = re.compile(r"^[A-Za-z0-9_.\-:]+$")
# A consumer's prefetch is what the first receive asked for plus this: a finished job stays
# unacked until the worker's ack batch goes (up to 100 acks or 0.1 s by default).
_ACK_ROOM = 100
# A message buffered this long (or a lease, if shorter) without a receive taking it: the
# receiver is busy, so its consumer pauses and the buffer goes back to the queue.
_BUFFER_SECONDS = 5.0
_FIRST_PUSHES_SECONDS = 1.0  # the longest a new consumer waits for the pushes of what is ready
_WAKE_SECONDS = 0.5  # a waiting receive re-checks its consumers (a dropped channel) this often


def _lost(conn: AbstractConnection) -> bool:
    """True when ``conn`` is closed, or was lost: aio-pika's ``is_closed`` stays False after the
    broker or the network drops the connection (only ``close()`` sets it), while ``connected``
    is cleared and the transport's own connection is closed."""
    if conn.is_closed or not conn.connected.is_set():
        return True
    transport = conn.transport
    return transport is None or transport.connection.is_closed


def _why_lost(conn: AbstractConnection) -> str:
    """`` (<error class>)`` when aiormq's reader of ``conn`` stopped on an error: the class
    only, as its text can quote what the broker sent."""
    transport = conn.transport
    reader = None if transport is None else getattr(transport.connection, "_reader_task", None)
    reader = getattr(reader, "task", reader)  # aiormq wraps its tasks in a TaskWrapper
    if not isinstance(reader, asyncio.Future) or not reader.done() or reader.cancelled():
        return ""
    error = reader.exception()
    return "" if error is None else f" ({type(error).__name__})"


async def _connect(url: str) -> AbstractConnection:
    """``aio_pika.connect(url)``, with the broker's refusal of the URL's virtual host said so:
    RabbitMQ answers an unknown (or forbidden) vhost by closing the connection, which aiormq
    reports as an ``InvalidFrameError`` showing a frame object's repr. The connection reads a
    content header pamqp cannot decode as unreadable instead of dying (:func:`tolerant_headers`)."""
    try:
        with tolerant_headers():
            conn = await aio_pika.connect(url)
    except InvalidFrameError as exc:
        if "Connection.Close" not in str(exc) or "OpenOk" not in str(exc):
            raise
        path = urlsplit(url).path
        vhost = unquote(path[1:]) if len(path) > 1 else "/"
        user = unquote(urlsplit(url).username or "guest")
        raise ConfigError(
            f"RabbitMQ refused the virtual host {vhost!r}: it does not exist, or the user "
            f"{user!r} has no permission on it (rabbitmqctl add_vhost {vhost}; rabbitmqctl "
            f"set_permissions -p {vhost} {user} '.*' '.*' '.*'); the vhost is the URL's path, "
            "percent-encoded: amqp://HOST:5672/%2F for the default one"
        ) from None
    _watch_blocking(conn)
    return conn


def _watch_blocking(conn: AbstractConnection) -> None:
    """Say what RabbitMQ's ``connection.blocked`` means for jobs: while a resource alarm is
    raised (memory over ``vm_memory_high_watermark``, free disk under ``disk_free_limit``) the
    broker stops reading from every publishing connection, so a publish waits (its confirm
    with it) until the alarm clears; nothing is lost, and nothing is unreachable. One WARNING
    naming the alarm when blocked, one INFO when unblocked. Wraps aiormq's own handlers of the
    two frames on this connection (only when the frames come, never per message); on an aiormq
    without them, aiormq's own lines stand."""
    transport = conn.transport
    raw = None if transport is None else transport.connection
    if raw is None or not _CAN_WATCH_BLOCKING:
        return
    on_blocked = getattr(raw, _BLOCKED_HANDLER)
    on_unblocked = getattr(raw, _UNBLOCKED_HANDLER)
    since: list[float] = []  # when the broker blocked it, while it is

    def went_blocked(reason: object) -> None:
        if since:
            return
        since.append(time.monotonic())
        log.warning(
            "RabbitMQ blocked publishing on this connection: a resource alarm is raised (%s);"
            " publishes wait, unconfirmed, until it clears, and nothing is lost (the outbox"
            " keeps the jobs); rabbitmqctl status lists the alarm: free memory (over"
            " vm_memory_high_watermark) or disk (under disk_free_limit)",
            reason if isinstance(reason, str) and reason else "alarm not named",
        )

    async def blocked(frame: spec.Connection.Blocked) -> None:
        await on_blocked(frame)
        went_blocked(frame.reason)

    async def unblocked(frame: spec.Connection.Unblocked) -> None:
        await on_unblocked(frame)
        if since:
            log.info(
                "RabbitMQ unblocked publishing on this connection after %.1fs: the resource"
                " alarm cleared; publishing resumed",
                time.monotonic() - since.pop(),
            )

    setattr(raw, _BLOCKED_HANDLER, blocked)
    setattr(raw, _UNBLOCKED_HANDLER, unblocked)
    event = getattr(raw, _UNBLOCKED_EVENT, None)
    if isinstance(event, asyncio.Event) and not event.is_set():
        went_blocked(None)  # blocked before the wrappers were in place


def _short(value: str | None) -> str | None:
    if value is None or len(value.encode()) > _SHORTSTR_BYTES:
        return None
    return value


# RabbitMQ closes the channel of a publish whose body is over its ``max_message_size`` with
# PRECONDITION_FAILED (406) and this text; every message after it on that channel fails too.
_SIZE_REFUSAL = re.compile(r"message size (\d+) is larger than configured max size (\d+)")


_SIZE_LIMIT_KEPT_SECONDS = 60.0
_PUBLISH_FRAMES_KEPT = 1024  # basic.publish frames kept, one per queue and channel


def _size_limit_of(exc: BaseException) -> int | None:
    """The broker's ``max_message_size`` when ``exc`` is its refusal of a message over it."""
    if isinstance(exc, ChannelPreconditionFailed):
        found = _SIZE_REFUSAL.search(str(exc))
        if found is not None:
            return int(found.group(2))
    return None


class _NotConfirmed(Exception):
    """The broker answered a publish with something else than its confirm (a nack, or the
    message returned as unroutable): the message is not known to be in the queue."""


def _forget(raw: aiormq.Channel, message_id: str, tag: int) -> Callable[[Any], None]:
    """Once a publish is confirmed (or failed), forget its message id as aiormq does: the id
    maps a returned message to its publish."""

    def forget(_: Any) -> None:
        if raw.message_id_delivery_tag.get(message_id) == tag:
            raw.message_id_delivery_tag.pop(message_id)

    return forget


def _as_unavailable(exc: Exception) -> Exception:
    return as_unavailable("RabbitMQ", _CONNECTION_ERRORS, exc)


def _nacked(exc: Exception, name: str) -> QueueUnavailable | None:
    """A publisher confirm that came back as ``basic.nack`` as ``QueueUnavailable`` saying so.
    RabbitMQ nacks a publish when the queue is full under ``overflow: reject-publish`` (or
    ``reject-publish-dlx``), a policy's or an argument's, or when the queue's process failed:
    either way the next message would be refused alike, so the relay backs off as for an
    outage (never a dead letter: the job is fine) and the text says what it is."""
    if not isinstance(exc, DeliveryError) or not isinstance(exc.frame, spec.Basic.Nack):
        return None
    full = QueueUnavailable(
        f"RabbitMQ queue {name} is full or cannot take messages now: the broker nacked the"
        " publish (basic.nack), as it does under a max-length or max-length-bytes limit with"
        " overflow reject-publish (a policy or a queue argument); the messages wait in the"
        " outbox until the queue has room (its jobs consumed, or the limit raised: rabbitmqctl"
        " list_queues name policy messages)"
    )
    full.__cause__ = exc
    return full


def _headers(message: Message, prior: int) -> dict[str, Any]:
    """The ids travel in headers (any length); the AMQP properties repeat them for tools when
    they fit."""
    headers: dict[str, Any] = {
        _H_CONSUMER: message.consumer,
        _H_JOB_ID: message.job_id,
        _H_PRIOR: prior,
    }
    if message.tenant_id is not None:
        headers[_H_TENANT] = message.tenant_id
    if message.correlation_id is not None:
        headers[_H_CORRELATION] = message.correlation_id
    if message.traceparent is not None:  # W3C names, as other OpenTelemetry clients use
        headers[_H_TRACEPARENT] = message.traceparent
        if message.tracestate is not None:
            headers[_H_TRACESTATE] = message.tracestate
    return headers


@dataclass(slots=True, eq=False)
class _Incoming:
    """One message delivered on a channel (pushed or taken with ``basic.get``), read straight
    from aiormq's frames: aio-pika's ``IncomingMessage`` costs more CPU per message than the
    rest of a job's path through the adapter. ``unsettled`` is the set of this channel's
    delivery tags not yet acked or rejected, shared by its messages, so that ``ack_many`` can
    ack a run of them with one ``basic.ack`` (``multiple``) without covering any other."""

    raw: aiormq.abc.AbstractChannel
    tag: int
    headers: dict[str, Any]
    body: bytes
    correlation_id: str | None
    unsettled: set[int]
    # Why its content header could not be decoded (it then has no properties nor headers).
    unreadable: str | None = None

    @classmethod
    def of(cls, delivered: aiormq.abc.DeliveredMessage, unsettled: set[int]) -> _Incoming:
        header = delivered.header
        props = header.properties
        tag = delivered.delivery.delivery_tag  # type: ignore[union-attr]
        assert isinstance(tag, int)
        unsettled.add(tag)
        return cls(
            raw=delivered.channel,
            tag=tag,
            headers=dict(props.headers or {}),
            body=bytes(delivered.body),
            correlation_id=props.correlation_id,
            unsettled=unsettled,
            unreadable=header.unreadable if isinstance(header, UnreadableHeader) else None,
        )

    async def ack(self) -> None:
        self.unsettled.discard(self.tag)
        await self.raw.basic_ack(self.tag)

    async def reject(self, *, requeue: bool) -> None:
        self.unsettled.discard(self.tag)
        await self.raw.basic_reject(self.tag, requeue=requeue)


async def _ack_runs(incomings: list[_Incoming]) -> None:
    """Ack ``incomings`` (all of one channel): those below every other unsettled tag of the
    channel with one ``basic.ack`` (``multiple``), the others one by one."""
    unsettled = incomings[0].unsettled
    tags = {i.tag for i in incomings}
    others = unsettled - tags
    floor = min(others) if others else None
    run = [i for i in incomings if floor is None or i.tag < floor]
    if len(run) > 1:
        top = max(i.tag for i in run)
        unsettled.difference_update(i.tag for i in run)
        await run[0].raw.basic_ack(top, multiple=True)
        incomings = [i for i in incomings if floor is not None and i.tag > floor]
    for incoming in incomings:
        await incoming.ack()


@dataclass(slots=True, eq=False)
class RabbitReceipt:
    incoming: _Incoming
    channel: AbstractChannel
    queue_name: str
    prior: int
    delivery_count: int
    settled: bool = False
    lost: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    unreadable: bool = False  # a release gives the message back as it is, never a copy


@dataclass(slots=True, eq=False)
class _Buffered:
    """A message the broker pushed to a consumer, not yet handed out by ``receive``."""

    incoming: _Incoming
    channel: AbstractChannel
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True, eq=False)
class _Consumer:
    name: str  # the AMQP queue's
    channel: AbstractChannel
    raw: aiormq.abc.AbstractChannel
    tag: str
    unsettled: set[int]


def _receipt(delivery: Delivery) -> RabbitReceipt:
    return receipt_of(delivery, RabbitReceipt, "RabbitMQQueue")


def _refuse_tx(operation: str) -> ConfigError:
    return refuse_tx("RabbitMQQueue", operation)


def _refuse_delay(operation: Literal["publish", "retry"]) -> ConfigError:
    return refuse_delay(
        "RabbitMQQueue",
        operation,
        "RabbitMQ holds a message back only with a plugin or TTL queues, which jobfence does not"
        " use",
    )


class RabbitMQQueue:
    """The RabbitMQ queue adapter. ``url`` is an ``amqp://`` or ``amqps://`` URL; ``prefix``
    starts the name of every queue it declares."""

    capabilities = QueueCapabilities(
        transactional=False,
        delayed_publish=False,
        delayed_retry=False,
        exact_stale_ack=False,
        exact_size=False,
        lists_queues=False,
    )

    def __init__(
        self,
        url: str = "amqp://guest:guest@127.0.0.1:5672/",
        *,
        prefix: str = "jobfence",
        prefetch: int | None = None,
    ) -> None:
        if not _NAME.match(prefix):
            raise ConfigError(f"prefix must be letters, digits, _ . - or :, got {prefix!r}")
        if prefetch is not None and not 1 <= prefetch <= 65535:
            raise ConfigError(f"prefetch must be from 1 to 65535 (or None), got {prefetch!r}")
        self._prefetch = prefetch
        self._url = url
        self._prefix = prefix
        self._conn: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()
        self._declared: dict[str, AbstractQueue] = {}
        self._held: set[RabbitReceipt] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._consumers: dict[str, _Consumer] = {}
        self._buffers: dict[str, deque[_Buffered]] = {}
        self._arrived = asyncio.Event()
        self._consume_lock = asyncio.Lock()
        self._buffer_seconds = _BUFFER_SECONDS  # or the latest receive's lease, if shorter
        # The unsettled delivery tags of the channel the consumers run on (see _Incoming).
        self._tags_of: aiormq.abc.AbstractChannel | None = None
        self._tags: set[int] = set()
        self._closing = False  # receive returns nothing; close() is returning the buffer
        self._closed = False
        # The broker's max_message_size as its last refusal named it, and when (AMQP does not
        # tell it at connect): kept for _SIZE_LIMIT_KEPT_SECONDS, as it may be raised meanwhile.
        self._size_limit: tuple[int, float] | None = None
        self._publish_frames: dict[tuple[int, str], bytes] = {}

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
                    self._conn = await _connect(self._url)
                self._channel = await self._conn.channel(publisher_confirms=True)
                self._declared.clear()
            return self._channel

    async def _notice_lost(self) -> None:
        """Raise (``QueueUnavailable``, through ``receive``) when the connection was lost:
        aio-pika may still say its channel is open after aiormq's reader stopped (a frame it
        could not decode, a dropped socket). What it delivered is stale (the broker requeues
        it); the next call opens a new connection. Without this, a receive would reconnect in
        silence and, when the broker pushes the same frame again, return nothing for ever."""
        conn = self._conn
        if conn is None or self._closing or not _lost(conn):
            return
        async with self._lock:
            if self._conn is not conn:
                return  # another call noticed it, and reconnected
            self._conn = self._channel = None
            self._declared.clear()
        self._consumers.clear()
        for buffer in self._buffers.values():
            for buffered in buffer:
                if buffered.timer is not None:
                    buffered.timer.cancel()
            buffer.clear()
        for receipt in self._held:
            receipt.lost = True
            if receipt.timer is not None:
                receipt.timer.cancel()
        self._held.clear()
        why = _why_lost(conn)
        with contextlib.suppress(Exception):
            await conn.close()
        raise AMQPConnectionError(f"the connection was lost{why}")

    def _name(self, queue: str) -> str:
        if not _NAME.match(queue):
            raise ConfigError(
                f"a RabbitMQ queue name is letters, digits, _ . - or :, got {queue!r}"
            )
        name = f"{self._prefix}.{queue}"
        if len(name) > _SHORTSTR_BYTES:  # ASCII, as _NAME and the prefix's check hold it
            raise ConfigError(
                f"a RabbitMQ queue name is at most 255 bytes with its prefix, got {len(name)}"
                f" for {shown_value(queue)}"
            )
        return name

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

    # -- the port -----------------------------------------------------------------------

    @_unavailable
    async def publish(
        self,
        message: Message,
        *,
        delay_seconds: float = 0.0,
        tx: AsyncConnection[Any] | None = None,
        prior_attempts: int = 0,
    ) -> None:
        if tx is not None:
            raise _refuse_tx("publish")
        if checked_delay(delay_seconds) > 0:
            raise _refuse_delay("publish")
        self._name(message.queue)  # a name no queue can have: ConfigError, as before sending
        await self._publish_one(message, prior=check_prior_attempts(prior_attempts))

    async def _publish_one(self, message: Message, *, prior: int) -> None:
        """Publish ``message`` (confirmed) as :meth:`publish_many` does: its message id unique
        among the channel's publishes still unconfirmed, the broker's size limit learnt from a
        refusal; raises its failure."""
        (result,) = await self.publish_many([Outgoing(message, prior)])
        if result is not None:
            raise result

    async def publish_many(self, outgoing: Sequence[Outgoing]) -> list[Exception | None]:
        """Every message published at once on the confirming channel (straight to aiormq's
        channel, without waiting for each frame to leave the socket), the broker's publisher
        confirms outstanding together: one round trip for the lot instead of one per message.
        A lost connection is ``QueueUnavailable`` for each message it caught.

        A body over the broker's ``max_message_size`` is ``PublishRefused``, and never stops
        the others: the broker closes the channel at such a message, and names its limit.
        Each message over it is then refused without being sent (for a minute: the limit may
        be raised), and those the closed channel caught are published once more on a new one.
        The limit is not offered to producers (no ``max_message_bytes``): a broker's limit
        raised later would leave them refusing what it now takes."""
        results: list[Exception | None] = [None] * len(outgoing)
        todo = list(range(len(outgoing)))
        for _ in range(2):  # a second pass only after learning the broker's limit
            for i in todo:
                results[i] = self._refusal(outgoing[i].message)
            todo = [i for i in todo if results[i] is None]
            if not todo:
                break
            sent = await self._publish_all([outgoing[i] for i in todo])
            learned = False
            for i, result in zip(todo, sent, strict=True):
                results[i] = result
                limit = None if result is None else _size_limit_of(result)
                if limit is not None:
                    self._size_limit, learned = (limit, time.monotonic()), True
            if not learned:
                break
            todo = [i for i in todo if results[i] is not None]
        return results

    def _refusal(self, message: Message) -> PublishRefused | None:
        """The refusal of ``message`` when its body is over the limit the broker named in a
        refusal less than ``_SIZE_LIMIT_KEPT_SECONDS`` ago (past that, such a message is sent
        again: the limit may have been raised)."""
        if self._size_limit is None:
            return None
        limit, learned_at = self._size_limit
        if time.monotonic() - learned_at > _SIZE_LIMIT_KEPT_SECONDS:
            self._size_limit = None
            return None
        if len(message.body) <= limit:
            return None
        return PublishRefused(
            f"RabbitMQ refuses this message: its body is {len(message.body):,} bytes, over the"
            f" broker's max_message_size of {limit:,} bytes"
        )

    async def _publish_all(self, outgoing: Sequence[Outgoing]) -> list[Exception | None]:
        try:
            raw, refused = await self._publishing_channel({item.message.queue for item in outgoing})
        except Exception as exc:
            return [exc] * len(outgoing)
        sending = [item for item in outgoing if item.message.queue not in refused]
        results = iter(await self._publish_batch(raw, sending))
        return [refused.get(item.message.queue) or next(results) for item in outgoing]

    @_unavailable
    async def _publishing_channel(
        self, queues: set[str]
    ) -> tuple[aiormq.Channel, dict[str, Exception]]:
        """The confirming channel, every queue of ``queues`` declared; with the error of each
        queue the broker would not declare (one declared otherwise, a name the user may not
        use): that queue's messages fail, and the others are published."""
        refused: dict[str, Exception] = {}
        for queue in sorted(queues):
            with contextlib.suppress(ConfigError):  # else its messages are refused one by one
                self._name(queue)
                try:
                    await self._queue(queue)
                except ChannelClosed as exc:  # the channel closes; the next one is opened
                    refused[queue] = exc
        channel = await self._open_channel()
        raw = await channel.get_underlay_channel()
        assert isinstance(raw, aiormq.Channel)
        return raw, refused

    async def _publish_batch(
        self, raw: aiormq.Channel, outgoing: Sequence[Outgoing]
    ) -> list[Exception | None]:
        """Publish ``outgoing`` on ``raw`` as aiormq's ``basic_publish`` does each message (a
        delivery tag and a confirmation future per message, under the channel's lock), but
        with the lock taken once and every message's frames written at once; then await the
        confirms together. Per message this costs about a quarter of the client CPU of a
        ``basic_publish`` in a task of its own. A message that cannot be framed (a name no
        queue can have, a routing key over 255 bytes) is refused alone, before anything is
        sent."""
        results: list[Exception | None] = [None] * len(outgoing)
        framed: list[tuple[int, str, bytes]] = []  # (index, message id, frames)
        for n, item in enumerate(outgoing):
            try:
                framed.append((n, *self._frames(raw, item)))
            except (ConfigError, ValueError, TypeError) as exc:
                results[n] = PublishRefused(f"RabbitMQ refuses this message: {exc}")
        if not framed:
            return results
        confirmations: list[asyncio.Future[Any]] = []
        try:
            async with raw.lock:  # a closed channel raises here, before any tag is taken
                first_tag = raw.delivery_tag + 1
                try:
                    for i, (n, job_message_id, _) in enumerate(framed):
                        message_id = job_message_id
                        if message_id in raw.message_id_delivery_tag:
                            # Outstanding already (one job for two consumers in this batch, or
                            # a publish beside it): a message id of its own, as a returned
                            # message finds its publish by its id.
                            message_id = uuid.uuid4().hex
                            framed[i] = (n, *self._frames(raw, outgoing[n], message_id))
                        raw.delivery_tag += 1
                        tag = raw.delivery_tag
                        confirmation = raw.create_future()
                        raw.confirmations[tag] = confirmation
                        raw.message_id_delivery_tag[message_id] = tag
                        confirmation.add_done_callback(_forget(raw, message_id, tag))
                        confirmations.append(confirmation)
                    payload = b"".join(frames for _, _, frames in framed)
                    await raw.write_queue.put(ChannelFrame(payload=payload, should_close=False))
                except BaseException:
                    # Nothing was sent: the tags are taken back while the lock is held.
                    for tag in range(first_tag, raw.delivery_tag + 1):
                        raw.confirmations.pop(tag, None)
                    raw.delivery_tag = first_tag - 1
                    for confirmation in confirmations:
                        confirmation.cancel()
                    raise
        except Exception as exc:
            for n, _, _ in framed:
                results[n] = _as_unavailable(exc)
            return results
        answers = await asyncio.gather(*confirmations, return_exceptions=True)
        for (n, _, _), answer in zip(framed, answers, strict=True):
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer
            if isinstance(answer, Exception):
                results[n] = _nacked(answer, self._name(outgoing[n].message.queue)) or (
                    _as_unavailable(answer)
                )
            elif not isinstance(answer, spec.Basic.Ack):
                results[n] = _NotConfirmed(
                    f"RabbitMQ did not confirm the message ({type(answer).__name__})"
                )
                if isinstance(answer, aiormq.abc.DeliveredMessage):
                    # Returned as unroutable: its queue is gone (deleted on the server); it is
                    # declared again before the next publish to it.
                    self._forget_declared(outgoing[n].message.queue)
        return results

    def _forget_declared(self, queue: str) -> None:
        name = self._name(queue)
        if self._declared.pop(name, None) is not None:
            log.warning(
                "RabbitMQ returned a message for queue %s as unroutable: the queue was deleted "
                "on the server; it is declared again before the next publish to it",
                name,
            )

    def _frames(
        self, raw: aiormq.Channel, item: Outgoing, message_id: str | None = None
    ) -> tuple[str, bytes]:
        """The message id aiormq knows a returned message by (the job id, when it fits and
        ``message_id`` is not given), and the message's frames (publish, content header,
        body) as they go on the wire."""
        message = item.message
        message_id = message_id or _short(message.job_id) or uuid.uuid4().hex
        return message_id, self._publish_frame(raw.number, message.queue) + content_frames(
            raw.number,
            raw.max_content_size,
            message.body,
            headers=_headers(message, check_prior_attempts(item.prior_attempts)),
            delivery_mode=2,  # persistent
            correlation_id=_short(message.correlation_id),
            message_id=message_id,
        )

    def _publish_frame(self, channel: int, queue: str) -> bytes:
        """The ``basic.publish`` method frame to ``queue`` on ``channel`` (mandatory, on the
        default exchange), marshalled once per queue and channel."""
        key = (channel, queue)
        publish = self._publish_frames.get(key)
        if publish is None:
            if len(self._publish_frames) >= _PUBLISH_FRAMES_KEPT:
                self._publish_frames.clear()  # queues without end (a producer's bug): no growth
            publish = self._publish_frames[key] = ChannelFrame.marshall(
                channel,
                [spec.Basic.Publish(exchange="", routing_key=self._name(queue), mandatory=True)],
            ).payload
        return publish

    @_unavailable
    async def receive(
        self,
        queues: Sequence[str],
        *,
        max_messages: int,
        lease_seconds: float,
        wait_seconds: float = 0.0,
    ) -> list[Delivery]:
        if max_messages <= 0 or self._closing:
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        self._buffer_seconds = min(lease_seconds, _BUFFER_SECONDS)
        first = True
        try:
            while True:
                await self._notice_lost()
                for queue in queues:
                    await self._consume(queue, max_messages)
                got = self._take_buffered(queues, max_messages, lease_seconds)
                if not got and first:
                    # Nothing pushed yet: a round trip lets pushes under way arrive (in order);
                    # then take what is ready now (a consumer whose prefetch is all leased),
                    # as a receive without wait promises.
                    await self._round_trip(queues)
                    got = self._take_buffered(queues, max_messages, lease_seconds)
                    if not got:
                        got = await self._get_ready(queues, max_messages, lease_seconds)
                first = False
                remaining = deadline - loop.time()
                if got or self._closing or remaining <= 0:
                    return got
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._arrived.wait(), timeout=min(remaining, _WAKE_SECONDS)
                    )
        except Exception:
            if self._closing:
                return []
            raise

    def _take_buffered(
        self, queues: Sequence[str], max_messages: int, lease_seconds: float
    ) -> list[Delivery]:
        got: list[Delivery] = []
        for queue in queues:
            buffer = self._buffers.get(queue)
            while buffer and len(got) < max_messages:
                buffered = buffer.popleft()
                if buffered.timer is not None:
                    buffered.timer.cancel()
                if buffered.channel.is_closed:  # the broker has it back
                    continue
                got.append(
                    self._delivery(queue, buffered.incoming, buffered.channel, lease_seconds)
                )
        return got

    async def _round_trip(self, queues: Sequence[str]) -> None:
        channels = {c.channel for q in queues if (c := self._consumers.get(q)) is not None}
        for channel in channels:
            if not channel.is_closed:
                await channel.set_qos(prefetch_count=self._prefetch or 1)
        for _ in range(3):  # the consumer callbacks run as tasks
            await asyncio.sleep(0)

    async def _get_ready(
        self, queues: Sequence[str], max_messages: int, lease_seconds: float
    ) -> list[Delivery]:
        got: list[Delivery] = []
        for queue in queues:
            consumer = self._consumers.get(queue)
            if consumer is None or consumer.channel.is_closed:
                continue
            while len(got) < max_messages:
                taken = await consumer.raw.basic_get(consumer.name, no_ack=False)
                if isinstance(taken.delivery, spec.Basic.GetEmpty):
                    break
                incoming = _Incoming.of(taken, consumer.unsettled)
                got.append(self._delivery(queue, incoming, consumer.channel, lease_seconds))
        return got

    async def _consume(self, queue: str, prefetch: int) -> None:
        """Start the push consumer of ``queue`` on the current channel, unless it runs."""
        async with self._consume_lock:
            channel = await self._open_channel()
            consumer = self._consumers.get(queue)
            if consumer is not None and consumer.channel is channel:
                return
            amqp_queue = await self._queue(queue)
            # Per consumer (quorum queues have no channel-wide prefetch); applies to the
            # consumers started after it.
            await channel.set_qos(prefetch_count=self._prefetch or prefetch + _ACK_ROOM)
            buffer = self._buffers.setdefault(queue, deque())
            raw = await channel.get_underlay_channel()
            unsettled = self._unsettled_tags(raw)

            async def arrived(delivered: aiormq.abc.DeliveredMessage) -> None:
                incoming = _Incoming.of(delivered, unsettled)
                self._buffer(queue, buffer, _Buffered(incoming=incoming, channel=channel))

            # The messages ready now: a new consumer's first pushes are awaited (below), so
            # that the receive starting it hands out what was already there.
            declared = await raw.queue_declare(amqp_queue.name, passive=True)
            ready = min(declared.message_count or 0, self._prefetch or prefetch + _ACK_ROOM)
            # Once per channel (a bound method is one set member): a consumer the broker
            # cancels is started again (its queue declared again) by the next receive.
            raw.on_consumer_cancel_callbacks.add(self._cancelled)
            ok = await raw.basic_consume(amqp_queue.name, arrived, no_ack=False)
            assert ok.consumer_tag is not None
            self._consumers[queue] = _Consumer(
                name=amqp_queue.name,
                channel=channel,
                raw=raw,
                tag=ok.consumer_tag,
                unsettled=unsettled,
            )
            await self._first_pushes(buffer, ready)

    def _cancelled(self, frame: spec.Basic.Cancel) -> None:
        """The broker cancelled a consumer (``basic.cancel``: its queue was deleted on the
        server): forget it, and the queue's declaration, so that the next receive declares the
        queue and consumes it again. Its deliveries already buffered stay valid on the
        channel."""
        for queue, consumer in list(self._consumers.items()):
            if consumer.tag == frame.consumer_tag:
                del self._consumers[queue]
                self._declared.pop(consumer.name, None)
                log.warning(
                    "RabbitMQ cancelled the consumer of queue %s (the queue was deleted on the"
                    " server): it is declared and consumed again at the next receive",
                    consumer.name,
                )

    async def _first_pushes(self, buffer: deque[_Buffered], ready: int) -> None:
        """Wait (up to a second) until ``ready`` messages were pushed into ``buffer``: a quorum
        queue's first pushes to a new consumer can trail its consume-ok by a few ms."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _FIRST_PUSHES_SECONDS
        while len(buffer) < ready and not self._closing:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout=remaining)

    def _unsettled_tags(self, raw: aiormq.abc.AbstractChannel) -> set[int]:
        """The unsettled delivery tags of ``raw`` (one set per channel: its tags start at 1)."""
        if self._tags_of is not raw:
            self._tags_of, self._tags = raw, set()
        return self._tags

    def _buffer(self, queue: str, buffer: deque[_Buffered], buffered: _Buffered) -> None:
        if self._closing or buffered.channel.is_closed:
            return  # close() returns the buffer; a closed channel gave it back already
        loop = asyncio.get_running_loop()
        buffered.timer = loop.call_later(
            self._buffer_seconds, self._unclaimed, queue, buffer, buffered
        )
        buffer.append(buffered)
        self._arrived.set()

    def _unclaimed(self, queue: str, buffer: deque[_Buffered], buffered: _Buffered) -> None:
        """Nobody received ``buffered`` in time: the receiver is busy. Pause the consumer (the
        next ``receive`` starts it again) and give its buffer back to the queue, uncounted."""
        if buffered not in buffer:
            return
        channel = buffered.channel
        consumer = self._consumers.get(queue)
        if consumer is not None and consumer.channel is channel:
            del self._consumers[queue]
        else:
            consumer = None
        unclaimed = [b for b in buffer if b.channel is channel]
        for b in unclaimed:
            buffer.remove(b)
            if b.timer is not None:
                b.timer.cancel()
        self._in_background(self._give_back_buffer(queue, consumer, unclaimed))

    async def _give_back_buffer(
        self, queue: str, consumer: _Consumer | None, unclaimed: list[_Buffered]
    ) -> None:
        if consumer is not None and not consumer.channel.is_closed:
            with contextlib.suppress(Exception):
                await consumer.raw.basic_cancel(consumer.tag)
        for buffered in unclaimed:
            await self._return_unseen(queue, buffered)

    def _in_background(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _return_unseen(self, queue: str, buffered: _Buffered) -> None:
        """Return a buffered message that was never handed out without counting a delivery:
        a copy keeping its count so far (confirmed), then ack the original. If the copy
        cannot be published, the original goes back (counted)."""
        if buffered.channel.is_closed:
            return
        incoming = buffered.incoming
        seen, _ = self._read(queue, incoming, None)
        if seen.unreadable is not None:
            # Back as it was published (counted: it is dead-lettered at its delivery anyway).
            with contextlib.suppress(Exception):
                await incoming.reject(requeue=True)
            return
        copy = {
            k: v
            for k, v in incoming.headers.items()
            if k.startswith("x-jobfence-") or k in (_H_TRACEPARENT, _H_TRACESTATE)
        }
        copy[_H_PRIOR] = seen.attempt - 1  # the deliveries so far: this one does not count
        try:
            await buffered.channel.default_exchange.publish(
                aio_pika.Message(
                    bytes(incoming.body),
                    headers=copy,
                    # None: aiormq gives the copy a random message id, by which a return finds
                    # it (the original's id may be outstanding in another publish).
                    message_id=None,
                    correlation_id=incoming.correlation_id,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=self._name(queue),
                mandatory=True,
            )
        except Exception:
            with contextlib.suppress(Exception):
                await incoming.reject(requeue=True)
            return
        with contextlib.suppress(Exception):
            await incoming.ack()

    def _delivery(
        self,
        queue: str,
        incoming: _Incoming,
        channel: AbstractChannel,
        lease_seconds: float,
    ) -> Delivery:
        receipt = RabbitReceipt(
            incoming=incoming,
            channel=channel,
            queue_name=self._name(queue),
            prior=0,
            delivery_count=0,
        )
        delivery, receipt.prior = self._read(queue, incoming, receipt)
        receipt.delivery_count = delivery.attempt - receipt.prior - 1
        receipt.unreadable = delivery.unreadable is not None
        loop = asyncio.get_running_loop()
        receipt.timer = loop.call_later(lease_seconds, self._lease_ran_out, receipt)
        self._held.add(receipt)
        return delivery

    @staticmethod
    def _read(
        queue: str, incoming: _Incoming, receipt: RabbitReceipt | None
    ) -> tuple[Delivery, int]:
        """The one reading of a message's headers (at its delivery, and when a buffered one
        is given back): a header that does not parse, or a content header that could not be
        decoded at all, makes it ``Delivery.unreadable``."""
        headers = incoming.headers
        read = read_delivery(
            _NAMES,
            queue=queue,
            body=incoming.body,
            consumer=headers.get(_H_CONSUMER, ""),
            job_id=headers.get(_H_JOB_ID, ""),
            tenant_id=headers.get(_H_TENANT),
            correlation_id=headers.get(_H_CORRELATION),
            prior=headers.get(_H_PRIOR),
            delivered=headers.get(_H_COUNT, 0),
            receipt=receipt,
            counted_before=True,
            traceparent=headers.get(_H_TRACEPARENT),
            tracestate=headers.get(_H_TRACESTATE),
        )
        if incoming.unreadable is None:
            return read
        delivery, _ = read
        return replace(delivery, unreadable=incoming.unreadable), 0

    def _lease_ran_out(self, receipt: RabbitReceipt) -> None:
        if receipt.settled or receipt.lost:
            return
        receipt.lost = True
        self._held.discard(receipt)
        if not receipt.channel.is_closed:
            self._in_background(self._give_back(receipt))

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

    @_unavailable
    async def ack(self, delivery: Delivery, *, tx: AsyncConnection[Any] | None = None) -> bool:
        if tx is not None:
            raise _refuse_tx("ack")
        receipt = _receipt(delivery)
        if not self._take_hold(receipt):
            return False
        await receipt.incoming.ack()
        return True

    @_unavailable
    async def extend(self, delivery: Delivery, *, lease_seconds: float) -> bool:
        """Restart this adapter's lease timer: RabbitMQ has no lease per message (its
        ``consumer_timeout`` counts from the delivery, whatever the client does)."""
        receipt = _receipt(delivery)
        if receipt.settled or receipt.lost or receipt.channel.is_closed:
            return False
        if receipt.timer is not None:
            receipt.timer.cancel()
        loop = asyncio.get_running_loop()
        receipt.timer = loop.call_later(lease_seconds, self._lease_ran_out, receipt)
        return True

    @_unavailable
    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """One ``basic.ack`` (``multiple``) per channel for each run of deliveries below every
        other unsettled one of that channel (the usual case: a worker finishes its jobs in
        order), and one per delivery for the rest."""
        by_channel: dict[int, list[_Incoming]] = {}
        for delivery in deliveries:
            receipt = _receipt(delivery)
            if self._take_hold(receipt):
                by_channel.setdefault(id(receipt.incoming.unsettled), []).append(receipt.incoming)
        for incomings in by_channel.values():
            await _ack_runs(incomings)

    @_unavailable
    async def retry(self, delivery: Delivery, *, delay_seconds: float, error: str) -> bool:
        receipt = _receipt(delivery)
        if delay_seconds > 0:
            raise _refuse_delay("retry")
        if not self._take_hold(receipt):
            return False
        await self._republish(receipt, delivery.message, prior=delivery.attempt)
        return True

    @_unavailable
    async def release(self, delivery: Delivery) -> None:
        receipt = _receipt(delivery)
        if not self._take_hold(receipt):
            return
        if receipt.unreadable:  # back as it was published (counted: dead-lettered anyway)
            await self._give_back(receipt)
            return
        await self._republish(receipt, delivery.message, prior=delivery.attempt - 1)

    async def _republish(self, receipt: RabbitReceipt, message: Message, *, prior: int) -> None:
        """Publish a copy (confirmed), then ack the original. If the copy cannot be published,
        the original goes back to the queue (and counts), so it never sits unacked."""
        try:
            await self._publish_one(message, prior=prior)
        except BaseException:
            await self._give_back(receipt)
            raise
        await receipt.incoming.ack()

    @_unavailable
    async def size(self, queues: Sequence[str]) -> QueueSize:
        """Ready and buffered messages (due), plus this instance's leases (total). A delayed
        retry or enqueue waits in the PostgreSQL outbox, not here, until it falls due. A lost
        connection is said (``QueueUnavailable``), as ``receive`` says it, before a new one
        is opened."""
        await self._notice_lost()
        due = total = 0
        for queue in queues:
            name = self._name(queue)
            ready = await self._ready(name)
            held = sum(1 for r in self._held if r.queue_name == name)
            buffered = sum(1 for b in self._buffers.get(queue, ()) if not b.channel.is_closed)
            due += ready + buffered
            total += ready + buffered + held
        return QueueSize(due=due, total=total)

    async def backlog(self, queues: Sequence[str]) -> int:
        """The messages of ``queues``: ready, plus what this instance holds or buffers. AMQP
        cannot list a virtual host's queues (``capabilities.lists_queues`` is False), and its
        queue declare does not count what other clients hold unacked (``exact_size`` False):
        stop the workers first, and what they held is ready again and counted."""
        return (await self.size(queues)).total

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
        """Stop the consumers, return the buffered messages uncounted, make sure the broker
        applied every ack, and close the connection (the broker requeues what this instance
        still held, counted); a waiting receiver returns an empty list."""
        if self._closing:
            return
        self._closing = True
        self._arrived.set()
        for receipt in self._held:
            if receipt.timer is not None:
                receipt.timer.cancel()
        self._held.clear()
        channel = self._channel
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                await self._settle_before_close(channel)
        self._closed = True
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()

    async def _settle_before_close(self, channel: AbstractChannel) -> None:
        # No more deliveries after basic.cancel-ok; on a quorum queue the cancel also goes
        # through the queue's log after the settlements this channel sent before it.
        for consumer in self._consumers.values():
            if consumer.channel is channel:
                await consumer.raw.basic_cancel(consumer.tag)
        self._consumers.clear()
        unseen = [(q, b) for q, buffer in self._buffers.items() for b in buffer]
        for buffer in self._buffers.values():
            buffer.clear()
        for queue, buffered in unseen:
            if buffered.timer is not None:
                buffered.timer.cancel()
            await self._return_unseen(queue, buffered)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        # A synchronous round trip after the last acks: the broker answers it only after it
        # processed them, so closing the connection next cannot drop them.
        await channel.set_qos(prefetch_count=self._prefetch or 1)


async def open_queue(url: str) -> RabbitMQQueue:
    """The factory ``JOBFENCE_QUEUE_URL=amqp://...`` uses (``jobfence.queues``): the adapter,
    connected (with its confirming channel), so a bad or unreachable URL fails here. The URL's
    ``prefix`` and ``prefetch`` parameters set the adapter's
    (:func:`jobfence.queues.parse_queue_url` reads them)."""
    from jobfence.queues import parse_queue_url

    target = parse_queue_url(url)
    assert target.client_url is not None
    settings = target.settings
    queue = RabbitMQQueue(target.client_url, prefix=settings.prefix, prefetch=settings.prefetch)
    try:
        await queue._open_channel()
    except BaseException:
        await queue.close()
        raise
    return queue
