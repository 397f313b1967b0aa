"""Jobs per second, side by side in one run on one database.

The systems do the same work per job, ``UPDATE bench_accounts SET points = points + %s WHERE
id = %s``:

(a) ceiling        a bare loop of transactions: BEGIN; the work statement; the fence insert
                   (``INSERT INTO core.processed_jobs ... ON CONFLICT DO NOTHING``); COMMIT.
(b) jobfence       end to end over its PostgreSQL queue: jobs pre-enqueued, then
                   ``Worker(...).run(until="idle")``, one transaction per job (the default).
(b2) jobfence,     the same with the consumer's ``jobs_per_transaction=10`` (``--group``): the
     grouped       worker commits up to 10 waiting jobs in one transaction, each with its fence.
(c) procrastinate  Procrastinate 3.x with a task running the same statement on its own
                   connection: jobs pre-deferred, ``run_worker_async(wait=False)``; the App,
                   connector and worker keep Procrastinate's defaults otherwise.
(g) plain loop     the physical reference for a queue with a fence, in plain async psycopg over
                   the same queue rows as (b): ``BEGIN; SELECT ... FROM jobfence_queue.messages
                   ... LIMIT 1 FOR UPDATE SKIP LOCKED``; the payload decoded; the fence insert
                   (``ON CONFLICT DO NOTHING``) and the work; ``DELETE``; ``COMMIT``.
(g2) plain loop,   (g) taking up to 10 messages per transaction (``--group``), each with its
     grouped       fence and work: what (b2) is compared with.
(a') ceiling-sync  (a) with psycopg's blocking API, for information: the issue's "about 2,500
                   transactions/s on one connection" matches this one, not the async loop.
(b3) jobfence,     (b) with a plain ``def`` handler: its transaction runs in a worker thread on
     sync def      the sync pool (``--systems jobfence-sync``).
(b4) jobfence,     (b3) with the work statement run as an ORM-enabled ``update()`` through a
     SQLAlchemy    SQLAlchemy Session on the handler's connection (``jobfence-sqlalchemy``).
(b5) jobfence,     (b) with ``opentelemetry`` treated as absent in the worker processes
     no otel       (``jobfence.tracing`` as without the ``otel`` extra: ``jobfence-no-otel``).
                   (b) itself runs with ``opentelemetry-api`` installed and no SDK configured.
(b6) jobfence,     (b) with the OpenTelemetry SDK recording every span, exported through a
     otel SDK      ``BatchSpanProcessor`` to an exporter that drops them (``jobfence-otel-sdk``).
                   ``--systems tracing`` runs (b5), (b) and (b6) side by side.

"1 worker" and "4 workers" are 1 and 4 OS processes (multiprocessing, spawn), each handling one
job at a time, so the systems are comparable. An extra column runs jobfence and Procrastinate
in one process with ``concurrency=4`` each (Procrastinate's tasks then get one work connection
each from a pool, as jobfence's processors do), for information. Rounds alternate the systems
(and rotate their order) so that drift on a shared machine hits all of them alike; the table
gives the medians of the rounds (min-max) and the ratio lines the median of the per-round
ratios. CPU per job is that of the worker processes and of every PostgreSQL process.

Timing: the worker processes connect and get ready first; the clock starts when the main process
releases them all at once and stops when the last job's work statement has run in any process.
Each run then checks that every job's effect was applied exactly once.

    .venv/bin/python benchmarks/throughput.py             # 5,000 jobs, 3 rounds: 5-6 min
    .venv/bin/python benchmarks/throughput.py --jobs 20000 --rounds 5
    .venv/bin/python benchmarks/throughput.py --systems brokers   # on brokers: broker_systems.py
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import SynchronizedArray
from multiprocessing.synchronize import Event
from typing import Any

import broker_systems as bs
import procrastinate
import psutil
import psycopg
from common import (
    CEILING_CONSUMER,
    CONSUMER,
    FENCE_SQL,
    QUEUE,
    WORK_SQL,
    Tracker,
    admin_url_from_env,
    build_jobfence_app,
    build_procrastinate_app,
    cpu_used,
    create_database,
    drop_database,
    enqueue_jobfence,
    expected_points,
    job_work,
    machine_notes,
    scalar,
    server_cpu,
    server_notes,
    versions,
)
from psycopg_pool import AsyncConnectionPool

from jobfence import PgQueue, Worker, open_pool, runtime, tracing
from jobfence.schema import migrate

CEILING = "ceiling"
CEILING_SYNC = "ceiling-sync"
PLAIN = "plain"
PLAIN_GROUP = "plain-group"
JOBFENCE = "jobfence"
JOBFENCE_GROUP = "jobfence-group"
JOBFENCE_SYNC = "jobfence-sync"
JOBFENCE_SQLALCHEMY = "jobfence-sqlalchemy"
JOBFENCE_NO_OTEL = "jobfence-no-otel"
JOBFENCE_OTEL_SDK = "jobfence-otel-sdk"
PROCRASTINATE = "procrastinate"
LABELS = {
    CEILING: "(a) ceiling",
    JOBFENCE: "(b) jobfence",
    JOBFENCE_GROUP: "(b2) jobfence, grouped",
    JOBFENCE_SYNC: "(b3) jobfence, sync def",
    JOBFENCE_SQLALCHEMY: "(b4) jobfence, SQLAlchemy",
    JOBFENCE_NO_OTEL: "(b5) jobfence, no otel",
    JOBFENCE_OTEL_SDK: "(b6) jobfence, otel SDK",
    PROCRASTINATE: "(c) procrastinate",
    CEILING_SYNC: "(a') ceiling, sync",
    PLAIN: "(g) plain loop",
    PLAIN_GROUP: "(g2) plain loop, grouped",
    **bs.BROKER_LABELS,
}
PG_SYSTEMS = (
    CEILING,
    PLAIN,
    PLAIN_GROUP,
    JOBFENCE,
    JOBFENCE_GROUP,
    JOBFENCE_SYNC,
    JOBFENCE_SQLALCHEMY,
    PROCRASTINATE,
    CEILING_SYNC,
)
TRACING_SYSTEMS = (JOBFENCE_NO_OTEL, JOBFENCE_OTEL_SDK)  # beside (b): --systems tracing
SYSTEMS = PG_SYSTEMS + TRACING_SYSTEMS + bs.BROKER_SYSTEMS
# --systems shorthands: "brokers" is jobfence on PostgreSQL beside every broker system.
SYSTEM_GROUPS = {
    "all": SYSTEMS,
    "postgres": PG_SYSTEMS,
    "brokers": (JOBFENCE, *bs.BROKER_SYSTEMS),
    "tracing": (JOBFENCE, *TRACING_SYSTEMS),
    # the physical references side by side with jobfence, one and ten jobs per transaction
    "plain": (CEILING, PLAIN, PLAIN_GROUP, JOBFENCE, JOBFENCE_GROUP),
}
JOBFENCES = (
    JOBFENCE,
    JOBFENCE_GROUP,
    JOBFENCE_SYNC,
    JOBFENCE_SQLALCHEMY,
    JOBFENCE_NO_OTEL,
    JOBFENCE_OTEL_SDK,
)
PLAINS = (PLAIN, PLAIN_GROUP)
FLAVOURS = {JOBFENCE_SYNC: "sync", JOBFENCE_SQLALCHEMY: "sqlalchemy"}
PROCRASTINATE_TABLES = (
    "procrastinate_jobs, procrastinate_events, procrastinate_workers, procrastinate_periodic_defers"
)


@dataclass(frozen=True)
class Config:
    system: str
    procs: int
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.system}:{self.procs}x{self.concurrency}"

    @property
    def column(self) -> str:
        if self.concurrency > 1:
            return f"1 proc x {self.concurrency}"
        return f"{self.procs} worker{'s' if self.procs > 1 else ''}"


@dataclass
class Measurement:
    config: Config
    round: int
    jobs: int
    seconds: float
    ok: bool
    problems: list[str] = field(default_factory=list)
    client_cpu: float = 0.0  # CPU seconds of the worker processes during the run
    server_cpu: float = 0.0  # CPU seconds of the PostgreSQL processes during the run
    broker_cpu: float | None = None  # CPU seconds of the broker's processes (broker systems)
    left_on_broker: int = 0  # messages of the run still on the broker after the workers closed

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds > 0 else 0.0


# --------------------------------------------------------------------------------------------
# Worker processes. They live for the whole run and take one command per measurement.


async def _released(go: Event) -> None:
    await asyncio.to_thread(go.wait)


async def _child_ceiling(cmd: dict[str, Any], pipe: Connection, go: Event) -> Tracker:
    tracker = Tracker()
    n, procs, index, prefix = cmd["jobs"], cmd["procs"], cmd["index"], cmd["prefix"]
    async with await psycopg.AsyncConnection.connect(cmd["url"], autocommit=True) as conn:
        pipe.send("ready")
        await _released(go)
        for i in range(index, n, procs):
            async with conn.transaction():
                await conn.execute(WORK_SQL, job_work(i))
                await conn.execute(FENCE_SQL, (f"{prefix}{i}", CEILING_CONSUMER))
            tracker.done()
    return tracker


async def _child_ceiling_sync(cmd: dict[str, Any], pipe: Connection, go: Event) -> Tracker:
    """(a) with psycopg's blocking API: no event loop between the round trips."""
    tracker = Tracker()
    n, procs, index, prefix = cmd["jobs"], cmd["procs"], cmd["index"], cmd["prefix"]
    with psycopg.connect(cmd["url"], autocommit=True) as conn:
        pipe.send("ready")
        go.wait()  # blocking is fine: this process does nothing else meanwhile
        for i in range(index, n, procs):
            with conn.transaction():
                conn.execute(WORK_SQL, job_work(i))
                conn.execute(FENCE_SQL, (f"{prefix}{i}", CEILING_CONSUMER))
            tracker.done()
    return tracker


