"""The spec's acceptance criteria for the consumer harness, on real PostgreSQL.

Acceptance 1, 2, 3, 5 and 8 of ``job-infrastructure.md`` (4, 6 and 7 live in other files), plus
the failure classes of D7 (hard failures, permanent types, serialization failures), graceful
shutdown on SIGTERM and the rollback of a failed handler's work. The effect counted everywhere
is ``pointsapp``'s: one ``public.awards`` row and the account balance, per applied job.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection, errors, sql
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import (
    App,
    DeadLetterConflict,
    HardFailure,
    JobMeta,
    PgQueue,
    PrometheusMetrics,
    RetryPolicy,
    Worker,
    get_dead_letter,
    open_pool,
    replay_dead_letter,
)
from jobfence.pgtx import Tx
from jobfence.worker import RunUntil, WorkerStats
from support import scalar, wait_until

Handler = Callable[[pointsapp.Award, JobMeta, AsyncConnection[Any]], Awaitable[None]]
CRASH_WORKER = Path(__file__).with_name("crash_worker.py")


class FakeClock:
    """The queue's clock, moved by hand: retries are scheduled against it, not real minutes."""

    def __init__(self, start: datetime) -> None:
        self.current = start

    def now(self) -> datetime:
        return self.current

    def advance_to(self, when: datetime) -> None:
        assert when >= self.current
        self.current = when


class AccountFrozen(Exception):
    """A handler error the test policy lists as permanent."""


# Handler flavours: the tests marked with it run once with an async handler and once with the
# same body as a plain def handler (pointsapp.as_sync), whose transaction runs in a worker thread
# on the sync pool.
FLAVOURS = pytest.mark.parametrize("flavour", ["async", "sync"])


def make_app(handler: Handler, *, retry: RetryPolicy | None = None, flavour: str = "async") -> App:
    app = App()
    app.consumer(
        "award_points",
        queue=pointsapp.QUEUE,
        schema=pointsapp.Award,
        **({"retry": retry} if retry is not None else {}),
    )(pointsapp.flavoured(handler, flavour))
    return app


def worker(
    app: App,
    pool: AsyncConnectionPool[Any],
    queue: PgQueue,
    metrics: PrometheusMetrics,
    **kwargs: Any,
) -> Worker:
    kwargs.setdefault("poll_seconds", 0.05)
    return Worker(app, pool, queue, metrics=metrics, **kwargs)


async def run_worker(
    app: App,
    pool: AsyncConnectionPool[Any],
    metrics: PrometheusMetrics,
    *,
    until: RunUntil = "idle",
    timeout: float = 20,
    queue: PgQueue | None = None,
    **kwargs: Any,
) -> WorkerStats:
    """Run one worker until ``until`` (``timeout`` seconds at most) over ``queue``, or over a
    PostgreSQL queue of its own, closed after."""
    used = PgQueue(pool, poll_interval_seconds=0.05) if queue is None else queue
    try:
        return await asyncio.wait_for(
            worker(app, pool, used, metrics, **kwargs).run(until=until), timeout=timeout
        )
    finally:
        if queue is None:
            await used.close()


async def run_recording_attempts(
    pool: AsyncConnectionPool[Any], until: RunUntil, metrics: PrometheusMetrics | None = None
) -> list[tuple[str, int]]:
    """Run a worker whose handler applies the award and records (job_id, attempt) it saw."""
    seen: list[tuple[str, int]] = []

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        seen.append((job.job_id, job.attempt))
        await pointsapp.apply_award(payload, job, tx)

    await run_worker(make_app(award), pool, metrics or PrometheusMetrics(), until=until)
    return seen


async def count(conn: AsyncConnection[Any], query: Any, params: Any = None) -> int:
    return int(await scalar(conn, query, params))


async def awards(conn: AsyncConnection[Any], job_id: str | None = None) -> int:
    if job_id is None:
        return await count(conn, "SELECT count(*) FROM public.awards")
    return await count(conn, "SELECT count(*) FROM public.awards WHERE job_id = %s", (job_id,))


async def fences(conn: AsyncConnection[Any], job_id: str) -> int:
    return await count(
        conn, "SELECT count(*) FROM core.processed_jobs WHERE job_id = %s", (job_id,)
    )


async def queued(conn: AsyncConnection[Any]) -> int:
    return await count(conn, "SELECT count(*) FROM jobfence_queue.messages")


