"""TTL cleanup of fence rows: bounded batches, database clock, never a row still in its TTL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import AsyncConnection

from jobfence.db import connect_options
from jobfence.harness import SQL
from jobfence.pgtx import execute_read_committed
from jobfence.ports import CleanupMetricsSink

log = logging.getLogger("jobfence.cleanup")

DEFAULT_BATCH_SIZE = 5000


@dataclass(frozen=True, slots=True)
class CleanupResult:
    deleted: int
    batches: int


async def cleanup_expired(
    conn: AsyncConnection[Any],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_batches: int | None = None,
    metrics: CleanupMetricsSink | None = None,
) -> CleanupResult:
    """Delete fence rows with ``expires_at < now()`` (database clock), one short transaction
    per batch of at most ``batch_size`` rows, until a batch comes back short.

    A fence whose job may still have a copy in the PostgreSQL queue is kept, expired or not:
    every fence of a consumer written since its oldest message there that is not a job waiting
    for its first run (a worker that died between a commit and its ack, and no worker on that
    queue since). The next round removes them once the copies are gone.

    ``conn`` must be in autocommit mode so each batch commits on its own: no long lock, no table
    rewrite, and concurrent workers never wait long behind it. ``metrics`` hears the rows of
    each committed batch and, when the round ends without error, a success.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if not conn.autocommit:
        raise ValueError("cleanup needs an autocommit connection (one transaction per batch)")
    deleted = 0
    batches = 0
    held = await (await execute_read_committed(conn, SQL["cleanup_held_since"])).fetchall()
    params = {
        "batch_size": batch_size,
        "held_consumers": [consumer for consumer, _ in held],
        "held_since": [since for _, since in held],
    }
    while max_batches is None or batches < max_batches:
        # READ COMMITTED whatever the database's default: a batch skips or re-reads the rows a
        # concurrent cleanup took, where a stricter level would fail it (a serialization failure).
        cur = await execute_read_committed(conn, SQL["cleanup_expired_batch"], params)
        batches += 1
        deleted += max(cur.rowcount, 0)
        if metrics is not None:
            metrics.cleanup_rows_removed(max(cur.rowcount, 0))
        if cur.rowcount < batch_size:
            break
    if metrics is not None:
        metrics.cleanup_succeeded()
    return CleanupResult(deleted=deleted, batches=batches)


async def cleanup_every(
    conninfo: str,
    *,
    interval_seconds: float,
    stop: asyncio.Event,
    batch_size: int = DEFAULT_BATCH_SIZE,
    metrics: CleanupMetricsSink | None = None,
) -> int:
    """Run :func:`cleanup_expired` every ``interval_seconds`` until ``stop`` is set.

    Each round uses a fresh connection, so a database restart or a lost connection costs one
    round (logged, and reported to ``metrics`` as ``cleanup_failed``), not the scheduler.
    """
    if interval_seconds <= 0:
        raise ValueError("interval_seconds must be > 0")
    total = 0
    while not stop.is_set():
        try:
            async with await psycopg.AsyncConnection.connect(
                conninfo, autocommit=True, connect_timeout=10, **connect_options()
            ) as conn:
                result = await cleanup_expired(conn, batch_size=batch_size, metrics=metrics)
        except psycopg.Error as exc:
            if metrics is not None:
                metrics.cleanup_failed()
            log.warning(
                "cleanup round failed (%s: %s); next try in %gs",
                type(exc).__name__,
                " ".join(str(exc).split())[:300],
                interval_seconds,
            )
        else:
            total += result.deleted
            log.info(
                "cleanup removed %d expired fence rows in %d batch(es)",
                result.deleted,
                result.batches,
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_seconds)
    return total
