"""OpenTelemetry traces, when ``opentelemetry-api`` is installed (``jobfence[otel]``).

Spans follow the OpenTelemetry semantic conventions for messaging, version **1.27.0**
(still marked Development upstream, hence the pin): ``create`` where a producer writes a job,
``send`` where the outbox relay publishes it to a broker, ``process`` around a job's fence
transaction in the worker. ``messaging.system`` is ``jobfence`` on every span, whatever the
queue (docs/observability.md).

The W3C trace context (``traceparent``, ``tracestate``) travels with the job: in the queue
row, the outbox row and the broker message. It is parsed here, at the boundary, by
:func:`valid_traceparent` and :func:`valid_tracestate`: a value that does not parse is dropped
(the job goes on without it), never an error.

Without ``opentelemetry-api`` nothing here imports it and every function is a constant: the
job goes through exactly as without this module. With the API and no SDK configured the
tracer is the API's no-op one; the worker then neither allocates a link nor attaches a context
per job (:func:`process` returns a shared do-nothing context manager).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from jobfence.model import Delivery, Message

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanContext

try:
    from opentelemetry import trace as _trace
    from opentelemetry.trace import SpanKind, TraceFlags, TraceState
except ImportError:  # the extra is absent: every function below is a constant
    _trace = None  # type: ignore[assignment]

__all__ = [
    "ENABLED",
    "SEMCONV_VERSION",
    "carried",
    "current_ids",
    "current_traceparent",
    "trace_id_of",
    "valid_traceparent",
    "valid_tracestate",
]

SEMCONV_VERSION = "1.27.0"
ENABLED = _trace is not None

MAX_TRACESTATE_CHARS = 512  # W3C: vendors propagate at least 512 characters; more is dropped
_MAX_MEMBERS = 32
_MAX_ATTRIBUTE_CHARS = 1024
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
# A simple key starts with a letter (W3C Trace Context, the Recommendation, as OpenTelemetry
# reads it: a member it cannot read drops the whole tracestate, with a WARNING quoting it).
_MEMBER = re.compile(
    r"[ \t]*(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*"
)
_STATE_KEY = "jobfence"  # the tracestate member a replay adds: the failed attempt's ids
_REPLAYED_FROM = re.compile(r"(?:^|,)[ \t]*jobfence=([0-9a-f]{32})-([0-9a-f]{16})[ \t]*(?:,|$)")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_NOTHING: AbstractContextManager[None] = contextlib.nullcontext()

# The semantic conventions' attribute names (messaging, 1.27.0) and jobfence's own.
SYSTEM = "messaging.system"
DESTINATION = "messaging.destination.name"
GROUP = "messaging.consumer.group.name"
MESSAGE_ID = "messaging.message.id"
CONVERSATION_ID = "messaging.message.conversation_id"
OPERATION_TYPE = "messaging.operation.type"
OPERATION_NAME = "messaging.operation.name"
BATCH_COUNT = "messaging.batch.message_count"
ERROR_TYPE = "error.type"
ATTEMPT = "jobfence.attempt"
OUTCOME = "jobfence.outcome"
ACTOR = "jobfence.actor"


def valid_traceparent(value: object) -> str | None:
    """``value`` when it is a W3C ``traceparent`` of version 00 (55 characters, lowercase hex,
    trace and span ids not all zero), else None."""
    if not isinstance(value, str) or len(value) != 55:
        return None
    found = _TRACEPARENT.fullmatch(value)
    if found is None or found[1] == _ZERO_TRACE or found[2] == _ZERO_SPAN:
        return None
    return value


def valid_tracestate(value: object) -> str | None:
    """``value`` when it is a W3C ``tracestate`` of at most 512 characters and 32 members,
    else None (an empty one is None too)."""
    if not isinstance(value, str) or not value or len(value) > MAX_TRACESTATE_CHARS:
        return None
    members = value.split(",")
    if len(members) > _MAX_MEMBERS:
        return None
    for member in members:
        if member.strip(" \t") and _MEMBER.fullmatch(member) is None:
            return None
    return value


def carried(traceparent: object, tracestate: object) -> tuple[str | None, str | None]:
    """The trace context a broker message carries, parsed at its boundary: header values as
    text or bytes; what does not parse is dropped (a tracestate without a traceparent too)."""
    parent = valid_traceparent(_header_text(traceparent, 55))
    if parent is None:
        return None, None
    return parent, valid_tracestate(_header_text(tracestate, MAX_TRACESTATE_CHARS))


def _header_text(value: object, limit: int) -> str | None:
    if isinstance(value, bytes | bytearray | memoryview):
        if len(value) > limit:
            return None
        try:
            return bytes(value).decode("ascii")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def trace_id_of(traceparent: str | None) -> str | None:
    """The 32 hex digits of a valid ``traceparent``'s trace id, else None."""
    valid = valid_traceparent(traceparent)
    return None if valid is None else valid[3:35]


