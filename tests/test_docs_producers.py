"""Every example of docs/producers.md, and the README's sync variant, runs as written: the job
exists exactly when the example's transaction commits, and the README's worker applies it once.

An example is the fenced block after a ``<!-- example: NAME -->`` line."""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy
from psycopg_pool import AsyncConnectionPool

from jobfence import PgQueue, Worker
from support import scalar
from test_enqueue_sql import run_psql
from test_producers import _engine, _url

ROOT = Path(__file__).resolve().parent.parent
PRODUCERS = ROOT / "docs" / "producers.md"
README = ROOT / "README.md"
TABLES = """
CREATE TABLE accounts (id integer PRIMARY KEY, points integer NOT NULL DEFAULT 0);
CREATE TABLE orders (id integer PRIMARY KEY, account_id integer NOT NULL);
INSERT INTO accounts (id) VALUES (7);
"""


def example(name: str) -> str:
    text = PRODUCERS.read_text(encoding="utf-8")
    match = re.search(rf"<!-- example: {re.escape(name)} -->\n```\w+\n(.*?)```", text, re.DOTALL)
    assert match, f"docs/producers.md has no example {name!r}"
    return match.group(1)


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)


def run_module(*sources: tuple[str, Path]) -> types.ModuleType:
    """Execute code blocks, in order, in one fresh module."""
    module = types.ModuleType("docs_example")
    for source, origin in sources:
        exec(compile(source, str(origin), "exec"), module.__dict__)
    return module


def readme_app_module(*more: str) -> types.ModuleType:
    """The README's example (its App and AwardPoints), then ``more`` blocks of producers.md."""
    return run_module((readme_python_blocks()[0], README), *((m, PRODUCERS) for m in more))


@pytest.fixture
def sync_conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(database_url)
    conn.execute(TABLES)  # type: ignore[arg-type]
    conn.commit()
    yield conn
    conn.close()


async def work(pool: AsyncConnectionPool[Any], module: types.ModuleType) -> dict[str, int]:
    """Run the README's worker until idle; its outcomes."""
    queue = PgQueue(pool)
    try:
        stats = await Worker(module.app, pool, queue).run(until="idle")
    finally:
        await queue.close()
    return dict(stats.outcomes)


async def points(pool: AsyncConnectionPool[Any]) -> int:
    async with pool.connection() as conn:
        return int(await scalar(conn, "SELECT points FROM accounts WHERE id = 7"))


def job_ids(conn: psycopg.Connection[Any]) -> list[str]:
    conn.rollback()  # a fresh snapshot
    return [r[0] for r in conn.execute("SELECT job_id FROM jobfence_queue.messages ORDER BY id")]


async def test_the_readme_sync_variant_enqueues_in_its_transaction_and_applies_once(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any]
) -> None:
    blocks = readme_python_blocks()
    assert "enqueue_sync" in blocks[1]
    module = run_module((blocks[0], README), (blocks[1], README))
    module.place_order_sync(sync_conn, 1, 7)
    module.place_order_sync(sync_conn, 2, 999)  # no such account: a hard failure
    assert job_ids(sync_conn) == ["order-1:points", "order-2:points"]
    assert await work(pool, module) == {"succeeded": 1, "dead_lettered": 1}
    assert await points(pool) == 10


async def test_the_sync_psycopg_example_enqueues_in_its_transaction_and_applies_once(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any]
) -> None:
    module = readme_app_module(example("sync-psycopg"))
    module.place_order_sync(sync_conn, 1, 7)
    with pytest.raises(psycopg.errors.UniqueViolation):  # the order fails: no job either
        module.place_order_sync(sync_conn, 1, 7)
    assert job_ids(sync_conn) == ["order-1:points"]
    assert await work(pool, module) == {"succeeded": 1}
    assert await points(pool) == 10


