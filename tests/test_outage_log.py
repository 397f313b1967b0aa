"""A database outage in the worker's log: one line when the database goes away, one when it is
back (with the outage's length and the jobs released), at most one line every 30 s between; no
flood of psycopg_pool warnings, no object reprs; and still no job lost or applied twice."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import PgQueue, PrometheusMetrics, QueueUnavailable, Worker, WorkerStats, db
from jobfence.outage_log import OutageLog, reason, stay_connected
from support import scalar, wait_until
from tcp_proxy import TcpProxy

JOBS = 60
OUTAGE_SECONDS = 3.0
# Probing every 0.5, 1, 2, 4 s... and reconnecting every 1, 2, 4, 8 s..., the worker found the
# database back about 7 s after an outage of this long; probing and reconnecting at least every
# 2 s, within 2-3 s. The jobs left take well under a second.
LONG_OUTAGE_SECONDS = 8.0
RESUMED_WITHIN_SECONDS = 5.0
REPR = re.compile(r"<[A-Za-z_][\w.]*[ >]|0x[0-9a-f]{6,}|\[BAD\]")


@dataclass
class Outage:
    """What a worker did through one database outage (:func:`_through_an_outage`)."""

    stats: WorkerStats
    messages: list[str]  # its INFO lines and up
    warnings_after_start: list[str]  # its WARNING lines and up, start-up lines left out
    finished_after_up: float  # seconds from the database's return to the queue's last job done


async def _through_an_outage(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    flavour: str,
    outage_seconds: float,
) -> Outage:
    """A worker (3 processors, async or sync handlers) on :data:`JOBS` slow jobs, its database
    cut for ``outage_seconds`` once 5 jobs are done, then back; the worker runs until the
    queue is empty."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app(flavour=flavour)
    async with conn.transaction():
        for i in range(JOBS):
            payload = {"account_id": i % 10 + 1, "points": 1, "mode": "slow"}
            await app.enqueue(conn, "award_points", payload, job_id=f"j{i}")
    proxy = TcpProxy.for_database(database_url)
    await proxy.start()
    pool = await db.open_pool(proxy.url(database_url), max_size=5)
    queue = PgQueue(pool, poll_interval_seconds=0.1)
    metrics = PrometheusMetrics()
    worker = Worker(app, pool, queue, concurrency=3, poll_seconds=0.1, metrics=metrics)
    caplog.set_level(logging.INFO, logger="jobfence")
    run = asyncio.create_task(worker.run(until="empty"))
    loop = asyncio.get_running_loop()
    try:

        async def some_done() -> bool:
            return metrics.count("succeeded") >= 5

        await wait_until(some_done, message="the first jobs to succeed")
        before = len(caplog.records)  # start-up lines (autovacuum off...) are not the outage's
        await proxy.cut()

        async def noticed() -> bool:
            return "database went away" in caplog.text

        await wait_until(noticed, message="the worker to notice the outage")
        await asyncio.sleep(outage_seconds)  # the outage itself: its length is the experiment
        proxy.up()
        up_at = loop.time()
        stats = await asyncio.wait_for(run, timeout=60)
        finished_after_up = loop.time() - up_at
    finally:
        worker.stop()
        await asyncio.wait_for(asyncio.shield(run), timeout=30)
        await queue.close()
        await pool.close()
        await proxy.close()
    # Nothing lost, nothing twice, no retry burnt.
    assert await scalar(conn, "SELECT count(*) FROM awards") == JOBS
    assert await scalar(conn, "SELECT count(DISTINCT job_id) FROM awards") == JOBS
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == JOBS
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0
    assert metrics.count("retried") == 0
    return Outage(
        stats=stats,
        messages=[r.getMessage() for r in caplog.records if r.levelno >= logging.INFO],
        warnings_after_start=[
            r.getMessage() for r in caplog.records[before:] if r.levelno >= logging.WARNING
        ],
        finished_after_up=finished_after_up,
    )


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_an_outage_logs_one_line_when_the_database_goes_one_when_back_and_no_flood(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    flavour: str,
) -> None:
    """For async handlers, and for sync ones (whose sync pool loses its connections too, and
    whose processors hold a connection of the worker's pool idle meanwhile)."""
    outage = await _through_an_outage(database_url, conn, caplog, flavour, OUTAGE_SECONDS)
    messages = outage.messages
    went = [m for m in messages if m.startswith("database went away (")]
    back = [m for m in messages if m.startswith("database back after ")]
    assert len(went) == 1, messages
    assert len(back) == 1, messages
    found = re.fullmatch(
        r"database back after (\d+\.\d)s, (\d+) job\(s\) released: resuming"
        r"( \(\d+ psycopg warning\(s\) held back\))?",
        back[0],
    )
    assert found is not None, back[0]
    assert float(found[1]) >= OUTAGE_SECONDS
    assert int(found[2]) == outage.stats.released >= 1
    assert not [m for m in messages if REPR.search(m)], messages
    # went away; the acks', the listener's first failure
    assert len(outage.warnings_after_start) <= 3, outage.warnings_after_start
    assert not [m for m in messages if "still unreachable" in m]  # 3 s < 30 s


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_after_a_long_outage_the_worker_resumes_within_seconds_of_the_database_return(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    flavour: str,
) -> None:
    """The worker probes the database, and its pools (the sync one too) try to replace their
    lost connections, at least every 2 s, not backing off further: after an outage of 8 s the
    jobs left run at once, not up to 8 s more later."""
    outage = await _through_an_outage(database_url, conn, caplog, flavour, LONG_OUTAGE_SECONDS)
    went = [m for m in outage.messages if m.startswith("database went away (")]
    back = [m for m in outage.messages if m.startswith("database back after ")]
    assert (len(went), len(back)) == (1, 1), outage.messages
    assert outage.finished_after_up < RESUMED_WITHIN_SECONDS, outage.messages


