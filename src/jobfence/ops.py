"""Ops management of dead letters: one service layer behind the HTTP API and the CLI.

Both edges only parse, call these functions and format; neither holds logic of its own.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from psycopg import AsyncConnection, AsyncCursor, sql
from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import Loader
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg.types.string import ByteaBinaryLoader
from psycopg_pool import AsyncConnectionPool

from jobfence._sql import Queries
from jobfence.codec import original_body
from jobfence.dead_letters import (
    DeadLetter,
    ReplayResult,
    discard_dead_letter,
    get_dead_letter,
    publish_with,
    replay_dead_letter,
    replay_message,
)
from jobfence.errors import DeadLetterNotFound, DeadLetterNotReplayable, JobfenceError
from jobfence.ports import QueuePort

SQL = Queries("jobfence.sql", "ops.sql")

STATUSES = ("pending_review", "replayed", "discarded")
DEFAULT_PAGE = 50
MAX_PAGE = 500
# A list item carries payloads up to this size whole; larger ones are summarised (and say so).
PAYLOAD_INLINE_LIMIT = 4096
PAYLOAD_SUMMARY_CHARS = 512
DEFAULT_BULK_MAX = 10_000
GROUP_KEYS = ("queue", "consumer", "error_class")
BULK_CHUNK = 500

__all__ = [
    "BulkItem",
    "BulkReplay",
    "BulkReplayNotFound",
    "BulkTooLarge",
    "DeadLetterDetail",
    "DeadLetterFilter",
    "DeadLetterGroup",
    "DeadLetterItem",
    "DeadLetterPage",
    "InvalidCursor",
    "InvalidRequest",
    "ItemCache",
    "check_bulk_selection",
    "parse_time",
    "count_dead_letters",
    "discard",
    "get_bulk_replay",
    "group_pending",
    "list_bulk_items",
    "list_dead_letters",
    "list_dead_letters_json",
    "list_page_query",
    "payload_body",
    "replay",
    "run_bulk_replay",
    "show_dead_letter",
    "show_dead_letter_json",
    "start_bulk_replay",
]


class InvalidRequest(JobfenceError):
    """A request that cannot be served as asked (bad cursor, bad filter value).

    ``field`` names the parameter at fault by its name here (``cursor``, ``limit``,
    ``created_from``...), or is None; the message uses these names too. Each edge words it for
    its own audience: the HTTP API by its parameters, the CLI by its flags."""

    __module__ = "jobfence"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidCursor(InvalidRequest):
    """A cursor that no list page returned: mistyped, cut short, or made up."""

    __module__ = "jobfence"

    def __init__(self) -> None:
        super().__init__("cursor is not one a list page returned", field="cursor")


class BulkReplayNotFound(InvalidRequest):
    """No bulk replay has that id."""

    __module__ = "jobfence"


class BulkTooLarge(JobfenceError):
    """More dead letters match than the bulk replay's ``max_items`` allows."""

    __module__ = "jobfence"

    def __init__(self, matching: int, max_items: int) -> None:
        super().__init__(
            f"{matching} pending dead letters match, more than max_items={max_items}: "
            "narrow the filter or raise max_items"
        )
        self.matching = matching
        self.max_items = max_items


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


@dataclass(frozen=True, slots=True)
class DeadLetterDetail:
    dead_letter: DeadLetter
    fence_exists: bool


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


_PENDING_MIDDLE = b',"status":"pending_review","discard_reason":null,"created_at":'
_PENDING_END = b',"resolved_at":null,"resolved_by":null}'
_CREATED_AT_KEY = b',"created_at":'

# How a list page is read (ItemCache.plan), and the named query its first statement starts with.
READ_IDS, READ_ITEMS, READ_RENDERED = "ids", "items", "rendered"
_LIST_BASE = {
    READ_IDS: "list_keys_base",
    READ_ITEMS: "list_items_base",
    READ_RENDERED: "list_rendered_base",
}
# A cached item's key: the dead letter's id and its created_at as PostgreSQL sends it.
_ItemKey = tuple[int, bytes]
# A kind of page: the filters set, the status, whether it has a cursor, its limit.
_PageShape = tuple[tuple[str, ...], str | None, bool, int]


