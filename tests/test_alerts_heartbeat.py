"""The heartbeats tell the truth: the relay's reports failure (Better Stack's ``/fail``
suffix) while an alert was refused for good or has waited longer than the delivery bound, and
success again once delivery works; the cleanup's reports a failed round as a failure."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from psycopg import AsyncConnection

from alert_helpers import (
    MovableClock,
    RecordingAlertMetrics,
    fast_settings,
    make_relay,
    running,
    wait_for_alerts,
    wait_rounds,
    write_dead_letter,
)
from fake_betterstack import INCIDENTS, FakeBetterStack, respond
from jobfence.adapters.betterstack import BetterStackHeartbeat, HeartbeatOnSuccess
from jobfence.adapters.prometheus import PrometheusCleanupMetrics
from jobfence.alerts import retry_failed_alerts
from jobfence.cleanup import cleanup_every
from support import wait_until, with_dbname


async def beats_after(server: FakeBetterStack, start: int, kind: str, count: int = 2) -> None:
    async def seen() -> bool:
        return server.heartbeat_kinds()[start:].count(kind) >= count

    await wait_until(seen, message=f"{count} heartbeat(s) reporting {kind}")


async def test_a_refused_create_flips_the_heartbeat_to_fail_until_retry_failed_delivers_it(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    heartbeat = BetterStackHeartbeat(server.heartbeat_url("relay"), name="alert relay")
    metrics = RecordingAlertMetrics()
    relay = make_relay(
        database_url,
        server,
        heartbeat=heartbeat,
        metrics=metrics,
        settings=fast_settings(heartbeat_interval_seconds=0.1),
    )
    async with running(relay):
        await beats_after(server, 0, "success")
        server.script("POST", INCIDENTS, [respond(401, {"errors": "Invalid Team API token"})])
        await write_dead_letter(conn, "refused-1")
        await wait_for_alerts(conn, "failed", 1)
        mark = len(server.heartbeats)
        await beats_after(server, mark, "fail", 3)
        assert "success" not in server.heartbeat_kinds()[mark + 1 :], "no success while refused"
        assert metrics.refused[-1] == 1
        assert metrics.heartbeat[-1] is False

        assert await retry_failed_alerts(conn) == 1  # the token was fixed
        await wait_for_alerts(conn, "sent", 1)
        mark = len(server.heartbeats)
        await beats_after(server, mark, "success")
    await heartbeat.aclose()
    assert server.heartbeats[0].path == "/api/v1/heartbeat/relay-secret-token"
    assert {b.path for b in server.heartbeats if b.path.endswith("/fail")} == {
        "/api/v1/heartbeat/relay-secret-token/fail"
    }
    assert metrics.heartbeat[-1] is True
    assert metrics.refused[-1] == 0
    assert "HTTP Request: GET http://127.0.0.1" in caplog.text
    assert "secret-token" not in caplog.text, "the heartbeat URL, /fail too, is never logged"


async def test_an_alert_waiting_longer_than_the_bound_flips_the_heartbeat_to_fail(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    heartbeat = BetterStackHeartbeat(server.heartbeat_url("relay"), name="alert relay")
    clock = MovableClock()
    relay = make_relay(
        database_url,
        server,
        clock=clock,
        heartbeat=heartbeat,
        settings=fast_settings(heartbeat_interval_seconds=0.1, delivery_bound_seconds=600),
    )
    async with running(relay):
        server.script("POST", INCIDENTS, [respond(503)] * 1000)  # Better Stack keeps failing
        await write_dead_letter(conn, "slow-1")
        clock.advance(seconds=1)

        async def retried() -> bool:
            return relay.stats.retried["dead_letters"] >= 1

        await wait_until(retried, message="a failed attempt")
        await wait_rounds(relay, 2)
        assert relay.stats.heartbeat_ok, "within the bound: still success"
        clock.advance(seconds=601)
        mark = len(server.heartbeats)
        await beats_after(server, mark, "fail")
        server.unscript()  # Better Stack answers again
        await wait_for_alerts(conn, "sent", 1, timeout=15)
        mark = len(server.heartbeats)
        await beats_after(server, mark, "success")
    await heartbeat.aclose()


async def test_a_failed_cleanup_round_reports_failure_on_the_cleanup_heartbeat(
    database_url: str, server: FakeBetterStack
) -> None:
    metrics = PrometheusCleanupMetrics()
    heartbeat = BetterStackHeartbeat(server.heartbeat_url("cleanup"), name="cleanup")
    sink = HeartbeatOnSuccess(metrics, heartbeat)
    missing = with_dbname(database_url, "jobfence_no_such_database")
    for conninfo, kind in ((missing, "fail"), (database_url, "success")):
        stop = asyncio.Event()
        task = asyncio.create_task(
            cleanup_every(conninfo, interval_seconds=0.05, stop=stop, metrics=sink)
        )
        start = len(server.heartbeats)
        try:
            await beats_after(server, start, kind, 1)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
        assert set(server.heartbeat_kinds()[start:]) == {kind}
    await sink.aclose()
    assert metrics.failures._value.get() >= 1
