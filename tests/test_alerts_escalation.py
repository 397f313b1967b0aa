"""D4: a dead letter still pending_review after escalate_after (default 72 h) raises one
escalation alert, once per group, and never for a group whose dead letters were all replayed
or discarded. The relay's clock is moved by hand instead of waiting 72 hours."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from alert_helpers import (
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
from fake_betterstack import FakeBetterStack
from jobfence import PgQueue, discard_dead_letter, replay_dead_letter
from jobfence.alerts import RelaySettings
from support import scalar, wait_until


def value(post_body: dict[str, Any], key: str) -> str:
    return str(post_body["metadata"][key][0]["value"])


async def test_a_group_still_pending_after_escalate_after_escalates_once_never_when_resolved(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
) -> None:
    assert RelaySettings().escalate_after_seconds == 72 * 3600, "the default of D4"
    ids: dict[str, list[int]] = {}
    for group in ("Untouched", "AllResolved", "HalfResolved"):
        for n in range(2):
            dead_letter_id = await write_dead_letter(conn, f"{group}-{n}", error_class=group)
            assert dead_letter_id is not None
            ids.setdefault(group, []).append(dead_letter_id)
    clock = MovableClock()
    relay = make_relay(
        database_url, server, clock=clock, settings=fast_settings(group_window_seconds=1.0)
    )
    queue = PgQueue(pool)
    try:
        async with running(relay):
            clock.advance(seconds=2)
            await wait_for_alerts(conn, "sent", 3)

            await discard_dead_letter(
                pool, ids["AllResolved"][0], reason="duplicate order", resolved_by="ops"
            )
            await replay_dead_letter(pool, queue, ids["AllResolved"][1], resolved_by="ops")
            await discard_dead_letter(
                pool, ids["HalfResolved"][0], reason="test account", resolved_by="ops"
            )

            clock.advance(hours=71)
            await wait_rounds(relay)
            assert len(server.posts()) == 3, "not due before 72 h"

            clock.advance(hours=2)
            await wait_for_alerts(conn, "sent", 5)
            await wait_rounds(relay)

            clock.advance(hours=200)  # long after: still once per group
            await wait_rounds(relay)
    finally:
        await queue.close()

    assert len(server.posts()) == 3, "escalation opens no new incident while one is open"
    incident_of = {
        i["attributes"]["metadata"]["error_class"][0]["value"]: i["id"]
        for i in server.incident_list()
    }
    assert set(server.escalations) == {incident_of["Untouched"], incident_of["HalfResolved"]}
    for bodies in server.escalations.values():
        assert bodies == [
            {
                "escalation_type": "Organization",
                "call": False,
                "sms": False,
                "email": True,
                "push": True,
            }
        ], "escalated once, through the documented endpoint"
    assert server.state(incident_of["AllResolved"]) == "resolved_by_api"
    assert server.state(incident_of["Untouched"]) == "open"
    rows = await alert_rows(conn)
    assert sorted(r["kind"] for r in rows) == ["dead_letters"] * 3 + ["escalation"] * 2
    escalations = [r for r in rows if r["kind"] == "escalation"]
    assert {r["incident_id"] for r in escalations} == set(server.escalations)
    assert {r["outcome"] for r in escalations} == {"escalated"}
    assert (
        await scalar(conn, "SELECT count(*) FROM jobfence.alert_groups WHERE escalation_decided")
        == 3
    )
    assert relay.stats.sent == {"dead_letters": 3, "escalation": 2}
    assert relay.stats.escalated == 2


async def test_an_escalation_whose_dead_letters_were_resolved_before_it_went_out_is_cancelled(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
) -> None:
    dead_letter_id = await write_dead_letter(conn, "late-1")
    assert dead_letter_id is not None
    clock = MovableClock()
    relay = make_relay(database_url, server, clock=clock)
    async with running(relay):
        clock.advance(seconds=1)
        await wait_for_alerts(conn, "sent", 1)
        server.down = "drop"  # Better Stack is down when the escalation comes due
        clock.advance(hours=73)

        async def escalation_waiting() -> bool:
            return relay.stats.retried["escalation"] >= 1

        await wait_until(escalation_waiting, message="the escalation to fail once")
        await discard_dead_letter(pool, dead_letter_id, reason="handled by hand", resolved_by="ops")
        server.down = None
        await wait_for_alerts(conn, "cancelled", 1)
    assert len(server.incident_list()) == 1, "only the first alert"
    assert relay.stats.cancelled == {"escalation": 1}


async def test_escalation_turned_off_never_escalates(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    await write_dead_letter(conn, "off-1")
    clock = MovableClock()
    relay = make_relay(
        database_url, server, clock=clock, settings=fast_settings(escalate_after_seconds=None)
    )
    async with running(relay):
        clock.advance(seconds=1)
        await wait_for_alerts(conn, "sent", 1)
        clock.advance(hours=1000)
        await wait_rounds(relay)
    assert len(server.posts()) == 1


async def test_escalation_escalates_the_open_incident_through_the_documented_endpoint(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    await write_dead_letter(conn, "e1")
    clock = MovableClock()
    sink = sink_for(server, policy_id="4711", requester_email="oncall@example.com")
    relay = make_relay(database_url, server, clock=clock, sink=sink)
    async with running(relay):
        clock.advance(seconds=1)
        await wait_for_alerts(conn, "sent", 1)
        [incident] = server.incident_list()
        server.acknowledge_by_person(incident["id"])  # acknowledged: still open
        clock.advance(hours=73)
        await wait_for_alerts(conn, "sent", 2)
        await wait_rounds(relay)
    await sink.aclose()
    assert len(server.posts()) == 1, "no new incident"
    [call] = server.calls("escalate")
    assert call.path == f"/api/v3/incidents/{incident['id']}/escalate"
    assert call.status == 200
    assert call.json() == {
        "escalation_type": "Policy",
        "policy_id": 4711,
        "call": False,
        "sms": False,
        "email": True,
        "push": True,
    }
    escalation = (await alert_rows(conn))[1]
    assert (escalation["kind"], escalation["outcome"], escalation["incident_id"]) == (
        "escalation",
        "escalated",
        incident["id"],
    )
    assert await scalar(conn, "SELECT escalated_at IS NOT NULL FROM jobfence.alert_incidents")


async def test_escalation_after_a_person_resolved_the_incident_with_dead_letters_pending_opens_one(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    await write_dead_letter(conn, "p1")
    await write_dead_letter(conn, "p2")
    clock = MovableClock()
    relay = make_relay(database_url, server, clock=clock)
    async with running(relay):
        clock.advance(seconds=1)
        await wait_for_alerts(conn, "sent", 1)
        [incident] = server.incident_list()
        server.resolve_by_person(incident["id"], "bob@example.com")  # but nothing was replayed
        clock.advance(hours=73)
        await wait_for_alerts(conn, "sent", 2)
        await wait_rounds(relay)
        clock.advance(hours=200)
        await wait_rounds(relay)
    assert server.calls("escalate") == [], "a resolved incident is not escalated"
    _, second = server.posts()
    body = second.json()
    assert value(body, "jobfence_alert") == "escalation"
    assert value(body, "dead_letters") == "2"
    assert body["name"].startswith("jobfence: 2 dead letters still pending review after 72h")
    rows = await alert_rows(conn)
    assert [(r["kind"], r["outcome"]) for r in rows] == [
        ("dead_letters", "opened"),
        ("escalation", "opened"),
    ], "once per group"
    cur = await conn.execute(
        "SELECT incident_id, state, resolution FROM jobfence.alert_incidents ORDER BY id"
    )
    new_id = server.incident_list()[1]["id"]
    assert await cur.fetchall() == [
        (incident["id"], "resolved", "person"),
        (new_id, "open", None),
    ], "the new incident is the key's open one (it resolves when the dead letters are)"


async def test_groups_merged_into_one_incident_escalate_it_once(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    clock = MovableClock()
    relay = make_relay(database_url, server, clock=clock)
    async with running(relay):
        for n in range(3):  # three windows, one incident
            await write_dead_letter(conn, f"w{n}")
            clock.advance(seconds=1)
            await wait_for_alerts(conn, "sent", n + 1)
        clock.advance(hours=73)
        await wait_for_alerts(conn, "sent", 6)
        await wait_rounds(relay)
    [incident] = server.incident_list()
    assert len(server.escalations[incident["id"]]) == 1, "one escalate call per incident"
    rows = await alert_rows(conn)
    assert [r["outcome"] for r in rows if r["kind"] == "escalation"] == ["escalated"] * 3
    assert relay.stats.escalated == 1


async def test_an_escalate_refused_because_a_person_just_resolved_it_opens_a_new_incident(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    await write_dead_letter(conn, "j1")
    clock = MovableClock()
    # What the relay knows of the state is never out of date here: only the escalate's 409
    # tells it that a person resolved the incident in between.
    relay = make_relay(
        database_url, server, clock=clock, settings=fast_settings(state_max_age_seconds=3e8)
    )
    async with running(relay):
        clock.advance(seconds=1)
        await wait_for_alerts(conn, "sent", 1)
        [incident] = server.incident_list()
        server.resolve_by_person(incident["id"])
        clock.advance(hours=73)
        await wait_for_alerts(conn, "sent", 2)
    [refused] = server.calls("escalate")
    assert refused.status == 409
    assert len(server.incident_list()) == 2, "the escalation opened a new incident"
    assert [r["outcome"] for r in await alert_rows(conn)] == ["opened", "opened"]