class ItemCache:
    """List items of dead letters, each rendered as if it were still pending, for
    :func:`list_dead_letters_json`.

    Such an item can never be stale: D5 keeps every field but the status and the resolution
    immutable (a trigger refuses any other change), and a page reads each row's status and
    resolution anew and renders only those. An item is found only under its dead letter's id
    *and* created_at, so a database restored to an earlier state, which hands out ids again,
    cannot be answered with another dead letter's item.

    The cache holds about ``max_bytes`` in two generations: when the younger one is full it
    becomes the older one (the previous older one is dropped), and an item found only in the
    older one moves back to the younger. ``max_bytes=0`` caches nothing.

    It also remembers, per kind of page (:data:`_PageShape`), how often such pages were found
    whole in the cache lately, which decides how the next one is read (:meth:`plan`).
    """

    __slots__ = (
        "_half",
        "_old",
        "_old_bytes",
        "_shapes",
        "_young",
        "_young_bytes",
        "hits",
        "misses",
    )

    # What a cached item costs besides its own bytes: a dict entry, its key, a bytes header.
    ENTRY_OVERHEAD = 210  # measured with tracemalloc: 1,064 bytes for an 850-byte item
    # How fast a kind of page's record follows its latest pages, and how many kinds it keeps.
    SHAPE_WEIGHT = 0.25
    MAX_SHAPES = 10_000
    # A kind of page rarely found whole is looked up in the cache once every this many pages.
    SAMPLE_EVERY = 4

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._half = max_bytes // 2
        self._young: dict[_ItemKey, bytes] = {}
        self._old: dict[_ItemKey, bytes] = {}
        self._young_bytes = self._old_bytes = 0
        self._shapes: dict[_PageShape, tuple[float, int]] = {}  # (found whole lately, pages)
        self.hits = 0  # items looked up and found, over the cache's life
        self.misses = 0  # items looked up and not found

    def __len__(self) -> int:
        return len(self._young.keys() | self._old.keys())

    @property
    def size_bytes(self) -> int:
        """What the cache holds, counted as :attr:`ENTRY_OVERHEAD` plus the item's length per
        entry (an item in both generations counts twice)."""
        return self._young_bytes + self._old_bytes

    def lookup(self, keys: list[_ItemKey]) -> list[bytes | None]:
        """The cached item of each key, None where there is none."""
        found = list(map(self._young.get, keys))
        if self._old and None in found:
            older = list(map(self._old.get, keys))
            if any(older):
                promoted = {}
                for index, item in enumerate(older):
                    if item is not None and found[index] is None:
                        found[index] = promoted[keys[index]] = item
                self.store(promoted)
        missed = found.count(None)
        self.hits += len(found) - missed
        self.misses += missed
        return found

    def store(self, items: dict[_ItemKey, bytes]) -> None:
        if self._half == 0 or not items:
            return
        self._young.update(items)
        self._young_bytes += sum(map(len, items.values())) + self.ENTRY_OVERHEAD * len(items)
        if self._young_bytes > self._half:
            self._old, self._old_bytes = self._young, self._young_bytes
            self._young, self._young_bytes = {}, 0

    def plan(self, shape: _PageShape) -> str:
        """How to read the next page of ``shape``, from how often such pages were found whole
        in the cache lately:

        - :data:`READ_IDS`, mostly whole: one short statement (ids, status, resolution), and
          the items missing, if any, in a second;
        - :data:`READ_ITEMS`, sometimes whole, never seen, or once every
          :attr:`SAMPLE_EVERY` pages of a kind rarely whole (to notice when it no longer is):
          one statement with the items as if pending, looked up and kept;
        - :data:`READ_RENDERED`, rarely whole (and always without a cache): one statement
          with the items as listed, the cache left alone. A page of random time windows or a
          walk through old pages costs what it would without a cache.

        Reading the missing items in a second statement costs the API process a round trip,
        more than receiving items it already had saves it; looking a page up and keeping its
        items costs about a third more than reading it rendered.
        """
        if self._half == 0:
            return READ_RENDERED
        whole, pages = self._shapes.get(shape, (0.0, 0))
        if whole >= 0.5:
            return READ_IDS
        if whole >= 0.2 or pages % self.SAMPLE_EVERY == 0:
            return READ_ITEMS
        self._shapes[shape] = (whole, pages + 1)
        return READ_RENDERED

    def record(self, shape: _PageShape, whole: bool) -> None:
        """A page of ``shape`` was (``whole``) or was not found whole in the cache."""
        if self._half == 0:
            return
        if len(self._shapes) >= self.MAX_SHAPES and shape not in self._shapes:
            self._shapes.clear()
        before, pages = self._shapes.get(shape, (0.0, 0))
        self._shapes[shape] = (before + self.SHAPE_WEIGHT * (float(whole) - before), pages + 1)