async def test_a_worker_stopped_during_an_outage_logs_one_line_for_the_jobs_it_cannot_release(
    database_url: str, conn: psycopg.AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    async with conn.transaction():
        for i in range(JOBS):
            payload = {"account_id": i % 10 + 1, "points": 1, "mode": "slow"}
            await app.enqueue(conn, "award_points", payload, job_id=f"j{i}")
    proxy = TcpProxy.for_database(database_url)
    await proxy.start()
    # A short pool timeout: each release during the outage fails within 0.5 s, not 30 s.
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        proxy.url(database_url), max_size=5, kwargs={"autocommit": True}, open=False, timeout=0.5
    )
    await pool.open(wait=True)
    queue = PgQueue(pool, poll_interval_seconds=0.1)
    metrics = PrometheusMetrics()
    worker = Worker(
        app, pool, queue, concurrency=3, poll_seconds=0.1, lease_seconds=2.0, metrics=metrics
    )
    caplog.set_level(logging.INFO, logger="jobfence")
    run = asyncio.create_task(worker.run())
    try:

        async def some_done() -> bool:
            return metrics.count("succeeded") >= 5

        await wait_until(some_done, message="the first jobs to succeed")
        await proxy.cut()

        async def noticed() -> bool:
            return "database went away" in caplog.text

        await wait_until(noticed, message="the worker to notice the outage")
        worker.stop()
        stats = await asyncio.wait_for(run, timeout=60)
    finally:
        worker.stop()
        await asyncio.wait_for(asyncio.shield(run), timeout=60)
        await queue.close()
        await pool.close()
        await proxy.close()

    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    lines = [m for m in messages if m.startswith("could not release")]
    assert len(lines) == 1, messages
    found = re.fullmatch(
        r"could not release (\d+) job\(s\) \(PoolTimeout: [^<>]*\); they return when their"
        r" lease runs out",
        lines[0],
    )
    assert found is not None, lines[0]
    assert int(found[1]) >= 1
    assert stats.released == 0
    # They come back after their lease: a second worker applies every job exactly once.
    direct = await db.open_pool(database_url, max_size=5)
    second_queue = PgQueue(direct, poll_interval_seconds=0.1)
    try:
        second = Worker(app, direct, second_queue, concurrency=3, poll_seconds=0.1)
        await asyncio.wait_for(second.run(until="empty"), timeout=60)
    finally:
        await second_queue.close()
        await direct.close()
    assert await scalar(conn, "SELECT count(*) FROM awards") == JOBS
    assert await scalar(conn, "SELECT count(DISTINCT job_id) FROM awards") == JOBS
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0


