"""The list items cache, and the JSON list pages served from it (the API's list path)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection, AsyncCursor
from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import Loader
from psycopg.types.string import ByteaBinaryLoader

from jobfence._sql import Queries
from jobfence.ops.filters import DeadLetterFilter
from jobfence.ops.listing import (
    _LIST_BASE,
    DEFAULT_PAGE,
    READ_IDS,
    READ_ITEMS,
    READ_RENDERED,
    _list_query,
    encode_cursor,
)

SQL = Queries("jobfence.sql", "ops.sql")


_PENDING_MIDDLE = b',"status":"pending_review","discard_reason":null,"created_at":'
_PENDING_END = b',"resolved_at":null,"resolved_by":null}'
_CREATED_AT_KEY = b',"created_at":'

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