def _format(ctx: SpanContext) -> tuple[str, str | None]:
    state = ctx.trace_state.to_header() if ctx.trace_state else ""
    return (
        f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}",
        valid_tracestate(state),
    )


def _remote(traceparent: str | None, tracestate: str | None) -> SpanContext | None:
    """The span context a message carries (already validated at its boundary)."""
    if traceparent is None:
        return None
    state = TraceState.from_header([tracestate]) if tracestate else None
    return _trace.SpanContext(
        trace_id=int(traceparent[3:35], 16),
        span_id=int(traceparent[36:52], 16),
        is_remote=True,
        trace_flags=TraceFlags(int(traceparent[53:55], 16)),
        trace_state=state,
    )


def _text(value: str | None) -> str:
    return "" if value is None else value[:_MAX_ATTRIBUTE_CHARS]


_TRACERS: list[Any] = []


def _tracer() -> Any:
    """jobfence's tracer, got once: the API's proxy, which follows the provider the application
    sets (before or after this first call)."""
    if not _TRACERS:
        _TRACERS.append(_trace.get_tracer("jobfence", SEMCONV_VERSION))
    return _TRACERS[0]


@contextlib.contextmanager
def _current(span: Span) -> Iterator[Span]:
    """``span`` current while the block runs, and ended after it. An exception out of the block
    sets the span's status to ERROR and ``error.type`` to the exception's class, and records
    nothing else of it: its text may quote what the statement carried (SQLAlchemy adds the
    parameters, the job's body among them; a PostgreSQL ``DETAIL`` quotes the row), and the
    application that catches it decides where that text goes."""
    with _trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    ):
        try:
            yield span
        except Exception as exc:
            if span.is_recording():
                span.set_attribute(ERROR_TYPE, type(exc).__name__)
                span.set_status(_trace.StatusCode.ERROR)
            raise


def _message_attributes(message: Message, operation: str, kind: str) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        SYSTEM: "jobfence",
        DESTINATION: _text(message.queue),
        MESSAGE_ID: _text(message.job_id),
        OPERATION_TYPE: kind,
        OPERATION_NAME: operation,
        "jobfence.consumer": _text(message.consumer),
    }
    if message.correlation_id is not None:
        attributes[CONVERSATION_ID] = _text(message.correlation_id)
    return attributes


@contextlib.contextmanager
def _producer(
    message: Message,
    operation: str,
    kind: str,
    *,
    parent: Any = None,
    links: Sequence[SpanContext] = (),
    actor: str | None = None,
    member: str | None = None,
) -> Iterator[Message]:
    span = _tracer().start_span(
        f"{operation} {_text(message.queue)}", context=parent, kind=SpanKind.PRODUCER
    )
    ctx = span.get_span_context()
    if not ctx.is_valid:  # no SDK: pass on the context the caller is in, if any
        current = _trace.get_current_span().get_span_context() if parent is None else None
        if current is not None and current.is_valid:
            traceparent, tracestate = _format(current)
            message = replace(message, traceparent=traceparent, tracestate=_new_job(tracestate))
        yield message
        return
    if span.is_recording():
        span.set_attributes(_message_attributes(message, operation, kind))
        if actor is not None:
            span.set_attribute(ACTOR, _text(actor))
        for link in links:
            span.add_link(link)
    traceparent, tracestate = _format(ctx)
    tracestate = _new_job(tracestate)
    if member is not None:  # W3C: a vendor's member goes first
        tracestate = valid_tracestate(member + ("," + tracestate if tracestate else "")) or (
            tracestate
        )
    with _current(span):
        yield replace(message, traceparent=traceparent, tracestate=tracestate)


