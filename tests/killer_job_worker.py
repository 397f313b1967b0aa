"""A worker process whose job kills it: ``python tests/killer_job_worker.py DATABASE_URL WORKDIR``.

It runs one consumer, ``killer``, on the PostgreSQL queue, with a 1 s lease and a retry policy of
one attempt (``max_retries=0``). Its handler appends ``<attempt>`` to ``WORKDIR/runs`` and then
SIGKILLs its own process, as a job that runs the worker out of memory or crashes a C extension
would: every delivery ends with no outcome. The test restarts the process until the job is
dead-lettered by the delivery limit.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import psycopg
from pydantic import BaseModel

from jobfence import App, JobMeta, PgQueue, RetryPolicy, Worker, open_pool

QUEUE = "killer_queue"


class Doom(BaseModel):
    n: int


def build_app(workdir: Path) -> App:
    app = App()
    policy = RetryPolicy(max_retries=0, rationale="the test counts deliveries, not retries")

    @app.consumer("killer", queue=QUEUE, schema=Doom, retry=policy)
    async def killer(payload: Doom, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
        with (workdir / "runs").open("a") as runs:
            runs.write(f"{job.attempt}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    return app


async def main(database_url: str, workdir: Path) -> None:
    pool = await open_pool(database_url, min_size=1, max_size=3, name="killer")
    try:
        worker = Worker(
            build_app(workdir),
            pool,
            PgQueue(pool, poll_interval_seconds=0.1),
            lease_seconds=1.0,
            poll_seconds=0.1,
            outbox_relay=False,
        )
        await worker.run(until="empty")
    finally:
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
