"""The limits on a job's identifiers, in one place: checked at enqueue and again at delivery.

Every identifier lands in a btree index: ``core.processed_jobs``' primary key ``(job_id,
consumer)``; ``core.dead_letters``' indexes on ``job_id``, ``(job_id, consumer)``,
``correlation_id``, ``(tenant_id, status, created_at, id)``, ``(consumer, created_at, id)`` and
``(queue, error_class, created_at, id)``; the alert tables' ``(queue, consumer, error_class)``.
PostgreSQL refuses an index entry larger than about 2,700 bytes (a third of an 8 kB page), so a
longer value would be accepted by the queue and then fail at the fence or the dead letter, on
every delivery. The widest entry these limits allow is ``(job_id, consumer)``: 1,024 + 200 bytes
plus headers, under half of PostgreSQL's limit. PostgreSQL text cannot hold a NUL character,
and UTF-8 cannot encode a lone surrogate: neither is allowed in any identifier.

Lengths are counted in bytes of UTF-8 (what the index stores), not in characters.

Numbers have limits too. An attempt count (deliveries of a job, the first included) is from 1 to
``MAX_ATTEMPT``, what ``core.dead_letters.attempts`` (``integer``) can record; the deliveries a
message says its job already had (a broker header, an outbox row's ``prior_attempts``) are from 0
to ``MAX_PRIOR_ATTEMPTS``. A delay is a finite number of seconds up to ``MAX_DELAY_SECONDS``
(a negative one counts as none).
"""

from __future__ import annotations

import hashlib
import math
import re

from jobfence.errors import JobRefused

MAX_JOB_ID_BYTES = 1024
MAX_CORRELATION_ID_BYTES = 1024
MAX_TENANT_ID_BYTES = 200
MAX_NAME_CHARS = 200
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
NAME_RULE = "1-200 characters of letters, digits and _ . : -"

MAX_ATTEMPT = 2**31 - 1  # core.dead_letters.attempts is a PostgreSQL integer
MAX_PRIOR_ATTEMPTS = MAX_ATTEMPT - 1  # so that the next delivery's attempt still fits
MAX_DELAY_DAYS = 3650
MAX_DELAY_SECONDS = MAX_DELAY_DAYS * 86400  # about ten years
# A job's body (the payload's bytes): 64 MiB. A dead letter must always be able to hold the
# payload: it keeps it as a jsonb document, or as a base64 string (a third larger) when the body
# is not JSON, and jsonb refuses a string over 268,435,455 bytes; a body past that would be
# refused by its own dead letter and delivered again for ever. Checked by every producer, in
# Python before any SQL and by jobfence.produce and jobfence.enqueue (migration 0027).
MAX_BODY_BYTES = 64 * 1024 * 1024
# A worker's lease per delivery (and the handler time it keeps a lease alive for): a week.
MAX_LEASE_SECONDS = 7 * 86400

# A bounded stand-in keeps this many characters of the value it stands for.
_SHOWN_CHARS = 64


def text_problem(field: str, value: object, max_bytes: int, *, required: bool) -> str | None:
    """Why ``value`` cannot be stored and indexed as ``field``; None when it can."""
    if value is None and not required:
        return None
    if not isinstance(value, str):
        return f"{field} must be a string, not {type(value).__name__}"
    if not value:
        return f"{field} must be a non-empty string" if required else None
    if "\x00" in value:
        return f"{field} contains a NUL character (\\x00), which PostgreSQL text cannot hold"
    if value.isascii():
        size = len(value)
    else:
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            return f"{field} contains a lone surrogate, which is not valid Unicode"
    if size > max_bytes:
        return f"{field} is {size:,} bytes of UTF-8, over the limit of {max_bytes:,}"
    return None


def name_problem(field: str, value: object) -> str | None:
    """Why ``value`` is not a valid consumer or queue name; None when it is."""
    if isinstance(value, str) and NAME_PATTERN.fullmatch(value) is not None:
        return None
    shown = shown_value(value) if isinstance(value, str) else type(value).__name__
    return f"{field} {shown!r} must be {NAME_RULE}"


