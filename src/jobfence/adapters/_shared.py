"""Small pieces the queue adapters need, written once: the receipt check, the refusals of a
transaction and of a delay an adapter cannot honour, and the reading of a broker message's
fields (:func:`read_delivery`), the one place where what a producer wrote is parsed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, NamedTuple, TypeVar

from jobfence.errors import ConfigError
from jobfence.limits import MAX_ATTEMPT, MAX_PRIOR_ATTEMPTS, shown_value
from jobfence.model import Delivery, Message, Outgoing
from jobfence.tracing import carried

R = TypeVar("R")


def receipt_of(delivery: Delivery, kind: type[R], adapter: str) -> R:
    """``delivery``'s receipt as ``kind``, or a ``TypeError`` naming ``adapter`` when the
    delivery came from another adapter."""
    receipt = delivery.receipt
    if not isinstance(receipt, kind):
        raise TypeError(f"this delivery did not come from {adapter}")
    return receipt


def refuse_tx(adapter: str, operation: str, *, instead: str = "") -> ConfigError:
    """The error a non-transactional adapter raises when asked to ``operation`` inside a
    database transaction (``tx=``)."""
    return ConfigError(
        f"{adapter} is not transactional (capabilities.transactional is False): it cannot "
        f"{operation} inside a database transaction; call it without tx= after the transaction "
        f"commits{instead}"
    )


def refuse_delay(adapter: str, operation: Literal["publish", "retry"], why: str) -> ConfigError:
    """The error an adapter without native delay (``capabilities.delayed_publish`` or
    ``delayed_retry`` False) raises when asked to ``operation`` with a delay, before it changes
    anything. ``why`` says what the broker lacks."""
    capability = "delayed_publish" if operation == "publish" else "delayed_retry"
    if operation == "publish":
        instead = (
            "publish without a delay, or write the message to the PostgreSQL outbox with its"
            " delay (jobfence.outbox.write(conn, message, delay_seconds=...), committed; App."
            "enqueue does this on a broker) and the outbox relay publishes it when due"
        )
    else:
        instead = (
            "retry without a delay, or go through the PostgreSQL outbox as the worker does:"
            " commit jobfence.outbox.schedule(conn, delivery.message, delay,"
            " prior_attempts=delivery.attempt), then ack the delivery; the outbox relay"
            " publishes the retry when due"
        )
    return ConfigError(
        f"{adapter} has no delayed {operation} (capabilities.{capability} is False): {why};"
        f" {instead}"
    )


def check_prior_attempts(prior_attempts: int) -> int:
    """``prior_attempts`` of a publish, refused (``ValueError``) unless a count from 0 to
    ``MAX_PRIOR_ATTEMPTS``."""
    if isinstance(prior_attempts, bool) or not isinstance(prior_attempts, int):
        raise TypeError(f"prior_attempts must be an int, got {type(prior_attempts).__name__}")
    if not 0 <= prior_attempts <= MAX_PRIOR_ATTEMPTS:
        raise ValueError(
            f"prior_attempts must be from 0 to {MAX_PRIOR_ATTEMPTS}, got {prior_attempts}"
        )
    return prior_attempts


class FieldNames(NamedTuple):
    """What an adapter calls each field of a message it reads (its headers or stream fields),
    for the reasons :func:`read_delivery` gives."""

    consumer: str
    job_id: str
    tenant_id: str
    correlation_id: str
    prior: str
    delivered: str


_MAX_DIGITS = 19  # more digits than any count jobfence accepts: not worth converting


def _shown(raw: object) -> str:
    text = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else str(raw)
    return repr(shown_value(text[:100]))


def read_count(raw: object, name: str, high: int) -> tuple[int, str | None]:
    """A count a broker message carries (an int, or the ASCII digits of one), from 0 to
    ``high``: ``(count, None)``, or ``(0, why not)``. Never raises."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif (
        isinstance(raw, bytes | str)
        and 0 < len(raw) <= _MAX_DIGITS
        and raw.isascii()
        and raw.isdigit()
    ):
        value = int(raw)
    else:
        return 0, f"{name} {_shown(raw)} is not a whole number from 0 to {high}"
    if not 0 <= value <= high:
        return 0, f"{name} {value} is not a whole number from 0 to {high}"
    return value, None


def read_text(
    raw: object, name: str, decode: Callable[[str], str] | None = None
) -> tuple[str | None, str | None]:
    """A text field a broker message carries (a ``str``, or UTF-8 ``bytes``; ``decode``
    undoes an adapter's own encoding of a ``str``): ``(text, None)``, or ``(what could be
    read, why it is not the text)``. None stays None (the field is absent). Never raises."""
    if raw is None:
        return None, None
    if isinstance(raw, bytes):
        data = raw
        try:
            raw = data.decode("utf-8")
        except UnicodeDecodeError:
            return data.decode("utf-8", "backslashreplace"), f"{name} is not valid UTF-8"
    if isinstance(raw, str):
        if decode is None:
            return raw, None
        try:
            return decode(raw), None
        except (UnicodeDecodeError, ValueError):
            return raw, f"{name} {_shown(raw)} is not valid percent-encoded UTF-8"
    return str(raw), f"{name} is a {type(raw).__name__}, not text"