async def list_dead_letters_json(
    conn: AsyncConnection[Any],
    flt: DeadLetterFilter,
    *,
    limit: int = DEFAULT_PAGE,
    cursor: str | None = None,
    items: ItemCache | None = None,
) -> bytes:
    """The page :func:`list_dead_letters` reads, as the API's JSON (``{"items": [...],
    "next_cursor": ...}``), rendered by PostgreSQL: no row becomes a Python object, and each
    payload is the text jsonb stores, exactly (numbers beyond a float, deep nesting).

    ``items`` keeps items between pages: a kind of page it held whole lately is read as ids,
    status and resolution, and only the items missing are rendered (see
    :meth:`ItemCache.plan`). Every row of a page comes from one statement, so a page is exactly
    what its filter matched at that moment."""
    shape: _PageShape = (tuple(flt.params()), flt.status, bool(cursor), limit)
    how = items.plan(shape) if items is not None else READ_RENDERED
    query, params = _list_query(_LIST_BASE[how], flt, limit=limit, cursor=cursor)
    # Text as the bytes received, no str made of them on the way to the HTTP response: a text
    # column in binary format is its text in the connection's encoding, which psycopg's (C)
    # bytea loader hands over as it is (another encoding than UTF-8 is transcoded); the
    # created_at of the cache's key likewise, as the 8 bytes PostgreSQL sends.
    utf8 = conn.info.encoding == "utf-8"
    cur = conn.cursor(binary=utf8)
    cur.adapters.register_loader("text", ByteaBinaryLoader if utf8 else _Utf8TextLoader)
    if how != READ_RENDERED:
        cur.adapters.register_loader("timestamptz", ByteaBinaryLoader if utf8 else _RawTextLoader)
    await cur.execute(query, params)
    rows = await cur.fetchall()
    more = len(rows) > limit
    if more:
        del rows[limit:]  # the row that only says there is a next page
    if how == READ_RENDERED:
        page = [row[0] for row in rows]
    else:
        assert items is not None
        page = await _items_of(cur, rows, items, shape, how)
    next_cursor = b"null"
    if more:
        last = json.loads(page[-1])
        created = datetime.fromisoformat(last["created_at"])
        next_cursor = json.dumps(encode_cursor(created, last["id"])).encode()
    # One join, so the page is copied once: the envelope rides on the first and last items.
    head, tail = b'{"items":[', b'],"next_cursor":' + next_cursor + b"}"
    if not page:
        return head + tail
    page[0] = head + page[0]
    page[-1] += tail
    return b",".join(page)