def _new_job(tracestate: str | None) -> str | None:
    """The ``tracestate`` a new job carries: the context's, less its ``jobfence`` member. That
    member names the failed attempt a replayed job's process span links to; a span in that
    context (the replayed job's, with ``trace_parent="child"``) passes it on to its children,
    and a job its handler enqueues is not a replay."""
    if tracestate is None or _STATE_KEY not in tracestate:
        return tracestate
    kept = [m for m in tracestate.split(",") if m.strip(" \t").partition("=")[0] != _STATE_KEY]
    return valid_tracestate(",".join(kept))


def create(message: Message) -> AbstractContextManager[Message]:
    """A producer writes ``message``: a PRODUCER span ``create <queue>``, child of the current
    context, whose context the yielded message carries."""
    if _trace is None:
        return contextlib.nullcontext(message)
    return _producer(message, "create", "create")


@dataclass(slots=True)
class Sends:
    """The ``send`` spans of a batch the outbox relay publishes (:func:`start_sends`)."""

    messages: list[Message]  # each carrying its send span's context
    spans: list[Any]

    def end(self, results: Sequence[BaseException | None]) -> None:
        """End each span; a message the broker did not confirm sets ``error.type``."""
        for span, result in zip(self.spans, results, strict=True):
            if result is not None and span.is_recording():
                span.set_attribute(ERROR_TYPE, type(result).__name__)
                span.set_status(_trace.StatusCode.ERROR)
            span.end()


def start_sends(messages: Sequence[Message]) -> Sends | None:
    """The outbox relay publishes ``messages`` (a batch, at once): a PRODUCER span
    ``send <queue>`` per message, child of the context it carries (its ``create``), not made
    current. None when no SDK records them (the messages keep their context)."""
    if _trace is None or not messages:
        return None
    tracer = _tracer()
    traced: list[Message] = []
    spans: list[Any] = []
    for message in messages:
        remote = _remote(message.traceparent, message.tracestate)
        parent = (
            None if remote is None else _trace.set_span_in_context(_trace.NonRecordingSpan(remote))
        )
        span = tracer.start_span(
            f"send {_text(message.queue)}", context=parent, kind=SpanKind.PRODUCER
        )
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return None  # no SDK: the same for every message of the batch
        if span.is_recording():
            span.set_attributes(_message_attributes(message, "send", "send"))
        traceparent, tracestate = _format(ctx)
        traced.append(replace(message, traceparent=traceparent, tracestate=tracestate))
        spans.append(span)
    return Sends(traced, spans)


def replay(message: Message, *, failed: str | None, actor: str) -> AbstractContextManager[Message]:
    """An operator replays a dead letter: a PRODUCER span ``replay <queue>`` (``create``), child
    of the current context, with the actor, linked to the failed attempt's span ``failed`` (its
    ``traceparent``, as the dead letter recorded it)."""
    if _trace is None:
        return contextlib.nullcontext(message)
    failed = valid_traceparent(failed)
    if failed is None:
        return _producer(message, "replay", "create", actor=actor)
    # The replayed job's process span links to the failed attempt too: the message carries its
    # ids as the tracestate member jobfence=<trace id>-<span id>.
    return _producer(
        message,
        "replay",
        "create",
        links=(_remote(failed, None),),  # type: ignore[arg-type]
        actor=actor,
        member=f"{_STATE_KEY}={failed[3:35]}-{failed[36:52]}",
    )