async def dead_letter_ids(conn: AsyncConnection[Any], job_id: str) -> list[int]:
    cur = await conn.execute(
        "SELECT id FROM core.dead_letters WHERE job_id = %s ORDER BY id", (job_id,)
    )
    return [row[0] for row in await cur.fetchall()]


async def balance(conn: AsyncConnection[Any], account_id: int) -> int:
    return await count(conn, "SELECT points FROM public.accounts WHERE id = %s", (account_id,))


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


class WorkerProcess:
    """``crash_worker.py`` in a subprocess, with its output kept for failure messages."""

    def __init__(self, mode: str, database_url: str, workdir: Path, flavour: str = "async") -> None:
        self.workdir = workdir
        self.marker = workdir / "in_handler"
        self.log = workdir / f"{mode}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(CRASH_WORKER), mode, database_url, str(workdir), flavour],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_in_handler(self, within: float = 20.0) -> tuple[int, str, int]:
        async def reached() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited early:\n{self.output()}")
            return self.marker.exists()

        await wait_until(reached, timeout=within, message="the worker to be inside its handler")
        pid, job_id, attempt = self.marker.read_text().split()
        return int(pid), job_id, int(attempt)

    async def wait_exit(self, within: float = 20.0) -> int:
        async def exited() -> bool:
            return self.proc.poll() is not None

        await wait_until(exited, timeout=within, message=f"the worker to exit:\n{self.output()}")
        assert self.proc.returncode is not None
        return self.proc.returncode

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def processes() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for proc in started:
        proc.cleanup()


# -- Acceptance 1 -------------------------------------------------------------------------------


