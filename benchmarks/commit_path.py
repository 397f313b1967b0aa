"""The commit path's client CPU per job: one simple-protocol query against three pipelined
statements.

Two loops on one connection, alternating rounds, each job being the next job's fence insert
(``fence_insert`` of ``core.sql``, with its ``RETURNING``) started with the previous job's
``fence_held`` check and COMMIT, then one work statement:

- **query** (what the worker does): ``Tx.commit_then_begin``, the check, COMMIT, BEGIN and the
  fence insert as one simple-protocol query, the fence's values quoted client-side by psycopg's
  ``ClientCursor``;
- **pipeline** (what the worker did before): the check and COMMIT queued as psycopg queues its
  own COMMIT, BEGIN, and the fence insert as an extended-protocol statement with its parameters
  bound server-side (prepared after psycopg's fifth run), all in one psycopg pipeline.

Both are one round trip per job. It prints, per round, the client CPU and wall time per job of
each and PostgreSQL's CPU per job (the connection's backend, from ``/proc``), then the ratios.

    PYTHONPATH=src python benchmarks/commit_path.py            # 4,000 jobs x 4 rounds
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from statistics import median
from typing import Any

import psycopg
from common import admin_url_from_env, create_database, drop_database

from jobfence import runtime
from jobfence.harness import FENCE_HELD, SQL
from jobfence.pgtx import Tx

DBNAME = "jobfence_commit_path"
FENCE = SQL.text("fence_insert")
WORK = "UPDATE bench_a SET points = points + 1 WHERE id = 1"
Loop = Callable[[psycopg.AsyncConnection[Any], int, str], Awaitable[None]]


def params(job_id: str) -> dict[str, Any]:
    return {"job_id": job_id, "consumer": "c", "tenant_id": None, "ttl": timedelta(days=7)}


async def query(conn: psycopg.AsyncConnection[Any], jobs: int, tag: str) -> None:
    tx, cur = await Tx.begin(conn, FENCE, params(f"{tag}0"))
    assert await cur.fetchone() is not None
    for i in range(1, jobs):
        await conn.execute(WORK)
        tx, cur = await tx.commit_then_begin(FENCE, params(f"{tag}{i}"), FENCE_HELD)
        assert await cur.fetchone() is not None
    await tx.commit(FENCE_HELD)


async def pipeline(conn: psycopg.AsyncConnection[Any], jobs: int, tag: str) -> None:
    tx = psycopg.AsyncTransaction(conn)
    async with conn.pipeline():
        await tx.__aenter__()
        cur = await conn.execute(FENCE, params(f"{tag}0"))
    assert await cur.fetchone() is not None
    for i in range(1, jobs):
        await conn.execute(WORK)
        following = _Chained(conn)
        async with conn.pipeline():
            async with conn.lock:
                await conn.wait(conn._exec_command(FENCE_HELD))
            await tx.__aexit__(None, None, None)  # queues COMMIT
            await following.__aenter__()  # queues BEGIN
            cur = await conn.execute(FENCE, params(f"{tag}{i}"))
        assert await cur.fetchone() is not None
        tx = following
    await tx.__aexit__(None, None, None)


class _Chained(psycopg.AsyncTransaction):
    """A main transaction whose BEGIN is queued after the previous one's COMMIT."""

    def _push_savepoint(self) -> None:
        self._outer_transaction = True
        self._stack_index = 0
        self._conn._num_transactions = 1


def backend_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main_async(jobs: int, rounds: int) -> None:
    admin = admin_url_from_env()
    url = await create_database(admin, DBNAME)
    loops: dict[str, Loop] = {"query": query, "pipeline": pipeline}
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute("CREATE SCHEMA IF NOT EXISTS core")
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS core.processed_jobs (job_id text, consumer text,"
                " tenant_id text, expires_at timestamptz, PRIMARY KEY (job_id, consumer))"
            )
            await conn.execute("CREATE TABLE bench_a (id int PRIMARY KEY, points bigint)")
            await conn.execute("INSERT INTO bench_a VALUES (1, 0)")
            pid = conn.info.backend_pid
            client: dict[str, list[float]] = {name: [] for name in loops}
            server: dict[str, list[float]] = {name: [] for name in loops}
            for n in range(rounds):
                order = list(loops) if n % 2 == 0 else list(reversed(loops))
                for name in order:
                    await conn.execute("TRUNCATE core.processed_jobs")
                    srv = backend_cpu(pid)
                    cpu, wall = time.process_time(), time.monotonic()
                    await loops[name](conn, jobs, f"{name}{n}-")
                    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
                    srv = backend_cpu(pid) - srv
                    client[name].append(cpu)
                    server[name].append(srv)
                    print(
                        f"round {n + 1} {name:>8}: {cpu / jobs * 1e6:5.0f} us client CPU,"
                        f" {srv / jobs * 1e6:5.0f} us PostgreSQL CPU,"
                        f" {wall / jobs * 1e6:5.0f} us wall per job"
                    )
            ratios = [q / p for q, p in zip(client["query"], client["pipeline"], strict=True)]
            srv_ratios = [q / p for q, p in zip(server["query"], server["pipeline"], strict=True)]
            print(
                "client CPU, query / pipeline, per round:",
                ", ".join(f"{r:.2f}" for r in ratios),
                f"(median {median(ratios):.2f})",
            )
            print(
                "PostgreSQL CPU, query / pipeline, per round:",
                ", ".join(f"{r:.2f}" for r in srv_ratios),
                f"(median {median(srv_ratios):.2f})",
            )
    finally:
        await drop_database(admin, DBNAME)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--loop", default=None, help="event loop (uvloop by default)")
    args = parser.parse_args()
    runtime.run(lambda: main_async(args.jobs, args.rounds), loop=args.loop)
    print(
        f"command: PYTHONPATH=src python benchmarks/commit_path.py --jobs {args.jobs}"
        f" --rounds {args.rounds}"
    )


if __name__ == "__main__":
    main()
