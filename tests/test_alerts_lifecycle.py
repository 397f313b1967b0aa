"""The alert lifecycle against the fake Better Stack, which models incident state (open,
acknowledged, resolved by a person, resolved through the API by us) and refuses what the
documented API refuses.

One unresolved incident per (queue, consumer, error_class): later groups are counted on it and
reported as rate-limited comments; a person's resolve makes the next dead letter open a new
one; replaying or discarding the last pending dead letter resolves it; a lost create is looked
up only once it is surely over. The relay's clock is moved by hand (windows of a minute, a
state freshness of a minute, one update per ten minutes: the defaults).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from alert_helpers import (
    TOKEN,
    MovableClock,
    RecordingAlertMetrics,
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
from jobfence import PgQueue, discard_dead_letter, replay_dead_letter
from jobfence.adapters.prometheus import PrometheusAlertMetrics
from jobfence.alerts import alert_counts
from jobfence.alerts.relay import RESOLVED_BY, AlertRelay
from support import scalar, wait_until


def minute_settings(**overrides: Any) -> Any:
    """The production pacing (one-minute windows and freshness, ten-minute updates)."""
    values: dict[str, Any] = {
        "group_window_seconds": 60.0,
        "state_max_age_seconds": 60.0,
        "update_interval_seconds": 600.0,
    }
    values.update(overrides)
    return fast_settings(**values)


async def incident_rows(conn: AsyncConnection[Any]) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT id, incident_id, state, dead_letters, reported_dead_letters, updates,"
        " resolved_at, resolved_by, resolution, escalated_at, resolve_attempts"
        " FROM jobfence.alert_incidents ORDER BY id"
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]


async def settle(conn: AsyncConnection[Any], relay: AlertRelay) -> None:
    """Until every dead letter written so far is grouped and its alert handled."""

    async def handled() -> bool:
        counts = await alert_counts(conn)
        return counts.pending == 0 and counts.dead_letters_awaiting_alert == 0

    await wait_until(handled, timeout=10, message="every alert handled")
    await wait_rounds(relay, 1)


# -- the fake is strict -----------------------------------------------------------------------


def test_the_fake_refuses_wrong_shapes_as_the_documented_api_does(
    server: FakeBetterStack,
) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = server.base_url
    good = {"summary": "s", "name": "n", "email": True, "metadata": {"k": "v"}}
    wrong = [
        ({**good, "summery": "typo"}, "Unknown parameter: summery"),
        ({**good, "email": "yes"}, "email must be of type bool"),
        ({**good, "team_wait": True}, "team_wait must be of type int"),
        ({**good, "metadata": {"k": [{"value": "v"}]}}, "metadata[k] must be a string or a list"),
        ({**good, "summary": " "}, "Summary can't be blank"),
    ]
    for body, message in wrong:
        answer = httpx.post(f"{url}{INCIDENTS}", json=body, headers=auth, timeout=5)
        assert answer.status_code == 422, body
        assert message in json.dumps(answer.json()["errors"]), answer.json()
    assert server.incident_list() == [], "nothing refused was stored"

    created = httpx.post(f"{url}{INCIDENTS}", json=good, headers=auth, timeout=5)
    assert created.status_code == 201
    incident = created.json()["data"]["id"]
    base = f"{url}{INCIDENTS}/{incident}"
    for path, body, message in [
        ("escalate", {}, "escalation_type must be one of"),
        ("escalate", {"escalation_type": "Policy"}, "policy_id required"),
        ("escalate", {"escalation_type": "Policy", "policy_id": "7"}, "policy_id must be"),
        ("resolve", {"resolved_by": 5}, "resolved_by must be of type str"),
        ("resolve", {"who": "me"}, "Unknown parameter: who"),
    ]:
        answer = httpx.post(f"{base}/{path}", json=body, headers=auth, timeout=5)
        assert answer.status_code == 422, (path, body)
        assert message in json.dumps(answer.json()["errors"])
    comment = httpx.post(
        f"{url}/api/v2/incidents/{incident}/comments", json={"text": "x"}, headers=auth, timeout=5
    )
    assert comment.status_code == 422
    assert server.state(incident) == "open", "nothing refused changed the incident"
    assert server.escalations == {} and server.comments == {}
    missing = httpx.get(f"{url}{INCIDENTS}/999999", headers=auth, timeout=5)
    assert missing.status_code == 404


def test_the_fake_models_incident_state(server: FakeBetterStack) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = server.base_url

    def create() -> str:
        answer = httpx.post(f"{url}{INCIDENTS}", json={"summary": "s"}, headers=auth, timeout=5)
        return str(answer.json()["data"]["id"])

    by_person, by_api = create(), create()
    assert server.state(by_person) == "open"
    server.acknowledge_by_person(by_person)
    assert server.state(by_person) == "acknowledged"
    server.resolve_by_person(by_person, "bob@example.com")
    assert server.state(by_person) == "resolved_by_person"
    got = httpx.get(f"{url}{INCIDENTS}/{by_person}", headers=auth, timeout=5).json()["data"]
    assert got["attributes"]["resolved_by"] == "bob@example.com"

    first = httpx.post(
        f"{url}{INCIDENTS}/{by_api}/resolve", json={"resolved_by": "us"}, headers=auth, timeout=5
    )
    assert first.status_code == 200
    assert first.json()["data"]["attributes"]["resolved_by"] == "us"
    assert server.state(by_api) == "resolved_by_api"
    again = httpx.post(f"{url}{INCIDENTS}/{by_api}/resolve", json={}, headers=auth, timeout=5)
    assert (again.status_code, again.json()) == (409, {"errors": "Incident was already resolved"})


# -- one incident per key ---------------------------------------------------------------------


async def test_a_failure_sustained_for_an_hour_opens_one_incident_and_few_requests(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
) -> None:
    """One dead letter every 10 s for an hour (the clock moved a minute at a time), then all
    of them discarded."""
    clock = MovableClock()
    metrics = RecordingAlertMetrics()
    relay = make_relay(
        database_url, server, clock=clock, metrics=metrics, settings=minute_settings()
    )
    written: list[int] = []
    async with running(relay):
        for minute in range(60):
            for n in range(6):
                dead_letter_id = await write_dead_letter(conn, f"m{minute}-{n}")
                assert dead_letter_id is not None
                written.append(dead_letter_id)
            clock.advance(seconds=60)
            await settle(conn, relay)
        [incident] = await incident_rows(conn)
        during = len(server.api_requests())
        for dead_letter_id in written:
            await discard_dead_letter(pool, dead_letter_id, reason="fixed", resolved_by="ops")

        async def resolved() -> bool:
            return [r["state"] for r in await incident_rows(conn)] == ["resolved"]

        await wait_until(resolved, message="the incident to be resolved")
    assert [c.status for c in server.calls("resolve")] == [200]
    assert len(server.api_requests()) == during + 1, "clearing it costs one request"
    groups = await scalar(conn, "SELECT count(*) FROM jobfence.alert_groups")
    requests = server.api_requests()[:during]
    figures = {
        "dead letters": 360,
        "grouping windows": groups,
        "incidents": len(server.incident_list()),
        "updates (comments)": len(server.calls("comment")),
        "state checks (GET)": len(server.calls("get")),
        "requests": len(requests),
        "requests to resolve it": len(server.api_requests()) - during,
    }
    print(f"\none hour of failure, one dead letter per 10 s: {figures}")
    assert groups >= 60, "a window per minute: many windows"
    assert len(server.incident_list()) == 1, "one incident for one cause"
    assert len(server.posts()) == 1
    assert incident["state"] == "open"
    assert incident["dead_letters"] == 360, "every dead letter counted on our side"
    assert 5 <= incident["updates"] <= 6, "one update per ten minutes at most"
    [comments] = server.comments.values()
    assert comments[-1].startswith("jobfence: ")
    assert f"{incident['reported_dead_letters']} dead letters so far" in comments[-1]
    assert len(server.calls("get")) <= 60, "at most one state check per minute"
    assert len(requests) <= 1 + 60 + 6
    assert {r["outcome"] for r in await alert_rows(conn)} == {"opened", "merged"}
    assert metrics.incidents["opened"] == 1
    assert metrics.incidents["merged"] == groups - 1
    assert metrics.incidents["updated"] == incident["updates"]


async def test_resolved_by_a_person_then_a_new_dead_letter_opens_one_new_incident(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    clock = MovableClock()
    metrics = RecordingAlertMetrics()
    relay = make_relay(
        database_url, server, clock=clock, metrics=metrics, settings=minute_settings()
    )
    async with running(relay):
        await write_dead_letter(conn, "a1")
        clock.advance(seconds=61)
        await settle(conn, relay)
        [first] = server.incident_list()
        server.acknowledge_by_person(first["id"])
        await write_dead_letter(conn, "a2")
        clock.advance(seconds=61)
        await settle(conn, relay)
        assert len(server.incident_list()) == 1, "acknowledged is still open"

        server.resolve_by_person(first["id"], "alice@example.com")
        await write_dead_letter(conn, "a3")
        await write_dead_letter(conn, "a4")
        clock.advance(seconds=61)  # what we know of the state is now older than a minute
        await settle(conn, relay)
        await write_dead_letter(conn, "a5")
        clock.advance(seconds=61)
        await settle(conn, relay)

    assert len(server.incident_list()) == 2, "exactly one new incident"
    second = next(i for i in server.incident_list() if i["id"] != first["id"])
    assert second["attributes"]["metadata"]["dead_letters"] == [{"type": "String", "value": "2"}]
    old, new = await incident_rows(conn)
    assert (old["incident_id"], old["state"], old["resolution"], old["resolved_by"]) == (
        first["id"],
        "resolved",
        "person",
        "alice@example.com",
    )
    assert old["resolved_at"] is not None
    assert (new["incident_id"], new["state"], new["dead_letters"]) == (second["id"], "open", 3)
    assert metrics.incidents["resolved_by_person"] == 1
    assert metrics.incidents["opened"] == 2


@pytest.mark.parametrize("last_step", ["replay", "discard"])
async def test_replaying_or_discarding_the_last_pending_dead_letter_resolves_the_incident(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    last_step: str,
) -> None:
    clock = MovableClock()
    metrics = RecordingAlertMetrics()
    relay = make_relay(database_url, server, clock=clock, metrics=metrics)
    queue = PgQueue(pool)
    try:
        async with running(relay):
            first = await write_dead_letter(conn, "r1")
            last = await write_dead_letter(conn, "r2")
            assert first is not None and last is not None
            clock.advance(seconds=1)
            await settle(conn, relay)
            [incident] = server.incident_list()

            await discard_dead_letter(pool, first, reason="test order", resolved_by="ops")
            await wait_rounds(relay, 3)
            assert server.calls("resolve") == [], "one dead letter is still pending"
            assert server.state(incident["id"]) == "open"

            if last_step == "replay":
                await replay_dead_letter(pool, queue, last, resolved_by="ops")
            else:
                await discard_dead_letter(pool, last, reason="handled", resolved_by="ops")

            async def resolved() -> bool:
                return [r["state"] for r in await incident_rows(conn)] == ["resolved"]

            await wait_until(resolved, message="the incident to be resolved")
            await wait_rounds(relay, 3)

            await write_dead_letter(conn, "r3")  # the same cause again: a new incident
            clock.advance(seconds=1)
            await settle(conn, relay)
    finally:
        await queue.close()

    [call] = server.calls("resolve")
    assert call.json() == {"resolved_by": RESOLVED_BY}
    assert server.state(incident["id"]) == "resolved_by_api"
    old, new = await incident_rows(conn)
    assert (old["state"], old["resolution"], old["resolved_by"]) == (
        "resolved",
        "jobfence",
        "jobfence alert relay",
    )
    assert old["resolved_at"] is not None
    assert new["state"] == "open"
    assert len(server.incident_list()) == 2
    assert metrics.incidents["resolved"] == 1


async def test_a_dead_letter_arriving_before_the_resolve_goes_out_keeps_the_incident_open(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
) -> None:
    clock = MovableClock()
    relay = make_relay(database_url, server, clock=clock)
    first = await write_dead_letter(conn, "k1")
    assert first is not None
    async with running(relay):
        clock.advance(seconds=1)
        await settle(conn, relay)
    # The relay is stopped: the resolve is requested in its next round, and re-checked right
    # before the request goes out.
    await discard_dead_letter(pool, first, reason="handled", resolved_by="ops")
    await conn.execute(
        "UPDATE jobfence.alert_incidents SET state = 'resolving', resolve_requested_at = now(),"
        " resolve_next_at = now()"
    )
    await write_dead_letter(conn, "k2")
    async with running(make_relay(database_url, server, clock=clock)) as again:
        await wait_rounds(again, 3)
    assert server.calls("resolve") == []
    [row] = await incident_rows(conn)
    assert row["state"] == "open"


# -- the duplicate-incident race --------------------------------------------------------------


async def test_a_lost_create_still_in_progress_is_looked_up_only_once_it_is_over(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    # Better Stack takes 1 s to create the incident; the client gives up after 0.3 s. An
    # immediate lookup would find nothing and open a second incident.
    server.script("POST", INCIDENTS, [stall(1.0)])
    await write_dead_letter(conn, "slow-1")
    relay = make_relay(
        database_url,
        server,
        sink=sink_for(server, timeout_seconds=0.3),
        settings=fast_settings(lost_answer_wait_seconds=0.3 + 1.5),
    )
    async with running(relay):

        async def posted() -> bool:
            return len(server.posts()) == 1

        await wait_until(posted, timeout=15, message="the create to reach Better Stack")
        # The relay measures the wait from its record of the attempt, committed before the
        # request went out (the fake sees it arrive later): so does this test.
        cur = await conn.execute("SELECT attempts, last_attempt_at FROM jobfence.alerts")
        [(attempts, first_attempt_at)] = await cur.fetchall()
        assert attempts == 1, "read before the second attempt, which waits 1.8 s"
        await wait_for_alerts(conn, "sent", 1, timeout=15)
    [first, *_] = server.posts()
    [lookup] = server.lists()
    second_attempt_at = await scalar(conn, "SELECT last_attempt_at FROM jobfence.alerts")
    waited = (second_attempt_at - first_attempt_at).total_seconds()
    assert waited >= 1.8, f"looked up {waited:.3f}s after the lost attempt, before it was over"
    assert lookup.at > first.at
    assert len(server.incident_list()) == 1, "no second incident"
    assert len(server.posts()) == 1
    [row] = await alert_rows(conn)
    assert (row["state"], row["outcome"]) == ("sent", "found")


# -- metrics ----------------------------------------------------------------------------------


def test_the_lifecycle_metrics_are_exported() -> None:
    from prometheus_client import generate_latest

    metrics = PrometheusAlertMetrics()
    metrics.incident_action("opened")
    metrics.incident_action("updated")
    metrics.incident_action("resolved")
    metrics.incident_action("escalated")
    metrics.alerts_refused(2)
    metrics.heartbeat_state(False)
    text = generate_latest(metrics.registry).decode()
    for line in (
        'jobfence_alert_incidents_total{action="opened"} 1.0',
        'jobfence_alert_incidents_total{action="updated"} 1.0',
        'jobfence_alert_incidents_total{action="resolved"} 1.0',
        'jobfence_alert_incidents_total{action="escalated"} 1.0',
        'jobfence_alert_incidents_total{action="merged"} 0.0',
        "jobfence_alerts_refused 2.0",
        "jobfence_alert_relay_heartbeat_ok 0.0",
    ):
        assert line in text, line
