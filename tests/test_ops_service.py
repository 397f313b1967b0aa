"""The Ops service layer (jobfence.ops) on a real PostgreSQL: list, show, groups, bulk replay.

Dead letters are seeded with plain INSERTs into core.dead_letters, so each test controls every
column (times included) and checks the service against what it wrote.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from jobfence import MemoryQueue, Message, PgQueue, ops
from jobfence.errors import DeadLetterNotFound
from jobfence.ops import BulkReplay, BulkTooLarge, DeadLetterFilter, InvalidRequest
from jobfence.outbox import OutboxRelay
from support import scalar

BASE = datetime(2026, 1, 1, tzinfo=UTC)
ALL_ORDER = "ORDER BY created_at DESC, id DESC"


async def seed(
    conn: psycopg.AsyncConnection[Any],
    *,
    job_id: str,
    queue: str = "loyalty",
    consumer: str = "award_points",
    tenant_id: str | None = "tenant-a",
    error_class: str = "pointsapp.Flaky",
    correlation_id: str | None = None,
    created_at: datetime | None = None,
    payload: Any = None,
    payload_encoding: str = "json",
    status: str = "pending_review",
) -> int:
    """One dead letter, inserted directly; ``status`` other than pending is set by the one
    transition the database allows."""
    cur = await conn.execute(
        """INSERT INTO core.dead_letters (job_id, queue, consumer, tenant_id, payload,
               payload_encoding, attempts, last_error, error_class, correlation_id, created_at)
           VALUES (%s, %s, %s, %s, %s, %s, 6, %s, %s, %s, coalesce(%s, now()))
           RETURNING id""",
        (
            job_id,
            queue,
            consumer,
            tenant_id,
            json.dumps({"job": job_id} if payload is None else payload),
            payload_encoding,
            f"{error_class}: failed\n  File handler.py, line 3",
            error_class,
            correlation_id,
            created_at,
        ),
    )
    row = await cur.fetchone()
    assert row is not None
    dead_letter_id = int(row[0])
    if status == "replayed":
        await conn.execute(
            "UPDATE core.dead_letters SET status = 'replayed', resolved_at = now(),"
            " resolved_by = 'seed' WHERE id = %s",
            (dead_letter_id,),
        )
    elif status == "discarded":
        await conn.execute(
            "UPDATE core.dead_letters SET status = 'discarded', discard_reason = 'seeded',"
            " resolved_at = now(), resolved_by = 'seed' WHERE id = %s",
            (dead_letter_id,),
        )
    return dead_letter_id


async def ids_where(
    conn: psycopg.AsyncConnection[Any], where: str, params: Any = None
) -> list[int]:
    cur = await conn.execute(
        f"SELECT id FROM core.dead_letters WHERE {where} {ALL_ORDER}",
        params,
    )
    return [int(r[0]) for r in await cur.fetchall()]


async def statuses(conn: psycopg.AsyncConnection[Any]) -> dict[int, str]:
    cur = await conn.execute("SELECT id, status FROM core.dead_letters")
    return {int(i): str(s) for i, s in await cur.fetchall()}


async def queued(conn: psycopg.AsyncConnection[Any]) -> list[dict[str, Any]]:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(
            "SELECT queue, consumer, job_id, body, tenant_id, correlation_id, attempts"
            " FROM jobfence_queue.messages ORDER BY id"
        )
        return await cur.fetchall()


async def list_all(
    conn: psycopg.AsyncConnection[Any], flt: DeadLetterFilter, *, limit: int = 500
) -> list[int]:
    page = await ops.list_dead_letters(conn, flt, limit=limit)
    assert page.next_cursor is None, "more than one page"
    return [item.id for item in page.items]


# -- list: filters, order, pagination ------------------------------------------------------


async def seed_matrix(conn: psycopg.AsyncConnection[Any]) -> None:
    """24 dead letters across 2 queues, 3 consumers, 3 tenants (one None), 2 error classes,
    3 statuses and 24 distinct minutes."""
    for n in range(24):
        await seed(
            conn,
            job_id=f"job-{n}",
            queue=("loyalty", "billing")[n % 2],
            consumer=("award_points", "send_mail", "bill")[n % 3],
            tenant_id=("tenant-a", "tenant-b", None)[n % 3 if n % 4 else 0],
            error_class=("pointsapp.Flaky", "InvalidJson")[n // 12],
            correlation_id=f"corr-{n % 5}",
            created_at=BASE + timedelta(minutes=(n * 7) % 24),
            status=("pending_review", "replayed", "discarded")[n % 5 % 3],
        )


FILTERS = [
    pytest.param({"status": "pending_review"}, "status = 'pending_review'", id="status-pending"),
    pytest.param({"status": "discarded"}, "status = 'discarded'", id="status-discarded"),
    pytest.param({"queue": "billing"}, "queue = 'billing'", id="queue"),
    pytest.param({"consumer": "send_mail"}, "consumer = 'send_mail'", id="consumer"),
    pytest.param({"tenant_id": "tenant-b"}, "tenant_id = 'tenant-b'", id="tenant"),
    pytest.param({"error_class": "InvalidJson"}, "error_class = 'InvalidJson'", id="error-class"),
    pytest.param({"job_id": "job-7"}, "job_id = 'job-7'", id="job-id"),
    pytest.param({"correlation_id": "corr-3"}, "correlation_id = 'corr-3'", id="correlation"),
    pytest.param(
        {"created_from": BASE + timedelta(minutes=10)},
        "created_at >= '2026-01-01T00:10:00Z'",
        id="created-from-inclusive",
    ),
    pytest.param(
        {"created_to": BASE + timedelta(minutes=10)},
        "created_at < '2026-01-01T00:10:00Z'",
        id="created-to-exclusive",
    ),
    pytest.param(
        {
            "queue": "loyalty",
            "status": "pending_review",
            "created_from": BASE + timedelta(minutes=3),
            "created_to": BASE + timedelta(minutes=20),
        },
        "queue = 'loyalty' AND status = 'pending_review'"
        " AND created_at >= '2026-01-01T00:03:00Z' AND created_at < '2026-01-01T00:20:00Z'",
        id="combined",
    ),
]


@pytest.mark.parametrize(("fields", "where"), FILTERS)
async def test_list_filter_selects_exactly_the_matching_rows_newest_first(
    conn: psycopg.AsyncConnection[Any], fields: dict[str, Any], where: str
) -> None:
    await seed_matrix(conn)
    expected = await ids_where(conn, where)
    assert expected, "the filter should match something"
    assert len(expected) < 24, "the filter should exclude something"

    assert await list_all(conn, DeadLetterFilter(**fields)) == expected
    assert await ops.count_dead_letters(conn, DeadLetterFilter(**fields)) == len(expected)


async def test_list_without_filter_is_every_row_newest_first_ties_by_id(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    older = await seed(conn, job_id="older", created_at=BASE)
    tie_1 = await seed(conn, job_id="tie-1", created_at=BASE + timedelta(hours=1))
    tie_2 = await seed(conn, job_id="tie-2", created_at=BASE + timedelta(hours=1))
    newest = await seed(conn, job_id="newest", created_at=BASE + timedelta(hours=2))

    page = await ops.list_dead_letters(conn, DeadLetterFilter())

    assert [i.id for i in page.items] == [newest, tie_2, tie_1, older]
    first = page.items[0]
    assert (first.job_id, first.queue, first.consumer, first.tenant_id) == (
        "newest",
        "loyalty",
        "award_points",
        "tenant-a",
    )
    assert first.payload == {"job": "newest"}
    assert first.status == "pending_review"
    assert first.attempts == 6
    assert first.created_at == BASE + timedelta(hours=2)


async def test_keyset_pagination_visits_every_row_exactly_once(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    # 37 rows, many sharing a created_at, so pages split inside groups of equal times.
    for n in range(37):
        await seed(conn, job_id=f"p-{n}", created_at=BASE + timedelta(minutes=n // 4))
    expected = await ids_where(conn, "true")

    seen: list[int] = []
    cursor: str | None = None
    pages = 0
    while True:
        page = await ops.list_dead_letters(conn, DeadLetterFilter(), limit=5, cursor=cursor)
        pages += 1
        assert len(page.items) == (5 if page.next_cursor else 37 - 5 * (pages - 1))
        seen += [i.id for i in page.items]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor

    assert pages == 8
    assert seen == expected
    assert len(set(seen)) == 37


async def test_pagination_with_a_filter_stays_within_it(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await seed_matrix(conn)
    expected = await ids_where(conn, "queue = 'billing'")
    seen: list[int] = []
    cursor = None
    while True:
        page = await ops.list_dead_letters(
            conn, DeadLetterFilter(queue="billing"), limit=4, cursor=cursor
        )
        seen += [i.id for i in page.items]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == expected


async def test_pagination_is_stable_when_rows_are_inserted_between_pages(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    for n in range(12):
        await seed(conn, job_id=f"s-{n}", created_at=BASE + timedelta(minutes=n))
    expected = await ids_where(conn, "true")

    first = await ops.list_dead_letters(conn, DeadLetterFilter(), limit=5)
    seen = [i.id for i in first.items]
    cursor = first.next_cursor
    inserted: list[int] = []
    while cursor is not None:
        # New failures arrive between pages: they sort before the first page.
        inserted.append(await seed(conn, job_id=f"new-{len(inserted)}"))
        page = await ops.list_dead_letters(conn, DeadLetterFilter(), limit=5, cursor=cursor)
        seen += [i.id for i in page.items]
        cursor = page.next_cursor

    assert seen == expected  # every original row once, none of the new ones, same order
    restart = await ops.list_dead_letters(conn, DeadLetterFilter(), limit=5)
    assert [i.id for i in restart.items][: len(inserted)] == sorted(inserted, reverse=True)


@pytest.mark.parametrize("limit", [0, -1, 501, 10_000])
async def test_list_limit_out_of_bounds_is_invalid(
    conn: psycopg.AsyncConnection[Any], limit: int
) -> None:
    with pytest.raises(InvalidRequest, match="limit must be between 1 and 500"):
        await ops.list_dead_letters(conn, DeadLetterFilter(), limit=limit)


async def test_list_limit_bounds_themselves_are_accepted(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    for n in range(3):
        await seed(conn, job_id=f"l-{n}", created_at=BASE + timedelta(minutes=n))
    one = await ops.list_dead_letters(conn, DeadLetterFilter(), limit=1)
    assert len(one.items) == 1
    assert one.next_cursor is not None
    most = await ops.list_dead_letters(conn, DeadLetterFilter(), limit=500)
    assert len(most.items) == 3
    assert most.next_cursor is None
    default = await ops.list_dead_letters(conn, DeadLetterFilter())
    assert len(default.items) == 3  # the default page is 50


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize(
    "cursor",
    [
        "not a cursor!",
        "abc",
        _b64(b"\xff\xfe"),
        _b64(b"[1, 2]"),
        _b64(b'"ab"'),
        _b64(b"null"),
        _b64(b'["2026-01-01T00:00:00+00:00"]'),
        _b64(b'["yesterday", 5]'),
        _b64(b'["2026-01-01T00:00:00+00:00", "five"]'),
        _b64(b'["2026-01-01T00:00:00+00:00", Infinity]'),
    ],
    ids=[
        "garbage",
        "short",
        "not-utf8",
        "numbers",
        "string",
        "null",
        "one-element",
        "bad-time",
        "bad-id",
        "infinite-id",
    ],
)
async def test_a_bad_cursor_is_an_invalid_request(
    conn: psycopg.AsyncConnection[Any], cursor: str
) -> None:
    with pytest.raises(InvalidRequest, match="cursor"):
        await ops.list_dead_letters(conn, DeadLetterFilter(), cursor=cursor)


def test_a_bad_filter_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="status must be one of"):
        DeadLetterFilter(status="pending")
    with pytest.raises(InvalidRequest, match="created_from must be before created_to"):
        DeadLetterFilter(created_from=BASE, created_to=BASE)


async def test_a_large_payload_is_summarised_and_says_so(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    big = {"blob": "x" * 10_000, "n": 1}
    large_id = await seed(conn, job_id="large", payload=big, created_at=BASE)
    small_id = await seed(conn, job_id="small", payload={"n": 2}, created_at=BASE)
    cur = await conn.execute("SELECT id, octet_length(payload::text) FROM core.dead_letters")
    sizes = dict(await cur.fetchall())

    items = {i.id: i for i in (await ops.list_dead_letters(conn, DeadLetterFilter())).items}

    large = items[large_id]
    assert large.payload_truncated
    assert large.payload is None
    assert large.payload_size == sizes[large_id] > ops.PAYLOAD_INLINE_LIMIT
    assert large.payload_summary is not None
    assert len(large.payload_summary) == ops.PAYLOAD_SUMMARY_CHARS
    assert large.payload_summary.startswith('{"n": 1, "blob": "xxxx')
    small = items[small_id]
    assert not small.payload_truncated
    assert small.payload == {"n": 2}
    assert small.payload_summary is None
    assert small.payload_size == sizes[small_id] == len('{"n": 2}')
    # show still returns the large payload whole
    detail = await ops.show_dead_letter(conn, large_id)
    assert detail.dead_letter.payload == big


# -- show ----------------------------------------------------------------------------------


async def test_show_returns_the_whole_dead_letter_and_whether_its_fence_exists(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    dl_id = await seed(conn, job_id="order-1", consumer="award_points", correlation_id="c-1")
    other_consumer = await seed(conn, job_id="order-1", consumer="send_mail")

    detail = await ops.show_dead_letter(conn, dl_id)
    assert not detail.fence_exists
    letter = detail.dead_letter
    assert (letter.id, letter.job_id, letter.consumer, letter.correlation_id) == (
        dl_id,
        "order-1",
        "award_points",
        "c-1",
    )
    assert letter.payload == {"job": "order-1"}
    assert letter.last_error.startswith("pointsapp.Flaky: failed")

    await conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('order-1', 'award_points', now() + interval '1 day')"
    )
    assert (await ops.show_dead_letter(conn, dl_id)).fence_exists
    # The fence is per (job_id, consumer): another consumer's dead letter has none.
    assert not (await ops.show_dead_letter(conn, other_consumer)).fence_exists

    with pytest.raises(DeadLetterNotFound, match="no dead letter with id 999999"):
        await ops.show_dead_letter(conn, 999_999)


# -- groups --------------------------------------------------------------------------------


async def test_group_pending_counts_pending_dead_letters_per_group(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await seed_matrix(conn)

    async def expected(columns: Sequence[str], where: str = "true") -> list[tuple[Any, ...]]:
        cols = ", ".join(columns)
        cur = await conn.execute(
            f"SELECT {cols}, count(*), min(created_at), max(created_at) FROM core.dead_letters"
            f" WHERE status = 'pending_review' AND {where} GROUP BY {cols}"
        )
        return sorted(await cur.fetchall(), key=lambda r: (-r[-3], r[-2], *r[:-3]))

    def shown(groups: list[ops.DeadLetterGroup], columns: Sequence[str]) -> list[tuple[Any, ...]]:
        out = []
        for g in groups:
            for key in ops.GROUP_KEYS:
                if key not in columns:
                    assert getattr(g, key) is None
            out.append((*(getattr(g, c) for c in columns), g.pending, g.oldest, g.newest))
        return out

    by_queue = await ops.group_pending(conn, DeadLetterFilter(), by=["queue"])
    assert shown(by_queue, ["queue"]) == await expected(["queue"])
    assert sum(g.pending for g in by_queue) == len(
        await ids_where(conn, "status = 'pending_review'")
    )

    three = ["queue", "consumer", "error_class"]
    assert shown(await ops.group_pending(conn, DeadLetterFilter(), by=three), three) == (
        await expected(three)
    )
    filtered = await ops.group_pending(
        conn, DeadLetterFilter(queue="loyalty", status="pending_review"), by=["error_class"]
    )
    assert shown(filtered, ["error_class"]) == await expected(["error_class"], "queue = 'loyalty'")
    assert len(await ops.group_pending(conn, DeadLetterFilter(), by=three, limit=2)) == 2


@pytest.mark.parametrize(
    ("by", "flt", "says"),
    [
        (["tenant_id"], DeadLetterFilter(), "group by one or more of"),
        ([], DeadLetterFilter(), "group by one or more of"),
        (["queue"], DeadLetterFilter(status="replayed"), "pending_review dead letters only"),
    ],
)
async def test_group_pending_refuses_what_it_cannot_count(
    conn: psycopg.AsyncConnection[Any], by: list[str], flt: DeadLetterFilter, says: str
) -> None:
    with pytest.raises(InvalidRequest, match=says):
        await ops.group_pending(conn, flt, by=by)


# -- bulk replay ---------------------------------------------------------------------------


async def seed_pending(
    conn: psycopg.AsyncConnection[Any], n: int, *, prefix: str = "b"
) -> list[int]:
    return [
        await seed(
            conn,
            job_id=f"{prefix}-{i}",
            correlation_id=f"corr-{prefix}-{i}",
            payload={"account_id": i + 1, "points": 10 + i},
            created_at=BASE + timedelta(minutes=i),
        )
        for i in range(n)
    ]


async def start(pool: AsyncConnectionPool[Any], flt: DeadLetterFilter, **kwargs: Any) -> BulkReplay:
    run = await ops.start_bulk_replay(pool, flt, requested_by="ops-test", **kwargs)
    assert isinstance(run, BulkReplay)
    return run


async def test_bulk_dry_run_counts_and_changes_nothing(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await seed_pending(conn, 4)
    await seed(conn, job_id="other-queue", queue="billing")
    await seed(conn, job_id="done", status="replayed")
    before = await statuses(conn)

    counted = await ops.start_bulk_replay(
        pool, DeadLetterFilter(queue="loyalty"), requested_by="ops-test", dry_run=True
    )
    everything = await ops.start_bulk_replay(
        pool,
        DeadLetterFilter(),
        requested_by="ops-test",
        dry_run=True,
        max_items=1,
        select_all=True,
    )

    assert counted == 4
    assert everything == 5  # a dry run counts even beyond max_items
    assert await statuses(conn) == before
    assert await scalar(conn, "SELECT count(*) FROM jobfence.bulk_replays") == 0
    assert await queued(conn) == []


async def test_bulk_more_than_max_items_is_refused_and_takes_nothing(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await seed_pending(conn, 3)
    before = await statuses(conn)

    with pytest.raises(BulkTooLarge) as refused:
        await ops.start_bulk_replay(
            pool, DeadLetterFilter(), requested_by="ops", max_items=2, select_all=True
        )

    assert (refused.value.matching, refused.value.max_items) == (3, 2)
    assert await statuses(conn) == before
    assert await scalar(conn, "SELECT count(*) FROM jobfence.bulk_replays") == 0
    assert await scalar(conn, "SELECT count(*) FROM jobfence.bulk_replay_items") == 0
    assert await queued(conn) == []
    run = await start(
        pool, DeadLetterFilter(), max_items=3, select_all=True
    )  # exactly max_items is fine
    assert run.total == 3


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"max_items": 0}, "max_items must be >= 1"),
        ({"requested_by": "  "}, "requested_by must name who asks"),
        ({"flt": DeadLetterFilter(status="discarded")}, "pending_review dead letters only"),
    ],
)
async def test_bulk_start_refuses_bad_requests(
    pool: AsyncConnectionPool[Any], kwargs: dict[str, Any], says: str
) -> None:
    args: dict[str, Any] = {
        "flt": DeadLetterFilter(),
        "requested_by": "ops",
        "select_all": True,
    } | kwargs
    with pytest.raises(InvalidRequest, match=says):
        await ops.start_bulk_replay(pool, **args)


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize(
    ("flt", "select_all", "says"),
    [
        (DeadLetterFilter(), False, ops.BULK_ALL_NEEDED),
        (DeadLetterFilter(status="pending_review"), False, ops.BULK_ALL_NEEDED),
        (DeadLetterFilter(queue="loyalty"), True, ops.BULK_ALL_WITH_FILTER),
    ],
    ids=["no-filter", "status-only", "filter-and-all"],
)
async def test_bulk_start_selects_everything_only_when_asked_and_never_with_a_filter(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    flt: DeadLetterFilter,
    *,
    select_all: bool,
    says: str,
    dry_run: bool,
) -> None:
    await seed_pending(conn, 2)
    before = await statuses(conn)

    with pytest.raises(InvalidRequest) as refused:
        await ops.start_bulk_replay(
            pool, flt, requested_by="ops", select_all=select_all, dry_run=dry_run
        )

    assert str(refused.value) == says
    assert await statuses(conn) == before
    assert await scalar(conn, "SELECT count(*) FROM jobfence.bulk_replays") == 0
    assert await queued(conn) == []


async def test_bulk_snapshot_excludes_dead_letters_created_after_the_start(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    snapshot = await seed_pending(conn, 3, prefix="early")
    run = await start(pool, DeadLetterFilter(queue="loyalty"))
    late = await seed_pending(conn, 2, prefix="late")  # fail after the call: not swept in

    queue = PgQueue(pool)
    try:
        final = await ops.run_bulk_replay(pool, queue, run.id, actor="alice")
    finally:
        await queue.close()

    assert run.total == final.total == 3
    assert final.status == "finished"
    assert final.finished_at is not None
    assert final.counts == {
        "replayed": 3,
        "already_processed": 0,
        "not_pending": 0,
        "failed": 0,
        "pending": 0,
    }
    now = await statuses(conn)
    assert [now[i] for i in snapshot] == ["replayed"] * 3
    assert [now[i] for i in late] == ["pending_review"] * 2
    assert sorted(m["job_id"] for m in await queued(conn)) == ["early-0", "early-1", "early-2"]


async def test_bulk_run_republishes_each_with_same_ids_and_original_body(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    raw = b"\xff\xfe not utf-8 \x00 at all"
    wrapper = {
        "encoding": "base64",
        "data": base64.b64encode(raw).decode(),
        "note": "original bytes kept as base64: payload is not valid UTF-8",
    }
    json_id = await seed(
        conn,
        job_id="json-job",
        tenant_id="tenant-j",
        correlation_id="corr-j",
        payload={"account_id": 3, "points": 7, "note": "héllo"},
        created_at=BASE,
    )
    b64_id = await seed(
        conn,
        job_id="bytes-job",
        consumer="send_mail",
        tenant_id=None,
        correlation_id="corr-b",
        payload=wrapper,
        payload_encoding="base64",
        created_at=BASE,
    )
    run = await start(pool, DeadLetterFilter(), select_all=True)
    queue = PgQueue(pool)
    try:
        final = await ops.run_bulk_replay(pool, queue, run.id, actor="alice")
    finally:
        await queue.close()

    assert final.counts["replayed"] == 2
    published = {m["job_id"]: m for m in await queued(conn)}
    assert set(published) == {"json-job", "bytes-job"}
    j = published["json-job"]
    assert (j["queue"], j["consumer"], j["tenant_id"], j["correlation_id"], j["attempts"]) == (
        "loyalty",
        "award_points",
        "tenant-j",
        "corr-j",
        0,
    )
    assert json.loads(bytes(j["body"])) == {"account_id": 3, "points": 7, "note": "héllo"}
    b = published["bytes-job"]
    assert (b["consumer"], b["tenant_id"], b["correlation_id"]) == ("send_mail", None, "corr-b")
    assert bytes(b["body"]) == raw  # the exact original bytes
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(
            "SELECT id, status, resolved_by, resolved_at FROM core.dead_letters ORDER BY id"
        )
        rows = await cur.fetchall()
    assert [(r["id"], r["status"], r["resolved_by"]) for r in rows] == [
        (json_id, "replayed", "alice"),
        (b64_id, "replayed", "alice"),
    ]
    assert all(r["resolved_at"] is not None for r in rows)
    items = await ops.list_bulk_items(conn, run.id)
    assert [(i.dead_letter_id, i.result) for i in items] == [
        (json_id, "replayed"),
        (b64_id, "replayed"),
    ]


async def test_bulk_item_already_fenced_is_not_republished_and_one_discarded_meanwhile_is_left(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    fenced, discarded, plain = await seed_pending(conn, 3)
    await conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('b-0', 'award_points', now() + interval '1 day')"
    )
    run = await start(pool, DeadLetterFilter(), select_all=True)
    # Between the snapshot and the run, someone discards one of its dead letters.
    discarded_row = await ops.discard(pool, discarded, reason="refunded by hand", actor="bob")

    queue = PgQueue(pool)
    try:
        final = await ops.run_bulk_replay(pool, queue, run.id, actor="alice")
    finally:
        await queue.close()

    assert final.counts == {
        "replayed": 1,
        "already_processed": 1,
        "not_pending": 1,
        "failed": 0,
        "pending": 0,
    }
    assert [m["job_id"] for m in await queued(conn)] == ["b-2"]
    now = await statuses(conn)
    assert (now[fenced], now[discarded], now[plain]) == ("replayed", "discarded", "replayed")
    detail = await ops.show_dead_letter(conn, discarded)
    assert detail.dead_letter == discarded_row  # untouched by the run
    items = {i.dead_letter_id: i for i in await ops.list_bulk_items(conn, run.id)}
    assert items[fenced].result == "already_processed"
    assert items[fenced].detail == "fence row exists: not republished"
    assert items[discarded].result == "not_pending"
    assert items[discarded].detail == "status is discarded"
    assert items[plain].result == "replayed"
    assert [
        i.dead_letter_id for i in await ops.list_bulk_items(conn, run.id, result="replayed")
    ] == [plain]


async def test_bulk_progress_is_reported_after_each_chunk(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await seed_pending(conn, 7)
    run = await start(pool, DeadLetterFilter(), select_all=True)
    seen: list[tuple[int, int, str]] = []

    def progress(state: BulkReplay) -> None:
        seen.append((state.total - state.counts["pending"], state.counts["replayed"], state.status))

    queue = PgQueue(pool)
    try:
        final = await ops.run_bulk_replay(
            pool, queue, run.id, actor="alice", chunk_size=3, on_progress=progress
        )
    finally:
        await queue.close()

    assert seen == [(3, 3, "running"), (6, 6, "running"), (7, 7, "running")]
    assert final.status == "finished"
    assert len(await queued(conn)) == 7


async def assert_each_replayed_and_published_or_pending(
    conn: psycopg.AsyncConnection[Any], run_id: int
) -> dict[str, int]:
    """Every item of the run is either replayed with exactly one queued message, or still
    pending_review with none (and not yet processed)."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(
            """SELECT d.id, d.status, i.result,
                      (SELECT count(*) FROM jobfence_queue.messages m
                       WHERE m.job_id = d.job_id AND m.consumer = d.consumer) AS published
               FROM jobfence.bulk_replay_items i
               JOIN core.dead_letters d ON d.id = i.dead_letter_id
               WHERE i.bulk_replay_id = %s""",
            (run_id,),
        )
        rows = await cur.fetchall()
    tally = {"replayed": 0, "pending_review": 0}
    for row in rows:
        if row["status"] == "replayed":
            assert (row["result"], row["published"]) == ("replayed", 1), row
        else:
            assert (row["status"], row["result"], row["published"]) == (
                "pending_review",
                None,
                0,
            ), row
        tally[row["status"]] += 1
    return tally


