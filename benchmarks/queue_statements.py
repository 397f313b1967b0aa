"""What the PostgreSQL queue's own statements cost the server, per job, without any job work.

Fills ``jobfence_queue.messages`` with ``--jobs`` messages, then drains it with 1 and with 4
connections at once, each looping the adapter's own ``receive`` (a batch of ``--batch`` under a
lease, as a worker fetches) and ``ack_many`` statements, and prints the server CPU of those
connections per job. ``--hot`` also measures a variant lease that leaves the indexed ``run_at``
alone (a ``leased_until`` column, fillfactor 50 and 100) so that PostgreSQL can update the row
in place (HOT), for comparison; the adapter does not use it.

    .venv/bin/python benchmarks/queue_statements.py            # 20,000 jobs, batches of 20
    .venv/bin/python benchmarks/queue_statements.py --hot
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import shlex
import statistics
import sys
import time
from datetime import timedelta
from multiprocessing.queues import Queue

import psutil
import psycopg
from common import admin_url_from_env, create_database, drop_database, machine_notes

from jobfence._sql import load_queries

QUERIES = load_queries("jobfence.adapters", "pg_queue.sql")
DB = "jobfence_queue_bench"

HOT_SCHEMA = """
ALTER TABLE jobfence_queue.messages ADD COLUMN leased_until timestamptz;
ALTER TABLE jobfence_queue.messages SET (fillfactor = {fillfactor});
"""
# receive, with the lease in leased_until: due = run_at passed and no live lease.
HOT_RECEIVE = (
    QUERIES["receive"]
    .replace(
        "AND m.run_at <= coalesce(%(now)s::timestamptz, now())",
        "AND m.run_at <= coalesce(%(now)s::timestamptz, now())\n"
        "          AND (m.leased_until IS NULL"
        " OR m.leased_until <= coalesce(%(now)s::timestamptz, now()))",
    )
    .replace("    run_at = coalesce(", "    leased_until = coalesce(")
)


def fill(url: str, jobs: int, extra_schema: str | None) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        if extra_schema:
            conn.execute(extra_schema.encode())
        conn.execute(
            "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body)"
            " SELECT 'q', 'c', 'job-' || i,"
            " convert_to('{\"points\": 1, \"account_id\": ' || i || '}', 'UTF8')"
            " FROM generate_series(1, %s) AS i",
            (jobs,),
        )
        conn.execute("VACUUM ANALYZE jobfence_queue.messages")
        conn.execute("CHECKPOINT")


def drain(url: str, receive: str, batch: int, out: Queue[tuple[int, float]]) -> None:
    """One connection: fetch a batch, ack it, until the queue is empty; (jobs, server CPU s)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        backend = psutil.Process(row[0])
        before = backend.cpu_times()
        jobs = 0
        params = {"queues": ["q"], "limit": batch, "now": None, "lease": timedelta(minutes=5)}
        while rows := conn.execute(receive.encode(), params).fetchall():
            conn.execute(
                QUERIES["ack_many"].encode(),
                {"ids": [r[0] for r in rows], "lease_tokens": [r[-1] for r in rows]},
            )
            jobs += len(rows)
        after = backend.cpu_times()
    out.put((jobs, (after.user + after.system) - (before.user + before.system)))


def measure(url: str, receive: str, batch: int, connections: int) -> tuple[float, float]:
    """Server CPU per job (us) and jobs per second, ``connections`` draining at once."""
    out: Queue[tuple[int, float]] = multiprocessing.Queue()
    procs = [
        multiprocessing.Process(target=drain, args=(url, receive, batch, out))
        for _ in range(connections)
    ]
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    results = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
    seconds = time.perf_counter() - started
    jobs = sum(r[0] for r in results)
    return 1e6 * sum(r[1] for r in results) / jobs, jobs / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="messages per run (20,000)")
    parser.add_argument("--batch", type=int, default=20, help="messages per fetch (20)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every variant (2)")
    parser.add_argument("--hot", action="store_true", help="also measure the HOT lease variant")
    args = parser.parse_args()
    admin_url = admin_url_from_env()
    variants: list[tuple[str, str, str | None]] = [("adapter", QUERIES["receive"], None)]
    if args.hot:
        for fillfactor in (50, 100):
            schema = HOT_SCHEMA.format(fillfactor=fillfactor)
            variants.append((f"HOT lease, fillfactor {fillfactor}", HOT_RECEIVE, schema))
    print(machine_notes())
    print(f"{args.jobs:,} messages, fetched {args.batch} at a time and acked per batch")
    results: dict[tuple[str, int], list[float]] = {}
    try:
        for round_no in range(1, args.rounds + 1):
            for name, receive, extra in variants:
                for connections in (1, 4):
                    url = asyncio.run(create_database(admin_url, DB))  # migrated
                    fill(url, args.jobs, extra)
                    per_job, rate = measure(url, receive, args.batch, connections)
                    results.setdefault((name, connections), []).append(per_job)
                    print(
                        f"round {round_no}  {name:26s} {connections} connection(s): "
                        f"server {per_job:5.1f} us per job (fetch + ack), {rate:,.0f} jobs/s"
                    )
    finally:
        asyncio.run(drop_database(admin_url, DB))
    print("\nmedian server CPU per job, and its ratio to the adapter's at the same connections")
    for (name, connections), values in results.items():
        base = statistics.median(results[("adapter", connections)])
        median = statistics.median(values)
        print(f"  {name:26s} {connections} connection(s): {median:5.1f} us  {median / base:.2f}")
    print("command:", shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
