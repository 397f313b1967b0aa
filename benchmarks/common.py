"""Shared pieces of the benchmarks: the database, the work statement and the bench apps.

Every system under test does the same work per job, one statement on a small accounts table:
``UPDATE bench_accounts SET points = points + %s WHERE id = %s``. Job ``i`` (counting from 0)
adds ``i % 7 + 1`` points to account ``i % ACCOUNTS + 1``, so the expected total is known and
every run checks that each job's effect was applied exactly once.
"""

from __future__ import annotations

import os
import platform
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import procrastinate
import psutil
import psycopg
from psycopg.conninfo import make_conninfo
from pydantic import BaseModel

from jobfence import App, JobMeta
from jobfence.schema import migrate

DEFAULT_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
BENCH_DB = "jobfence_bench"
ACCOUNTS = 1000
QUEUE = "bench"
CONSUMER = "bench_award"
CEILING_CONSUMER = "bench_ceiling"

WORK_SQL = "UPDATE bench_accounts SET points = points + %s WHERE id = %s"
# The same fence row jobfence writes (core.sql "fence_insert"), with jobfence's default TTL.
FENCE_SQL = (
    "INSERT INTO core.processed_jobs (job_id, consumer, tenant_id, expires_at)"
    " VALUES (%s, %s, NULL, now() + interval '7 days')"
    " ON CONFLICT (job_id, consumer) DO NOTHING"
)

BENCH_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS bench_accounts (id integer PRIMARY KEY, points bigint NOT NULL);
INSERT INTO bench_accounts (id, points) SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) AS g
ON CONFLICT DO NOTHING;
"""

# Pre-enqueue n messages straight into the jobfence queue table; the body is byte for byte what
# App.message() produces for AwardPoints (pydantic's compact JSON).
ENQUEUE_SQL = f"""
INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body)
SELECT %(queue)s, %(consumer)s, %(prefix)s || g,
       convert_to(format('{{"account_id":%%s,"points":%%s}}', g %% {ACCOUNTS} + 1, g %% 7 + 1),
                  'UTF8')