# (g) and (g2): the plain SKIP LOCKED loop over jobfence's own queue rows.
PLAIN_CLAIM = (
    "SELECT id, job_id, body FROM jobfence_queue.messages"
    " WHERE queue = %s AND run_at <= now() ORDER BY run_at, id"
    " LIMIT %s FOR UPDATE SKIP LOCKED"
)
PLAIN_DELETE = "DELETE FROM jobfence_queue.messages WHERE id = ANY(%s)"


async def _child_plain(cmd: dict[str, Any], pipe: Connection, go: Event) -> Tracker:
    """Claim up to n due messages, fence and work each, delete them, commit; until none is
    left for this process."""
    tracker = Tracker()
    n = cmd["group"] if cmd["system"] == PLAIN_GROUP else 1
    async with await psycopg.AsyncConnection.connect(cmd["url"], autocommit=True) as conn:
        pipe.send("ready")
        await _released(go)
        while True:
            async with conn.transaction():
                cur = await conn.execute(PLAIN_CLAIM, (QUEUE, n))
                rows = await cur.fetchall()
                for _id, job_id, body in rows:
                    payload = json.loads(body)
                    await conn.execute(FENCE_SQL, (job_id, CONSUMER))
                    await conn.execute(WORK_SQL, (payload["points"], payload["account_id"]))
                if rows:
                    await conn.execute(PLAIN_DELETE, ([row[0] for row in rows],))
            if not rows:
                break
            for _ in rows:
                tracker.done()
    return tracker


