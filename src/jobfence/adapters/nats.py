"""A queue on NATS JetStream (``pip install 'jobfence[nats]'``).

One stream (default ``JOBFENCE``, subjects ``<subject_prefix>.>``) holds every queue, with file
storage and work-queue retention: an acked message is removed. Each jobfence queue is the
subject ``<subject_prefix>.<queue>`` and has one durable pull consumer with explicit acks,
shared by every worker of that queue.

- **Lease**: the consumer's AckWait. A receive sets it to its ``lease_seconds`` (all workers of
  a queue should use the same lease). A message not acked or nak'ed within AckWait is
  delivered again by the server, so a hung or dead holder loses it after AckWait.
- **Attempt**: the server's delivery count (``metadata.num_delivered``), plus the deliveries of
  earlier copies of the same job (the ``Jobfence-Prior`` header of a released message, or of a
  message published with ``prior_attempts``).
- **Fields**: the body is the payload; job id, consumer, tenant and correlation id travel in
  ``Jobfence-*`` headers, percent-encoded where a header could not carry them as they are.
  Each is read once, with its bounds, by ``read_delivery``: a message whose header does not
  parse is a delivery marked ``unreadable`` (the harness dead-letters it, whole; the rest of
  its pull batch is handed out as usual), and a release naks it as it is.
- **Stale receipts**: JetStream accepts an ack from an earlier delivery of a message that was
  delivered again (it acks by stream sequence). So the adapter keeps each delivery's lease
  deadline on the client (the pull request's send time + AckWait, minus a margin) and refuses
  ack, extend, retry and release after it: ``capabilities.exact_stale_ack`` is False. An ack
  that races the server's AckWait by less than the margin can still remove a message another
  worker holds; it is sent only after the job's transaction committed, so that worker's fence
  finds the job done.
- **Extend**: an in-progress ack (``+WPI``) restarts the message's AckWait at the server (the
  consumer's AckWait, whatever ``lease_seconds`` says; it does not count a delivery), and the
  client-side deadline moves with it.
- **Retry with a delay**: ``nak(delay)``; the server counts the next delivery.
- **Release**: a plain ``nak`` would count a delivery at the server, so a release publishes a
  copy (waiting for the server's ack) carrying the delivery count so far minus one, then acks
  the original. A crash in between leaves two copies: one more delivery, absorbed by the fence.
- **Delayed publish**: JetStream (before 2.12's message schedules) has none:
  ``capabilities.delayed_publish`` is False and a publish with a delay is refused (a delayed
  enqueue waits in the PostgreSQL outbox instead).
- **max_deliver**: unlimited by default. The harness dead-letters a job itself when the retry
  policy's attempts run out (D1), counting the server's deliveries; a finite ``max_deliver``
  would make JetStream stop delivering a message silently, which jobfence never does. A
  consumer edited on the server (``nats consumer edit``: max_deliver, ack_wait, backoff, the
  filter) is found by a worker within ``_CONSUMER_CHECK_SECONDS`` and put back, with a log
  line; a message that reached an edited max_deliver meanwhile (JetStream's advisory) is
  published again with its deliveries counted, and the stranded one deleted.
- **A full stream** (a limit with discard new): a publish is ``QueueUnavailable`` (every
  message would be refused alike, so the relay backs off) saying the stream is full and which
  limit, not that NATS is unreachable.

Not transactional: ``publish`` and ``ack`` refuse a database transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import random
import re
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote, unquote

from psycopg import AsyncConnection

from jobfence.adapters._shared import (
    FieldNames,
    check_prior_attempts,
    read_delivery,
    receipt_of,
    refuse_delay,
    refuse_tx,
)
from jobfence.adapters._unavailable import unavailable_on
from jobfence.errors import ConfigError, PublishRefused, QueueUnavailable
from jobfence.limits import MAX_PRIOR_ATTEMPTS, checked_delay, shown_value
from jobfence.model import Delivery, Message, Outgoing
from jobfence.ports import QueueCapabilities, QueueSize

try:
    import nats
    from nats.aio.client import NO_RESPONDERS_STATUS
    from nats.aio.client import Client as NatsClient
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.api import (
        AckPolicy,
        ConsumerConfig,
        DeliverPolicy,
        DiscardPolicy,
        Header,
        RetentionPolicy,
        StorageType,
        StreamConfig,
    )
    from nats.js.errors import (
        APIError,
        BadRequestError,
        NoStreamResponseError,
        NotFoundError,
        ServiceUnavailableError,
    )
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("jobfence.adapters.nats needs nats-py: pip install 'jobfence[nats]'") from exc

log = logging.getLogger("jobfence.adapters.nats")

# JetStream's API errors while a cluster has no leader for the stream, its consumer or its own
# metadata (a server died, an election is under way): "no suitable peers" (10005), "not
# assigned to this server" (10007), "temporarily unavailable" (10008), "can not handle request"
# (10009), stream or consumer "offline" (10118, 10119).
_NO_LEADER_CODES = frozenset({10005, 10007, 10008, 10009, 10118, 10119})


def _no_leader(exc: BaseException) -> bool:
    """True when the cluster cannot serve the request now: nobody answers it ("no
    responders": the stream or consumer has no leader during an election, or a publish finds
    no stream), JetStream is "temporarily unavailable" (503), or one of the codes above."""
    if isinstance(
        exc, ServiceUnavailableError | NoStreamResponseError | nats.errors.NoRespondersError
    ):
        return True
    return isinstance(exc, APIError) and exc.err_code in _NO_LEADER_CODES


# nats-py's errors for a closed, reconnecting or stale connection, no server to reach, and a
# request or flush that timed out: the broker is unreachable (D7); so is a cluster with no
# leader for the request (:func:`_no_leader`).
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.NoServersError,
    nats.errors.TimeoutError,
    nats.errors.UnexpectedEOF,
    ConnectionError,
    TimeoutError,
)
_unavailable = unavailable_on("NATS", _CONNECTION_ERRORS, also=_no_leader)

_H_CONSUMER = "Jobfence-Consumer"
_H_JOB_ID = "Jobfence-Job-Id"
_H_TENANT = "Jobfence-Tenant-Id"
_H_CORRELATION = "Jobfence-Correlation-Id"
_H_PRIOR = "Jobfence-Prior"
_H_TRACEPARENT = "traceparent"
_H_TRACESTATE = "tracestate"
_H_MSG_ID = "Nats-Msg-Id"  # JetStream stores one message per id within its duplicate window
_H_EXPECTED_STREAM = "Nats-Expected-Stream"  # JetStream refuses the publish into another stream
_SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")
_HEADER_SAFE = "!\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"
# What quote(..., safe=_HEADER_SAFE) leaves as it is: ASCII letters and digits, "_.-~" and
# _HEADER_SAFE.
_HEADER_AS_IS = re.compile("[A-Za-z0-9_.~" + re.escape(_HEADER_SAFE) + "-]*")
# A waiting receive re-issues its pull request at least this often (looks at close() again),
# and at least four times per lease.
_WAIT_SLICE_SECONDS = 1.0
# How long the server gets to answer a no-wait pull request.
_NO_WAIT_ANSWER_SECONDS = 5.0
# The JetStream error code of a create whose stream exists with another configuration.
_STREAM_NAME_IN_USE = 10058
_MESSAGE_TOO_LARGE = 10054  # "message size exceeds maximum allowed" (the stream's max_msg_size)
# A publish the stream cannot store (503): "maximum messages exceeded", "maximum bytes exceeded"
# or "maximum messages per subject exceeded" under a limit with discard new (each setting named
# below), or a failure of the server's store; JetStream's storage exhausted (the server's or the
# account's limit) is "insufficient resources".
_STORE_FAILED = 10077
_INSUFFICIENT_RESOURCES = 10047
_FULL_LIMITS = {
    "maximum messages exceeded": "max_msgs",
    "maximum bytes exceeded": "max_bytes",
    "maximum messages per subject exceeded": "max_msgs_per_subject",
}
# After a publish or a pull that nothing answered ("no responders": no stream took the subject,
# no consumer took the pull), whether the stream and the consumer still exist is asked, at most
# this often, each question given this long: a stream or consumer deleted on the server is made
# again, while a cluster electing a leader costs at most one unanswered question per interval.
_RECHECK_SECONDS = 5.0
_RECHECK_ANSWER_SECONDS = 1.0
# A worker compares the settings of the consumers of the queues it receives from with
# jobfence's at most this often (one consumer info per queue), and puts back an edit made on the
# server (``nats consumer edit``) since: a lowered max_deliver, a filter subject edited away,
# would otherwise strand jobs in the stream.
_CONSUMER_CHECK_SECONDS = 5.0
_MAX_STREAM_SEQ = 2**64 - 1  # a JetStream stream sequence is an unsigned 64-bit number


async def _client_error(exc: Exception) -> None:
    """nats-py's error callback: each failed reconnection attempt and each lost connection.
    The worker logs an outage itself (about two lines: went away, back), so these stay at
    DEBUG; nats-py's default logs each at ERROR with a traceback."""
    log.debug("NATS client: %s: %s", type(exc).__name__, exc)