def identifiers_problem(
    *,
    queue: object,
    consumer: object,
    job_id: object,
    tenant_id: object,
    correlation_id: object,
) -> tuple[str, str] | None:
    """The first identifier of a job that breaks a limit, as ``(field, reason)``; else None."""
    for field, reason in (
        ("job_id", text_problem("job_id", job_id, MAX_JOB_ID_BYTES, required=True)),
        ("consumer", name_problem("consumer", consumer)),
        ("queue", name_problem("queue", queue)),
        ("tenant_id", text_problem("tenant_id", tenant_id, MAX_TENANT_ID_BYTES, required=False)),
        (
            "correlation_id",
            text_problem(
                "correlation_id", correlation_id, MAX_CORRELATION_ID_BYTES, required=False
            ),
        ),
    ):
        if reason is not None:
            return field, reason
    return None


# A job whose identifiers break a limit (jobfence.codec.unfenceable): dead-lettered at once,
# kept whole (jobfence.codec.kept_whole), never replayed as it is.
UNFENCEABLE = "UnfenceableMessage"


def bounded(value: str) -> str:
    """A short stand-in for an identifier that cannot be stored as it is: its first characters
    (NULs and lone surrogates escaped) and its size and SHA-256, so that the same value always
    gives the same stand-in and two different values almost never share one."""
    raw = value.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(raw).hexdigest()[:16]
    head = value[:_SHOWN_CHARS].encode("utf-8", "surrogatepass").decode("utf-8", "backslashreplace")
    head = head.replace("\x00", "\\x00")
    return f"{head}...[{len(raw)} bytes, sha256 {digest}]"


def storable(value: str | None, max_bytes: int, *, required: bool = False) -> str | None:
    """``value`` if it can be stored and indexed as it is, else its :func:`bounded` stand-in."""
    if value is None or text_problem("value", value, max_bytes, required=required) is None:
        return value
    return bounded(value)


def shown_value(value: str | None) -> str | None:
    """``value`` for a log line: as it is when short and printable, else its stand-in."""
    if value is None or (len(value) <= 200 and "\x00" not in value and value.isprintable()):
        return value
    return bounded(value)


def delay_problem(field: str, value: object) -> str | None:
    """Why ``value`` is not a delay in seconds (a finite real number, at most
    ``MAX_DELAY_SECONDS``; a negative one counts as none); None when it is."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{field} must be a number of seconds, not {type(value).__name__}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{field} must be a finite number of seconds, got {value}"
    if value > MAX_DELAY_SECONDS:
        return (
            f"{field} is {value:g} seconds, over the limit of {MAX_DELAY_SECONDS:,}"
            f" ({MAX_DELAY_DAYS:,} days)"
        )
    return None


def checked_delay(value: object, field: str = "delay_seconds") -> float:
    """``value`` as a delay in seconds (0 when negative), or :class:`~jobfence.JobRefused`
    naming ``field`` when :func:`delay_problem` finds one."""
    problem = delay_problem(field, value)
    if problem is not None:
        raise JobRefused(field, problem)
    return max(float(value), 0.0)  # type: ignore[arg-type]


def recordable_attempt(attempt: object) -> int:
    """``attempt`` as ``core.dead_letters.attempts`` can hold it: within 1..``MAX_ATTEMPT``
    (1 when it is not an integer at all)."""
    if isinstance(attempt, bool) or not isinstance(attempt, int):
        return 1
    return min(max(attempt, 1), MAX_ATTEMPT)


def storable_text(text: str) -> str:
    """``text`` as PostgreSQL text can hold it: NULs and lone surrogates escaped."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def message_size_problem(size: int, max_bytes: int, broker: str) -> str:
    """Why a payload of ``size`` bytes cannot go to ``broker``, whose largest message is
    ``max_bytes`` (as the broker says: NATS's ``max_payload``, recorded by the outbox relay)."""
    return (
        f"payload is {size:,} bytes, over the largest message the {broker} broker accepts"
        f" ({max_bytes:,} bytes, its max_payload, headers included): it would be refused at"
        " publish; send a smaller payload (a reference to the data) or raise the broker's limit"
    )
