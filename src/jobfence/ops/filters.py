"""Which dead letters a request means: the filter, its time rule, its WHERE clause."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from psycopg import sql

from jobfence.ops.errors import InvalidRequest

STATUSES = ("pending_review", "replayed", "discarded")
GROUP_KEYS = ("queue", "consumer", "error_class")


TIME_RULE = "e.g. 2026-05-01 or 2026-05-01T12:00:00Z; without an offset it is UTC"


def parse_time(text: str) -> datetime:
    """A time filter's value (``created_from``/``created_to``, ``--since``/``--until``): an
    ISO 8601 date or date-time; one without an offset (a date included) is taken as UTC."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidRequest(f"not an ISO 8601 date or time ({TIME_RULE})") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class DeadLetterFilter:
    """Which dead letters: every field set must match (``created_*`` bound a half-open range)."""

    status: str | None = None
    queue: str | None = None
    consumer: str | None = None
    tenant_id: str | None = None
    error_class: str | None = None
    job_id: str | None = None
    correlation_id: str | None = None
    created_from: datetime | None = None  # inclusive
    created_to: datetime | None = None  # exclusive

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in STATUSES:
            raise InvalidRequest(
                f"status must be one of {', '.join(STATUSES)}, not {self.status!r}"
            )
        if self.created_from and self.created_to and self.created_from >= self.created_to:
            raise InvalidRequest("created_from must be before created_to", field="created_from")

    def to_json(self) -> dict[str, Any]:
        return {
            k: (v.isoformat() if isinstance(v, datetime) else v)
            for k, v in asdict(self).items()
            if v is not None
        }

    def params(self) -> dict[str, Any]:
        """The values set, by placeholder name (``f_<field>``), in field order."""
        return {
            f"f_{name}": value
            for name in _FILTER_FIELDS
            if (value := getattr(self, name)) is not None
        }

    def where(
        self, *, extra: sql.Composable | None = None
    ) -> tuple[sql.Composable, dict[str, Any]]:
        """A ``WHERE`` clause (possibly empty) and its parameters."""
        params = self.params()
        return where_clause(tuple(params), extra=extra), params


_FILTER_FIELDS = (
    "status",
    "queue",
    "consumer",
    "tenant_id",
    "error_class",
    "job_id",
    "correlation_id",
    "created_from",
    "created_to",
)
_RANGE = {
    "f_created_from": sql.SQL("created_at >= %(f_created_from)s"),
    "f_created_to": sql.SQL("created_at < %(f_created_to)s"),
}


def where_clause(params: Sequence[str], *, extra: sql.Composable | None = None) -> sql.Composable:
    """The ``WHERE`` clause (possibly empty) of a filter whose set values are ``params``
    (names as :meth:`DeadLetterFilter.params` gives them)."""
    parts: list[sql.Composable] = []
    for name in params:
        if name in _RANGE:
            parts.append(_RANGE[name])
        else:
            column = name.removeprefix("f_")
            parts.append(sql.SQL("{} = {}").format(sql.Identifier(column), sql.Placeholder(name)))
    if extra is not None:
        parts.append(extra)
    if not parts:
        return sql.SQL("")
    return sql.SQL(" WHERE ") + sql.SQL(" AND ").join(parts)