class Interrupted(Exception):
    pass


async def test_bulk_run_interrupted_between_chunks_leaves_each_item_done_or_pending_then_resumes(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await seed_pending(conn, 5)
    run = await start(pool, DeadLetterFilter(), select_all=True)

    def stop_after_first_chunk(state: BulkReplay) -> None:
        raise Interrupted(f"stopped at {state.counts}")

    queue = PgQueue(pool)
    try:
        with pytest.raises(Interrupted):
            await ops.run_bulk_replay(
                pool, queue, run.id, actor="alice", chunk_size=2, on_progress=stop_after_first_chunk
            )
        assert await assert_each_replayed_and_published_or_pending(conn, run.id) == {
            "replayed": 2,
            "pending_review": 3,
        }
        async with pool.connection() as c:
            halfway = await ops.get_bulk_replay(c, run.id)
        assert (halfway.status, halfway.counts["pending"]) == ("running", 3)

        final = await ops.run_bulk_replay(pool, queue, run.id, actor="alice", chunk_size=2)
    finally:
        await queue.close()

    assert final.status == "finished"
    assert final.counts["replayed"] == 5
    assert await assert_each_replayed_and_published_or_pending(conn, run.id) == {
        "replayed": 5,
        "pending_review": 0,
    }


class CrashingPgQueue(PgQueue):
    """Fails inside a chunk, after earlier publishes of that chunk went into its transaction."""

    def __init__(self, pool: AsyncConnectionPool[Any], crash_on: str) -> None:
        super().__init__(pool)
        self.crash_on = crash_on

    async def publish(
        self,
        message: Message,
        *,
        delay_seconds: float = 0.0,
        tx: psycopg.AsyncConnection[Any] | None = None,
        prior_attempts: int = 0,
    ) -> None:
        if message.job_id == self.crash_on:
            raise Interrupted(f"crash while publishing {message.job_id}")
        await super().publish(
            message, delay_seconds=delay_seconds, tx=tx, prior_attempts=prior_attempts
        )


# The server refuses the publish's own INSERT for one job (the "refused by the server" case).
REFUSE_PUBLISH = """
CREATE FUNCTION refuse_r0() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'queue refuses %', NEW.job_id; END $$;
CREATE TRIGGER refuse_r0 BEFORE INSERT ON jobfence_queue.messages
FOR EACH ROW WHEN (NEW.job_id = 'r-0') EXECUTE FUNCTION refuse_r0();
"""


async def _replay_state(conn: psycopg.AsyncConnection[Any], dead_letter_id: int) -> tuple[Any, ...]:
    cur = await conn.execute(
        """SELECT d.status, d.resolved_by,
                  (SELECT count(*) FROM jobfence_queue.messages m WHERE m.job_id = d.job_id)
           FROM core.dead_letters d WHERE d.id = %s""",
        (dead_letter_id,),
    )
    row = await cur.fetchone()
    assert row is not None
    return tuple(row)


@pytest.mark.parametrize("failure", ["refused by the server", "raised in the adapter"])
async def test_a_single_replay_whose_transactional_publish_fails_leaves_the_row_pending(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any], failure: str
) -> None:
    first, second = await seed_pending(conn, 2, prefix="r")
    refused = failure == "refused by the server"
    if refused:
        await conn.execute(REFUSE_PUBLISH)
    failing = PgQueue(pool) if refused else CrashingPgQueue(pool, crash_on="r-0")
    expected = psycopg.errors.RaiseException if refused else Interrupted
    try:
        with pytest.raises(expected):
            await ops.replay(pool, failing, first, actor="alice")
    finally:
        await failing.close()
    assert await _replay_state(conn, first) == ("pending_review", None, 0)
    await conn.execute("DROP TRIGGER IF EXISTS refuse_r0 ON jobfence_queue.messages")

    # The pool's connections are left usable: the next replay goes through.
    queue = PgQueue(pool)
    try:
        for dead_letter_id in (second, first):
            result = await ops.replay(pool, queue, dead_letter_id, actor="alice")
            assert result.published
            assert await _replay_state(conn, dead_letter_id) == ("replayed", "alice", 1)
    finally:
        await queue.close()


