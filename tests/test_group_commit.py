"""Group commit: a consumer's ``jobs_per_transaction`` lets a worker commit several waiting jobs
in one transaction. Every guarantee of one transaction per job still holds, per job: the fence
is in the transaction that holds the work, a duplicate (in the group, or already fenced) runs
nothing, a crash leaves neither work nor fence, a failure fails that job alone under its own
policy. Real PostgreSQL, real workers, real processes for the crash.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import App, ConfigError, JobMeta, PgQueue, PrometheusMetrics, open_pool
from jobfence.adapters.pg_queue import publish_on
from jobfence.app import Consumer
from jobfence.harness import Harness
from jobfence.model import Message
from support import job_groups, wait_until
from test_acceptance_harness import (
    WorkerProcess,
    awards,
    balance,
    count,
    dead_letter_ids,
    fences,
    queued,
    run_worker,
    worker,
)

CONSUMER = "award_points"


@pytest.fixture
def crashing() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for proc in started:
        proc.cleanup()


def grouped_app(
    group: int,
    seen: list[tuple[str, int]] | None = None,
    *,
    other: str | None = None,
    flavour: str = "async",
) -> App:
    """pointsapp's award consumer with ``jobs_per_transaction=group``; ``seen`` collects
    (job_id, transaction id) of every handler call; ``other`` adds a second consumer on the same
    queue, one job per transaction, recorded alike. ``flavour`` ``sync``: the same handlers as
    plain def handlers (pointsapp.as_sync), a group committing in one sync transaction."""
    app = App()

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        if seen is not None:
            cur = await tx.execute("SELECT txid_current()")
            row = await cur.fetchone()
            assert row is not None
            seen.append((job.job_id, int(row[0])))
        await pointsapp.apply_award(payload, job, tx)

    handler = pointsapp.flavoured(award, flavour)
    app.consumer(
        CONSUMER, queue=pointsapp.QUEUE, schema=pointsapp.Award, jobs_per_transaction=group
    )(handler)
    if other is not None:
        app.consumer(other, queue=pointsapp.QUEUE, schema=pointsapp.Award)(handler)
    return app


def transactions(seen: list[tuple[str, int]]) -> list[list[str]]:
    """The job_ids of each transaction, in the order the transactions began."""
    groups: dict[int, list[str]] = {}
    for job_id, txid in seen:
        groups.setdefault(txid, []).append(job_id)
    return list(groups.values())


async def applied_once(conn: AsyncConnection[Any], job_ids: Iterable[str]) -> None:
    """Each of ``job_ids`` has exactly one effect (an awards row) and one fence row."""
    for job_id in job_ids:
        assert await awards(conn, job_id) == 1, job_id
        assert await fences(conn, job_id) == 1, job_id


async def enqueue(conn: AsyncConnection[Any], app: App, *job_ids: str, **award: Any) -> None:
    for job_id in job_ids:
        payload = {"account_id": 1, "points": 2, **award}
        await app.enqueue(conn, CONSUMER, payload, job_id=job_id)


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_group_commit_runs_waiting_jobs_of_a_consumer_in_one_transaction(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    flavour: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """30 waiting jobs, ``jobs_per_transaction=10``, one processor: three transactions of ten,
    every effect once. The same run with the default commits 30 transactions."""
    job_ids = [f"g-{i:02}" for i in range(30)]
    for group, expected in ((10, [job_ids[0:10], job_ids[10:20], job_ids[20:30]]), (1, None)):
        await points.execute("TRUNCATE public.awards, core.processed_jobs")
        seen: list[tuple[str, int]] = []
        app = grouped_app(group, seen, flavour=flavour)
        await enqueue(points, app, *job_ids)
        metrics = PrometheusMetrics()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jobfence.worker"):
            stats = await run_worker(app, pool, metrics, concurrency=1, batch_size=30)
        announced = (
            "consumer award_points on queue loyalty commits up to 10 waiting jobs per"
            " transaction (group commit)"
        )
        assert (announced in caplog.messages) == (group == 10)
        assert dict(stats.outcomes) == {"succeeded": 30}
        assert metrics.count("succeeded") == 30
        if expected is not None:
            assert transactions(seen) == expected
            assert job_groups(metrics, "committed") == 3
        else:
            assert len(transactions(seen)) == 30
            assert job_groups(metrics, "committed") == 0
        assert job_groups(metrics, "rolled_back") == 0
        await applied_once(points, job_ids)
        assert await queued(points) == 0


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_group_commit_a_failing_job_rolls_the_group_back_and_each_job_runs_alone(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    flavour: str,
) -> None:
    """A hard failure and a transient one inside a group of 10: the group rolls back, then each
    job runs in its own transaction under its own policy. The 8 good jobs apply once; the hard
    one is a dead letter after 1 attempt, the transient one is scheduled for attempt 2; neither
    has a fence."""
    seen: list[tuple[str, int]] = []
    app = grouped_app(10, seen, flavour=flavour)
    ok = [f"ok-{i}" for i in range(8)]
    await enqueue(points, app, *ok[:4])
    await enqueue(points, app, "hard-1", mode="hard")
    await enqueue(points, app, *ok[4:6])
    await enqueue(points, app, "transient-1", mode="transient")
    await enqueue(points, app, *ok[6:])
    metrics = PrometheusMetrics()
    stats = await run_worker(app, pool, metrics, concurrency=1, batch_size=10)

    assert dict(stats.outcomes) == {"succeeded": 8, "dead_lettered": 1, "retried": 1}
    # The group ran up to the hard failure, then every job ran alone, in order.
    first, *alone = transactions(seen)
    assert first == [*ok[:4], "hard-1"]
    alone_order = [*ok[:4], "hard-1", *ok[4:6], "transient-1", *ok[6:]]
    assert alone == [[job_id] for job_id in alone_order]
    await applied_once(points, ok)
    assert await balance(points, 1) == 2 * len(ok)
    for job_id in ("hard-1", "transient-1"):
        assert await awards(points, job_id) == 0
        assert await fences(points, job_id) == 0
    assert len(await dead_letter_ids(points, "hard-1")) == 1
    assert (
        await count(points, "SELECT attempts FROM core.dead_letters WHERE job_id = 'hard-1'") == 1
    )
    assert (
        await count(
            points,
            "SELECT count(*) FROM jobfence_queue.messages WHERE job_id = 'transient-1'"
            " AND attempts = 1 AND run_at > now()",
        )
        == 1
    )
    assert metrics.count("retried") == metrics.count("dead_lettered") == 1
    assert job_groups(metrics, "rolled_back") == 1
    assert job_groups(metrics, "committed") == 0


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_group_commit_duplicates_in_the_group_and_already_fenced_jobs_run_nothing(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    flavour: str,
) -> None:
    """One group holds a job_id twice and a job whose fence already exists: the handler runs
    once for the first, never for the second, and both count as duplicates."""
    seen: list[tuple[str, int]] = []
    app = grouped_app(10, seen, flavour=flavour)
    await points.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('fenced-1', %s, now() + interval '7 days')",
        (CONSUMER,),
    )
    await enqueue(points, app, "a-1", "twice-1", "b-1", "twice-1", "fenced-1", "c-1")
    metrics = PrometheusMetrics()
    stats = await run_worker(app, pool, metrics, concurrency=1, batch_size=10)

    assert dict(stats.outcomes) == {"succeeded": 4, "duplicate": 2}
    assert transactions(seen) == [["a-1", "twice-1", "b-1", "c-1"]]
    await applied_once(points, ("a-1", "twice-1", "b-1", "c-1"))
    assert await awards(points, "fenced-1") == 0
    assert await queued(points) == 0
    assert metrics.count("duplicate") == 2


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_group_commit_poison_in_a_group_is_dead_lettered_without_retry(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    flavour: str,
) -> None:
    """A payload that is not JSON among four good jobs: poison, dead-lettered at attempt 1 with
    its bytes; the four good ones apply once."""
    app = grouped_app(10, flavour=flavour)
    await enqueue(points, app, "p-1", "p-2")
    await publish_on(
        points,
        Message(queue=pointsapp.QUEUE, consumer=CONSUMER, job_id="poison-1", body=b"{not json"),
    )
    await enqueue(points, app, "p-3", "p-4")
    stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=10)

    assert dict(stats.outcomes) == {"succeeded": 4, "poison": 1}
    for job_id in ("p-1", "p-2", "p-3", "p-4"):
        assert await awards(points, job_id) == 1
    cur = await points.execute(
        "SELECT attempts, error_class, payload_encoding FROM core.dead_letters"
        " WHERE job_id = 'poison-1'"
    )
    assert await cur.fetchall() == [(1, "InvalidJson", "base64")]
    assert await queued(points) == 0


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_group_commit_keeps_other_consumers_jobs_in_their_own_transactions(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    flavour: str,
) -> None:
    """A queue shared with a consumer that commits one job per transaction: a group ends at
    the other consumer's job, which runs alone, and the next group starts after it."""
    seen: list[tuple[str, int]] = []
    app = grouped_app(10, seen, other="audit", flavour=flavour)
    await enqueue(points, app, "m-1", "m-2", "m-3")
    await app.enqueue(points, "audit", {"account_id": 2, "points": 5}, job_id="single-1")
    await enqueue(points, app, "m-4", "m-5")
    stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=10)

    assert dict(stats.outcomes) == {"succeeded": 6}
    assert transactions(seen) == [["m-1", "m-2", "m-3"], ["single-1"], ["m-4", "m-5"]]
    assert await balance(points, 1) == 10
    assert await balance(points, 2) == 5


