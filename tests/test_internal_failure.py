"""A job whose handling fails inside jobfence, the same way on every delivery, does not loop.

Induced here with a trigger that makes the ordinary dead-letter insert fail (as an index entry
too large for PostgreSQL did): the job stays leased, comes back, and at delivery
INTERNAL_FAILURE_DELIVERIES a fallback that keeps the whole message writes one
``InternalFailure`` dead letter, with its alert. Every such failure is counted
(``internal_error``) and logged at ERROR, rate-limited. If even the fallback fails, the job
stays on the queue, counted and logged, and nothing is lost once the cause is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import Message, PgQueue, PrometheusMetrics, Worker
from jobfence.adapters.pg_queue import publish_on
from jobfence.codec import PAYLOAD_MESSAGE, original_message
from jobfence.harness import (
    INTERNAL_FAILURE,
    INTERNAL_FAILURE_DELIVERIES,
    INTERNAL_LOG_PER_MINUTE,
    describe_error,
)
from support import scalar, wait_until

# Makes an insert into core.dead_letters fail: every insert, or (only_ordinary) those that do
# not keep the whole message, with the error an oversized index entry gives.
BREAK_DEAD_LETTERS = """
CREATE FUNCTION public.break_dead_letters() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_ARGV[0] = 'all' OR NEW.payload_encoding <> 'message' THEN
        RAISE EXCEPTION 'index row size 8048 exceeds btree version 4 maximum 2704'
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER break_dead_letters BEFORE INSERT ON core.dead_letters
    FOR EACH ROW EXECUTE FUNCTION public.break_dead_letters({which});
