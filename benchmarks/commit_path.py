"""What the commit path would save sent as one simple-protocol query: client CPU per job.

Two loops on one connection, alternating rounds, each job being the next job's fence insert
started with the previous job's COMMIT, then one work statement:

- **pipeline** (what the worker does): ``Tx.commit_then_begin``, COMMIT + BEGIN + the fence
  insert as three pipelined extended-protocol statements, its parameters bound server-side;
- **simple query**: ``COMMIT; BEGIN; INSERT ...`` as one simple-protocol query string, the
  fence's values quoted client-side (``psycopg.sql.Literal``).

Both are one round trip. It prints the client CPU and wall time per job of each, and the ratio.

    PYTHONPATH=src python benchmarks/commit_path.py            # 4,000 jobs x 3 rounds
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import psycopg
from common import admin_url_from_env, create_database, drop_database
from psycopg import sql

from jobfence import runtime
from jobfence.pgtx import Tx

DBNAME = "jobfence_commit_path"
FENCE = "INSERT INTO f (job_id, consumer) VALUES (%(job_id)s, %(consumer)s) ON CONFLICT DO NOTHING"
SIMPLE = "COMMIT; BEGIN; INSERT INTO f (job_id, consumer) VALUES ({}, {}) ON CONFLICT DO NOTHING"
WORK = "UPDATE a SET points = points + 1 WHERE id = 1"


async def pipeline(conn: psycopg.AsyncConnection[Any], jobs: int) -> None:
    tx, _ = await Tx.begin(conn, FENCE, {"job_id": "p0", "consumer": "c"})
    for i in range(1, jobs):
        await conn.execute(WORK)
        tx, _ = await tx.commit_then_begin(FENCE, {"job_id": f"p{i}", "consumer": "c"})
    await tx.commit()


async def simple(conn: psycopg.AsyncConnection[Any], jobs: int) -> None:
    await conn.execute("BEGIN")
    for i in range(jobs):
        await conn.execute(WORK)
        await conn.execute(sql.SQL(SIMPLE).format(sql.Literal(f"s{i}"), sql.Literal("c")))
    await conn.execute("COMMIT")


async def main_async(jobs: int, rounds: int) -> None:
    admin = admin_url_from_env()
    url = await create_database(admin, DBNAME)
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(
                "CREATE TABLE f (job_id text, consumer text, PRIMARY KEY (job_id, consumer))"
            )
            await conn.execute("CREATE TABLE a (id int PRIMARY KEY, points bigint)")
            await conn.execute("INSERT INTO a VALUES (1, 0)")
            ratios = []
            for n in range(rounds):
                figures = {}
                order = (pipeline, simple) if n % 2 == 0 else (simple, pipeline)
                for loop in order:
                    await conn.execute("TRUNCATE f")
                    cpu, wall = time.process_time(), time.monotonic()
                    await loop(conn, jobs)
                    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
                    figures[loop.__name__] = cpu
                    print(
                        f"round {n + 1} {loop.__name__:>8}: {cpu / jobs * 1e6:5.0f} us client CPU,"
                        f" {wall / jobs * 1e6:5.0f} us wall per job"
                    )
                ratios.append(figures["simple"] / figures["pipeline"])
            print(
                "client CPU, simple query / pipeline, per round:",
                ", ".join(f"{r:.2f}" for r in ratios),
            )
    finally:
        await drop_database(admin, DBNAME)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loop", default=None, help="event loop (uvloop by default)")
    args = parser.parse_args()
    runtime.run(lambda: main_async(args.jobs, args.rounds), loop=args.loop)


if __name__ == "__main__":
    main()
