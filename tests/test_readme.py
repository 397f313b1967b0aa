"""The README's example runs as written: enqueue inside a transaction, one effect, a hard failure
dead-lettered at once."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from jobfence import App, PgQueue, Worker
from support import scalar

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> types.ModuleType:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    assert blocks, "README.md has no python example"
    module = types.ModuleType("readme_example")
    exec(compile(blocks[0], str(README), "exec"), module.__dict__)
    return module


async def test_the_readme_example_applies_an_award_once_and_dead_letters_a_hard_failure(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    example = readme_example()
    app: App = example.app
    await conn.execute(
        "CREATE TABLE accounts (id integer PRIMARY KEY, points integer NOT NULL DEFAULT 0);"
        "CREATE TABLE orders (id integer PRIMARY KEY, account_id integer NOT NULL);"
        "INSERT INTO accounts (id) VALUES (7);"
    )
    await example.place_order(conn, 1, 7)
    await app.enqueue(  # the same order's job again, as a redelivery would bring it
        conn, "award_points", {"account_id": 7, "points": 10}, job_id="order-1:points"
    )
    await example.place_order(conn, 2, 999)  # no such account: a hard failure

    queue = PgQueue(pool)
    stats = await Worker(app, pool, queue).run(until="idle")
    await queue.close()

    assert stats.outcomes == {"succeeded": 1, "duplicate": 1, "dead_lettered": 1}
    assert await scalar(conn, "SELECT points FROM accounts WHERE id = 7") == 10
    row = await (
        await conn.execute("SELECT job_id, attempts, correlation_id FROM core.dead_letters")
    ).fetchall()
    assert row == [("order-2:points", 1, "order-2")]
