"""``jobfence demo``: a points-awarding workload with duplicates, poison and failures.

It shows, with numbers a person can check, that each award applies once however often it is
delivered, that a poison payload is dead-lettered without retries, that a transient failure
recovers, and that a job that always fails ends as one dead letter after 6 deliveries.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
import uuid
from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, Field

from jobfence import db
from jobfence.adapters.pg_queue import PgQueue
from jobfence.adapters.prometheus import PrometheusMetrics
from jobfence.app import App
from jobfence.model import JobMeta, Message
from jobfence.outbox import OutboxRelaySettings
from jobfence.ports import QueuePort
from jobfence.producer import publish_async
from jobfence.queue_record import adopt_queue
from jobfence.queues import QueueTarget, open_queue, parse_queue_url
from jobfence.redact import redact_url
from jobfence.retry import RetryPolicy
from jobfence.schema import migrate
from jobfence.worker import Worker

QUEUE = "demo-loyalty"
ACCOUNTS = 20

DEMO_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS jobfence_demo;
CREATE TABLE IF NOT EXISTS jobfence_demo.accounts (
    id integer PRIMARY KEY, points bigint NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS jobfence_demo.awards (
    job_id text PRIMARY KEY, account_id integer NOT NULL, points integer NOT NULL,
    awarded_at timestamptz NOT NULL DEFAULT now());
"""


class AwardPoints(BaseModel):
    account_id: int = Field(ge=1)
    points: int = Field(gt=0)
    fail_until_attempt: int = 0
    always_fail: bool = False


# The demo shortens the backoff so it finishes in seconds. The spec requires a rationale for
# every override, and the worker logs it at start-up.
DEMO_RETRY = RetryPolicy(
    base_seconds=0.2,
    cap_seconds=1.0,
    rationale="demo queue: backoff shortened so the whole demo runs in seconds",
)


class UpstreamTimeout(Exception):
    """Stands in for a flaky dependency."""


