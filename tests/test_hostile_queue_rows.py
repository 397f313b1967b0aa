"""A row a producer writes can never stop a queue: it is refused by a check, or taken and ends
as one dead letter while the jobs beside it run.

Producers write ``jobfence_queue.messages`` and ``jobfence.outbox`` rows (``App.enqueue``,
``jobfence.enqueue``, or an INSERT of their own). The checks of migration 0016 hold for every role,
a superuser included; the queries stay robust for what the checks allow. Without that, one row
with ``attempts = 2147483647`` made every fetch fail with "integer out of range" and the jobs
behind it never ran, and an outbox row with ``prior_attempts = 2147483647`` looped.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from typing import Any

import psycopg
import pytest
from psycopg import errors
from psycopg_pool import AsyncConnectionPool

import pointsapp
from brokers import make_queue, on_broker
from jobfence import PgQueue, PrometheusMetrics, Worker
from jobfence.codec import original_message
from jobfence.harness import DELIVERY_LIMIT
from jobfence.limits import UNFENCEABLE, shown_value
from jobfence.outbox import OutboxRelay, OutboxRelaySettings, record_queue
from jobfence.queues import parse_queue_url
from support import run_jobfence, scalar

INT_MAX = 2**31 - 1
BODY = b'{"account_id": 1, "points": 5}'

INSERT_ROW = (
    "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body, attempts, run_at)"
    " VALUES ('loyalty', 'award_points', %s, %s, %s, %s)"
)
INSERT_OUTBOX_ROW = (
    "INSERT INTO jobfence.outbox (queue, consumer, job_id, body, attempts, due_at,"
    " prior_attempts) VALUES ('loyalty', 'award_points', %s, %s, %s, %s, %s)"
)


async def _enqueue_five(conn: psycopg.AsyncConnection[Any]) -> None:
    app = pointsapp.build_app()
    for n in range(5):
        await app.enqueue(conn, "award_points", {"account_id": 1, "points": 1}, job_id=f"ok-{n}")


async def _worker_until_empty(pool: AsyncConnectionPool[Any], queue: Any) -> PrometheusMetrics:
    """A worker with its outbox relay, run until the outbox and the queue are empty."""
    metrics = PrometheusMetrics()
    worker = Worker(
        pointsapp.build_app(),
        pool,
        queue,
        concurrency=2,
        poll_seconds=0.05,
        lease_seconds=30,
        metrics=metrics,
        outbox_settings=OutboxRelaySettings(poll_seconds=0.05),
    )
    await asyncio.wait_for(worker.run(until="empty"), 60)
    return metrics


async def _five_applied_on_a_broker(
    pool: AsyncConnectionPool[Any], queue: Any, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A worker with its outbox relay runs until the outbox and the queue are empty: the five
    jobs of :func:`_enqueue_five` are applied once each."""
    metrics = await _worker_until_empty(pool, queue)
    assert metrics.count("succeeded") == 5
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 5


