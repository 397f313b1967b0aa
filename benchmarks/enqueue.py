"""Enqueue throughput: the producer role through ``jobfence.produce`` against a direct insert.

Since migration ``0019_producer_functions`` every Python producer runs ``SELECT
jobfence.produce(...)``, a ``SECURITY DEFINER`` function that checks the job and inserts the
row, so that a producer role needs no privilege on any table. Before it, producers ran the
insert itself (``DIRECT_SQL`` below: the ``produce`` statement of ``sql/outbox.sql`` up to
0018, verbatim). Both run here side by side, in alternating rounds on one database, on the
same Python path (``App.message``, the producer's trace context, then one statement on an
asyncio psycopg connection and its row), so that only the statement differs:

- ``direct``: ``DIRECT_SQL``, as a role with table privileges (the database's superuser);
- ``function``: ``App.enqueue`` (``jobfence.produce``), as a login role that holds only the
  producer role of ``jobfence roles --print-sql``.

Three shapes: one job per transaction (``BEGIN``, enqueue, ``COMMIT``); the same with the
application's own work first (an ``INSERT`` into an orders table, as in the README's example:
``order+1``); and ``--per-tx`` jobs per transaction (the statement's own cost, where a
function's overhead shows most). The queue table is emptied before each round.

    .venv/bin/python benchmarks/enqueue.py                    # 3,000 jobs x 5 rounds, ~1 min
    .venv/bin/python benchmarks/enqueue.py --jobs 10000 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql
from psycopg.conninfo import make_conninfo
from pydantic import BaseModel

from jobfence import App, JobMeta, tracing
from jobfence.adapters.pg_queue import publish_params
from jobfence.roles import render_roles_sql
from jobfence.schema import migrate

DB = "jobfence_enqueue_bench"
QUEUE = "bench"
CONSUMER = "bench_award"
PRODUCER_LOGIN = "jobfence_bench_producer_login"
ROLE_NAMES = {
    "owner": "jobfence_bench_owner",
    "producer": "jobfence_bench_producer",
    "worker": "jobfence_bench_worker",
    "ops": "jobfence_bench_ops",
    "relay": "jobfence_bench_relay",
    "alert_relay": "jobfence_bench_alert_relay",
}

# The `produce` statement every Python producer ran before migration 0019: the insert itself.
DIRECT_SQL = """
WITH target AS (
    SELECT s.queue_kind <> 'postgresql' AS external FROM jobfence.settings s
), queued AS (
    INSERT INTO jobfence_queue.messages (
        queue, consumer, job_id, body, tenant_id, correlation_id, run_at
    )
    SELECT %(queue)s::text, %(consumer)s::text, %(job_id)s::text, %(body)s::bytea,
           %(tenant_id)s::text, %(correlation_id)s::text,
           coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval
    FROM target WHERE NOT target.external
    RETURNING id, pg_notify('jobfence_queue', queue)
), outboxed AS (
    INSERT INTO jobfence.outbox (
        queue, consumer, job_id, body, tenant_id, correlation_id, due_at
    )
    SELECT %(queue)s::text, %(consumer)s::text, %(job_id)s::text, %(body)s::bytea,
           %(tenant_id)s::text, %(correlation_id)s::text,
           coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval
    FROM target WHERE target.external
    RETURNING id, pg_notify('jobfence_outbox', '')
)
SELECT id FROM queued UNION ALL SELECT id FROM outboxed
"""


def admin_url_from_env() -> str:
    return os.environ.get("JOBFENCE_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def notes() -> str:
    """The commit measured and the machine (this benchmark needs no `bench` extra, so it does
    not import common.py)."""
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--exclude", "*"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"git {commit}; {os.cpu_count()} CPUs, {platform.system()} {platform.release()},"
        f" load average {load}"
    )


def alternating(names: list[str], rounds: int) -> list[tuple[str, str]]:
    """Rounds of every name, the order reversed every other round."""
    return [
        (f"round {r + 1}/{rounds}", name)
        for r in range(rounds)
        for name in (names if r % 2 == 0 else list(reversed(names)))
    ]


ORDER_SQL = "INSERT INTO public.bench_orders (id, account_id) VALUES (%s, %s)"
ORDERS = "CREATE TABLE public.bench_orders (id text PRIMARY KEY, account_id integer NOT NULL)"

# As the producers ran it: a psycopg.sql.SQL object, compiled once (jobfence._sql.Queries).
DIRECT = psycopg.sql.SQL(DIRECT_SQL)


class AwardPoints(BaseModel):
    account_id: int
    points: int


def build_app() -> App:
    app = App()

    @app.consumer(CONSUMER, queue=QUEUE, schema=AwardPoints)
    async def award(payload: AwardPoints, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
        pass  # never runs: only the enqueue is measured

    return app


def backend_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the server process ``pid`` has used, from /proc (Linux, the
    server on this machine); NaN when it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Round:
    jobs_per_second: float
    server_us_per_job: float  # the connection's backend, by /proc
    client_us_per_job: float  # this process


async def run_round(
    system: str, url: str, app: App, *, jobs: int, per_tx: int, order: bool, tag: str
) -> Round:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        cur = await conn.execute("SELECT pg_backend_pid()")
        pid = int((await cur.fetchone() or [0])[0])
        await conn.commit()
        server_before, client_before = backend_cpu_seconds(pid), time.process_time()
        started = time.perf_counter()
        for start in range(0, jobs, per_tx):
            async with conn.transaction():
                for i in range(start, min(start + per_tx, jobs)):
                    if order:
                        await conn.execute(ORDER_SQL, (f"{tag}-{i}", i % 1000 + 1))
                    payload = {"account_id": i % 1000 + 1, "points": i % 7 + 1}
                    job_id = f"{tag}-{i}"
                    if system == "direct":
                        # What App.enqueue does around its statement (the producer's trace
                        # context, one row back), so that only the statement differs.
                        message = app.message(CONSUMER, payload, job_id=job_id)
                        with tracing.create(message) as traced:
                            cur = await conn.execute(DIRECT, publish_params(traced))
                            await cur.fetchone()
                    else:
                        await app.enqueue(conn, CONSUMER, payload, job_id=job_id)
        elapsed = time.perf_counter() - started
        server = backend_cpu_seconds(pid) - server_before
        client = time.process_time() - client_before
    return Round(jobs / elapsed, server / jobs * 1e6, client / jobs * 1e6)


async def setup(admin_url: str) -> tuple[str, str]:
    """(superuser URL, producer login URL) of a fresh migrated database with the roles."""
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
        await conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")  # type: ignore[arg-type]
        await conn.execute(f"CREATE DATABASE {DB}")  # type: ignore[arg-type]
    url = make_conninfo(admin_url, dbname=DB)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
        await conn.execute(ORDERS)
        await conn.execute(render_roles_sql(ROLE_NAMES))  # type: ignore[arg-type]
        await conn.execute(f"DROP ROLE IF EXISTS {PRODUCER_LOGIN}")  # type: ignore[arg-type]
        await conn.execute(
            f"CREATE ROLE {PRODUCER_LOGIN} LOGIN IN ROLE {ROLE_NAMES['producer']}"  # type: ignore[arg-type]
        )
        await conn.execute(f"GRANT INSERT ON public.bench_orders TO {PRODUCER_LOGIN}")  # type: ignore[arg-type]
    return url, make_conninfo(url, user=PRODUCER_LOGIN)


async def teardown(admin_url: str, url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for name in [PRODUCER_LOGIN, *ROLE_NAMES.values()]:
            await conn.execute(f"REASSIGN OWNED BY {name} TO CURRENT_USER")  # type: ignore[arg-type]
            await conn.execute(f"DROP OWNED BY {name}")  # type: ignore[arg-type]
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
        await conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")  # type: ignore[arg-type]
        for name in [PRODUCER_LOGIN, *ROLE_NAMES.values()]:
            await conn.execute(f"DROP ROLE IF EXISTS {name}")  # type: ignore[arg-type]


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000, help="jobs per round (3000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each system (5)")
    parser.add_argument("--per-tx", type=int, default=50, help="jobs per transaction, batched (50)")
    args = parser.parse_args(argv)
    admin_url = admin_url_from_env()
    print("command:", shlex.join(["python", "benchmarks/enqueue.py", *argv]))
    print(notes())
    url, producer_url = await setup(admin_url)
    async with await psycopg.AsyncConnection.connect(url) as conn:
        cur = await conn.execute("SELECT version(), current_setting('synchronous_commit')")
        print("server:", await cur.fetchone())
    app = build_app()
    urls = {"direct": url, "function": producer_url}
    results: dict[tuple[str, str], list[Round]] = {}
    shapes = [("1", 1, False), ("order+1", 1, True), (str(args.per_tx), args.per_tx, False)]
    try:
        for shape, per_tx, order in shapes:
            for label, system in alternating(["direct", "function"], args.rounds):
                async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
                    await admin.execute("TRUNCATE jobfence_queue.messages, public.bench_orders")
                    await admin.execute("CHECKPOINT")
                result = await run_round(
                    system, urls[system], app, jobs=args.jobs, per_tx=per_tx, order=order, tag=label
                )
                results.setdefault((shape, system), []).append(result)
                print(
                    f"  {shape:>7} {label} {system:<8}"
                    f" {result.jobs_per_second:8.0f} jobs/s, server {result.server_us_per_job:5.0f}"
                    f" us/job, client {result.client_us_per_job:5.0f} us/job"
                )
    finally:
        await teardown(admin_url, url)

    print()
    print("Medians of the rounds; CPU per job: the server backend's (by /proc) and this process's.")
    print()
    print(
        "| jobs per transaction | | direct insert (superuser)"
        " | jobfence.produce (producer role) | function / direct |"
    )
    print("|---|---|---|---|---|")
    for shape, _, _ in shapes:
        for what, unit, pick in (
            ("throughput", "jobs/s", lambda r: r.jobs_per_second),
            ("server CPU", "us/job", lambda r: r.server_us_per_job),
            ("client CPU", "us/job", lambda r: r.client_us_per_job),
        ):
            direct = statistics.median(pick(r) for r in results[(shape, "direct")])
            function = statistics.median(pick(r) for r in results[(shape, "function")])
            print(
                f"| {shape} | {what} | {direct:,.0f} {unit} | {function:,.0f} {unit} |"
                f" {function / direct:.3f} ({(function / direct - 1) * 100:+.1f}%) |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
