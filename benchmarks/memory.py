"""A jobfence worker's resident memory over many jobs (it must stay flat).

One worker process (spawn), set up like ``jobfence worker`` (pool of concurrency + 2
connections, PgQueue, default metrics), runs the bench consumer until stopped. This process
feeds the queue in batches so the backlog stays between ``--batch`` and twice that, and reads the
worker's RSS with psutil: at start, after the warm-up, at every tenth of the run and at the end.
It also vacuums the queue table every ``--vacuum-every`` jobs, as autovacuum would (a server with
autovacuum off otherwise lets dead queue rows pile up and the run slow down).

    .venv/bin/python benchmarks/memory.py                  # 200,000 jobs after a 10,000 warm-up
    .venv/bin/python benchmarks/memory.py --jobs 50000     # shorter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import shlex
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from typing import Any

import psutil
import psycopg
from common import (
    admin_url_from_env,
    build_jobfence_app,
    create_database,
    drop_database,
    enqueue_jobfence,
    expected_points,
    machine_notes,
    scalar,
    versions,
)

from jobfence import PgQueue, Worker, open_pool

MIB = 1024 * 1024


def child_main(url: str, concurrency: int, group: int, pipe: Connection, stop: Event) -> None:
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_child(url, concurrency, group, pipe, stop))


async def _child(url: str, concurrency: int, group: int, pipe: Connection, stop: Event) -> None:
    pool = await open_pool(url, max_size=concurrency + 2, name="bench-memory")
    try:
        queue = PgQueue(pool)
        worker = Worker(build_jobfence_app(None, group), pool, queue, concurrency=concurrency)
        loop = asyncio.get_running_loop()

        def watch() -> None:
            stop.wait()
            loop.call_soon_threadsafe(worker.stop)

        threading.Thread(target=watch, daemon=True).start()
        pipe.send("ready")
        stats = await worker.run()
        await queue.close()
    finally:
        await pool.close()
    pipe.send({str(k): v for k, v in stats.outcomes.items()})


def rss_mib(proc: psutil.Process) -> float:
    return float(proc.memory_info().rss) / MIB


async def feed_and_watch(
    url: str, proc: psutil.Process, args: argparse.Namespace
) -> list[dict[str, float]]:
    total = args.warmup + args.jobs
    marks = [args.warmup + args.jobs * k // 10 for k in range(1, 11)]
    samples = [{"processed": 0, "rss_mib": rss_mib(proc), "seconds": 0.0}]
    print(f"worker pid {proc.pid}: RSS at start {samples[0]['rss_mib']:.1f} MiB", flush=True)
    enqueued = vacuumed_at = 0
    started = time.monotonic()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while True:
            backlog = int(await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages"))
            processed = enqueued - backlog
            if args.vacuum_every and processed - vacuumed_at >= args.vacuum_every:
                # What autovacuum does on a server that has it on: dead queue rows become reusable.
                await conn.execute("VACUUM jobfence_queue.messages")
                vacuumed_at = processed
            if backlog < args.batch and enqueued < total:
                stop_at = min(enqueued + args.batch, total)
                await enqueue_jobfence(conn, "m:", enqueued, stop_at)
                enqueued = stop_at
            next_mark = args.warmup if len(samples) == 1 else marks[len(samples) - 2]
            if processed >= next_mark:
                sample = {
                    "processed": processed,
                    "rss_mib": rss_mib(proc),
                    "seconds": time.monotonic() - started,
                }
                samples.append(sample)
                label = "after warm-up" if len(samples) == 2 else ""
                print(
                    f"  {processed:>9,} jobs  RSS {sample['rss_mib']:7.1f} MiB  "
                    f"{sample['seconds']:7.1f} s  {label}",
                    flush=True,
                )
                if processed >= total:
                    return samples
            await asyncio.sleep(0.2)


def slope_per_100k(samples: list[dict[str, float]]) -> float:
    """Least-squares growth of RSS, MiB per 100,000 jobs, over the samples after warm-up."""
    points = [(s["processed"], s["rss_mib"]) for s in samples[1:]]
    if len(points) < 2:
        return 0.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    cov = sum((x - mx) * (y - my) for x, y in points)
    return cov / var * 100_000 if var else 0.0


async def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    admin_url = args.admin_url or admin_url_from_env()
    print(f"machine: {machine_notes()}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    url = await create_database(admin_url, args.db)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        points_before = int(await scalar(conn, "SELECT sum(points) FROM bench_accounts"))
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    parent, child = ctx.Pipe()
    worker = ctx.Process(
        target=child_main, args=(url, args.concurrency, args.group, child, stop), daemon=True
    )
    worker.start()
    try:
        if await asyncio.to_thread(parent.recv) != "ready":
            raise RuntimeError("the worker process did not start")
        samples = await feed_and_watch(url, psutil.Process(worker.pid), args)
    finally:
        stop.set()
        outcomes = await asyncio.to_thread(parent.recv) if worker.is_alive() else {}
        worker.join(timeout=30)
    total = args.warmup + args.jobs
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        fences = int(await scalar(conn, "SELECT count(*) FROM core.processed_jobs"))
        points = int(await scalar(conn, "SELECT sum(points) FROM bench_accounts")) - points_before
    if not args.keep_db:
        await drop_database(admin_url, args.db)

    warm, end = samples[1], samples[-1]
    delta = end["rss_mib"] - warm["rss_mib"]
    slope = slope_per_100k(samples)
    rate = (end["processed"] - warm["processed"]) / (end["seconds"] - warm["seconds"])
    checks_ok = fences == total and points == expected_points(total)
    flat = abs(delta) <= args.max_growth_mib
    print()
    print(
        f"worker concurrency {args.concurrency}, {args.group} job(s) per transaction, "
        f"{args.jobs:,} jobs after {args.warmup:,} warm-up"
    )
    print(f"  RSS at start                 {samples[0]['rss_mib']:8.1f} MiB")
    print(
        f"  RSS after warm-up            {warm['rss_mib']:8.1f} MiB   ({warm['processed']:,} jobs)"
    )
    print(f"  RSS at the end               {end['rss_mib']:8.1f} MiB   ({end['processed']:,} jobs)")
    print(
        f"  delta after warm-up          {delta:+8.1f} MiB   (limit +/-{args.max_growth_mib} MiB)"
    )
    print(f"  trend after warm-up          {slope:+8.2f} MiB per 100,000 jobs (least squares)")
    print(f"  throughput after warm-up     {rate:8,.0f} jobs/s")
    print(f"  outcomes {outcomes}; fence rows {fences:,}; points applied exactly once: {checks_ok}")
    print(f"  verdict: {'flat' if flat else 'GROWING'}")
    print(f"machine at the end: {machine_notes()}")
    print(f"command: {command}")
    return {
        "command": command,
        "concurrency": args.concurrency,
        "jobs_per_transaction": args.group,
        "warmup": args.warmup,
        "jobs": args.jobs,
        "samples": samples,
        "delta_mib": delta,
        "slope_mib_per_100k": slope,
        "jobs_per_s": rate,
        "checks_ok": checks_ok,
        "flat": flat,
        "machine": machine_notes(),
        "versions": versions(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200_000, help="jobs after warm-up (200000)")
    parser.add_argument("--warmup", type=int, default=10_000, help="warm-up jobs (10000)")
    parser.add_argument("--concurrency", type=int, default=4, help="worker concurrency (4)")
    parser.add_argument("--batch", type=int, default=2000, help="jobs enqueued at once (2000)")
    parser.add_argument(
        "--group", type=int, default=1, help="the consumer's jobs_per_transaction (1)"
    )
    parser.add_argument(
        "--vacuum-every",
        type=int,
        default=20_000,
        help="VACUUM the queue table every N jobs, standing in for autovacuum (20000; 0: never)",
    )
    parser.add_argument(
        "--max-growth-mib", type=float, default=10.0, help="flat means |delta| <= this (10)"
    )
    parser.add_argument("--admin-url", default=None)
    parser.add_argument("--db", default="jobfence_bench_memory")
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    summary = asyncio.run(run(args, command))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    return 0 if summary["checks_ok"] and summary["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