async def _items_of(
    cur: AsyncCursor[Any], rows: list[Any], items: ItemCache, shape: _PageShape, how: str
) -> list[bytes]:
    """The items of ``rows`` (``list_keys_base``'s columns, and ``list_items_base``'s item as
    if pending with :data:`READ_ITEMS`) from ``items``, and what it lacks from ``rows`` or the
    database, which ``items`` then keeps; each row's status and resolution put in."""
    keys: list[_ItemKey] = [(row[0], row[1]) for row in rows]
    page = items.lookup(keys)
    items.record(shape, None not in page)
    if how == READ_ITEMS and None in page:
        received = {
            key: row[4]
            for key, row, item in zip(keys, rows, page, strict=True)
            if item is None and row[4] is not None
        }
        items.store(received)
        page = [received.get(key, item) for key, item in zip(keys, page, strict=True)]
    if None in page:  # not cached, or (read with its row) without a stored rendering
        missing = [key for key, item in zip(keys, page, strict=True) if item is None]
        fetched = await _items_as_pending(cur, missing)
        items.store(fetched)
        page = [fetched.get(key, item) for key, item in zip(keys, page, strict=True)]
    for index, row in enumerate(rows):
        resolved_head, resolved_tail = row[2], row[3]
        if resolved_head is not None:
            item = page[index]
            assert item is not None
            cut = item.rfind(_PENDING_MIDDLE)
            created_at = item[cut + len(_PENDING_MIDDLE) : -len(_PENDING_END)]
            page[index] = b"".join(
                (item[:cut], resolved_head, _CREATED_AT_KEY, created_at, resolved_tail)
            )
    return page  # type: ignore[return-value]  # every None was filled above


async def _items_as_pending(cur: AsyncCursor[Any], keys: list[_ItemKey]) -> dict[_ItemKey, bytes]:
    """The items of ``keys`` as if still pending (``list_items_as_pending``), by key."""
    by_id = dict(keys)
    fetched: dict[_ItemKey, bytes] = {}
    for name in ("list_items_as_pending", "list_items_as_pending_unrendered"):
        # The ids as a bigint[] literal: psycopg adapting a list of ints costs 5x more.
        await cur.execute(SQL[name], {"ids": "{" + ",".join(map(str, by_id)) + "}"})
        for dead_letter_id, item in await cur.fetchall():
            fetched[dead_letter_id, by_id.pop(dead_letter_id)] = item
        if not by_id:
            return fetched
    raise RuntimeError(f"dead letters {sorted(by_id)} vanished during a list page")


class _RawTextLoader(Loader):
    """A value received as text, as the bytes received."""

    def load(self, data: Buffer) -> bytes:
        return bytes(data)


