"""Sync handlers (a plain ``def`` consumer, and the SQLAlchemy ORM inside one), on real
PostgreSQL with real worker processes.

The acceptance criteria shared with async handlers run for both flavours where they live
(``test_acceptance_harness.py``, ``test_group_commit.py``, parametrised on ``flavour``); here:
Acceptance 1 with real concurrent processes for each flavour, what a handler that ends the
fence transaction itself gets, and the SQLAlchemy session's contract.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from sqlalchemy import text

import points_orm
import pointsapp
from jobfence import (
    App,
    JobMeta,
    PgQueue,
    PrometheusMetrics,
    TransactionAborted,
    get_dead_letter,
)
from jobfence.contrib.sqlalchemy import async_session_for, session_for
from jobfence.sync import PsycopgRunner
from support import counting_chains, wait_until
from test_acceptance_harness import (
    awards,
    balance,
    count,
    dead_letter_ids,
    fences,
    queued,
    run_worker,
    worker,
)

RACE_WORKER = Path(__file__).with_name("race_worker.py")
CONSUMER = "award_points"


def app_with(handler: Any, **options: Any) -> App:
    app = App()
    app.consumer(CONSUMER, queue=pointsapp.QUEUE, schema=pointsapp.Award, **options)(handler)
    return app


async def enqueue(conn: AsyncConnection[Any], app: App, job_id: str, **award: Any) -> None:
    payload = {"account_id": 1, "points": 2, **award}
    await app.enqueue(conn, CONSUMER, payload, job_id=job_id)


# -- Acceptance 1, with real concurrent processes for each handler flavour -----------------------


class Racers:
    """``race_worker.py`` processes of one flavour, their output kept for failure messages."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self, flavour: str, database_url: str, n: int) -> None:
        for i in range(n):
            log = self.workdir / f"racer-{i}.log"
            self.logs.append(log)
            with log.open("wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(RACE_WORKER),
                            flavour,
                            database_url,
                            str(self.workdir),
                            str(n - 1),
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs)

    def ready(self) -> bool:
        if any(proc.poll() is not None for proc in self.procs):
            raise AssertionError(f"a worker exited early:\n{self.output()}")
        return len(list(self.workdir.glob("ready.*"))) == len(self.procs)

    def errors(self) -> str | None:
        path = self.workdir / "errors"
        return path.read_text() if path.exists() else None

    def stop(self) -> list[Counter[str]]:
        """SIGTERM each, wait for its exit, and return each one's outcomes."""
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        outcomes: list[Counter[str]] = []
        for proc, log in zip(self.procs, self.logs, strict=True):
            proc.wait(timeout=30)
            assert proc.returncode == 0, self.output()
            found = re.search(r"^stopped (.*)$", log.read_text(), re.MULTILINE)
            assert found is not None, self.output()
            outcomes.append(
                Counter({k: int(v) for k, v in (kv.split("=") for kv in found[1].split())})
            )
        return outcomes

    def handler_runs(self) -> Counter[str]:
        """How many times a handler ran for each job_id, over all processes."""
        return Counter(
            line for path in self.workdir.glob("ran.*") for line in path.read_text().splitlines()
        )

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def racers(tmp_path: Path) -> Iterator[Racers]:
    started = Racers(tmp_path)
    yield started
    started.cleanup()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flavour", ["async", "sync", "sqlalchemy", "async-sqlalchemy"])
