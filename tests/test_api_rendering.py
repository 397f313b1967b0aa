"""The API renders list pages and single dead letters as JSON in PostgreSQL; the pydantic
models document that JSON. Here the two are held to each other on the same rows: escapes,
non-ASCII text, a summarised large payload, a base64 payload, timestamps with and without
microseconds, whatever the session's time zone; rendered from the row stored at insert
(migration 0008) or on read."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from typing import Any

from psycopg import AsyncConnection
from psycopg.sql import SQL
from psycopg.types.json import Jsonb

from jobfence import ops, schema
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


async def _page_json(conn: AsyncConnection[Any]) -> Any:
    return json.loads(await ops.list_dead_letters_json(conn, ops.DeadLetterFilter(), limit=500))


async def test_a_dead_letter_listed_from_its_stored_rendering_equals_one_rendered_on_read(
    conn: AsyncConnection[Any],
) -> None:
    # Migration 0008 stores the immutable fields' rendering at insert; a row without one (say,
    # inserted by logical replication, where triggers do not fire) is rendered on read.
    await _seed(conn)
    await conn.execute("SET TimeZone = 'UTC'")
    cur = await conn.execute("SELECT count(*) FROM jobfence.dead_letter_renderings")
    assert await cur.fetchone() == (4,)
    stored = await _page_json(conn)
    await conn.execute("DELETE FROM jobfence.dead_letter_renderings")
    assert await _page_json(conn) == stored
    assert stored == _pydantic_page(
        await ops.list_dead_letters(conn, ops.DeadLetterFilter(), limit=500)
    )


async def test_the_payload_summary_starts_one_byte_past_the_python_inline_limit(
    conn: AsyncConnection[Any],
) -> None:
    # The stored rendering spells the inline limit and the summary length in SQL: held here to
    # jobfence.ops' constants at the boundary.
    overhead = len(json.dumps({"x": ""}).encode())
    fits = "a" * (ops.PAYLOAD_INLINE_LIMIT - overhead)
    await _insert(conn, job_id="fits", payload=Jsonb({"x": fits}))
    await _insert(conn, job_id="over", payload=Jsonb({"x": fits + "a"}))
    await conn.execute("SET TimeZone = 'UTC'")
    items = {item["job_id"]: item for item in (await _page_json(conn))["items"]}
    assert items["fits"]["payload_size"] == ops.PAYLOAD_INLINE_LIMIT
    assert items["fits"]["payload_truncated"] is False
    assert items["fits"]["payload"] == {"x": fits}
    assert items["over"]["payload_size"] == ops.PAYLOAD_INLINE_LIMIT + 1
    assert items["over"]["payload_truncated"] is True
    assert len(items["over"]["payload_summary"]) == ops.PAYLOAD_SUMMARY_CHARS
    assert (await _page_json(conn))["items"] == _pydantic_page(
        await ops.list_dead_letters(conn, ops.DeadLetterFilter(), limit=500)
    )["items"]


async def test_upgrading_to_stored_renderings_renders_the_dead_letters_already_there(
    empty_database_url: str,
) -> None:
    # A database migrated by a jobfence from before 0008, with dead letters in it.
    async with await AsyncConnection.connect(empty_database_url, autocommit=True) as conn:
        await conn.execute(schema.BOOKKEEPING)
        for m in schema.migrations():
            if m.version < 8:
                await conn.execute(SQL(m.sql))  # type: ignore[arg-type]
                await conn.execute(
                    "INSERT INTO jobfence.schema_migrations (version, name, checksum)"
                    " VALUES (%s, %s, %s)",
                    (m.version, m.name, m.checksum),
                )
        await _seed(conn)
        applied = await schema.migrate(conn)
        assert [m.version for m in applied] == [
            m.version for m in schema.migrations() if m.version >= 8
        ]
        cur = await conn.execute("SELECT count(*) FROM jobfence.dead_letter_renderings")
        assert await cur.fetchone() == (4,)
        await conn.execute("SET TimeZone = 'UTC'")
        assert await _page_json(conn) == _pydantic_page(
            await ops.list_dead_letters(conn, ops.DeadLetterFilter(), limit=500)
        )


async def test_a_page_is_utf8_json_whatever_the_connection_encoding(
    conn: AsyncConnection[Any],
) -> None:
    # The page travels as bytes from PostgreSQL to the HTTP response, decoded nowhere: on a
    # connection in another encoding than UTF-8 they are transcoded.
    await _insert(conn, job_id="latin", last_error="Grüße, café", tenant_id="ÄÖÜ")
    await conn.execute("SET TimeZone = 'UTC'")
    utf8 = await ops.list_dead_letters_json(conn, ops.DeadLetterFilter())
    await conn.execute("SET client_encoding = 'LATIN1'")
    assert conn.info.encoding == "iso8859-1"
    latin1 = await ops.list_dead_letters_json(conn, ops.DeadLetterFilter())
    assert latin1 == utf8
    [item] = json.loads(latin1.decode("utf-8"))["items"]
    assert (item["last_error"], item["tenant_id"]) == ("Grüße, café", "ÄÖÜ")


async def test_a_page_that_matches_nothing_is_an_empty_list(conn: AsyncConnection[Any]) -> None:
    await _seed(conn)
    nothing = ops.DeadLetterFilter(queue="no such queue")
    assert await ops.list_dead_letters_json(conn, nothing) == b'{"items":[],"next_cursor":null}'
    DeadLetterPageOut.model_validate_json(await ops.list_dead_letters_json(conn, nothing))


async def test_a_page_does_not_read_the_large_payload_of_a_row_it_lists(
    conn: AsyncConnection[Any],
) -> None:
    # A listed row's payload summary comes from its stored rendering: the page must not fetch
    # the payload itself (1 MB here, kept out of line by TOAST, about 500 chunks), which it
    # would by passing the whole row to the fallback renderer.
    await _insert(conn, job_id="huge", payload=Jsonb({"blob": os.urandom(512 * 1024).hex()}))
    await _insert(conn, job_id="small")
    query, params = ops.list_page_query(ops.DeadLetterFilter(), limit=50)
    cur = await conn.execute(b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params)
    row = await cur.fetchone()
    assert row is not None
    plan = row[0][0]["Plan"]
    blocks = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    assert blocks < 40, f"listing 2 rows touched {blocks} buffers"
    items = {item["job_id"]: item for item in (await _page_json(conn))["items"]}
    assert items["huge"]["payload_truncated"] is True
