"""Batched acknowledgements after commit (``jobfence.acks``), on the real PostgreSQL queue."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from jobfence import Message, PgQueue
from jobfence.acks import AckBatcher
from jobfence.model import Delivery
from support import scalar, wait_until

QUEUE = "acks.test"


async def queued(conn: AsyncConnection[Any]) -> int:
    return int(await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages"))


async def take(queue: PgQueue, conn: AsyncConnection[Any], n: int) -> list[Delivery]:
    for i in range(n):
        await queue.publish(Message(queue=QUEUE, consumer="c", job_id=f"j{i}", body=b"{}"))
    got = await queue.receive([QUEUE], max_messages=n, lease_seconds=300)
    assert len(got) == n
    return got


@pytest.fixture
async def queue(pool: AsyncConnectionPool[Any]) -> Any:
    q = PgQueue(pool)
    yield q
    await q.close()


async def test_acks_wait_for_a_full_batch_then_go_in_one_statement(
    queue: PgQueue, conn: AsyncConnection[Any]
) -> None:
    got = await take(queue, conn, 5)
    acks = AckBatcher(queue, max_batch=3, max_delay=3600.0)
    acks.add(got[0])
    acks.add(got[1])
    for _ in range(20):  # give a wrongly eager batcher the chance to take them: it must not
        await asyncio.sleep(0)
    assert acks.pending == 2
    assert await queued(conn) == 5
    acks.add(got[2])  # the batch is full: sent now, not in an hour

    async def three_gone() -> bool:
        return await queued(conn) == 2

    await wait_until(three_gone, timeout=5, message="the full batch to be acked")
    assert acks.pending == 0
    acks.add(got[3])
    await acks.close()  # sends what is left
    assert await queued(conn) == 1


async def test_acks_go_after_max_delay_when_the_batch_does_not_fill(
    queue: PgQueue, conn: AsyncConnection[Any]
) -> None:
    got = await take(queue, conn, 2)
    acks = AckBatcher(queue, max_batch=100, max_delay=0.1)
    for delivery in got:
        acks.add(delivery)

    async def all_gone() -> bool:
        return await queued(conn) == 0

    await wait_until(all_gone, timeout=5, message="the delayed acks")
    await acks.close()


async def test_acks_that_fail_are_kept_and_sent_once_the_queue_answers_again(
    queue: PgQueue, conn: AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    got = await take(queue, conn, 3)
    acks = AckBatcher(queue, max_batch=100, max_delay=3600.0)
    for delivery in got:
        acks.add(delivery)
    await conn.execute("ALTER TABLE jobfence_queue.messages RENAME TO messages_away")
    try:
        assert await acks.flush() is False
        assert acks.pending == 3, "nothing is dropped when the ack fails"
        assert "cannot acknowledge 3 finished job(s) yet (UndefinedTable" in caplog.text
    finally:
        await conn.execute("ALTER TABLE jobfence_queue.messages_away RENAME TO messages")
    assert await acks.flush() is True
    assert acks.pending == 0
    assert await queued(conn) == 0
    await acks.close()


async def test_a_run_of_failed_acks_logs_one_warning_and_one_line_when_they_go_through(
    queue: PgQueue, conn: AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    got = await take(queue, conn, 2)
    acks = AckBatcher(queue, max_batch=100, max_delay=3600.0)
    for delivery in got:
        acks.add(delivery)
    caplog.set_level(logging.INFO, logger="jobfence.acks")
    await conn.execute("ALTER TABLE jobfence_queue.messages RENAME TO messages_away")
    try:
        for _ in range(5):  # an outage: every retry fails
            assert await acks.flush() is False
    finally:
        await conn.execute("ALTER TABLE jobfence_queue.messages_away RENAME TO messages")
    assert await acks.flush() is True
    await acks.close()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert [level for level, _ in lines] == ["WARNING", "INFO"], lines
    assert lines[0][1].startswith("cannot acknowledge 2 finished job(s) yet (UndefinedTable")
    assert lines[1][1] == "acknowledging again after 5 failed tries (2 job(s) now)"
    assert await queued(conn) == 0


@pytest.mark.parametrize(("batch", "delay"), [(0, 1.0), (1, 0.0), (1, -1.0)])
def test_bad_batch_settings_are_refused(batch: int, delay: float) -> None:
    with pytest.raises(ValueError, match="max_"):
        AckBatcher(object(), max_batch=batch, max_delay=delay)  # type: ignore[arg-type]