def _outage_log(caplog: pytest.LogCaptureFixture, now: list[float]) -> OutageLog:
    """An OutageLog on the clock ``now[0]``, its INFO lines and up captured."""
    caplog.set_level(logging.INFO, logger="jobfence.test")
    return OutageLog(logging.getLogger("jobfence.test"), still_down_every=30, clock=lambda: now[0])


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def test_a_long_outage_logs_still_unreachable_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    outage = _outage_log(caplog, now)
    lost = psycopg.OperationalError("connection refused")
    outage.went_away(lost)
    for _ in range(100):  # a probe every 0.5 s for 50 s, and more jobs cut off
        now[0] += 0.5
        outage.went_away(lost)
        outage.still_down(lost)
    outage.back(released=7)
    assert _messages(caplog) == [
        "database went away (OperationalError: connection refused): pausing; the jobs in hand"
        " go back to the queue when it is back",
        "database still unreachable after 30s (OperationalError: connection refused); retrying",
        "database back after 50.0s, 7 job(s) released: resuming",
    ]


def test_a_broker_outage_is_logged_as_the_broker_going_away_not_the_database(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    outage = _outage_log(caplog, now)
    try:
        try:
            raise ConnectionResetError("Connection reset by peer")
        except ConnectionResetError as cause:
            raise QueueUnavailable("Redis unreachable: Connection reset by peer") from cause
    except QueueUnavailable as exc:
        lost = exc
    outage.went_away(lost)
    now[0] += 31
    outage.still_down(lost)
    outage.back(released=2)
    assert _messages(caplog) == [
        "broker went away (QueueUnavailable: Redis unreachable: Connection reset by peer):"
        " pausing; the jobs in hand go back to the queue when it is back",
        "broker still unreachable after 31s (QueueUnavailable: Redis unreachable: Connection"
        " reset by peer); retrying",
        "broker back after 31.0s, 2 job(s) released: resuming",
    ]


def test_the_reason_names_the_connection_error_never_a_repr() -> None:
    try:
        try:
            raise psycopg.OperationalError("consuming input failed: server closed the connection")
        except psycopg.OperationalError:
            raise psycopg.ProgrammingError(
                "transaction exit at the wrong nesting level: <jobfence.pgtx._Chained (active)"
                " connection=<psycopg.AsyncConnection [BAD] at 0x7f3a2b1c0d90>>"
            ) from None
    except psycopg.ProgrammingError as exc:
        hidden = exc
    hidden.__context__ = psycopg.OperationalError("server closed the connection")
    assert reason(hidden) == "OperationalError: server closed the connection"
    assert (
        reason(psycopg.ProgrammingError("a <psycopg.AsyncConnection [BAD] at 0x7f3a2b1c0d90> :"))
        == "ProgrammingError: a"
    )


async def test_a_relays_database_outage_line_shows_no_password_and_forges_no_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a relay logs when its database cannot be reached quotes the connection's error: the
    connection string's password (here with a newline and a forged log line in it) shows in no
    line, and the outage is one WARNING however many tries fail."""
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    password = "S3cr3t-pw\nWARNING jobfence.worker: forged"
    conninfo = f"postgresql://jf:{quote(password, safe='')}@127.0.0.1:{port}/jobfence"
    caplog.set_level(logging.DEBUG, logger="jobfence.test")
    stopping = asyncio.Event()
    served: list[object] = []

    async def serve(conn: psycopg.AsyncConnection[Any]) -> None:
        served.append(conn)

    async def tried_three_times() -> bool:
        return len([r for r in caplog.records if "unreachable" in r.getMessage()]) >= 2

    task = asyncio.create_task(
        stay_connected(
            conninfo,
            serve,
            who="test relay",
            doing=("paused", "resumed"),
            log=logging.getLogger("jobfence.test"),
            stopping=stopping,
            reconnect_cap_seconds=30.0,
            on_lost=lambda: None,
        )
    )
    try:
        await wait_until(tried_three_times, timeout=15, message="three failed tries")
    finally:
        stopping.set()
        await asyncio.wait_for(task, 10)
    assert not served
    lines = [r.getMessage() for r in caplog.records if r.name == "jobfence.test"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("test relay: database went away (OperationalError: ")
    for line in lines:
        assert "S3cr3t" not in line and "forged" not in line, line
        assert "\n" not in line, line
