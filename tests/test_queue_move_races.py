"""A move of the database to another queue (``jobfence migrate --queue-url``) racing the
processes that publish: nothing is published where no worker reads any more."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import PrometheusMetrics
from jobfence.adapters.pg_queue import PgQueue
from jobfence.dead_letters import replay_dead_letter
from jobfence.errors import ConfigError, QueueMoved
from jobfence.outbox import OutboxRelay, OutboxRelaySettings, queue_setting, record_queue
from jobfence.queue_record import move_queue
from jobfence.queues import open_broker, parse_queue_url
from support import scalar, wait_until
from test_acceptance_harness import dead_letter_ids, run_worker
from test_api_support import PREFIX, auth, running_api

AWARD = "award_points"


async def _waits_on_lock(watcher: AsyncConnection[Any], other: AsyncConnection[Any]) -> bool:
    return bool(
        await scalar(
            watcher,
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
            (other.info.backend_pid,),
        )
    )


async def _relay_standing_by(watcher: AsyncConnection[Any]) -> bool:
    """A relay's session is connected and polls the relay lock (which the move holds)."""
    return bool(
        await scalar(
            watcher,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND state = 'idle'"
            " AND query LIKE '%pg_try_advisory_lock%'",
        )
    )


async def test_a_relay_standing_by_during_a_move_never_publishes_to_the_broker_left_behind(
    points: AsyncConnection[Any], database_url: str, redis_url: str
) -> None:
    """A relay that starts while a move from one Redis prefix to another runs passes its
    start-up comparison (the record still names the old one) and stands by on the relay lock,
    which the move holds. Before, it took the lock when the move let go and published the rows
    written for the new broker to the old one, where no worker reads. Now it checks the record
    again once it holds the lock, and stops with one ERROR: the rows stay in the outbox."""
    base = redis_url.split("?", maxsplit=1)[0]
    old = parse_queue_url(f"{base}?prefix=jfmove-old-{uuid.uuid4().hex[:8]}")
    new = parse_queue_url(f"{base}?prefix=jfmove-new-{uuid.uuid4().hex[:8]}")
    await record_queue(points, old.kind, old.location)
    old_queue = await open_broker(old)  # the relay's queue, adopted before the move
    new_queue = await open_broker(new)
    relay = OutboxRelay(database_url, old_queue, settings=OutboxRelaySettings(poll_seconds=0.05))
    relay_task: asyncio.Task[Any] | None = None
    try:
        async with await psycopg.AsyncConnection.connect(database_url) as blocker:
            # Keeps the move inside its critical section, holding the relay lock:
            # jobfence.set_queue reads the settings row FOR UPDATE.
            await blocker.execute("SELECT 1 FROM jobfence.settings FOR UPDATE")
            async with await psycopg.AsyncConnection.connect(
                database_url, autocommit=True
            ) as mover:
                move = asyncio.create_task(move_queue(mover, new, new_address=True))
                await wait_until(
                    lambda: _waits_on_lock(points, mover), message="the move to hold the lock"
                )
                relay_task = asyncio.create_task(relay.run())
                await wait_until(
                    lambda: _relay_standing_by(points), message="the relay to stand by"
                )
                assert not relay.active
                await blocker.rollback()
                try:
                    assert await asyncio.wait_for(move, 20) is True
                finally:
                    move.cancel()
        assert (await queue_setting(points)).location == new.location
        app = pointsapp.build_app()
        await app.enqueue(points, AWARD, {"account_id": 1, "points": 1}, job_id="after-move")

        with pytest.raises(ConfigError) as stopped:
            await asyncio.wait_for(relay_task, 20)
        assert "the database was moved while it waited" in str(stopped.value)
        assert await old_queue.backlog([pointsapp.QUEUE]) == 0
        assert await scalar(points, "SELECT job_id FROM jobfence.outbox") == "after-move"
    finally:
        relay.stop()
        if relay_task is not None and not relay_task.done():
            relay_task.cancel()
            with contextlib.suppress(BaseException):
                await relay_task
        await old_queue.close()
        await new_queue.close()


async def _replay_waits_on_the_move(watcher: AsyncConnection[Any]) -> bool:
    return bool(
        await scalar(
            watcher,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()",
        )
    )


async def _one_dead_letter(pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]) -> int:
    app = pointsapp.build_app()
    await app.enqueue(points, AWARD, {"account_id": 1, "points": 1, "mode": "hard"}, job_id="dl")
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"dead_lettered": 1}
    [dl_id] = await dead_letter_ids(points, "dl")
    return int(dl_id)


async def _replay_during_move(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    database_url: str,
    queue: Any,
    dl_id: int,
    *,
    kind: str,
    location: str | None,
) -> asyncio.Task[Any]:
    """A replay of ``dl_id`` on ``queue`` started while a move to ``kind`` holds its lock; the
    move commits once the replay waits on it. The replay's task, to await."""
    async with await psycopg.AsyncConnection.connect(database_url) as mover:
        await record_queue(mover, kind, location)  # the move, not committed
        replay = asyncio.create_task(
            replay_dead_letter(pool, queue, dl_id, resolved_by="operator-b")
        )
        await wait_until(
            lambda: _replay_waits_on_the_move(points), message="the replay to wait for the move"
        )
        await mover.commit()
    return replay


