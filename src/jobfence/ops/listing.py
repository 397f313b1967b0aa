"""Listing dead letters: pages with keyset cursors, counts, and pending groups."""

from __future__ import annotations

import base64
import binascii
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection, sql
from psycopg.rows import dict_row

from jobfence._sql import Queries
from jobfence.ops.errors import InvalidCursor, InvalidRequest
from jobfence.ops.filters import GROUP_KEYS, DeadLetterFilter, where_clause

SQL = Queries("jobfence.sql", "ops.sql")

DEFAULT_PAGE = 50
MAX_PAGE = 500
# A list item carries payloads up to this size whole; larger ones are summarised (and say so).
PAYLOAD_INLINE_LIMIT = 4096
PAYLOAD_SUMMARY_CHARS = 512

# How a list page is read (ItemCache.plan), and the named query its first statement starts with.
READ_IDS, READ_ITEMS, READ_RENDERED = "ids", "items", "rendered"
_LIST_BASE = {
    READ_IDS: "list_keys_base",
    READ_ITEMS: "list_items_base",
    READ_RENDERED: "list_rendered_base",
}


@dataclass(frozen=True, slots=True)
class DeadLetterItem:
    """A dead letter as listed: everything the table holds; a payload over
    ``PAYLOAD_INLINE_LIMIT`` bytes is replaced by ``payload_summary`` (its first characters as
    JSON text) with ``payload_truncated = True``; ``payload_size`` is its size in bytes."""

    id: int
    job_id: str
    queue: str
    consumer: str
    tenant_id: str | None
    payload: Any
    payload_encoding: str
    payload_truncated: bool
    payload_summary: str | None
    payload_size: int
    attempts: int
    last_error: str
    error_class: str
    correlation_id: str | None
    status: str
    discard_reason: str | None
    created_at: datetime
    resolved_at: datetime | None
    resolved_by: str | None


@dataclass(frozen=True, slots=True)
class DeadLetterPage:
    items: list[DeadLetterItem]
    next_cursor: str | None


