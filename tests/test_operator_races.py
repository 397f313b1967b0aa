"""Operators (and their scripts) acting on the same dead letters at once, over real HTTP, with
the real CLI, on a real PostgreSQL: whoever loses a race gets a clear answer, each dead letter is
replayed at most once, and every bulk run finishes on its own.

Some databases are set to run every transaction at a stricter isolation level than PostgreSQL's
default (``ALTER DATABASE app SET default_transaction_isolation = 'serializable'``, for the
application's own code). jobfence's dead-letter operations pin the level they are written for,
so such a setting changes none of these answers. To order the racers deterministically a test
holds the rows itself (``SELECT ... FOR UPDATE``), sees each racer wait
(``pg_stat_activity.wait_event_type = 'Lock'``), then lets them go.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from psycopg import AsyncConnection, sql

from jobfence import open_pool
from jobfence.api import ApiSettings
from jobfence.schema import MIGRATION_LOCK_KEY, latest_version
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

LEVELS = ["serializable", "repeatable read"]
BULK = f"{PREFIX}/replay-bulk"


async def set_default_isolation(conn: AsyncConnection[Any], level: str) -> None:
    """The database's default isolation level for every new session (a DBA's setting)."""
    dbname = await scalar(conn, "SELECT current_database()")
    await conn.execute(
        sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = {}").format(
            sql.Identifier(dbname), sql.Literal(level)
        )
    )


@asynccontextmanager
async def api_on(database_url: str, *, chunk: int = 500) -> AsyncIterator[Api]:
    """The Ops API on a pool of its own, opened after the test set the database's defaults
    (a setting of the database applies to the sessions opened after it)."""
    pool = await open_pool(database_url)
    try:
        settings = ApiSettings(jwt_secret=SECRET, bulk_chunk_size=chunk)
        async with running_api(pool, settings=settings) as api:
            yield api
    finally:
        await pool.close()


async def waiting_on_locks(conn: AsyncConnection[Any]) -> int:
    return int(
        await scalar(
            conn,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'",
        )
    )


def jobfence_process(url: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "JOBFENCE_DATABASE_URL": url, "JOBFENCE_ACTOR": "bob (INC-7)"}
    return subprocess.Popen(
        [sys.executable, "-m", "jobfence.cli", *args],
        env=env,
        cwd=Path(__file__).parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("level", LEVELS)
async def test_an_api_replay_and_a_cli_discard_of_one_dead_letter_at_once_the_loser_gets_its_status(
    database_url: str, conn: AsyncConnection[Any], level: str
) -> None:
    """Alice replays dead letter N through the API while Bob discards it with the CLI. Exactly
    one of them wins, whatever isolation level the database defaults to; the other is told the
    dead letter is no longer pending (HTTP 409 / exit status 1 naming its status), never a
    database error, and the job is queued once if the replay won, not at all otherwise."""
    await set_default_isolation(conn, level)
    dl = await insert_dead_letter(conn, job_id="order-7:points")
    locker = await AsyncConnection.connect(database_url)
    proc: subprocess.Popen[str] | None = None
    try:
        async with api_on(database_url) as api:
            await locker.execute("SELECT 1 FROM core.dead_letters WHERE id = %s FOR UPDATE", (dl,))
            replay = asyncio.create_task(
                api.client.post(f"{PREFIX}/{dl}/replay", headers=auth(sub="alice (INC-7)"))
            )

            async def replay_waits() -> bool:
                return await waiting_on_locks(conn) >= 1

            await wait_until(replay_waits, timeout=30, message="the API replay to wait")
            proc = jobfence_process(
                database_url, "dead-letters", "discard", str(dl), "--reason", "sent by hand"
            )

            async def both_wait() -> bool:
                if proc is not None and proc.poll() is not None:
                    raise AssertionError(f"the discard exited early: {proc.communicate()}")
                return await waiting_on_locks(conn) >= 2

            await wait_until(both_wait, timeout=60, message="the CLI discard to wait too")
            await locker.commit()
            response = await replay
            out, err = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        await locker.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
    status = await scalar(conn, "SELECT status FROM core.dead_letters WHERE id = %s", (dl,))
    # The API asked first, so it takes the row first; the CLI finds it replayed.
    assert (response.status_code, status) == (200, "replayed"), response.text
    assert proc.returncode == 1, (out, err)
    assert err.strip() == f"jobfence: error: dead letter {dl} is replayed, not pending_review"
    assert Counter(await queued_job_ids(conn)) == {"order-7:points": 1}


@pytest.mark.parametrize("level", LEVELS)
async def test_two_api_replays_of_one_dead_letter_at_once_one_publishes_the_other_is_a_409(
    database_url: str, conn: AsyncConnection[Any], level: str
) -> None:
    """Two dashboards press replay on the same dead letter: one 200, one 409
    ``not-pending-review`` (never a 500), one job queued."""
    await set_default_isolation(conn, level)
    dl = await insert_dead_letter(conn, job_id="order-8:points")
    locker = await AsyncConnection.connect(database_url)
    try:
        async with api_on(database_url) as api:
            await locker.execute("SELECT 1 FROM core.dead_letters WHERE id = %s FOR UPDATE", (dl,))
            tasks = [
                asyncio.create_task(api.client.post(f"{PREFIX}/{dl}/replay", headers=auth()))
                for _ in range(2)
            ]

            async def both_wait() -> bool:
                return await waiting_on_locks(conn) >= 2

            await wait_until(both_wait, timeout=30, message="both replays to wait")
            await locker.commit()
            responses = await asyncio.gather(*tasks)
    finally:
        await locker.close()
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 409], [r.text for r in responses]
    [lost] = [r for r in responses if r.status_code == 409]
    assert lost.json()["type"] == "urn:jobfence:problem:not-pending-review", lost.text
    assert lost.json()["current_status"] == "replayed"
    assert Counter(await queued_job_ids(conn)) == {"order-8:points": 1}


@pytest.mark.parametrize("level", LEVELS)
async def test_bulk_replays_at_once_over_the_same_dead_letters_each_finish_and_replay_each_once(
    database_url: str, conn: AsyncConnection[Any], level: str
) -> None:
    """Three bulk replays over overlapping filters, started through the API while another
    transaction holds their dead letters: each run ends ``finished`` on its own, every item
    accounted for, and each dead letter is replayed by exactly one run, whatever isolation
    level the database defaults to."""
    await set_default_isolation(conn, level)
    ids = {}
    for i in range(12):
        job_id = f"bk-{i:02d}"
        ids[job_id] = await insert_dead_letter(
            conn, job_id=job_id, queue="bk-a" if i % 2 else "bk-b"
        )
    filters = [{"queue": "bk-a"}, {"consumer": "award_points"}, {"all": True}]
    locker = await AsyncConnection.connect(database_url)
    try:
        async with api_on(database_url, chunk=3) as api:
            await locker.execute("SELECT id FROM core.dead_letters FOR UPDATE")
            responses = await asyncio.gather(
                *(api.client.post(BULK, json=body, headers=auth()) for body in filters)
            )
            assert [r.status_code for r in responses] == [202] * len(filters), responses

            async def all_wait() -> bool:
                return await waiting_on_locks(conn) >= len(filters)

            await wait_until(all_wait, timeout=30, message="every run to wait on the rows")
            await locker.commit()
            runs = [await wait_bulk_finished(api, r.json()["id"], timeout=60) for r in responses]
    finally:
        await locker.close()
    for run in runs:
        counts = run["counts"]
        assert (run["status"], counts["pending"], counts["failed"]) == ("finished", 0, 0), run
        assert counts["replayed"] + counts["not_pending"] == run["total"], run
    assert sum(run["counts"]["replayed"] for run in runs) == len(ids)
    assert Counter(await queued_job_ids(conn)) == dict.fromkeys(ids, 1)


@pytest.mark.parametrize("level", LEVELS)
async def test_two_migrate_processes_at_once_one_applies_the_other_finds_it_up_to_date(
    empty_database_url: str, level: str
) -> None:
    """Two deploys run ``jobfence migrate`` at once on a database whose default isolation is
    stricter than READ COMMITTED: both exit 0, one applies every migration, the other waits for
    it on the lock and says the database is already up to date."""
    async with await AsyncConnection.connect(empty_database_url, autocommit=True) as conn:
        await set_default_isolation(conn, level)
        locker = await AsyncConnection.connect(empty_database_url)
        procs: list[subprocess.Popen[str]] = []
        try:
            await locker.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            procs = [jobfence_process(empty_database_url, "migrate") for _ in range(2)]

            async def both_wait() -> bool:
                if any(p.poll() is not None for p in procs):
                    raise AssertionError("a migrate exited while the lock was held")
                return await waiting_on_locks(conn) >= 2

            await wait_until(both_wait, timeout=60, message="both migrates to wait on the lock")
            await locker.commit()
            outputs = [await asyncio.to_thread(p.communicate, timeout=60) for p in procs]
        finally:
            await locker.close()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    assert [p.returncode for p in procs] == [0, 0], outputs
    firsts = sorted(out.splitlines()[0] for out, _ in outputs)
    assert firsts[0] == f"already up to date (version {latest_version():04d})", outputs
    assert firsts[1].startswith("applied 0001_core"), outputs


@pytest.mark.parametrize(
    ("sqlstate", "name"), [("40001", "SerializationFailure"), ("40P01", "DeadlockDetected")]
)
async def test_a_replay_the_database_rolls_back_for_a_conflict_is_a_503_naming_the_conflict(
    database_url: str, conn: AsyncConnection[Any], sqlstate: str, name: str
) -> None:
    """The database may roll a request's transaction back for a conflict with another one (a
    serialization failure, a deadlock: here a trigger raises it once, as a concurrent change
    would): the answer is a 503 that says so, with ``Retry-After``, not "the database cannot
    be reached"; nothing of the request was written, and the same request then works."""
    dl = await insert_dead_letter(conn, job_id="conflict-1")
    # A sequence counts the calls: unlike a row, nextval() outlives the rollback it causes.
    await conn.execute("CREATE SEQUENCE public.conflict_once")
    await conn.execute(
        sql.SQL(
            """CREATE FUNCTION public.conflict_once() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF nextval('public.conflict_once') = 1 THEN
                RAISE EXCEPTION 'could not serialize access' USING ERRCODE = {};
              END IF;
              RETURN NEW;
            END $$"""
        ).format(sql.Literal(sqlstate))
    )
    await conn.execute(
        "CREATE TRIGGER conflict_once BEFORE UPDATE ON core.dead_letters"
        " FOR EACH ROW EXECUTE FUNCTION public.conflict_once()"
    )
    try:
        async with api_on(database_url) as api:
            refused = await api.client.post(f"{PREFIX}/{dl}/replay", headers=auth())
            assert refused.status_code == 503, refused.text
            body = refused.json()
            assert body["type"] == "urn:jobfence:problem:transaction-conflict", body
            assert name in body["detail"] and "try again" in body["detail"], body
            assert refused.headers["Retry-After"] == "1"
            assert await queued_job_ids(conn) == []
            assert await scalar(
                conn, "SELECT status FROM core.dead_letters WHERE id = %s", (dl,)
            ) == ("pending_review")
            replayed = await api.client.post(f"{PREFIX}/{dl}/replay", headers=auth())
            assert replayed.status_code == 200, replayed.text
    finally:
        await conn.execute("DROP TRIGGER conflict_once ON core.dead_letters")
        await conn.execute("DROP FUNCTION public.conflict_once()")
        await conn.execute("DROP SEQUENCE public.conflict_once")