class _Utf8TextLoader(Loader):
    """``text`` received in another encoding than UTF-8, as UTF-8 bytes."""

    def __init__(self, oid: int, context: AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        conn = self.connection
        self._encoding = conn.info.encoding if conn is not None else "utf-8"

    def load(self, data: Buffer) -> bytes:
        return bytes(data).decode(self._encoding).encode()


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


async def show_dead_letter(conn: AsyncConnection[Any], dead_letter_id: int) -> DeadLetterDetail:
    """One dead letter whole, and whether a fence row exists for its (job_id, consumer)."""
    letter = await get_dead_letter(conn, dead_letter_id)
    cur = await conn.execute(
        SQL["fence_exists_for"], {"job_id": letter.job_id, "consumer": letter.consumer}
    )
    row = await cur.fetchone()
    return DeadLetterDetail(dead_letter=letter, fence_exists=bool(row and row[0]))


async def payload_body(conn: AsyncConnection[Any], dead_letter_id: int) -> bytes:
    """The bytes a replay of the dead letter publishes: the original bytes of a base64 payload,
    the stored JSON document's text (UTF-8) otherwise."""
    cur = await conn.execute(SQL["payload_body"], {"id": dead_letter_id})
    row = await cur.fetchone()
    if row is None:
        raise DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
    return original_body(row[0], row[1])


async def show_dead_letter_json(conn: AsyncConnection[Any], dead_letter_id: int) -> str:
    """What :func:`show_dead_letter` reads, as the API's JSON, rendered by PostgreSQL in one
    statement (see :func:`list_dead_letters_json`)."""
    cur = await conn.execute(SQL["show_json"], {"id": dead_letter_id})
    row = await cur.fetchone()
    if row is None:
        raise DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
    text: str = row[0]
    return text


async def replay(
    pool: AsyncConnectionPool[Any], queue: QueuePort, dead_letter_id: int, *, actor: str
) -> ReplayResult:
    return await replay_dead_letter(pool, queue, dead_letter_id, resolved_by=actor)


async def discard(
    pool: AsyncConnectionPool[Any], dead_letter_id: int, *, reason: str, actor: str
) -> DeadLetter:
    return await discard_dead_letter(pool, dead_letter_id, reason=reason, resolved_by=actor)


@dataclass(frozen=True, slots=True)
class BulkReplay:
    """A bulk replay and its progress: ``counts`` has replayed, already_processed, not_pending,
    failed and pending (not processed yet)."""

    id: int
    filter: dict[str, Any]
    requested_by: str
    max_items: int
    total: int
    status: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BulkItem:
    dead_letter_id: int
    result: str | None
    detail: str | None
    processed_at: datetime | None


# Worded for the HTTP API (its body field ``all``); the CLI words them with ``--all``.
BULK_ALL_NEEDED = (
    "no filter given: a bulk replay of every pending dead letter (poison included) must be "
    'asked for explicitly with "all": true'
)
BULK_ALL_WITH_FILTER = (
    'a filter and "all": true contradict each other: "all" selects every pending dead letter;'
    ' give either filters or "all"'
)


def check_bulk_selection(flt: DeadLetterFilter, *, select_all: bool) -> None:
    """A bulk replay selects by filter, or everything when asked for explicitly: no filter
    without ``select_all`` (:data:`BULK_ALL_NEEDED`), and not both
    (:data:`BULK_ALL_WITH_FILTER`). ``status`` is not a filter here."""
    filtered = any(v is not None for k, v in asdict(flt).items() if k != "status")
    if select_all and filtered:
        raise InvalidRequest(BULK_ALL_WITH_FILTER, field="all")
    if not select_all and not filtered:
        raise InvalidRequest(BULK_ALL_NEEDED, field="all")


def _pending_filter(flt: DeadLetterFilter) -> DeadLetterFilter:
    if flt.status not in (None, "pending_review"):
        raise InvalidRequest("bulk replay takes pending_review dead letters only")
    return DeadLetterFilter(**{**asdict(flt), "status": "pending_review"})


async def start_bulk_replay(
    pool: AsyncConnectionPool[Any],
    flt: DeadLetterFilter,
    *,
    max_items: int = DEFAULT_BULK_MAX,
    requested_by: str,
    dry_run: bool = False,
    select_all: bool = False,
) -> BulkReplay | int:
    """Fix the snapshot: the pending dead letters matching ``flt`` now, and only those.

    ``flt`` without a filter selects every pending dead letter, and only with ``select_all``
    (which takes no filter): see :func:`check_bulk_selection`; a refusal changes nothing.
    ``dry_run`` returns how many match and changes nothing. More matches than ``max_items``
    raise :class:`BulkTooLarge` (nothing is taken). Otherwise the run is recorded with its items
    and returned; process it with :func:`run_bulk_replay`.
    """
    if max_items < 1:
        raise InvalidRequest("max_items must be >= 1")
    if not requested_by.strip():
        raise InvalidRequest("requested_by must name who asks")
    check_bulk_selection(flt, select_all=select_all)
    flt = _pending_filter(flt)
    async with pool.connection() as conn:
        if dry_run:
            return await count_dead_letters(conn, flt)
        async with conn.transaction():
            # The snapshot and, when it is too large, the count see the same rows.
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cur = await conn.execute(
                SQL["bulk_create"],
                {
                    "filter": Jsonb(flt.to_json()),
                    "requested_by": requested_by,
                    "max_items": max_items,
                },
            )
            row = await cur.fetchone()
            assert row is not None
            bulk_id = int(row[0])
            # One scan: take at most one row more than allowed; one more means too many.
            where, params = flt.where()
            cur = await conn.execute(
                SQL["bulk_snapshot_base"] + where + sql.SQL(" LIMIT %(cap)s"),
                params | {"bulk_id": bulk_id, "cap": max_items + 1},
            )
            if cur.rowcount > max_items:  # raised inside: rolled back, nothing recorded
                raise BulkTooLarge(await count_dead_letters(conn, flt), max_items)
            await conn.execute(SQL["bulk_set_total"], {"id": bulk_id, "total": cur.rowcount})
        return await get_bulk_replay(conn, bulk_id)


async def get_bulk_replay(conn: AsyncConnection[Any], bulk_id: int) -> BulkReplay:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(SQL["bulk_get"], {"id": bulk_id})
        row = await cur.fetchone()
        if row is None:
            raise BulkReplayNotFound(f"no bulk replay with id {bulk_id}")
        await cur.execute(SQL["bulk_counts"], {"id": bulk_id})
        counts = {r["result"]: int(r["n"]) for r in await cur.fetchall()}
    for key in ("replayed", "already_processed", "not_pending", "failed", "pending"):
        counts.setdefault(key, 0)
    return BulkReplay(counts=counts, **row)


async def list_bulk_items(
    conn: AsyncConnection[Any],
    bulk_id: int,
    *,
    result: str | None = None,
    after: int = 0,
    limit: int = 100,
) -> list[BulkItem]:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(
            SQL["bulk_items"], {"id": bulk_id, "result": result, "after": after, "limit": limit}
        )
        return [BulkItem(**r) for r in await cur.fetchall()]


async def run_bulk_replay(
    pool: AsyncConnectionPool[Any],
    queue: QueuePort,
    bulk_id: int,
    *,
    actor: str,
    chunk_size: int = BULK_CHUNK,
    on_progress: Callable[[BulkReplay], None] | None = None,
) -> BulkReplay:
    """Process a run's remaining items, a chunk per transaction (resumable after a crash).

    Per item: a dead letter no longer pending is ``not_pending`` (left as it is); one whose
    fence row exists is ``already_processed``: moved to replayed without republishing, since the
    fence would skip the job anyway; any other is republished with the same job_id (D8) and
    ``replayed``. With the PostgreSQL queue the publishes and the transitions of a chunk commit
    together; with an external broker its outbox rows (:mod:`jobfence.outbox`) and the
    transitions do, and the outbox relay publishes them after the commit. A publish (or outbox
    insert) that fails rolls its chunk back: its dead letters stay ``pending_review`` and the
    run resumes from that chunk.
    """
    while True:
        async with pool.connection() as conn, conn.transaction():
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(SQL["bulk_take_chunk"], {"id": bulk_id, "limit": chunk_size})
                rows = await cur.fetchall()
            if not rows:
                await conn.execute(SQL["bulk_finish"], {"id": bulk_id})
                break
            ids: list[int] = []
            results: list[str] = []
            details: list[str | None] = []
            to_mark: list[int] = []
            for row in rows:
                ids.append(row["dead_letter_id"])
                if row["status"] != "pending_review":
                    results.append("not_pending")
                    details.append(f"status is {row['status']}")
                    continue
                if row["fenced"]:
                    results.append("already_processed")
                    details.append("fence row exists: not republished")
                    to_mark.append(row["dead_letter_id"])
                    continue
                try:
                    message = replay_message(row)
                except DeadLetterNotReplayable as exc:
                    results.append("failed")
                    details.append(str(exc)[:500])
                    continue
                await publish_with(conn, queue, message)
                results.append("replayed")
                details.append(None)
                to_mark.append(row["dead_letter_id"])
            if to_mark:
                await conn.execute(
                    SQL["bulk_mark_replayed"], {"ids": to_mark, "resolved_by": actor}
                )
            await conn.execute(
                SQL["bulk_record_results"],
                {"bulk_id": bulk_id, "ids": ids, "results": results, "details": details},
            )
            await conn.execute(SQL["bulk_touch"], {"id": bulk_id})
        if on_progress is not None:
            async with pool.connection() as conn:
                on_progress(await get_bulk_replay(conn, bulk_id))
    async with pool.connection() as conn:
        return await get_bulk_replay(conn, bulk_id)
