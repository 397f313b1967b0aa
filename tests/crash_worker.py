"""A worker process for the crash and shutdown tests of ``test_acceptance_harness.py``.

    python tests/crash_worker.py crash|graceful|unacked|group DATABASE_URL WORKDIR [FLAVOUR]

It runs the ``award_points`` consumer of ``pointsapp`` on ``DATABASE_URL``. The first job's
handler executes its work statement (the awards row), then writes ``WORKDIR/in_handler``
(``<backend pid> <job_id> <attempt>``, written atomically) so the test knows the uncommitted
work exists, and then:

* ``crash``: blocks forever; the test SIGKILLs the process before the commit. The lease is
  1 s and the poll interval long, so the blocked worker does not fetch the job again itself.
* ``unacked``: like ``crash``, but only a job whose job_id ends in ``-block`` blocks; the jobs
  before it commit, and their acks wait in the worker's batch (a batch of 1,000, an hour late)
  when the test SIGKILLs it: committed work whose message was never acknowledged.
* ``group``: like ``unacked``, but the consumer commits up to 5 jobs per transaction and the
  worker fetches 5: the jobs before ``-block`` ran their work in the same open transaction.
  The handler also writes ``WORKDIR/inside`` (the awards rows its transaction sees) first.
* ``graceful``: waits for SIGTERM, then executes its second statement (the balance) and
  returns, so the job finishes after the signal. The worker runs one job at a time and has
  fetched the other queued jobs (batch of 5) without starting them.

FLAVOUR (not in ``unacked`` mode): ``async`` (the default), ``sync`` (a plain def handler on the
sync connection, in a worker thread), or, in ``crash`` mode only, ``sqlalchemy`` (a def handler
writing through the ORM with ``jobfence.contrib.sqlalchemy.session_for``, the row flushed
before the marker) or ``async-sqlalchemy`` (the same with an async handler and
``async_session_for``).

Later jobs (graceful mode) run without blocking. The process prints the worker's summary and
exits 0 after a graceful stop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
from psycopg import AsyncConnection

import pointsapp
from jobfence import App, JobMeta, PgQueue, Worker, open_pool


def write_marker(workdir: Path, backend_pid: object, job: JobMeta) -> None:
    tmp = workdir / "in_handler.tmp"
    tmp.write_text(f"{backend_pid} {job.job_id} {job.attempt}\n")
    tmp.rename(workdir / "in_handler")


def async_orm_crash_app(workdir: Path) -> App:
    """``crash`` mode with an async handler writing through an AsyncSession."""
    app = App()

    @app.consumer("award_points", queue=pointsapp.QUEUE, schema=pointsapp.Award)
    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        from sqlalchemy import text

        import points_orm
        from jobfence.contrib.sqlalchemy import async_session_for

        async with async_session_for(tx) as session:
            session.add(
                points_orm.AwardRow(
                    job_id=job.job_id, account_id=payload.account_id, points=payload.points
                )
            )
            await session.flush()
            pid = (await session.execute(text("SELECT pg_backend_pid()"))).scalar()
            write_marker(workdir, pid, job)
            await asyncio.Event().wait()  # until SIGKILL: the commit never comes

    return app


def flavoured_crash_app(flavour: str, workdir: Path, mode: str) -> App:
    if flavour == "async-sqlalchemy":
        return async_orm_crash_app(workdir)
    return sync_crash_app(flavour, workdir, mode)


# Set on SIGTERM, for a sync handler waiting in its thread (graceful mode).
SIGTERMED = threading.Event()


def sync_crash_app(flavour: str, workdir: Path, mode: str) -> App:
    """``crash``, ``group`` and ``graceful`` modes with a sync handler: the work row, the marker
    (for a group, on its ``-block`` job, after writing ``inside``), then block until SIGKILL
    (graceful: until SIGTERM, then the balance)."""
    app = App()

    @app.consumer(
        "award_points",
        queue=pointsapp.QUEUE,
        schema=pointsapp.Award,
        jobs_per_transaction=5 if mode == "group" else 1,
    )
    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        if flavour == "sqlalchemy":
            from sqlalchemy import text

            import points_orm
            from jobfence.contrib.sqlalchemy import session_for

            with session_for(tx) as session:
                session.add(
                    points_orm.AwardRow(
                        job_id=job.job_id, account_id=payload.account_id, points=payload.points
                    )
                )
                session.flush()
                write_marker(
                    workdir, session.execute(text("SELECT pg_backend_pid()")).scalar(), job
                )
                threading.Event().wait()  # until SIGKILL: the commit never comes
        tx.execute(
            "INSERT INTO public.awards (job_id, account_id, points) VALUES (%s, %s, %s)",
            (job.job_id, payload.account_id, payload.points),
        )
        if mode == "graceful":
            if not (workdir / "in_handler").exists():
                row = tx.execute("SELECT pg_backend_pid()").fetchone()
                assert row is not None
                write_marker(workdir, row[0], job)
                SIGTERMED.wait()
            tx.execute(
                "UPDATE public.accounts SET points = points + %s WHERE id = %s",
                (payload.points, payload.account_id),
            )
            return
        if mode == "group":
            if not job.job_id.endswith("-block"):
                return
            inside = tx.execute("SELECT count(*) FROM public.awards").fetchone()
            assert inside is not None
            (workdir / "inside").write_text(f"{inside[0]}\n")
        row = tx.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        write_marker(workdir, row[0], job)
        threading.Event().wait()  # until SIGKILL: the commit never comes

    return app


async def main(mode: str, url: str, workdir: Path, flavour: str = "async") -> int:
    marker = workdir / "in_handler"
    terminated = asyncio.Event()
    app = App() if flavour == "async" else flavoured_crash_app(flavour, workdir, mode)

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await tx.execute(
            "INSERT INTO public.awards (job_id, account_id, points) VALUES (%s, %s, %s)",
            (job.job_id, payload.account_id, payload.points),
        )
        blocking = mode not in ("unacked", "group") or job.job_id.endswith("-block")
        if blocking and not marker.exists():
            if mode == "group":
                cur = await tx.execute("SELECT count(*) FROM public.awards")
                inside = await cur.fetchone()
                assert inside is not None
                (workdir / "inside").write_text(f"{inside[0]}\n")
            cur = await tx.execute("SELECT pg_backend_pid()")
            row = await cur.fetchone()
            assert row is not None
            tmp = workdir / "in_handler.tmp"
            tmp.write_text(f"{row[0]} {job.job_id} {job.attempt}\n")
            tmp.rename(marker)
            if mode in ("crash", "unacked", "group"):
                await asyncio.Event().wait()  # until SIGKILL: the commit never comes
            await terminated.wait()
        await tx.execute(
            "UPDATE public.accounts SET points = points + %s WHERE id = %s",
            (payload.points, payload.account_id),
        )

    if flavour == "async":
        app.consumer(
            "award_points",
            queue=pointsapp.QUEUE,
            schema=pointsapp.Award,
            jobs_per_transaction=5 if mode == "group" else 1,
        )(award)

    pool = await open_pool(url, min_size=1, max_size=4, name=f"crash-worker-{mode}")
    queue = PgQueue(pool)
    if mode == "crash":
        worker = Worker(
            app, pool, queue, concurrency=1, batch_size=1, lease_seconds=1.0, poll_seconds=60.0
        )
    elif mode == "group":
        worker = Worker(
            app, pool, queue, concurrency=1, batch_size=5, lease_seconds=1.0, poll_seconds=60.0
        )
    elif mode == "unacked":
        worker = Worker(
            app,
            pool,
            queue,
            concurrency=1,
            batch_size=1,
            lease_seconds=1.0,
            poll_seconds=60.0,
            ack_batch_size=1000,
            ack_delay_seconds=3600.0,
        )
    else:
        worker = Worker(
            app,
            pool,
            queue,
            concurrency=1,
            batch_size=5,
            lease_seconds=60.0,
            poll_seconds=0.2,
            shutdown_grace_seconds=20.0,
        )

    def on_sigterm() -> None:
        worker.stop()
        terminated.set()
        SIGTERMED.set()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        stats = await worker.run()
        await queue.close()
    finally:
        await pool.close()
    outcomes = " ".join(f"{k}={v}" for k, v in sorted(stats.outcomes.items()))
    print(f"stopped {outcomes} released={stats.released}", flush=True)
    return 0


if __name__ == "__main__":
    if (
        len(sys.argv) not in (4, 5)
        or sys.argv[1] not in ("crash", "graceful", "unacked", "group")
        or sys.argv[4:] not in ([], ["async"], ["sync"], ["sqlalchemy"], ["async-sqlalchemy"])
        or (sys.argv[4:] not in ([], ["async"]) and sys.argv[1] == "unacked")
        or (sys.argv[4:] in (["sqlalchemy"], ["async-sqlalchemy"]) and sys.argv[1] != "crash")
    ):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    os.environ.pop("JOBFENCE_DATABASE_URL", None)  # the URL argument names the database
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), *sys.argv[4:])))
