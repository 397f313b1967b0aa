"""A burst of 10,000 dead letters across 3 groups opens 3 incidents, each stating its count.

One dead letter per group goes through the real harness (a hard failure, a schema-invalid
payload, a message for a consumer that does not exist); the other 9,997 are inserted
set-based, with their outbox rows recorded by the same function in the same transaction.
"""

from __future__ import annotations

import asyncio
from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

import pointsapp
from alert_helpers import (
    CONSUMER,
    HARD,
    QUEUE,
    MovableClock,
    bulk_dead_letters,
    fast_settings,
    make_relay,
    running,
    wait_for_alerts,
    wait_rounds,
)
from fake_betterstack import FakeBetterStack
from jobfence import Message, PgQueue, PrometheusMetrics, Worker
from jobfence.adapters.pg_queue import publish_on
from jobfence.alerts import alert_counts
from support import scalar, wait_until

GROUPS = [
    (QUEUE, CONSUMER, HARD),
    (QUEUE, CONSUMER, "SchemaInvalid"),
    (QUEUE, "ghost", "UnknownConsumer"),
]
TOTAL = 10_000


async def test_a_burst_of_10000_dead_letters_across_3_groups_opens_3_incidents(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    clock = MovableClock()
    relay = make_relay(
        database_url, server, clock=clock, settings=fast_settings(group_window_seconds=30)
    )
    async with running(relay):
        await app.enqueue(
            conn, "award_points", {"account_id": 1, "points": 1, "mode": "hard"}, job_id="h-1"
        )
        await publish_on(conn, Message(QUEUE, CONSUMER, "p-1", b'{"account_id": 0, "points": 1}'))
        await publish_on(conn, Message(QUEUE, "ghost", "g-1", b"{}"))
        metrics = PrometheusMetrics()
        queue = PgQueue(pool, poll_interval_seconds=0.05)
        try:
            worker = Worker(app, pool, queue, poll_seconds=0.05, metrics=metrics)
            stats = await asyncio.wait_for(worker.run(until="empty"), timeout=20)
        finally:
            await queue.close()
        assert stats.outcomes == {"dead_lettered": 1, "poison": 2}

        async def three_groups_open() -> bool:
            return (
                await scalar(
                    conn, "SELECT count(*) FROM jobfence.alert_groups WHERE closed_at IS NULL"
                )
                == 3
            )

        await wait_until(three_groups_open, message="the relay to open the three groups")
        ids = await bulk_dead_letters(conn, TOTAL - 3, GROUPS)
        assert len(ids) == TOTAL - 3
        await wait_rounds(relay, 3)
        assert server.posts() == [], "nothing goes out while the window is open"

        clock.advance(seconds=31)  # every window is over
        await wait_for_alerts(conn, "sent", 3, timeout=20)
        await wait_rounds(relay, 3)

    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == TOTAL
    posts = server.posts()
    assert len(posts) == 3
    stated = {}
    for post in posts:
        body = post.json()
        key = tuple(body["metadata"][k][0]["value"] for k in ("queue", "consumer", "error_class"))
        count = int(body["metadata"]["dead_letters"][0]["value"])
        assert body["summary"].startswith(f"{count} dead letters on queue {key[0]}")
        stated[key] = count
    # Dead letters for unknown consumers share their queue's one key, whatever the name.
    assert stated == {GROUPS[0]: 3334, GROUPS[1]: 3333, (QUEUE, "*", "*"): 3333}
    assert sum(stated.values()) == TOTAL
    counts = await alert_counts(conn)
    assert (counts.sent, counts.pending, counts.dead_letters_awaiting_alert) == (3, 0, 0)
    assert relay.stats.sent == {"dead_letters": 3}
