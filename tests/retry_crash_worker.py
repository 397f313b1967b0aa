"""A worker process SIGKILLed between a retry's outbox commit and its ack, for
``test_retries_through_the_outbox.py``.

    python tests/retry_crash_worker.py BROKER BROKER_URL NAME DATABASE_URL WORKDIR

It runs :func:`build_app`'s consumer on the broker's queue adapter (named after NAME, as
``tests/brokers.py`` does), without the outbox relay, one job at a time. The adapter's ``ack``
is wrapped: the first ack of a first delivery (attempt 1) writes ``WORKDIR/before_ack``
atomically and blocks forever, so the test can SIGKILL the process exactly there. The handler
fails every first delivery, so that ack is the one the harness sends right after committing
the delivery's retry to the outbox.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection
from pydantic import BaseModel

from brokers import make_queue
from jobfence import App, JobMeta, RetryPolicy, Worker, open_pool
from jobfence.model import Delivery

QUEUE = "retries"
CONSUMER = "flaky_award"
EFFECTS_SQL = "CREATE TABLE IF NOT EXISTS public.retry_effects (job_id text NOT NULL)"
LEASE_SECONDS = 2.0


class Job(BaseModel):
    # Deliveries that fail before one succeeds; -1: every delivery fails.
    fail_times: int


class Flaky(Exception):
    pass


def build_app(policy: RetryPolicy, seen: list[tuple[str, int, float, str]] | None = None) -> App:
    """The consumer: its effect is one ``public.retry_effects`` row per applied job. ``seen``
    collects ``(job_id, attempt, loop time, "arrived" | "failed")`` of each handler run."""
    app = App()

    @app.consumer(CONSUMER, queue=QUEUE, schema=Job, retry=policy)
    async def handle(payload: Job, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        loop = asyncio.get_running_loop()
        if seen is not None:
            seen.append((job.job_id, job.attempt, loop.time(), "arrived"))
        await tx.execute("INSERT INTO public.retry_effects (job_id) VALUES (%s)", (job.job_id,))
        if payload.fail_times < 0 or job.attempt <= payload.fail_times:
            if seen is not None:
                seen.append((job.job_id, job.attempt, loop.time(), "failed"))
            raise Flaky(f"ledger timeout on attempt {job.attempt}")

    return app


POLICY = RetryPolicy(
    max_retries=2, base_seconds=0.5, cap_seconds=5.0, rationale="a test needs quick retries"
)


async def main(kind: str, url: str, name: str, database_url: str, workdir: Path) -> int:
    marker = workdir / "before_ack"
    queue = make_queue(kind, url, name)
    real_ack = queue.ack

    async def ack(delivery: Delivery, *, tx: Any = None) -> bool:
        if delivery.attempt == 1 and not marker.exists():
            tmp = workdir / "before_ack.tmp"
            tmp.write_text(f"{delivery.message.job_id}\n")
            tmp.rename(marker)
            await asyncio.Event().wait()  # until SIGKILL: the ack never goes
        return await real_ack(delivery, tx=tx)

    queue.ack = ack  # type: ignore[method-assign]
    pool = await open_pool(database_url, min_size=1, max_size=4, name="retry-crash-worker")
    try:
        worker = Worker(
            build_app(POLICY),
            pool,
            queue,
            concurrency=1,
            batch_size=1,
            lease_seconds=LEASE_SECONDS,
            poll_seconds=0.05,
            outbox_relay=False,
        )
        await worker.run()
    finally:
        await queue.close()
        await pool.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 6:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    os.environ.pop("JOBFENCE_DATABASE_URL", None)  # the argument names the database
    sys.exit(
        asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5])))
    )
