"""How PostgreSQL plans list pages (jobfence.ops, "Plans"): a page without filter values or a
cursor has no parameter left and is planned once per connection; any other page keeps its
values as parameters, for PostgreSQL to plan for them."""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from psycopg import AsyncConnection

from jobfence import ops

ROWS = 20_000
FIELDS = ("queue", "consumer", "tenant_id", "error_class", "job_id", "correlation_id")
VALUES = {
    "queue": "q3",
    "consumer": "c4",
    "tenant_id": "t5",
    "error_class": "E2",
    "job_id": "job-77",
    "correlation_id": "corr-7",
}
CURSOR = ops.encode_cursor(datetime(2026, 3, 1, tzinfo=UTC), ROWS // 2)
DAY = {
    "created_from": datetime(2026, 2, 1, tzinfo=UTC),
    "created_to": datetime(2026, 2, 2, tzinfo=UTC),
}


async def _seed(conn: AsyncConnection[Any]) -> None:
    """ROWS dead letters over 10 queues, consumers, tenants and error classes, one in 20
    discarded and one in 10 replayed, an hour apart, analysed."""
    await conn.execute(
        """
        INSERT INTO core.dead_letters (job_id, queue, consumer, tenant_id, payload, attempts,
            last_error, error_class, correlation_id, status, discard_reason, created_at,
            resolved_at, resolved_by)
        SELECT 'job-' || i, 'q' || i %% 10, 'c' || i %% 7, 't' || i %% 13, '{"n": 1}', 1, 'boom',
               'E' || i %% 11, 'corr-' || i %% 1000, s.status,
               CASE WHEN s.status = 'discarded' THEN 'not needed' END,
               timestamptz '2026-01-01 00:00Z' + i * interval '5 minutes',
               CASE WHEN s.status <> 'pending_review' THEN now() END,
               CASE WHEN s.status <> 'pending_review' THEN 'ops' END
        FROM generate_series(1, %s) AS i
        CROSS JOIN LATERAL (SELECT CASE WHEN i %% 20 = 0 THEN 'discarded'
                                        WHEN i %% 10 = 1 THEN 'replayed'
                                        ELSE 'pending_review' END AS status) AS s
        """,
        (ROWS,),
    )
    await conn.execute("ANALYZE core.dead_letters")


def _filters() -> list[tuple[str, ops.DeadLetterFilter, str | None]]:
    """Every combination of the list's filters (each equality filter set or not, a status or
    none, a one-day range or none), with and without a cursor."""
    out = []
    for n in range(len(FIELDS) + 1):
        for fields in itertools.combinations(FIELDS, n):
            for status in (None, *ops.STATUSES):
                for day in (False, True):
                    values: dict[str, Any] = {f: VALUES[f] for f in fields}
                    if day:
                        values |= DAY
                    flt = ops.DeadLetterFilter(status=status, **values)
                    for cursor in (None, CURSOR):
                        out.append((f"{flt.to_json()} cursor={bool(cursor)}", flt, cursor))
    return out


async def _plans(conn: AsyncConnection[Any]) -> list[tuple[str, int, int]]:
    """The prepared statements of list pages (not those that fetch the pages' items by id)."""
    cur = await conn.execute(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
        " WHERE statement LIKE '%ORDER BY created_at DESC, id DESC%' ORDER BY prepare_time"
    )
    return [(str(s), int(g), int(c)) for s, g, c in await cur.fetchall()]


async def test_the_first_page_of_all_or_of_one_status_is_planned_once_per_connection(
    database_url: str,
) -> None:
    async with await AsyncConnection.connect(database_url, autocommit=True) as conn:
        await _seed(conn)
        for _ in range(8):
            for status in (None, *ops.STATUSES):
                flt = ops.DeadLetterFilter(status=status)
                await ops.list_dead_letters_json(conn, flt, limit=500)
        plans = await _plans(conn)
    # psycopg prepares a statement after its fifth execution (prepare_threshold): 3 prepared
    # executions of each of the 4 queries, all on the plan made once.
    assert len(plans) == 4, plans
    for statement, generic, custom in plans:
        assert "LIMIT 501" in statement and "$" not in statement, statement
        assert (generic, custom) == (3, 0), plans


def test_a_page_with_filter_values_or_a_cursor_keeps_them_and_its_limit_as_parameters() -> None:
    # Written into the query, they would let PostgreSQL keep one generic plan for all values
    # after five executions, made from average estimates (see jobfence.ops, "Plans").
    for label, flt, cursor in _filters():
        query, params = ops.list_page_query(flt, limit=50, cursor=cursor)
        values = flt.params()
        if set(values) <= {"f_status"} and not cursor:
            assert b"%(" not in query and query.endswith(b"LIMIT 51"), label
            continue
        assert query.endswith(b"LIMIT %(limit)s") and params["limit"] == 51, label
        for name, value in values.items():
            assert f"%({name})s".encode() in query and params[name] == value, label
        assert (b"%(c_created_at)s" in query) == bool(cursor), label


async def test_a_page_with_filter_values_is_planned_for_its_values_every_time(
    database_url: str,
) -> None:
    """PostgreSQL may switch a prepared statement to one generic plan after five executions
    when that plan looks no dearer than the custom ones; for list pages it never does (their
    LIMIT is a parameter too), so each page is planned for its own values."""
    shapes = (
        [(ops.DeadLetterFilter(queue=f"q{i % 10}"), None) for i in range(10)]
        + [
            (ops.DeadLetterFilter(status="discarded", tenant_id=f"t{i % 13}"), None)
            for i in range(10)
        ]
        + [
            (ops.DeadLetterFilter(status="pending_review", queue=f"q{i % 10}"), CURSOR)
            for i in range(10)
        ]
    )
    async with await AsyncConnection.connect(database_url, autocommit=True) as conn:
        await _seed(conn)
        for flt, cursor in shapes:
            await ops.list_dead_letters_json(conn, flt, limit=50, cursor=cursor)
        plans = await _plans(conn)
    assert len(plans) == 3, plans
    for statement, generic, custom in plans:
        assert "$1" in statement, statement
        assert (generic, custom) == (0, 5), plans


@pytest.mark.parametrize("status", [None, *ops.STATUSES])
async def test_every_page_of_all_or_of_one_status_lists_the_rows_sql_finds(
    conn: AsyncConnection[Any], status: str | None
) -> None:
    """The first page (status and LIMIT in the query) and the pages after it (parameters)
    list every row once, newest first."""
    await _seed(conn)
    listed: list[int] = []
    cursor = None
    while True:
        text = await ops.list_dead_letters_json(
            conn, ops.DeadLetterFilter(status=status), limit=500, cursor=cursor
        )
        page = json.loads(text)
        listed.extend(item["id"] for item in page["items"])
        assert all(status in (None, item["status"]) for item in page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    where = "" if status is None else f"WHERE status = '{status}'"
    cur = await conn.execute(
        f"SELECT id FROM core.dead_letters {where} ORDER BY created_at DESC, id DESC"
    )
    assert listed == [row[0] for row in await cur.fetchall()]
    assert len(listed) > 500


async def _rows_read_for(conn: AsyncConnection[Any], flt: ops.DeadLetterFilter) -> int:
    """How many index entries of core.dead_letters the page's plan read, kept or not."""
    query, params = ops.list_page_query(flt, limit=50)
    cur = await conn.execute(b"EXPLAIN (ANALYZE, FORMAT JSON) " + query, params)
    found = await cur.fetchone()
    assert found is not None

    def scans(node: dict[str, Any]) -> list[dict[str, Any]]:
        below = [scan for child in node.get("Plans", []) for scan in scans(child)]
        return [node, *below] if node.get("Relation Name") == "dead_letters" else below

    (scan,) = scans(found[0][0]["Plan"])
    return int(scan["Actual Rows"]) + int(scan.get("Rows Removed by Filter", 0))


async def test_a_page_of_one_queue_reads_only_that_queues_rows(
    conn: AsyncConnection[Any],
) -> None:
    await _seed(conn)
    assert await _rows_read_for(conn, ops.DeadLetterFilter(queue="q3")) == 51
    # Without migration 0009's index, the page walks every queue's rows in time order.
    await conn.execute("DROP INDEX core.dead_letters_queue_created_idx")
    assert await _rows_read_for(conn, ops.DeadLetterFilter(queue="q3")) > 400