def build_app() -> App:
    app = App()

    @app.consumer("award_points", queue=QUEUE, schema=AwardPoints, retry=DEMO_RETRY)
    async def award_points(payload: AwardPoints, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        if payload.always_fail:
            raise UpstreamTimeout("the loyalty ledger did not answer (always, in this demo)")
        if job.attempt < payload.fail_until_attempt:
            raise UpstreamTimeout(f"the loyalty ledger did not answer (attempt {job.attempt})")
        await tx.execute(
            "INSERT INTO jobfence_demo.awards (job_id, account_id, points) VALUES (%s, %s, %s)",
            (job.job_id, payload.account_id, payload.points),
        )
        await tx.execute(
            "UPDATE jobfence_demo.accounts SET points = points + %s WHERE id = %s",
            (payload.points, payload.account_id),
        )

    return app


async def _scalar(conn: AsyncConnection[Any], query: Any, params: Any = None) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    return row[0] if row else None


async def _enqueue(
    app: App, conn: AsyncConnection[Any], run: str, jobs: int, duplicates: int
) -> dict[str, int]:
    rng = random.Random(42)
    awards = [
        AwardPoints(account_id=rng.randint(1, ACCOUNTS), points=rng.randint(1, 50))
        for _ in range(jobs)
    ]
    expected_points = sum(a.points for a in awards)
    # Each award once, then redeliveries of some of them with the same job_id, as a broker
    # timeout or a deploy would cause.
    order = list(range(jobs)) + [rng.randrange(jobs) for _ in range(duplicates)]
    async with conn.transaction():
        for i in order:
            await app.enqueue(
                conn,
                "award_points",
                awards[i],
                job_id=f"{run}:award-{i + 1}",
                tenant_id="demo",
                correlation_id=f"{run}:order-{i + 1}",
            )
        # A transient failure that recovers on the third delivery.
        flaky = AwardPoints(account_id=1, points=7, fail_until_attempt=3)
        expected_points += flaky.points
        await app.enqueue(
            conn,
            "award_points",
            flaky,
            job_id=f"{run}:flaky",
            tenant_id="demo",
            correlation_id=f"{run}:flaky",
        )
        # A job that always fails: 6 deliveries, then one dead letter.
        await app.enqueue(
            conn,
            "award_points",
            AwardPoints(account_id=2, points=5, always_fail=True),
            job_id=f"{run}:doomed",
            tenant_id="demo",
            correlation_id=f"{run}:doomed",
        )
        # A poison payload: points is not a number. Published raw, as a buggy producer would.
        await publish_async(
            conn,
            Message(
                queue=QUEUE,
                consumer="award_points",
                job_id=f"{run}:poison",
                body=b'{"account_id": 3, "points": "lots"}',
                tenant_id="demo",
                correlation_id=f"{run}:poison",
            ),
        )
    return {
        "expected_points": expected_points,
        "expected_effects": jobs + 1,
        "deliveries": jobs + duplicates + 3,
    }


async def _open_queue(
    target: QueueTarget, pool: AsyncConnectionPool[Any], conn: AsyncConnection[Any], out: Any
) -> QueuePort:
    """The demo's queue, emptied of an earlier run's jobs: the PostgreSQL one polled often (the
    retries are seconds apart), or the broker, which must be the one the database records
    (``jobfence migrate --queue-url URL`` moves it there first)."""
    await conn.execute("DELETE FROM jobfence_queue.messages WHERE queue = %s", (QUEUE,))
    await conn.execute("DELETE FROM jobfence.outbox WHERE queue = %s", (QUEUE,))
    await conn.commit()
    print(f"queue: {target.describe()}", file=out)
    await adopt_queue(conn, target)  # the demo never moves its database: migrate does
    return (
        await open_queue(target, pool)
        if target.external
        else PgQueue(pool, poll_interval_seconds=0.1)
    )


async def run_demo(
    *, jobs: int = 200, duplicates: int = 50, out: Any = None, queue_url: str | None = None
) -> int:
    """Run the demo on the PostgreSQL queue, or on the broker ``queue_url`` names (then the
    jobs go through the outbox, published by the worker's relay)."""
    out = out or sys.stdout
    target = parse_queue_url(queue_url)
    # The demo alone uses the embedded PostgreSQL when JOBFENCE_DATABASE_URL is unset (and
    # logs where, before the level below hides jobfence's INFO lines).
    url = db.resolve_database_url(embedded_when_unset=True)
    # The progress display and the summary say it all; keep per-job log lines out of the way.
    logging.getLogger("jobfence").setLevel(logging.ERROR)
    print(f"database: {redact_url(url)}", file=out)
    pool = await db.open_pool(url, max_size=8, name="jobfence-demo")
    run = f"demo-{uuid.uuid4().hex[:8]}"
    app = build_app()
    metrics = PrometheusMetrics()
    opened: list[QueuePort] = []
    try:
        async with pool.connection() as conn:
            applied = await migrate(conn)
            print(f"migrations applied: {len(applied)}", file=out)
            await conn.execute(DEMO_SCHEMA)
            opened.append(queue := await _open_queue(target, pool, conn, out))
            await conn.execute(
                "INSERT INTO jobfence_demo.accounts (id) SELECT generate_series(1, %s)"
                " ON CONFLICT DO NOTHING",
                (ACCOUNTS,),
            )
            before = await _scalar(
                conn, "SELECT coalesce(sum(points), 0) FROM jobfence_demo.accounts"
            )
            plan = await _enqueue(app, conn, run, jobs, duplicates)
        print(
            f"run {run}: enqueued {plan['deliveries']} deliveries "
            f"({jobs} award jobs, {duplicates} duplicates, 1 flaky, 1 always failing, 1 poison)",
            file=out,
        )

        worker = Worker(
            app,
            pool,
            queue,
            concurrency=4,
            poll_seconds=0.1,
            metrics=metrics,
            outbox_settings=OutboxRelaySettings(poll_seconds=0.1),
        )
        started = time.perf_counter()
        task = asyncio.create_task(worker.run(until="empty"))
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            size = await queue.size([QUEUE])
            s = worker.stats.outcomes
            print(
                f"  {time.perf_counter() - started:5.1f}s  handled {worker.stats.handled:4d}  "
                f"succeeded {s['succeeded']:4d}  duplicates {s['duplicate']:3d}  "
                f"retries {s['retried']:2d}  dead letters {s['dead_lettered'] + s['poison']:2d}  "
                f"queue {size.total}",
                file=out,
            )
        await task
        elapsed = time.perf_counter() - started

        async with pool.connection() as conn:
            effects = await _scalar(
                conn,
                "SELECT count(*) FROM jobfence_demo.awards WHERE job_id LIKE %s",
                (f"{run}:%",),
            )
            after = await _scalar(
                conn, "SELECT coalesce(sum(points), 0) FROM jobfence_demo.accounts"
            )
            fences = await _scalar(
                conn, "SELECT count(*) FROM core.processed_jobs WHERE job_id LIKE %s", (f"{run}:%",)
            )
            cur = await conn.execute(
                "SELECT job_id, attempts, error_class FROM core.dead_letters"
                " WHERE job_id LIKE %s ORDER BY id",
                (f"{run}:%",),
            )
            dead = await cur.fetchall()
    finally:
        for each in opened:
            await each.close()
        await pool.close()

    s = worker.stats.outcomes
    checks = [
        ("effects applied", effects, plan["expected_effects"]),
        ("points awarded", after - before, plan["expected_points"]),
        ("fence rows", fences, plan["expected_effects"]),
        ("duplicates skipped", s["duplicate"], duplicates),
        ("retries", s["retried"], 2 + 5),
        ("dead letters", len(dead), 2),
    ]
    print(f"\nsummary ({elapsed:.1f}s):", file=out)
    ok = True
    for label, got, want in checks:
        mark = "ok" if got == want else "MISMATCH"
        ok = ok and got == want
        print(f"  {label:<20} {got:>6}   expected {want:<6} {mark}", file=out)
    for job_id, attempts, error_class in dead:
        print(f"  dead letter: {job_id}  attempts={attempts}  {error_class}", file=out)
    print(
        "\nall checks passed: each award applied once, no failure lost"
        if ok
        else "\nSOME CHECKS FAILED",
        file=out,
    )
    return 0 if ok else 1