async def _child_jobfence(cmd: dict[str, Any], pipe: Connection, go: Event) -> Tracker:
    tracker = Tracker()
    concurrency = cmd["concurrency"]
    # Like `jobfence worker` (max_size = concurrency + 2), with the connections opened up front.
    pool = await open_pool(
        cmd["url"], min_size=concurrency + 1, max_size=concurrency + 2, name="bench"
    )
    try:
        queue = PgQueue(pool, poll_interval_seconds=0.05)
        worker = Worker(
            build_jobfence_app(
                tracker,
                cmd["group"] if cmd["system"] == JOBFENCE_GROUP else 1,
                FLAVOURS.get(cmd["system"], "async"),
            ),
            pool,
            queue,
            concurrency=concurrency,
            poll_seconds=0.05,
        )
        # Open the LISTEN connection now rather than inside the timed part.
        await queue.receive(["bench-warmup"], max_messages=1, lease_seconds=1, wait_seconds=0.01)
        pipe.send("ready")
        await _released(go)
        stats = await worker.run(until="idle")
        await queue.close()
    finally:
        await pool.close()
    if stats.outcomes["succeeded"] != tracker.count:
        raise RuntimeError(f"jobfence outcomes {dict(stats.outcomes)} != {tracker.count} handled")
    return tracker


async def _child_jobfence_tracing(cmd: dict[str, Any], pipe: Connection, go: Event) -> Tracker:
    """(b) with jobfence.tracing as without the extra (b5), or with an SDK recording (b6)."""
    saved = tracing._trace, tracing.ENABLED, tracing._tracer
    provider: Any = None
    if cmd["system"] == JOBFENCE_NO_OTEL:
        tracing._trace, tracing.ENABLED = None, False  # type: ignore[assignment]
    else:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        class Dropped(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(Dropped()))
        sdk_tracer = provider.get_tracer("jobfence", tracing.SEMCONV_VERSION)
        tracing._tracer = lambda: sdk_tracer  # type: ignore[assignment]
    try:
        return await _child_jobfence(cmd, pipe, go)
    finally:
        if provider is not None:
            provider.shutdown()
        tracing._trace, tracing.ENABLED, tracing._tracer = saved  # type: ignore[assignment]


