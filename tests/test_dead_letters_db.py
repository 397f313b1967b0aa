"""Acceptance 7 and D5: dead-letter invariants enforced by the database itself, not only Python.

Every refusal here is a raw SQL statement that bypasses jobfence's Python checks; each test shows
the error and that the row is exactly as it was before.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg import errors
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from jobfence import discard_dead_letter
from jobfence.harness import SQL
from support import scalar

IMMUTABLE_COLUMNS = {
    # column: a new value (SQL) that differs from the one _insert writes
    "job_id": "'other-job'",
    "queue": "'other-queue'",
    "consumer": "'other-consumer'",
    "tenant_id": "'tenant-b'",
    "payload": """'{"points": 6}'::jsonb""",
    "payload_encoding": "'base64'",
    "attempts": "7",
    "last_error": "'RuntimeError: rewritten'",
    "error_class": "'RuntimeError'",
    "correlation_id": "'corr-2'",
    "created_at": "created_at - interval '1 day'",
}
BLANK_REASONS = [None, "", "   ", " \t\n ", "\r\n"]
ILLEGAL_TRANSITIONS = [
    ("replayed", "pending_review"),
    ("discarded", "replayed"),
    ("discarded", "pending_review"),
    ("replayed", "discarded"),
    ("replayed", "replayed"),  # re-resolving (a new resolved_by) is a change too
    ("pending_review", "pending_review"),
    ("pending_review", "bogus"),
]
LEGAL_TRANSITION = "status = 'replayed', resolved_at = now(), resolved_by = 'ops'"
ONLY_RESOLUTION_MAY_CHANGE = "only status, discard_reason, resolved_at and resolved_by may change"


async def _insert(
    conn: psycopg.AsyncConnection[Any], job_id: str = "job-1", consumer: str = "award_points"
) -> int | None:
    """A dead letter written by the harness's own query; None when it inserted nothing."""
    cur = await conn.execute(
        SQL["dead_letter_insert"],
        {
            "job_id": job_id,
            "queue": "loyalty",
            "consumer": consumer,
            "tenant_id": "tenant-a",
            "payload": json.dumps({"account_id": 1, "points": 5}),
            "payload_encoding": "json",
            "attempts": 6,
            "last_error": "Flaky: ledger timeout on attempt 6",
            "error_class": "pointsapp.Flaky",
            "correlation_id": "corr-1",
            "traceparent": None,
        },
    )
    row = await cur.fetchone()
    return None if row is None else int(row[0])


async def _row(conn: psycopg.AsyncConnection[Any], dead_letter_id: int) -> dict[str, Any]:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute("SELECT * FROM core.dead_letters WHERE id = %s", (dead_letter_id,))
        row = await cur.fetchone()
    assert row is not None
    return row


async def _count(conn: psycopg.AsyncConnection[Any]) -> int:
    return int(await scalar(conn, "SELECT count(*) FROM core.dead_letters"))


async def _set_status(conn: psycopg.AsyncConnection[Any], dead_letter_id: int, status: str) -> None:
    if status == "replayed":
        assignments = LEGAL_TRANSITION
    else:
        assignments = (
            "status = 'discarded', discard_reason = 'duplicate of #1', resolved_at = now(),"
            " resolved_by = 'ops'"
        )
    await conn.execute(
        f"UPDATE core.dead_letters SET {assignments} WHERE id = %s",  # type: ignore[arg-type]
        (dead_letter_id,),
    )


