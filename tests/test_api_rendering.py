"""The API renders list pages and single dead letters as JSON in PostgreSQL; the pydantic
models document that JSON. Here the two are held to each other on the same rows: escapes,
non-ASCII text, a summarised large payload, a base64 payload, timestamps with and without
microseconds, whatever the session's time zone."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

from jobfence import ops
from jobfence.api.schemas import DeadLetterDetailOut, DeadLetterItemOut, DeadLetterPageOut

AWKWARD = 'quote " backslash \\ newline \n tab \t bell \x07 unit-sep \x1f del \x7f'
UNICODE = "Grüße, 日本語, emoji \U0001f600, line sep \u2028, é"


async def _insert(conn: AsyncConnection[Any], **values: Any) -> int:
    row = {
        "job_id": "job",
        "queue": "q",
        "consumer": "c",
        "tenant_id": None,
        "payload": Jsonb({"n": 1}),
        "payload_encoding": "json",
        "attempts": 1,
        "last_error": "boom",
        "error_class": "E",
        "correlation_id": None,
        "created_at": datetime.now(UTC),
    } | values
    cur = await conn.execute(
        f"INSERT INTO core.dead_letters ({', '.join(row)})"
        f" VALUES ({', '.join(['%s'] * len(row))}) RETURNING id",
        list(row.values()),
    )
    found = await cur.fetchone()
    assert found is not None
    return int(found[0])


async def _seed(conn: AsyncConnection[Any]) -> list[int]:
    ids = [
        await _insert(
            conn,
            job_id=f"job {AWKWARD}",
            queue=UNICODE,
            tenant_id=UNICODE,
            payload=Jsonb({"text": AWKWARD, "unicode": UNICODE, "nested": [1, 2.5, None, True]}),
            last_error=f"{AWKWARD}\n{UNICODE}",
            correlation_id="corr/1",
            created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),  # no microseconds
        ),
        await _insert(
            conn,
            job_id="large",
            payload=Jsonb({"attachment": "é" * 5000, "note": AWKWARD}),  # > 4,096 bytes
            created_at=datetime(2026, 1, 2, 3, 4, 6, 120, tzinfo=UTC),
        ),
        await _insert(
            conn,
            job_id="bytes",
            payload=Jsonb({"encoding": "base64", "data": "//4=", "note": "not UTF-8"}),
            payload_encoding="base64",
            error_class="InvalidUtf8",
            created_at=datetime(2026, 1, 2, 3, 4, 7, 999999, tzinfo=UTC),
        ),
        await _insert(conn, job_id="discarded", created_at=datetime(2026, 1, 3, tzinfo=UTC)),
    ]
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at)"
            " VALUES ('bytes', 'c', now(), now() + interval '1 day')"
        )
    discard = (
        "UPDATE core.dead_letters SET status = 'discarded', discard_reason = %s,"
        " resolved_at = %s, resolved_by = %s WHERE id = %s"
    )
    await conn.execute(
        discard,
        (AWKWARD, datetime(2026, 1, 4, 5, 6, 7, 890, tzinfo=UTC), UNICODE, ids[3]),
    )
    return ids


def _pydantic_page(page: ops.DeadLetterPage) -> Any:
    model = DeadLetterPageOut(
        items=[DeadLetterItemOut.of(item) for item in page.items], next_cursor=page.next_cursor
    )
    return json.loads(model.model_dump_json())


async def test_a_page_rendered_in_sql_equals_the_pydantic_rendering_of_the_same_rows(
    conn: AsyncConnection[Any],
) -> None:
    await _seed(conn)
    await conn.execute("SET TimeZone = 'UTC'")  # how the models' timestamps render: with Z
    for flt, limit in (
        (ops.DeadLetterFilter(), 50),
        (ops.DeadLetterFilter(), 2),  # a page with a next cursor
        (ops.DeadLetterFilter(queue=UNICODE, tenant_id=UNICODE), 50),
        (ops.DeadLetterFilter(status="discarded"), 50),
    ):
        expected = _pydantic_page(await ops.list_dead_letters(conn, flt, limit=limit))
        rendered = await ops.list_dead_letters_json(conn, flt, limit=limit)
        assert json.loads(rendered) == expected
        DeadLetterPageOut.model_validate_json(rendered)  # and it fits the documented model
        cursor = expected["next_cursor"]
        if cursor is not None:
            expected = _pydantic_page(
                await ops.list_dead_letters(conn, flt, limit=limit, cursor=cursor)
            )
            rendered = await ops.list_dead_letters_json(conn, flt, limit=limit, cursor=cursor)
            assert json.loads(rendered) == expected
    everything = json.loads(await ops.list_dead_letters_json(conn, ops.DeadLetterFilter()))
    summarised = [item for item in everything["items"] if item["job_id"] == "large"]
    assert summarised[0]["payload"] is None
    assert summarised[0]["payload_truncated"] is True
    assert summarised[0]["payload_summary"].startswith('{"note": "quote \\" backslash')
    assert "Z" in everything["items"][0]["created_at"]


async def test_a_dead_letter_shown_in_sql_equals_the_pydantic_rendering(
    conn: AsyncConnection[Any],
) -> None:
    ids = await _seed(conn)
    await conn.execute("SET TimeZone = 'UTC'")
    for dead_letter_id in ids:
        model = DeadLetterDetailOut.of(await ops.show_dead_letter(conn, dead_letter_id))
        rendered = await ops.show_dead_letter_json(conn, dead_letter_id)
        assert json.loads(rendered) == json.loads(model.model_dump_json())
        DeadLetterDetailOut.model_validate_json(rendered)
    assert json.loads(await ops.show_dead_letter_json(conn, ids[2]))["fence_exists"] is True


async def test_sql_rendering_gives_utc_whatever_the_session_time_zone(
    conn: AsyncConnection[Any],
) -> None:
    ids = await _seed(conn)
    await conn.execute("SET TimeZone = 'UTC'")
    page = await ops.list_dead_letters_json(conn, ops.DeadLetterFilter())
    shown = await ops.show_dead_letter_json(conn, ids[3])
    await conn.execute("SET TimeZone = 'America/Sao_Paulo'")
    assert await ops.list_dead_letters_json(conn, ops.DeadLetterFilter()) == page
    assert await ops.show_dead_letter_json(conn, ids[3]) == shown
    body = json.loads(shown)
    assert body["created_at"] == "2026-01-03T00:00:00Z"
    assert body["resolved_at"] == "2026-01-04T05:06:07.000890Z"
