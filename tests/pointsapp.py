"""A points-awarding application used by the tests: the effect is money, so count it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
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


def apply_award_sync(payload: Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
    """:func:`apply_award` as a sync handler: the same statements on a sync connection."""
    if payload.mode == "transient":
        raise Flaky(f"ledger timeout on attempt {job.attempt}")
    if payload.mode == "hard":
        raise HardFailure("account is closed")
    tx.execute(
        "INSERT INTO public.awards (job_id, account_id, points) VALUES (%s, %s, %s)",
        (job.job_id, payload.account_id, payload.points),
    )
    tx.execute(
        "UPDATE public.accounts SET points = points + %s WHERE id = %s",
        (payload.points, payload.account_id),
    )
    if payload.mode == "slow":
        tx.execute("SELECT pg_sleep(0.02)")


class _Cursor:
    def __init__(self, cur: psycopg.Cursor[Any]) -> None:
        self._cur = cur

    async def fetchone(self) -> Any:
        return self._cur.fetchone()

    async def fetchall(self) -> list[Any]:
        return self._cur.fetchall()


class AsyncOverSync:
    """The awaitable face of a sync connection, for :func:`as_sync`: each statement runs at
    once, in the calling thread, on the sync connection and its transaction."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    async def execute(self, query: Any, params: Any = None) -> _Cursor:
        return _Cursor(self.conn.execute(query, params))


AsyncHandler = Callable[[Any, JobMeta, AsyncConnection[Any]], Awaitable[None]]


def as_sync(handler: AsyncHandler) -> Callable[[Any, JobMeta, psycopg.Connection[Any]], None]:
    """A plain ``def`` handler running ``handler``'s body on the sync connection it is given:
    the tests written for async handlers then exercise sync handlers too (the consumer is a
    real sync consumer: its transaction runs in a worker thread on the sync pool)."""

    def run(payload: Any, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        asyncio.run(handler(payload, job, AsyncOverSync(tx)))  # type: ignore[arg-type]

    return run


def flavoured(handler: AsyncHandler, flavour: str) -> Any:
    """``handler`` as is (``async``) or as a sync handler (``sync``)."""
    return handler if flavour == "async" else as_sync(handler)


def build_app(
    retry: RetryPolicy | None = None, *, jobs_per_transaction: int = 1, flavour: str = "async"
) -> App:
    app = App()
    app.consumer(
        "award_points",
        queue=QUEUE,
        schema=Award,
        jobs_per_transaction=jobs_per_transaction,
        **({"retry": retry} if retry else {}),
    )(apply_award if flavour == "async" else apply_award_sync)
    return app


app = build_app()


async def enqueue_awards(database_url: str, job_ids: list[str]) -> None:
    """One award of 1 point to account 1 per job id, enqueued in one transaction (through the
    outbox when the database's queue is a broker)."""
    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        for job_id in job_ids:
            await app.enqueue(tx, "award_points", {"account_id": 1, "points": 1}, job_id=job_id)
        await tx.commit()
