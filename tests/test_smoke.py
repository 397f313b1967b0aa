from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import PgQueue, Worker
from support import scalar


async def test_a_job_applies_once(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    await app.enqueue(conn, "award_points", {"account_id": 1, "points": 5}, job_id="j1")
    await app.enqueue(conn, "award_points", {"account_id": 1, "points": 5}, job_id="j1")
    queue = PgQueue(pool)
    stats = await Worker(app, pool, queue, concurrency=2).run(until="idle")
    await queue.close()
    assert stats.outcomes == {"succeeded": 1, "duplicate": 1}
    assert await scalar(conn, "SELECT points FROM accounts WHERE id = 1") == 5