async def _child_procrastinate(cmd: dict[str, Any], pipe: Connection, go: Event) -> Tracker:
    tracker = Tracker()
    concurrency = cmd["concurrency"]
    # One work connection per concurrent job, as jobfence's processors each hold one.
    async with AsyncConnectionPool(
        cmd["url"],
        min_size=concurrency,
        max_size=concurrency,
        kwargs={"autocommit": True},
        open=False,
    ) as work_pool:
        await work_pool.wait()

        async def work(points: int, account_id: int) -> None:
            async with work_pool.connection() as work_conn:
                await work_conn.execute(WORK_SQL, (points, account_id))
            tracker.done()

        app = build_procrastinate_app(cmd["url"], work)
        async with app.open_async():
            pipe.send("ready")
            await _released(go)
            await app.run_worker_async(
                queues=[QUEUE],
                concurrency=concurrency,
                wait=False,
                install_signal_handlers=False,
                name=f"bench-{cmd['index']}",
            )
    return tracker


async def _child_jobfence_broker(cmd: dict[str, Any], pipe: Connection, go: Event) -> Tracker:
    """jobfence's Worker, unchanged, on a broker's queue adapter (one job at a time; a grouped
    system's consumer commits up to ``--group`` jobs per transaction)."""
    tracker = Tracker()
    pool = await open_pool(cmd["url"], min_size=2, max_size=3, name="bench")
    queue = bs.jobfence_queue(cmd["system"], cmd["broker_url"], cmd["name"])
    try:
        group = cmd["group"] if bs.grouped(cmd["system"]) else 1
        worker = Worker(
            build_jobfence_app(tracker, group), pool, queue, concurrency=1, poll_seconds=0.05
        )
        await queue.size([QUEUE])  # connect (and declare) now rather than inside the timed part
        pipe.send("ready")
        await _released(go)
        stats = await worker.run(until="empty")
    finally:
        await queue.close()
        await pool.close()
    if stats.outcomes["succeeded"] != tracker.count:
        raise RuntimeError(f"jobfence outcomes {dict(stats.outcomes)} != {tracker.count} handled")
    return tracker


CHILDREN = {
    CEILING: _child_ceiling,
    CEILING_SYNC: _child_ceiling_sync,
    PLAIN: _child_plain,
    PLAIN_GROUP: _child_plain,
    JOBFENCE: _child_jobfence,
    JOBFENCE_GROUP: _child_jobfence,
    JOBFENCE_SYNC: _child_jobfence,
    JOBFENCE_SQLALCHEMY: _child_jobfence,
    JOBFENCE_NO_OTEL: _child_jobfence_tracing,
    JOBFENCE_OTEL_SDK: _child_jobfence_tracing,
    PROCRASTINATE: _child_procrastinate,
    **{system: _child_jobfence_broker for system in bs.JOBFENCE_ON_BROKERS},
}


def child_main(pipe: Connection, go: Event, slots: SynchronizedArray[float]) -> None:
    logging.basicConfig(level=logging.WARNING)
    # Every worker's start-up warning about autovacuum, 4 processes x every run: the main process
    # says it once (VACUUM runs before each measurement, so it does not skew the figures).
    logging.getLogger("jobfence.worker").addFilter(
        lambda record: not record.getMessage().startswith("autovacuum is off")
    )
    while True:
        cmd = pipe.recv()
        if cmd is None:
            return
        try:
            if cmd["system"] in CHILDREN:
                child = functools.partial(CHILDREN[cmd["system"]], cmd, pipe, go)
                tracker = runtime.run(child, loop=cmd["loop"])
                pipe.send({"count": tracker.count, "first": tracker.first, "last": tracker.last})
            else:  # Dramatiq or Celery: their own threads and processes, no event loop
                pipe.send(bs.run_framework_worker(cmd, pipe, go, slots))
        except BaseException:
            pipe.send({"error": traceback.format_exc()})


# --------------------------------------------------------------------------------------------
# The main process: prepares each run, releases the workers, checks the outcome.


