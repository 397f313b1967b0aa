"""A worker whose handler never returns, for the lease-extension crash test.

    python tests/lease_worker_proc.py QUEUE_KIND DATABASE_URL BROKER_URL NAME LEASE MAX_HANDLER

QUEUE_KIND is ``pg`` (the PostgreSQL queue; BROKER_URL and NAME are not used) or one of
``brokers.BROKERS``. The worker runs one job at a time with ``lease_seconds=LEASE`` and
``max_handler_seconds=MAX_HANDLER`` (lease extension on). The ``held`` consumer's handler prints
``started <job_id> <attempt>`` and then blocks forever: the test SIGKILLs the process.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import psycopg
from pydantic import BaseModel

from brokers import make_queue
from jobfence import App, JobMeta, PgQueue, QueuePort, Worker, open_pool

QUEUE = "leases.held"


class Held(BaseModel):
    pass


async def main(argv: list[str]) -> None:
    kind, database_url, broker_url, name = argv[:4]
    lease, cap = float(argv[4]), float(argv[5])
    app = App()

    @app.consumer("held", queue=QUEUE, schema=Held)
    async def held(payload: Held, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
        print("started", job.job_id, job.attempt, flush=True)
        await asyncio.Event().wait()  # until SIGKILL

    pool = await open_pool(database_url, max_size=4)
    queue: QueuePort = (
        PgQueue(pool, poll_interval_seconds=0.1)
        if kind == "pg"
        else make_queue(kind, broker_url, name)
    )
    worker = Worker(
        app,
        pool,
        queue,
        concurrency=1,
        poll_seconds=0.1,
        lease_seconds=lease,
        max_handler_seconds=cap,
        outbox_relay=False,
    )
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
