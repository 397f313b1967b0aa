"""Alerting never blocks or fails job processing: with Better Stack unreachable (requests hang
until the client times out), a worker sharing the relay's event loop processes the same batch
as fast as with Better Stack up, and the alerts go out once Better Stack is back."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

import pointsapp
from alert_helpers import (
    alert_rows,
    fast_settings,
    make_relay,
    running,
    sink_for,
    wait_for_alerts,
    write_dead_letter,
)
from fake_betterstack import FakeBetterStack
from jobfence import App, PgQueue, PrometheusMetrics, Worker
from jobfence.alerts import alert_counts
from support import scalar, wait_until
from tcp_proxy import TcpProxy
from test_read_only_database import read_only_switch

JOBS = 80
HARD_EVERY = 8  # 10 of the 80 jobs fail for good


async def run_batch(
    app: App, pool: AsyncConnectionPool[Any], conn: AsyncConnection[Any], prefix: str
) -> float:
    """Enqueue the batch, run a worker until the queue is empty; return the seconds it took."""
    async with conn.transaction():
        for i in range(JOBS):
            mode = "hard" if i % HARD_EVERY == 0 else "ok"
            await app.enqueue(
                conn,
                "award_points",
                {"account_id": 1 + i % 10, "points": 1, "mode": mode},
                job_id=f"{prefix}-{i}",
            )
    metrics = PrometheusMetrics()
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    worker = Worker(app, pool, queue, concurrency=4, poll_seconds=0.05, metrics=metrics)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        stats = await asyncio.wait_for(worker.run(until="empty"), timeout=30)
    finally:
        await queue.close()
    elapsed = loop.time() - started
    hard = JOBS // HARD_EVERY
    assert stats.outcomes == {"succeeded": JOBS - hard, "dead_lettered": hard}, "no job failed"
    return elapsed


async def test_better_stack_unreachable_slows_no_job_and_alerts_arrive_after_recovery(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    relay = make_relay(
        database_url,
        server,
        sink=sink_for(server, timeout_seconds=0.5),
        settings=fast_settings(retry_cap_seconds=0.5),
    )
    async with running(relay):
        with_better_stack_up = await run_batch(app, pool, conn, "up")

        server.down = "stall"  # every request hangs: a black hole, the worst case
        with_better_stack_down = await run_batch(app, pool, conn, "down")

        async def piling_up() -> bool:
            return relay.stats.retried["dead_letters"] >= 3

        await wait_until(piling_up, timeout=15, message="three failed delivery attempts")
        during = await alert_counts(conn)
        assert during.pending >= 1
        assert during.dead_letters_awaiting_alert >= 1

        server.down = None

        async def all_sent() -> bool:
            counts = await alert_counts(conn)
            return counts.pending == 0 and counts.dead_letters_awaiting_alert == 0

        await wait_until(all_sent, timeout=15, message="the alerts to go out after recovery")

    # No slower while Better Stack was down (both runs do the same work on the same loop).
    assert with_better_stack_down <= 1.5 * with_better_stack_up + 0.5, (
        with_better_stack_up,
        with_better_stack_down,
    )
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == 2 * (JOBS - 10)
    rows = await alert_rows(conn)
    assert {r["state"] for r in rows} == {"sent"}
    assert len(rows) == await scalar(conn, "SELECT count(*) FROM jobfence.alert_groups")
    [incident] = server.incident_list()
    assert {r["incident_id"] for r in rows} == {incident["id"]}, "one incident for the key"
    counted = await scalar(conn, "SELECT dead_letters FROM jobfence.alert_incidents")
    assert counted == 20, "every dead letter of both batches is counted on it"
    assert all(len(ids) == 1 for ids in server.by_dedup_key().values())


DATABASE_OUTAGE_SECONDS = 8.0


async def test_the_alert_relay_logs_a_database_outage_as_two_lines_and_resumes_within_seconds(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The relay's database goes away for 8 s (a proxy between them is cut) while a dead letter
    is written: one WARNING when it goes, one INFO when it is back, no line per failed
    reconnect, and the alert goes out within seconds of the database's return. (Reconnecting
    0.5 s doubling to 30 s apart, it went out about 7 s after it.)"""
    caplog.set_level(logging.INFO, logger="jobfence")
    loop = asyncio.get_running_loop()
    async with TcpProxy.for_database(database_url) as proxy:
        relay = make_relay(proxy.url(database_url), server)
        async with running(relay):

            async def active() -> bool:
                return relay.active

            await wait_until(active, message="the relay to be active")
            await proxy.cut()

            async def noticed() -> bool:
                return "alert relay: database went away" in caplog.text

            await wait_until(noticed, message="the relay to notice the outage")
            await write_dead_letter(conn, "during-the-outage")
            await asyncio.sleep(DATABASE_OUTAGE_SECONDS)  # the outage's length is the experiment
            proxy.up()
            back_at = loop.time()
            await wait_for_alerts(conn, "sent", 1, timeout=30)
            recovered = loop.time() - back_at
    lines = [r.getMessage() for r in caplog.records if r.name == "jobfence.alerts"]
    assert len([line for line in lines if "database went away" in line]) == 1, lines
    assert len([line for line in lines if "database back after" in line]) == 1, lines
    assert not [line for line in lines if "database error" in line or "still" in line], lines
    assert recovered < 4.0, recovered
    assert len(server.incident_list()) == 1


async def test_the_alert_relay_pauses_once_on_a_read_only_database_and_alerts_once_writable(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The relay's database becomes read-only (a failover to a standby, its other sessions
    ended) while a dead letter waits for its alert: one WARNING naming it read-only, no line
    per refused try, and the alert goes out once writes work again (the relay drops the
    sessions opened while it refused them)."""
    caplog.set_level(logging.INFO, logger="jobfence")
    relay = make_relay(database_url, server)
    with read_only_switch(database_url, keep=[conn.info.backend_pid]) as switch:
        async with running(relay):

            async def active() -> bool:
                return relay.active

            await wait_until(active, message="the relay to be active")
            switch(True)
            # The test's own session, opened before, still writes: the dead letter and its
            # alert row, which the relay cannot claim (a write) while the database refuses it.
            await write_dead_letter(conn, "during-the-window")

            async def refused() -> bool:
                return "alert relay: database is read-only (" in caplog.text

            await wait_until(refused, timeout=20, message="the relay to find it read-only")
            assert server.incident_list() == []
            switch(False)
            await wait_for_alerts(conn, "sent", 1, timeout=30)
    lines = [r.getMessage() for r in caplog.records if r.name == "jobfence.alerts"]
    went = [line for line in lines if line.startswith("alert relay: database is read-only (")]
    assert len(went) == 1 and "SQLSTATE 25006" in went[0], lines
    assert any("database writable again after" in line for line in lines), lines
    assert not [line for line in lines if "database error" in line], lines
    assert len(server.incident_list()) == 1