class _UnreadableHeaders(dict[str, str]):
    """The headers of a message whose header block nats-py could not parse (a status line that
    is not UTF-8, say): the header lines it could read, and why the rest could not be. Only
    :class:`_Client` makes one, so no header a publisher writes can pass for it."""

    why: str = ""


class _Client(NatsClient):
    """nats-py's client, reading every header block it is handed without raising.

    nats-py decodes a message's status line without catching the error, inside its read loop:
    one message published with ``NATS/1.0 \\xff...`` ended the read loop of every connection
    it reached (nothing was received any more, no error callback, the connection still
    "connected"). Here such a block becomes :class:`_UnreadableHeaders`, and the delivery that
    carries it one ``UnfenceableMessage`` dead letter (:meth:`NatsQueue._delivery`)."""

    # Set for a tls:// URL: a server whose INFO does not ask for TLS is refused before the
    # client sends its CONNECT (its credentials). nats-py alone would go on in clear text.
    require_tls = False

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection and self.require_tls and not info.get("tls_required"):
            raise TlsNotOffered(
                "the NATS server does not offer TLS, and a tls:// URL requires it (no credentials"
                " were sent): enable TLS on the server, or use nats:// on a trusted network"
            )
        await super()._process_info(info, initial_connection=initial_connection)

    async def _process_headers(self, headers: bytes | None) -> dict[str, str] | None:
        try:
            parsed: dict[str, str] | None = await super()._process_headers(headers)
        except Exception as exc:
            assert headers is not None  # an empty block is not parsed
            end = headers.find(b"\r\n")
            readable = _UnreadableHeaders(
                self._parse_header_lines(headers[end + 2 :]) if end >= 0 else {}
            )
            readable.why = f"its header block cannot be read ({type(exc).__name__}: {exc})"
            return readable
        return parsed


