"""A points-awarding application used by the tests: the effect is money, so count it."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from pydantic import BaseModel, Field

from jobfence import App, HardFailure, JobMeta, RetryPolicy

QUEUE = "loyalty"
SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS public.accounts (
    id integer PRIMARY KEY, points bigint NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS public.awards (
    job_id text NOT NULL, account_id integer NOT NULL, points integer NOT NULL);
INSERT INTO public.accounts (id) SELECT generate_series(1, 10) ON CONFLICT DO NOTHING;
"""


class Award(BaseModel):
    account_id: int = Field(ge=1)
    points: int = Field(gt=0)
    mode: str = "ok"  # ok | transient | hard | slow


class Flaky(Exception):
    pass


async def apply_award(payload: Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
    """The work statement: an awards row (the effect we count) and the balance."""
    if payload.mode == "transient":
        raise Flaky(f"ledger timeout on attempt {job.attempt}")
    if payload.mode == "hard":
        raise HardFailure("account is closed")
    await tx.execute(
        "INSERT INTO public.awards (job_id, account_id, points) VALUES (%s, %s, %s)",
        (job.job_id, payload.account_id, payload.points),
    )
    await tx.execute(
        "UPDATE public.accounts SET points = points + %s WHERE id = %s",
        (payload.points, payload.account_id),
    )
    if payload.mode == "slow":
        await tx.execute("SELECT pg_sleep(0.02)")


def build_app(retry: RetryPolicy | None = None, *, jobs_per_transaction: int = 1) -> App:
    app = App()
    app.consumer(
        "award_points",
        queue=QUEUE,
        schema=Award,
        jobs_per_transaction=jobs_per_transaction,
        **({"retry": retry} if retry else {}),
    )(apply_award)
    return app


app = build_app()
