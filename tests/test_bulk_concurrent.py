"""Bulk replays running at once over the same dead letters, over real HTTP and with the real
CLI: every run reaches ``finished`` on its own, each of its items accounted for, and every dead
letter is replayed exactly once.

A run takes its items with ``SKIP LOCKED``; when all it has left are rows another transaction
holds (another run's chunk), it waits for them and counts them as that transaction left them.
To hold the rows deterministically a test locks them itself (``SELECT ... FOR UPDATE``), sees
each run wait (``pg_stat_activity.wait_event_type = 'Lock'``), then lets them go.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from jobfence import PgQueue, ops
from jobfence.api import ApiSettings
from support import scalar, wait_until
from test_api_support import (
    PREFIX,
    SECRET,
    Api,
    auth,
    insert_dead_letter,
    queued_job_ids,
    running_api,
    wait_bulk_finished,
)

BULK = f"{PREFIX}/replay-bulk"
RESULTS = ("replayed", "already_processed", "not_pending", "failed")


@pytest.fixture
async def api(pool: AsyncConnectionPool[Any]) -> AsyncIterator[Api]:
    async with running_api(pool, settings=ApiSettings(jwt_secret=SECRET, bulk_chunk_size=3)) as a:
        yield a


async def seed(conn: AsyncConnection[Any]) -> dict[str, int]:
    """37 pending dead letters over two queues and two error classes: job_id -> id."""
    ids: dict[str, int] = {}
    for i in range(37):
        job_id = f"cc-{i:02d}"
        ids[job_id] = await insert_dead_letter(
            conn,
            job_id=job_id,
            queue="cc-a" if i % 2 else "cc-b",
            error_class="Flaky" if i % 3 else "Timeout",
        )
    return ids


async def waiting_on_locks(conn: AsyncConnection[Any]) -> int:
    return int(
        await scalar(
            conn,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'",
        )
    )


async def assert_each_replayed_once(conn: AsyncConnection[Any], ids: dict[str, int]) -> None:
    queued = Counter(await queued_job_ids(conn))
    assert queued == dict.fromkeys(ids, 1), queued
    pending = await scalar(
        conn, "SELECT count(*) FROM core.dead_letters WHERE status = 'pending_review'"
    )
    assert pending == 0
    cur = await conn.execute(
        "SELECT dead_letter_id, count(*) FROM jobfence.bulk_replay_items"
        " WHERE result = 'replayed' GROUP BY 1"
    )
    assert dict(await cur.fetchall()) == dict.fromkeys(ids.values(), 1)


def assert_accounted(run: dict[str, Any]) -> None:
    counts = run["counts"]
    assert (run["status"], counts["pending"]) == ("finished", 0), run
    assert sum(counts[r] for r in RESULTS) == run["total"], run
    assert counts["failed"] == 0, run


FILTERS = [
    {"queue": "cc-a"},
    {"error_class": "Flaky"},
    {"consumer": "award_points"},
    {"all": True},
    {"queue": "cc-b"},
]


async def test_concurrent_bulk_replays_over_overlapping_filters_all_finish_each_item_once(
    api: Api, conn: AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Five POSTs at once (chunks of 3): every run ends ``finished`` with pending 0 on its own,
    and each dead letter is replayed by exactly one of them (``not_pending`` in the others)."""
    ids = await seed(conn)
    with caplog.at_level(logging.ERROR, logger="jobfence"):
        responses = await asyncio.gather(
            *(api.client.post(BULK, json=body, headers=auth()) for body in FILTERS)
        )
        assert [r.status_code for r in responses] == [202] * len(FILTERS), responses
        runs = [await wait_bulk_finished(api, r.json()["id"], timeout=60) for r in responses]
    for run in runs:
        assert_accounted(run)
    assert sum(run["counts"]["replayed"] for run in runs) == len(ids)
    await assert_each_replayed_once(conn, ids)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_bulk_replays_wait_for_dead_letters_another_transaction_holds_then_finish(
    api: Api, conn: AsyncConnection[Any], database_url: str
) -> None:
    """Every dead letter locked by another transaction when the runs start: none finds a row
    it can take at once, and none stops there; each waits, then finishes. What that
    transaction did to them stands: the two it discarded are ``not_pending`` everywhere."""
    ids = await seed(conn)
    locker = await AsyncConnection.connect(database_url)
    try:
        await locker.execute("SELECT id FROM core.dead_letters FOR UPDATE")
        await locker.execute(
            "UPDATE core.dead_letters SET status = 'discarded', discard_reason = 'by hand',"
            " resolved_at = now(), resolved_by = 'hand' WHERE job_id IN ('cc-00', 'cc-01')"
        )
        responses = await asyncio.gather(
            *(api.client.post(BULK, json=body, headers=auth()) for body in FILTERS)
        )
        assert [r.status_code for r in responses] == [202] * len(FILTERS)

        async def all_waiting() -> bool:
            return await waiting_on_locks(conn) >= len(FILTERS)

        await wait_until(all_waiting, timeout=30, message="every run to wait on the locked rows")
        for r in responses:  # still running, nothing taken
            shown = (await api.client.get(f"{BULK}/{r.json()['id']}", headers=auth())).json()
            assert (shown["status"], shown["active"]) == ("running", True), shown
        await locker.commit()
    finally:
        await locker.close()

    runs = [await wait_bulk_finished(api, r.json()["id"], timeout=60) for r in responses]
    for run in runs:
        assert_accounted(run)
    for job_id in ("cc-00", "cc-01"):
        cur = await conn.execute(
            "SELECT DISTINCT result FROM jobfence.bulk_replay_items WHERE dead_letter_id = %s",
            (ids[job_id],),
        )
        assert [r[0] for r in await cur.fetchall()] == ["not_pending"]
    live = {job_id: i for job_id, i in ids.items() if job_id not in ("cc-00", "cc-01")}
    assert sum(run["counts"]["replayed"] for run in runs) == len(live)
    assert Counter(await queued_job_ids(conn)) == dict.fromkeys(live, 1)