FROM generate_series(%(start)s::bigint, %(stop)s::bigint - 1) AS g
"""


def job_work(i: int) -> tuple[int, int]:
    """(points, account_id) of job ``i``: the parameters of WORK_SQL."""
    return i % 7 + 1, i % ACCOUNTS + 1


def expected_points(n: int) -> int:
    return sum(i % 7 + 1 for i in range(n))


def alternating(names: Iterable[str], rounds: int) -> Iterator[tuple[str, str]]:
    """``(round label, name)`` for ``rounds`` rounds of every name, the order reversed every
    other round, so that neither side of a comparison always runs first (a warmer cache, a
    quieter minute)."""
    order = list(names)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            yield f"round {r + 1}/{rounds}", name


def admin_url_from_env() -> str:
    return os.environ.get("JOBFENCE_DATABASE_URL", DEFAULT_ADMIN_URL)


def bench_url(admin_url: str, dbname: str = BENCH_DB) -> str:
    return make_conninfo(admin_url, dbname=dbname)


async def create_database(admin_url: str, dbname: str = BENCH_DB) -> str:
    """(Re)create the benchmark database, migrate jobfence into it, add the accounts table."""
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
        await conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{dbname}"')
    url = bench_url(admin_url, dbname)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
        await conn.execute(BENCH_SCHEMA)
    return url


async def drop_database(admin_url: str, dbname: str = BENCH_DB) -> None:
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
        await conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


async def enqueue_jobfence(
    conn: psycopg.AsyncConnection[Any], prefix: str, start: int, stop: int
) -> None:
    await conn.execute(
        ENQUEUE_SQL,
        {"queue": QUEUE, "consumer": CONSUMER, "prefix": prefix, "start": start, "stop": stop},
    )


async def scalar(conn: psycopg.AsyncConnection[Any], query: Any, params: Any = None) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    return row[0] if row else None


class AwardPoints(BaseModel):
    account_id: int
    points: int


class Tracker:
    """Counts finished jobs in one process and remembers when the first and last ran."""

    def __init__(self) -> None:
        self.count = 0
        self.first = 0.0
        self.last = 0.0

    def done(self) -> None:
        now = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes on Linux
        if not self.count:
            self.first = now
        self.count += 1
        self.last = now


def build_jobfence_app(
    tracker: Tracker | None = None, jobs_per_transaction: int = 1, flavour: str = "async"
) -> App:
    """The benchmark's consumer; ``flavour``: ``async`` (an async def handler), ``sync`` (a plain
    def handler on the sync connection, in a worker thread) or ``sqlalchemy`` (a def handler
    running the same UPDATE as an ORM-enabled statement through a Session on that connection)."""
    app = App()
    register = app.consumer(
        CONSUMER, queue=QUEUE, schema=AwardPoints, jobs_per_transaction=jobs_per_transaction
    )
    if flavour == "async":

        @register
        async def award(
            payload: AwardPoints, job: JobMeta, tx: psycopg.AsyncConnection[Any]
        ) -> None:
            await tx.execute(WORK_SQL, (payload.points, payload.account_id))
            if tracker is not None:
                tracker.done()

        return app

    lock = threading.Lock()  # the handlers run in several threads

    def done() -> None:
        if tracker is not None:
            with lock:
                tracker.done()

    if flavour == "sync":

        @register
        def award_sync(payload: AwardPoints, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
            tx.execute(WORK_SQL, (payload.points, payload.account_id))
            done()

        return app

    from sqlalchemy import BigInteger, Integer, update
    from sqlalchemy.orm import DeclarativeBase, mapped_column

    from jobfence.contrib.sqlalchemy import session_for

    class Base(DeclarativeBase):
        pass

    class Account(Base):
        __tablename__ = "bench_accounts"
        # Not annotated: the annotations of a class defined in a function are not resolvable.
        id = mapped_column(Integer, primary_key=True)
        points = mapped_column(BigInteger)

    statement = update(Account)

    @register
    def award_orm(payload: AwardPoints, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        with session_for(tx) as session:
            session.execute(
                statement.where(Account.id == payload.account_id).values(
                    points=Account.points + payload.points
                )
            )
        done()

    return app


def git_revision() -> str:
    """The commit of the checkout being measured, with ``-dirty`` if it has local changes."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--exclude", "*"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def versions() -> dict[str, str]:
    found = {"git": git_revision(), "python": platform.python_version()}
    for dist in ("jobfence", "psycopg", "psycopg-pool", "pydantic", "procrastinate"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "-"
    return found


async def server_notes(url: str) -> dict[str, str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        notes = {"postgres": str(await scalar(conn, "SHOW server_version"))}
        for setting in ("synchronous_commit", "shared_buffers", "max_connections", "autovacuum"):
            notes[setting] = str(await scalar(conn, f"SHOW {setting}"))
    return notes


def cpu_pressure() -> str:
    """Linux PSI: the share of time some runnable task waited for a CPU (10 s, 60 s, 300 s)."""
    try:
        line = Path("/proc/pressure/cpu").read_text(encoding="ascii").splitlines()[0]
    except (OSError, IndexError):
        return "n/a"
    fields = dict(part.split("=") for part in line.split()[1:])
    return "/".join(f"{float(fields[k]):.0f}%" for k in ("avg10", "avg60", "avg300"))


def machine_notes() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
        f"load average {load}, CPU pressure (PSI some, 10s/60s/300s) {cpu_pressure()}"
    )


def build_procrastinate_app(
    url: str, work: Callable[[int, int], Awaitable[None]] | None = None
) -> procrastinate.App:
    """A Procrastinate app with its default connector settings and one task, ``bench_award``."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    @app.task(name=CONSUMER, queue=QUEUE)
    async def bench_award(account_id: int, points: int) -> None:
        if work is not None:
            await work(points, account_id)

    return app


def server_cpu() -> dict[int, float]:
    """CPU seconds of every PostgreSQL process on this machine (a local server is assumed),
    including the backends that have exited: the postmaster's children times hold those."""
    found = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        if proc.info["name"] in ("postgres", "postmaster") and proc.info["cpu_times"]:
            t = proc.info["cpu_times"]
            found[proc.pid] = t.user + t.system + t.children_user + t.children_system
    return found


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two :func:`server_cpu`-like readings (by pid; a process that
    started meanwhile counts whole)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())
