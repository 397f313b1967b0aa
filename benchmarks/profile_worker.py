"""Where a jobfence worker's time goes, next to the ceiling loop, in this one process.

For the ceiling loop (throughput.py's (a)) and a jobfence worker over a pre-filled PostgreSQL
queue (its (b)), both with the same work statement, it prints per job: wall time, round trips to
the server, CPU time of this (client) process and CPU time of the PostgreSQL server processes;
for jobfence also the latency of a queue fetch at that backlog. Runs alternate, medians shown.
With ``--cprofile`` it then profiles one jobfence run and prints the top functions.

    .venv/bin/python benchmarks/profile_worker.py                 # 5,000 jobs, 3 rounds
    .venv/bin/python benchmarks/profile_worker.py --jobs 20000 --cprofile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from common import (
    CEILING_CONSUMER,
    FENCE_SQL,
    WORK_SQL,
    Tracker,
    admin_url_from_env,
    build_jobfence_app,
    cpu_used,
    create_database,
    drop_database,
    enqueue_jobfence,
    job_work,
    server_cpu,
)

from jobfence import PgQueue, Worker, open_pool, runtime
from jobfence.model import Delivery
from jobfence.schema import migrate


class RoundTrips:
    """Counts round trips to the server: psycopg operations that had to wait for the socket.

    Every statement, BEGIN and COMMIT goes through ``AsyncConnection.wait``; operations that
    finish without I/O (a COMMIT on an idle connection, as the pool's exit does) are not counted.
    """

    def __init__(self) -> None:
        self.count = 0
        self._original = psycopg.AsyncConnection.wait

    def _tracked(self, gen: Any) -> Any:
        try:
            out = gen.send(None)
        except StopIteration as stop:
            return stop.value
        self.count += 1
        while True:
            try:
                sent = yield out
            except BaseException as exc:
                try:
                    out = gen.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    out = gen.send(sent)
                except StopIteration as stop:
                    return stop.value

    def __enter__(self) -> RoundTrips:
        original, tracked = self._original, self._tracked

        async def counting_wait(conn: Any, gen: Any, *args: Any, **kwargs: Any) -> Any:
            return await original(conn, tracked(gen), *args, **kwargs)

        psycopg.AsyncConnection.wait = counting_wait  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        psycopg.AsyncConnection.wait = self._original  # type: ignore[method-assign]


class Meter:
    """Wall time, round trips, client and server CPU of one run."""

    def __enter__(self) -> Meter:
        self.trips = RoundTrips().__enter__()
        self.server = server_cpu()
        self.client = time.process_time()
        self.wall = time.monotonic()
        return self

    def stop(self, last_job_at: float | None = None) -> None:
        self.wall = (last_job_at or time.monotonic()) - self.wall
        self.client = time.process_time() - self.client
        after = server_cpu()
        self.server = cpu_used(self.server, after)
        self.trips.__exit__()

    def __exit__(self, *exc: object) -> None:
        self.trips.__exit__()


class TimedQueue(PgQueue):
    """PgQueue that records how long each fetch took."""

    fetches: list[float]

    async def _take(
        self, queues: Sequence[str], max_messages: int, lease_seconds: float
    ) -> list[Delivery]:
        started = time.perf_counter()
        try:
            return await super()._take(queues, max_messages, lease_seconds)
        finally:
            self.fetches.append(time.perf_counter() - started)


async def reset(url: str, jobs: int) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)  # no-op unless the working tree gained a migration meanwhile
        await conn.execute("TRUNCATE core.processed_jobs, jobfence_queue.messages")
        await enqueue_jobfence(conn, "p:", 0, jobs)
        await conn.execute(
            "VACUUM (ANALYZE) jobfence_queue.messages, bench_accounts, core.processed_jobs"
        )
        await conn.execute("CHECKPOINT")


async def run_ceiling(url: str, jobs: int) -> dict[str, float]:
    await reset(url, 0)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        with Meter() as meter:
            for i in range(jobs):
                async with conn.transaction():
                    await conn.execute(WORK_SQL, job_work(i))
                    await conn.execute(FENCE_SQL, (f"c{i}", CEILING_CONSUMER))
            meter.stop()
    return summarise(meter, jobs)


async def run_jobfence(
    url: str, jobs: int, concurrency: int, profiler: cProfile.Profile | None = None
) -> dict[str, float]:
    await reset(url, jobs)
    tracker = Tracker()
    pool = await open_pool(url, min_size=concurrency + 1, max_size=concurrency + 2)
    try:
        queue = TimedQueue(pool, poll_interval_seconds=0.05)
        queue.fetches = []
        worker = Worker(
            build_jobfence_app(tracker), pool, queue, concurrency=concurrency, poll_seconds=0.05
        )
        await queue.receive(["warmup"], max_messages=1, lease_seconds=1, wait_seconds=0.01)
        queue.fetches.clear()
        with Meter() as meter:
            if profiler is not None:
                profiler.enable()
            await worker.run(until="idle")
            if profiler is not None:
                profiler.disable()
            meter.stop(tracker.last)
        await queue.close()
    finally:
        await pool.close()
    if tracker.count != jobs:
        raise RuntimeError(f"handled {tracker.count} of {jobs} jobs")
    result = summarise(meter, jobs)
    result["fetch_ms"] = statistics.median(queue.fetches) * 1000
    result["fetches_per_job"] = len(queue.fetches) / jobs
    return result


def summarise(meter: Meter, jobs: int) -> dict[str, float]:
    return {
        "jobs_per_s": jobs / meter.wall,
        "wall_ms": meter.wall * 1000 / jobs,
        "round_trips": meter.trips.count / jobs,
        "client_cpu_ms": meter.client * 1000 / jobs,
        "server_cpu_ms": float(meter.server) * 1000 / jobs,
    }


ROWS = (
    ("jobs/s", "jobs_per_s", "{:,.0f}"),
    ("wall time per job, ms", "wall_ms", "{:.3f}"),
    ("round trips per job", "round_trips", "{:.2f}"),
    ("client CPU per job, ms", "client_cpu_ms", "{:.3f}"),
    ("server CPU per job, ms", "server_cpu_ms", "{:.3f}"),
    ("queue fetch (up to a batch), median ms", "fetch_ms", "{:.2f}"),
    ("queue fetches per job", "fetches_per_job", "{:.3f}"),
)


async def main_async(args: argparse.Namespace) -> None:
    admin_url = args.admin_url or admin_url_from_env()
    url = await create_database(admin_url, args.db)
    results: dict[str, list[dict[str, float]]] = {"ceiling": [], "jobfence": []}
    stats: pstats.Stats | None = None
    try:
        await run_jobfence(url, min(args.jobs, 2000), args.concurrency)  # warm-up
        for r in range(args.rounds):
            order = ["ceiling", "jobfence"] if r % 2 == 0 else ["jobfence", "ceiling"]
            for name in order:
                if name == "ceiling":
                    results[name].append(await run_ceiling(url, args.jobs))
                else:
                    results[name].append(await run_jobfence(url, args.jobs, args.concurrency))
                print(f"round {r + 1}: {name:<9} {results[name][-1]['jobs_per_s']:7,.0f} jobs/s")
        if args.cprofile:
            profiler = cProfile.Profile()
            profiled = await run_jobfence(url, args.jobs, args.concurrency, profiler)
            stats = pstats.Stats(profiler)
    finally:
        if not args.keep_db:
            await drop_database(admin_url, args.db)

    print(
        f"\n{args.jobs:,} jobs per run, median of {args.rounds} rounds; jobfence concurrency "
        f"{args.concurrency}, backlog at start = all jobs"
    )
    print(f"{'':<40}{'(a) ceiling':>14}{'(b) jobfence':>14}")
    for label, key, fmt in ROWS:
        cells = []
        for name in ("ceiling", "jobfence"):
            values = [r[key] for r in results[name] if key in r]
            cells.append(fmt.format(statistics.median(values)) if values else "-")
        print(f"{label:<40}{cells[0]:>14}{cells[1]:>14}")
    if stats is not None:
        print(f"\ncProfile of one jobfence run ({profiled['jobs_per_s']:,.0f} jobs/s profiled)")
        out = io.StringIO()
        stats.stream = out  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(r"jobfence|psycopg_pool", args.top)
        print(out.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000, help="jobs per run (5000)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("--concurrency", type=int, default=1, help="jobfence concurrency (1)")
    parser.add_argument("--cprofile", action="store_true", help="also profile one jobfence run")
    parser.add_argument("--top", type=int, default=25, help="rows of each profile table")
    parser.add_argument("--admin-url", default=None)
    parser.add_argument("--db", default="jobfence_profile")
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args()
    print(f"event loop: {args.loop}")
    runtime.run(lambda: main_async(args), loop=args.loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
