"""The application of the end-to-end broker tests (``tests/test_broker_chaos.py``).

One consumer, ``award`` on the queue ``chaos``: each job inserts one ``public.awards`` row (the
effect, counted per job_id) and adds its points to an account. ``mode`` says how it behaves:

- ``ok``: applies;
- ``transient``: fails (``Flaky``) on its first two deliveries, then applies; the retry policy
  is shortened (4 retries from 0.2 s) so that the test runs in seconds;
- ``hard``: ``HardFailure`` while ``public.chaos_fixed`` is empty (the account is closed),
  applies once a row says it was fixed: a bulk replay after the fix applies it.
"""

from __future__ import annotations

from typing import Any, Literal

from psycopg import AsyncConnection
from pydantic import BaseModel, Field

from jobfence import App, HardFailure, JobMeta, RetryPolicy

QUEUE = "chaos"
CONSUMER = "award"
SCHEMA_SQL = """
CREATE TABLE public.accounts (id integer PRIMARY KEY, points bigint NOT NULL DEFAULT 0);
CREATE TABLE public.awards (
    job_id text NOT NULL, account_id integer NOT NULL, points integer NOT NULL);
CREATE TABLE public.chaos_fixed (fixed boolean NOT NULL);
INSERT INTO public.accounts (id) SELECT generate_series(1, 10);
"""
POLICY = RetryPolicy(
    max_retries=4,
    base_seconds=0.2,
    cap_seconds=1.0,
    rationale="an end-to-end test: retries within seconds",
)


class Award(BaseModel):
    account_id: int = Field(ge=1, le=10)
    points: int = Field(gt=0)
    mode: Literal["ok", "transient", "hard"] = "ok"


class Flaky(Exception):
    pass


app = App()


@app.consumer(CONSUMER, queue=QUEUE, schema=Award, retry=POLICY)
async def award(payload: Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
    if payload.mode == "transient" and job.attempt < 3:
        raise Flaky(f"ledger timeout on attempt {job.attempt}")
    if payload.mode == "hard":
        cur = await tx.execute("SELECT count(*) FROM public.chaos_fixed")
        row = await cur.fetchone()
        if not (row and row[0]):
            raise HardFailure("account is closed")
    await tx.execute(
        "INSERT INTO public.awards (job_id, account_id, points) VALUES (%s, %s, %s)",
        (job.job_id, payload.account_id, payload.points),
    )
    await tx.execute(
        "UPDATE public.accounts SET points = points + %s WHERE id = %s",
        (payload.points, payload.account_id),
    )
