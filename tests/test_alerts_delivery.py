"""Spec behaviour 4: a new dead letter alerts Better Stack, through the outbox and the relay.

Against the fake Better Stack (``fake_betterstack.py``), over real HTTP on loopback: what a
request looks like, one incident per group, and how each kind of failure is handled (429 with
Retry-After, 5xx, timeouts, 409 are retried or resolved; 401 and 422 are not retried).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

import pointsapp
from alert_helpers import (
    CONSUMER,
    HARD,
    QUEUE,
    TOKEN,
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
from fake_betterstack import INCIDENTS, FakeBetterStack, respond, stall
from jobfence import PgQueue, PrometheusMetrics, Worker
from jobfence.adapters.betterstack import BetterStackHeartbeat
from jobfence.alerts import alert_counts, record_dead_letter_alerts, retry_failed_alerts
from jobfence.harness import SQL as CORE_SQL
from support import scalar, wait_until


def metadata_value(body: dict[str, Any], key: str) -> str:
    [entry] = body["metadata"][key]
    assert entry["type"] == "String"
    return str(entry["value"])


async def test_each_group_opens_one_incident_with_the_documented_request(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    for n in range(3):
        await write_dead_letter(conn, f"hard-{n}")
    await write_dead_letter(conn, "poison-1", error_class="SchemaInvalid")
    sink = sink_for(
        server,
        requester_email="oncall@example.com",
        team_name="Platform",
        policy_id="4711",
        team_wait=300,
    )
    metrics = RecordingAlertMetrics()
    relay = make_relay(database_url, server, sink=sink, metrics=metrics)
    async with running(relay):
        await wait_for_alerts(conn, "sent", 2)
        await wait_rounds(relay)
    await sink.aclose()

    posts = server.posts()
    assert len(posts) == 2, "one incident per (queue, consumer, error_class) group"
    assert server.lists() == [], "a first attempt creates without looking up"
    bodies = {}
    for post in posts:
        assert post.method == "POST"
        assert post.path == INCIDENTS == "/api/v3/incidents"
        assert post.query == {}
        assert post.headers["authorization"] == f"Bearer {TOKEN}"
        assert post.headers["content-type"] == "application/json"
        assert post.headers["accept"] == "application/json"
        assert post.status == 201
        body = post.json()
        bodies[metadata_value(body, "error_class")] = body
    hard = bodies[HARD]
    assert set(hard) == {
        "requester_email",
        "name",
        "summary",
        "description",
        "call",
        "sms",
        "email",
        "push",
        "team_wait",
        "policy_id",
        "team_name",
        "metadata",
    }
    assert hard["requester_email"] == "oncall@example.com"
    assert hard["team_name"] == "Platform"
    assert hard["policy_id"] == "4711"
    assert hard["team_wait"] == 300
    assert (hard["call"], hard["sms"], hard["email"], hard["push"]) == (False, False, True, True)
    assert hard["name"] == f"jobfence: 3 dead letters on {QUEUE}/{CONSUMER} ({HARD})"
    assert hard["summary"] == f"3 dead letters on queue {QUEUE}, consumer {CONSUMER}: {HARD}"
    assert "3 dead letters of queue loyalty" in hard["description"]
    assert "job hard-0, 1 attempt: jobfence.HardFailure: account is closed" in hard["description"]
    assert "Traceback" not in hard["description"], "only the first line of each error"
    assert metadata_value(hard, "dead_letters") == "3"
    assert metadata_value(hard, "queue") == QUEUE
    assert metadata_value(hard, "consumer") == CONSUMER
    assert metadata_value(hard, "jobfence_alert") == "dead_letters"
    assert bodies["SchemaInvalid"]["name"].startswith("jobfence: 1 dead letter on ")

    rows = await alert_rows(conn)
    assert [(r["kind"], r["state"], r["attempts"]) for r in rows] == [
        ("dead_letters", "sent", 1),
        ("dead_letters", "sent", 1),
    ]
    # The dedup key sent is the one stored, and the incident id Better Stack gave is recorded.
    stored = {r["dedup_key"]: r["incident_id"] for r in rows}
    assert {k: v[0] for k, v in server.by_dedup_key().items()} == stored
    assert all(key.startswith("jobfence-dl-") for key in stored)
    counts = await alert_counts(conn)
    assert (counts.pending, counts.sent, counts.failed) == (0, 2, 0)
    assert counts.dead_letters_awaiting_alert == 0
    assert metrics.sent == {"dead_letters": 2}
    assert metrics.pending[-1] == 0


async def test_a_dead_letter_after_its_groups_window_closed_is_counted_on_the_open_incident(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    relay = make_relay(database_url, server)
    async with running(relay):
        await write_dead_letter(conn, "first")
        await wait_for_alerts(conn, "sent", 1)
        await write_dead_letter(conn, "second")
        await wait_for_alerts(conn, "sent", 2)
    [post] = server.posts()
    assert metadata_value(post.json(), "dead_letters") == "1"
    rows = await alert_rows(conn)
    assert rows[0]["incident_id"] == rows[1]["incident_id"]
    assert await scalar(conn, "SELECT dead_letters FROM jobfence.alert_incidents") == 2


async def test_429_is_retried_after_its_retry_after_and_opens_one_incident(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    server.script(
        "POST", INCIDENTS, [respond(429, {"errors": "Rate limit exceeded"}, **{"Retry-After": "1"})]
    )
    await write_dead_letter(conn, "j1")
    metrics = RecordingAlertMetrics()
    # Backoff alone would retry after 0.1-0.2 s: only Retry-After explains a 1 s wait.
    relay = make_relay(database_url, server, metrics=metrics)
    async with running(relay):
        await wait_for_alerts(conn, "sent", 1)
    first, second = server.posts()
    assert (first.status, second.status) == (429, 201)
    assert second.at - first.at >= 0.95, "Retry-After: 1 was honoured"
    [lookup] = server.lists()
    assert first.at < lookup.at < second.at, "the retry looked for an earlier incident first"
    assert len(server.incident_list()) == 1
    [row] = await alert_rows(conn)
    assert (row["state"], row["attempts"]) == ("sent", 2)
    assert relay.stats.retried == {"dead_letters": 1}
    assert metrics.failed == {("dead_letters", "rate_limited"): 1}


async def test_5xx_is_retried_with_growing_backoff_until_delivered(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    server.script(
        "POST",
        INCIDENTS,
        [respond(500, {"errors": "Internal"}), respond(503), respond(502)],
    )
    await write_dead_letter(conn, "j1")
    relay = make_relay(database_url, server, settings=fast_settings(retry_base_seconds=0.2))
    async with running(relay):
        await wait_for_alerts(conn, "sent", 1)
    posts = server.posts()
    assert [p.status for p in posts] == [500, 503, 502, 201]
    gaps = [b.at - a.at for a, b in itertools.pairwise(posts)]
    # min(0.2 * 2^(n-1), cap) * U(0.5, 1): at least 0.1, 0.2, 0.4 s.
    for gap, low in zip(gaps, (0.1, 0.2, 0.4), strict=True):
        assert gap >= low - 0.02, gaps
    assert len(server.incident_list()) == 1
    [row] = await alert_rows(conn)
    assert (row["state"], row["attempts"]) == ("sent", 4)


async def test_a_timeout_is_retried_and_the_incident_it_created_is_found_not_opened_twice(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    # Better Stack creates the incident, but the answer comes after the client gave up.
    server.script("POST", INCIDENTS, [stall(1.5, create_first=True)])
    await write_dead_letter(conn, "j1")
    metrics = RecordingAlertMetrics()
    relay = make_relay(
        database_url, server, sink=sink_for(server, timeout_seconds=0.3), metrics=metrics
    )
    async with running(relay):
        await wait_for_alerts(conn, "sent", 1)
    [incident] = server.incident_list()
    assert len(server.posts()) == 1, "the retry found the incident instead of creating"
    assert len(server.lists()) == 1
    [row] = await alert_rows(conn)
    assert (row["state"], row["attempts"], row["incident_id"]) == ("sent", 2, incident["id"])
    assert relay.stats.found_existing == 1
    assert metrics.failed == {("dead_letters", "network"): 1}


async def test_a_connection_dropped_without_an_answer_is_retried(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    server.down = "drop"
    await write_dead_letter(conn, "j1")
    relay = make_relay(database_url, server)
    async with running(relay):

        async def refused_twice() -> bool:
            return relay.stats.retried["dead_letters"] >= 2

        await wait_until(refused_twice, message="two failed attempts")
        server.down = None
        await wait_for_alerts(conn, "sent", 1)
    assert len(server.incident_list()) == 1


async def test_409_conflict_records_the_incident_that_already_carries_the_dedup_key(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    server.script("POST", INCIDENTS, [respond(409, {"errors": "exists"}, create_first=True)])
    await write_dead_letter(conn, "j1")
    relay = make_relay(database_url, server)
    async with running(relay):
        await wait_for_alerts(conn, "sent", 1)
    [incident] = server.incident_list()
    [row] = await alert_rows(conn)
    assert (row["state"], row["attempts"], row["incident_id"]) == ("sent", 1, incident["id"])
    assert len(server.posts()) == 1


async def test_401_and_422_are_not_retried_but_counted_logged_and_marked_failed(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="jobfence")
    server.script(
        "POST",
        INCIDENTS,
        [
            respond(401, {"errors": "Invalid Team API token"}),
            respond(422, {"errors": ["Requester email is invalid"]}),
        ],
    )
    await write_dead_letter(conn, "a1")
    await write_dead_letter(conn, "b1", error_class="SchemaInvalid")
    metrics = RecordingAlertMetrics()
    relay = make_relay(database_url, server, metrics=metrics)
    async with running(relay):
        await wait_for_alerts(conn, "failed", 2)
        await wait_rounds(relay, 10)  # ten more rounds: still no retry
    assert [p.status for p in server.posts()] == [401, 422]
    assert server.lists() == []
    rows = await alert_rows(conn)
    assert [r["state"] for r in rows] == ["failed", "failed"]
    errors = sorted(r["last_error"] for r in rows)
    assert "HTTP 401: Invalid Team API token" in errors[0]
    assert "HTTP 422" in errors[1] and "Requester email is invalid" in errors[1]
    assert relay.stats.failed == {"dead_letters": 2}
    assert relay.stats.retried == {}
    assert metrics.failed == {("dead_letters", "rejected"): 2}
    errors_logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    refused = [m for m in errors_logged if "REFUSED and not retried" in m]
    assert len(refused) == 2
    # The two windows end a few milliseconds apart: a round closes one of them, or (on a busy
    # machine, a round slower than that gap) both at once.
    [turned] = [m for m in errors_logged if m not in refused]
    assert turned in [
        f"alert relay: the heartbeat reports FAILURE: {n} refused for good, oldest waiting "
        "none (bound 10m). See the runbook dead-letter-replay"
        for n in ("1 alert", "2 alerts")
    ], turned
    assert TOKEN not in caplog.text
    counts = await alert_counts(conn)
    assert (counts.pending, counts.failed) == (0, 2)

    # Once the settings are fixed, --retry-failed sends them; a lookup comes first.
    assert await retry_failed_alerts(conn) == 2
    async with running(make_relay(database_url, server)):
        await wait_for_alerts(conn, "sent", 2)
    assert len(server.incident_list()) == 2
    assert len(server.lists()) == 2


async def test_a_wrong_token_is_refused_by_the_api_and_never_appears_in_logs_or_errors(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "bst-wrong-token-0000"
    await write_dead_letter(conn, "j1")
    relay = make_relay(database_url, server, sink=sink_for(server, token=wrong))
    async with running(relay):
        await wait_for_alerts(conn, "failed", 1)
    [post] = server.posts()
    assert post.status == 401
    assert post.headers["authorization"] == f"Bearer {wrong}"
    [row] = await alert_rows(conn)
    assert "HTTP 401" in row["last_error"]
    assert wrong not in row["last_error"]
    assert wrong not in caplog.text
    assert wrong not in repr(relay._sink)


class TimedHeartbeat(BetterStackHeartbeat):
    """A Better Stack heartbeat that notes when the relay sends each beat (event loop time)."""

    def __init__(self, url: str, *, name: str) -> None:
        super().__init__(url, name=name)
        self.sent: list[float] = []

    async def beat(self, ok: bool = True) -> bool:
        self.sent.append(asyncio.get_running_loop().time())
        return await super().beat(ok)


async def test_the_relay_heartbeat_goes_out_after_successful_rounds_without_logging_its_url(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url = server.heartbeat_url("relay")
    heartbeat = TimedHeartbeat(url, name="alert relay")
    relay = make_relay(
        database_url,
        server,
        heartbeat=heartbeat,
        settings=fast_settings(heartbeat_interval_seconds=0.2),
    )
    async with running(relay):

        async def beating() -> bool:
            return len(server.heartbeats) >= 3

        await wait_until(beating, message="three heartbeats")
        server.down = "drop"
        await wait_rounds(relay, 8)
        server.down = None
    await heartbeat.aclose()
    assert {(b.method, b.path) for b in server.heartbeats} == {
        ("GET", "/api/v1/heartbeat/relay-secret-token")
    }
    # The relay spaces the beats it sends (its own clock, when it sends): measured there, not
    # at the fake's arrivals, which a loaded machine delays by different amounts.
    gaps = [b - a for a, b in itertools.pairwise(heartbeat.sent)]
    assert len(heartbeat.sent) >= len(server.heartbeats)
    assert min(gaps) >= 0.2 - 1e-6, "at most one heartbeat per interval"
    assert relay.stats.heartbeat_failures >= 1
    assert "alert relay heartbeat failed" in caplog.text
    assert "secret-token" not in caplog.text
    assert "authorization" not in {k.lower() for b in server.heartbeats for k in b.headers}


async def test_the_harness_records_the_alert_in_the_dead_letters_own_transaction_once(
    pool: AsyncConnectionPool[Any], conn: AsyncConnection[Any]
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    # The same job fails for good twice while its first dead letter is pending (D5): the
    # second failure inserts no dead letter, so it records no alert either.
    for _ in range(2):
        await app.enqueue(
            conn, "award_points", {"account_id": 1, "points": 2, "mode": "hard"}, job_id="h1"
        )
    await app.enqueue(conn, "award_points", {"account_id": 1, "points": 2}, job_id="ok1")
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    metrics = PrometheusMetrics()
    try:
        worker = Worker(app, pool, queue, poll_seconds=0.05, metrics=metrics, concurrency=1)
        await asyncio.wait_for(worker.run(until="empty"), timeout=20)
    finally:
        await queue.close()
    assert metrics.count("dead_lettered") == 2
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 1
    cur = await conn.execute(
        "SELECT o.queue, o.consumer, o.error_class, o.created_at = d.created_at,"
        "       o.xmin::text = d.xmin::text, o.group_id"
        " FROM jobfence.alert_outbox o JOIN core.dead_letters d ON d.id = o.dead_letter_id"
    )
    # Same xmin: written by the very transaction that wrote the dead letter.
    assert await cur.fetchall() == [(QUEUE, CONSUMER, HARD, True, True, None)]
    counts = await alert_counts(conn)
    assert counts.dead_letters_awaiting_alert == 1
    assert counts.pending == 0  # no relay ran: the group is not even open yet


async def _dead_letter_with_alert(conn: AsyncConnection[Any], job_id: str, last_error: str) -> None:
    """A dead letter of ``job_id`` whose error is ``last_error``, and its alert, committed."""
    async with conn.transaction():
        cur = await conn.execute(
            CORE_SQL["dead_letter_insert"],
            {
                "job_id": job_id,
                "queue": QUEUE,
                "consumer": CONSUMER,
                "tenant_id": None,
                "payload": "{}",
                "payload_encoding": "json",
                "attempts": 1,
                "last_error": last_error,
                "error_class": HARD,
                "correlation_id": None,
                "traceparent": None,
            },
        )
        row = await cur.fetchone()
        assert row is not None
        await record_dead_letter_alerts(conn, [row[0]])


async def test_a_secret_quoted_in_a_dead_letters_error_is_masked_in_the_incident(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = "jwt-signing-secret-4f9a1c"
    monkeypatch.setenv("JOBFENCE_JWT_SECRET", secret)
    await _dead_letter_with_alert(conn, "leaky", f"{HARD}: upstream refused key {secret}")
    sink = sink_for(server)
    relay = make_relay(database_url, server, sink=sink)
    async with running(relay):
        await wait_for_alerts(conn, "sent", 1)
    await sink.aclose()
    [post] = server.posts()
    assert secret not in post.body.decode()
    assert "upstream refused key ***" in post.json()["description"]


CONFIGURED = "jwt-signing-secret-4f9a1c-0123456789abcdef"


@pytest.mark.parametrize(
    ("error", "secret", "shown"),
    [
        pytest.param(
            "gateway postgresql://pay:Hunter2Secret@10.0.0.5/pay refused",
            "Hunter2Secret",
            "gateway postgresql://pay:***@10.0.0.5/pay refused",
            id="a-url-password",
        ),
        pytest.param(
            "retry with api_key=AKIA1234SECRET later",
            "AKIA1234SECRET",
            "retry with api_key=*** later",
            id="a-key-value",
        ),
        pytest.param(
            # The configured secret starts before the 300th character and ends after it.
            "x" * (280 - len(HARD)) + f" {CONFIGURED} tail",
            CONFIGURED[:12],
            "x" * (280 - len(HARD)) + " *** tail",
            id="a-configured-secret-across-the-cut",
        ),
        pytest.param(
            "refused " + "y" * 4100 + "Hunter2Secret",
            "Hunter2Secret",
            "refused ...",  # the word cut where reading stopped is left out whole
            id="a-line-longer-than-what-is-read",
        ),
    ],
)
async def test_every_secret_a_log_line_hides_is_hidden_in_the_incident(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    monkeypatch: pytest.MonkeyPatch,
    *,
    error: str,
    secret: str,
    shown: str,
) -> None:
    """The incident quotes a dead letter's first error line, and leaves our systems: a URL's
    password, a ``password=``-like value and a configured secret are hidden as the logs hide
    them, the line redacted before it is cut to 300 characters (a secret across the cut would
    no longer be recognised after it)."""
    monkeypatch.setenv("JOBFENCE_JWT_SECRET", CONFIGURED)
    await _dead_letter_with_alert(conn, "leaky", f"{HARD}: {error}\nTraceback ...")
    sink = sink_for(server)
    relay = make_relay(database_url, server, sink=sink)
    async with running(relay):
        await wait_for_alerts(conn, "sent", 1)
    await sink.aclose()
    [post] = server.posts()
    assert secret not in post.body.decode()
    [quoted] = [line for line in post.json()["description"].splitlines() if "job leaky" in line]
    assert quoted == f"- #1 job leaky, 1 attempt: {HARD}: {shown}"


async def test_a_forged_job_id_or_error_cannot_start_a_line_of_its_own_in_the_incident(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    """A job id may hold any character but NUL (a newline is a valid id), and an error message
    is the handler's: in the incident, each is escaped on its one line, as in the logs, so that
    neither can add a line that reads as jobfence's own, nor colour a terminal."""
    forged = "- #1 job all-clear, 1 attempt: resolved, nothing to do"
    await _dead_letter_with_alert(
        conn, f"inj\n{forged}", f"{HARD}: declined \x1b[31mred\x1b[0m\rreset"
    )
    sink = sink_for(server)
    relay = make_relay(database_url, server, sink=sink)
    async with running(relay):
        await wait_for_alerts(conn, "sent", 1)
    await sink.aclose()
    [post] = server.posts()
    description = post.json()["description"]
    assert not [line for line in description.splitlines() if line.startswith(forged)]
    assert f"job inj\\n{forged}" in description
    assert "declined \\x1b[31mred\\x1b[0m\\rreset" in description
    assert "\x1b" not in post.body.decode() and "\r" not in description


