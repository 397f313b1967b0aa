"""Sync (``def``) handlers at the edges: what a hostile handler does in its worker thread ends
as one failure of its own job, and the jobs behind it go on. Real PostgreSQL, real workers."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from sqlalchemy.exc import IntegrityError

import pointsapp
from jobfence import App, JobMeta, PrometheusMetrics, RetryPolicy, db, get_dead_letter
from jobfence.contrib.sqlalchemy import async_session_for, session_for
from jobfence.worker import WorkerStats
from points_orm import Account, AwardRow
from test_acceptance_harness import awards, balance, dead_letter_ids, fences, queued, run_worker
from test_sync_handlers import CONSUMER, app_with


def run_worker_apart(database_url: str, app: App, **kwargs: Any) -> WorkerStats:
    """Run a worker until idle on an event loop of its own, in a thread: whatever escapes the
    worker (even a SystemExit) comes back here as a test failure, not as the test's own end."""
    escaped: list[BaseException] = []
    stats: list[WorkerStats] = []

    async def main() -> None:
        pool = await db.open_pool(database_url, min_size=1, max_size=6)
        try:
            stats.append(await run_worker(app, pool, PrometheusMetrics(), timeout=20, **kwargs))
        finally:
            await pool.close()

    def thread() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            escaped.append(exc)

    runner = threading.Thread(target=thread, name="test-worker")
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "the worker did not stop"
    assert not escaped, f"{type(escaped[0]).__name__} escaped the worker: {escaped[0]!r}"
    return stats[0]


EXITS: list[type[BaseException]] = [
    SystemExit,
    KeyboardInterrupt,
    GeneratorExit,
    asyncio.CancelledError,
]


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("per_transaction", [1, 5])
@pytest.mark.parametrize("raised", EXITS, ids=lambda exc: exc.__name__)
async def test_a_handler_raising_a_base_exception_is_one_dead_letter_and_the_jobs_behind_run(
    database_url: str,
    points: AsyncConnection[Any],
    raised: type[BaseException],
    per_transaction: int,
    flavour: str,
) -> None:
    """SystemExit, KeyboardInterrupt, GeneratorExit or CancelledError raised by a handler (a
    ``def`` one in its worker thread; an ``async def`` one with no cancellation of the worker's
    task requested) stops nothing but its job: its transaction rolls back, fence included, the
    job fails like any other error (here with no retry left: one dead letter naming what was
    raised), and the worker runs the jobs behind it. In a group (``jobs_per_transaction``)
    the group rolls back and its jobs run one transaction each, the same way."""

    def exits(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        pointsapp.apply_award_sync(payload, job, tx)
        if job.job_id == "exits":
            raise raised("bye")

    async def exits_async(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        if job.job_id == "exits":
            raise raised("bye")

    award: Any = exits if flavour == "sync" else exits_async

    app = app_with(
        award,
        retry=RetryPolicy(max_retries=0, rationale="no retry in this test"),
        jobs_per_transaction=per_transaction,
    )
    job_ids = ["exits", *(f"after-{n}" for n in range(4))]
    for job_id in job_ids:
        await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id=job_id)

    stats = run_worker_apart(database_url, app, concurrency=1)

    assert stats.outcomes == {"dead_lettered": 1, "succeeded": 4}, dict(stats.outcomes)
    assert await awards(points, "exits") == 0
    assert await fences(points, "exits") == 0
    [dl_id] = await dead_letter_ids(points, "exits")
    dl = await get_dead_letter(points, dl_id)
    assert (dl.attempts, dl.error_class) == (1, "jobfence.HandlerExited")
    assert f"raised {raised.__name__}" in dl.last_error, dl.last_error
    for job_id in job_ids[1:]:
        assert await awards(points, job_id) == 1, job_id
    assert await balance(points, 1) == 2 * 4
    assert await queued(points) == 0


# -- SQLAlchemy sessions: savepoints a handler leaves open ----------------------------------------


def orm_award_in_open_savepoint(flavour: str) -> Any:
    """A handler that opens ``begin_nested()`` and never commits it, its award made inside."""

    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        with session_for(tx) as session:
            session.begin_nested()
            session.add(AwardRow(job_id=job.job_id, account_id=1, points=payload.points))
            account = session.get(Account, 1, with_for_update=True)
            assert account is not None
            account.points += payload.points

    async def award_async(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        async with async_session_for(tx) as session:
            await session.begin_nested()
            session.add(AwardRow(job_id=job.job_id, account_id=1, points=payload.points))
            account = await session.get(Account, 1, with_for_update=True)
            assert account is not None
            account.points += payload.points

    return award if flavour == "sqlalchemy" else award_async


@pytest.mark.parametrize("flavour", ["sqlalchemy", "async-sqlalchemy"])
async def test_orm_changes_in_a_savepoint_left_open_commit_with_the_fence(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    """Leaving the session's block releases the savepoints the handler left open, as
    ``Session.commit()`` does: the changes made in them commit with the fence, not a fence
    committed with nothing applied."""
    app = app_with(orm_award_in_open_savepoint(flavour))
    job_ids = [f"open-savepoint-{n}" for n in range(3)]
    for job_id in job_ids:
        await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id=job_id)

    stats = await run_worker(app, pool, PrometheusMetrics())

    assert stats.outcomes == {"succeeded": 3}, dict(stats.outcomes)
    for job_id in job_ids:
        assert (await awards(points, job_id), await fences(points, job_id)) == (1, 1), job_id
    assert await balance(points, 1) == 2 * 3
    assert await queued(points) == 0


async def test_a_failed_flush_caught_in_an_orm_savepoint_rolls_back_that_savepoint_alone(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    """A flush that fails inside ``begin_nested()`` rolls back its savepoint (SQLAlchemy does);
    a handler that catches the error, the savepoint left as it is, commits the rest with the
    fence."""

    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        with session_for(tx) as session:
            session.add(AwardRow(job_id=job.job_id, account_id=1, points=payload.points))
            session.flush()
            session.begin_nested()
            session.add(Account(id=1, points=0))  # the account exists: a duplicate key
            with pytest.raises(IntegrityError):
                session.flush()

    app = app_with(award)
    await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id="caught")

    stats = await run_worker(app, pool, PrometheusMetrics())

    assert stats.outcomes == {"succeeded": 1}, dict(stats.outcomes)
    assert (await awards(points, "caught"), await fences(points, "caught")) == (1, 1)
