"""The API's request and response bodies: the service layer's data, as JSON.

Every text that reaches the database is checked here to be storable (no NUL character), so a
request PostgreSQL would refuse is a 422, never a 500.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from jobfence import ops
from jobfence.dead_letters import (
    BLANK_DISCARD_REASON,
    LONG_DISCARD_REASON,
    MAX_DISCARD_REASON,
    DeadLetter,
    ReplayResult,
)

MAX_BIGINT = 2**63 - 1
MAX_BULK_ITEMS = ops.MAX_BULK_ITEMS
MAX_FILTER_CHARS = 1000
MAX_CURSOR_CHARS = 512

DeadLetterStatus = Literal["pending_review", "replayed", "discarded"]
BulkStatus = Literal["running", "finished"]
BulkResult = Literal["replayed", "already_processed", "not_pending", "failed", "pending"]


def _no_surrogates(text: str) -> str:
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
        raise ValueError("must be valid Unicode (no lone surrogates)")
    return text


def _date_time_text(value: object) -> datetime:
    """A time filter, read as the CLI reads it (:func:`jobfence.ops.parse_time`): an ISO 8601
    date or date-time, UTC when it has no offset. Only text (or a datetime): never a number
    as Unix time."""
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if not isinstance(value, str):
        raise PydanticCustomError(
            "date_time", f"must be text: an ISO 8601 date or time ({ops.TIME_RULE})"
        )
    try:
        return ops.parse_time(value)
    except ops.InvalidRequest as exc:
        raise PydanticCustomError("date_time", str(exc)) from None


DateTime = Annotated[datetime, BeforeValidator(_date_time_text)]
FilterText = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_FILTER_CHARS, pattern=r"^[^\x00]*$"),
    AfterValidator(_no_surrogates),
]


def _discard_reason(text: str) -> str:
    """The CLI's words for a reason it refuses, never a pattern."""
    if not text.strip():
        raise PydanticCustomError("discard_reason", BLANK_DISCARD_REASON)
    if len(text) > MAX_DISCARD_REASON:
        raise PydanticCustomError("discard_reason", LONG_DISCARD_REASON)
    if "\x00" in text:
        raise PydanticCustomError("discard_reason", "a discard reason cannot hold a NUL character")
    return text


DiscardReason = Annotated[
    str,
    AfterValidator(_discard_reason),
    AfterValidator(_no_surrogates),
    # Documented as before: what a client may send.
    WithJsonSchema(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_DISCARD_REASON,
            "pattern": r"^[^\x00]*[^\s\x00][^\x00]*$",
        }
    ),
]
DeadLetterId = Annotated[int, Field(ge=1, le=MAX_BIGINT, description="the dead letter's id")]
BulkReplayId = Annotated[int, Field(ge=1, le=MAX_BIGINT, description="the bulk replay's id")]


class _Filter(BaseModel):
    """Which dead letters: every field given must match."""

    model_config = ConfigDict(extra="forbid")

    queue: FilterText | None = None
    consumer: FilterText | None = None
    tenant_id: FilterText | None = None
    error_class: FilterText | None = None
    job_id: FilterText | None = None
    correlation_id: FilterText | None = None
    created_from: DateTime | None = Field(
        default=None,
        description="created at or after (ISO 8601 date or date-time; UTC without an offset)",
    )
    created_to: DateTime | None = Field(
        default=None,
        description="created before (ISO 8601 date or date-time; UTC without an offset)",
    )

    @model_validator(mode="after")
    def _range(self) -> Self:
        if self.created_from and self.created_to and self.created_from >= self.created_to:
            raise ValueError("created_from must be before created_to")
        return self


class DeadLetterQuery(_Filter):
    """``GET /v1/core/dead-letters``: the filter, a page size and the cursor of the next page."""

    status: DeadLetterStatus | None = None
    limit: int = Field(default=ops.DEFAULT_PAGE, ge=1, le=ops.MAX_PAGE)
    cursor: (
        Annotated[
            str,
            StringConstraints(max_length=MAX_CURSOR_CHARS),
            Field(description="`next_cursor` of the previous page"),
        ]
        | None
    ) = None

    def to_filter(self) -> ops.DeadLetterFilter:
        return ops.DeadLetterFilter(**self.model_dump(exclude={"limit", "cursor"}))