async def _dead_letters(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
    cur = await conn.execute(
        "SELECT job_id, error_class, attempts, status FROM core.dead_letters ORDER BY id"
    )
    return await cur.fetchall()


async def test_a_queue_row_with_attempts_at_the_top_of_integer_is_one_dead_letter_and_the_rest_run(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    await conn.execute(INSERT_ROW, ("huge", BODY, INT_MAX, "now"))
    await _enqueue_five(conn)
    metrics = PrometheusMetrics()
    queue = PgQueue(pool)
    try:
        worker = Worker(
            pointsapp.build_app(), pool, queue, concurrency=2, poll_seconds=0.05, metrics=metrics
        )
        await asyncio.wait_for(worker.run(until="empty"), 60)
    finally:
        await queue.close()

    assert metrics.count("succeeded") == 5
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 5
    # Delivered with the highest attempt there is: far past its policy, so dead-lettered
    # without running, and the count is what the dead letter can record.
    assert await _dead_letters(conn) == [("huge", DELIVERY_LIMIT, INT_MAX, "pending_review")]
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0


@pytest.mark.parametrize(
    ("attempts", "run_at", "check"),
    [
        pytest.param(-1, "now", "messages_attempts_check", id="negative-attempts"),
        pytest.param(0, "infinity", "messages_run_at_check", id="run-at-infinity"),
        pytest.param(0, "-infinity", "messages_run_at_check", id="run-at-minus-infinity"),
    ],
)
async def test_the_queue_table_refuses_a_row_no_worker_could_take_even_from_a_superuser(
    conn: psycopg.AsyncConnection[Any], attempts: int, run_at: str, check: str
) -> None:
    assert await scalar(conn, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    with pytest.raises(errors.CheckViolation, match=check):
        await conn.execute(INSERT_ROW, ("bad", BODY, attempts, run_at))


@pytest.mark.parametrize(
    ("attempts", "due_at", "prior", "check"),
    [
        pytest.param(-1, "now", 0, "outbox_attempts_check", id="negative-attempts"),
        pytest.param(0, "infinity", 0, "outbox_due_at_check", id="due-at-infinity"),
        pytest.param(0, "now", -1, "outbox_prior_attempts_check", id="negative-prior"),
    ],
)
async def test_the_outbox_refuses_a_row_the_relay_could_not_take_even_from_a_superuser(
    conn: psycopg.AsyncConnection[Any], attempts: int, due_at: str, prior: int, check: str
) -> None:
    with pytest.raises(errors.CheckViolation, match=check):
        await conn.execute(INSERT_OUTBOX_ROW, ("bad", BODY, attempts, due_at, prior))


async def test_an_outbox_row_whose_publish_keeps_failing_at_the_top_of_attempts_stays_due(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The relay's failed-publish count never overflows: the row is pushed back, not stuck."""
    await conn.execute(INSERT_OUTBOX_ROW, ("j", BODY, INT_MAX, "now", 0))
    sql = resources.files("jobfence.sql").joinpath("outbox.sql").read_text()
    mark = sql.split("-- name: outbox_mark_failed\n", 1)[1].split("-- name:", 1)[0]
    row_id = await scalar(conn, "SELECT id FROM jobfence.outbox")
    await conn.execute(mark, {"id": row_id, "error": "refused", "now": None, "delay_seconds": 1})
    assert await scalar(conn, "SELECT attempts FROM jobfence.outbox") == INT_MAX


@pytest.fixture(params=["redis"])
async def redis_target(request: pytest.FixtureRequest) -> Any:
    async with on_broker(request, [pointsapp.QUEUE], prefix="jfhostile") as (kind, url, name):
        queue = make_queue(kind, url, name)
        yield url, queue
        await queue.close()


async def test_an_outbox_row_with_prior_attempts_at_the_top_is_one_dead_letter_and_the_rest_run(
    redis_target: tuple[str, Any],
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    url, queue = redis_target
    await conn.execute(pointsapp.SCHEMA_SQL)
    target = parse_queue_url(url)
    await record_queue(conn, target.kind, target.location)
    await conn.execute(INSERT_OUTBOX_ROW, ("huge-prior", BODY, 0, "now", INT_MAX))
    await _enqueue_five(conn)
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 6
    await _five_applied_on_a_broker(pool, queue, conn)
    assert await _dead_letters(conn) == [("huge-prior", DELIVERY_LIMIT, INT_MAX, "pending_review")]
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
    assert (await queue.size([pointsapp.QUEUE])).total == 0


async def test_a_check_stays_not_valid_with_a_warning_when_a_row_already_breaks_it(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """``jobfence migrate`` on a database that already holds a breaking row does not fail the
    deploy: that check stays NOT VALID (new rows are still checked), the others are validated,
    and the migration's WARNING is printed."""
    await conn.execute(
        "ALTER TABLE jobfence_queue.messages DROP CONSTRAINT messages_attempts_check,"
        " DROP CONSTRAINT messages_run_at_check;"
        " ALTER TABLE jobfence.outbox DROP CONSTRAINT outbox_attempts_check,"
        " DROP CONSTRAINT outbox_due_at_check;"
        " DELETE FROM jobfence.schema_migrations WHERE version = 16"
    )
    await conn.execute(INSERT_ROW, ("old", BODY, -3, "now"))

    result = await asyncio.to_thread(run_jobfence, database_url, "migrate")

    assert result.returncode == 0, result.stderr
    assert result.stdout == "applied 0016_hostile_rows\n"
    assert (
        "WARNING jobfence.schema: jobfence: jobfence_queue.messages holds rows where attempts < 0:"
        " check messages_attempts_check stays NOT VALID (new and updated rows are checked);"
        " validate it once they are gone"
    ) in result.stderr
    cur = await conn.execute(
        "SELECT conname, convalidated FROM pg_constraint WHERE conname IN"
        " ('messages_attempts_check', 'messages_run_at_check', 'outbox_attempts_check',"
        " 'outbox_due_at_check') ORDER BY conname"
    )
    assert await cur.fetchall() == [
        ("messages_attempts_check", False),
        ("messages_run_at_check", True),
        ("outbox_attempts_check", True),
        ("outbox_due_at_check", True),
    ]
    with pytest.raises(errors.CheckViolation, match="messages_attempts_check"):
        await conn.execute(INSERT_ROW, ("new", BODY, -1, "now"))


async def test_a_row_a_producer_wrote_with_a_lease_token_runs_like_any_other(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    """The columns only workers mean to write (``lease_token``, ``last_error``, ``attempts``)
    change nothing when a producer sets them: a due row is taken under a fresh lease."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    await conn.execute(
        "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body, attempts,"
        " lease_token, last_error) VALUES ('loyalty', 'award_points', 'leased', %s, 2,"
        " gen_random_uuid(), 'made up')",
        (BODY,),
    )
    queue = PgQueue(pool)
    try:
        stats = await asyncio.wait_for(
            Worker(pointsapp.build_app(), pool, queue, poll_seconds=0.05).run(until="empty"), 30
        )
    finally:
        await queue.close()
    assert stats.outcomes == {"succeeded": 1}
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 5
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0


@pytest.fixture(params=["nats", "redis", "rabbitmq"])
async def broker_target(request: pytest.FixtureRequest) -> Any:
    async with on_broker(request, [pointsapp.QUEUE], prefix="jfhostile") as (kind, url, name):
        queue = make_queue(kind, url, name)
        yield url, queue
        await queue.close()


# Dot-separated tokens, as a NATS subject is made of, 5,007 characters: longer than a NATS
# server's control line (4 KB) and RabbitMQ's queue names (255 bytes).
LONG_QUEUE = "loyalty" + ".x" * 2500


@pytest.mark.parametrize(
    ("column", "value", "field"),
    [
        pytest.param("queue", LONG_QUEUE, "queue", id="queue-of-5007-characters"),
        pytest.param("queue", "loyalty points", "queue", id="queue-with-a-space"),
        pytest.param("consumer", "award\npoints", "consumer", id="consumer-with-a-newline"),
        pytest.param("correlation_id", "c" * 3000, "correlation_id", id="correlation-id-of-3000"),
    ],
)
async def test_an_outbox_row_no_worker_could_take_is_one_dead_letter_and_the_rest_run(  # noqa: PLR0917
    broker_target: tuple[str, Any],
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    column: str,
    value: str,
    field: str,
) -> None:
    """A row written straight into the outbox (by a role that may, or an application's own
    INSERT) with a queue name, consumer name or id over jobfence's limits is never sent to the
    broker: the relay makes it one dead letter of class UnfenceableMessage, with its values
    shown as bounded stand-ins, and publishes the rows behind it."""
    url, queue = broker_target
    await conn.execute(pointsapp.SCHEMA_SQL)
    target = parse_queue_url(url)
    await record_queue(conn, target.kind, target.location)
    row = {"queue": "loyalty", "consumer": "award_points", "correlation_id": None}
    row[column] = value
    await conn.execute(
        "INSERT INTO jobfence.outbox (queue, consumer, job_id, body, correlation_id)"
        " VALUES (%(queue)s, %(consumer)s, 'hostile', %(body)s, %(correlation_id)s)",
        {**row, "body": BODY},
    )
    await _enqueue_five(conn)
    await _five_applied_on_a_broker(pool, queue, conn)
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
    cur = await conn.execute(
        "SELECT job_id, error_class, attempts, last_error, queue, consumer, correlation_id,"
        " payload FROM core.dead_letters"
    )
    ((job_id, error_class, attempts, last_error, *stored, payload),) = await cur.fetchall()
    assert (job_id, error_class, attempts) == ("hostile", UNFENCEABLE, 1)
    assert last_error.startswith(
        f"{UNFENCEABLE}: the message cannot be fenced or stored as it is: {field} "
    ), last_error
    assert "\n" not in last_error
    for stored_value in stored:  # what is stored fits its indexes: the value, or its stand-in
        assert stored_value is None or len(stored_value.encode()) <= 1024
    kept = original_message(json.dumps(payload))  # the whole message, as it was written
    assert getattr(kept, column) == value
    assert (kept.job_id, kept.body) == ("hostile", BODY)
    if shown_value(value) != value:  # a log line shows it only when short and printable
        assert value not in caplog.text
    # Never sent: nothing of it is on the broker, and no outage was taken for it.
    assert (await queue.size([pointsapp.QUEUE])).total == 0
    assert "went away" not in caplog.text


async def test_an_outbox_row_a_producer_wrote_with_a_claim_is_published_like_any_other(
    redis_target: tuple[str, Any], database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """``claimed_until`` is the relay's own column. A row written with a claim far ahead (an
    INSERT of a role allowed to write every column) is published at the relay's next round, as
    any due row: no relay makes a claim longer than its ``claim_seconds``. Before, it waited
    until a relay next took over (which clears every claim), which could be days."""
    url, queue = redis_target
    target = parse_queue_url(url)
    await record_queue(conn, target.kind, target.location)
    await conn.execute(
        "INSERT INTO jobfence.outbox (queue, consumer, job_id, body, claimed_until)"
        " VALUES ('loyalty', 'award_points', 'claimed', %s, now() + interval '1 year')",
        (BODY,),
    )
    relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
        await relay.run_round(c)
    assert relay.stats.published == 1
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
    [delivery] = await queue.receive([pointsapp.QUEUE], max_messages=5, lease_seconds=30)
    assert delivery.message.job_id == "claimed"
    await queue.ack(delivery)


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("created_at", "infinity"),
        ("created_at", "-infinity"),
        ("created_at", "20000-01-01 00:00+00"),
        ("created_at", "4713-01-01 00:00+00 BC"),
        ("due_at", "4713-01-01 00:00+00 BC"),  # finite, so the check lets it in; due at once
        ("due_at", "0001-01-01 00:00+00"),
    ],
)
async def test_an_outbox_row_with_a_time_no_datetime_holds_is_published_like_any_other(
    column: str,
    value: str,
    redis_target: tuple[str, Any],
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A producer may write any timestamp in an outbox row, some of which no Python
    ``datetime`` holds: the relay must not read one as such (``created_at`` goes into the row's
    publish id, ``due_at`` orders a batch), or that row would fail every claim and hold back the
    whole outbox."""
    url, queue = redis_target
    await conn.execute(pointsapp.SCHEMA_SQL)
    target = parse_queue_url(url)
    await record_queue(conn, target.kind, target.location)
    await conn.execute(
        f"INSERT INTO jobfence.outbox (queue, consumer, job_id, body, {column})"
        " VALUES ('loyalty', 'award_points', 'odd-time', %s, %s)",
        (b'{"account_id": 2, "points": 7}', value),
    )
    await _enqueue_five(conn)
    metrics = await _worker_until_empty(pool, queue)
    assert metrics.count("succeeded") == 6
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 2") == 7
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
