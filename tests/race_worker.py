"""A worker process for the concurrent-duplicates tests of ``test_sync_handlers.py``.

    python tests/race_worker.py FLAVOUR DATABASE_URL WORKDIR OTHERS

Runs pointsapp's ``award_points`` consumer with a handler of FLAVOUR (``async``, ``sync``: a plain
def handler, ``sqlalchemy``: a def handler writing through the ORM, ``async-sqlalchemy``: an
async handler writing through the ORM's AsyncSession), one job at a time, until
SIGTERM. Before its work, every handler call waits until OTHERS other backends of the database
are blocked on a lock (the uncommitted fence key it holds), polling from a connection of its
own for at most 20 s; a handler that times out writes ``WORKDIR/errors``. Each handler call
appends ``<job_id>`` to ``WORKDIR/ran.<pid>``. At exit it prints the worker's outcomes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import AsyncConnection

import pointsapp
from jobfence import App, JobMeta, PgQueue, Worker, open_pool

BLOCKED = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
)
WAIT_SECONDS = 20.0


def note(workdir: Path, job: JobMeta) -> None:
    with (workdir / f"ran.{os.getpid()}").open("a") as out:
        out.write(f"{job.job_id}\n")


def build(flavour: str, url: str, workdir: Path, others: int) -> App:
    app = App()
    register = app.consumer("award_points", queue=pointsapp.QUEUE, schema=pointsapp.Award)
    if flavour in ("async", "async-sqlalchemy"):

        async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
            note(workdir, job)
            async with await AsyncConnection.connect(url, autocommit=True) as probe:
                deadline = time.monotonic() + WAIT_SECONDS
                while True:
                    cur = await probe.execute(BLOCKED)
                    row = await cur.fetchone()
                    if row is not None and row[0] >= others:
                        break
                    if time.monotonic() > deadline:
                        (workdir / "errors").write_text(f"{job.job_id}: duplicates never blocked")
                        raise TimeoutError("duplicates never blocked")
                    await asyncio.sleep(0.02)
            if flavour == "async":
                await pointsapp.apply_award(payload, job, tx)
            else:
                import points_orm

                await points_orm.apply_award_orm_async(payload, job, tx)

        register(award)
        return app

    def wait_for_others(job: JobMeta) -> None:
        with psycopg.connect(url, autocommit=True) as probe:
            deadline = time.monotonic() + WAIT_SECONDS
            while True:
                row = probe.execute(BLOCKED).fetchone()
                if row is not None and row[0] >= others:
                    return
                if time.monotonic() > deadline:
                    (workdir / "errors").write_text(f"{job.job_id}: duplicates never blocked")
                    raise TimeoutError("duplicates never blocked")
                time.sleep(0.02)

    if flavour == "sync":

        def award_sync(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
            note(workdir, job)
            wait_for_others(job)
            pointsapp.apply_award_sync(payload, job, tx)

        register(award_sync)
        return app

    import points_orm

    def award_orm(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        note(workdir, job)
        wait_for_others(job)
        points_orm.apply_award_orm(payload, job, tx)

    register(award_orm)
    return app


async def main(flavour: str, url: str, workdir: Path, others: int) -> int:
    app = build(flavour, url, workdir, others)
    pool = await open_pool(url, min_size=1, max_size=3, name=f"race-{flavour}")
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    worker = Worker(app, pool, queue, concurrency=1, batch_size=1, poll_seconds=0.05)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
    (workdir / f"ready.{os.getpid()}").write_text("")
    try:
        stats = await worker.run()
        await queue.close()
    finally:
        await pool.close()
    outcomes = " ".join(f"{k}={v}" for k, v in sorted(stats.outcomes.items()))
    print(f"stopped {outcomes}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] not in ("async", "sync", "sqlalchemy", "async-sqlalchemy"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    os.environ.pop("JOBFENCE_DATABASE_URL", None)
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))))
