"""No producer can page on-call at will: what a producer chooses never multiplies incidents.

Dead letters for consumers that are not registered share one key per queue; a consumer's error
classes beyond ``max_error_classes`` share one key; beyond ``max_new_incidents`` new incidents
per ``incident_period``, one storm incident counts the rest. Nothing is lost: every dead letter
keeps its row and is counted on exactly one incident, and the collapsed and storm incidents
resolve and escalate like the others.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

from alert_helpers import (
    CONSUMER,
    HARD,
    QUEUE,
    MovableClock,
    alert_rows,
    fast_settings,
    make_relay,
    running,
    sink_for,
    wait_for_alerts,
    wait_rounds,
    write_dead_letter,
)
from fake_betterstack import INCIDENTS, FakeBetterStack, stall
from jobfence import App, HardFailure, JobMeta, Message, PgQueue, Worker, discard_dead_letter
from jobfence.adapters.pg_queue import publish_on
from jobfence.alerts import RelaySettings, alert_counts
from jobfence.config import alert_config_from_env
from jobfence.errors import ConfigError
from support import scalar, wait_until

BOUNDS_QUEUE = "bounds"


class Job(BaseModel):
    n: int
    kind: str


def hostile_app() -> App:
    """One consumer whose jobs fail hard, some with an exception class made at run time."""
    app = App()

    @app.consumer("charge", queue=BOUNDS_QUEUE, schema=Job)
    async def charge(payload: Job, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        if payload.kind == "dynamic":
            raise type(f"Dynamic{payload.n}", (HardFailure,), {})("made at run time")
        raise HardFailure("card declined")

    return app


async def settled(conn: AsyncConnection[Any]) -> bool:
    counts = await alert_counts(conn)
    return counts.pending == 0 and counts.dead_letters_awaiting_alert == 0


async def incidents(conn: AsyncConnection[Any]) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT id, incident_id, scope, queue, consumer, error_class, state, dead_letters,"
        " escalated_at FROM jobfence.alert_incidents ORDER BY id"
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]


async def counted_on(conn: AsyncConnection[Any]) -> dict[int, list[str]]:
    """Each dead letter's incidents: through its outbox row, its group, the group's alert."""
    cur = await conn.execute(
        "SELECT d.id, array_remove(array_agg(a.incident_id), NULL)"
        " FROM core.dead_letters d"
        " LEFT JOIN jobfence.alert_outbox o ON o.dead_letter_id = d.id"
        " LEFT JOIN jobfence.alerts a ON a.group_id = o.group_id AND a.kind = 'dead_letters'"
        " GROUP BY d.id"
    )
    return {row[0]: list(row[1]) for row in await cur.fetchall()}


async def assert_each_dead_letter_counted_once(
    conn: AsyncConnection[Any], server: FakeBetterStack, total: int
) -> list[dict[str, Any]]:
    on = await counted_on(conn)
    assert len(on) == total, "every dead letter keeps its row"
    assert all(len(ids) == 1 for ids in on.values()), on
    rows = await incidents(conn)
    per_incident: dict[str, int] = {}
    for ids in on.values():
        per_incident[ids[0]] = per_incident.get(ids[0], 0) + 1
    assert per_incident == {r["incident_id"]: r["dead_letters"] for r in rows}
    assert sum(r["dead_letters"] for r in rows) == total
    assert {i["id"] for i in server.incident_list()} == set(per_incident)
    return rows


async def test_unknown_consumers_and_error_classes_beyond_five_do_not_multiply_incidents(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
) -> None:
    """The scenario that opened 26 incidents: a 5 s window, 50 hard failures of one group, 20
    jobs for made-up consumers ghost_1..ghost_20 and 5 exception classes made at run time,
    all through a real worker (and two messages whose consumer name cannot be stored). Now:
    one incident for the hard failures, four for the first new classes, one for the classes
    beyond five, one for every unknown consumer of the queue: 7, and each dead letter counted
    on exactly one of them."""
    app = hostile_app()
    for n in range(50):
        await app.enqueue(conn, "charge", {"n": n, "kind": "hard"}, job_id=f"hard-{n}")
    for n in range(5):
        await app.enqueue(conn, "charge", {"n": n, "kind": "dynamic"}, job_id=f"dyn-{n}")
    for n in range(1, 21):
        await publish_on(conn, Message(BOUNDS_QUEUE, f"ghost_{n}", f"ghost-{n}", b"{}"))
    # Names no consumer can have (a line break, 300 characters): kept whole as
    # UnfenceableMessage dead letters, and filed under the same key of the queue.
    for n, name in enumerate(["ghost\nFORGED CRITICAL line", "g" * 300]):
        await conn.execute(
            "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body)"
            " VALUES (%s, %s, %s, %s)",
            (BOUNDS_QUEUE, name, f"unfenceable-{n}", b"{}"),
        )
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    try:
        worker = Worker(app, pool, queue, poll_seconds=0.05)
        stats = await asyncio.wait_for(worker.run(until="empty"), timeout=60)
    finally:
        await queue.close()
    assert stats.outcomes == {"dead_lettered": 55, "poison": 22}

    clock = MovableClock()
    relay = make_relay(
        database_url, server, clock=clock, settings=fast_settings(group_window_seconds=5.0)
    )
    async with running(relay):
        await wait_rounds(relay, 2)
        clock.advance(seconds=6)
        await wait_until(lambda: settled(conn), message="every alert handled")
        await wait_rounds(relay, 2)

    rows = await assert_each_dead_letter_counted_once(conn, server, 77)
    assert len(server.posts()) == 7
    by_scope: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_scope.setdefault(row["scope"], []).append(row)
    assert {scope: len(found) for scope, found in by_scope.items()} == {
        "error_class": 5,
        "other_error_classes": 1,
        "unknown_consumers": 1,
    }
    [unknown] = by_scope["unknown_consumers"]
    assert (unknown["queue"], unknown["consumer"], unknown["dead_letters"]) == (
        BOUNDS_QUEUE,
        "*",
        22,
    )
    [other] = by_scope["other_error_classes"]
    assert (other["consumer"], other["error_class"], other["dead_letters"]) == ("charge", "*", 1)
    assert sorted(r["dead_letters"] for r in by_scope["error_class"]) == [1, 1, 1, 1, 50]
    names = sorted(post.json()["name"] for post in server.posts())
    assert f"jobfence: 22 dead letters on {BOUNDS_QUEUE} (unknown consumers)" in names
    assert f"jobfence: 1 dead letter on {BOUNDS_QUEUE}/charge (other error classes)" in names
    assert not any("ghost_" in name for name in names)


async def storm_scenario(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack, clock: MovableClock
) -> tuple[list[int], Any]:
    """Eight error classes of eight consumers (no collapse applies), cap 3 per 10 minutes."""
    written: list[int] = []
    for n in range(8):
        for m in range(n + 1):
            dead_letter_id = await write_dead_letter(
                conn, f"storm-{n}-{m}", consumer=f"consumer_{n}", error_class=f"Error{n}"
            )
            assert dead_letter_id is not None
            written.append(dead_letter_id)
    relay = make_relay(
        database_url,
        server,
        clock=clock,
        settings=fast_settings(
            group_window_seconds=1.0, max_new_incidents=3, update_interval_seconds=60.0
        ),
    )
    return written, relay


async def test_beyond_the_cap_of_new_incidents_one_storm_incident_counts_the_rest(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
) -> None:
    clock = MovableClock()
    written, relay = await storm_scenario(database_url, conn, server, clock)
    async with running(relay):
        clock.advance(seconds=2)
        await wait_until(lambda: settled(conn), message="every alert handled")
        total = len(written)
        rows = await assert_each_dead_letter_counted_once(conn, server, total)
        assert [r["scope"] for r in rows] == ["error_class"] * 3 + ["storm"]
        storm = rows[3]
        assert storm["dead_letters"] == total - sum(r["dead_letters"] for r in rows[:3])
        [storm_post] = [p for p in server.posts() if "alert storm" in p.json()["name"]]
        body = storm_post.json()
        assert body["name"] == "jobfence: alert storm: over 3 new incidents in 10m"
        assert "3 incidents opened in the last 10m (the cap is 3)" in body["summary"]
        assert body["metadata"]["scope"][0]["value"] == "storm"

        # Within the period, a new key is counted on the storm: no page.
        late = await write_dead_letter(conn, "late-1", consumer="consumer_late", error_class="Late")
        assert late is not None
        written.append(late)
        clock.advance(seconds=2)
        await wait_until(lambda: settled(conn), message="the late alert handled")
        assert len(server.posts()) == 4

        # The storm's count is reported, with its largest keys.
        clock.advance(seconds=61)
        await wait_until(
            lambda: _has_comment(server, storm["incident_id"]), message="the storm's update"
        )
        comment = server.comments[storm["incident_id"]][-1]
        assert comment.startswith(
            f"jobfence: alert storm: {storm['dead_letters'] + 1} dead letters counted here"
        )
        assert "Largest keys:\n- queue loyalty, consumer consumer_" in comment
        assert "consumer consumer_late, error class Late: 1 dead letter in 1 group" in comment

        # Once a whole period passes without a storm alert, new incidents open again.
        clock.advance(seconds=601)
        again = await write_dead_letter(conn, "after-1", consumer="consumer_new", error_class="New")
        assert again is not None
        written.append(again)
        clock.advance(seconds=2)
        await wait_until(lambda: settled(conn), message="the alert after the storm")
        assert len(server.posts()) == 5
        await assert_each_dead_letter_counted_once(conn, server, len(written))

        # Resolving every dead letter resolves every incident, the storm's included.
        for dead_letter_id in written:
            await discard_dead_letter(pool, dead_letter_id, reason="handled", resolved_by="ops")

        async def all_resolved() -> bool:
            return {r["state"] for r in await incidents(conn)} == {"resolved"}

        await wait_until(all_resolved, message="every incident resolved")
    assert server.state(storm["incident_id"]) == "resolved_by_api"
    assert relay.stats.storms == 1


def _has_comment(server: FakeBetterStack, incident_id: str) -> Any:
    async def check() -> bool:
        return bool(server.comments.get(incident_id))

    return check()


async def test_a_storm_incident_stays_open_while_one_of_its_dead_letters_is_pending_and_escalates(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
) -> None:
    clock = MovableClock()
    _written, relay = await storm_scenario(database_url, conn, server, clock)
    async with running(relay):
        clock.advance(seconds=2)
        await wait_until(lambda: settled(conn), message="every alert handled")
        rows = await incidents(conn)
        storm = rows[-1]
        assert storm["scope"] == "storm"
        on = await counted_on(conn)
        storm_ids = [dl for dl, ids in on.items() if ids == [storm["incident_id"]]]
        for dead_letter_id in storm_ids[:-1]:
            await discard_dead_letter(pool, dead_letter_id, reason="handled", resolved_by="ops")
        await wait_rounds(relay, 3)
        assert server.state(storm["incident_id"]) == "open", "one is still pending"

        # D4: the groups counted on the storm escalate it, once; no new incident opens.
        clock.advance(hours=73)
        await wait_until(
            lambda: _escalated(server, storm["incident_id"]), message="the storm escalated"
        )
        await wait_rounds(relay, 3)
        assert len(server.posts()) == 4
        assert len(server.escalations[storm["incident_id"]]) == 1

        await discard_dead_letter(pool, storm_ids[-1], reason="handled", resolved_by="ops")

        async def storm_resolved() -> bool:
            return server.state(storm["incident_id"]) == "resolved_by_api"

        await wait_until(storm_resolved, message="the storm resolved")
    escalations = [r for r in await alert_rows(conn) if r["kind"] == "escalation"]
    assert escalations and all(r["state"] in ("sent", "cancelled") for r in escalations)
    assert len(server.posts()) == 4


def _escalated(server: FakeBetterStack, incident_id: str) -> Any:
    async def check() -> bool:
        return bool(server.escalations.get(incident_id))

    return check()


async def test_a_class_gets_its_own_incident_again_once_a_slot_is_free(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
) -> None:
    """A consumer's classes count while they have a dead letter pending review: once one is
    resolved, the next new class gets an incident of its own."""
    clock = MovableClock()
    relay = make_relay(
        database_url,
        server,
        clock=clock,
        settings=fast_settings(group_window_seconds=1.0, max_error_classes=2),
    )
    written = [
        await write_dead_letter(conn, f"c{n}", error_class=name)
        for n, name in enumerate(["First", "Second", "Third"])
    ]
    first = written[0]
    assert first is not None
    async with running(relay):
        clock.advance(seconds=2)
        await wait_until(lambda: settled(conn), message="every alert handled")
        assert sorted(r["error_class"] for r in await incidents(conn)) == ["*", "First", "Second"]
        await discard_dead_letter(pool, first, reason="handled", resolved_by="ops")
        written.append(await write_dead_letter(conn, "c4", error_class="Fourth"))
        clock.advance(seconds=2)
        await wait_until(lambda: settled(conn), message="the fourth handled")
        keys = [(r["error_class"], r["state"]) for r in await incidents(conn)]
        assert ("Fourth", "open") in keys
        assert ("*", "open") in keys, "Third still pending: its collapsed incident stays open"

        # The collapsed incident resolves like any other once its dead letters are handled.
        for dead_letter_id in written[1:]:
            assert dead_letter_id is not None
            await discard_dead_letter(pool, dead_letter_id, reason="handled", resolved_by="ops")

        async def all_resolved() -> bool:
            return {r["state"] for r in await incidents(conn)} == {"resolved"}

        await wait_until(all_resolved, message="every incident resolved")
    assert len(server.calls("resolve")) == 4
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 4
    assert all(r["consumer"] == CONSUMER and r["queue"] == QUEUE for r in await incidents(conn))
    assert HARD not in {r["error_class"] for r in await incidents(conn)}


async def test_messages_the_relay_could_not_publish_share_one_incident_per_queue(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    """A message the broker refused for good (or that kept failing) names a consumer no worker
    has checked: ten made-up names on one queue open one incident, counting all ten."""
    clock = MovableClock()
    relay = make_relay(
        database_url, server, clock=clock, settings=fast_settings(group_window_seconds=1.0)
    )
    for n in range(10):
        error_class = "PublishRefused" if n % 2 else "PublishFailed"
        await write_dead_letter(conn, f"p{n}", consumer=f"ghost_{n}", error_class=error_class)
    async with running(relay):
        clock.advance(seconds=2)
        await wait_until(lambda: settled(conn), message="every alert handled")
    rows = await incidents(conn)
    assert [(r["queue"], r["consumer"], r["error_class"]) for r in rows] == [(QUEUE, "*", "*")]
    assert rows[0]["scope"] == "unknown_consumers"
    assert rows[0]["dead_letters"] == 10
    assert len(server.posts()) == 1


async def test_a_storm_incident_whose_create_answer_was_lost_is_found_and_kept_as_the_storm(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    """The storm decision is committed before its request: the attempt after a lost answer
    looks the dedup key up and records the incident it finds as the storm, so the next key is
    counted on it instead of opening another."""
    server.script("POST", INCIDENTS, [stall(0.0), stall(1.0)])
    await write_dead_letter(conn, "a-1", error_class="A")
    await write_dead_letter(conn, "b-1", error_class="B")
    clock = MovableClock()
    relay = make_relay(
        database_url,
        server,
        clock=clock,
        sink=sink_for(server, timeout_seconds=0.3),
        settings=fast_settings(
            group_window_seconds=1.0, max_new_incidents=1, lost_answer_wait_seconds=0.3 + 1.5
        ),
    )
    async with running(relay):
        clock.advance(seconds=2)
        await wait_for_alerts(conn, "sent", 2, timeout=20)
        await write_dead_letter(conn, "c-1", error_class="C")
        clock.advance(seconds=2)
        await wait_for_alerts(conn, "sent", 3, timeout=20)
    assert [r["scope"] for r in await incidents(conn)] == ["error_class", "storm"]
    assert len(server.incident_list()) == 2, "no second storm incident"
    outcomes = sorted(r["outcome"] for r in await alert_rows(conn))
    assert outcomes == ["found", "merged", "opened"]
    assert await scalar(conn, "SELECT count(*) FROM jobfence.alerts WHERE storm") == 1
    await assert_each_dead_letter_counted_once(conn, server, 3)


def test_the_bounds_are_configured_by_environment_and_checked() -> None:
    config = alert_config_from_env(
        {
            "JOBFENCE_ALERT_MAX_ERROR_CLASSES": "3",
            "JOBFENCE_ALERT_MAX_NEW_INCIDENTS": "20",
            "JOBFENCE_ALERT_INCIDENT_PERIOD": "1h",
        }
    )
    assert (config.max_error_classes, config.max_new_incidents) == (3, 20)
    assert config.incident_period_seconds == 3600.0
    defaults = alert_config_from_env({})
    assert (defaults.max_error_classes, defaults.max_new_incidents) == (5, 10)
    assert defaults.incident_period_seconds == 600.0
    for name, value in (
        ("JOBFENCE_ALERT_MAX_ERROR_CLASSES", "0"),
        ("JOBFENCE_ALERT_MAX_NEW_INCIDENTS", "ten"),
        ("JOBFENCE_ALERT_MAX_NEW_INCIDENTS", "²"),
        ("JOBFENCE_ALERT_INCIDENT_PERIOD", "-1m"),
    ):
        with pytest.raises(ConfigError, match=name):
            alert_config_from_env({name: value})
    with pytest.raises(ConfigError, match="max_new_incidents"):
        RelaySettings(max_new_incidents=0)