async def reset(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(
        f"TRUNCATE core.processed_jobs, jobfence_queue.messages, {PROCRASTINATE_TABLES} CASCADE"
    )


async def prepare(
    conn: psycopg.AsyncConnection[Any],
    papp: procrastinate.App,
    config: Config,
    jobs: int,
    prefix: str,
    *,
    broker: tuple[bs.Urls, str] | None = None,
) -> None:
    await migrate(conn)  # no-op, unless the working tree gained a migration during the run
    await reset(conn)
    if broker is not None:
        urls, name = broker
        await bs.publish(config.system, urls, name, prefix, jobs)
    elif config.system in (*JOBFENCES, *PLAINS):
        await enqueue_jobfence(conn, prefix, 0, jobs)
    elif config.system == PROCRASTINATE:
        task = papp.tasks[CONSUMER]
        for start in range(0, jobs, 2000):
            kwargs = []
            for i in range(start, min(start + 2000, jobs)):
                points, account_id = job_work(i)
                kwargs.append({"account_id": account_id, "points": points})
            await task.batch_defer_async(*kwargs)
    # The same starting line for everyone: fresh statistics, no dead rows, no checkpoint due.
    await conn.execute(
        "VACUUM (ANALYZE) bench_accounts, core.processed_jobs, jobfence_queue.messages,"
        " procrastinate_jobs"
    )
    await conn.execute("CHECKPOINT")


async def verify(
    conn: psycopg.AsyncConnection[Any], config: Config, jobs: int, points_delta: int
) -> list[str]:
    problems = []
    if points_delta != expected_points(jobs):
        problems.append(f"points added {points_delta}, expected {expected_points(jobs)}")
    if config.system in (CEILING, CEILING_SYNC):
        fences = await scalar(conn, "SELECT count(*) FROM core.processed_jobs")
        if fences != jobs:
            problems.append(f"{fences} fence rows, expected {jobs}")
    elif config.system in (*JOBFENCES, *PLAINS):
        fences = await scalar(conn, "SELECT count(*) FROM core.processed_jobs")
        left = await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages")
        if fences != jobs or left:
            problems.append(f"{fences} fence rows (expected {jobs}), {left} messages left")
    elif config.system in bs.BROKER_SYSTEMS:
        fences = await scalar(conn, "SELECT count(*) FROM core.processed_jobs")
        if fences != jobs:
            problems.append(f"{fences} fence rows, expected {jobs}")
    else:
        done = await scalar(
            conn, "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
        )
        if done != jobs:
            problems.append(f"{done} procrastinate jobs succeeded, expected {jobs}")
    return problems


@dataclass
class Bench:
    """The database, the Procrastinate app used to defer, and the worker processes."""

    url: str
    papp: procrastinate.App
    pipes: list[Connection]
    go: Event
    loop: str
    workers: list[psutil.Process]
    group: int
    urls: bs.Urls
    slots: SynchronizedArray[float]


async def measure(bench: Bench, config: Config, jobs: int, round_no: int) -> Measurement:
    """One run of one system; a broker system gets broker names of its own, deleted after."""
    prefix = f"r{round_no}-{config.system}-{config.procs}x{config.concurrency}:"
    if config.system in bs.BROKER_SYSTEMS:
        name = bs.new_name()
        try:
            return await _measure(bench, config, jobs, round_no, prefix, name=name)
        finally:
            await bs.delete_run(config.system, bench.urls, name)
    return await _measure(bench, config, jobs, round_no, prefix, name=None)


async def _measure(
    bench: Bench, config: Config, jobs: int, round_no: int, prefix: str, *, name: str | None
) -> Measurement:
    url, papp, pipes, go, loop = bench.url, bench.papp, bench.pipes, bench.go, bench.loop
    on_broker = (bench.urls, name) if name is not None else None
    broker = bs.BROKER_OF.get(config.system)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await prepare(conn, papp, config, jobs, prefix, broker=on_broker)
        for i in range(len(bench.slots)):
            bench.slots[i] = 0.0
        points_before = await scalar(conn, "SELECT sum(points) FROM bench_accounts")
        go.clear()
        used = pipes[: config.procs]
        for index, pipe in enumerate(used):
            pipe.send(
                {
                    "system": config.system,
                    "url": url,
                    "jobs": jobs,
                    "procs": config.procs,
                    "index": index,
                    "concurrency": config.concurrency,
                    "prefix": prefix,
                    "loop": loop,
                    "group": bench.group,
                    "name": name,
                    "broker_url": bench.urls.of(config.system) if broker else None,
                }
            )
        errors = []
        for pipe in used:
            reply = await asyncio.to_thread(pipe.recv)
            if reply != "ready":
                errors.append(reply.get("error", repr(reply)))
        workers = bench.workers[: config.procs]
        client_before = _cpu_of(workers)
        server_before = server_cpu()
        broker_before = bs.broker_cpu(broker) if broker else {}
        started = time.monotonic()
        go.set()
        results = [await asyncio.to_thread(pipe.recv) for pipe in used if not errors]
        client = cpu_used(client_before, _cpu_of(workers))
        server = cpu_used(server_before, server_cpu())
        broker_used = cpu_used(broker_before, bs.broker_cpu(broker)) if broker else None
        if results and all("cpu" in r for r in results):
            # Dramatiq and Celery measure themselves from the start signal to the last job,
            # Celery's prefork pool process included, before they shut down.
            client = sum(r["cpu"] for r in results)
        errors += [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError(f"{config.key} failed in a worker process:\n" + "\n".join(errors))
        finished = max(r["last"] for r in results)
        handled = sum(r["count"] for r in results)
        points_after = await scalar(conn, "SELECT sum(points) FROM bench_accounts")
        problems = await verify(conn, config, jobs, points_after - points_before)
        if handled != jobs:
            problems.append(f"{handled} jobs handled, expected {jobs}")
        # Not an effect check: a message left behind was done (its fence row is counted above)
        # and would only come back as a duplicate. Reported beside the run.
        left = await bs.left_on_broker(config.system, bench.urls, name) if name else 0
    return Measurement(
        config,
        round_no,
        jobs,
        finished - started,
        not problems,
        problems,
        client,
        server,
        broker_used,
        left,
    )


def _cpu_of(procs: list[psutil.Process]) -> dict[int, float]:
    return {p.pid: (t := p.cpu_times()).user + t.system for p in procs}


def _fmt_rate(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:,.0f}"
    return f"{med:,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def _print_cpu(
    by_key: dict[str, list[Measurement]], configs: list[Config], columns: list[str], width: int
) -> None:
    print()
    print(
        "CPU ms per job, worker processes + PostgreSQL (+ broker, for the broker systems),"
        " median of the rounds"
    )
    print(f"{'':<24}" + "".join(f"{col:>{width}}" for col in columns))
    for system in SYSTEMS:
        if not any(c.system == system for c in configs):
            continue
        row = f"{LABELS[system]:<24}"
        for col in columns:
            cfg = next((c for c in configs if c.system == system and c.column == col), None)
            runs = by_key.get(cfg.key, []) if cfg else []
            if runs:
                client = statistics.median(1000 * m.client_cpu / m.jobs for m in runs)
                server = statistics.median(1000 * m.server_cpu / m.jobs for m in runs)
                cell = f"{client:.3f} + {server:.3f}"
                if runs[0].broker_cpu is not None:
                    broker = statistics.median(1000 * (m.broker_cpu or 0.0) / m.jobs for m in runs)
                    cell += f" + {broker:.3f}"
                row += f"{cell:>{width}}"
            else:
                row += f"{'-':>{width}}"
        print(row)


def _print_ratios(by_key: dict[str, list[Measurement]], rounds: int) -> dict[str, dict[str, Any]]:
    ratios: dict[str, dict[str, Any]] = {}
    print()
    print(
        "ratios: median of the per-round ratios (min-max); targets (b)/(a) >= 0.60, (b)/(c) >= 4,"
        " (b)/(g) >= 1.0, (b2)/(g2) >= 0.9,"
        " (b3)/(b) >= 0.8 at 4 workers;"
        " on a broker: (d)/(e) >= 2, (d)/(b) >= 0.8"
    )
    comparisons: list[tuple[str, int, int, str, float | None, str]] = []
    for system, b in ((JOBFENCE, "(b)"), (JOBFENCE_GROUP, "(b2)")):
        for procs in (1, 4):
            comparisons += [
                (system, procs, 1, CEILING, 0.60, f"{b}/(a)"),
                (system, procs, 1, PROCRASTINATE, 4.0, f"{b}/(c)"),
                (system, procs, 1, CEILING_SYNC, None, f"{b}/(a')"),
            ]
        comparisons.append((system, 1, 4, PROCRASTINATE, None, f"{b}/(c)"))
    # The plain SKIP LOCKED loops: (b) >= 1.0 (g) at 1 and 4 workers, (b2) >= 0.9 (g2) at 4.
    for procs in (1, 4):
        comparisons.append((JOBFENCE, procs, 1, PLAIN, 1.0, "(b)/(g)"))
        comparisons.append((JOBFENCE_GROUP, procs, 1, PLAIN_GROUP, 0.9, "(b2)/(g2)"))
    # Sync handlers against the async path, side by side: target 0.8 at 4 workers.
    for system, b in ((JOBFENCE_SYNC, "(b3)"), (JOBFENCE_SQLALCHEMY, "(b4)")):
        for procs, concurrency in ((1, 1), (4, 1), (1, 4)):
            target = 0.8 if (system, procs) == (JOBFENCE_SYNC, 4) else None
            comparisons.append((system, procs, concurrency, JOBFENCE, target, f"{b}/(b)"))
    for broker, mine_sys, dramatiq, celery in (
        ("RabbitMQ", bs.JOBFENCE_RABBITMQ, bs.DRAMATIQ_RABBITMQ, bs.CELERY_RABBITMQ),
        ("NATS", bs.JOBFENCE_NATS, None, None),
        ("Redis", bs.JOBFENCE_REDIS, bs.DRAMATIQ_REDIS, bs.CELERY_REDIS),
    ):
        # (d) one job per transaction, against (b); (d2) grouped, against (b2).
        for d, system, own in (
            ("(d)", mine_sys, JOBFENCE),
            ("(d2)", mine_sys + bs.GROUPED, JOBFENCE_GROUP),
        ):
            for procs in (1, 4):
                if dramatiq:
                    comparisons.append((system, procs, 1, dramatiq, 2.0, f"{d}/(e) {broker}"))
                if celery:
                    comparisons.append((system, procs, 1, celery, None, f"{d}/(f) {broker}"))
                own_label = f"{d} {broker}/{'(b)' if own == JOBFENCE else '(b2)'}"
                comparisons.append((system, procs, 1, own, 0.8, own_label))
    for system, procs, concurrency, other, target, label in comparisons:
        mine, theirs = Config(system, procs, concurrency), Config(other, procs, concurrency)
        col = mine.column
        per_round = []
        for r in range(rounds):
            b = [m for m in by_key.get(mine.key, []) if m.round == r]
            o = [m for m in by_key.get(theirs.key, []) if m.round == r]
            if b and o and o[0].rate:
                per_round.append(b[0].rate / o[0].rate)
        if per_round:
            med = statistics.median(per_round)
            spread = f"({min(per_round):.2f}-{max(per_round):.2f})"
            if other == CEILING_SYNC:
                verdict = "for information: the blocking-API ceiling"
            elif other == JOBFENCE and target is None:
                verdict = "for information: sync handler / async handler"
            elif target is None and other in bs.BROKER_SYSTEMS:
                verdict = "for information: Celery on the same broker"
            elif target is None:
                verdict = "for information: both in one process, 4 jobs at a time"
            else:
                verdict = f"target >= {target:g}: " + ("met" if med >= target else "NOT met")
            print(f"  {label:<20} at {col:<10} {med:6.2f} {spread:<14} {verdict}")
            ratios[f"{label} {col}"] = {"median": med, "per_round": per_round, "target": target}
    return ratios


def report(
    results: list[Measurement], configs: list[Config], args: argparse.Namespace, command: str
) -> dict[str, Any]:
    by_key: dict[str, list[Measurement]] = {}
    for m in results:
        by_key.setdefault(m.config.key, []).append(m)
    columns = sorted({c.column for c in configs}, key=lambda c: (c.startswith("1 proc"), c))
    width = 26
    print()
    print(f"jobs/s, median of {args.rounds} rounds (min-max), {args.jobs:,} jobs per run")
    print(f"{'':<24}" + "".join(f"{col:>{width}}" for col in columns))
    for system in SYSTEMS:
        if not any(c.system == system for c in configs):
            continue
        row = f"{LABELS[system]:<24}"
        for col in columns:
            cfg = next((c for c in configs if c.system == system and c.column == col), None)
            rates = [m.rate for m in by_key.get(cfg.key, [])] if cfg else []
            row += f"{_fmt_rate(rates):>{width}}"
        print(row)

    _print_cpu(by_key, configs, columns, width)

    ratios = _print_ratios(by_key, args.rounds)
    failed = [m for m in results if not m.ok]
    for m in failed:
        print(f"CHECK FAILED: round {m.round + 1} {m.config.key}: {'; '.join(m.problems)}")
    print()
    print(f"machine at the end: {machine_notes()}")
    print(f"command: {command}")
    return {
        "command": command,
        "jobs": args.jobs,
        "rounds": args.rounds,
        "runs": [
            {
                **asdict(m.config),
                "round": m.round,
                "seconds": m.seconds,
                "rate": m.rate,
                "ok": m.ok,
                "client_cpu_ms_per_job": 1000 * m.client_cpu / m.jobs,
                "server_cpu_ms_per_job": 1000 * m.server_cpu / m.jobs,
                "left_on_broker": m.left_on_broker,
                "broker_cpu_ms_per_job": (
                    None if m.broker_cpu is None else 1000 * m.broker_cpu / m.jobs
                ),
            }
            for m in results
        ],
        "ratios": ratios,
        "all_checks_passed": not failed,
    }


async def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    admin_url = args.admin_url or admin_url_from_env()
    print(f"machine: {machine_notes()}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    print(f"event loop of every worker process, all systems: {args.loop}")
    url = await create_database(admin_url, args.db)
    print("server: " + ", ".join(f"{k} {v}" for k, v in (await server_notes(url)).items()))
    papp = build_procrastinate_app(url)
    async with papp.open_async():
        await papp.schema_manager.apply_schema_async()

        systems = [s for s in SYSTEMS if s in args.systems]
        configs = [Config(s, p, 1) for p in (1, 4) for s in systems]
        if not args.no_extra:  # one process running 4 jobs at a time, for information
            configs += [
                Config(s, 1, 4)
                for s in (
                    JOBFENCE,
                    JOBFENCE_GROUP,
                    JOBFENCE_SYNC,
                    JOBFENCE_SQLALCHEMY,
                    PROCRASTINATE,
                )
                if s in systems
            ]
        ctx = mp.get_context("spawn")
        go = ctx.Event()
        nprocs = max(c.procs for c in configs)
        slots = ctx.Array("d", bs.SLOT * nprocs)  # the Dramatiq and Celery workers' counts
        pipes, procs = [], []
        for _ in range(nprocs):
            parent, child = ctx.Pipe()
            # Not daemonic: Celery's prefork pool starts processes of its own.
            proc = ctx.Process(target=child_main, args=(child, go, slots))
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        workers = [psutil.Process(proc.pid) for proc in procs]
        urls = bs.Urls(args.amqp_url, args.nats_url, args.redis_url)
        bench = Bench(url, papp, pipes, go, args.loop, workers, args.group, urls, slots)
        results: list[Measurement] = []
        try:
            for r in range(args.rounds):
                groups = [[c for c in configs if c.procs == 1 and c.concurrency == 1]]
                groups.append([c for c in configs if c not in groups[0]])
                for group in groups:
                    shift = r % len(group)
                    for config in group[shift:] + group[:shift]:
                        m = await measure(bench, config, args.jobs, r)
                        results.append(m)
                        status = "ok" if m.ok else "CHECK FAILED: " + "; ".join(m.problems)
                        if m.left_on_broker:
                            status += (
                                f" (note: {m.left_on_broker} done messages left on the broker)"
                            )
                        print(
                            f"round {r + 1}/{args.rounds}  {LABELS[config.system]:<24} "
                            f"{config.column:<11} {m.seconds:7.2f} s {m.rate:9,.0f} jobs/s  "
                            + status,
                            flush=True,
                        )
        finally:
            for pipe in pipes:
                pipe.send(None)
            for proc in procs:
                proc.join(timeout=10)
    summary = report(results, configs, args, command)
    summary["machine"] = machine_notes()
    summary["versions"] = versions()
    if not args.keep_db:
        await drop_database(admin_url, args.db)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000, help="jobs per run (5000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every system (3)")
    parser.add_argument(
        "--admin-url",
        default=None,
        help="server to create the benchmark database on "
        "(default $JOBFENCE_DATABASE_URL or postgresql://postgres@127.0.0.1:5432/postgres)",
    )
    parser.add_argument("--db", default="jobfence_bench", help="benchmark database (recreated)")
    parser.add_argument("--keep-db", action="store_true", help="do not drop it at the end")
    parser.add_argument("--no-extra", action="store_true", help="skip the jobfence 1 proc x 4 line")
    parser.add_argument(
        "--systems",
        default="postgres",
        type=lambda text: [part.strip().replace("_", "-") for part in text.split(",") if part],
        help=f"comma-separated subset of {','.join(SYSTEMS)}, or a group: "
        + "; ".join(f"{k} = {','.join(v)}" for k, v in SYSTEM_GROUPS.items())
        + " (default: postgres)",
    )
    for broker, what in (("amqp", "RabbitMQ"), ("nats", "NATS"), ("redis", "Redis")):
        default = bs.DEFAULT_URLS["rabbitmq" if broker == "amqp" else broker]
        parser.add_argument(
            f"--{broker}-url", default=default, help=f"{what} for the broker systems ({default})"
        )
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="event loop of every worker process, all systems alike (uvloop: what `jobfence "
        "worker` runs on by default)",
    )
    parser.add_argument(
        "--group",
        type=int,
        default=10,
        help="jobs_per_transaction of the consumer in the (b2) runs (10)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    args.systems = [s for part in args.systems for s in SYSTEM_GROUPS.get(part, (part,))]
    unknown = set(args.systems) - set(LABELS)
    if unknown:
        parser.error(f"unknown system(s): {', '.join(sorted(unknown))}")
    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    summary = asyncio.run(run(args, command))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
        print(f"results written to {args.json}")
    return 0 if summary["all_checks_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