def read_delivery(
    names: FieldNames,
    *,
    queue: str,
    body: bytes,
    consumer: object,
    job_id: object,
    tenant_id: object,
    correlation_id: object,
    prior: object,
    delivered: object,
    receipt: object,
    decode: Callable[[str], str] | None = None,
    counted_before: bool = False,
    traceparent: object = None,
    tracestate: object = None,
) -> tuple[Delivery, int]:
    """The delivery of a message a broker handed over, its fields as the broker gave them, and
    the deliveries its job had before this message (``prior``: 0 when absent).

    ``delivered`` is the broker's own count of this message's deliveries, this one included
    (with ``counted_before``: the deliveries before this one, RabbitMQ's ``x-delivery-count``).
    Every field is read with its bounds (text: a ``str`` or UTF-8; counts from 0 to
    ``MAX_PRIOR_ATTEMPTS``; an attempt up to ``MAX_ATTEMPT``; the identifier limits of
    ``jobfence.limits`` are the harness's to check, as for every queue). When one does not
    parse, the delivery says why (``Delivery.unreadable``) and holds what could be read, with
    the broker's own count (at least 1) as its attempt: the harness dead-letters it at once,
    whole, as ``UnfenceableMessage``. Never raises: one bad message never fails a batch.

    ``traceparent`` and ``tracestate`` (the W3C trace context, :mod:`jobfence.tracing`) are
    kept when they parse and dropped when they do not: never a reason to refuse the message."""
    problems: list[str] = []
    texts: list[str | None] | None = None
    if decode is None and (
        type(consumer) is str
        and type(job_id) is str
        and (tenant_id is None or type(tenant_id) is str)
        and (correlation_id is None or type(correlation_id) is str)
    ):  # the usual case, without a call per field
        texts = [consumer, job_id, tenant_id, correlation_id]
    elif (
        type(consumer) is bytes
        and type(job_id) is bytes
        and (tenant_id is None or type(tenant_id) is bytes)
        and (correlation_id is None or type(correlation_id) is bytes)
    ):  # the usual case of bytes (Redis): valid UTF-8
        try:
            texts = [
                consumer.decode(),
                job_id.decode(),
                None if tenant_id is None else tenant_id.decode(),
                None if correlation_id is None else correlation_id.decode(),
            ]
        except UnicodeDecodeError:
            texts = None
    if texts is None:
        texts = []
        for raw, name in (
            (consumer, names.consumer),
            (job_id, names.job_id),
            (tenant_id, names.tenant_id),
            (correlation_id, names.correlation_id),
        ):
            text, problem = read_text(raw, name, decode)
            texts.append(text)
            if problem is not None:
                problems.append(problem)
    if prior is None:
        earlier = 0
    else:
        earlier, problem = read_count(prior, names.prior, MAX_PRIOR_ATTEMPTS)
        if problem is not None:
            problems.append(problem)
    high = MAX_ATTEMPT - counted_before
    if type(delivered) is int and 0 <= delivered <= high:
        count = delivered
    else:
        count, problem = read_count(delivered, names.delivered, high)
        if problem is not None:
            problems.append(problem)
    count += counted_before
    attempt = earlier + count
    if not problems and not 1 <= attempt <= MAX_ATTEMPT:
        problems.append(
            f"attempt {attempt} ({names.prior} {earlier} + {names.delivered} {count}) is not"
            f" from 1 to {MAX_ATTEMPT}"
        )
    trace = (None, None) if traceparent is None else carried(traceparent, tracestate)
    message = Message(
        queue=queue,
        consumer=texts[0] or "",
        job_id=texts[1] or "",
        body=body,
        tenant_id=texts[2],
        correlation_id=texts[3],
        traceparent=trace[0],
        tracestate=trace[1],
    )
    if problems:
        return (
            Delivery(message, min(max(count, 1), MAX_ATTEMPT), receipt, "; ".join(problems)),
            0,
        )
    return Delivery(message, attempt, receipt), earlier


async def publish_each(
    publish: Callable[[Outgoing], Awaitable[None]], outgoing: Sequence[Outgoing]
) -> list[Exception | None]:
    """``publish_many`` for an adapter whose publishes are cheap and local (the memory queue,
    the PostgreSQL queue): one after the other, each message's error in its place."""
    results: list[Exception | None] = []
    for item in outgoing:
        try:
            await publish(item)
        except Exception as exc:
            results.append(exc)
        else:
            results.append(None)
    return results