async def test_group_commit_same_job_ids_in_concurrent_groups_have_exactly_one_effect(
    database_url: str, points: AsyncConnection[Any]
) -> None:
    """Acceptance 1 for groups: three workers, each on its own pool, fetch groups holding the
    same ten job_ids at once, 5 rounds. The first group to insert its fences waits in its first
    handler until another worker's group is blocked on those uncommitted fence keys (seen in
    pg_stat_activity): the groups overlap. Every job_id ends with one effect and one fence."""
    workers_n, ids_n, rounds = 3, 10, 5
    probe = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    blocked_seen = 0
    waited: set[int] = set()

    async def others_blocked() -> bool:
        return (
            await count(
                probe,
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            >= 1
        )

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        nonlocal blocked_seen
        round_no = int(job.job_id.split("-")[1])
        if round_no not in waited:
            waited.add(round_no)
            await wait_until(others_blocked, timeout=15, message="another group to block")
            blocked_seen += 1
        await pointsapp.apply_award(payload, job, tx)

    app = App()
    app.consumer(
        CONSUMER, queue=pointsapp.QUEUE, schema=pointsapp.Award, jobs_per_transaction=ids_n
    )(award)
    metrics = PrometheusMetrics()
    pools = [
        await open_pool(database_url, min_size=1, max_size=3, name=f"g1-{i}")
        for i in range(workers_n)
    ]
    queues = [PgQueue(p, poll_interval_seconds=0.05) for p in pools]
    try:
        for round_no in range(rounds):
            job_ids = [f"r-{round_no}-{i}" for i in range(ids_n)]
            for _ in range(workers_n):
                await enqueue(points, app, *job_ids)
            runs = [
                worker(app, p, q, metrics, concurrency=1, batch_size=ids_n).run(until="idle")
                for p, q in zip(pools, queues, strict=True)
            ]
            stats = await asyncio.wait_for(asyncio.gather(*runs), timeout=60)
            outcomes = sum((s.outcomes for s in stats), start=Counter[str]())
            assert outcomes == {"succeeded": ids_n, "duplicate": ids_n * (workers_n - 1)}
            await applied_once(points, job_ids)
            assert await queued(points) == 0
    finally:
        for q in queues:
            await q.close()
        for p in pools:
            await p.close()
        await probe.close()
    assert blocked_seen == rounds
    assert await balance(points, 1) == 2 * ids_n * rounds


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_group_commit_crash_mid_group_leaves_no_work_and_no_fence(  # noqa: PLR0917
    database_url: str,
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    tmp_path: Path,
    crashing: list[WorkerProcess],
    flavour: str,
) -> None:
    """Acceptance 2 for groups: a worker process SIGKILLed while the fifth job of a group runs,
    after the four before it ran their work in the same transaction. Nothing of the five is
    visible, before or after the kill; after the 1 s lease all five are delivered again and
    each applies once. With an async handler, and with a sync one (one sync transaction)."""
    app = pointsapp.build_app()
    job_ids = [f"crash-{i}" for i in range(4)] + ["crash-4-block"]
    for job_id in job_ids:
        await app.enqueue(points, CONSUMER, {"account_id": 3, "points": 4}, job_id=job_id)

    proc = WorkerProcess("group", database_url, tmp_path, flavour)
    crashing.append(proc)
    _, job_id, attempt = await proc.wait_in_handler()
    assert (job_id, attempt) == ("crash-4-block", 1)
    # Inside the group's transaction all five awards rows exist; outside, none.
    assert (tmp_path / "inside").read_text().strip() == "5"
    assert await awards(points) == 0

    proc.proc.send_signal(signal.SIGKILL)
    assert await proc.wait_exit() == -signal.SIGKILL
    assert await awards(points) == 0
    for job_id in job_ids:
        assert await fences(points, job_id) == 0
    assert await queued(points) == 5

    seen: list[tuple[str, int]] = []
    stats = await run_worker(grouped_app(5, seen), pool, PrometheusMetrics(), until="empty")
    assert dict(stats.outcomes) == {"succeeded": 5}
    await applied_once(points, job_ids)
    assert await balance(points, 3) == 4 * 5


async def test_group_commit_deadlocked_groups_one_rolls_back_and_its_jobs_run_alone(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    """Two groups lock the same two accounts in opposite orders: PostgreSQL aborts one of them
    (DeadlockDetected); that group rolls back, its jobs run one transaction each, and every job
    applies once. Each group's first handler waits until the other group's first handler has
    locked its row, so the deadlock happens every run."""
    both_locked = asyncio.Barrier(2)
    waited: set[str] = set()

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        if job.job_id.endswith("-first") and job.job_id not in waited:
            waited.add(job.job_id)  # in the groups only, not when run alone after
            await asyncio.wait_for(both_locked.wait(), timeout=10)

    app = App()
    app.consumer(CONSUMER, queue=pointsapp.QUEUE, schema=pointsapp.Award, jobs_per_transaction=2)(
        award
    )
    for job_id, account in (("a-first", 1), ("a-second", 2), ("b-first", 2), ("b-second", 1)):
        await app.enqueue(points, CONSUMER, {"account_id": account, "points": 3}, job_id=job_id)
    queue = PgQueue(pool)
    harness = Harness(app, pool, queue, metrics=PrometheusMetrics())
    group_a = await queue.receive([pointsapp.QUEUE], max_messages=2, lease_seconds=60)
    group_b = await queue.receive([pointsapp.QUEUE], max_messages=2, lease_seconds=60)
    assert [d.message.job_id for d in group_a + group_b] == [
        "a-first",
        "a-second",
        "b-first",
        "b-second",
    ]
    async with pool.connection() as conn_a, pool.connection() as conn_b:
        for conn in (conn_a, conn_b):
            await conn.execute("SET deadlock_timeout = '100ms'")
        results = await asyncio.gather(
            harness.handle_group(group_a, conn_a), harness.handle_group(group_b, conn_b)
        )
        # Exactly one group was the deadlock's victim and committed nothing.
        assert sorted(r is None for r in results) == [False, True], results
        loser, conn = (group_a, conn_a) if results[0] is None else (group_b, conn_b)
        for delivery in loser:
            assert await harness.handle(delivery, conn) == "succeeded"
    await queue.close()

    await applied_once(points, ("a-first", "a-second", "b-first", "b-second"))
    assert await balance(points, 1) == await balance(points, 2) == 6


@pytest.mark.parametrize("value", [0, 101, True, "10", 2.5])
def test_jobs_per_transaction_out_of_range_is_a_config_error(value: Any) -> None:
    app = App()
    with pytest.raises(ConfigError) as caught:
        app.add(
            Consumer(
                name=CONSUMER,
                queue=pointsapp.QUEUE,
                schema=pointsapp.Award,
                handler=pointsapp.apply_award,
                jobs_per_transaction=value,
            )
        )
    assert str(caught.value) == (
        f"consumer 'award_points': jobs_per_transaction must be an integer from 1 to 100,"
        f" got {value!r}"
    )
    assert app.get(CONSUMER) is None