async def test_acceptance_1_same_job_id_in_concurrent_worker_processes_has_exactly_one_effect(
    database_url: str,
    points: AsyncConnection[Any],
    racers: Racers,
    flavour: str,
) -> None:
    """Four worker processes receive copies of one job_id at once, 5 rounds. The handler that
    runs waits, before its work, until the three other processes are blocked on its
    uncommitted fence key (pg_stat_activity), which proves the deliveries overlap. Every round
    ends with one effect and one fence; no handler ever runs twice for a job_id."""
    processes, copies, rounds = 4, 8, 5
    racers.start(flavour, database_url, processes)

    async def all_ready() -> bool:
        return racers.ready()

    await wait_until(all_ready, timeout=30, message="the four workers to start")
    app = pointsapp.build_app()
    for round_no in range(rounds):
        job_id = f"same-{round_no}"
        for _ in range(copies):
            await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 3}, job_id=job_id)

        async def done() -> bool:
            return await queued(points) == 0

        await wait_until(done, timeout=40, message=f"round {round_no}:\n{racers.output()}")
        assert racers.errors() is None, racers.errors()
        assert await awards(points, job_id) == 1, f"round {round_no}"
        assert await fences(points, job_id) == 1, f"round {round_no}"

    each = await asyncio.to_thread(racers.stop)
    assert all(sum(mine.values()) >= 1 for mine in each), f"every worker took part: {each}"
    assert racers.handler_runs() == {f"same-{r}": 1 for r in range(rounds)}, "one run per job_id"
    outcomes = sum(each, start=Counter[str]())
    assert outcomes == {"succeeded": rounds, "duplicate": rounds * (copies - 1)}
    assert await awards(points) == rounds
    assert await balance(points, 1) == 3 * rounds


# -- a sync handler that ends the fence transaction itself --------------------------------------