async def test_the_by_name_example_enqueues_without_the_consumers_code(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any], database_url: str
) -> None:
    by_name = run_module((example("by-name"), PRODUCERS))
    assert "app" not in vars(by_name)  # nothing of the consumer
    by_name.place_order_by_name(sync_conn, 1, 7)
    async with await psycopg.AsyncConnection.connect(database_url) as aconn:
        await by_name.place_order_by_name_async(aconn, 2)
    assert job_ids(sync_conn) == ["order-1:points", "order-2:points"]
    assert await work(pool, readme_app_module()) == {"succeeded": 2}
    assert await points(pool) == 20


async def test_the_psycopg2_example_enqueues_in_its_transaction_and_applies_once(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any], database_url: str
) -> None:
    module = run_module((example("psycopg2"), PRODUCERS))
    module.place_order_psycopg2(database_url, 1, 7)
    with pytest.raises(Exception, match="duplicate key"):  # rolled back: no second job
        module.place_order_psycopg2(database_url, 1, 7)
    assert job_ids(sync_conn) == ["order-1:points"]
    assert await work(pool, readme_app_module()) == {"succeeded": 1}
    assert await points(pool) == 10


async def test_the_sqlalchemy_example_enqueues_in_its_session_and_applies_once(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any], database_url: str
) -> None:
    module = run_module((example("sqlalchemy"), PRODUCERS))
    engine = _engine(database_url, "psycopg")
    try:
        module.place_order_sqlalchemy(engine, 1, 7)
        with pytest.raises(sqlalchemy.exc.IntegrityError):  # rolled back: no second job
            module.place_order_sqlalchemy(engine, 1, 7)
    finally:
        engine.dispose()
    assert job_ids(sync_conn) == ["order-1:points"]
    assert await work(pool, readme_app_module()) == {"succeeded": 1}
    assert await points(pool) == 10


async def test_the_sqlalchemy_asyncio_example_enqueues_in_its_session_and_applies_once(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any], database_url: str
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    module = run_module((example("sqlalchemy-asyncio"), PRODUCERS))
    engine = create_async_engine(_url(database_url, "psycopg"))
    try:
        await module.place_order_sqlalchemy_async(engine, 1, 7)
        with pytest.raises(sqlalchemy.exc.IntegrityError):  # rolled back: no second job
            await module.place_order_sqlalchemy_async(engine, 1, 7)
    finally:
        await engine.dispose()
    assert job_ids(sync_conn) == ["order-1:points"]
    assert await work(pool, readme_app_module()) == {"succeeded": 1}
    assert await points(pool) == 10


async def test_the_psql_example_enqueues_in_its_transaction_and_applies_once(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any], database_url: str
) -> None:
    script = example("psql")
    done = run_psql(database_url, script)
    assert done.returncode == 0, done.stderr
    again = run_psql(database_url, script)  # the order exists: its transaction fails whole
    assert again.returncode != 0 and "duplicate key" in again.stderr
    assert job_ids(sync_conn) == ["order-41:points"]
    assert await work(pool, readme_app_module()) == {"succeeded": 1}
    assert await points(pool) == 10


async def test_the_trigger_example_enqueues_with_each_inserted_order(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any]
) -> None:
    sync_conn.execute(example("trigger"))  # type: ignore[arg-type]
    sync_conn.commit()
    sync_conn.execute("INSERT INTO orders (id, account_id) VALUES (1, 7), (2, 7)")
    sync_conn.commit()
    sync_conn.execute("INSERT INTO orders (id, account_id) VALUES (3, 7)")
    sync_conn.rollback()
    assert job_ids(sync_conn) == ["order-1:points", "order-2:points"]
    sync_conn.rollback()
    cur = sync_conn.execute("SELECT correlation_id FROM jobfence_queue.messages ORDER BY id")
    assert cur.fetchall() == [("order-1",), ("order-2",)]
    assert await work(pool, readme_app_module()) == {"succeeded": 2}
    assert await points(pool) == 20