def process(delivery: Delivery, *, child: bool) -> AbstractContextManager[Span | None]:
    """The CONSUMER span ``process <queue>`` around one job, current while it runs (the
    handler's own spans are its children). It links to the producer's context, or is its child
    with ``child``. Yields None when no SDK records anything (no span, no context attached)."""
    if _trace is None:
        return _NOTHING
    message = delivery.message
    parent = None
    if child and message.traceparent is not None:
        remote = _remote(message.traceparent, message.tracestate)
        parent = _trace.set_span_in_context(_trace.NonRecordingSpan(remote))  # type: ignore[arg-type]
    span = _tracer().start_span(
        f"process {_text(message.queue)}", context=parent, kind=SpanKind.CONSUMER
    )
    if not span.get_span_context().is_valid:
        return _NOTHING
    if span.is_recording():
        attributes = _message_attributes(message, "process", "process")
        attributes[GROUP] = attributes.pop("jobfence.consumer")
        attributes[ATTEMPT] = delivery.attempt
        span.set_attributes(attributes)
        if not child and message.traceparent is not None:
            span.add_link(_remote(message.traceparent, message.tracestate))
        if message.tracestate is not None and _STATE_KEY in message.tracestate:
            _link_replayed_from(span, message.tracestate)
    return _current(span)


def _link_replayed_from(span: Span, tracestate: str) -> None:
    """A replayed job's process span links to the attempt that failed (its tracestate member
    ``jobfence=<trace id>-<span id>``, added by :func:`replay`)."""
    found = _REPLAYED_FROM.search(tracestate)
    if found is None or found[1] == _ZERO_TRACE or found[2] == _ZERO_SPAN:
        return
    failed = f"00-{found[1]}-{found[2]}-01"
    span.add_link(_remote(failed, None), {"jobfence.link": "replayed_from"})  # type: ignore[arg-type]


def process_group(deliveries: Sequence[Delivery]) -> AbstractContextManager[Span | None]:
    """The CONSUMER span of a group of jobs committed in one transaction: the batch size, and
    one link per job's producer context."""
    if _trace is None:
        return _NOTHING
    first = deliveries[0].message
    span = _tracer().start_span(f"process {_text(first.queue)}", kind=SpanKind.CONSUMER)
    if not span.get_span_context().is_valid:
        return _NOTHING
    if span.is_recording():
        attributes = _message_attributes(first, "process", "process")
        attributes[GROUP] = attributes.pop("jobfence.consumer")
        del attributes[MESSAGE_ID]
        attributes.pop(CONVERSATION_ID, None)
        attributes[BATCH_COUNT] = len(deliveries)
        span.set_attributes(attributes)
        for delivery in deliveries:
            message = delivery.message
            remote = _remote(message.traceparent, message.tracestate)
            if remote is not None:
                span.add_link(remote, {MESSAGE_ID: _text(message.job_id)})
    return _current(span)


_FINE = frozenset(("succeeded", "duplicate", "committed"))


def finish(span: Span, outcome: str) -> None:
    """Record a job's outcome on its process span; any but a success or a duplicate sets the
    span's status to ERROR (``error.type`` was set where the job failed: :func:`note_error`)."""
    if not span.is_recording():
        return
    span.set_attribute(OUTCOME, outcome)
    if outcome not in _FINE:
        span.set_status(_trace.StatusCode.ERROR)


def note_error(error_type: str) -> None:
    """Set ``error.type`` on the current span (a failing job's process span)."""
    if _trace is None:
        return
    span = _trace.get_current_span()
    if span.is_recording():
        span.set_attribute(ERROR_TYPE, error_type[:200])


def current_traceparent() -> str | None:
    """The ``traceparent`` of the current span, when there is a valid one."""
    if _trace is None:
        return None
    ctx = _trace.get_current_span().get_span_context()
    return _format(ctx)[0] if ctx.is_valid else None


def current_ids() -> tuple[str, str] | None:
    """The trace id and span id (hex) of the current span, when there is a valid one."""
    if _trace is None:
        return None
    ctx = _trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