"""
HARD = b'{"account_id": 1, "points": 5, "mode": "hard"}'


def _message(job_id: str) -> Message:
    return Message(pointsapp.QUEUE, "award_points", job_id, HARD, correlation_id="corr-" + job_id)


def _worker(pool: AsyncConnectionPool[Any], queue: PgQueue, **kwargs: Any) -> Worker:
    kwargs.setdefault("metrics", PrometheusMetrics())
    return Worker(pointsapp.build_app(), pool, queue, concurrency=1, poll_seconds=0.05, **kwargs)


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and r.name == "jobfence.harness"
    ]


async def test_a_job_failing_inside_jobfence_every_time_ends_as_one_internal_failure_dead_letter(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="jobfence")
    await conn.execute(pointsapp.SCHEMA_SQL)
    await conn.execute(BREAK_DEAD_LETTERS.format(which="'ordinary'"))
    message = _message("loops-1")
    await publish_on(conn, message)
    metrics = PrometheusMetrics()
    queue = PgQueue(pool)
    try:
        worker = _worker(pool, queue, lease_seconds=0.3, metrics=metrics)
        await asyncio.wait_for(worker.run(until="empty"), 30)
    finally:
        await queue.close()

    cur = await conn.execute(
        "SELECT job_id, error_class, attempts, payload_encoding, payload::text, last_error,"
        " correlation_id FROM core.dead_letters"
    )
    rows = await cur.fetchall()
    assert len(rows) == 1, rows
    job_id, error_class, attempts, encoding, payload_text, last_error, correlation = rows[0]
    assert (job_id, error_class, attempts, encoding, correlation) == (
        "loops-1",
        INTERNAL_FAILURE,
        INTERNAL_FAILURE_DELIVERIES,
        PAYLOAD_MESSAGE,
        "corr-loops-1",
    )
    assert original_message(payload_text) == message
    assert "handling failed inside jobfence" in json.loads(payload_text)["note"]
    assert last_error.startswith(
        f"{INTERNAL_FAILURE}: handling failed inside jobfence at delivery 3"
    )
    assert "psycopg.errors.ProgramLimitExceeded: index row size 8048" in last_error
    assert await scalar(conn, "SELECT count(*) FROM jobfence.alert_outbox") == 1
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
    assert metrics.count("internal_error") == INTERNAL_FAILURE_DELIVERIES
    assert metrics.count("dead_lettered") == 1
    lines = _errors(caplog)
    assert lines[0].startswith(
        "internal error handling job loops-1 for award_points (delivery 1):"
        " psycopg.errors.ProgramLimitExceeded: index row size 8048"
    )
    assert "at delivery 3 it is dead-lettered as InternalFailure" in lines[0]
    assert lines[-1].startswith(
        "job loops-1 for award_points dead-lettered as InternalFailure: handling failed inside"
        " jobfence at delivery 3"
    )


async def test_when_the_fallback_fails_too_the_job_is_counted_logged_and_kept_until_recorded(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="jobfence")
    await conn.execute(pointsapp.SCHEMA_SQL)
    await conn.execute(BREAK_DEAD_LETTERS.format(which="'all'"))
    await publish_on(conn, _message("stuck-1"))
    metrics = PrometheusMetrics()
    queue = PgQueue(pool)
    try:
        worker = _worker(pool, queue, lease_seconds=0.2, metrics=metrics)
        running = asyncio.create_task(worker.run())
        await wait_until(
            lambda: _attempts_at_least(conn, INTERNAL_FAILURE_DELIVERIES + 2),
            timeout=20,
            message="five deliveries",
        )
        worker.stop()
        await asyncio.wait_for(running, 20)
        assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0
        assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 1
        assert metrics.count("internal_error") >= INTERNAL_FAILURE_DELIVERIES + 1
        assert any(
            "its fallback dead letter could not be written either" in line
            for line in _errors(caplog)
        )
        # The cause goes away: the job becomes its dead letter, nothing was lost.
        await conn.execute("DROP TRIGGER break_dead_letters ON core.dead_letters")
        await asyncio.wait_for(_worker(pool, queue, lease_seconds=0.2).run(until="empty"), 30)
    finally:
        await queue.close()
    assert await scalar(conn, "SELECT array_agg(job_id) FROM core.dead_letters") == ["stuck-1"]


async def _attempts_at_least(conn: psycopg.AsyncConnection[Any], n: int) -> bool:
    return bool(await scalar(conn, "SELECT attempts >= %s FROM jobfence_queue.messages", (n,)))


async def test_internal_error_lines_are_rate_limited_while_every_failure_is_counted(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="jobfence")
    await conn.execute(pointsapp.SCHEMA_SQL)
    await conn.execute(BREAK_DEAD_LETTERS.format(which="'all'"))
    jobs = INTERNAL_LOG_PER_MINUTE + 5
    for i in range(jobs):
        await publish_on(conn, _message(f"many-{i}"))
    metrics = PrometheusMetrics()
    queue = PgQueue(pool)
    try:
        await asyncio.wait_for(
            _worker(pool, queue, metrics=metrics).run(until="idle"), 30
        )  # the default lease keeps each to one delivery here
    finally:
        await queue.close()
    assert metrics.count("internal_error") == jobs
    assert len(_errors(caplog)) == INTERNAL_LOG_PER_MINUTE
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == jobs


# --- what a dead letter says about the failure ------------------------------------------------


async def test_last_error_starts_at_the_handlers_own_frame_and_the_log_line_gives_the_message(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="jobfence")
    await conn.execute(pointsapp.SCHEMA_SQL)
    await publish_on(conn, _message("hard-1"))
    queue = PgQueue(pool)
    try:
        await asyncio.wait_for(_worker(pool, queue).run(until="idle"), 30)
    finally:
        await queue.close()
    last_error = await scalar(conn, "SELECT last_error FROM core.dead_letters")
    head, _, trace = last_error.partition("\nTraceback (most recent call last, trimmed):\n")
    assert head == "jobfence.HardFailure: account is closed"
    assert trace.lstrip().startswith(f'File "{pointsapp.__file__}"'), trace
    assert "jobfence/harness.py" not in trace
    assert (
        "job hard-1 for award_points dead-lettered after 1 attempt(s):"
        " jobfence.HardFailure: account is closed"
    ) in caplog.text


def test_an_error_raised_inside_jobfence_alone_keeps_all_its_frames() -> None:
    from jobfence.codec import original_body

    try:
        original_body("{}", "rot13")
    except ValueError as exc:
        text = describe_error(exc)
    assert "jobfence/codec.py" in text
    assert "in original_body" in text


def test_last_error_escapes_what_postgresql_text_cannot_hold() -> None:
    text = describe_error(ValueError("bad \x00 byte and \ud800 surrogate"))
    assert text == "ValueError: bad \\x00 byte and \\ud800 surrogate"
    text.encode("utf-8")


async def test_in_a_group_an_unfenceable_job_and_internal_failures_each_end_as_one_dead_letter(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    """Group commit: the group rolls back and its jobs run one transaction each, where the
    limits and the bounded rule apply to each; the job that can succeed commits once."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    await conn.execute(BREAK_DEAD_LETTERS.format(which="'ordinary'"))
    ok = Message(pointsapp.QUEUE, "award_points", "ok-1", b'{"account_id": 1, "points": 5}')
    long_id = Message(pointsapp.QUEUE, "award_points", "L" * 2000, ok.body)
    for message in (ok, _message("hard-1"), long_id, _message("hard-2")):
        await publish_on(conn, message)
    metrics = PrometheusMetrics()
    queue = PgQueue(pool)
    try:
        worker = Worker(
            pointsapp.build_app(jobs_per_transaction=10),
            pool,
            queue,
            concurrency=1,
            poll_seconds=0.05,
            lease_seconds=0.3,
            metrics=metrics,
        )
        await asyncio.wait_for(worker.run(until="empty"), 30)
    finally:
        await queue.close()
    cur = await conn.execute(
        "SELECT error_class, payload::text FROM core.dead_letters ORDER BY error_class, id"
    )
    letters = [
        (error_class, original_message(text).job_id) for error_class, text in await cur.fetchall()
    ]
    assert sorted(letters) == [
        (INTERNAL_FAILURE, "hard-1"),
        (INTERNAL_FAILURE, "hard-2"),
        ("UnfenceableMessage", "L" * 2000),
    ]
    assert await scalar(conn, "SELECT array_agg(job_id) FROM public.awards") == ["ok-1"]
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