async def test_a_replay_racing_the_move_to_a_broker_writes_the_new_queues_outbox(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], database_url: str
) -> None:
    """An operator replays a dead letter from a process whose queue is the PostgreSQL one
    while another moves the database to a broker. Before, the replay's publish waited for the
    move's lock and then inserted into jobfence_queue.messages all the same: the dead letter
    said ``replayed`` and its job sat in a table no worker reads. Now it reads the record once
    the move is over, as a producer does, and writes the outbox of the new queue."""
    dl_id = await _one_dead_letter(pool, points)
    queue = PgQueue(pool)  # the Ops process's queue, adopted while the database was on PostgreSQL
    try:
        replay = await _replay_during_move(
            pool, points, database_url, queue, dl_id, kind="rabbitmq", location="amqp://broker/"
        )
        result = await asyncio.wait_for(replay, 10)
    finally:
        await queue.close()
    assert result.published
    assert (await queue_setting(points)).kind == "rabbitmq"
    status = await scalar(points, "SELECT status FROM core.dead_letters WHERE id = %s", (dl_id,))
    assert status == "replayed"
    assert await scalar(points, "SELECT count(*) FROM jobfence_queue.messages") == 0
    assert await scalar(points, "SELECT job_id FROM jobfence.outbox") == "dl"


async def test_a_replay_racing_a_move_back_to_postgresql_is_refused_and_nothing_is_stranded(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], database_url: str, redis_url: str
) -> None:
    """An operator replays a dead letter from a process on a broker while another moves the
    database back to the PostgreSQL queue (the outbox is empty, so the move goes ahead). Before,
    the replay's outbox row waited for the move's lock and was then written all the same: the
    dead letter said ``replayed`` and its job sat in an outbox no relay publishes any more. Now
    the replay reads the record once the move is over and is refused, naming the queue the
    database moved to; the dead letter stays pending, to replay from the PostgreSQL queue."""
    dl_id = await _one_dead_letter(pool, points)
    target = parse_queue_url(
        f"{redis_url.split('?', maxsplit=1)[0]}?prefix=jfback-{uuid.uuid4().hex[:8]}"
    )
    await record_queue(points, target.kind, target.location)
    queue = await open_broker(target)  # the Ops process's queue, adopted before the move
    try:
        replay = await _replay_during_move(
            pool, points, database_url, queue, dl_id, kind="postgresql", location=None
        )
        with pytest.raises(QueueMoved) as refused:
            await asyncio.wait_for(replay, 10)
    finally:
        await queue.close()
    assert "now go to the postgresql queue" in str(refused.value), str(refused.value)
    assert (await queue_setting(points)).kind == "postgresql"
    status = await scalar(points, "SELECT status FROM core.dead_letters WHERE id = %s", (dl_id,))
    assert status == "pending_review"
    assert await scalar(points, "SELECT count(*) FROM jobfence.outbox") == 0
    # Replayed from the PostgreSQL queue, it runs.
    pg_queue = PgQueue(pool)
    try:
        assert (await replay_dead_letter(pool, pg_queue, dl_id, resolved_by="operator-b")).published
    finally:
        await pg_queue.close()
    assert await scalar(points, "SELECT count(*) FROM jobfence_queue.messages") == 1


async def test_the_api_refuses_a_replay_once_the_database_moved_back_to_postgresql(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], redis_url: str
) -> None:
    """The Ops API started on a broker; the database then moved back to the PostgreSQL queue.
    A replay through it is a 409 naming the move, and nothing is written: the dead letter
    stays pending and the outbox empty (a bulk replay's run stops at its first chunk the same
    way, and resumes from a process on the PostgreSQL queue)."""
    dl_id = await _one_dead_letter(pool, points)
    base = redis_url.split("?", maxsplit=1)[0]
    target = parse_queue_url(f"{base}?prefix=jfapi-{uuid.uuid4().hex[:8]}")
    await record_queue(points, target.kind, target.location)
    queue = await open_broker(target)
    try:
        async with running_api(pool, queue=queue) as api:
            await record_queue(points, "postgresql", None)  # the move back, committed
            answer = await api.client.post(f"{PREFIX}/{dl_id}/replay", headers=auth())
    finally:
        await queue.close()
    assert answer.status_code == 409, answer.text
    body = answer.json()
    assert body["type"] == "urn:jobfence:problem:queue-moved"
    assert "now go to the postgresql queue" in body["detail"]
    status = await scalar(points, "SELECT status FROM core.dead_letters WHERE id = %s", (dl_id,))
    assert status == "pending_review"
    assert await scalar(points, "SELECT count(*) FROM jobfence.outbox") == 0