async def test_acceptance_1_same_job_id_processed_concurrently_has_exactly_one_effect(
    database_url: str, points: AsyncConnection[Any]
) -> None:
    """Four workers, each on its own pool, receive copies of one job_id at once, 20 rounds.

    The winner's handler waits until the three other workers are blocked on its uncommitted
    fence key (seen in pg_stat_activity from a separate connection), which proves the four
    deliveries really overlap. Every round ends with one awards row and one fence row.
    """
    workers_n, copies, rounds = 4, 8, 20  # 2 copies per worker: each holds one, runs one
    probe = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    handler_errors: list[BaseException] = []
    blocked_seen: list[int] = []
    entered: set[str] = set()

    async def others_blocked() -> bool:
        waiting = await count(
            probe,
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        if waiting >= workers_n - 1:
            blocked_seen.append(waiting)
            return True
        return False

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        # Only the first handler call of a round waits: a second one would be a double effect.
        if job.job_id not in entered:
            entered.add(job.job_id)
            try:
                await wait_until(others_blocked, timeout=15, message="duplicates to block")
            except BaseException as exc:
                handler_errors.append(exc)
                raise
        await pointsapp.apply_award(payload, job, tx)

    app = make_app(award)
    metrics = PrometheusMetrics()
    pools = [
        await open_pool(database_url, min_size=1, max_size=3, name=f"a1-{i}")
        for i in range(workers_n)
    ]
    queues = [PgQueue(p, poll_interval_seconds=0.05) for p in pools]
    try:
        for round_no in range(rounds):
            job_id = f"same-{round_no}"
            for _ in range(copies):
                await app.enqueue(
                    points, "award_points", {"account_id": 1, "points": 3}, job_id=job_id
                )
            runs = [
                worker(app, p, q, metrics, concurrency=1, batch_size=1).run(until="idle")
                for p, q in zip(pools, queues, strict=True)
            ]
            stats = await asyncio.wait_for(asyncio.gather(*runs), timeout=30)
            assert not handler_errors, handler_errors
            assert await awards(points, job_id) == 1, f"round {round_no}"
            assert await fences(points, job_id) == 1, f"round {round_no}"
            assert await queued(points) == 0, f"round {round_no}"
            outcomes = sum((s.outcomes for s in stats), start=Counter[str]())
            assert outcomes == {"succeeded": 1, "duplicate": copies - 1}, f"round {round_no}"
            assert all(s.handled >= 1 for s in stats), "every worker took part"
    finally:
        for q in queues:
            await q.close()
        for p in pools:
            await p.close()
        await probe.close()

    assert len(blocked_seen) == rounds
    assert await awards(points) == rounds
    assert await balance(points, 1) == 3 * rounds
    assert metrics.count("succeeded") == rounds
    assert metrics.count("duplicate") == rounds * (copies - 1)
    assert metrics.count("retried") == metrics.count("dead_lettered") == 0


# -- Acceptance 2 -------------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["async", "sync", "sqlalchemy", "async-sqlalchemy"])
async def test_acceptance_2_crash_between_work_and_fence_leaves_neither(  # noqa: PLR0917
    database_url: str,
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    workdir: Path,
    processes: list[WorkerProcess],
    flavour: str,
) -> None:
    """A worker process SIGKILLed after its work statement, before commit, leaves no effect and
    no fence; after the 1 s lease the job is delivered again (attempt 2) and applied once. With
    each handler flavour: async, a sync def, a sync def writing through the SQLAlchemy ORM, an
    async handler writing through the ORM's AsyncSession."""
    app = pointsapp.build_app()
    await app.enqueue(points, "award_points", {"account_id": 2, "points": 7}, job_id="crash-1")

    proc = WorkerProcess("crash", database_url, workdir, flavour)
    processes.append(proc)
    backend_pid, job_id, attempt = await proc.wait_in_handler()
    assert (job_id, attempt) == ("crash-1", 1)

    # The work statement ran in the worker's open transaction: it holds the awards table's
    # write lock and a transaction id, yet nothing is visible from outside.
    assert (
        await count(
            points,
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE l.pid = %s AND c.relname = 'awards' AND l.mode = 'RowExclusiveLock'",
            (backend_pid,),
        )
        == 1
    )
    assert (
        await scalar(
            points,
            "SELECT state FROM pg_stat_activity WHERE pid = %s AND backend_xid IS NOT NULL",
            (backend_pid,),
        )
        == "idle in transaction"
    )
    assert await awards(points) == 0
    assert await fences(points, "crash-1") == 0

    proc.proc.send_signal(signal.SIGKILL)
    assert await proc.wait_exit() == -signal.SIGKILL

    async def rolled_back() -> bool:
        return (
            await count(
                points, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (backend_pid,)
            )
            == 0
        )

    await wait_until(rolled_back, timeout=15, message="the server to end the killed backend")
    assert await awards(points) == 0
    assert await fences(points, "crash-1") == 0
    assert await balance(points, 2) == 0
    assert await queued(points) == 1

    # "empty" keeps polling through the rest of the dead worker's lease.
    metrics = PrometheusMetrics()
    seen = await run_recording_attempts(pool, "empty", metrics)
    assert seen == [("crash-1", 2)]
    assert await awards(points, "crash-1") == 1
    assert await fences(points, "crash-1") == 1
    assert await balance(points, 2) == 7
    assert await queued(points) == 0
    assert metrics.count("succeeded") == 1


async def kill_after_a_commit_before_its_ack(
    database_url: str,
    points: AsyncConnection[Any],
    workdir: Path,
    processes: list[WorkerProcess],
) -> None:
    """Jobs "late-ack" (3 points to account 3) and "z-block": a worker process commits
    "late-ack", then is SIGKILLed inside "z-block"'s handler while "late-ack"'s ack waits in
    its batch. Left: "late-ack"'s effect, its fence and its message."""
    app = pointsapp.build_app()
    await app.enqueue(points, "award_points", {"account_id": 3, "points": 5}, job_id="late-ack")
    await app.enqueue(points, "award_points", {"account_id": 4, "points": 1}, job_id="z-block")

    proc = WorkerProcess("unacked", database_url, workdir)
    processes.append(proc)
    _, job_id, _ = await proc.wait_in_handler()
    assert job_id == "z-block"  # so "late-ack" has committed, and its ack is held back
    assert await awards(points, "late-ack") == 1
    assert await fences(points, "late-ack") == 1
    assert await queued(points) == 2, "the committed job's message is still queued (unacked)"

    proc.proc.send_signal(signal.SIGKILL)
    assert await proc.wait_exit() == -signal.SIGKILL


async def test_crash_after_commit_before_the_batched_ack_redelivers_as_a_duplicate(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    workdir: Path,
    processes: list[WorkerProcess],
) -> None:
    """Acks go out after the commit, in batches: a worker SIGKILLed while a committed job's ack
    is still waiting leaves the effect, the fence and the message. The message comes back when
    its 1 s lease ends and the fence makes it a duplicate: acked, counted, no second effect."""
    await kill_after_a_commit_before_its_ack(database_url, points, workdir, processes)

    metrics = PrometheusMetrics()
    seen = await run_recording_attempts(pool, "empty", metrics)
    assert seen == [("z-block", 2)], "the handler never sees the committed job again"
    assert metrics.count("duplicate") == 1
    assert metrics.count("succeeded") == 1
    assert await awards(points, "late-ack") == 1
    assert await balance(points, 3) == 5
    assert await awards(points, "z-block") == 1
    assert await queued(points) == 0


# -- Acceptance 3 -------------------------------------------------------------------------------


async def _deliver_until_dead_lettered(
    app: App,
    *,
    pool: AsyncConnectionPool[Any],
    queue: PgQueue,
    clock: FakeClock,
    metrics: PrometheusMetrics,
    rng: random.Random,
    conn: AsyncConnection[Any],
) -> list[float]:
    """Run a worker once per delivery, moving the fake clock past each scheduled retry.

    Returns the delay of each scheduled retry: its ``run_at`` minus the fake now.
    """
    delays: list[float] = []
    for delivery in range(1, 7):
        stats = await asyncio.wait_for(
            worker(app, pool, queue, metrics, rng=rng).run(until="idle"), timeout=20
        )
        assert stats.handled == 1, f"delivery {delivery}: {stats.outcomes}"
        if delivery == 6:
            assert stats.outcomes == {"dead_lettered": 1}
            return delays
        assert stats.outcomes == {"retried": 1}
        cur = await conn.execute(
            "SELECT run_at, attempts, lease_token, last_error FROM jobfence_queue.messages"
        )
        [(run_at, attempts, lease_token, last_error)] = await cur.fetchall()
        assert attempts == delivery
        assert lease_token is None
        assert f"ledger timeout on attempt {delivery}" in last_error
        delays.append((run_at - clock.now()).total_seconds())
        # Not due until the fake clock reaches run_at: a run just before handles nothing.
        clock.advance_to(run_at - timedelta(seconds=1))
        early = await worker(app, pool, queue, metrics, rng=rng).run(until="idle")
        assert early.handled == 0
        clock.advance_to(run_at + timedelta(seconds=1))
    raise AssertionError("not dead-lettered after 6 deliveries")


@FLAVOURS
async def test_acceptance_3_transient_failure_retries_5_times_growing_then_dead_letter_attempts_6(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    seed = 20260817
    clock = FakeClock(datetime.now(UTC).replace(microsecond=0))
    queue = PgQueue(pool, clock=clock, poll_interval_seconds=0.05)
    # mode "transient" raises pointsapp.Flaky on every attempt
    app = pointsapp.build_app(flavour=flavour)
    metrics = PrometheusMetrics()
    payload = {"account_id": 3, "points": 11, "mode": "transient"}
    message = app.message(
        "award_points", payload, job_id="flaky-1", tenant_id="tenant-7", correlation_id="corr-42"
    )
    await queue.publish(message)
    try:
        delays = await _deliver_until_dead_lettered(
            app,
            pool=pool,
            queue=queue,
            clock=clock,
            metrics=metrics,
            rng=random.Random(seed),
            conn=points,
        )
    finally:
        await queue.close()

    policy = RetryPolicy()
    bounds = [(30.0, 37.5), (60.0, 75.0), (120.0, 150.0), (240.0, 300.0), (480.0, 600.0)]
    assert len(delays) == 5
    for n, (delay, (low, high)) in enumerate(zip(delays, bounds, strict=True), start=1):
        assert (low, high) == (policy.nominal_delay(n), policy.upper_bound(n))
        assert low - 1e-5 <= delay <= high + 1e-5, (n, delays)
    assert all(a < b for a, b in itertools.pairwise(delays)), delays
    replay_rng = random.Random(seed)
    expected = [policy.delay(n, replay_rng) for n in range(1, 6)]
    assert delays == pytest.approx(expected, abs=1e-5), "jitter reproducible from the seed"

    ids = await dead_letter_ids(points, "flaky-1")
    assert len(ids) == 1
    dl = await get_dead_letter(points, ids[0])
    assert dl.attempts == 6
    assert dl.status == "pending_review"
    assert dl.error_class == "pointsapp.Flaky"
    assert dl.last_error.startswith("pointsapp.Flaky: ledger timeout on attempt 6")
    assert "Traceback" in dl.last_error
    assert "apply_award" in dl.last_error  # the frame that raised (apply_award_sync for sync)
    assert dl.correlation_id == "corr-42"
    assert dl.tenant_id == "tenant-7"
    assert (dl.consumer, dl.queue, dl.job_id) == ("award_points", pointsapp.QUEUE, "flaky-1")
    assert dl.payload == payload
    assert dl.payload_encoding == "json"

    assert await queued(points) == 0
    assert await awards(points) == 0
    assert await fences(points, "flaky-1") == 0
    assert metrics.count("retried") == 5
    assert metrics.count("dead_lettered") == 1
    assert metrics.count("succeeded") == 0


# -- Acceptance 5 -------------------------------------------------------------------------------


@FLAVOURS
async def test_acceptance_5_replay_with_same_job_id_produces_no_second_effect(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    broken = {"yes": True}
    attempts: list[tuple[str, int]] = []

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        attempts.append((job.job_id, job.attempt))
        await pointsapp.apply_award(payload, job, tx)
        if broken["yes"]:
            raise HardFailure("ledger rejected the account")

    app = make_app(award, flavour=flavour)
    metrics = PrometheusMetrics()
    queue = PgQueue(pool, poll_interval_seconds=0.05)

    async def drain() -> None:
        await run_worker(app, pool, metrics, queue=queue)

    try:
        await app.enqueue(
            points,
            "award_points",
            {"account_id": 4, "points": 13},
            job_id="replay-1",
            correlation_id="corr-r1",
        )
        await drain()
        [dl_id] = await dead_letter_ids(points, "replay-1")
        assert await awards(points, "replay-1") == 0

        broken["yes"] = False  # the bug is fixed
        result = await replay_dead_letter(pool, queue, dl_id, resolved_by="ops")
        assert result.message.job_id == "replay-1"
        assert result.message.correlation_id == "corr-r1"
        await drain()
        assert await awards(points, "replay-1") == 1
        assert await balance(points, 4) == 13

        with pytest.raises(DeadLetterConflict) as conflict:
            await replay_dead_letter(pool, queue, dl_id, resolved_by="ops")
        assert conflict.value.status == "replayed"

        # The provider delivers the same job_id once more: the fence absorbs it.
        await app.enqueue(
            points, "award_points", {"account_id": 4, "points": 13}, job_id="replay-1"
        )
        await drain()
    finally:
        await queue.close()

    assert attempts == [("replay-1", 1), ("replay-1", 1)]  # fresh delivery count on replay
    assert await awards(points, "replay-1") == 1
    assert await balance(points, 4) == 13
    assert await fences(points, "replay-1") == 1
    assert await queued(points) == 0
    assert await dead_letter_ids(points, "replay-1") == [dl_id]
    dl = await get_dead_letter(points, dl_id)
    assert dl.status == "replayed"
    assert dl.resolved_by == "ops"
    assert dl.resolved_at is not None
    assert metrics.count("dead_lettered") == 1
    assert metrics.count("succeeded") == 1
    assert metrics.count("duplicate") == 1


@FLAVOURS
async def test_acceptance_5_replay_of_job_already_fenced_by_redelivery_has_no_second_effect(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    """The dead letter was written, then a redelivery of the job succeeded (fence row);
    replaying the dead letter afterwards must not apply the work again."""
    broken = {"yes": True}

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        if broken["yes"]:
            raise HardFailure("ledger rejected the account")
        await pointsapp.apply_award(payload, job, tx)

    app = make_app(award, flavour=flavour)
    metrics = PrometheusMetrics()
    queue = PgQueue(pool, poll_interval_seconds=0.05)

    async def drain() -> None:
        await run_worker(app, pool, metrics, queue=queue)

    try:
        await app.enqueue(points, "award_points", {"account_id": 5, "points": 17}, job_id="r2")
        await drain()
        [dl_id] = await dead_letter_ids(points, "r2")

        broken["yes"] = False
        await app.enqueue(points, "award_points", {"account_id": 5, "points": 17}, job_id="r2")
        await drain()
        assert await awards(points, "r2") == 1
        assert await fences(points, "r2") == 1

        result = await replay_dead_letter(pool, queue, dl_id, resolved_by="ops")
        # The fence shows the effect is applied: nothing is republished.
        assert result.already_processed
        assert not result.published
        assert await queued(points) == 0
        await drain()
    finally:
        await queue.close()

    assert await awards(points, "r2") == 1
    assert await balance(points, 5) == 17
    assert await queued(points) == 0
    assert metrics.count("succeeded") == 1
    assert metrics.count("duplicate") == 0
    assert (await get_dead_letter(points, dl_id)).status == "replayed"


# -- Acceptance 8 -------------------------------------------------------------------------------


async def _row_counts(conn: AsyncConnection[Any]) -> dict[str, int]:
    """Rows in every user table of the database, by ``schema.table``."""
    cur = await conn.execute(
        "SELECT table_schema, table_name FROM information_schema.tables "
        "WHERE table_type = 'BASE TABLE' "
        "AND table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2"
    )
    counts: dict[str, int] = {}
    for schema_name, table in await cur.fetchall():
        query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema_name, table))
        counts[f"{schema_name}.{table}"] = await count(conn, query)
    return counts


@FLAVOURS
async def test_acceptance_8_successful_jobs_write_no_row_beyond_their_fence(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    n = 50
    before = await _row_counts(points)
    assert "core.processed_jobs" in before
    assert "core.dead_letters" in before
    assert before["jobfence_queue.messages"] == 0

    app = pointsapp.build_app(flavour=flavour)
    for i in range(n):
        await app.enqueue(
            points,
            "award_points",
            {"account_id": 1 + i % 10, "points": 1},
            job_id=f"ok-{i}",
            tenant_id="t1",
            correlation_id=f"c-{i}",
        )
    metrics = PrometheusMetrics()
    stats = await run_worker(app, pool, metrics, concurrency=4, timeout=30)
    assert stats.outcomes == {"succeeded": n}
    assert metrics.count("succeeded") == n

    after = await _row_counts(points)
    assert set(after) == set(before)
    grown = {
        table: after[table] - before[table] for table in after if after[table] != before[table]
    }
    # The application's own effect, and in jobfence's schemas exactly the n fence rows.
    assert grown == {"core.processed_jobs": n, "public.awards": n}
    assert after["jobfence_queue.messages"] == 0
    assert await count(points, "SELECT count(DISTINCT job_id) FROM core.processed_jobs") == n


# -- D7: failure classes ------------------------------------------------------------------------


@FLAVOURS
async def test_hard_failure_and_permanent_error_type_dead_letter_at_once_without_retry(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload.model_copy(update={"mode": "ok"}), job, tx)
        if payload.mode == "hard":
            raise HardFailure("account is closed")
        if payload.mode == "frozen":
            raise AccountFrozen("account 6 is frozen by compliance")
        if payload.mode == "transient":
            raise pointsapp.Flaky("ledger timeout")

    app = make_app(award, retry=RetryPolicy(permanent=(AccountFrozen,)), flavour=flavour)
    for job_id, mode in (("hard-1", "hard"), ("frozen-1", "frozen"), ("flaky-1", "transient")):
        await app.enqueue(
            points, "award_points", {"account_id": 6, "points": 1, "mode": mode}, job_id=job_id
        )
    metrics = PrometheusMetrics()
    stats = await run_worker(app, pool, metrics)
    assert stats.outcomes == {"dead_lettered": 2, "retried": 1}

    for job_id, error_class, text in (
        ("hard-1", "jobfence.HardFailure", "account is closed"),
        ("frozen-1", f"{__name__}.AccountFrozen", "account 6 is frozen by compliance"),
    ):
        [dl_id] = await dead_letter_ids(points, job_id)
        dl = await get_dead_letter(points, dl_id)
        assert dl.attempts == 1, job_id
        assert dl.error_class == error_class
        assert dl.last_error.startswith(f"{error_class}: {text}")
        assert await fences(points, job_id) == 0

    # Only the transient one is still queued, waiting for its retry; nothing was applied.
    cur = await points.execute("SELECT job_id, attempts FROM jobfence_queue.messages")
    assert await cur.fetchall() == [("flaky-1", 1)]
    assert await dead_letter_ids(points, "flaky-1") == []
    assert await awards(points) == 0
    assert await balance(points, 6) == 0
    assert metrics.count("dead_lettered") == 2
    assert metrics.count("retried") == 1


@FLAVOURS
async def test_d7_serialization_failure_is_retried_at_once_without_counting_an_attempt(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    calls: list[int] = []

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        calls.append(job.attempt)
        await pointsapp.apply_award(payload, job, tx)
        if len(calls) <= 2:
            raise errors.SerializationFailure("could not serialize access (induced)")

    app = make_app(award, flavour=flavour)
    await app.enqueue(points, "award_points", {"account_id": 7, "points": 19}, job_id="ser-1")
    metrics = PrometheusMetrics()
    stats = await run_worker(app, pool, metrics)

    assert calls == [1, 1, 1]  # three runs within one delivery
    assert stats.outcomes == {"succeeded": 1}
    assert await awards(points, "ser-1") == 1
    assert await balance(points, 7) == 19
    assert await fences(points, "ser-1") == 1
    assert await queued(points) == 0
    assert await dead_letter_ids(points, "ser-1") == []
    assert metrics.count("retried") == 0
    assert metrics.count("succeeded") == 1


# -- Graceful shutdown --------------------------------------------------------------------------


@FLAVOURS
async def test_sigterm_finishes_the_job_in_progress_and_releases_fetched_jobs(  # noqa: PLR0917
    database_url: str,
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    workdir: Path,
    processes: list[WorkerProcess],
    flavour: str,
) -> None:
    app = pointsapp.build_app()
    job_ids = [f"term-{i}" for i in range(5)]
    for job_id in job_ids:
        await app.enqueue(points, "award_points", {"account_id": 8, "points": 2}, job_id=job_id)

    proc = WorkerProcess("graceful", database_url, workdir, flavour)
    processes.append(proc)
    _, running, attempt = await proc.wait_in_handler()
    assert attempt == 1

    async def all_leased() -> bool:
        return (
            await count(
                points, "SELECT count(*) FROM jobfence_queue.messages WHERE lease_token IS NOT NULL"
            )
            == 5
        )

    await wait_until(all_leased, timeout=10, message="the worker to hold all five jobs")
    assert await awards(points) == 0

    proc.proc.send_signal(signal.SIGTERM)
    assert await proc.wait_exit() == 0, proc.output()
    assert "released=4" in proc.output()

    # The job in progress finished after the signal: its second statement committed too.
    assert await awards(points, running) == 1
    assert await fences(points, running) == 1
    assert await balance(points, 8) == 2
    cur = await points.execute(
        "SELECT job_id, attempts, lease_token IS NULL, run_at <= now() "
        "FROM jobfence_queue.messages ORDER BY job_id"
    )
    rest = sorted(set(job_ids) - {running})
    assert await cur.fetchall() == [(job_id, 0, True, True) for job_id in rest]

    seen = await run_recording_attempts(pool, "idle")
    assert sorted(seen) == [(job_id, 1) for job_id in rest]
    assert await awards(points) == 5
    assert await balance(points, 8) == 10
    assert await queued(points) == 0


# -- Rollback of a failed handler ---------------------------------------------------------------


@FLAVOURS
async def test_handler_raising_after_its_work_rolls_back_everything_and_schedules_a_retry(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        assert await scalar(tx, "SELECT count(*) FROM public.awards") == 1  # work is done...
        raise pointsapp.Flaky("ledger went away after the write")  # ...then the handler fails

    clock = FakeClock(datetime.now(UTC).replace(microsecond=0))
    queue = PgQueue(pool, clock=clock, poll_interval_seconds=0.05)
    app = make_app(award, flavour=flavour)
    await queue.publish(app.message("award_points", {"account_id": 9, "points": 23}, job_id="rb-1"))
    metrics = PrometheusMetrics()
    try:
        stats = await run_worker(app, pool, metrics, queue=queue)
    finally:
        await queue.close()

    assert stats.outcomes == {"retried": 1}
    assert await awards(points) == 0
    assert await balance(points, 9) == 0
    assert await fences(points, "rb-1") == 0
    assert await dead_letter_ids(points, "rb-1") == []
    cur = await points.execute(
        "SELECT job_id, attempts, lease_token, run_at, last_error FROM jobfence_queue.messages"
    )
    [(job_id, attempts, lease_token, run_at, last_error)] = await cur.fetchall()
    assert (job_id, attempts, lease_token) == ("rb-1", 1, None)
    assert 30.0 <= (run_at - clock.now()).total_seconds() <= 37.5
    assert last_error.startswith("pointsapp.Flaky: ledger went away after the write")
    assert metrics.count("retried") == 1


@FLAVOURS
async def test_a_handler_raising_psycopg_rollback_fails_its_job_and_nothing_of_it_commits(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    """psycopg.Rollback, raised by the handler out of the fence transaction, rolls back the
    fence with the work: the job is not counted as done (acked with no fence and no effect,
    it would vanish), it fails as any exception does, and the next delivery applies it."""

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        if job.attempt == 1:
            raise psycopg.Rollback()

    clock = FakeClock(datetime.now(UTC).replace(microsecond=0))
    queue = PgQueue(pool, clock=clock, poll_interval_seconds=0.05)
    app = make_app(award, flavour=flavour)
    await queue.publish(app.message("award_points", {"account_id": 9, "points": 23}, job_id="rb-2"))
    metrics = PrometheusMetrics()
    try:
        stats = await run_worker(app, pool, metrics, queue=queue)
        assert stats.outcomes == {"retried": 1}
        assert await awards(points) == 0
        assert await fences(points, "rb-2") == 0
        cur = await points.execute("SELECT attempts, last_error FROM jobfence_queue.messages")
        [(attempts, last_error)] = await cur.fetchall()
        assert attempts == 1
        assert last_error.startswith("psycopg.Rollback")
        assert "raise psycopg.Rollback()" in last_error  # the handler's line, in the traceback

        clock.advance_to(clock.now() + timedelta(minutes=5))
        stats = await run_worker(app, pool, metrics, queue=queue)
    finally:
        await queue.close()
    assert stats.outcomes == {"succeeded": 1}
    assert await awards(points) == 1
    assert await balance(points, 9) == 23
    assert await fences(points, "rb-2") == 1
    assert await dead_letter_ids(points, "rb-2") == []


# -- one round trip between two jobs: a COMMIT that fails while the next job waits ---------------


async def test_a_commit_that_fails_while_the_next_job_waits_fails_that_job_alone(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A deferred foreign key is checked at COMMIT: job "bad-4" passes its handler and fails at
    # its COMMIT, which travels with the next job's BEGIN and fence insert.
    await points.execute(
        "CREATE TABLE public.audit (account_id integer"
        " REFERENCES public.accounts (id) DEFERRABLE INITIALLY DEFERRED)"
    )

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        account = 999 if job.job_id == "bad-4" else payload.account_id
        await tx.execute("INSERT INTO public.audit VALUES (%s)", (account,))

    chained: list[str] = []  # how each chained COMMIT ended
    original = Tx.commit_then_begin

    async def observed(self: Tx, query: Any, params: Any, check: Any = None) -> Any:
        try:
            result = await original(self, query, params, check)
        except Exception as exc:
            chained.append(type(exc).__name__)
            raise
        chained.append("ok")
        return result

    monkeypatch.setattr(Tx, "commit_then_begin", observed)

    app = make_app(award, retry=RetryPolicy(permanent=(errors.ForeignKeyViolation,)))
    job_ids = [f"{'bad' if i == 4 else 'ok'}-{i}" for i in range(10)]
    for i, job_id in enumerate(job_ids):
        await app.enqueue(
            points, "award_points", {"account_id": 1 + i % 10, "points": 1}, job_id=job_id
        )
    metrics = PrometheusMetrics()
    stats = await run_worker(app, pool, metrics)

    assert "ForeignKeyViolation" in chained, "the failing COMMIT was sent with the next BEGIN"
    assert "ok" in chained, chained
    assert stats.outcomes == {"succeeded": 9, "dead_lettered": 1}
    for job_id in job_ids:
        expected = 0 if job_id == "bad-4" else 1
        assert await awards(points, job_id) == expected, job_id
        assert await fences(points, job_id) == expected, job_id
    [dl_id] = await dead_letter_ids(points, "bad-4")
    dl = await get_dead_letter(points, dl_id)
    assert dl.error_class == "psycopg.errors.ForeignKeyViolation"
    assert await count(points, "SELECT count(*) FROM public.audit") == 9
    assert await queued(points) == 0
    assert metrics.count("succeeded") == 9


@FLAVOURS
async def test_a_handler_that_swallows_a_database_error_fails_instead_of_looking_done(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    # PostgreSQL answers COMMIT on an aborted transaction with a silent ROLLBACK: without the
    # check, the job would be acked as succeeded with nothing written.
    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        if job.attempt == 1:
            with contextlib.suppress(psycopg.errors.UndefinedTable):
                await tx.execute("UPDATE public.missing SET x = 1")

    app = make_app(award, flavour=flavour)
    for i in range(3):
        await app.enqueue(points, "award_points", {"account_id": 2, "points": 5}, job_id=f"s-{i}")
    metrics = PrometheusMetrics()
    stats = await run_worker(app, pool, metrics)
    assert stats.outcomes == {"retried": 3}
    assert await awards(points) == 0
    assert await balance(points, 2) == 0
    assert await count(points, "SELECT count(*) FROM core.processed_jobs") == 0
    cur = await points.execute(
        "SELECT job_id, attempts, last_error FROM jobfence_queue.messages ORDER BY job_id"
    )
    rows = await cur.fetchall()
    assert [(job_id, attempts) for job_id, attempts, _ in rows] == [
        ("s-0", 1),
        ("s-1", 1),
        ("s-2", 1),
    ]
    for _, _, last_error in rows:
        assert last_error.startswith("jobfence.TransactionAborted: the handler returned")