def _commits(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
    pointsapp.apply_award_sync(payload, job, tx)
    tx.commit()


def _rolls_back(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
    pointsapp.apply_award_sync(payload, job, tx)
    tx.rollback()


def _closes(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
    pointsapp.apply_award_sync(payload, job, tx)
    tx.close()


def _session_commits(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
    with session_for(tx) as session:
        session.add(points_orm.AwardRow(job_id=job.job_id, account_id=1, points=2))
        session.commit()


def _session_rolls_back(
    payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]
) -> None:
    with session_for(tx) as session:
        session.add(points_orm.AwardRow(job_id=job.job_id, account_id=1, points=2))
        session.flush()
        session.rollback()


def _session_connection_commits(
    payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]
) -> None:
    with session_for(tx) as session:
        session.add(points_orm.AwardRow(job_id=job.job_id, account_id=1, points=2))
        session.flush()
        session.connection().commit()


@pytest.mark.parametrize(
    ("handler", "what"),
    [
        (_commits, "commit"),
        (_rolls_back, "rollback"),
        (_closes, "close"),
        (_session_commits, "commit"),
        (_session_rolls_back, "rollback"),
        (_session_connection_commits, "commit"),
    ],
    ids=["commit", "rollback", "close", "session.commit", "session.rollback", "sa_conn.commit"],
)
async def test_a_sync_handler_ending_the_fence_transaction_gets_a_clear_error_and_nothing_applies(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], handler: Any, what: str
) -> None:
    """commit(), rollback() or close() on the lent connection, and commit() or rollback() on the
    SQLAlchemy session (or its Connection), are refused before anything is sent: the work and
    the fence roll back together and the job is dead-lettered at once, with the reason."""
    app = app_with(handler)
    await enqueue(points, app, "misuse-1")
    metrics = PrometheusMetrics()
    stats = await run_worker(app, pool, metrics)

    assert stats.outcomes == {"dead_lettered": 1}
    assert await awards(points) == 0
    assert await balance(points, 1) == 0
    assert await fences(points, "misuse-1") == 0
    [dl_id] = await dead_letter_ids(points, "misuse-1")
    dl = await get_dead_letter(points, dl_id)
    assert dl.attempts == 1
    assert dl.error_class == "jobfence.TransactionMisuse"
    assert dl.last_error.startswith(
        "jobfence.TransactionMisuse: the fence transaction is committed by jobfence, with the"
        f" handler's work and its fence together; do not call {what}()"
    ), dl.last_error
    assert await queued(points) == 0


async def test_a_sync_handler_sending_commit_itself_is_a_clear_error_and_applies_once(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    """A COMMIT statement cannot be stopped before it runs: what the handler did up to there
    commits with the fence, together. jobfence sees the transaction ended and dead-letters the
    job with the reason; the fence keeps a replay from applying it again."""

    def commits_by_sql(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        pointsapp.apply_award_sync(payload, job, tx)
        tx.execute("COMMIT")

    app = app_with(commits_by_sql)
    await enqueue(points, app, "sql-commit-1")
    stats = await run_worker(app, pool, PrometheusMetrics())

    assert stats.outcomes == {"dead_lettered": 1}
    assert await awards(points, "sql-commit-1") == 1
    assert await fences(points, "sql-commit-1") == 1
    [dl_id] = await dead_letter_ids(points, "sql-commit-1")
    dl = await get_dead_letter(points, dl_id)
    assert dl.error_class == "jobfence.TransactionMisuse"
    assert "the handler ended the fence transaction itself" in dl.last_error


async def test_a_sync_handler_returning_an_awaitable_is_told_to_be_async_def(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    async def body(payload: pointsapp.Award, job: JobMeta, tx: Any) -> None:
        raise AssertionError("never awaited")

    def returns_coroutine(payload: pointsapp.Award, job: JobMeta, tx: Any) -> Any:
        return body(payload, job, tx)

    app = app_with(returns_coroutine)
    await enqueue(points, app, "coro-1")
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"retried": 1}
    cur = await points.execute("SELECT last_error FROM jobfence_queue.messages")
    [(last_error,)] = await cur.fetchall()
    assert last_error.startswith(
        "TypeError: the sync handler of consumer 'award_points' returned an awaitable: declare"
        " it `async def` to get an AsyncConnection"
    )
    assert await fences(points, "coro-1") == 0


# -- what a sync consumer's fence and pool are ---------------------------------------------------


async def test_a_sync_consumers_fence_is_inserted_in_its_transaction_with_its_ttl(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    """The handler sees its own fence row (uncommitted, in its transaction) and the fence
    expires after the consumer's fence_ttl (Acceptance 6 relies on it)."""
    seen: list[tuple[str, int]] = []

    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        row = tx.execute(
            "SELECT job_id, extract(epoch FROM expires_at - processed_at)::bigint"
            " FROM core.processed_jobs WHERE job_id = %s",
            (job.job_id,),
        ).fetchone()
        assert row is not None
        seen.append((row[0], row[1]))
        pointsapp.apply_award_sync(payload, job, tx)

    app = app_with(award, fence_ttl=timedelta(days=9))
    await enqueue(points, app, "ttl-1")
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"succeeded": 1}
    assert seen == [("ttl-1", 9 * 86400)]
    assert await awards(points, "ttl-1") == 1


async def test_a_worker_opens_the_sync_pool_only_when_its_queues_have_sync_consumers(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    opened: list[int] = []
    original = PsycopgRunner.open

    def counting(self: PsycopgRunner, *, timeout: float = 30.0) -> None:
        opened.append(1)
        original(self, timeout=timeout)

    monkeypatch.setattr(PsycopgRunner, "open", counting)
    await run_worker(pointsapp.build_app(), pool, PrometheusMetrics())
    assert opened == []
    await enqueue(points, pointsapp.build_app(flavour="sync"), "pool-1")
    with caplog.at_level(logging.INFO, logger="jobfence.worker"):
        stats = await run_worker(pointsapp.build_app(flavour="sync"), pool, PrometheusMetrics())
    assert opened == [1]
    assert stats.outcomes == {"succeeded": 1}
    assert (
        "consumer award_points on queue loyalty has a sync handler: its transactions run in 4"
        " threads on a sync connection pool"
    ) in caplog.messages


async def test_a_poison_payload_for_a_sync_consumer_is_dead_lettered_with_zero_retries(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    """Acceptance 4 for a sync consumer: its handler never runs."""
    calls: list[str] = []

    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        calls.append(job.job_id)

    app = app_with(award)
    from jobfence.adapters.pg_queue import publish_on
    from jobfence.model import Message

    await publish_on(
        points,
        Message(
            queue=pointsapp.QUEUE,
            consumer=CONSUMER,
            job_id="bad-1",
            body=b'{"account_id": 0, "points": 1}',
        ),
    )
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"poison": 1}
    assert calls == []
    cur = await points.execute(
        "SELECT attempts, error_class FROM core.dead_letters WHERE job_id = 'bad-1'"
    )
    assert await cur.fetchall() == [(1, "SchemaInvalid")]
    assert await queued(points) == 0


# -- SQLAlchemy ORM in a sync handler -------------------------------------------------------------


async def test_orm_changes_commit_with_the_fence_even_unflushed_and_a_follow_up_job_too(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    """The session's changes are flushed when the ``with`` block ends and commit with the fence;
    a job enqueued on the session (``enqueue_sync``) commits in the same transaction."""
    followers = pointsapp.build_app()

    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        with session_for(tx) as session:
            assert session.execute(text("SELECT count(*) FROM core.processed_jobs")).scalar() == 1
            if job.job_id == "orm-1":
                followers.enqueue_sync(
                    session, CONSUMER, {"account_id": 2, "points": 1}, job_id="orm-follow"
                )
            session.add(
                points_orm.AwardRow(job_id=job.job_id, account_id=payload.account_id, points=5)
            )  # not flushed by the handler: leaving the block flushes it

    app = App()
    app.consumer("orm_award", queue="orm", schema=pointsapp.Award)(award)
    await app.enqueue(points, "orm_award", {"account_id": 1, "points": 5}, job_id="orm-1")
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"succeeded": 1}
    assert await awards(points, "orm-1") == 1
    assert await fences(points, "orm-1") == 1
    cur = await points.execute("SELECT job_id, consumer FROM jobfence_queue.messages")
    assert await cur.fetchall() == [("orm-follow", CONSUMER)]


async def test_orm_changes_of_a_failing_handler_roll_back_with_the_fence(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        with session_for(tx) as session:
            session.add(points_orm.AwardRow(job_id=job.job_id, account_id=1, points=5))
            session.flush()
        follow = session_for(tx)
        with follow as again:
            assert again.get(points_orm.AwardRow, job.job_id) is not None  # flushed, in the tx
        raise pointsapp.Flaky("ledger went away after the ORM write")

    app = app_with(award)
    await enqueue(points, app, "orm-fail-1")
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"retried": 1}
    assert await awards(points) == 0
    assert await fences(points, "orm-fail-1") == 0


async def test_an_orm_flush_error_caught_by_the_handler_fails_the_job_instead_of_looking_done(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        pointsapp.apply_award_sync(payload, job, tx)
        try:
            with session_for(tx) as session:
                session.add(points_orm.Account(id=1, points=0))  # duplicate primary key
        except Exception:
            pass  # swallowed: the transaction is aborted all the same

    app = app_with(award)
    await enqueue(points, app, "orm-abort-1")
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"retried": 1}
    assert await awards(points) == 0
    assert await fences(points, "orm-abort-1") == 0
    cur = await points.execute("SELECT last_error FROM jobfence_queue.messages")
    [(last_error,)] = await cur.fetchall()
    assert last_error.startswith(f"{TransactionAborted.__module__}.TransactionAborted: the handler")


def test_session_for_refuses_what_is_not_a_sync_psycopg_connection() -> None:
    with (
        pytest.raises(TypeError, match=r"session_for needs the psycopg\.Connection a sync handler"),
        session_for(object()),  # type: ignore[arg-type]
    ):
        pass


async def test_the_readme_sync_handler_applies_an_award_once_and_dead_letters_a_hard_failure(
    pool: AsyncConnectionPool[Any], conn: AsyncConnection[Any]
) -> None:
    from test_docs_producers import README, readme_python_blocks, run_module

    blocks = readme_python_blocks()
    assert "def award_points_sync" in blocks[2]
    module = run_module(*((block, README) for block in blocks[:3]))
    app: App = module.app
    assert app.consumers["award_points_sync"].sync
    await conn.execute(
        "CREATE TABLE accounts (id integer PRIMARY KEY, points integer NOT NULL DEFAULT 0);"
        "INSERT INTO accounts (id) VALUES (7);"
    )
    for job_id, account in (("s-1", 7), ("s-1", 7), ("s-2", 999)):
        await app.enqueue(
            conn, "award_points_sync", {"account_id": account, "points": 4}, job_id=job_id
        )
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"succeeded": 1, "duplicate": 1, "dead_lettered": 1}
    assert await count(conn, "SELECT points FROM accounts WHERE id = 7") == 4
    [dl_id] = await dead_letter_ids(conn, "s-2")
    assert (await get_dead_letter(conn, dl_id)).error_class == "jobfence.HardFailure"


# -- SQLAlchemy's asyncio extension in an async handler ------------------------------------------


async def test_async_orm_changes_commit_with_the_fence_even_unflushed_and_a_follow_up_job_too(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    followers = pointsapp.build_app()
    app = App()

    @app.consumer("orm_award", queue="orm", schema=pointsapp.Award)
    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        async with async_session_for(tx) as session:
            result = await session.execute(text("SELECT count(*) FROM core.processed_jobs"))
            assert result.scalar() == 1  # the fence, in this transaction
            await followers.enqueue(
                session, CONSUMER, {"account_id": 2, "points": 1}, job_id=f"{job.job_id}-next"
            )
            session.add(points_orm.AwardRow(job_id=job.job_id, account_id=1, points=5))
        if payload.mode == "slow":  # fails after the ORM work: nothing of it may commit
            raise pointsapp.Flaky("after the ORM write")

    await app.enqueue(points, "orm_award", {"account_id": 1, "points": 5}, job_id="a-orm-1")
    await app.enqueue(
        points, "orm_award", {"account_id": 1, "points": 5, "mode": "slow"}, job_id="a-orm-2"
    )
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"succeeded": 1, "retried": 1}
    assert await awards(points, "a-orm-1") == 1
    assert await fences(points, "a-orm-1") == 1
    assert await awards(points, "a-orm-2") == 0
    assert await fences(points, "a-orm-2") == 0
    cur = await points.execute("SELECT job_id FROM jobfence_queue.messages ORDER BY job_id")
    assert [r[0] for r in await cur.fetchall()] == ["a-orm-1-next", "a-orm-2"]


@pytest.mark.parametrize("what", ["commit", "rollback"])
async def test_an_async_session_ending_the_fence_transaction_gets_a_clear_error(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], what: str
) -> None:
    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        async with async_session_for(tx) as session:
            session.add(points_orm.AwardRow(job_id=job.job_id, account_id=1, points=2))
            await session.flush()
            await getattr(session, what)()

    app = app_with(award)
    await enqueue(points, app, "a-misuse-1")
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"dead_lettered": 1}
    assert await awards(points) == 0
    assert await fences(points, "a-misuse-1") == 0
    [dl_id] = await dead_letter_ids(points, "a-misuse-1")
    dl = await get_dead_letter(points, dl_id)
    assert dl.last_error.startswith(
        "jobfence.TransactionMisuse: the fence transaction is committed by jobfence, with the"
        f" handler's work and its fence together; do not call {what}()"
    ), dl.last_error


# -- a sync job's COMMIT travels with the next job's BEGIN and fence insert ----------------------


async def in_transaction_elsewhere(conn: AsyncConnection[Any]) -> int:
    """Sessions of the test database, other than ``conn``'s, idle inside a transaction."""
    return await count(
        conn,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%%'",
    )


async def test_a_backlog_of_sync_jobs_commits_each_with_the_next_begin_and_applies_each_once(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One processor with a backlog: each sync job's COMMIT carries the next job's BEGIN and
    fence insert. A duplicate, a job whose handler fails, and a job of an async consumer
    between them each end as they would alone; every award applies once, and no transaction
    is left open."""
    chained = counting_chains(monkeypatch)

    async def award_async(payload: pointsapp.Award, job: JobMeta, tx: Any) -> None:
        await pointsapp.apply_award(payload, job, tx)

    app = app_with(pointsapp.apply_award_sync)
    app.consumer("award_async", queue=pointsapp.QUEUE, schema=pointsapp.Award)(award_async)
    job_ids = [f"chain-{n}" for n in range(12)]
    for n, job_id in enumerate(job_ids):
        await enqueue(points, app, job_id)
        if n == 3:
            await enqueue(points, app, job_ids[0])  # a duplicate
        if n == 5:
            await enqueue(points, app, "chain-fails", mode="transient")
        if n == 8:
            payload = {"account_id": 1, "points": 2}
            await app.enqueue(points, "award_async", payload, job_id="chain-async")
    stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=20)

    assert stats.outcomes == {"succeeded": 13, "duplicate": 1, "retried": 1}
    assert len(chained) >= 8, "the backlog's commits travelled alone"
    for job_id in [*job_ids, "chain-async"]:
        assert await awards(points, job_id) == 1, job_id
    assert await awards(points, "chain-fails") == 0
    assert await fences(points, "chain-fails") == 0
    assert await balance(points, 1) == 2 * 13
    assert await queued(points) == 1  # the failed job, waiting for its retry
    await wait_until(lambda: zero(in_transaction_elsewhere(points)), message="no open transaction")


# Job ids a producer may choose that would break a query quoted by hand: quotes, backslashes (an
# E'' string), placeholders of psycopg's client-side binding, dollar quotes, statement ends,
# multibyte text.
HOSTILE_JOB_IDS = [
    "it's",
    "two '' quotes",
    "back\\slash\\",
    "\\'); DELETE FROM core.processed_jobs; --",
    "%s",
    "%(job_id)s",
    "%%",
    "$$x$$",
    "ünïcødé ✓ 日本",
    "tab\tand\nnewline",
    "semi;colon",
    # and what would break an array literal (a group's fence insert takes arrays):
    '{"a","b"}',
    "comma, and } brace {",
    'double " quote',
    "NULL",
    " padded ",
]


@pytest.mark.parametrize("flavour", ["async", "sync", "async-group", "sync-group"])
async def test_job_ids_with_quotes_backslashes_and_placeholders_are_fenced_as_they_are_when_chained(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    monkeypatch: pytest.MonkeyPatch,
    flavour: str,
) -> None:
    """A backlog of jobs whose ids and tenants would break a hand-quoted query, run by one
    processor so that each COMMIT carries the next job's BEGIN and fence insert (its values
    quoted client-side): each fence row holds its job's id and tenant exactly, each award
    applies once, and the same jobs delivered again are all duplicates."""
    sync, grouped = flavour.startswith("sync"), flavour.endswith("group")
    chained = counting_chains(monkeypatch) if sync else observe_async_chains(monkeypatch)

    async def award_async(payload: pointsapp.Award, job: JobMeta, tx: Any) -> None:
        await pointsapp.apply_award(payload, job, tx)

    app = app_with(
        pointsapp.apply_award_sync if sync else award_async,
        **({"jobs_per_transaction": 10} if grouped else {}),
    )
    job_ids = HOSTILE_JOB_IDS
    for job_id in job_ids:  # the tenant too: the fence insert quotes it the same way
        payload = {"account_id": 1, "points": 2}
        await app.enqueue(points, CONSUMER, payload, job_id=job_id, tenant_id=f"t {job_id}")

    stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=20)

    assert stats.outcomes == {"succeeded": len(job_ids)}
    if not grouped:  # a group's fence insert takes arrays, and a group is not chained
        assert len(chained) >= len(job_ids) // 2, "the backlog's commits travelled alone"
    fenced = await (
        await points.execute(
            "SELECT job_id, tenant_id FROM core.processed_jobs WHERE consumer = %s",
            (CONSUMER,),
        )
    ).fetchall()
    assert sorted(fenced) == sorted((job_id, f"t {job_id}") for job_id in job_ids)
    assert await balance(points, 1) == 2 * len(job_ids)

    for job_id in job_ids:  # delivered again: every one a duplicate
        await enqueue(points, app, job_id)
    again = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=20)
    assert again.outcomes == {"duplicate": len(job_ids)}
    assert await balance(points, 1) == 2 * len(job_ids)


def observe_async_chains(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the async path's chained round trips (``Tx.commit_then_begin``)."""
    from jobfence.pgtx import Tx

    chained: list[int] = []
    original = Tx.commit_then_begin

    async def counted(self: Tx, *args: Any) -> Any:
        chained.append(1)
        return await original(self, *args)

    monkeypatch.setattr(Tx, "commit_then_begin", counted)
    return chained


async def zero(value: Any) -> bool:
    return await value == 0


@pytest.mark.timeout(60)
async def test_a_worker_cut_off_while_a_sync_job_begins_the_next_leaves_no_transaction_open(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped past its grace period while a sync handler runs, the worker gives the next job
    back at once. When the handler's thread finishes and commits, the next job's transaction
    it began is rolled back and its connection closed: nothing holds the next job's fence, and
    a later worker runs every job once (the one that committed as a duplicate)."""
    chained = counting_chains(monkeypatch)
    release = threading.Event()
    running = threading.Event()

    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        if job.job_id == "cut-0":
            running.set()
            release.wait(timeout=30)
        pointsapp.apply_award_sync(payload, job, tx)

    app = app_with(award)
    for n in range(3):
        await enqueue(points, app, f"cut-{n}")
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    try:
        first = worker(
            app, pool, queue, PrometheusMetrics(), concurrency=1, shutdown_grace_seconds=0.2
        )
        task = asyncio.create_task(first.run(until="stopped"))
        await wait_until(lambda: asyncio.to_thread(running.is_set), message="handler running")
        first.stop()
        stats = await asyncio.wait_for(task, timeout=20)
        assert stats.cut_off == 2  # cut-0, and cut-1 it took to begin with its COMMIT
        release.set()  # the thread commits cut-0 and begins cut-1 with it
        await wait_until(lambda: asyncio.to_thread(lambda: bool(chained)), message="chained")
        await wait_until(
            lambda: zero(in_transaction_elsewhere(points)), message="the begun one rolled back"
        )
        assert await awards(points, "cut-0") == 1
        assert await fences(points, "cut-1") == 0
        stats = await run_worker(app, pool, PrometheusMetrics(), queue=queue, concurrency=1)
    finally:
        release.set()
        await queue.close()
    assert stats.outcomes == {"succeeded": 2, "duplicate": 1}
    for n in range(3):
        assert await awards(points, f"cut-{n}") == 1
    assert await balance(points, 1) == 6


def test_the_sync_runner_holds_a_begun_transaction_out_of_its_pool_until_it_runs_or_is_abandoned(
    database_url: str,
) -> None:
    """run_ahead() with the next job's fence statement returns its transaction begun, on a
    connection kept out of the pool; the next run_ahead() runs in it, or abandon() rolls it
    back and gives the connection back (once: a second abandon, or a claim after it, does
    nothing)."""
    with psycopg.connect(database_url, autocommit=True) as setup:
        setup.execute("CREATE TABLE seen (id int PRIMARY KEY)")
    fence = "INSERT INTO seen (id) VALUES (%(id)s) ON CONFLICT DO NOTHING RETURNING id"
    runner = PsycopgRunner(database_url, size=1)
    runner.open()
    try:

        def work(rows: Any, tx: Any) -> list[Any]:
            return list(rows)

        rows, begun, _changed = runner.run_ahead(fence, {"id": 1}, work, then=(fence, {"id": 2}))
        assert rows == [(1,)]
        assert begun is not None and begun.fresh
        rows, begun, _changed = runner.run_ahead(
            fence, {"id": 2}, work, opened=begun, then=(fence, {"id": 1})
        )
        assert rows == [(2,)], "ran in the transaction begun for it"
        assert begun is not None and not begun.fresh, "id 1 is a duplicate"
        rows, begun, _changed = runner.run_ahead(
            fence, {"id": 1}, work, opened=begun, then=(fence, {"id": 3})
        )
        assert rows == [] and begun is not None
        begun.abandon()
        begun.abandon()
        assert begun.claim() is None
        # The one connection is back in the pool: a plain run gets it.
        assert runner.run(fence, {"id": 4}, work) == [(4,)]
    finally:
        runner.close()
    with psycopg.connect(database_url, autocommit=True) as check:
        assert check.execute("SELECT array_agg(id ORDER BY id) FROM seen").fetchone() == (
            [1, 2, 4],
        )
