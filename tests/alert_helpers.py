"""Helpers shared by the alert tests: dead letters written the way the harness writes them, a
relay against the fake Better Stack, a movable clock, and a recording metrics sink."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection

from fake_betterstack import FakeBetterStack
from jobfence.adapters.betterstack import BetterStackIncidents, BetterStackSettings
from jobfence.alerts import AlertRelay, RelaySettings, record_dead_letter_alerts
from jobfence.harness import SQL as CORE_SQL
from support import scalar, wait_until

TOKEN = "bst-test-token-7f3a"
QUEUE = "loyalty"
CONSUMER = "award_points"
HARD = "jobfence.HardFailure"
TESTS_DIR = Path(__file__).parent


class MovableClock:
    """Real time plus an offset the test moves forward (windows and escalations come due)."""

    def __init__(self) -> None:
        self.offset = timedelta(0)

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset

    def advance(self, **delta: float) -> None:
        self.offset += timedelta(**delta)


@dataclass
class RecordingAlertMetrics:
    """An AlertMetricsSink that remembers what it heard."""

    sent: Counter[str] = field(default_factory=Counter)
    failed: Counter[tuple[str, str]] = field(default_factory=Counter)
    pending: list[int] = field(default_factory=list)
    incidents: Counter[str] = field(default_factory=Counter)
    refused: list[int] = field(default_factory=list)
    heartbeat: list[bool] = field(default_factory=list)

    def alert_sent(self, kind: str) -> None:
        self.sent[kind] += 1

    def alert_failed(self, kind: str, reason: str) -> None:
        self.failed[kind, reason] += 1

    def alerts_pending(self, count: int) -> None:
        self.pending.append(count)

    def incident_action(self, action: str) -> None:
        self.incidents[action] += 1

    def alerts_refused(self, count: int) -> None:
        self.refused.append(count)

    def heartbeat_state(self, ok: bool) -> None:
        self.heartbeat.append(ok)


def fast_settings(**overrides: Any) -> RelaySettings:
    values: dict[str, Any] = {
        "group_window_seconds": 0.3,
        "poll_seconds": 0.05,
        "retry_base_seconds": 0.2,
        "retry_cap_seconds": 2.0,
        "heartbeat_interval_seconds": 0.0,
        "lost_answer_wait_seconds": 0.5,
        "state_max_age_seconds": 0.2,
    }
    values.update(overrides)
    return RelaySettings(**values)


def sink_for(server: FakeBetterStack, **overrides: Any) -> BetterStackIncidents:
    values: dict[str, Any] = {"token": TOKEN, "api_url": server.base_url, "timeout_seconds": 2.0}
    values.update(overrides)
    return BetterStackIncidents(BetterStackSettings(**values))


@contextlib.asynccontextmanager
async def running(relay: AlertRelay) -> AsyncIterator[AlertRelay]:
    """The relay as an embedded asyncio task for the duration of the block."""
    task = asyncio.create_task(relay.run())
    try:
        yield relay
    finally:
        relay.stop()
        await asyncio.wait_for(task, timeout=15)


def make_relay(
    database_url: str,
    server: FakeBetterStack,
    *,
    settings: RelaySettings | None = None,
    sink: BetterStackIncidents | None = None,
    **kwargs: Any,
) -> AlertRelay:
    kwargs.setdefault("rng", random.Random(7))
    return AlertRelay(
        database_url,
        sink if sink is not None else sink_for(server),
        settings=settings if settings is not None else fast_settings(),
        **kwargs,
    )


async def write_dead_letter(
    conn: AsyncConnection[Any],
    job_id: str,
    *,
    queue: str = QUEUE,
    consumer: str = CONSUMER,
    error_class: str = HARD,
    traceparent: str | None = None,
) -> int | None:
    """What the harness's dead-letter write does: the insert and, when it inserted a row, the
    outbox record, in one transaction. Returns the dead letter's id (None: already pending)."""
    async with conn.transaction():
        cur = await conn.execute(
            CORE_SQL["dead_letter_insert"],
            {
                "job_id": job_id,
                "queue": queue,
                "consumer": consumer,
                "tenant_id": "tenant-1",
                "payload": json.dumps({"account_id": 1, "points": 5}),
                "payload_encoding": "json",
                "attempts": 1,
                "last_error": f"{error_class}: account is closed\nTraceback ...",
                "error_class": error_class,
                "correlation_id": f"corr-{job_id}",
                "traceparent": traceparent,
            },
        )
        row = await cur.fetchone()
        if row is None:
            return None
        await record_dead_letter_alerts(conn, [row[0]])
        return int(row[0])


async def bulk_dead_letters(
    conn: AsyncConnection[Any], count: int, groups: Sequence[tuple[str, str, str]]
) -> list[int]:
    """``count`` dead letters spread round-robin over ``groups`` (queue, consumer, class),
    inserted set-based, with their outbox rows recorded in the same transaction."""
    async with conn.transaction():
        cur = await conn.execute(
            """
            INSERT INTO core.dead_letters (job_id, queue, consumer, tenant_id, payload, attempts,
                                           last_error, error_class, correlation_id)
            SELECT 'bulk-' || n,
                   (%(queues)s::text[])[(n %% %(groups)s)::int + 1],
                   (%(consumers)s::text[])[(n %% %(groups)s)::int + 1],
                   'tenant-1', jsonb_build_object('n', n), 1,
                   (%(classes)s::text[])[(n %% %(groups)s)::int + 1] || ': burst',
                   (%(classes)s::text[])[(n %% %(groups)s)::int + 1],
                   'corr-bulk-' || n
            FROM generate_series(0, %(count)s - 1) AS n
            RETURNING id
            """,
            {
                "count": count,
                "groups": len(groups),
                "queues": [g[0] for g in groups],
                "consumers": [g[1] for g in groups],
                "classes": [g[2] for g in groups],
            },
        )
        ids = [row[0] for row in await cur.fetchall()]
        await record_dead_letter_alerts(conn, ids)
    return ids


async def alert_rows(conn: AsyncConnection[Any]) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT id, group_id, kind, state, attempts, incident_id, dead_letters, last_error,"
        " dedup_key, outcome FROM jobfence.alerts ORDER BY id"
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]


async def wait_for_alerts(
    conn: AsyncConnection[Any], state: str, count: int, *, timeout: float = 10.0
) -> None:
    async def reached() -> bool:
        n = await scalar(conn, "SELECT count(*) FROM jobfence.alerts WHERE state = %s", (state,))
        return int(n) >= count

    await wait_until(reached, timeout=timeout, message=f"{count} alert(s) {state}")


async def wait_rounds(relay: AlertRelay, rounds: int = 3, *, timeout: float = 10.0) -> None:
    """Let the relay run ``rounds`` more complete rounds."""
    target = relay.stats.rounds + rounds

    async def done() -> bool:
        return relay.stats.rounds >= target

    await wait_until(done, timeout=timeout, message=f"{rounds} relay rounds")


def relay_env(database_url: str, server: FakeBetterStack, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "JOBFENCE_DATABASE_URL": database_url,
        "JOBFENCE_BETTERSTACK_TOKEN": TOKEN,
        "JOBFENCE_BETTERSTACK_API_URL": server.base_url,
        "JOBFENCE_BETTERSTACK_REQUESTER_EMAIL": "oncall@example.com",
        "JOBFENCE_ALERT_GROUP_WINDOW": "0.2",
        # A lost attempt is looked up once it is older than the timeout plus 5 s.
        "JOBFENCE_BETTERSTACK_TIMEOUT": "2",
        "PYTHONUNBUFFERED": "1",
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    env.update(extra)
    return env