def encode_cursor(created_at: datetime, dead_letter_id: int) -> str:
    raw = json.dumps([created_at.isoformat(), dead_letter_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, int]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        created, dead_letter_id = json.loads(base64.urlsafe_b64decode(padded.encode()))
        return datetime.fromisoformat(created), int(dead_letter_id)
    except (ValueError, TypeError, OverflowError, binascii.Error):
        raise InvalidCursor from None


def _list_query(
    base: str, flt: DeadLetterFilter, *, limit: int, cursor: str | None
) -> tuple[bytes, dict[str, Any]]:
    """The named query ``base`` with ``flt``'s WHERE clause, newest first, ``limit + 1`` rows
    (one more tells whether there is a next page)."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be between 1 and {MAX_PAGE}", field="limit")
    params: dict[str, Any] = {}
    if cursor:
        created_at, dead_letter_id = decode_cursor(cursor)
        params = {"c_created_at": created_at, "c_id": dead_letter_id}
    filter_params = flt.params()
    shape = tuple(filter_params)
    params |= filter_params | {
        "payload_limit": PAYLOAD_INLINE_LIMIT,
        "summary_chars": PAYLOAD_SUMMARY_CHARS,
    }
    if shape in ((), ("f_status",)) and not cursor:  # no parameter left (see "Plans" below)
        params.pop("f_status", None)
        return _composed(base, (), flt.status, False, limit + 1), params
    params["limit"] = limit + 1
    return _composed(base, shape, None, bool(cursor), None), params


# Plans. While a page's LIMIT is a parameter, PostgreSQL as a rule plans the page again on
# every request: a generic plan has to assume many rows for an unknown LIMIT, so it seldom
# costs less than a plan for the values. Planning weighs core.dead_letters' indexes and costs
# about what running a 50-row page does (0.2 ms of PostgreSQL CPU of a first page's 0.38 at
# 1,000,000 rows).
# - A page without filter values or a cursor (the first page of all dead letters or of one
#   status: the one an operator opens first, and dashboards poll) has its status and LIMIT
#   written into the query. With no parameter left, PostgreSQL plans it once per connection,
#   for exactly those values. status is one of three words, checked by DeadLetterFilter.
# - Any other page keeps every value, and its LIMIT, as parameters. PostgreSQL plans it for its
#   values, and keeps a generic plan only where it costs one no dearer than those: with the
#   LIMIT a parameter, at 1,000,000 rows, it kept none in our runs. Written into the query,
#   the LIMIT (or the status) makes a generic plan look cheap, and PostgreSQL kept one for
#   every filtered page tried. A generic plan is made from average estimates: at 20,000 rows,
#   the one for queue + status + cursor collected every matching row and sorted them, fine
#   for a small group and slow for a busy queue (tests/test_api_plans.py keeps these
#   parameters).


_CURSOR_CLAUSE = sql.SQL("(created_at, id) < (%(c_created_at)s, %(c_id)s)")


@functools.lru_cache(maxsize=1024)
def _composed(
    base: str, filter_params: tuple[str, ...], status: str | None, cursor: bool, limit: int | None
) -> bytes:
    # The query text depends only on which filters are set (and, on a page without parameters,
    # on the status and the limit): compose it once per shape, as bytes, so psycopg's own cache
    # of parsed queries finds it again on every request.
    if status is not None:  # no other filter, and no cursor
        where: sql.Composable = sql.SQL(" WHERE status = {}").format(sql.Literal(status))
    else:
        where = where_clause(filter_params, extra=_CURSOR_CLAUSE if cursor else None)
    order = sql.SQL(" ORDER BY created_at DESC, id DESC LIMIT ")
    rows = sql.Placeholder("limit") if limit is None else sql.Literal(limit)
    return (SQL[base] + where + order + rows).as_bytes(None)


def list_page_query(
    flt: DeadLetterFilter,
    *,
    limit: int = DEFAULT_PAGE,
    cursor: str | None = None,
    how: str = "ids",
) -> tuple[bytes, dict[str, Any]]:
    """The SQL (and parameters) of the page's first statement in
    :func:`list_dead_letters_json` (the one whose plan depends on the filter) when read
    ``how`` (:meth:`ItemCache.plan`; ``"rendered"``: as without a cache), for benchmarks and
    EXPLAIN."""
    return _list_query(_LIST_BASE[how], flt, limit=limit, cursor=cursor)


async def list_dead_letters(
    conn: AsyncConnection[Any],
    flt: DeadLetterFilter,
    *,
    limit: int = DEFAULT_PAGE,
    cursor: str | None = None,
) -> DeadLetterPage:
    """One page, newest first, keyset-paginated on ``(created_at, id)``: a page boundary never
    moves when rows are inserted meanwhile (new rows sort before the first page)."""
    query, params = _list_query("list_base", flt, limit=limit, cursor=cursor)
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(query, params)
        rows = await cur.fetchall()
    more = len(rows) > limit
    rows = rows[:limit]
    items = [
        DeadLetterItem(payload_truncated=row["payload_summary"] is not None, **row) for row in rows
    ]
    next_cursor = encode_cursor(rows[-1]["created_at"], rows[-1]["id"]) if more else None
    return DeadLetterPage(items=items, next_cursor=next_cursor)


async def count_dead_letters(conn: AsyncConnection[Any], flt: DeadLetterFilter) -> int:
    where, params = flt.where()
    cur = await conn.execute(SQL["count_base"] + where, params)
    row = await cur.fetchone()
    return int(row[0]) if row else 0


@dataclass(frozen=True, slots=True)
class DeadLetterGroup:
    """Pending dead letters that share the grouped columns; a column not grouped by is None."""

    queue: str | None
    consumer: str | None
    error_class: str | None
    pending: int
    oldest: datetime
    newest: datetime


async def group_pending(
    conn: AsyncConnection[Any],
    flt: DeadLetterFilter,
    *,
    by: Sequence[str],
    limit: int = DEFAULT_PAGE,
) -> list[DeadLetterGroup]:
    """How many pending dead letters match ``flt``, per group of ``by`` (some of
    ``GROUP_KEYS``): the largest groups first (then the oldest), at most ``limit`` of them."""
    keys = set(by)
    if not keys or not keys <= set(GROUP_KEYS):
        raise InvalidRequest(f"group by one or more of {', '.join(GROUP_KEYS)}, not {list(by)}")
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be between 1 and {MAX_PAGE}", field="limit")
    if flt.status not in (None, "pending_review"):
        raise InvalidRequest("groups count pending_review dead letters only")
    where, params = replace(flt, status="pending_review").where()
    query = (
        sql.SQL(
            "SELECT queue, consumer, error_class, count(*) AS pending,"
            " min(created_at) AS oldest, max(created_at) AS newest FROM ("
        )
        + SQL["group_base"]
        + where
        + sql.SQL(
            ") AS matching GROUP BY queue, consumer, error_class"
            " ORDER BY pending DESC, oldest, queue, consumer, error_class LIMIT %(limit)s"
        )
    )
    params |= {f"by_{key}": key in keys for key in GROUP_KEYS} | {"limit": limit}
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(query, params)
        return [DeadLetterGroup(**row) for row in await cur.fetchall()]
