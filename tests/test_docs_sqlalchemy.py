"""docs/sqlalchemy.md's complete example runs as written: the order and its job commit together
through the session, the ORM handler applies the award once, a bad account is dead-lettered."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool
from sqlalchemy.orm import Session

from jobfence import PgQueue, Worker
from support import scalar
from test_producers import _engine

DOC = Path(__file__).resolve().parent.parent / "docs" / "sqlalchemy.md"
TABLES = """
CREATE TABLE accounts (id integer PRIMARY KEY, points integer NOT NULL DEFAULT 0);
CREATE TABLE orders (id integer PRIMARY KEY, account_id integer NOT NULL);
INSERT INTO accounts (id) VALUES (7);
"""


def doc_example() -> types.ModuleType:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"<!-- example: sqlalchemy-app -->\n```python\n(.*?)```", text, re.DOTALL)
    assert match, "docs/sqlalchemy.md has no example sqlalchemy-app"
    module = types.ModuleType("sqlalchemy_example")
    # dont_inherit: the example runs without this file's `from __future__ import annotations`
    exec(compile(match.group(1), str(DOC), "exec", dont_inherit=True), module.__dict__)
    return module


async def test_the_sqlalchemy_example_commits_the_job_with_the_order_and_applies_it_once(
    database_url: str, pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(TABLES)
    example = doc_example()
    engine = _engine(database_url, "psycopg")
    try:
        with Session(engine) as session, session.begin():
            example.place_order(session, 1, account_id=7)
        with Session(engine) as session:  # rolled back: neither the order nor its job
            example.place_order(session, 2, account_id=7)
        with Session(engine) as session, session.begin():
            example.place_order(session, 3, account_id=999)  # no such account
    finally:
        engine.dispose()
    cur = await conn.execute("SELECT job_id FROM jobfence_queue.messages ORDER BY id")
    assert [r[0] for r in await cur.fetchall()] == ["order-1:points", "order-3:points"]

    queue = PgQueue(pool)
    try:
        stats = await Worker(example.app, pool, queue).run(until="idle")
    finally:
        await queue.close()
    assert stats.outcomes == {"succeeded": 1, "dead_lettered": 1}
    assert await scalar(conn, "SELECT points FROM accounts WHERE id = 7") == 10
    cur = await conn.execute("SELECT job_id, attempts, error_class FROM core.dead_letters")
    assert await cur.fetchall() == [("order-3:points", 1, "jobfence.HardFailure")]
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 1
