"""Workers, the outbox relay and the TTL cleanup on a database whose default isolation level is
stricter than PostgreSQL's (``ALTER DATABASE app SET default_transaction_isolation =
'serializable'`` or ``'repeatable read'``, set by a team for its own code).

jobfence's own statements (the queue's fetch, completion and retry, the outbox's claim and
delete, the cleanup) run at ``READ COMMITTED`` whatever that default: none of them fails with a
serialization failure because another worker got there first. A job's work transaction (its
fence and its handler's statements) keeps the database's default: a serialization failure there
is the handler's, run again at once. Real PostgreSQL, real workers, each on a pool of its own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from uuid import uuid4

import pytest
from psycopg import AsyncConnection, sql

import pointsapp
from brokers import delete_everything, make_queue
from jobfence import App, JobMeta, PgQueue, PrometheusMetrics, RetryPolicy, Worker, open_pool
from jobfence.cleanup import CleanupResult, cleanup_expired
from jobfence.outbox import OutboxRelaySettings, record_queue
from jobfence.queues import parse_queue_url
from support import scalar, wait_until

LEVELS = ["repeatable read", "serializable"]
JOBS = 200
# Every job adds to account 1: at a stricter level than READ COMMITTED, the handlers' UPDATEs of
# that row conflict with each other (the application's own serialization failures, run again
# at once, then retried as transient failures): quick retries keep the test short.
QUICK = RetryPolicy(
    max_retries=100, base_seconds=0.05, cap_seconds=0.5, rationale="a test needs quick retries"
)


async def set_default_isolation(conn: AsyncConnection[Any], level: str) -> None:
    """The database's default isolation level for every new session (a DBA's setting)."""
    dbname = await scalar(conn, "SELECT current_database()")
    await conn.execute(
        sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = {}").format(
            sql.Identifier(dbname), sql.Literal(level)
        )
    )


def jobfence_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """jobfence's warnings and errors, but the test servers' own (autovacuum is off there, and
    the test Redis runs without AOF)."""
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.name.startswith("jobfence")
        and r.levelno >= logging.WARNING
        and not r.getMessage().startswith("autovacuum is off")
        and "runs without AOF" not in r.getMessage()  # the test Redis's own
    ]


async def count(conn: AsyncConnection[Any], query: str) -> int:
    return int(await scalar(conn, query))


@pytest.mark.parametrize("group", [1, 10], ids=["one-per-transaction", "group-commit"])
@pytest.mark.parametrize("level", LEVELS)
async def test_workers_on_a_database_defaulting_to_serializable_apply_each_job_once_without_stall(
    database_url: str,
    conn: AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    level: str,
    group: int,
) -> None:
    """Two workers of concurrency 4, each on its own pool, take 200 jobs that all add to one
    account: every job is applied once, none is dead-lettered, no fetch, ack or retry of the
    queue fails, and they finish in a few seconds."""
    caplog.set_level(logging.INFO, logger="jobfence")
    await conn.execute(pointsapp.SCHEMA_SQL)
    await set_default_isolation(conn, level)
    job_ids = [f"award-{i}" for i in range(JOBS)]
    await pointsapp.enqueue_awards(database_url, job_ids)
    app = pointsapp.build_app(QUICK, jobs_per_transaction=group)

    pools = [await open_pool(database_url, max_size=8, name=f"worker-{i}") for i in range(2)]
    queues = [PgQueue(pool, poll_interval_seconds=0.05) for pool in pools]
    try:
        assert await scalar(conn, "SHOW default_transaction_isolation") == "read committed"
        async with pools[0].connection() as c:  # the setting reaches the workers' sessions
            assert await scalar(c, "SHOW default_transaction_isolation") == level
        workers = [
            Worker(
                app,
                pool,
                queue,
                concurrency=4,
                batch_size=8,
                poll_seconds=0.05,
                metrics=PrometheusMetrics(),
            )
            for pool, queue in zip(pools, queues, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(w.run(until="empty") for w in workers)), timeout=60)
    finally:
        for queue in queues:
            await queue.close()
        for pool in pools:
            await pool.close()

    assert jobfence_warnings(caplog) == []
    assert await count(conn, "SELECT count(*) FROM core.dead_letters") == 0
    assert await count(conn, "SELECT count(DISTINCT job_id) FROM public.awards") == JOBS
    assert await count(conn, "SELECT count(*) FROM public.awards") == JOBS
    assert await count(conn, "SELECT points FROM public.accounts WHERE id = 1") == JOBS
    assert await count(conn, "SELECT count(*) FROM core.processed_jobs") == JOBS
    assert await count(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0


@pytest.mark.parametrize("level", LEVELS)
async def test_cleanups_at_once_on_a_database_defaulting_to_serializable_remove_every_expired_fence(
    database_url: str, conn: AsyncConnection[Any], level: str
) -> None:
    """Four cleanups at once (a scheduler on each of several hosts) over 20,000 expired fences
    in batches of 100: each skips what another holds, none fails, and every expired fence goes
    (a live one stays)."""
    await conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at)"
        " SELECT 'old-' || g, 'cleanup_test', now() - interval '8 days', now() - interval '1 day'"
        " FROM generate_series(1, 20000) g"
    )
    await conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('live', 'cleanup_test', now() + interval '7 days')"
    )
    await set_default_isolation(conn, level)
    cleaners = [await AsyncConnection.connect(database_url, autocommit=True) for _ in range(4)]
    try:
        results = await asyncio.gather(
            *(cleanup_expired(c, batch_size=100) for c in cleaners), return_exceptions=True
        )
    finally:
        for c in cleaners:
            await c.close()
    failures = [repr(r) for r in results if isinstance(r, BaseException)]
    assert failures == []
    assert sum(r.deleted for r in results if isinstance(r, CleanupResult)) == 20000
    assert await count(conn, "SELECT count(*) FROM core.processed_jobs") == 1


@pytest.mark.parametrize("level", LEVELS)
async def test_a_worker_on_redis_with_the_outbox_relay_publishes_and_applies_every_job_once(
    database_url: str,
    conn: AsyncConnection[Any],
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
    level: str,
) -> None:
    """A database on Redis Streams defaulting to a stricter level: producers write the outbox
    while two workers' relays (one active, the other standing by) publish it and the workers
    apply it; every job is published and applied once, the outbox ends empty, and nothing of
    jobfence warns."""
    caplog.set_level(logging.INFO, logger="jobfence")
    await conn.execute(pointsapp.SCHEMA_SQL)
    name = f"iso{uuid4().hex[:10]}"
    target = parse_queue_url(redis_url)
    await record_queue(conn, target.kind, target.location)
    await set_default_isolation(conn, level)
    app = pointsapp.build_app(QUICK)
    pools = [await open_pool(database_url, max_size=8, name=f"worker-{i}") for i in range(2)]
    queues = [make_queue("redis", redis_url, name) for _ in range(2)]
    try:
        workers = [
            Worker(
                app,
                pool,
                queue,
                concurrency=4,
                batch_size=8,
                poll_seconds=0.05,
                metrics=PrometheusMetrics(),
                outbox_settings=OutboxRelaySettings(poll_seconds=0.05),
            )
            for pool, queue in zip(pools, queues, strict=True)
        ]
        runs = [asyncio.create_task(w.run()) for w in workers]
        for start in range(0, JOBS, 20):  # producers keep writing while the relay publishes
            await pointsapp.enqueue_awards(
                database_url, [f"award-{i}" for i in range(start, start + 20)]
            )

        async def all_applied() -> bool:
            return await count(conn, "SELECT count(*) FROM public.awards") >= JOBS

        await wait_until(all_applied, timeout=60, message="every job applied")
        for w in workers:
            w.stop()
        await asyncio.wait_for(asyncio.gather(*runs), timeout=30)
    finally:
        for queue in queues:
            await queue.close()
        for pool in pools:
            await pool.close()
        await delete_everything("redis", redis_url, name, [pointsapp.QUEUE])

    assert jobfence_warnings(caplog) == []
    assert await count(conn, "SELECT count(*) FROM core.dead_letters") == 0
    assert await count(conn, "SELECT count(DISTINCT job_id) FROM public.awards") == JOBS
    assert await count(conn, "SELECT count(*) FROM public.awards") == JOBS
    assert await count(conn, "SELECT count(*) FROM jobfence.outbox") == 0


@pytest.mark.parametrize("level", LEVELS)
async def test_a_jobs_work_transaction_keeps_the_databases_default_isolation_level(
    database_url: str, conn: AsyncConnection[Any], level: str
) -> None:
    """The fence and the handler's statements run at the level the database's owner chose; only
    jobfence's own statements around them run at READ COMMITTED."""
    seen: list[str] = []
    app = App()

    @app.consumer("award_points", queue=pointsapp.QUEUE, schema=pointsapp.Award)
    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        seen.append(str(await scalar(tx, "SELECT current_setting('transaction_isolation')")))

    await conn.execute(pointsapp.SCHEMA_SQL)
    await set_default_isolation(conn, level)
    await pointsapp.enqueue_awards(database_url, ["award-0"])
    pool = await open_pool(database_url)
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    try:
        worker = Worker(app, pool, queue, poll_seconds=0.05, metrics=PrometheusMetrics())
        await asyncio.wait_for(worker.run(until="empty"), timeout=20)
    finally:
        await queue.close()
        await pool.close()
    assert seen == [level]
    assert await count(conn, "SELECT count(*) FROM core.processed_jobs") == 1