class BulkReplayRequest(_Filter):
    """Replay every ``pending_review`` dead letter that matches, as of now."""

    # strict: a JSON body says true and 5, not "yes" and "5" (query strings are text anyway).
    dry_run: bool = Field(
        default=False, strict=True, description="only count the matching dead letters"
    )
    max_items: int = Field(
        default=ops.DEFAULT_BULK_MAX,
        strict=True,
        ge=1,
        le=MAX_BULK_ITEMS,
        description="refuse (422) when more dead letters than this match",
    )
    all: bool = Field(
        default=False,
        strict=True,
        description="select every pending dead letter, poison included (no filter may be "
        "given); without a filter, a request that does not say so is refused (422)",
    )

    def to_filter(self) -> ops.DeadLetterFilter:
        return ops.DeadLetterFilter(**self.model_dump(exclude={"dry_run", "max_items", "all"}))


class DiscardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: DiscardReason = Field(description="why nobody will replay it (non-blank)")


class DeadLetterItemOut(BaseModel):
    """A dead letter as listed. A payload larger than 4,096 bytes of JSON is left out
    (``payload`` null, ``payload_truncated`` true) and ``payload_summary`` holds its first
    512 characters; ``GET /v1/core/dead-letters/{id}`` returns it whole."""

    id: int
    job_id: str
    queue: str
    consumer: str
    tenant_id: str | None
    payload: JsonValue
    payload_encoding: Literal["json", "base64", "message"]
    payload_truncated: bool
    payload_summary: str | None
    payload_size: int = Field(description="size of the payload as JSON text, in bytes")
    attempts: int
    last_error: str
    error_class: str
    correlation_id: str | None
    status: DeadLetterStatus
    discard_reason: str | None
    created_at: datetime
    resolved_at: datetime | None
    resolved_by: str | None

    @classmethod
    def of(cls, item: ops.DeadLetterItem) -> Self:
        """The model of a listed item. The API renders the same JSON in SQL
        (``ops.list_dead_letters_json``); the tests hold the two to each other."""
        return cls.model_validate(_fields(cls, item))


def _fields(model: type[BaseModel], source: object) -> dict[str, object]:
    return {name: getattr(source, name) for name in model.model_fields if hasattr(source, name)}


class DeadLetterPageOut(BaseModel):
    items: list[DeadLetterItemOut]
    next_cursor: str | None = Field(
        description="pass as `cursor` for the next page; null at the end"
    )


class DeadLetterOut(BaseModel):
    """One dead letter whole, payload included (``payload_encoding`` ``base64``: a payload that
    was not JSON, kept as ``{"encoding": "base64", "data": ...}``; ``message``: the whole
    message kept, identifiers included, as ``{"encoding": "message", "message": {...},
    "data": ...}``)."""

    id: int
    job_id: str
    queue: str
    consumer: str
    tenant_id: str | None
    payload: JsonValue
    payload_encoding: Literal["json", "base64", "message"]
    attempts: int
    last_error: str
    error_class: str
    correlation_id: str | None
    status: DeadLetterStatus
    discard_reason: str | None
    created_at: datetime
    resolved_at: datetime | None
    resolved_by: str | None


class DeadLetterDetailOut(DeadLetterOut):
    fence_exists: bool = Field(
        description="whether core.processed_jobs has a row for (job_id, consumer): the job's "
        "effect is applied, and a replay would not republish it"
    )
    trace_id: str | None = Field(
        default=None,
        description="the OpenTelemetry trace id (32 hex digits) of the attempt that failed, "
        "when it was traced: open it in your tracing tool",
    )

    @classmethod
    def of(cls, detail: ops.DeadLetterDetail) -> Self:
        """The model of a shown dead letter (rendered in SQL by the API, as for items)."""
        letter = detail.dead_letter
        return cls.model_validate(
            _fields(cls, letter)
            | {"fence_exists": detail.fence_exists, "trace_id": letter.trace_id}
        )


