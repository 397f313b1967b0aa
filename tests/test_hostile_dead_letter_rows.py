"""A dead letter or bulk-replay item some role wrote by hand never stops the others.

The worker, relay and owner roles may INSERT any column of ``core.dead_letters``, and the ops
role may INSERT ``jobfence.bulk_replay_items`` (it has no foreign key). A row that breaks what
jobfence writes is one clear refusal or one failed item, and everything beside it goes on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg import errors
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from jobfence import PgQueue, ops
from jobfence.alerts import record_dead_letter_alerts
from jobfence.ops import DeadLetterFilter
from support import run_jobfence, scalar
from test_api_support import PREFIX, assert_problem, auth, running_api

INSERT_DL = (
    "INSERT INTO core.dead_letters (job_id, queue, consumer, tenant_id, payload,"
    " payload_encoding, attempts, last_error, error_class)"
    " VALUES (%s, 'loyalty', 'award_points', 't1', %s, %s, 6, 'Flaky: it failed', 'Flaky')"
    " RETURNING id"
)
MALFORMED = [
    pytest.param({"note": "no data"}, "base64", "its data is not a base64 string", id="no-data"),
    pytest.param({"data": "%%%"}, "base64", "its data is not valid base64", id="bad-base64"),
    pytest.param([1, 2, 3], "base64", "is a JSON object, not list", id="an-array"),
    pytest.param({"data": "e30="}, "message", 'has no "message" object', id="no-message"),
]


async def _dl(
    conn: psycopg.AsyncConnection[Any], job_id: str, payload: Any = None, encoding: str = "json"
) -> int:
    body = {"account_id": 1, "points": 5} if payload is None else payload
    return int(await scalar(conn, INSERT_DL, (job_id, Jsonb(body), encoding)))


@pytest.mark.parametrize(("payload", "encoding", "says"), MALFORMED)
async def test_a_bulk_replay_fails_a_dead_letter_whose_payload_is_not_its_encoding_and_goes_on(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    payload: Any,
    encoding: str,
    says: str,
) -> None:
    """Before, the run stopped at that dead letter (KeyError, binascii.Error), and every
    resume stopped at the same chunk: the good dead letters beside it were never replayed."""
    good_before = await _dl(conn, "good-1")
    bad = await _dl(conn, "bad", payload, encoding)
    good_after = await _dl(conn, "good-2")
    queue = PgQueue(pool)
    try:
        run = await ops.start_bulk_replay(
            pool, DeadLetterFilter(queue="loyalty"), requested_by="ops"
        )
        finished = await asyncio.wait_for(ops.run_bulk_replay(pool, queue, run.id, actor="ops"), 30)
    finally:
        await queue.close()
    assert finished.status == "finished"
    cur = await conn.execute("SELECT id, status FROM core.dead_letters")
    statuses = dict(await cur.fetchall())
    assert statuses == {good_before: "replayed", bad: "pending_review", good_after: "replayed"}
    cur = await conn.execute(
        "SELECT result, detail FROM jobfence.bulk_replay_items WHERE dead_letter_id = %s", (bad,)
    )
    [(result, detail)] = await cur.fetchall()
    assert result == "failed"
    assert detail.startswith(
        f"dead letter {bad} cannot be replayed: its payload is not what its payload_encoding"
    ), detail
    assert says in detail


@pytest.mark.parametrize(("payload", "encoding", "says"), MALFORMED)
async def test_the_replay_and_show_of_a_dead_letter_whose_payload_is_not_its_encoding_say_why(  # noqa: PLR0917
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    database_url: str,
    payload: Any,
    encoding: str,
    says: str,
) -> None:
    """The API's replay is a 409 naming the reason (it was a 500), and ``dead-letters show``
    prints the payload as stored with the reason (it was a traceback)."""
    bad = await _dl(conn, "bad", payload, encoding)
    async with running_api(pool) as api:
        replay = await api.client.post(f"{PREFIX}/{bad}/replay", headers=auth())
        problem = assert_problem(
            replay, 409, type="urn:jobfence:problem:not-replayable", current_status="pending_review"
        )
        assert says in problem["detail"], problem
    assert await scalar(conn, "SELECT status FROM core.dead_letters") == "pending_review"
    done = await asyncio.to_thread(run_jobfence, database_url, "dead-letters", "show", str(bad))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    if encoding == "base64":
        assert "not what its payload_encoding 'base64' says: " in done.stdout
        assert says in done.stdout


async def test_a_bulk_replay_item_that_names_no_dead_letter_is_failed_and_the_run_finishes(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    """An item the ops role wrote for a dead letter that does not exist: before, the run
    looked for it for ever (a tight loop of round trips), and never finished."""
    good = await _dl(conn, "good-1")
    run = await ops.start_bulk_replay(pool, DeadLetterFilter(queue="loyalty"), requested_by="ops")
    await conn.execute(
        "INSERT INTO jobfence.bulk_replay_items (bulk_replay_id, dead_letter_id)"
        " VALUES (%s, 999999)",
        (run.id,),
    )
    queue = PgQueue(pool)
    try:
        finished = await asyncio.wait_for(ops.run_bulk_replay(pool, queue, run.id, actor="ops"), 30)
    finally:
        await queue.close()
    assert finished.status == "finished"
    cur = await conn.execute(
        "SELECT dead_letter_id, result, detail FROM jobfence.bulk_replay_items ORDER BY 1"
    )
    assert await cur.fetchall() == [
        (good, "replayed", None),
        (999999, "failed", "no dead letter has this id"),
    ]


@pytest.mark.parametrize(
    "created_at",
    [
        "294276-01-01 00:00:00+00",
        "4713-01-01 00:00:00+00 BC",
        "10000-01-01 00:00:00+00",
        "2100-01-01",
    ],
    ids=["end-of-postgresql", "before-year-1", "past-year-9999", "in-2100"],
)
async def test_a_dead_letter_dated_where_no_reader_could_follow_is_refused_even_from_a_superuser(
    conn: psycopg.AsyncConnection[Any], created_at: str
) -> None:
    """Before, one such row made every ``jobfence dead-letters list`` fail (Python's dates end
    at 9999), made the API's pages loop (a BC date rendered without its era) or fail, made the
    alert relay fail every round for every key (near the end of the range), or (2100) opened
    an alert group whose window ended then, which every later dead letter of its key joined,
    none paged. Now the table refuses it, as it refuses a status it does not know."""
    assert await scalar(conn, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    with pytest.raises(errors.CheckViolation, match="dead_letters_created_at_check"):
        await conn.execute(
            "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts,"
            " last_error, error_class, created_at) VALUES ('odd', 'loyalty', 'award_points',"
            " '{}', 1, 'Hard: x', 'Hard', %s::timestamptz)",
            (created_at,),
        )
    # A dead letter written now, or dated back (an import of older ones), is taken, alert and all.
    for when in ("now()", "'2001-01-01'"):
        dl_id = await scalar(
            conn,
            "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts,"
            f" last_error, error_class, created_at) VALUES ('fine-' || {when}::text, 'loyalty',"
            f" 'award_points', '{{}}', 1, 'Hard: x', 'Hard', {when}) RETURNING id",
        )
        await record_dead_letter_alerts(conn, [int(dl_id)])
    with pytest.raises(errors.CheckViolation, match="alert_outbox_created_at_check"):
        await conn.execute(
            "INSERT INTO jobfence.alert_outbox (dead_letter_id, queue, consumer, error_class,"
            " created_at) VALUES (999, 'loyalty', 'award_points', 'Hard', %s::timestamptz)",
            (created_at,),
        )


async def test_the_date_checks_stay_not_valid_with_a_warning_when_a_row_already_breaks_them(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """``jobfence migrate`` on a database that already holds such a dead letter does not fail
    the deploy: the check stays NOT VALID (new rows are still checked), with its WARNING."""
    await conn.execute(
        "ALTER TABLE core.dead_letters DROP CONSTRAINT dead_letters_created_at_check;"
        " ALTER TABLE jobfence.alert_outbox DROP CONSTRAINT alert_outbox_created_at_check;"
        " DELETE FROM jobfence.schema_migrations WHERE version = 25"
    )
    await conn.execute(
        "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts, last_error,"
        " error_class, created_at) VALUES ('old', 'loyalty', 'award_points', '{}', 1, 'x', 'X',"
        " '2100-01-01')"
    )
    result = await asyncio.to_thread(run_jobfence, database_url, "migrate")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "applied 0025_dead_letter_dates\n"
    assert (
        "WARNING jobfence.schema: jobfence: core.dead_letters holds rows whose created_at is"
        " before year 1 or more than a day ahead: check dead_letters_created_at_check stays NOT"
        " VALID (new and updated rows are checked); validate it once they are gone"
    ) in result.stderr
    cur = await conn.execute(
        "SELECT conname, convalidated FROM pg_constraint WHERE conname IN"
        " ('dead_letters_created_at_check', 'alert_outbox_created_at_check') ORDER BY conname"
    )
    assert await cur.fetchall() == [
        ("alert_outbox_created_at_check", True),
        ("dead_letters_created_at_check", False),
    ]