async def test_bulk_run_interrupted_inside_a_chunk_rolls_that_chunk_back_then_resumes(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await seed_pending(conn, 5)
    run = await start(pool, DeadLetterFilter(), select_all=True)

    crashing = CrashingPgQueue(pool, crash_on="b-3")  # second item of the second chunk
    try:
        with pytest.raises(Interrupted):
            await ops.run_bulk_replay(pool, crashing, run.id, actor="alice", chunk_size=2)
    finally:
        await crashing.close()
    # Chunk 1 committed; chunk 2's publish of b-2 and its transitions rolled back together.
    assert await assert_each_replayed_and_published_or_pending(conn, run.id) == {
        "replayed": 2,
        "pending_review": 3,
    }

    queue = PgQueue(pool)
    try:
        final = await ops.run_bulk_replay(pool, queue, run.id, actor="alice", chunk_size=2)
    finally:
        await queue.close()
    assert (final.status, final.counts["replayed"]) == ("finished", 5)
    assert await assert_each_replayed_and_published_or_pending(conn, run.id) == {
        "replayed": 5,
        "pending_review": 0,
    }


async def test_two_processes_resuming_the_same_run_do_each_item_once(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await seed_pending(conn, 30)
    run = await start(pool, DeadLetterFilter(), select_all=True)
    queue = PgQueue(pool)
    try:
        await asyncio.gather(
            *(
                ops.run_bulk_replay(pool, queue, run.id, actor=f"worker-{n}", chunk_size=4)
                for n in range(3)
            )
        )
    finally:
        await queue.close()
    assert await assert_each_replayed_and_published_or_pending(conn, run.id) == {
        "replayed": 30,
        "pending_review": 0,
    }
    async with pool.connection() as c:
        final = await ops.get_bulk_replay(c, run.id)
    assert (final.status, final.counts["replayed"]) == ("finished", 30)


class FlakyBroker(MemoryQueue):
    """An external (non-transactional) broker that refuses some messages."""

    def __init__(self, refuse: set[str]) -> None:
        super().__init__()
        self.refuse = refuse

    async def publish(
        self,
        message: Message,
        *,
        delay_seconds: float = 0.0,
        tx: psycopg.AsyncConnection[Any] | None = None,
        prior_attempts: int = 0,
    ) -> None:
        if message.job_id in self.refuse:
            raise ConnectionError(f"broker refused {message.job_id}")
        await super().publish(
            message, delay_seconds=delay_seconds, tx=tx, prior_attempts=prior_attempts
        )


async def test_bulk_replay_on_an_external_broker_goes_through_the_outbox_and_loses_nothing(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    """The replay writes one outbox row per dead letter with its transition and never calls
    the broker; the relay publishes them, and what the broker refuses stays in the outbox."""
    ids = await seed_pending(conn, 5)
    run = await start(pool, DeadLetterFilter(), select_all=True)
    broker = FlakyBroker(refuse={"b-1", "b-3"})

    final = await ops.run_bulk_replay(pool, broker, run.id, actor="alice", chunk_size=2)

    assert final.status == "finished"
    assert final.counts == {
        "replayed": 5,
        "already_processed": 0,
        "not_pending": 0,
        "failed": 0,
        "pending": 0,
    }
    now = await statuses(conn)
    assert [now[i] for i in ids] == ["replayed"] * 5
    assert (await broker.size(["loyalty"])).total == 0
    assert await queued(conn) == []  # nothing went to the PostgreSQL queue

    relay = OutboxRelay(database_url, broker)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
        for _ in range(3):  # the refused ones wait out their backoff: not published here
            await relay.run_round(c)
    deliveries = await broker.receive(["loyalty"], max_messages=10, lease_seconds=60)
    published = {d.message.job_id: json.loads(d.message.body) for d in deliveries}
    assert sorted(published) == ["b-0", "b-2", "b-4"]
    assert published["b-2"] == {"account_id": 3, "points": 12}
    cur = await conn.execute("SELECT job_id, attempts FROM jobfence.outbox ORDER BY job_id")
    assert await cur.fetchall() == [("b-1", 1), ("b-3", 1)]
    await broker.close()


async def test_get_bulk_replay_of_an_unknown_run_is_an_invalid_request(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    with pytest.raises(InvalidRequest, match="no bulk replay with id 4242"):
        await ops.get_bulk_replay(conn, 4242)