class DiscardOut(BaseModel):
    """A discard's answer to a token that may discard but not read dead letters: what it did,
    with the dead letter's identifiers, never its payload or error (least privilege; a token
    that may also read gets the dead letter whole)."""

    dead_letter_id: int
    status: Literal["discarded"] = "discarded"
    discard_reason: str
    resolved_at: datetime
    resolved_by: str
    job_id: str
    queue: str
    consumer: str
    tenant_id: str | None
    correlation_id: str | None

    @classmethod
    def of(cls, letter: DeadLetter) -> Self:
        assert letter.discard_reason is not None and letter.resolved_at is not None
        assert letter.resolved_by is not None  # a discarded row has them (core.dead_letters)
        return cls(
            dead_letter_id=letter.id,
            discard_reason=letter.discard_reason,
            resolved_at=letter.resolved_at,
            resolved_by=letter.resolved_by,
            job_id=letter.job_id,
            queue=letter.queue,
            consumer=letter.consumer,
            tenant_id=letter.tenant_id,
            correlation_id=letter.correlation_id,
        )


class ReplayOut(BaseModel):
    """What a replay did: the message it published (same job_id and correlation_id), or,
    when the job's fence row already existed, that it published nothing."""

    dead_letter_id: int
    status: Literal["replayed"] = "replayed"
    published: bool
    already_processed: bool
    job_id: str
    queue: str
    consumer: str
    tenant_id: str | None
    correlation_id: str | None

    @classmethod
    def of(cls, result: ReplayResult) -> Self:
        message = result.message
        return cls(
            dead_letter_id=result.dead_letter_id,
            published=result.published,
            already_processed=result.already_processed,
            job_id=message.job_id,
            queue=message.queue,
            consumer=message.consumer,
            tenant_id=message.tenant_id,
            correlation_id=message.correlation_id,
        )


class BulkCounts(BaseModel):
    replayed: int
    already_processed: int
    not_pending: int
    failed: int
    pending: int = Field(description="not processed yet")


class BulkReplayOut(BaseModel):
    """A bulk replay and its progress. ``total`` is its fixed snapshot's size; ``active`` says
    whether this API process is working on it now: a ``running`` run that is not active was
    interrupted (resume it)."""

    id: int
    filter: dict[str, str]
    requested_by: str
    max_items: int
    total: int
    status: BulkStatus
    active: bool
    counts: BulkCounts
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None

    @classmethod
    def of(cls, run: ops.BulkReplay, *, active: bool) -> Self:
        return cls(
            id=run.id,
            filter={key: str(value) for key, value in run.filter.items()},
            requested_by=run.requested_by,
            max_items=run.max_items,
            total=run.total,
            status=run.status,  # type: ignore[arg-type]  # checked by the model
            active=active,
            counts=BulkCounts.model_validate(run.counts),
            created_at=run.created_at,
            updated_at=run.updated_at,
            finished_at=run.finished_at,
        )


class BulkDryRunOut(BaseModel):
    dry_run: Literal[True] = True
    matching: int = Field(description="pending dead letters the filter matches now")
    max_items: int
    exceeds_max_items: bool = Field(description="whether the real run would be refused (422)")


class BulkItemOut(BaseModel):
    dead_letter_id: int
    result: BulkResult
    detail: str | None
    processed_at: datetime | None

    @classmethod
    def of(cls, item: ops.BulkItem) -> Self:
        return cls(
            dead_letter_id=item.dead_letter_id,
            result=item.result or "pending",  # type: ignore[arg-type]  # checked by the model
            detail=item.detail,
            processed_at=item.processed_at,
        )


class BulkItemsOut(BaseModel):
    items: list[BulkItemOut]
    next_after: int | None = Field(description="pass as `after` for the next page; null at the end")


class BulkItemsQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    result: BulkResult | None = Field(default=None, description="only items with this result")
    after: int = Field(
        default=0, ge=0, le=MAX_BIGINT, description="items after this dead letter id"
    )
    limit: int = Field(default=100, ge=1, le=ops.MAX_PAGE)


class Health(BaseModel):
    status: Literal["ok"] = "ok"
