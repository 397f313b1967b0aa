"""Slow handlers: each sleeps ``SLOW_SECONDS`` inside its transaction, after its work statement,
so a worker stopped mid-run has jobs in flight with uncommitted effects."""

from __future__ import annotations

import os
from typing import Any

from psycopg import AsyncConnection

from jobfence import App, JobMeta
from pointsapp import QUEUE, Award, apply_award

SLOW_SECONDS = float(os.environ.get("SLOW_SECONDS", "60"))


async def slow_award(payload: Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
    await apply_award(payload, job, tx)
    await tx.execute("SELECT pg_sleep(%s)", (SLOW_SECONDS,))


app = App()
app.consumer("award_points", queue=QUEUE, schema=Award)(slow_award)
