"""What a producer may ask for, bounded where the job is written: when it falls due, and how big
its body is.

A delay is limited by the time the job falls due (``now() + delay``), not by the interval: an
interval compares a month as 30 days, while ``now() + delay`` adds calendar months, so months and
days of opposite signs once passed the 3,650-day check and put ``run_at`` centuries away (never
run, never dead-lettered, ``Worker.run(until="empty")`` never returning) or centuries in the
past. A body is at most ``MAX_BODY_BYTES`` (64 MiB): its dead letter must always be able to
hold it (jsonb refuses a string over 268,435,455 bytes, and a base64 body is a third larger).

Every SQL call here runs as a login role holding only the producer role of ``jobfence roles
--print-sql``: the caller the limits are for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import JobRefused, PgQueue, Producer, Worker
from jobfence.limits import MAX_BODY_BYTES
from jobfence.model import Message
from jobfence.producer import publish_sync
from roles_support import deployed_roles

ROUTES = {"award_points": pointsapp.QUEUE}
GOOD_BODY = '{"account_id":1,"points":1}'
# The calls a producer role can make, with the job's body or payload as the fourth argument.
CALLS = {
    "produce": "SELECT produced_id FROM jobfence.produce("
    "'award_points', 'loyalty', %(job_id)s, {body}, NULL, NULL, %(delay)s::interval)",
    "enqueue": "SELECT jobfence.enqueue("
    "'award_points', 'loyalty', %(job_id)s, {payload}, NULL, NULL, %(delay)s::interval)",
}
GOOD_ARGUMENT = {
    "produce": "convert_to(%(good)s, 'UTF8')",
    "enqueue": "%(good)s::jsonb",
}


def call(function: str, argument: str | None = None) -> str:
    """The SQL of ``function`` with the body (or payload) given by ``argument``, an SQL
    expression: by default the good body, from the parameter ``good``."""
    argument = argument if argument is not None else GOOD_ARGUMENT[function]
    return CALLS[function].format(body=argument, payload=argument)


@pytest.fixture
def producer_url(database_url: str) -> Iterator[str]:
    """A login role holding only the producer role (and the points app's own tables)."""
    with psycopg.connect(database_url, autocommit=True) as setup:
        setup.execute(pointsapp.SCHEMA_SQL)
    with deployed_roles(database_url) as urls:
        login = psycopg.conninfo.conninfo_to_dict(urls["producer"])["user"]
        with psycopg.connect(database_url, autocommit=True) as setup:
            setup.execute(f'GRANT SELECT, INSERT ON public.awards TO "{login}"')
        yield urls["producer"]


def set_queue_kind(database_url: str, kind: str) -> None:
    if kind != "postgresql":
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute("SELECT jobfence.set_queue(%s, 'amqp://broker/')", (kind,))


def written(database_url: str) -> list[tuple[str, str]]:
    """Every job written, as (table, job_id): the PostgreSQL queue's and the outbox's."""
    with psycopg.connect(database_url, autocommit=True) as admin:
        return admin.execute(
            "SELECT 'queue', job_id FROM jobfence_queue.messages"
            " UNION ALL SELECT 'outbox', job_id FROM jobfence.outbox ORDER BY 1, 2"
        ).fetchall()


def run_until_empty(database_url: str) -> dict[str, int]:
    """The points app's worker, until the queue holds nothing at all (10 s at most)."""

    async def run() -> dict[str, int]:
        async with AsyncConnectionPool(
            database_url, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
        ) as pool:
            queue = PgQueue(pool)
            try:
                worker = Worker(pointsapp.build_app(), pool, queue)
                stats = await asyncio.wait_for(worker.run(until="empty"), 10)
            finally:
                await queue.close()
        return dict(stats.outcomes)  # Outcome is a str: {"succeeded": 2} compares equal

    return asyncio.run(run())


# 1. A delay is bounded by the time the job falls due.

# (interval, what it is): each compares as 3,650 days or less, and puts the job further away.
OFFSET_DELAYS = [
    # 83,333 years of months less 82,134 years of days: year 3225 (the audit's job).
    ("1000000 months -29999000 days", "83333 years 4 mons -29999000 days"),
    # Ten calendar years and a day: about 3,653 days, compared as 3,601.
    ("120 months 1 day", "10 years 1 day"),
    # Centuries in the past, by the same mistake the other way.
    ("-1000000 months 30000000 days", "-83333 years -4 mons +30000000 days"),
]


@pytest.mark.parametrize("kind", ["postgresql", "rabbitmq"])
@pytest.mark.parametrize("function", ["produce", "enqueue"])
def test_a_delay_of_months_offset_by_days_past_the_limit_is_refused_and_writes_nothing(
    database_url: str, producer_url: str, function: str, kind: str
) -> None:
    set_queue_kind(database_url, kind)
    with psycopg.connect(producer_url) as conn:
        conn.execute(call(function), {"job_id": "before", "good": GOOD_BODY, "delay": "0"})
        conn.commit()
        for delay, shown in OFFSET_DELAYS:
            with pytest.raises(psycopg.errors.InvalidParameterValue) as refused:
                conn.execute(call(function), {"job_id": "far", "good": GOOD_BODY, "delay": delay})
            assert refused.value.diag.message_primary == (
                f"jobfence.{function}: delay {shown} is over the limit of 3650 days"
            )
            conn.rollback()
        conn.execute(call(function), {"job_id": "after", "good": GOOD_BODY, "delay": "0"})
        conn.commit()
    table = "queue" if kind == "postgresql" else "outbox"
    assert written(database_url) == [(table, "after"), (table, "before")]
    if kind == "postgresql":
        assert run_until_empty(database_url) == {"succeeded": 2}
        assert written(database_url) == []


@pytest.mark.parametrize("kind", ["postgresql", "rabbitmq"])
@pytest.mark.parametrize("function", ["produce", "enqueue"])
def test_a_delay_that_lands_before_now_counts_as_none(
    database_url: str, producer_url: str, function: str, kind: str
) -> None:
    """Twelve months back and 361 days on compares as a day ahead, and lands about four days
    ago: a negative delay counts as none, so the job is due now, not before the others."""
    set_queue_kind(database_url, kind)
    with psycopg.connect(producer_url) as conn:
        conn.execute(
            call(function),
            {"job_id": "back", "good": GOOD_BODY, "delay": "-12 months 361 days"},
        )
        conn.commit()
    with psycopg.connect(database_url, autocommit=True) as admin:
        due = admin.execute(
            "SELECT run_at - created_at FROM jobfence_queue.messages"
            " UNION ALL SELECT due_at - created_at FROM jobfence.outbox"
        ).fetchall()
    assert [str(d) for (d,) in due] == ["0:00:00"]


# 2. A body is at most MAX_BODY_BYTES.


# A body of MAX_BODY_BYTES + 1 (%(size)s), built by the server, and what the caller is told.
BIG_ARGUMENT = {
    "produce": "convert_to('\"' || repeat('x', %(size)s - 2) || '\"', 'UTF8')",
    "enqueue": "to_jsonb(repeat('x', %(size)s - 2))",
}
BIG_REFUSAL = {
    "produce": "jobfence.produce: body is 67108865 bytes long, at most 67108864 are allowed",
    "enqueue": "jobfence.enqueue: payload is 67108865 bytes long as compact JSON (UTF-8), at most"
    " 67108864 are allowed",
}


@pytest.mark.parametrize("kind", ["postgresql", "rabbitmq"])
@pytest.mark.parametrize("function", ["produce", "enqueue"])
def test_sql_body_over_64_mib_is_refused_and_writes_nothing(
    database_url: str, producer_url: str, function: str, kind: str
) -> None:
    """The body is built by the server (no 64 MiB round trip); the message names its size and
    the limit, never its content."""
    set_queue_kind(database_url, kind)
    with psycopg.connect(producer_url) as conn:
        conn.execute(call(function), {"job_id": "before", "good": GOOD_BODY, "delay": "0"})
        conn.commit()
        with pytest.raises(psycopg.errors.InvalidParameterValue) as refused:
            conn.execute(
                call(function, BIG_ARGUMENT[function]),
                {"job_id": "huge", "size": MAX_BODY_BYTES + 1, "delay": "0"},
            )
        assert refused.value.diag.message_primary == BIG_REFUSAL[function]
        conn.rollback()
        conn.execute(call(function), {"job_id": "after", "good": GOOD_BODY, "delay": "0"})
        conn.commit()
    table = "queue" if kind == "postgresql" else "outbox"
    assert written(database_url) == [(table, "after"), (table, "before")]
    if kind == "postgresql":
        assert run_until_empty(database_url) == {"succeeded": 2}


def test_python_producers_refuse_a_body_over_64_mib_before_any_sql(
    database_url: str, producer_url: str
) -> None:
    """App.enqueue_sync, Producer.enqueue_sync, Producer.enqueue (async) and publish_sync of a
    raw Message: JobRefused naming the payload, its size and the limit, not its content; the
    caller's transaction untouched, its other work committed with it."""
    blob = "x" * MAX_BODY_BYTES  # with the other keys, just over the limit once encoded
    payload = {"account_id": 1, "points": 1, "mode": blob}
    size = len(f'{{"account_id":1,"points":1,"mode":"{blob}"}}')
    expected = (
        f"job refused: payload is {size:,} bytes, over the limit of {MAX_BODY_BYTES:,} (64 MiB)"
    )
    app, producer = pointsapp.build_app(), Producer(routes=ROUTES)
    raw = Message(
        queue="loyalty", consumer="award_points", job_id="raw", body=b'"' + b"x" * MAX_BODY_BYTES
    )

    async def producer_async() -> None:
        async with await psycopg.AsyncConnection.connect(producer_url) as aconn:
            await producer.enqueue(aconn, "award_points", payload, job_id="async")

    attempts: dict[str, Callable[[psycopg.Connection[Any]], None]] = {
        "App.enqueue_sync": lambda c: app.enqueue_sync(c, "award_points", payload, job_id="app"),
        "Producer.enqueue_sync": lambda c: producer.enqueue_sync(
            c, "award_points", payload, job_id="by-name"
        ),
        "publish_sync": lambda c: publish_sync(c, raw),
        "Producer.enqueue": lambda c: asyncio.run(producer_async()),
    }
    with psycopg.connect(producer_url) as conn:
        conn.execute("INSERT INTO public.awards VALUES ('caller', 1, 1)")
        for name, attempt in attempts.items():
            with pytest.raises(JobRefused) as refused:
                attempt(conn)
            assert refused.value.field == "payload", name
            if name == "publish_sync":
                assert str(refused.value).startswith(
                    f"job refused: payload is {MAX_BODY_BYTES + 1:,} bytes, over the limit of"
                ), name
            else:
                assert str(refused.value).startswith(expected), name
            assert "xxxx" not in str(refused.value), name
            assert conn.info.transaction_status == TransactionStatus.INTRANS, name
        producer.enqueue_sync(conn, "award_points", {"account_id": 1, "points": 1}, job_id="ok")
        conn.commit()
        assert conn.execute("SELECT job_id FROM public.awards").fetchall() == [("caller",)]
    assert written(database_url) == [("queue", "ok")]
    assert run_until_empty(database_url) == {"succeeded": 1}
