"""Replay with a queue outside the database: the dead letter's status change and its outbox
row commit together (single and bulk), so a dead letter is never ``replayed`` with nothing on
its way to the queue."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from jobfence import MemoryQueue, ops
from jobfence.ops import BulkReplay, DeadLetterFilter
from jobfence.outbox import OutboxRelay
from support import scalar
from test_ops_service import seed_pending

# The database refuses the outbox insert of one job: a real failure inside the transaction.
REFUSE_OUTBOX = """
CREATE FUNCTION refuse_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'outbox refuses %', NEW.job_id; END $$;
CREATE TRIGGER refuse_outbox BEFORE INSERT ON jobfence.outbox
FOR EACH ROW WHEN (NEW.job_id = 'b-3') EXECUTE FUNCTION refuse_outbox();
"""


async def _state(conn: psycopg.AsyncConnection[Any]) -> dict[str, tuple[str, int]]:
    """job_id -> (dead letter status, outbox rows for it)."""
    cur = await conn.execute(
        """SELECT d.job_id, d.status,
                  (SELECT count(*) FROM jobfence.outbox o WHERE o.job_id = d.job_id)
           FROM core.dead_letters d ORDER BY d.id"""
    )
    return {job_id: (status, int(n)) for job_id, status, n in await cur.fetchall()}


async def test_a_replay_writes_its_status_and_its_outbox_row_in_one_transaction(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    (first,) = await seed_pending(conn, 1)
    broker = MemoryQueue()
    result = await ops.replay(pool, broker, first, actor="alice")
    assert result.published
    assert await _state(conn) == {"b-0": ("replayed", 1)}
    assert (await broker.size(["loyalty"])).total == 0  # not published before the commit
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0

    relay = OutboxRelay(database_url, broker)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
        await relay.run_round(c)
    (delivery,) = await broker.receive(["loyalty"], max_messages=5, lease_seconds=60)
    sent = delivery.message
    assert (sent.job_id, sent.consumer, sent.correlation_id, sent.tenant_id) == (
        "b-0",
        "award_points",
        "corr-b-0",
        "tenant-a",
    )
    assert json.loads(sent.body) == {"account_id": 1, "points": 10}
    assert await _state(conn) == {"b-0": ("replayed", 0)}


async def test_a_replay_whose_outbox_insert_fails_stays_pending_review(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    ids = await seed_pending(conn, 4)
    await conn.execute(REFUSE_OUTBOX)
    with pytest.raises(psycopg.errors.RaiseException, match="outbox refuses b-3"):
        await ops.replay(pool, MemoryQueue(), ids[3], actor="alice")
    assert (await _state(conn))["b-3"] == ("pending_review", 0)
    # The pool's connection is usable again: the next replay goes through.
    await ops.replay(pool, MemoryQueue(), ids[0], actor="alice")
    assert (await _state(conn))["b-0"] == ("replayed", 1)


async def test_a_bulk_replay_commits_each_chunk_with_its_outbox_rows_or_not_at_all(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await seed_pending(conn, 5)
    await conn.execute(REFUSE_OUTBOX)
    run = await ops.start_bulk_replay(
        pool, DeadLetterFilter(), requested_by="ops-test", select_all=True
    )
    assert isinstance(run, BulkReplay)
    broker = MemoryQueue()
    with pytest.raises(psycopg.errors.RaiseException, match="outbox refuses b-3"):
        await ops.run_bulk_replay(pool, broker, run.id, actor="alice", chunk_size=2)
    # Chunk 1 (b-0, b-1) committed with its outbox rows; chunk 2 (b-2, b-3) rolled back whole.
    assert await _state(conn) == {
        "b-0": ("replayed", 1),
        "b-1": ("replayed", 1),
        "b-2": ("pending_review", 0),
        "b-3": ("pending_review", 0),
        "b-4": ("pending_review", 0),
    }
    await conn.execute("DROP TRIGGER refuse_outbox ON jobfence.outbox")
    final = await ops.run_bulk_replay(pool, broker, run.id, actor="alice", chunk_size=2)
    assert (final.status, final.counts["replayed"], final.counts["failed"]) == ("finished", 5, 0)
    assert set((await _state(conn)).values()) == {("replayed", 1)}
    assert (await broker.size(["loyalty"])).total == 0  # the relay publishes, not the replay
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
