"""Bulk replay: a fixed snapshot of matching dead letters, replayed a chunk at a time."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection, errors, sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from jobfence._sql import Queries
from jobfence.dead_letters import (
    publish_with,
    replay_message,
)
from jobfence.errors import DeadLetterNotReplayable
from jobfence.ops.errors import BulkReplayNotFound, BulkTooLarge, InvalidRequest
from jobfence.ops.filters import DeadLetterFilter
from jobfence.ops.listing import count_dead_letters
from jobfence.pgtx import SET_READ_COMMITTED
from jobfence.ports import QueuePort

SQL = Queries("jobfence.sql", "ops.sql")

log = logging.getLogger("jobfence.ops")

DEFAULT_BULK_MAX = 10_000
MAX_BULK_ITEMS = 1_000_000  # the largest max_items a run may be given (API and CLI)
BULK_CHUNK = 500
# How long a run waits at a time for dead letters another transaction holds (logged at INFO
# each time it waits on).
LOCK_WAIT_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class BulkReplay:
    """A bulk replay and its progress: ``counts`` has replayed, already_processed, not_pending,
    failed and pending (not processed yet)."""

    id: int
    filter: dict[str, Any]
    requested_by: str
    max_items: int
    total: int
    status: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BulkItem:
    dead_letter_id: int
    result: str | None
    detail: str | None
    processed_at: datetime | None


# Worded for the HTTP API (its body field ``all``); the CLI words them with ``--all``.
BULK_ALL_NEEDED = (
    "no filter given: a bulk replay of every pending dead letter (poison included) must be "
    'asked for explicitly with "all": true'
)
BULK_ALL_WITH_FILTER = (
    'a filter and "all": true contradict each other: "all" selects every pending dead letter;'
    ' give either filters or "all"'
)


def check_bulk_selection(flt: DeadLetterFilter, *, select_all: bool) -> None:
    """A bulk replay selects by filter, or everything when asked for explicitly: no filter
    without ``select_all`` (:data:`BULK_ALL_NEEDED`), and not both
    (:data:`BULK_ALL_WITH_FILTER`). ``status`` is not a filter here."""
    filtered = any(v is not None for k, v in asdict(flt).items() if k != "status")
    if select_all and filtered:
        raise InvalidRequest(BULK_ALL_WITH_FILTER, field="all")
    if not select_all and not filtered:
        raise InvalidRequest(BULK_ALL_NEEDED, field="all")


def _pending_filter(flt: DeadLetterFilter) -> DeadLetterFilter:
    if flt.status not in (None, "pending_review"):
        raise InvalidRequest("bulk replay takes pending_review dead letters only")
    return DeadLetterFilter(**{**asdict(flt), "status": "pending_review"})


async def start_bulk_replay(
    pool: AsyncConnectionPool[Any],
    flt: DeadLetterFilter,
    *,
    max_items: int = DEFAULT_BULK_MAX,
    requested_by: str,
    dry_run: bool = False,
    select_all: bool = False,
) -> BulkReplay | int:
    """Fix the snapshot: the pending dead letters matching ``flt`` now, and only those.

    ``flt`` without a filter selects every pending dead letter, and only with ``select_all``
    (which takes no filter): see :func:`check_bulk_selection`; a refusal changes nothing.
    ``dry_run`` returns how many match and changes nothing. More matches than ``max_items``
    raise :class:`BulkTooLarge` (nothing is taken). Otherwise the run is recorded with its items
    and returned; process it with :func:`run_bulk_replay`.
    """
    if max_items < 1:
        raise InvalidRequest("max_items must be >= 1")
    if not requested_by.strip():
        raise InvalidRequest("requested_by must name who asks")
    check_bulk_selection(flt, select_all=select_all)
    flt = _pending_filter(flt)
    async with pool.connection() as conn:
        if dry_run:
            return await count_dead_letters(conn, flt)
        async with conn.transaction():
            # The snapshot and, when it is too large, the count see the same rows.
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cur = await conn.execute(
                SQL["bulk_create"],
                {
                    "filter": Jsonb(flt.to_json()),
                    "requested_by": requested_by,
                    "max_items": max_items,
                },
            )
            row = await cur.fetchone()
            assert row is not None
            bulk_id = int(row[0])
            # One scan: take at most one row more than allowed; one more means too many.
            where, params = flt.where()
            cur = await conn.execute(
                SQL["bulk_snapshot_base"] + where + sql.SQL(" LIMIT %(cap)s"),
                params | {"bulk_id": bulk_id, "cap": max_items + 1},
            )
            if cur.rowcount > max_items:  # raised inside: rolled back, nothing recorded
                raise BulkTooLarge(await count_dead_letters(conn, flt), max_items)
            await conn.execute(SQL["bulk_set_total"], {"id": bulk_id, "total": cur.rowcount})
        return await get_bulk_replay(conn, bulk_id)


async def get_bulk_replay(conn: AsyncConnection[Any], bulk_id: int) -> BulkReplay:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(SQL["bulk_get"], {"id": bulk_id})
        row = await cur.fetchone()
        if row is None:
            raise BulkReplayNotFound(f"no bulk replay with id {bulk_id}")
        await cur.execute(SQL["bulk_counts"], {"id": bulk_id})
        counts = {r["result"]: int(r["n"]) for r in await cur.fetchall()}
    for key in ("replayed", "already_processed", "not_pending", "failed", "pending"):
        counts.setdefault(key, 0)
    return BulkReplay(counts=counts, **row)


async def list_bulk_items(
    conn: AsyncConnection[Any],
    bulk_id: int,
    *,
    result: str | None = None,
    after: int = 0,
    limit: int = 100,
) -> list[BulkItem]:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(
            SQL["bulk_items"], {"id": bulk_id, "result": result, "after": after, "limit": limit}
        )
        return [BulkItem(**r) for r in await cur.fetchall()]


async def run_bulk_replay(
    pool: AsyncConnectionPool[Any],
    queue: QueuePort,
    bulk_id: int,
    *,
    actor: str,
    chunk_size: int = BULK_CHUNK,
    on_progress: Callable[[BulkReplay], None] | None = None,
) -> BulkReplay:
    """Process a run's remaining items, a chunk per transaction (resumable after a crash).

    Per item: a dead letter no longer pending is ``not_pending`` (left as it is); one whose
    fence row exists is ``already_processed``: moved to replayed without republishing, since the
    fence would skip the job anyway; any other is republished with the same job_id (D8) and
    ``replayed``. With the PostgreSQL queue the publishes and the transitions of a chunk commit
    together; with an external broker its outbox rows (:mod:`jobfence.outbox`) and the
    transitions do, and the outbox relay publishes them after the commit. A publish (or outbox
    insert) that fails rolls its chunk back: its dead letters stay ``pending_review`` and the
    run resumes from that chunk.

    Several runs at once over the same dead letters, and several processes on one run, each
    finish on their own: items whose rows another transaction holds are waited for, then
    counted as that transaction left them (``not_pending`` once another run replayed them).
    A run that stops without finishing (an error, a cancellation) is logged at ERROR with the
    command that resumes it.
    """
    try:
        run = await _run_chunks(
            pool, queue, bulk_id, actor=actor, chunk_size=chunk_size, on_progress=on_progress
        )
    except BaseException as exc:
        _log_unfinished(bulk_id, f"{type(exc).__name__}: {exc}".strip(" :"), exc)
        raise
    if run.status != "finished":
        _log_unfinished(bulk_id, f"{run.counts['pending']} items still pending", None)
    return run


def resume_hint(bulk_id: int) -> str:
    """How to resume bulk replay ``bulk_id``, from the CLI or the API."""
    return (
        f"jobfence dead-letters replay-bulk --resume {bulk_id}"
        f" (or POST /v1/core/dead-letters/replay-bulk/{bulk_id}/resume)"
    )


def _log_unfinished(bulk_id: int, why: str, exc: BaseException | None) -> None:
    log.error(
        "bulk replay %d stopped without finishing (%s); its finished chunks stand, resume it: %s",
        bulk_id,
        why,
        resume_hint(bulk_id),
        exc_info=exc if isinstance(exc, Exception) else None,
        extra={"bulk_replay_id": bulk_id},
    )


async def _take_chunk(
    conn: AsyncConnection[Any], bulk_id: int, chunk_size: int
) -> list[dict[str, Any]] | None:
    """The next items of the run, locked, in the transaction open on ``conn``; None when the
    run has none left. Items whose rows another transaction holds are waited for (a
    concurrent run over the same dead letters, or another process resuming this run): an
    empty list means they were resolved meanwhile, so look again."""
    params = {"id": bulk_id, "limit": chunk_size}
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(SQL["bulk_take_chunk"], params)
        rows = await cur.fetchall()
        if rows:
            return rows
        await cur.execute(SQL["bulk_unprocessed"], params)
        left = await cur.fetchone()
        if left is None or not next(iter(left.values())):
            return None
        await cur.execute(SQL["bulk_fail_orphans"], {"id": bulk_id})
        if cur.rowcount:
            return []  # look again: what is left may be none
        await cur.execute(SQL["lock_timeout"])
        found = await cur.fetchone()
        assert found is not None
        wait = {"value": f"{int(LOCK_WAIT_SECONDS * 1000)}ms"}
        try:
            async with conn.transaction():  # a savepoint: a lock timeout undoes only this
                await cur.execute(SQL["set_lock_timeout"], wait)
                await cur.execute(SQL["bulk_take_chunk_waiting"], params)
                rows = await cur.fetchall()
                await cur.execute(SQL["set_lock_timeout"], {"value": found["lock_timeout"]})
        except errors.LockNotAvailable:
            log.info(
                "bulk replay %d: its remaining dead letters are still locked by another"
                " transaction after %.0fs; waiting on",
                bulk_id,
                LOCK_WAIT_SECONDS,
                extra={"bulk_replay_id": bulk_id},
            )
            return []
        return rows


async def _run_chunks(
    pool: AsyncConnectionPool[Any],
    queue: QueuePort,
    bulk_id: int,
    *,
    actor: str,
    chunk_size: int,
    on_progress: Callable[[BulkReplay], None] | None,
) -> BulkReplay:
    while True:
        async with pool.connection() as conn, conn.transaction():
            # Taking locked items and waiting for them relies on READ COMMITTED (a row another
            # transaction changed is re-read after the wait), whatever the database's default.
            await conn.execute(SET_READ_COMMITTED)
            taken = await _take_chunk(conn, bulk_id, chunk_size)
            if taken is None:
                await conn.execute(SQL["bulk_finish"], {"id": bulk_id})
                break
            rows = taken
            if not rows:
                continue
            ids: list[int] = []
            results: list[str] = []
            details: list[str | None] = []
            to_mark: list[int] = []
            external: bool | None = None  # where jobs go, read once per chunk (publish_with)
            for row in rows:
                ids.append(row["dead_letter_id"])
                if row["status"] != "pending_review":
                    results.append("not_pending")
                    details.append(f"status is {row['status']}")
                    continue
                if row["fenced"]:
                    results.append("already_processed")
                    details.append("fence row exists: not republished")
                    to_mark.append(row["dead_letter_id"])
                    continue
                try:
                    message = replay_message(row)
                except DeadLetterNotReplayable as exc:
                    results.append("failed")
                    details.append(str(exc)[:500])
                    continue
                external = await publish_with(
                    conn, queue, message, actor=actor, failed=row["traceparent"], external=external
                )
                results.append("replayed")
                details.append(None)
                to_mark.append(row["dead_letter_id"])
            if to_mark:
                await conn.execute(
                    SQL["bulk_mark_replayed"], {"ids": to_mark, "resolved_by": actor}
                )
            await conn.execute(
                SQL["bulk_record_results"],
                {"bulk_id": bulk_id, "ids": ids, "results": results, "details": details},
            )
            await conn.execute(SQL["bulk_touch"], {"id": bulk_id})
        if on_progress is not None:
            async with pool.connection() as conn:
                on_progress(await get_bulk_replay(conn, bulk_id))
    async with pool.connection() as conn:
        return await get_bulk_replay(conn, bulk_id)