class TlsNotOffered(nats.errors.Error):
    """A server reached with a ``tls://`` URL did not offer TLS."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why

    def __str__(self) -> str:
        return self.why


def tls_context(
    ca: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext | None:
    """The TLS settings of a NATS URL (``tls_ca``, ``tls_cert``, ``tls_key``) as a context that
    verifies the server's certificate and host name (against ``ca``, else the system's CAs);
    None when the URL gives none (nats-py's own default context then, which verifies too). A
    file that cannot be read is a :class:`ConfigError` naming the parameter."""
    if ca is None and cert is None:
        return None
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_ca: cannot load the CA file {ca!r} ({_reason(exc)})") from None
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"tls_cert: cannot load the client certificate {cert!r}"
                f"{' with its tls_key' if key else ''} ({_reason(exc)})"
            ) from None
    return context


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or type(exc).__name__


def _stopped_reading(nc: NatsClient) -> bool:
    """True when ``nc`` says it is connected but its read loop has ended."""
    reading = getattr(nc, "_reading_task", None)
    return bool(nc.is_connected and isinstance(reading, asyncio.Task) and reading.done())


# How long publish_many waits for the JetStream acks of what it sent.
_ACKS_WITHIN = 5.0

# How often the client tries to reconnect to a server that went away: a broker that is back is
# used again within this (nats-py's default is 2 s).
_RECONNECT_SECONDS = 0.5


@dataclass(slots=True)
class NatsReceipt:
    msg: Msg
    prior: int
    deadline: float  # time.monotonic() after which this delivery's lease counts as lost
    settled: bool = False
    unreadable: bool = False  # a release gives the message back as it is (nak), never a copy


def _receipt(delivery: Delivery) -> NatsReceipt:
    return receipt_of(delivery, NatsReceipt, "NatsQueue")


def _refuse_tx(operation: str) -> ConfigError:
    return refuse_tx("NatsQueue", operation)


def _header(value: str) -> str:
    """A header value: spaces, line breaks, ``%`` and non-ASCII percent-encoded (headers are
    line-based and trimmed), the rest as is."""
    if _HEADER_AS_IS.fullmatch(value):  # nothing to encode (most ids): as quote would give it
        return value
    return quote(value, safe=_HEADER_SAFE)


def _unquote(value: str) -> str:
    """A header value as :func:`_header` wrote it; ``UnicodeDecodeError`` when its
    percent-encoding is not UTF-8."""
    return unquote(value, errors="strict") if "%" in value else value


_NAMES = FieldNames(
    consumer=f"header {_H_CONSUMER}",
    job_id=f"header {_H_JOB_ID}",
    tenant_id=f"header {_H_TENANT}",
    correlation_id=f"header {_H_CORRELATION}",
    prior=f"header {_H_PRIOR}",
    delivered="the delivery count",
)


def _stream_full(exc: BaseException, stream: str) -> QueueUnavailable | None:
    """A publish the stream refused because it cannot store it (a limit with discard new
    reached, JetStream's storage exhausted), as ``QueueUnavailable`` that says so: every
    message would be refused the same way, so the relay backs off as for an outage, but an
    operator must not go looking for one. None for any other error."""
    if not isinstance(exc, APIError) or exc.err_code not in (
        _STORE_FAILED,
        _INSUFFICIENT_RESOURCES,
    ):
        return None
    description = str(exc.description or "").strip()
    limit = _FULL_LIMITS.get(description.lower())
    if limit is not None:
        text = (
            f"NATS stream {stream} is full: its {limit} limit (discard new) refuses new messages"
            f" ({description}); they wait in the outbox until its jobs are consumed, or the"
            f" limit is raised (nats stream edit {stream} --{limit.replace('_', '-')} ...)"
        )
    elif exc.err_code == _INSUFFICIENT_RESOURCES:
        text = (
            f"NATS stream {stream} is full: JetStream has no storage left for it"
            f" ({description or 'insufficient resources'}: the server's or the account's"
            " JetStream storage limit); the messages wait in the outbox"
        )
    else:
        text = f"NATS stream {stream} cannot store a message now: {description}"
    full = QueueUnavailable(text)
    full.__cause__ = exc
    return full


def _as_unavailable(exc: BaseException, stream: str) -> Exception:
    """A JetStream ack's error as the port reports it: a lost connection, a timeout or a
    cluster without a leader is ``QueueUnavailable``, and so is a full stream (saying so);
    anything else (an API error: no stream, a limit) as it is."""
    if (full := _stream_full(exc, stream)) is not None:
        return full
    if isinstance(exc, _CONNECTION_ERRORS) or _no_leader(exc):
        unavailable = QueueUnavailable(f"NATS unreachable: {type(exc).__name__}: {exc}")
        unavailable.__cause__ = exc
        return unavailable
    return exc if isinstance(exc, Exception) else RuntimeError(str(exc))


def _headers_size(headers: dict[str, str], stream: str) -> int:
    """The bytes ``headers`` take on the wire (``NATS/1.0``, a line per header, the expected
    stream's header included), which count towards the server's ``max_payload``."""
    size = len(f"NATS/1.0\r\n\r\n{_H_EXPECTED_STREAM}: {stream}\r\n")
    for key, value in headers.items():
        size += len(key) + (len(value) if value.isascii() else len(value.encode())) + 4
    return size


class _AckInbox:
    """The JetStream acks of this adapter's publishes: one subscription to an inbox of its own
    (``<inbox>.*``); each publish gets a reply subject ``<inbox>.<n>`` and a future that the
    ack settles: ``None``, or the error JetStream answered (``APIError``, as nats-py raises
    it), or ``NoStreamResponseError`` when no stream took the subject. nats-py's own
    ``publish_async`` does the same, with a task, a random token and a parsed ``PubAck`` per
    message on top: about a third of the relay's CPU per message on NATS. The subscription is
    nats-py's, restored by it after a reconnect."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._cut = len(prefix) + 1
        self._next = 0
        self._waiting: dict[str, asyncio.Future[None]] = {}

    @classmethod
    async def open(cls, nc: NatsClient) -> _AckInbox:
        inbox = cls(nc.new_inbox())
        await nc.subscribe(f"{inbox._prefix}.*", cb=inbox._on_ack)
        return inbox

    def expect(self) -> tuple[str, asyncio.Future[None]]:
        """A reply subject for one publish, and the future of its ack."""
        self._next += 1
        token = str(self._next)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: self._waiting.pop(token, None))
        self._waiting[token] = future
        return f"{self._prefix}.{token}", future

    def forget(self, reply: str) -> None:
        """The publish of ``reply`` did not go out: no ack will come."""
        future = self._waiting.pop(reply[self._cut :], None)
        if future is not None:
            future.cancel()

    async def _on_ack(self, msg: Msg) -> None:
        future = self._waiting.pop(msg.subject[self._cut :], None)
        if future is None or future.done():
            return  # late (its wait was given up) or not one of ours
        if msg.headers and msg.headers.get(Header.STATUS) == NO_RESPONDERS_STATUS:
            future.set_exception(NoStreamResponseError())
            return
        data = msg.data
        if data.startswith(b'{"stream":') and b'"error"' not in data and b'"seq":' in data:
            future.set_result(None)  # {"stream": ..., "seq": ...}: stored
            return
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
            future.set_exception(_ack_error(answer["error"]))
        elif isinstance(answer, dict) and "stream" in answer and "seq" in answer:
            future.set_result(None)
        else:  # not JetStream's (another responder on the subject): not known to be stored
            future.set_exception(
                APIError(description="the publish was answered with something not a JetStream ack")
            )


def _ack_error(error: dict[str, Any]) -> Exception:
    """The exception of a JetStream ack's ``error``, of nats-py's class for its code
    (``APIError.from_error`` raises it rather than return it: inside nats-py's own
    ``publish_async`` callback that left the ack's future waiting until it timed out, so that
    a message JetStream refused looked like an outage)."""
    try:
        APIError.from_error(error)
    except APIError as exc:
        if exc.err_code == _MESSAGE_TOO_LARGE:  # the stream's max_msg_size: never stored
            refused = PublishRefused(f"NATS refuses this message: {exc.description}")
            refused.__cause__ = exc
            return refused
        return exc
    except Exception:  # an error object of another shape
        pass
    return APIError(description=str(error.get("description", "JetStream refused the message")))


def _stream_dangers(config: StreamConfig) -> list[str]:
    """What in a stream's settings can drop or strand a job that JetStream stored, each with
    how to change it; empty when nothing can. ``max_msgs`` (or ``max_msgs_per_subject`` with
    discard new per subject) with discard ``new`` drops nothing: a publish over it is refused,
    and its job waits in the outbox; ``max_bytes`` drops the oldest even with discard new."""
    stream = config.name
    dangers: list[str] = []
    # nats-py leaves the server's answer as text, where a StreamConfig made here has enums.
    retention = RetentionPolicy(config.retention or RetentionPolicy.LIMITS)
    if retention != RetentionPolicy.WORK_QUEUE:
        dangers.append(
            f"retention is {retention.value}, not workqueue (limits keeps acked jobs and"
            " delivers them again to a consumer made again; interest drops a job published"
            " while its queue has no consumer; retention cannot be edited: make the stream"
            " again)"
        )
    if config.max_age:
        dangers.append(
            f"max_age is {config.max_age:g}s (a job older than that is deleted, delivered or"
            f" not: nats stream edit {stream} --max-age=0)"
        )
    discard_old = DiscardPolicy(config.discard or DiscardPolicy.OLD) != DiscardPolicy.NEW
    if discard_old and (config.max_msgs or -1) > 0:
        dangers.append(
            f"max_msgs is {config.max_msgs} with discard old (the oldest jobs are deleted"
            f" to make room: nats stream edit {stream} --max-msgs=-1, or --discard new)"
        )
    if (config.max_bytes or -1) > 0:
        # Discard new does not protect max_bytes: the server checks a new message's payload
        # against the limit, then stores it with its subject and overhead, and deletes the
        # oldest message when that goes over (measured on nats-server 2.9.10: every publish
        # acked, one job kept; nats-server issue 4771, open, seen on 2.9 and 2.10 too).
        dangers.append(
            f"max_bytes is {config.max_bytes} (the oldest jobs are deleted to make room, with"
            f" discard new too: nats stream edit {stream} --max-bytes=-1; use max_msgs with"
            " discard new to bound the stream)"
        )
    per_subject = config.max_msgs_per_subject or -1
    if per_subject > 0 and not (not discard_old and config.discard_new_per_subject):
        dangers.append(
            f"max_msgs_per_subject is {per_subject} (a queue's oldest jobs are deleted to"
            f" make room: nats stream edit {stream} --max-msgs-per-subject=-1)"
        )
    if config.allow_rollup_hdrs:
        dangers.append(
            "allow_rollup_hdrs is on (a message published with a Nats-Rollup header deletes"
            f" the other jobs of its queue: nats stream edit {stream} --no-allow-rollup)"
        )
    return dangers


def _consumer_changes(
    found: ConsumerConfig, wanted: ConsumerConfig
) -> tuple[list[str], bool, bool]:
    """What differs in a consumer's settings ``found`` on the server from jobfence's
    ``wanted``, each with what it does; whether one can strand a job; whether the consumer must
    be made again (a setting JetStream does not edit, or a filter that skipped jobs)."""
    changes: list[str] = []
    strands = remake = False
    max_deliver = found.max_deliver or -1
    if max_deliver > 0:
        changes.append(
            f"max_deliver is {max_deliver} (a job delivered that often is never delivered"
            " again: it stays in the stream, with no dead letter)"
        )
        strands = True
    if found.backoff:
        changes.append(
            f"backoff is {found.backoff} (a lost lease's job waits those delays, not the lease)"
        )
        strands = True
    if found.filter_subject != wanted.filter_subject or found.filter_subjects:
        shown = found.filter_subjects or found.filter_subject
        changes.append(
            f"filter_subject is {shown}, not {wanted.filter_subject} (the queue's jobs published"
            " meanwhile are skipped, for good)"
        )
        strands = remake = True
    for setting in ("ack_policy", "deliver_policy", "deliver_subject"):
        value, own = getattr(found, setting), getattr(wanted, setting)
        if setting == "deliver_subject" and not value:
            continue
        if str(getattr(value, "value", value)) != str(getattr(own, "value", own)):
            changes.append(f"{setting} is {getattr(value, 'value', value)}")
            strands = remake = True
    # ack_wait is left alone: the workers of a queue set it to their lease when they start,
    # and workers started with different leases (a deploy changing it) would set it back and
    # forth every check. Put back with the others, it becomes this worker's lease.
    max_ack_pending = found.max_ack_pending or -1
    if max_ack_pending > 0:
        changes.append(
            f"max_ack_pending is {max_ack_pending} (at most that many of the queue's jobs run at"
            " once)"
        )
    return changes, strands, remake


def _lease_margin(lease_seconds: float) -> float:
    return max(lease_seconds * 0.1, 0.05)


class NatsQueue:
    """The NATS JetStream queue adapter. ``url`` is a ``nats://`` URL (or several, comma
    separated). ``stream`` and ``subject_prefix`` name where the queues live; the stream is
    created when missing (file storage, work-queue retention, ``replicas`` copies); opening
    the adapter waits up to ``stream_wait_seconds`` for it (a fresh cluster electing its
    leaders, workers started together racing to create it)."""

    capabilities = QueueCapabilities(
        transactional=False, delayed_publish=False, delayed_retry=True, exact_stale_ack=False
    )

    def __init__(
        self,
        url: str = "nats://127.0.0.1:4222",
        *,
        stream: str = "JOBFENCE",
        subject_prefix: str = "jobfence",
        replicas: int = 1,
        default_lease_seconds: float = 30.0,
        stream_wait_seconds: float = 30.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if not _NAME.match(stream):
            raise ConfigError(f"stream must be letters, digits, _ or -, got {stream!r}")
        if not _SUBJECT_TOKEN.match(subject_prefix):
            raise ConfigError(f"subject_prefix must be a valid subject, got {subject_prefix!r}")
        if not (stream_wait_seconds > 0 and math.isfinite(stream_wait_seconds)):
            raise ConfigError(
                f"stream_wait_seconds must be a finite number above 0, got {stream_wait_seconds!r}"
            )
        self._url = url
        self._tls = tls  # None: nats-py's default context when a server asks for TLS
        self._stream = stream
        self._subject_prefix = subject_prefix
        self._replicas = replicas
        self._stream_wait = stream_wait_seconds
        self._default_lease = default_lease_seconds
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._inbox: _AckInbox | None = None
        self._connect_lock = asyncio.Lock()
        self._ack_wait: dict[str, float] = {}  # queue -> the AckWait its consumer has
        self._unanswered: set[str] = set()  # queues whose publish or pull nothing answered
        self._recheck_at = 0.0
        self._leased: set[str] = set()  # queues received from here: their lease is known
        self._consumers_checked_at = 0.0
        self._closed = False

    # -- connection, stream and consumers ------------------------------------------------

    async def _jetstream(self) -> JetStreamContext:
        async with self._connect_lock:
            if self._nc is not None and self._nc.is_closed and not self._closed:
                # The client gave up reconnecting (or was closed under us): a new one, so
                # that the queue comes back with its broker.
                self._nc, self._js = None, None
            elif self._nc is not None and not self._closed and _stopped_reading(self._nc):
                # Connected, but its read loop ended on an error of nats-py's own (it logs it,
                # with no error callback): nothing would be received any more. A new one.
                log.warning(
                    "the NATS connection stopped reading (nats-py's read loop ended on an "
                    "error): connecting again"
                )
                stale, self._nc, self._js = self._nc, None, None
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(stale.close(), _RECHECK_ANSWER_SECONDS)
            if self._js is None:
                client = _Client()
                client.require_tls = self._url.strip().lower().startswith("tls://")
                await client.connect(
                    [server.strip() for server in self._url.split(",")],
                    name="jobfence",
                    tls=self._tls,
                    # Seconds, slept with asyncio.sleep: a float works (typed int).
                    reconnect_time_wait=_RECONNECT_SECONDS,  # type: ignore[arg-type]
                    error_cb=_client_error,
                )
                self._nc = client
                # Once connected, never give up reconnecting (nats-py closes the client for
                # good after 60 failed attempts, 2 minutes): an outage ends when the server is
                # back, however long it lasted. The first connection keeps the bound above.
                self._nc.options["max_reconnect_attempts"] = -1
                js = self._nc.jetstream()
                try:
                    await self._ensure_stream(js)
                except BaseException:
                    nc, self._nc = self._nc, None
                    with contextlib.suppress(Exception):
                        await nc.close()
                    raise
                self._inbox = await _AckInbox.open(self._nc)
                await self._nc.subscribe(
                    f"$JS.EVENT.ADVISORY.STREAM.UPDATED.{self._stream}", cb=self._stream_edited
                )
                await self._nc.subscribe(
                    f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self._stream}.*",
                    cb=self._max_delivered,
                )
                self._js = js
            return self._js

    async def _ensure_stream(self, js: JetStreamContext) -> None:
        """The stream, created when missing. On a fresh cluster the stream's creation can go
        unanswered or meet no leader (workers started together race to create it, servers are
        still electing): retried with backoff for up to ``stream_wait_seconds``, an existing
        stream (whoever created it) being success; then one ``QueueUnavailable`` saying what
        did not answer."""
        config = self._stream_config()
        give_up = time.monotonic() + self._stream_wait
        pause = 0.1
        while True:
            try:
                try:
                    info = await js.stream_info(self._stream)
                except NotFoundError:
                    await js.add_stream(config)
                    return
                self._check_replicas(info.config.num_replicas or 1)
                dangers = _stream_dangers(info.config)
                if dangers:
                    raise ConfigError(
                        f"the NATS stream {self._stream} exists with settings that can drop a"
                        f" job jobfence accepted, with no dead letter: {'; '.join(dangers)}."
                        " jobfence does not use it: change them, or give jobfence a stream"
                        " of its own (the URL's stream=)"
                    )
                return
            except BadRequestError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:
                    raise  # created meanwhile with other settings: its info is asked next
                last: BaseException = exc
            except (nats.errors.TimeoutError, TimeoutError) as exc:
                last = exc
            except Exception as exc:
                if not _no_leader(exc):
                    raise
                last = exc
            if time.monotonic() + pause > give_up:
                raise QueueUnavailable(
                    f"NATS JetStream did not create or confirm the stream {self._stream} "
                    f"({self._replicas} replica(s)) within {self._stream_wait:g}s; last "
                    f"answer: {type(last).__name__}: {last}"
                ) from last
            await asyncio.sleep(pause * random.uniform(0.5, 1.0))
            pause = min(pause * 2, 2.0)

    def _stream_config(self) -> StreamConfig:
        return StreamConfig(
            name=self._stream,
            subjects=[f"{self._subject_prefix}.>"],
            storage=StorageType.FILE,
            retention=RetentionPolicy.WORK_QUEUE,
            num_replicas=self._replicas,
        )

    async def _recheck(self) -> None:
        """After "no responders" on a publish or a pull of a queue: does the stream exist, and
        the queue's consumer? One that was deleted on the server (by hand, or lost with a
        server's JetStream store) is made again, with a WARNING: the messages it held are gone
        with it. Asked at most every ``_RECHECK_SECONDS``; no answer (a cluster electing a
        leader, the server away) leaves things as they are until the next time."""
        if not self._unanswered or time.monotonic() < self._recheck_at or self._nc is None:
            return
        self._recheck_at = time.monotonic() + _RECHECK_SECONDS
        js = self._nc.jetstream(timeout=_RECHECK_ANSWER_SECONDS)
        try:
            try:
                await js.stream_info(self._stream)
            except NotFoundError:
                await js.add_stream(self._stream_config())
                self._ack_wait.clear()  # its consumers went with it
                self._unanswered.clear()
                log.warning(
                    "the NATS stream %s was gone (deleted on the server, or lost with a "
                    "server's JetStream store): made again; the messages it held are gone "
                    "with it",
                    self._stream,
                )
                return
            for queue in sorted(self._unanswered):
                try:
                    await js.consumer_info(self._stream, self._durable(queue))
                except NotFoundError:
                    self._ack_wait.pop(queue, None)  # made again at its next use
                    log.warning(
                        "the NATS consumer of queue %s on stream %s was gone (deleted on the "
                        "server): made again",
                        queue,
                        self._stream,
                    )
            self._unanswered.clear()
        except Exception as exc:
            log.debug("NATS stream %s not checked now (%s)", self._stream, type(exc).__name__)

    async def _stream_edited(self, msg: Msg) -> None:
        """JetStream's advisory that the stream was edited on the server (``nats stream
        edit``): an ERROR when its settings can now drop a job. The workers go on (the jobs it
        holds are still delivered), but a job it drops is not dead-lettered."""
        if self._nc is None:
            return
        try:
            info = await self._nc.jetstream(timeout=_RECHECK_ANSWER_SECONDS).stream_info(
                self._stream
            )
        except Exception as exc:
            log.debug("NATS stream %s not checked now (%s)", self._stream, type(exc).__name__)
            return
        dangers = _stream_dangers(info.config)
        if dangers:
            log.error(
                "the NATS stream %s was edited on the server and can now drop a job jobfence "
                "accepted, with no dead letter and no other log line: %s; change it back",
                self._stream,
                "; ".join(dangers),
            )

    def _check_replicas(self, replicas: int) -> None:
        """A WARNING when the existing stream keeps fewer copies than this adapter asks for:
        ``replicas`` applies when the stream is created, and the stream was created before."""
        if replicas < self._replicas:
            log.warning(
                "the NATS stream %s has %d replica(s), fewer than the %d asked for (replicas=%d): "
                "it was created before with fewer; losing a server can stall its jobs; raise it "
                "with nats stream edit %s --replicas %d",
                self._stream,
                replicas,
                self._replicas,
                self._replicas,
                self._stream,
                self._replicas,
            )

    def _subject(self, queue: str) -> str:
        if not _SUBJECT_TOKEN.match(queue):
            raise ConfigError(
                f"a NATS queue name is dot-separated letters, digits, _ or -, got {queue!r}"
            )
        return f"{self._subject_prefix}.{queue}"

    @staticmethod
    def _durable(queue: str) -> str:
        digest = hashlib.sha256(queue.encode()).hexdigest()[:8]
        return f"jobfence_{re.sub(r'[^A-Za-z0-9_-]', '_', queue)}_{digest}"

    async def _consumer(self, queue: str, lease_seconds: float | None) -> str:
        """The durable consumer of ``queue``, created (or its AckWait changed) as needed."""
        js = await self._jetstream()
        durable = self._durable(queue)
        wanted = lease_seconds if lease_seconds is not None else self._ack_wait.get(queue)
        if queue in self._ack_wait and (wanted is None or wanted == self._ack_wait[queue]):
            if lease_seconds is not None:
                self._leased.add(queue)  # its settings are checked (_check_consumers)
            return durable
        if wanted is None:
            # A publisher (the outbox relay, a replay) has no lease of its own: it keeps the
            # AckWait the workers set, and only creates a consumer that does not exist yet.
            with contextlib.suppress(NotFoundError):
                info = await js.consumer_info(self._stream, durable)
                self._ack_wait[queue] = float(info.config.ack_wait or self._default_lease)
                return durable
        ack_wait = wanted if wanted is not None else self._default_lease
        await js.add_consumer(self._stream, self._consumer_config(queue, ack_wait))
        self._ack_wait[queue] = ack_wait
        if lease_seconds is not None:
            self._leased.add(queue)
        return durable

    def _consumer_config(self, queue: str, ack_wait: float) -> ConsumerConfig:
        """jobfence's settings for the consumer of ``queue``."""
        return ConsumerConfig(
            durable_name=self._durable(queue),
            filter_subject=self._subject(queue),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait,
            max_deliver=-1,
            max_ack_pending=-1,
        )

    async def _check_consumers(self, queues: Sequence[str]) -> None:
        """At most every ``_CONSUMER_CHECK_SECONDS``: the consumers of ``queues`` that this
        adapter made or set (at its first receive) still have jobfence's settings, or are put
        back (:meth:`_put_back`). No answer leaves things as they are until the next time."""
        if self._nc is None:
            return
        self._consumers_checked_at = time.monotonic() + _CONSUMER_CHECK_SECONDS
        js = self._nc.jetstream(timeout=_RECHECK_ANSWER_SECONDS)
        for queue in queues:
            if queue not in self._leased:
                continue  # set to jobfence's settings by this receive
            try:
                info = await js.consumer_info(self._stream, self._durable(queue))
            except NotFoundError:
                self._unanswered.add(queue)  # made again by _recheck, with its WARNING
                self._recheck_at = 0.0
                continue
            except Exception as exc:
                log.debug("NATS consumers not checked now (%s)", type(exc).__name__)
                return
            await self._put_back(js, queue, info.config)

    async def _put_back(self, js: JetStreamContext, queue: str, config: ConsumerConfig) -> None:
        """The consumer of ``queue``, found with ``config``, put back to jobfence's settings
        when someone changed them on the server, with one log line naming each: an ERROR when
        the change can strand a job (max_deliver, backoff, the filter subject, the ack or
        deliver policy, a push subject), else a WARNING. A consumer whose filter subject (or
        policy) changed is deleted and made again: one that pulled while filtered elsewhere
        skipped the queue's jobs published meanwhile, and goes on skipping them under its old
        filter too; made again, it delivers every job in the stream (those held now a second
        time: the fence absorbs them)."""
        ack_wait = self._ack_wait.get(queue) if queue in self._leased else None
        if ack_wait is None:  # a publisher: it does not know the workers' lease
            ack_wait = float(config.ack_wait or self._default_lease)
        wanted = self._consumer_config(queue, ack_wait)
        changes, strands, remake = _consumer_changes(config, wanted)
        if not changes:
            return
        durable = self._durable(queue)
        try:
            if remake:
                with contextlib.suppress(NotFoundError):
                    await js.delete_consumer(self._stream, durable)
            await js.add_consumer(self._stream, wanted)
        except Exception as exc:
            log.error(
                "the NATS consumer %s of queue %s on stream %s was changed on the server: %s;"
                " it could not be put back (%s: %s): change it back",
                durable,
                queue,
                self._stream,
                "; ".join(changes),
                type(exc).__name__,
                exc,
            )
            return
        log.log(
            logging.ERROR if strands else logging.WARNING,
            "the NATS consumer %s of queue %s on stream %s was changed on the server: %s; %s",
            durable,
            queue,
            self._stream,
            "; ".join(changes),
            "made again with jobfence's settings (every job in the stream is delivered; those"
            " held now once more)"
            if remake
            else "put back to jobfence's settings",
        )

    async def _max_delivered(self, msg: Msg) -> None:
        """JetStream's advisory that a message of a consumer reached its ``max_deliver``: the
        server will never deliver it again, and it stays in the work-queue stream for ever (a
        jobfence consumer has none, so someone set one on the server). The job is published
        again from the stored copy, its deliveries counted in ``Jobfence-Prior`` (its next
        delivery is the attempt after them; the retry policy dead-letters it when they run
        out), the stranded one deleted, and the consumer's settings put back, with an ERROR.
        Every process of the stream hears the advisory: the copy's ``Nats-Msg-Id`` lets the
        stream keep one, and only the process whose copy was stored logs it."""
        if self._nc is None or self._closed:
            return
        # Any client allowed to publish on the advisory's subject can write one: a field of
        # another type or out of range is not the server's, and moves nothing.
        try:
            advisory = json.loads(msg.data)
            seq, deliveries = advisory["stream_seq"], advisory["deliveries"]
            durable = advisory["consumer"]
        except (ValueError, TypeError, KeyError):
            return
        if not (
            type(seq) is int
            and type(deliveries) is int
            and isinstance(durable, str)
            and 1 <= seq <= _MAX_STREAM_SEQ
            and 1 <= deliveries <= MAX_PRIOR_ATTEMPTS
        ):
            return
        prefix = f"{self._subject_prefix}."
        js = self._nc.jetstream(timeout=_RECHECK_ANSWER_SECONDS)
        try:
            try:
                stored = await js.get_msg(self._stream, seq)
            except NotFoundError:
                return  # published again by another process already (or acked meanwhile)
            subject = stored.subject or ""
            queue = subject[len(prefix) :] if subject.startswith(prefix) else ""
            if not queue or self._durable(queue) != durable:
                return  # not a jobfence queue's message, or not its consumer
            headers = dict(stored.headers or {})
            prior = headers.get(_H_PRIOR)
            if prior is None or prior.isdigit():  # else unreadable: copied as it is
                headers[_H_PRIOR] = str(int(prior or 0) + deliveries)
            headers[_H_MSG_ID] = f"jobfence-max-deliver-{seq}"
            # The consumer's settings first, so that the copy is not stopped the same way.
            await self._put_back(js, queue, (await js.consumer_info(self._stream, durable)).config)
            ack = await js.publish(
                subject, stored.data or b"", stream=self._stream, headers=headers
            )
            with contextlib.suppress(NotFoundError):
                await js.delete_msg(self._stream, seq)
            if not ack.duplicate:
                log.error(
                    "the NATS consumer %s of queue %s on stream %s stopped delivering job %s"
                    " (stream sequence %d) after %d deliveries: its max_deliver was set on the"
                    " server; the job was published again with its deliveries counted",
                    durable,
                    queue,
                    self._stream,
                    shown_value(headers.get(_H_JOB_ID)) or "?",
                    seq,
                    deliveries,
                )
        except Exception as exc:
            log.error(
                "the NATS consumer %s on stream %s stopped delivering the message of stream"
                " sequence %d after %d deliveries (its max_deliver was set on the server), and"
                " it could not be published again (%s: %s): it stays in the stream, not"
                " delivered (setting max_deliver back does not deliver it); delete the"
                " consumer (nats consumer rm %s %s): the workers make it again, and it"
                " delivers every job in the stream",
                shown_value(durable),
                self._stream,
                seq,
                deliveries,
                type(exc).__name__,
                exc,
                self._stream,
                shown_value(durable),
            )

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
            raise refuse_delay("NatsQueue", "publish", "JetStream cannot hold a new message back")
        await self._publish(message, prior=check_prior_attempts(prior_attempts))

    async def publish_many(self, outgoing: Sequence[Outgoing]) -> list[Exception | None]:
        """Every message sent as an asynchronous JetStream publish, then their acks awaited
        together (up to ``_ACKS_WITHIN`` seconds): one round trip for the lot instead of one
        per message. A message over the server's ``max_payload`` is refused
        (:class:`~jobfence.errors.PublishRefused`) without being sent; a lost connection, or
        acks that do not come, are ``QueueUnavailable`` for each message concerned."""
        if not outgoing:
            return []
        try:
            refused = await self._ready_to_publish({item.message.queue for item in outgoing})
        except Exception as exc:
            return [exc] * len(outgoing)
        nc, inbox = self._nc, self._inbox
        assert nc is not None and inbox is not None  # _ready_to_publish connected
        results: list[Exception | None] = [None] * len(outgoing)
        acks: dict[int, asyncio.Future[None]] = {}
        subjects: dict[str, str] = {}
        for n, item in enumerate(outgoing):
            message = item.message
            if (refusal := refused.get(message.queue)) is not None:
                results[n] = refusal
                continue
            try:
                subject = subjects.get(message.queue)
                if subject is None:
                    subject = subjects[message.queue] = self._publish_subject(message.queue)
                headers = self._headers_of(
                    message, check_prior_attempts(item.prior_attempts), item.publish_id
                )
                headers[_H_EXPECTED_STREAM] = self._stream
                self._check_connected()
                reply, ack = inbox.expect()
                try:
                    await nc.publish(subject, message.body, reply=reply, headers=headers)
                except BaseException:
                    inbox.forget(reply)
                    raise
                acks[n] = ack
            except Exception as exc:
                results[n] = _as_unavailable(exc, self._stream)
        pending = await self._acks(list(acks.values()))
        for n, future in acks.items():
            if future in pending:
                results[n] = QueueUnavailable(
                    "NATS unreachable: the connection was lost, or no JetStream ack came"
                    f" within {_ACKS_WITHIN:g}s"
                )
            elif (error := future.exception()) is not None:
                if isinstance(error, NoStreamResponseError):
                    self._unanswered.add(outgoing[n].message.queue)
                results[n] = _as_unavailable(error, self._stream)
        return results

    async def _acks(self, futures: list[asyncio.Future[Any]]) -> set[asyncio.Future[Any]]:
        """Wait for ``futures`` (JetStream acks) up to ``_ACKS_WITHIN`` seconds, or until the
        connection is lost (then they would never come); cancels and returns those pending."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _ACKS_WITHIN
        pending = set(futures)
        while pending:
            remaining = deadline - loop.time()
            if remaining <= 0 or self._nc is None or not self._nc.is_connected:
                break
            _, pending = await asyncio.wait(pending, timeout=min(remaining, 0.25))
        for future in pending:
            future.cancel()
        return pending

    @_unavailable
    async def _ready_to_publish(self, queues: set[str]) -> dict[str, Exception]:
        """The stream, and the durable consumer of each queue of ``queues``; returns the error
        of each queue whose consumer JetStream would not create (a stream's consumer limit):
        that queue's messages fail, and the others are published. A lost connection or a
        cluster without a leader raises."""
        await self._jetstream()
        await self._recheck()
        refused: dict[str, Exception] = {}
        for queue in sorted(queues):
            if _SUBJECT_TOKEN.match(queue):  # else its messages are refused one by one
                try:
                    await self._consumer(queue, None)
                except Exception as exc:
                    if isinstance(_as_unavailable(exc, self._stream), QueueUnavailable):
                        raise
                    refused[queue] = exc
        return refused

    def _publish_subject(self, queue: str) -> str:
        try:
            return self._subject(queue)
        except ConfigError as exc:
            raise PublishRefused(f"NATS refuses this message: {exc}") from None

    @property
    def max_message_bytes(self) -> int | None:
        """The largest message the server accepts, for the outbox relay to record for
        producers: the ``max_payload`` of the last server connected to (kept while it is
        away); None before the first connection."""
        return None if self._nc is None else int(self._nc.max_payload)

    @property
    def max_payload(self) -> int | None:
        """The largest message (headers and body, bytes) the connected server accepts: its
        ``max_payload``, from the INFO it sent at connect; None before connecting."""
        if self._nc is None or not self._nc.is_connected:
            return None
        return int(self._nc.max_payload)

    def _check_connected(self) -> None:
        if self._nc is not None and not self._nc.is_connected:
            # nats-py would buffer the publish and time out its ack 5 s later: the broker is
            # away now, and the caller (the outbox relay) backs off instead.
            raise nats.errors.ConnectionReconnectingError

    async def _publish(self, message: Message, *, prior: int) -> None:
        js = await self._jetstream()
        self._check_connected()
        await self._recheck()
        await self._consumer(message.queue, None)
        try:
            await js.publish(
                self._subject(message.queue),
                message.body,
                stream=self._stream,
                headers=self._headers_of(message, prior),
            )
        except NoStreamResponseError:
            self._unanswered.add(message.queue)
            raise
        except APIError as exc:
            full = _stream_full(exc, self._stream)
            if full is not None:
                raise full from exc
            raise

    def _headers_of(
        self, message: Message, prior: int, publish_id: str | None = None
    ) -> dict[str, str]:
        """The message's headers, or :class:`PublishRefused` when they and the body are over
        the server's ``max_payload``."""
        headers = {
            _H_CONSUMER: _header(message.consumer),
            _H_JOB_ID: _header(message.job_id),
            _H_PRIOR: str(prior),
        }
        if publish_id is not None:
            headers[_H_MSG_ID] = _header(publish_id)
        if message.tenant_id is not None:
            headers[_H_TENANT] = _header(message.tenant_id)
        if message.correlation_id is not None:
            headers[_H_CORRELATION] = _header(message.correlation_id)
        if message.traceparent is not None:  # W3C names, as other OpenTelemetry clients use
            headers[_H_TRACEPARENT] = message.traceparent
            if message.tracestate is not None:
                headers[_H_TRACESTATE] = message.tracestate
        limit = self.max_payload
        if limit is not None:
            size = len(message.body) + _headers_size(headers, self._stream)
            if size > limit:
                raise PublishRefused(
                    f"NATS refuses this message: {size:,} bytes with its headers, over the"
                    f" server's max_payload of {limit:,} bytes"
                )
        return headers

    @_unavailable
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
            await self._recheck()
            durables = [(q, await self._consumer(q, lease_seconds)) for q in queues]
            if time.monotonic() >= self._consumers_checked_at:
                await self._check_consumers(queues)
            got: list[Delivery] = []
            for queue, durable in durables:
                got += await self._pull(queue, durable, max_messages - len(got), None)
                if len(got) >= max_messages:
                    return got
            while not got and not self._closed and durables:
                remaining = deadline - loop.time()
                if remaining <= 0.01:
                    break
                # A delivery's lease is counted from its pull request's send time, so a long
                # lingering request would eat into it: at most a quarter of the lease.
                slice_ = min(remaining, _WAIT_SLICE_SECONDS, lease_seconds / 4) / len(durables)
                for queue, durable in durables:
                    got += await self._pull(queue, durable, max_messages, max(slice_, 0.01))
                    if got or self._closed:
                        break
            return got
        except Exception:
            if self._closed:
                return []
            raise

    async def _pull(
        self, queue: str, durable: str, batch: int, expires: float | None
    ) -> list[Delivery]:
        """One pull request: no-wait (``expires`` None) or lingering up to ``expires``.

        Waits for the server's closing status (no messages, request timeout) unless the batch
        fills, so no message is delivered to a request nobody reads any more."""
        await self._jetstream()
        assert self._nc is not None
        nc = self._nc
        if nc.is_reconnecting:
            # nats-py would buffer the request and let it go unanswered: say the server is away,
            # so that the worker logs one outage (went away, back) instead of idling.
            raise nats.errors.ConnectionReconnectingError
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        request: dict[str, Any] = {"batch": batch}
        if expires is None:
            request["no_wait"] = True
            answer_within = _NO_WAIT_ANSWER_SECONDS
        else:
            request["expires"] = int(expires * 1_000_000_000)
            answer_within = expires + _NO_WAIT_ANSWER_SECONDS
        sent = time.monotonic()
        lease = self._ack_wait[queue]
        lease_deadline = sent + lease - _lease_margin(lease)
        got: list[Delivery] = []
        try:
            await nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{self._stream}.{durable}",
                json.dumps(request).encode(),
                reply=inbox,
            )
            give_up = sent + answer_within
            while len(got) < batch:
                try:
                    msg = await sub.next_msg(timeout=max(give_up - time.monotonic(), 0.001))
                except (TimeoutError, nats.errors.TimeoutError):
                    log.debug(
                        "a pull request on %s got no closing answer within %.1fs",
                        queue,
                        answer_within,
                    )
                    self._unanswered.add(queue)  # a consumer always answers: is it there?
                    break
                if msg.reply:
                    # A delivery: JetStream gives each one a reply subject ($JS.ACK...), and
                    # its headers are its publisher's (a header "Status" is theirs, not the
                    # server's status line).
                    got.append(self._delivery(queue, msg, lease_deadline))
                    continue
                status = (msg.headers or {}).get("Status")
                if status == "100":  # idle heartbeat
                    continue
                if status == "503":  # no responders: the consumer has no leader now, or is gone
                    self._unanswered.add(queue)
                    raise nats.errors.NoRespondersError
                break  # 404 no messages, 408 request timeout, 409 and the like
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return got

    @staticmethod
    def _delivery(queue: str, msg: Msg, lease_deadline: float) -> Delivery:
        """Every field read by :func:`read_delivery`: one that does not parse makes this one
        message an ``UnfenceableMessage`` dead letter, never a failed pull batch."""
        receipt = NatsReceipt(msg=msg, prior=0, deadline=lease_deadline)
        try:
            headers = msg.headers or {}
            delivered: object = msg.metadata.num_delivered
        except Exception as exc:  # a reply subject the client cannot read: not ours to judge
            headers, delivered = {}, 1
            unreadable: str | None = f"its metadata cannot be read ({type(exc).__name__})"
        else:
            unreadable = None
        consumer, job_id = headers.get(_H_CONSUMER, ""), headers.get(_H_JOB_ID, "")
        tenant, correlation = headers.get(_H_TENANT), headers.get(_H_CORRELATION)
        encoded = any(
            isinstance(v, str) and "%" in v for v in (consumer, job_id, tenant, correlation)
        )
        delivery, receipt.prior = read_delivery(
            _NAMES,
            queue=queue,
            body=bytes(msg.data),
            consumer=consumer,
            job_id=job_id,
            tenant_id=tenant,
            correlation_id=correlation,
            prior=headers.get(_H_PRIOR),
            delivered=delivered,
            receipt=receipt,
            decode=_unquote if encoded else None,
            traceparent=headers.get(_H_TRACEPARENT),
            tracestate=headers.get(_H_TRACESTATE),
        )
        if isinstance(msg.headers, _UnreadableHeaders) and unreadable is None:
            unreadable = msg.headers.why
        if unreadable is not None and delivery.unreadable is None:
            delivery = replace(delivery, unreadable=unreadable)
        receipt.unreadable = delivery.unreadable is not None
        return delivery

    @staticmethod
    def _holds(receipt: NatsReceipt) -> bool:
        return not receipt.settled and time.monotonic() < receipt.deadline

    @_unavailable
    async def ack(self, delivery: Delivery, *, tx: AsyncConnection[Any] | None = None) -> bool:
        if tx is not None:
            raise _refuse_tx("ack")
        receipt = _receipt(delivery)
        if not self._holds(receipt):
            return False
        receipt.settled = True
        await receipt.msg.ack_sync()
        return True

    @_unavailable
    async def extend(self, delivery: Delivery, *, lease_seconds: float) -> bool:
        """An in-progress ack (``+WPI``): the server restarts the message's AckWait, the
        consumer's own setting, so the lease runs for AckWait (not ``lease_seconds``) from the
        moment the server sees it. The client-side deadline moves with it, by the shorter of
        the two, minus the margin; the flush waits until the server has it."""
        receipt = _receipt(delivery)
        if not self._holds(receipt):
            return False
        sent = time.monotonic()
        await receipt.msg.in_progress()
        if self._nc is not None:
            await self._nc.flush()
        ack_wait = self._ack_wait.get(delivery.message.queue, lease_seconds)
        lease = min(lease_seconds, ack_wait)
        receipt.deadline = max(receipt.deadline, sent + lease - _lease_margin(lease))
        return True

    @_unavailable
    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """Per JetStream consumer, plain acks for all but the last, then the last with
        ``ack_sync``: the server handles one connection's acks to a consumer in order, so its
        answer to the last one says the batch was applied, for one round trip instead of one
        per delivery."""
        by_consumer: dict[str, list[NatsReceipt]] = {}
        for delivery in deliveries:
            receipt = _receipt(delivery)
            if self._holds(receipt):
                receipt.settled = True
                by_consumer.setdefault(receipt.msg.metadata.consumer or "", []).append(receipt)
        for held in by_consumer.values():
            *rest, last = held
            for receipt in rest:
                await receipt.msg.ack()
            await last.msg.ack_sync()

    @_unavailable
    async def retry(self, delivery: Delivery, *, delay_seconds: float, error: str) -> bool:
        receipt = _receipt(delivery)
        if not self._holds(receipt):
            return False
        receipt.settled = True
        await receipt.msg.nak(delay=delay_seconds if delay_seconds > 0 else None)
        if self._nc is not None:
            await self._nc.flush()
        return True

    @_unavailable
    async def release(self, delivery: Delivery) -> None:
        receipt = _receipt(delivery)
        if not self._holds(receipt):
            return
        receipt.settled = True
        if receipt.unreadable:  # back as it was published (counted: it is dead-lettered anyway)
            await receipt.msg.nak()
            return
        delivered = int(receipt.msg.metadata.num_delivered)
        try:
            await self._publish(delivery.message, prior=receipt.prior + delivered - 1)
        except BaseException:
            with contextlib.suppress(Exception):  # back at once, counted, not after AckWait
                await receipt.msg.nak()
            raise
        await receipt.msg.ack_sync()

    @_unavailable
    async def size(self, queues: Sequence[str]) -> QueueSize:
        """``due``: messages never delivered; ``total`` adds those delivered and not yet acked
        (leased, or waiting for a redelivery after a nak or a lost lease)."""
        js = await self._jetstream()
        due = total = 0
        for queue in queues:
            try:
                info = await js.consumer_info(self._stream, self._durable(queue))
            except NotFoundError:
                continue
            due += info.num_pending or 0
            total += (info.num_pending or 0) + (info.num_ack_pending or 0)
        return QueueSize(due=due, total=total)

    @_unavailable
    async def backlog(self, queues: Sequence[str]) -> int:
        """Every message in the stream, of every queue (work-queue retention: an acked message
        is gone; a leased or nak'ed one is still there). ``queues`` is not needed."""
        js = await self._jetstream()
        try:
            info = await js.stream_info(self._stream)
        except NotFoundError:
            return 0
        return int(info.state.messages or 0)

    async def close(self) -> None:
        """Close the connection; a waiting receiver returns an empty list."""
        if self._closed:
            return
        self._closed = True
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()


async def open_queue(url: str) -> NatsQueue:
    """The factory ``JOBFENCE_QUEUE_URL=nats://...`` uses (``jobfence.queues``): the adapter,
    connected to JetStream with its stream, so a bad or unreachable URL fails here. ``url`` may
    be a seed list (``nats://a:4222,nats://b:4222``) and carry the ``stream``,
    ``subject_prefix``, ``replicas`` and ``stream_wait`` parameters
    (:func:`jobfence.queues.parse_queue_url`).

    A first connection that tries each server at most twice checks that one answers: the
    client would otherwise keep retrying (and logging each failure) for minutes."""

    from jobfence.queues import parse_queue_url

    target = parse_queue_url(url)
    assert target.client_url is not None
    servers = target.client_url.split(",")
    settings = target.settings
    tls = tls_context(settings.tls_ca, settings.tls_cert, settings.tls_key)
    errors: list[Exception] = []
    unverified = asyncio.Event()

    async def quiet(exc: Exception) -> None:
        errors.append(exc)
        if isinstance(exc, ssl.SSLCertVerificationError):
            unverified.set()

    # Each server of a seed list is tried (twice at most): one that is down does not fail the
    # start-up while another answers. A certificate that does not verify stops it at once:
    # it will not verify on the next try, and nats-py's next try on that connection hangs.
    probe = _Client()
    probe.require_tls = target.client_url.lower().startswith("tls://")
    connecting = asyncio.ensure_future(
        probe.connect(
            servers,
            name="jobfence",
            connect_timeout=5,
            max_reconnect_attempts=1,
            reconnect_time_wait=1,
            error_cb=quiet,
            tls=tls,
        )
    )
    refused = asyncio.ensure_future(unverified.wait())
    try:
        await asyncio.wait({connecting, refused}, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
            raise next(e for e in errors if isinstance(e, ssl.SSLCertVerificationError))
        await connecting
    except nats.errors.NoServersError:
        # Why the last try failed (no TLS offered, say) says more than "no servers available".
        reason = next((e for e in reversed(errors) if isinstance(e, TlsNotOffered)), None)
        if reason is not None:
            raise reason from None
        raise
    finally:
        refused.cancel()
        connecting.cancel()
        with contextlib.suppress(Exception):  # what failed the start-up is the error to see
            await probe.close()
    queue = NatsQueue(
        target.client_url,
        stream=settings.stream,
        subject_prefix=settings.subject_prefix,
        replicas=settings.replicas,
        stream_wait_seconds=settings.stream_wait,
        tls=tls,
    )
    try:
        await queue._jetstream()
    except BaseException:
        await queue.close()
        raise
    return queue
