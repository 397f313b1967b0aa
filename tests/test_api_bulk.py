"""Bulk replay through the Ops API, over real HTTP: the fixed snapshot, dry run, max_items,
per-item results and progress, replays through the outbox, and a run killed mid-way then
resumed.

To hold a run in the middle deterministically, a test takes ``LOCK TABLE
jobfence_queue.messages IN SHARE MODE``: the run's next publish (an INSERT in its chunk
transaction) waits for it, visibly (``pg_stat_activity.wait_event_type = 'Lock'``).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from jobfence import MemoryQueue, ops
from jobfence.api import ApiSettings
from support import scalar, wait_until
from test_api_support import (
    PREFIX,
    SECRET,
    Api,
    ApiProcess,
    assert_problem,
    auth,
    dead_letter_row,
    insert_dead_letter,
    queued_job_ids,
    running_api,
    wait_bulk_finished,
)

BULK = f"{PREFIX}/replay-bulk"


@pytest.fixture
async def api(pool: AsyncConnectionPool[Any]) -> AsyncIterator[Api]:
    async with running_api(pool, settings=ApiSettings(jwt_secret=SECRET, bulk_chunk_size=3)) as a:
        yield a


@contextlib.asynccontextmanager
async def queue_locked(database_url: str) -> AsyncIterator[AsyncConnection[Any]]:
    """While inside, every publish to the PostgreSQL queue waits (and nothing else)."""
    locker = await AsyncConnection.connect(database_url)
    try:
        await locker.execute("LOCK TABLE jobfence_queue.messages IN SHARE MODE")
        yield locker
    finally:
        await locker.rollback()
        await locker.close()


async def wait_publish_blocked(conn: AsyncConnection[Any]) -> None:
    async def blocked() -> bool:
        waiting = await scalar(
            conn,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'",
        )
        return bool(waiting)

    await wait_until(blocked, timeout=15, message="the bulk replay to wait on its publish")


async def test_bulk_replay_dry_run_counts_the_pending_matches_and_changes_nothing(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    for i in range(5):
        await insert_dead_letter(conn, job_id=f"d-{i}", queue="dry")
    discarded = await insert_dead_letter(conn, job_id="d-x", queue="dry")
    await api.client.post(f"{PREFIX}/{discarded}/discard", json={"reason": "r"}, headers=auth())
    await insert_dead_letter(conn, job_id="e-1", queue="elsewhere")

    response = await api.client.post(BULK, json={"queue": "dry", "dry_run": True}, headers=auth())
    assert response.status_code == 200, response.text
    assert response.json() == {
        "dry_run": True,
        "matching": 5,
        "max_items": 10_000,
        "exceeds_max_items": False,
    }
    over = await api.client.post(
        BULK, json={"queue": "dry", "dry_run": True, "max_items": 4}, headers=auth()
    )
    assert over.json()["exceeds_max_items"] is True
    everything = await api.client.post(BULK, json={"dry_run": True, "all": True}, headers=auth())
    assert everything.json()["matching"] == 6
    assert await scalar(conn, "SELECT count(*) FROM jobfence.bulk_replays") == 0
    assert await queued_job_ids(conn) == []


async def _bulk_state(conn: AsyncConnection[Any]) -> tuple[Any, ...]:
    statuses = await conn.execute("SELECT id, status FROM core.dead_letters ORDER BY id")
    return (
        await statuses.fetchall(),
        await scalar(conn, "SELECT count(*) FROM jobfence.bulk_replays"),
        await queued_job_ids(conn),
    )


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({}, ops.BULK_ALL_NEEDED),
        ({"dry_run": True}, ops.BULK_ALL_NEEDED),
        ({"all": False, "max_items": 10}, ops.BULK_ALL_NEEDED),
        ({"all": True, "queue": "everything"}, ops.BULK_ALL_WITH_FILTER),
        ({"all": True, "dry_run": True, "created_from": "2026-01-01"}, ops.BULK_ALL_WITH_FILTER),
    ],
    ids=["empty", "dry-run", "all-false", "all-and-queue", "dry-run-all-and-date"],
)
async def test_bulk_replay_of_everything_needs_all_and_no_filter_else_422_and_nothing_changes(
    api: Api, conn: AsyncConnection[Any], body: dict[str, Any], says: str
) -> None:
    await insert_dead_letter(conn, job_id="ok-1", queue="everything")
    await insert_dead_letter(conn, job_id="poison-1", queue="everything", error_class="Poison")
    before = await _bulk_state(conn)

    refused = await api.client.post(BULK, json=body, headers=auth())

    problem = assert_problem(refused, 422, type="urn:jobfence:problem:validation")
    assert problem["detail"] == says
    assert "--all" not in problem["detail"]  # the API's words: its body field, not a flag
    assert await _bulk_state(conn) == before


async def test_bulk_replay_with_all_replays_every_pending_dead_letter(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    await insert_dead_letter(conn, job_id="ok-1", queue="a")
    await insert_dead_letter(conn, job_id="poison-1", queue="b", error_class="Poison")

    counted = await api.client.post(BULK, json={"all": True, "dry_run": True}, headers=auth())
    assert counted.json()["matching"] == 2
    started = await api.client.post(BULK, json={"all": True}, headers=auth())
    assert started.status_code == 202, started.text
    finished = await wait_bulk_finished(api, started.json()["id"])
    assert finished["counts"]["replayed"] == 2
    assert sorted(await queued_job_ids(conn)) == ["ok-1", "poison-1"]


async def test_bulk_replay_over_max_items_is_422_with_the_matching_count_and_takes_nothing(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    for i in range(5):
        await insert_dead_letter(conn, job_id=f"m-{i}", queue="max")

    refused = await api.client.post(BULK, json={"queue": "max", "max_items": 4}, headers=auth())

    problem = assert_problem(
        refused, 422, type="urn:jobfence:problem:bulk-too-large", matching=5, max_items=4
    )
    assert "5 pending dead letters match" in problem["detail"]
    assert await scalar(conn, "SELECT count(*) FROM jobfence.bulk_replays") == 0
    assert (
        await scalar(
            conn, "SELECT count(*) FROM core.dead_letters WHERE status <> 'pending_review'"
        )
        == 0
    )
    accepted = await api.client.post(BULK, json={"queue": "max", "max_items": 5}, headers=auth())
    assert accepted.status_code == 202, accepted.text
    assert accepted.json()["total"] == 5


@pytest.mark.parametrize(
    "body",
    [
        '{"max_items": 0}',
        '{"max_items": 1000001}',
        '{"status": "replayed"}',
        '{"dry_run": "maybe"}',
        '{"dry_run": "true", "queue": "x"}',
        '{"max_items": "5"}',
        '{"max_items": 5.0}',
        '{"created_to": -3.78e-32}',
        '{"created_from": "2026-13-01"}',
        '{"created_from": 1767225600}',
        '{"all": "yes"}',
        '{"all": 1}',
        '{"queue": "q\\u0000"}',
        '{"queue": "\\ud800"}',
        '{"queue": ',
        "[]",
    ],
)
async def test_bulk_replay_refuses_an_invalid_request_with_a_422_problem(
    api: Api, conn: AsyncConnection[Any], body: str
) -> None:
    response = await api.client.post(
        BULK, content=body, headers={**auth(), "Content-Type": "application/json"}
    )
    assert_problem(response, 422, type="urn:jobfence:problem:validation")
    assert await scalar(conn, "SELECT count(*) FROM jobfence.bulk_replays") == 0


async def test_bulk_replay_takes_a_fixed_snapshot_a_failure_arriving_during_the_run_stays_pending(
    api: Api, conn: AsyncConnection[Any], database_url: str
) -> None:
    ids = [await insert_dead_letter(conn, job_id=f"s-{i}", queue="snap") for i in range(12)]
    other = await insert_dead_letter(conn, job_id="o-1", queue="other")

    async with queue_locked(database_url):
        started = await api.client.post(BULK, json={"queue": "snap"}, headers=auth(sub="ops-1"))
        assert started.status_code == 202, started.text
        run = started.json()
        assert started.headers["location"] == f"{BULK}/{run['id']}"
        assert (run["total"], run["status"], run["active"]) == (12, "running", True)
        assert run["counts"]["pending"] == 12
        assert run["filter"] == {"queue": "snap", "status": "pending_review"}
        assert run["requested_by"] == "ops-1"
        await wait_publish_blocked(conn)

        # A new failure matching the filter arrives while the run is in progress.
        late = await insert_dead_letter(conn, job_id="s-late", queue="snap")
        progress = (await api.client.get(started.headers["location"], headers=auth())).json()
        assert (progress["status"], progress["active"]) == ("running", True)
        assert progress["counts"]["pending"] == 12

    done = await wait_bulk_finished(api, run["id"])
    assert done["total"] == 12
    assert done["counts"] == {
        "replayed": 12,
        "already_processed": 0,
        "not_pending": 0,
        "failed": 0,
        "pending": 0,
    }
    assert done["finished_at"] is not None
    items = (await api.client.get(f"{BULK}/{run['id']}/items", headers=auth())).json()
    assert [item["dead_letter_id"] for item in items["items"]] == ids
    assert (await dead_letter_row(conn, late))["status"] == "pending_review"
    assert (await dead_letter_row(conn, other))["status"] == "pending_review"
    assert sorted(await queued_job_ids(conn)) == sorted(f"s-{i}" for i in range(12))
    assert {(await dead_letter_row(conn, i))["resolved_by"] for i in ids} == {"ops-1"}


async def test_bulk_replay_reports_each_items_result_with_paging_and_a_result_filter(
    api: Api, conn: AsyncConnection[Any], database_url: str
) -> None:
    """replayed, already_processed (its fence row exists: no republish) and not_pending (it
    was discarded after the snapshot), with the counts that sum them up."""
    ids = {
        name: await insert_dead_letter(conn, job_id=f"r-{name}", queue="res")
        for name in ("a", "b", "c", "d", "e", "f")
    }
    await conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('r-b', 'award_points', now() + interval '1 day')"
    )
    async with queue_locked(database_url):
        started = await api.client.post(BULK, json={"queue": "res"}, headers=auth())
        assert started.status_code == 202
        run_id = started.json()["id"]
        await wait_publish_blocked(conn)  # holding a, b, c (one chunk of 3)
        discard = await api.client.post(
            f"{PREFIX}/{ids['e']}/discard", json={"reason": "handled by hand"}, headers=auth()
        )
        assert discard.status_code == 200, discard.text

    done = await wait_bulk_finished(api, run_id)
    assert done["counts"] == {
        "replayed": 4,
        "already_processed": 1,
        "not_pending": 1,
        "failed": 0,
        "pending": 0,
    }

    async def items(**params: Any) -> dict[str, Any]:
        response = await api.client.get(f"{BULK}/{run_id}/items", params=params, headers=auth())
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    everything = await items()
    results = {item["dead_letter_id"]: item["result"] for item in everything["items"]}
    assert results == {
        ids["a"]: "replayed",
        ids["b"]: "already_processed",
        ids["c"]: "replayed",
        ids["d"]: "replayed",
        ids["e"]: "not_pending",
        ids["f"]: "replayed",
    }
    assert everything["next_after"] is None
    [skipped] = (await items(result="not_pending"))["items"]
    assert skipped["detail"] == "status is discarded"
    assert [i["dead_letter_id"] for i in (await items(result="already_processed"))["items"]] == [
        ids["b"]
    ]
    assert (await items(result="pending"))["items"] == []

    paged: list[int] = []
    after = 0
    while True:
        page = await items(limit=2, after=after)
        paged.extend(item["dead_letter_id"] for item in page["items"])
        if page["next_after"] is None:
            break
        after = page["next_after"]
    assert paged == sorted(ids.values())

    assert sorted(await queued_job_ids(conn)) == ["r-a", "r-c", "r-d", "r-f"]
    assert (await dead_letter_row(conn, ids["b"]))["status"] == "replayed"


# The database refuses the outbox insert of one job: a real failure inside the transaction.
REFUSE_OUTBOX = """
CREATE FUNCTION refuse_f1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'outbox refuses %', NEW.job_id; END $$;
CREATE TRIGGER refuse_f1 BEFORE INSERT ON jobfence.outbox
FOR EACH ROW WHEN (NEW.job_id = 'f-1') EXECUTE FUNCTION refuse_f1();
"""


async def _outbox_job_ids(conn: AsyncConnection[Any]) -> list[str]:
    cur = await conn.execute("SELECT job_id FROM jobfence.outbox ORDER BY job_id")
    return [row[0] for row in await cur.fetchall()]


async def test_replay_on_an_external_broker_writes_the_outbox_with_the_status_change(
    pool: AsyncConnectionPool[Any], conn: AsyncConnection[Any]
) -> None:
    """With a broker (not transactional) replays write outbox rows in the transaction that
    marks them replayed; an outbox insert the database refuses rolls its replay back (single:
    a 5xx problem; bulk: the whole chunk, resumable), so no row is replayed without its
    message."""
    ids = [await insert_dead_letter(conn, job_id=f"f-{i}", queue="fail") for i in range(5)]
    await conn.execute(REFUSE_OUTBOX)
    broker = MemoryQueue()
    async with running_api(pool, queue=broker) as api:
        single = await api.client.post(f"{PREFIX}/{ids[1]}/replay", headers=auth())
        assert_problem(single, 500, type="urn:jobfence:problem:internal")
        assert "outbox" not in single.text
        ok = await api.client.post(f"{PREFIX}/{ids[0]}/replay", headers=auth())
        assert ok.status_code == 200, ok.text

        started = await api.client.post(BULK, json={"queue": "fail"}, headers=auth())
        assert started.status_code == 202
        run_id = started.json()["id"]

        async def stopped() -> bool:
            return not api.app.state.jobfence.bulk.active(run_id)

        await wait_until(stopped, message="the bulk run to stop on the refused insert")
        statuses = [(await dead_letter_row(conn, i))["status"] for i in ids]
        assert statuses == ["replayed"] + ["pending_review"] * 4
        assert await _outbox_job_ids(conn) == ["f-0"]

        await conn.execute("DROP TRIGGER refuse_f1 ON jobfence.outbox")
        resumed = await api.client.post(f"{BULK}/{run_id}/resume", headers=auth())
        assert resumed.status_code == 202, resumed.text
        done = await wait_bulk_finished(api, run_id)
        assert done["counts"]["replayed"] == 4

    assert await _outbox_job_ids(conn) == ["f-0", "f-1", "f-2", "f-3", "f-4"]
    assert (await broker.size(["fail"])).total == 0  # the relay publishes, not the API
    statuses = [(await dead_letter_row(conn, i))["status"] for i in ids]
    assert statuses == ["replayed"] * 5


async def test_unknown_bulk_replay_is_404_and_resuming_a_finished_one_is_409(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    for path, method in (
        (f"{BULK}/4242", "GET"),
        (f"{BULK}/4242/items", "GET"),
        (f"{BULK}/4242/resume", "POST"),
    ):
        response = await api.client.request(method, path, headers=auth())
        assert_problem(response, 404, type="urn:jobfence:problem:not-found")

    await insert_dead_letter(conn, job_id="fin-1", queue="fin")
    started = await api.client.post(BULK, json={"queue": "fin"}, headers=auth())
    await wait_bulk_finished(api, started.json()["id"])
    again = await api.client.post(f"{BULK}/{started.json()['id']}/resume", headers=auth())
    assert_problem(again, 409, type="urn:jobfence:problem:bulk-replay-finished")
    assert again.json()["current_status"] == "finished"


async def test_resume_runs_a_run_nobody_is_working_on_to_the_end(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    for i in range(7):
        await insert_dead_letter(conn, job_id=f"n-{i}", queue="idle")
    run = await ops.start_bulk_replay(
        api.pool, ops.DeadLetterFilter(queue="idle"), requested_by="someone-else"
    )
    assert isinstance(run, ops.BulkReplay)
    shown = (await api.client.get(f"{BULK}/{run.id}", headers=auth())).json()
    assert (shown["status"], shown["active"], shown["counts"]["pending"]) == ("running", False, 7)

    resumed = await api.client.post(f"{BULK}/{run.id}/resume", headers=auth(sub="resumer"))

    assert resumed.status_code == 202, resumed.text
    assert resumed.headers["location"] == f"{BULK}/{run.id}"
    done = await wait_bulk_finished(api, run.id)
    assert done["counts"]["replayed"] == 7
    assert len(await queued_job_ids(conn)) == 7
    assert (
        await scalar(conn, "SELECT count(*) FROM core.dead_letters WHERE resolved_by = 'resumer'")
        == 7
    )


async def test_bulk_replay_killed_mid_run_leaves_rows_replayed_and_queued_or_pending_then_resumes(
    database_url: str, tmp_path: Path, pool: AsyncConnectionPool[Any], conn: AsyncConnection[Any]
) -> None:
    """``jobfence api`` in a subprocess, one dead letter per transaction; SIGKILL while a
    chunk is in flight. Every item is then either replayed with its message in the queue, or
    pending with no message; a resume through another API process finishes the run."""
    total = 1000
    await conn.execute(
        "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts, last_error,"
        " error_class) SELECT 'k-' || i, 'kill', 'award_points', jsonb_build_object('i', i), 1,"
        " 'e', 'E' FROM generate_series(1, %s) AS i",
        (total,),
    )
    victim_url = f"{database_url} application_name=jobfence-api-victim"
    proc = ApiProcess(victim_url, tmp_path, "--bulk-chunk-size", "1")
    try:
        base_url = await proc.base_url()
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            started = await client.post(BULK, json={"queue": "kill"}, headers=auth())
            assert started.status_code == 202, started.text
            run_id = started.json()["id"]

            async def some_done() -> bool:
                progress = await client.get(f"{BULK}/{run_id}", headers=auth())
                return bool(progress.json()["counts"]["replayed"] >= 5)

            await wait_until(some_done, timeout=30, message="the run to make progress")
            async with queue_locked(database_url):
                await wait_publish_blocked(conn)  # a chunk is in flight, holding its rows
                progress = (await client.get(f"{BULK}/{run_id}", headers=auth())).json()
                assert progress["counts"]["pending"] > 0, "the run finished before the kill"
                assert progress["active"] is True
                proc.proc.send_signal(signal.SIGKILL)
                assert await proc.wait_exit() == -signal.SIGKILL
    finally:
        proc.cleanup()

    async def victim_gone() -> bool:
        left = await scalar(
            conn,
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'jobfence-api-victim'",
        )
        return left == 0

    await wait_until(victim_gone, timeout=15, message="the killed API's sessions to end")

    cur = await conn.execute(
        "SELECT d.status, i.result,"
        " (SELECT count(*) FROM jobfence_queue.messages m WHERE m.job_id = d.job_id)"
        " FROM jobfence.bulk_replay_items i JOIN core.dead_letters d ON d.id = i.dead_letter_id"
        " WHERE i.bulk_replay_id = %s",
        (run_id,),
    )
    states = {tuple(row) for row in await cur.fetchall()}
    assert states == {("replayed", "replayed", 1), ("pending_review", None, 0)}, states
    assert await scalar(conn, "SELECT status FROM jobfence.bulk_replays") == "running"

    async with running_api(pool) as api:
        shown = (await api.client.get(f"{BULK}/{run_id}", headers=auth())).json()
        assert (shown["status"], shown["active"]) == ("running", False)
        resumed = await api.client.post(f"{BULK}/{run_id}/resume", headers=auth())
        assert resumed.status_code == 202, resumed.text
        done = await wait_bulk_finished(api, run_id)

    assert done["counts"]["replayed"] == total
    assert done["total"] == total
    cur = await conn.execute(
        "SELECT count(*), count(DISTINCT job_id) FROM jobfence_queue.messages WHERE queue = 'kill'"
    )
    assert await cur.fetchone() == (total, total)
    assert (
        await scalar(conn, "SELECT count(*) FROM core.dead_letters WHERE status = 'replayed'")
        == total
    )


async def test_api_shutdown_interrupts_a_bulk_run_which_stays_resumable(
    pool: AsyncConnectionPool[Any], conn: AsyncConnection[Any], database_url: str
) -> None:
    for i in range(9):
        await insert_dead_letter(conn, job_id=f"x-{i}", queue="stop")
    settings = ApiSettings(jwt_secret=SECRET, bulk_chunk_size=2)
    async with queue_locked(database_url), running_api(pool, settings=settings) as api:
        started = await api.client.post(BULK, json={"queue": "stop"}, headers=auth())
        run_id = started.json()["id"]
        await wait_publish_blocked(conn)
        # The server stopped (its lifespan cancelled the run) while the publish was waiting.

    states = await conn.execute(
        "SELECT count(*) FILTER (WHERE result IS NULL) FROM jobfence.bulk_replay_items"
    )
    assert await states.fetchone() == (9,)
    assert await queued_job_ids(conn) == []
    async with conn.transaction():  # NOWAIT: raises if the cancelled run still held a row
        await conn.execute("SELECT 1 FROM core.dead_letters FOR UPDATE NOWAIT")
    async with running_api(pool, settings=settings) as api:
        await api.client.post(f"{BULK}/{run_id}/resume", headers=auth())
        done = await wait_bulk_finished(api, run_id)
    assert done["counts"]["replayed"] == 9