def replay_bulk_process(url: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "JOBFENCE_DATABASE_URL": url, "JOBFENCE_ACTOR": "cli-test"}
    return subprocess.Popen(
        [sys.executable, "-m", "jobfence.cli", "dead-letters", "replay-bulk", "--json", *args],
        env=env,
        cwd=Path(__file__).parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_concurrent_cli_bulk_replays_all_finish_and_replay_each_dead_letter_once(
    conn: AsyncConnection[Any], database_url: str
) -> None:
    """Four ``jobfence dead-letters replay-bulk`` processes at once over overlapping filters,
    the rows held by another transaction as they start: each exits 0 with its run finished."""
    ids = await seed(conn)
    locker = await AsyncConnection.connect(database_url)
    procs: list[subprocess.Popen[str]] = []
    try:
        await locker.execute("SELECT id FROM core.dead_letters FOR UPDATE")
        for args in (["--queue", "cc-a"], ["--error-class", "Flaky"], ["--all"], ["--all"]):
            procs.append(replay_bulk_process(database_url, *args))

        async def all_waiting() -> bool:
            if any(p.poll() is not None for p in procs):
                raise AssertionError(
                    "a replay-bulk exited while the rows were locked:\n"
                    + "\n".join(p.communicate()[1] for p in procs if p.poll() is not None)
                )
            return await waiting_on_locks(conn) >= len(procs)

        await wait_until(all_waiting, timeout=60, message="every process to wait on the rows")
        await locker.commit()
        outputs = [await asyncio.to_thread(p.communicate, timeout=60) for p in procs]
    finally:
        await locker.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()  # reaped, its pipes closed
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
        doc = json.loads(out)
        assert doc["finished"] is True, doc
        assert_accounted(doc["run"])
    await assert_each_replayed_once(conn, ids)


async def test_a_bulk_replay_that_stops_without_finishing_is_an_error_naming_how_to_resume(
    pool: AsyncConnectionPool[Any], conn: AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A publish that fails stops the run: ERROR, with the run id and the resume command."""
    await seed(conn)
    run = await ops.start_bulk_replay(pool, ops.DeadLetterFilter(queue="cc-a"), requested_by="x")
    assert isinstance(run, ops.BulkReplay)

    class FailingQueue(PgQueue):
        async def publish(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("the broker said no")

    queue = FailingQueue(pool)
    try:
        with (
            caplog.at_level(logging.ERROR, logger="jobfence.ops"),
            pytest.raises(RuntimeError, match="the broker said no"),
        ):
            await ops.run_bulk_replay(pool, queue, run.id, actor="x")
    finally:
        await queue.close()
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage().startswith(f"bulk replay {run.id} stopped without finishing ("), (
        record.getMessage()
    )
    assert f"jobfence dead-letters replay-bulk --resume {run.id}" in record.getMessage()
    assert f"POST /v1/core/dead-letters/replay-bulk/{run.id}/resume" in record.getMessage()