async def _alerts_settled(conn: AsyncConnection[Any], count: int) -> list[dict[str, Any]]:
    """The alert rows once ``count`` of them are no longer pending."""

    async def settled() -> bool:
        rows = await alert_rows(conn)
        return len([r for r in rows if r["state"] != "pending"]) >= count

    await wait_until(settled, timeout=15, message=f"{count} alert(s) settled")
    return await alert_rows(conn)


async def test_an_incident_id_that_is_not_digits_is_never_recorded_and_the_alert_goes_out(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    """Better Stack's incident ids are whole numbers, and an answer's id becomes the path of
    later requests and the key's recorded incident. An answer with another id (a proxy, a
    changed API) is unreadable: retried, the dedup key looked up, the alert delivered. It is
    never recorded, so the alerts after it go out too."""
    server.script(
        "POST", INCIDENTS, [respond(201, {"data": {"id": "inc_01HXYZ", "type": "incident"}})]
    )
    await write_dead_letter(conn, "j1")
    sink = sink_for(server)
    relay = make_relay(database_url, server, sink=sink)
    async with running(relay):
        await _alerts_settled(conn, 1)
        await write_dead_letter(conn, "j2")  # the same key: counted on its incident
        rows = await _alerts_settled(conn, 2)
    await sink.aclose()
    assert [r["state"] for r in rows] == ["sent", "sent"], rows
    recorded = await conn.execute("SELECT incident_id FROM jobfence.alert_incidents")
    assert [row[0] for row in await recorded.fetchall()] == list(server.incidents)
    assert all(r["incident_id"].isascii() and r["incident_id"].isdigit() for r in rows)
    assert not [r.path for r in server.requests if "inc_" in r.path]


async def test_an_incident_recorded_with_an_id_that_is_not_digits_is_taken_for_gone(
    database_url: str, conn: AsyncConnection[Any], server: FakeBetterStack
) -> None:
    """An id recorded before ids were checked where they arrive names no incident: the relay
    takes it for one deleted in Better Stack and opens a new incident, instead of refusing
    every later alert of the key for good."""
    await write_dead_letter(conn, "j1")
    sink = sink_for(server)
    relay = make_relay(database_url, server, sink=sink)
    async with running(relay):
        await _alerts_settled(conn, 1)
    await conn.execute("UPDATE jobfence.alerts SET incident_id = 'inc_01HXYZ'")
    await conn.execute("UPDATE jobfence.alert_incidents SET incident_id = 'inc_01HXYZ'")
    await write_dead_letter(conn, "j2")
    async with running(make_relay(database_url, server, sink=sink)):
        rows = await _alerts_settled(conn, 2)
    await sink.aclose()
    assert [r["state"] for r in rows] == ["sent", "sent"], rows
    assert rows[1]["incident_id"].isdigit() and len(server.posts()) == 2
    assert not [r.path for r in server.requests if "inc_" in r.path]
