"""Producers outside the async typed path: a wrong connection refused before any SQL, sync
psycopg, enqueue by name (validated by the consumer, as poison), psycopg2 and SQLAlchemy.

Every producer runs the one named query ``produce`` on the caller's connection, never
committing it: the job exists exactly when the caller's transaction commits. Every test that
enqueues runs twice: as the database's superuser, and as a login role that holds only the
producer role of ``jobfence roles --print-sql`` (and its own tables' grants).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import psycopg2
import psycopg2.extensions
import pytest
import sqlalchemy
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import pointsapp
from jobfence import App, ConfigError, JobRefused, PgQueue, Producer, Worker, WorkerStats
from roles_support import deployed_roles
from support import scalar

ROUTES = {"award_points": pointsapp.QUEUE}
MESSAGE_COLUMNS = (
    "queue, consumer, job_id, body, tenant_id, correlation_id, attempts, lease_token,"
    " last_error, run_at - created_at"
)


async def run_worker(pool: AsyncConnectionPool[Any], app: App | None = None) -> WorkerStats:
    queue = PgQueue(pool)
    try:
        return await Worker(app or pointsapp.build_app(), pool, queue).run(until="idle")
    finally:
        await queue.close()


@pytest.fixture(params=["superuser", "producer-role"])
def producer_url(request: pytest.FixtureRequest, database_url: str) -> Iterator[str]:
    """Where the producers under test connect: the superuser, or a login role holding only the
    producer role (and the grants on the points app's own tables its transactions write)."""
    with psycopg.connect(database_url, autocommit=True) as setup:
        setup.execute(pointsapp.SCHEMA_SQL)  # type: ignore[arg-type]
    if request.param == "superuser":
        yield database_url
        return
    with deployed_roles(database_url) as urls:
        login = psycopg.conninfo.conninfo_to_dict(urls["producer"])["user"]
        with psycopg.connect(database_url, autocommit=True) as setup:
            setup.execute(
                f'GRANT SELECT, INSERT, UPDATE ON public.accounts, public.awards TO "{login}"'  # type: ignore[arg-type]
            )
        yield urls["producer"]


@pytest.fixture
def sync_conn(producer_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A sync psycopg connection, not in autocommit: its transactions are the caller's."""
    conn = psycopg.connect(producer_url)
    yield conn
    conn.close()


@pytest.fixture
async def producer_conn(producer_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """An async connection as the producer, in autocommit (like ``conn``)."""
    c = await psycopg.AsyncConnection.connect(producer_url, autocommit=True)
    yield c
    await c.close()


def messages(database_url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(f"SELECT {MESSAGE_COLUMNS} FROM jobfence_queue.messages ORDER BY id")  # type: ignore[arg-type]
        return [(*r[:3], bytes(r[3]), *r[4:]) for r in rows.fetchall()]


# 1. A connection of the wrong kind is refused before any statement runs.


def test_async_enqueue_on_a_sync_connection_is_refused_before_any_sql(
    sync_conn: psycopg.Connection[Any], database_url: str
) -> None:
    app = pointsapp.build_app()
    sync_conn.execute("INSERT INTO public.awards VALUES ('mine', 1, 1)")  # the caller's work
    with pytest.raises(TypeError) as refused:  # as sync code would call it
        asyncio.run(
            app.enqueue(
                sync_conn,  # type: ignore[arg-type]
                "award_points",
                {"account_id": 1, "points": 5},
                job_id="wrong-1",
            )
        )
    assert str(refused.value) == (
        "enqueue needs a psycopg.AsyncConnection (or a SQLAlchemy AsyncSession or"
        " AsyncConnection), got psycopg.Connection; for a sync connection (psycopg.Connection,"
        " psycopg2, SQLAlchemy Session or Connection) use app.enqueue_sync(conn, ...) or"
        " jobfence.Producer(...).enqueue_sync(conn, ...)"
    )
    with pytest.raises(TypeError, match=r"got psycopg\.Connection;"):
        asyncio.run(
            Producer(routes=ROUTES).enqueue(
                sync_conn,  # type: ignore[arg-type]
                "award_points",
                {"account_id": 1, "points": 5},
                job_id="wrong-2",
            )
        )
    # No statement ran in the caller's transaction, which is intact and usable: no job in it,
    # and its own work commits.
    assert sync_conn.info.transaction_status == TransactionStatus.INTRANS
    sync_conn.commit()
    assert messages(database_url) == []
    with psycopg.connect(database_url) as check:
        assert check.execute("SELECT job_id FROM public.awards").fetchall() == [("mine",)]


async def test_sync_enqueue_on_an_async_connection_or_anything_else_is_refused(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    app = pointsapp.build_app()
    with pytest.raises(TypeError) as refused:
        app.enqueue_sync(conn, "award_points", {"account_id": 1, "points": 5}, job_id="a")
    assert str(refused.value) == (
        "enqueue_sync needs a sync connection, got psycopg.AsyncConnection:"
        " use `await app.enqueue(conn, ...)` or `await producer.enqueue(conn, ...)`"
    )
    with pytest.raises(TypeError) as refused:
        Producer(routes=ROUTES).enqueue_sync(
            "postgresql://db/app", "award_points", {"account_id": 1}, job_id="a"
        )
    assert str(refused.value) == (
        "enqueue_sync needs a psycopg.Connection, a psycopg2 connection, or a SQLAlchemy"
        " Session or Connection, got builtins.str"
    )
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0


# 2. Sync psycopg: the job exists exactly when the caller's transaction commits.


async def test_sync_psycopg_enqueue_commits_with_the_callers_transaction_and_runs_once(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any], database_url: str
) -> None:
    app = pointsapp.build_app()
    sync_conn.execute("UPDATE public.accounts SET points = 100 WHERE id = 3")
    app.enqueue_sync(sync_conn, "award_points", {"account_id": 3, "points": 7}, job_id="s-1")
    assert messages(database_url) == []  # not committed: invisible to anyone else
    sync_conn.commit()

    stats = await run_worker(pool, app)
    assert stats.outcomes == {"succeeded": 1}
    async with pool.connection() as check:
        assert await scalar(check, "SELECT points FROM public.accounts WHERE id = 3") == 107
        assert await scalar(check, "SELECT count(*) FROM public.awards") == 1


async def test_sync_psycopg_enqueue_rolled_back_leaves_no_job(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any], database_url: str
) -> None:
    app = pointsapp.build_app()
    app.enqueue_sync(sync_conn, "award_points", {"account_id": 3, "points": 7}, job_id="s-2")
    sync_conn.rollback()
    assert messages(database_url) == []
    assert (await run_worker(pool, app)).outcomes == {}


def test_sync_and_async_typed_enqueue_write_the_same_row(
    sync_conn: psycopg.Connection[Any], producer_url: str, database_url: str
) -> None:
    app = pointsapp.build_app()

    async def enqueue_async() -> None:
        async with await psycopg.AsyncConnection.connect(producer_url) as aconn:
            await app.enqueue(
                aconn, "award_points", {"account_id": 2, "points": 9}, job_id="same",
                tenant_id="t", correlation_id="c", delay_seconds=30,
            )  # fmt: skip

    asyncio.run(enqueue_async())
    app.enqueue_sync(
        sync_conn, "award_points", {"account_id": 2, "points": 9}, job_id="same",
        tenant_id="t", correlation_id="c", delay_seconds=30,
    )  # fmt: skip
    sync_conn.commit()
    first, second = messages(database_url)
    assert first == second
    assert first[3] == b'{"account_id":2,"points":9,"mode":"ok"}'


# 3. Enqueue by name: no import of the consumer's code; validation on the consumer side.


class AwardRequest(BaseModel):
    """The producer's own model: it need not be the consumer's schema."""

    account_id: int
    points: int


async def test_by_name_payloads_are_validated_by_the_consumer_as_poison(
    sync_conn: psycopg.Connection[Any],
    producer_conn: psycopg.AsyncConnection[Any],
    conn: psycopg.AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
) -> None:
    producer = Producer(routes=ROUTES)
    producer.enqueue_sync(sync_conn, "award_points", {"account_id": 4, "points": 6}, job_id="ok")
    producer.enqueue_sync(  # account_id must be >= 1: the consumer's schema rejects it
        sync_conn, "award_points", AwardRequest(account_id=0, points=6), job_id="bad"
    )
    sync_conn.commit()
    await producer.enqueue(
        producer_conn, "award_points", AwardRequest(account_id=4, points=1), job_id="a"
    )

    stats = await run_worker(pool)  # the real App, with the real schema
    assert stats.outcomes == {"succeeded": 2, "poison": 1}
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 4") == 7
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == 2
    cur = await conn.execute(
        "SELECT job_id, attempts, error_class, status, payload::text FROM core.dead_letters"
    )
    assert await cur.fetchall() == [
        ("bad", 1, "SchemaInvalid", "pending_review", '{"points": 6, "account_id": 0}')
    ]


async def test_by_name_enqueue_exists_exactly_when_the_transaction_commits(
    sync_conn: psycopg.Connection[Any],
    producer_conn: psycopg.AsyncConnection[Any],
    database_url: str,
) -> None:
    producer = Producer(routes=ROUTES)
    conn = producer_conn
    producer.enqueue_sync(sync_conn, "award_points", {"account_id": 4}, job_id="sync-rolled-back")
    sync_conn.rollback()
    async with conn.transaction(force_rollback=True):
        await producer.enqueue(conn, "award_points", {"account_id": 4}, job_id="rolled-back")
    async with conn.transaction():
        await producer.enqueue(conn, "award_points", {"account_id": 4}, job_id="committed")
    assert [m[2] for m in messages(database_url)] == ["committed"]


def test_a_producer_refuses_an_unknown_consumer_and_bad_routes() -> None:
    producer = Producer(routes=ROUTES)
    with pytest.raises(ConfigError) as refused:
        producer.message("award_point", {}, job_id="x")
    assert str(refused.value) == (
        "this Producer has no route for consumer 'award_point' (it knows: award_points);"
        " add it to Producer(routes={...})"
    )
    with pytest.raises(ConfigError) as refused:
        Producer(routes={"award points": "loyalty"})
    assert str(refused.value) == (
        "Producer routes: consumer name 'award points' must be 1-200 characters of letters,"
        " digits and _ . : -"
    )
    with pytest.raises(ConfigError, match="queue name ''"):
        Producer(routes={"award_points": ""})
    with pytest.raises(ValueError, match="job_id must be a non-empty string"):
        producer.message("award_points", {}, job_id="")
    with pytest.raises(TypeError, match="payload must be a mapping or a pydantic model, got list"):
        producer.message("award_points", [1], job_id="x")  # type: ignore[arg-type]


def test_a_by_name_enqueue_refuses_what_the_typed_one_refuses_before_any_sql(
    sync_conn: psycopg.Connection[Any], database_url: str
) -> None:
    """The identifier limits and the unstorable-payload rule hold for by-name producers too:
    refused with JobRefused naming the field, the caller's transaction untouched."""
    producer = Producer(routes=ROUTES)
    cases = [
        ({"job_id": "LONG-" + "ab" * 4000}, {}, "job_id", "over the limit of 1,024"),
        ({"job_id": "j", "correlation_id": "c" * 8000}, {}, "correlation_id", "1,024"),
        ({"job_id": "j", "tenant_id": "t\x00"}, {}, "tenant_id", "NUL"),
        ({"job_id": "j"}, {"note": "a\x00b"}, "payload", "cannot hold"),
        ({"job_id": "j"}, {"note": "\ud800"}, "payload", "lone surrogate"),
    ]
    with sync_conn.transaction():
        for ids, payload, field, words in cases:
            with pytest.raises(JobRefused, match=words) as refused:
                producer.enqueue_sync(sync_conn, "award_points", payload, **ids)
            assert refused.value.field == field
        assert sync_conn.info.transaction_status == TransactionStatus.INTRANS
        producer.enqueue_sync(
            sync_conn, "award_points", {"account_id": 1, "points": 1}, job_id="ok"
        )
    assert [row[2] for row in messages(database_url)] == ["ok"]


# 5. psycopg2: the same named query, the same row (bytea adapted by psycopg2).


@pytest.fixture
def pg2_conn(sync_conn: psycopg.Connection[Any], producer_url: str) -> Iterator[Any]:
    conn = psycopg2.connect(producer_url)
    yield conn
    conn.close()


async def test_psycopg2_enqueue_commits_with_the_callers_transaction_and_runs_once(
    pg2_conn: Any, pool: AsyncConnectionPool[Any], database_url: str
) -> None:
    app = pointsapp.build_app()
    with pg2_conn.cursor() as cur:
        cur.execute("UPDATE public.accounts SET points = 50 WHERE id = 5")
    Producer(routes=ROUTES).enqueue_sync(
        pg2_conn, "award_points", {"account_id": 5, "points": 2}, job_id="p2-1"
    )
    assert pg2_conn.status == psycopg2.extensions.STATUS_IN_TRANSACTION  # not committed by us
    assert messages(database_url) == []
    pg2_conn.commit()
    app.enqueue_sync(pg2_conn, "award_points", {"account_id": 5, "points": 3}, job_id="p2-2")
    pg2_conn.rollback()

    stats = await run_worker(pool, app)
    assert stats.outcomes == {"succeeded": 1}
    async with pool.connection() as check:
        assert await scalar(check, "SELECT points FROM public.accounts WHERE id = 5") == 52


def test_psycopg2_and_psycopg_write_the_same_bytes(
    pg2_conn: Any, sync_conn: psycopg.Connection[Any], database_url: str
) -> None:
    payload = {"note": 'café \\ " \n 🎉 \u2028', "account_id": 1, "points": 1}
    producer = Producer(routes=ROUTES)
    producer.enqueue_sync(sync_conn, "award_points", payload, job_id="b", tenant_id="é")
    sync_conn.commit()
    producer.enqueue_sync(pg2_conn, "award_points", payload, job_id="b", tenant_id="é")
    pg2_conn.commit()
    by_psycopg, by_psycopg2 = messages(database_url)
    assert by_psycopg == by_psycopg2
    assert by_psycopg[3] == producer.message("award_points", payload, job_id="b").body


# 6. SQLAlchemy 2.x, sync: Session and Connection, on psycopg and on psycopg2.


def _url(database_url: str, driver: str) -> sqlalchemy.URL:
    params = psycopg.conninfo.conninfo_to_dict(database_url)
    return sqlalchemy.URL.create(
        f"postgresql+{driver}",
        username=str(params.get("user", "")) or None,
        password=str(params["password"]) if params.get("password") else None,
        host=str(params.get("host", "")) or None,
        port=int(params["port"]) if params.get("port") else None,
        database=str(params["dbname"]),
    )


def _engine(database_url: str, driver: str) -> sqlalchemy.Engine:
    return sqlalchemy.create_engine(_url(database_url, driver))


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
async def test_sqlalchemy_session_enqueue_commits_or_rolls_back_with_the_session(
    driver: str,
    sync_conn: psycopg.Connection[Any],
    pool: AsyncConnectionPool[Any],
    producer_url: str,
    database_url: str,
) -> None:
    engine = _engine(producer_url, driver)
    producer = Producer(routes=ROUTES)
    try:
        with Session(engine) as session:
            session.execute(sqlalchemy.text("UPDATE public.accounts SET points = 10 WHERE id = 6"))
            producer.enqueue_sync(
                session, "award_points", {"account_id": 6, "points": 1}, job_id="c"
            )
            assert messages(database_url) == []
            session.commit()
        with Session(engine) as session:
            producer.enqueue_sync(
                session, "award_points", {"account_id": 6, "points": 2}, job_id="r"
            )
            session.rollback()
        with Session(engine) as session:  # closed without commit: SQLAlchemy rolls back
            producer.enqueue_sync(
                session, "award_points", {"account_id": 6, "points": 4}, job_id="x"
            )
        with engine.connect() as connection:
            producer.enqueue_sync(
                connection, "award_points", {"account_id": 6, "points": 8}, job_id="k"
            )
            connection.commit()
        with engine.connect() as connection:
            producer.enqueue_sync(
                connection, "award_points", {"account_id": 6, "points": 16}, job_id="n"
            )
            connection.rollback()
    finally:
        engine.dispose()

    assert [m[2] for m in messages(database_url)] == ["c", "k"]
    stats = await run_worker(pool)
    assert stats.outcomes == {"succeeded": 2}
    async with pool.connection() as check:
        assert await scalar(check, "SELECT points FROM public.accounts WHERE id = 6") == 19


async def test_sqlalchemy_asyncio_enqueue_commits_or_rolls_back_with_the_session(
    sync_conn: psycopg.Connection[Any],
    pool: AsyncConnectionPool[Any],
    producer_url: str,
    database_url: str,
) -> None:
    engine = create_async_engine(_url(producer_url, "psycopg"))
    app = pointsapp.build_app()
    producer = Producer(routes=ROUTES)
    try:
        async with AsyncSession(engine) as session:
            await session.execute(
                sqlalchemy.text("UPDATE public.accounts SET points = 1 WHERE id = 8")
            )
            await app.enqueue(session, "award_points", {"account_id": 8, "points": 1}, job_id="c")
            assert messages(database_url) == []
            await session.commit()
        async with AsyncSession(engine) as session:
            await producer.enqueue(session, "award_points", {"account_id": 8}, job_id="r")
            await session.rollback()
        async with engine.connect() as connection:
            await producer.enqueue(
                connection, "award_points", {"account_id": 8, "points": 2}, job_id="k"
            )
            await connection.commit()
        async with engine.connect() as connection:
            await app.enqueue(
                connection, "award_points", {"account_id": 8, "points": 4}, job_id="n"
            )
            await connection.rollback()
    finally:
        await engine.dispose()

    assert [m[2] for m in messages(database_url)] == ["c", "k"]
    assert (await run_worker(pool, app)).outcomes == {"succeeded": 2}
    async with pool.connection() as check:
        assert await scalar(check, "SELECT points FROM public.accounts WHERE id = 8") == 4


def test_sqlalchemy_on_another_driver_is_refused_before_any_sql() -> None:
    # Not storage: SQLite only stands for "a SQLAlchemy driver jobfence cannot run on".
    engine = sqlalchemy.create_engine("sqlite://")
    try:
        with Session(engine) as session, pytest.raises(TypeError) as refused:
            Producer(routes=ROUTES).enqueue_sync(session, "award_points", {}, job_id="x")
        assert str(refused.value) == (
            "enqueue_sync on SQLAlchemy needs the psycopg or psycopg2 driver, got 'pysqlite'"
            " (use a postgresql+psycopg:// or postgresql+psycopg2:// URL)"
        )
    finally:
        engine.dispose()