async def test_acceptance_7_discarding_without_a_reason_is_refused_by_the_database(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    dead_letter_id = await _insert(conn)
    assert dead_letter_id is not None
    before = await _row(conn, dead_letter_id)

    for reason in BLANK_REASONS:
        with pytest.raises(errors.CheckViolation) as refused:
            await conn.execute(
                "UPDATE core.dead_letters SET status = 'discarded', discard_reason = %s,"
                " resolved_at = now(), resolved_by = 'ops' WHERE id = %s",
                (reason, dead_letter_id),
            )
        assert "dead_letters_discard_reason_iff_discarded" in str(refused.value), reason
        assert await _row(conn, dead_letter_id) == before, reason


async def test_a_discard_reason_on_a_row_that_is_not_discarded_is_refused_by_the_database(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    dead_letter_id = await _insert(conn)
    assert dead_letter_id is not None
    before = await _row(conn, dead_letter_id)
    with pytest.raises(errors.CheckViolation, match="dead_letters_discard_reason_iff_discarded"):
        await conn.execute(
            f"UPDATE core.dead_letters SET {LEGAL_TRANSITION}, discard_reason = 'why'"
            " WHERE id = %s",
            (dead_letter_id,),
        )
    assert await _row(conn, dead_letter_id) == before


async def test_discard_dead_letter_with_a_blank_reason_raises_and_leaves_the_row_unchanged(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    dead_letter_id = await _insert(conn)
    assert dead_letter_id is not None
    before = await _row(conn, dead_letter_id)

    for reason in BLANK_REASONS[1:]:
        with pytest.raises(ValueError, match="a discard requires a non-blank reason"):
            await discard_dead_letter(pool, dead_letter_id, reason=reason, resolved_by="ops@x")  # type: ignore[arg-type]
        assert await _row(conn, dead_letter_id) == before, reason


async def test_discard_dead_letter_with_a_reason_records_who_and_when(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    dead_letter_id = await _insert(conn)
    assert dead_letter_id is not None
    before = await _row(conn, dead_letter_id)
    started: datetime = await scalar(conn, "SELECT now()")

    result = await discard_dead_letter(
        pool, dead_letter_id, reason="account closed; refunded by hand", resolved_by="ops@example"
    )

    assert result.status == "discarded"
    assert result.discard_reason == "account closed; refunded by hand"
    assert result.resolved_by == "ops@example"
    after = await _row(conn, dead_letter_id)
    assert after["status"] == "discarded"
    assert after["resolved_by"] == "ops@example"
    assert after["resolved_at"] is not None
    assert after["resolved_at"] >= started
    unchanged = {"status", "discard_reason", "resolved_at", "resolved_by"}
    assert {k: v for k, v in after.items() if k not in unchanged} == {
        k: v for k, v in before.items() if k not in unchanged
    }


async def test_d5_trigger_refuses_an_update_of_each_immutable_column(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    dead_letter_id = await _insert(conn)
    assert dead_letter_id is not None
    before = await _row(conn, dead_letter_id)

    for column, new_value in IMMUTABLE_COLUMNS.items():
        # Alone (the status stays pending_review): the error names the immutable column ...
        with pytest.raises(errors.IntegrityConstraintViolation, match=ONLY_RESOLUTION_MAY_CHANGE):
            await conn.execute(
                f"UPDATE core.dead_letters SET {column} = {new_value} WHERE id = %s",  # type: ignore[arg-type]
                (dead_letter_id,),
            )
        # ... and riding along with a legal pending_review -> replayed transition.
        with pytest.raises(errors.IntegrityConstraintViolation, match=ONLY_RESOLUTION_MAY_CHANGE):
            await conn.execute(
                f"UPDATE core.dead_letters SET {LEGAL_TRANSITION}, {column} = {new_value}"  # type: ignore[arg-type]
                " WHERE id = %s",
                (dead_letter_id,),
            )
        assert await _row(conn, dead_letter_id) == before, column


async def test_d5_the_identity_column_cannot_be_updated_either(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    dead_letter_id = await _insert(conn)
    assert dead_letter_id is not None
    before = await _row(conn, dead_letter_id)
    with pytest.raises(errors.GeneratedAlways):
        await conn.execute(
            f"UPDATE core.dead_letters SET {LEGAL_TRANSITION}, id = 999 WHERE id = %s",
            (dead_letter_id,),
        )
    assert await _row(conn, dead_letter_id) == before


async def test_d5_trigger_refuses_delete(conn: psycopg.AsyncConnection[Any]) -> None:
    dead_letter_id = await _insert(conn)
    assert dead_letter_id is not None
    before = await _row(conn, dead_letter_id)
    with pytest.raises(errors.IntegrityConstraintViolation, match="DELETE is not allowed"):
        await conn.execute("DELETE FROM core.dead_letters WHERE id = %s", (dead_letter_id,))
    assert await _row(conn, dead_letter_id) == before


async def test_d5_trigger_refuses_truncate(conn: psycopg.AsyncConnection[Any]) -> None:
    dead_letter_id = await _insert(conn)
    assert dead_letter_id is not None
    with pytest.raises(errors.IntegrityConstraintViolation, match="TRUNCATE is not allowed"):
        await conn.execute("TRUNCATE core.dead_letters")
    assert await _count(conn) == 1


async def test_d5_trigger_refuses_illegal_status_transitions(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    rows: dict[str, int] = {}
    for index, status in enumerate(("pending_review", "replayed", "discarded")):
        dead_letter_id = await _insert(conn, job_id=f"job-{index}")
        assert dead_letter_id is not None
        if status != "pending_review":
            await _set_status(conn, dead_letter_id, status)
        rows[status] = dead_letter_id

    for start, target in ILLEGAL_TRANSITIONS:
        before = await _row(conn, rows[start])
        assert before["status"] == start
        with pytest.raises(errors.IntegrityConstraintViolation) as refused:
            await conn.execute(
                "UPDATE core.dead_letters SET status = %s, resolved_by = 'ops',"
                " discard_reason = CASE WHEN %s = 'discarded' THEN 'a reason' END,"
                " resolved_at = CASE WHEN %s = 'pending_review' THEN NULL ELSE now() END"
                " WHERE id = %s",
                (target, target, target, rows[start]),
            )
        expected = "cannot change" if start != "pending_review" else f"not to {target}"
        assert expected in str(refused.value), (start, target)
        assert await _row(conn, rows[start]) == before, (start, target)


async def test_d5_at_most_one_pending_review_row_per_job_and_consumer(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    first = await _insert(conn)
    assert first is not None
    before = await _row(conn, first)

    # A redelivered failure, through the harness's own query: a no-op, nothing overwritten.
    assert await _insert(conn) is None
    assert await _count(conn) == 1
    assert await _row(conn, first) == before

    # Bypassing the harness: the partial unique index refuses a second pending row.
    with pytest.raises(errors.UniqueViolation, match="dead_letters_one_pending_per_job"):
        await conn.execute(
            "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts,"
            " last_error, error_class) VALUES ('job-1', 'loyalty', 'award_points', '{}', 1,"
            " 'E: again', 'E')"
        )
    assert await _count(conn) == 1

    # The same job failing for another consumer is another dead letter.
    assert await _insert(conn, consumer="notify_customer") is not None
    assert await _count(conn) == 2


async def test_d5_after_replay_the_same_job_may_be_dead_lettered_again(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    first = await _insert(conn)
    assert first is not None
    await _set_status(conn, first, "replayed")

    second = await _insert(conn)

    assert second is not None and second != first
    cur = await conn.execute("SELECT id, status FROM core.dead_letters ORDER BY id")
    assert await cur.fetchall() == [(first, "replayed"), (second, "pending_review")]
