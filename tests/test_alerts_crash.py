"""A relay killed between Better Stack's answer and its own record opens no second incident,
resolves once (a second resolve answers 409: done) and escalates the same incident.

The relay runs as ``jobfence alert-relay`` in a subprocess and is SIGKILLed at the worst
moment: after Better Stack created the incident (and, in the first test, after it answered
201), before the relay recorded it. The restarted relay finds the incident by its dedup key.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from alert_helpers import (
    TESTS_DIR,
    alert_rows,
    relay_env,
    wait_for_alerts,
    write_dead_letter,
)
from fake_betterstack import INCIDENTS, FakeBetterStack, hold, stall
from jobfence import discard_dead_letter
from support import wait_until

STALLING_RELAY = TESTS_DIR / "alert_relay_proc.py"


class RelayProcess:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"relay exited early ({self.proc.returncode}):\n{self.output()}")
        return True

    async def wait_exit(self, within: float = 15.0) -> int:
        async def exited() -> bool:
            return self.proc.poll() is not None

        await wait_until(exited, timeout=within, message=f"the relay to exit:\n{self.output()}")
        assert self.proc.returncode is not None
        return self.proc.returncode

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert await self.wait_exit() == -signal.SIGKILL

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def processes() -> Iterator[list[RelayProcess]]:
    started: list[RelayProcess] = []
    yield started
    for proc in started:
        proc.cleanup()


def cli_relay(env: dict[str, str], log: Path) -> RelayProcess:
    return RelayProcess(["-m", "jobfence.cli", "alert-relay", "--poll-seconds", "0.05"], env, log)


async def restart_and_check_one_incident(
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    *,
    env: dict[str, str],
    tmp_path: Path,
    processes: list[RelayProcess],
    incident_id: str,
) -> None:
    second = cli_relay(env, tmp_path / "second.log")
    processes.append(second)
    await wait_for_alerts(conn, "sent", 1, timeout=20)
    [row] = await alert_rows(conn)
    assert (row["state"], row["attempts"], row["incident_id"]) == ("sent", 2, incident_id)
    assert len(server.incident_list()) == 1, "no second incident"
    assert len(server.posts()) == 1
    assert len(server.lists()) == 1, "the restarted relay looked the dedup key up"
    assert second.alive()
    second.proc.send_signal(signal.SIGTERM)
    assert await second.wait_exit() == 0
    assert "alert relay stopped: sent 1, failed 0" in second.output()
    assert "found already open 1" in second.output()


async def test_relay_killed_after_a_201_before_recording_it_opens_no_second_incident(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    tmp_path: Path,
    processes: list[RelayProcess],
) -> None:
    await write_dead_letter(conn, "k1")
    await write_dead_letter(conn, "k2")
    env = relay_env(database_url, server)
    marker = tmp_path / "answered"
    first = RelayProcess([str(STALLING_RELAY), str(marker)], env, tmp_path / "first.log")
    processes.append(first)

    async def answered() -> bool:
        return first.alive() and marker.exists()

    await wait_until(answered, timeout=20, message="Better Stack's 201 to reach the relay")
    alert_id, incident_id = marker.read_text().split()
    assert [p.status for p in server.posts()] == [201]
    [created] = server.incident_list()
    assert created["id"] == incident_id
    [row] = await alert_rows(conn)
    assert (row["id"], row["state"], row["attempts"]) == (int(alert_id), "pending", 1)
    assert row["incident_id"] is None, "not recorded yet"

    await first.kill()
    await restart_and_check_one_incident(
        conn, server, env=env, tmp_path=tmp_path, processes=processes, incident_id=incident_id
    )


async def test_relay_killed_while_better_stack_holds_its_answer_opens_no_second_incident(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    tmp_path: Path,
    processes: list[RelayProcess],
) -> None:
    server.script("POST", INCIDENTS, [hold()])
    await write_dead_letter(conn, "k1")
    env = relay_env(database_url, server, JOBFENCE_BETTERSTACK_TIMEOUT="3")
    first = cli_relay(env, tmp_path / "first.log")
    processes.append(first)

    async def created() -> bool:
        return first.alive() and server.created.is_set()

    await wait_until(created, timeout=20, message="Better Stack to create the incident")
    [incident] = server.incident_list()
    await first.kill()
    server.release()  # the held answer goes nowhere
    await restart_and_check_one_incident(
        conn,
        server,
        env=env,
        tmp_path=tmp_path,
        processes=processes,
        incident_id=incident["id"],
    )


def test_the_fake_servers_hold_is_released_on_close() -> None:
    # Guard for the test above: a held request never outlives the server.
    fake = FakeBetterStack().start()
    fake.script("POST", INCIDENTS, [hold()])
    done = threading.Event()

    def post() -> None:
        import httpx

        try:
            httpx.post(f"{fake.base_url}{INCIDENTS}", json={"summary": "x"}, timeout=10)
        finally:
            done.set()

    thread = threading.Thread(target=post)
    thread.start()
    assert fake.created.wait(5)
    fake.close()
    assert done.wait(5)
    thread.join(5)


async def test_relay_killed_after_better_stack_resolved_before_recording_resolves_once(
    *,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    tmp_path: Path,
    processes: list[RelayProcess],
) -> None:
    dead_letter_id = await write_dead_letter(conn, "r1")
    assert dead_letter_id is not None
    env = relay_env(database_url, server)
    marker = tmp_path / "resolved"
    first = RelayProcess([str(STALLING_RELAY), str(marker), "resolve"], env, tmp_path / "first.log")
    processes.append(first)
    await wait_for_alerts(conn, "sent", 1, timeout=20)
    await discard_dead_letter(pool, dead_letter_id, reason="handled", resolved_by="ops")

    async def answered() -> bool:
        return first.alive() and marker.exists()

    await wait_until(answered, timeout=20, message="Better Stack's answer to the resolve")
    [incident] = server.incident_list()
    assert server.state(incident["id"]) == "resolved_by_api"
    [row] = await incident_state(conn)
    assert row[:2] == ("resolving", 1), "requested and attempted, not recorded"
    await first.kill()

    second = cli_relay(env, tmp_path / "second.log")
    processes.append(second)

    async def recorded() -> bool:
        return (await incident_state(conn))[0][0] == "resolved"

    await wait_until(recorded, timeout=20, message="the restarted relay to record the resolve")
    [row] = await incident_state(conn)
    assert row == ("resolved", 2, "jobfence", "jobfence alert relay")
    assert [c.status for c in server.calls("resolve")] == [200, 409], "409: done already"
    assert len(server.incident_list()) == 1
    second.proc.send_signal(signal.SIGTERM)
    assert await second.wait_exit() == 0
    assert "resolved 1" in second.output()


async def test_relay_killed_after_better_stack_escalated_before_recording_opens_nothing_new(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    tmp_path: Path,
    processes: list[RelayProcess],
) -> None:
    await write_dead_letter(conn, "e1")
    env = relay_env(database_url, server, JOBFENCE_ALERT_ESCALATE_AFTER="1")
    marker = tmp_path / "escalated"
    first = RelayProcess(
        [str(STALLING_RELAY), str(marker), "escalate"], env, tmp_path / "first.log"
    )
    processes.append(first)

    async def answered() -> bool:
        return first.alive() and marker.exists()

    await wait_until(answered, timeout=20, message="Better Stack's answer to the escalate")
    alert_id, incident_id = marker.read_text().split()
    [incident] = server.incident_list()
    assert incident["id"] == incident_id
    assert len(server.escalations[incident_id]) == 1
    rows = await alert_rows(conn)
    assert [(r["kind"], r["state"]) for r in rows] == [
        ("dead_letters", "sent"),
        ("escalation", "pending"),
    ]
    assert rows[1]["id"] == int(alert_id)
    await first.kill()

    second = cli_relay(env, tmp_path / "second.log")
    processes.append(second)
    await wait_for_alerts(conn, "sent", 2, timeout=25)
    rows = await alert_rows(conn)
    assert (rows[1]["outcome"], rows[1]["incident_id"]) == ("escalated", incident_id)
    assert len(server.incident_list()) == 1, "no second incident"
    assert len(server.posts()) == 1
    # The escalate whose answer was never recorded is sent again, on the same incident: at
    # least once (a lost escalation would be worse than a repeated notification).
    assert 1 <= len(server.escalations[incident_id]) <= 2
    second.proc.send_signal(signal.SIGTERM)
    assert await second.wait_exit() == 0
    assert "escalated 1" in second.output()


async def incident_state(conn: AsyncConnection[Any]) -> list[tuple[Any, ...]]:
    cur = await conn.execute(
        "SELECT state, resolve_attempts, resolution, resolved_by FROM jobfence.alert_incidents"
    )
    return await cur.fetchall()


@pytest.mark.parametrize("step", ["resolve", "escalate"])
async def test_relay_killed_while_better_stack_holds_its_answer_resolves_or_escalates_the_same(
    *,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    tmp_path: Path,
    processes: list[RelayProcess],
    step: str,
) -> None:
    dead_letter_id = await write_dead_letter(conn, "h1")
    assert dead_letter_id is not None
    env = relay_env(
        database_url, server, JOBFENCE_BETTERSTACK_TIMEOUT="3", JOBFENCE_ALERT_ESCALATE_AFTER="3"
    )
    first = cli_relay(env, tmp_path / "first.log")
    processes.append(first)
    await wait_for_alerts(conn, "sent", 1, timeout=20)
    [incident] = server.incident_list()
    server.script("POST", f"{INCIDENTS}/{incident['id']}/{step}", [hold()])
    if step == "resolve":
        await discard_dead_letter(pool, dead_letter_id, reason="handled", resolved_by="ops")

    async def done_at_better_stack() -> bool:
        return first.alive() and server.created.is_set()

    await wait_until(done_at_better_stack, timeout=20, message=f"Better Stack to {step}")
    await first.kill()
    server.release()  # the held answer goes nowhere

    second = cli_relay(env, tmp_path / "second.log")
    processes.append(second)
    if step == "resolve":

        async def recorded() -> bool:
            return (await incident_state(conn))[0][0] == "resolved"

        await wait_until(recorded, timeout=25, message="the resolve to be recorded")
        assert (await incident_state(conn))[0][2:] == ("jobfence", "jobfence alert relay")
        assert [c.status for c in server.calls("resolve")] == [None, 409]
    else:
        await wait_for_alerts(conn, "sent", 2, timeout=25)
        assert 1 <= len(server.escalations[incident["id"]]) <= 2, "the same incident"
    assert len(server.incident_list()) == 1, "no second incident"
    second.proc.send_signal(signal.SIGTERM)
    assert await second.wait_exit() == 0


async def last_attempt_at(conn: AsyncConnection[Any]) -> datetime:
    """When the relay recorded its latest attempt of the only alert (the database's clock)."""
    cur = await conn.execute("SELECT last_attempt_at FROM jobfence.alerts")
    [(at,)] = await cur.fetchall()
    assert isinstance(at, datetime)
    return at


async def test_relay_killed_while_better_stack_is_still_creating_waits_before_looking_up(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    tmp_path: Path,
    processes: list[RelayProcess],
) -> None:
    # Better Stack takes 3 s to create the incident; the relay is killed meanwhile and
    # restarted at once. Looking the key up at once would find nothing and open a second
    # incident: the restarted relay waits until the lost attempt is older than the timeout
    # (2 s) plus 5 s.
    server.script("POST", INCIDENTS, [stall(3.0)])
    await write_dead_letter(conn, "slow-1")
    env = relay_env(database_url, server)
    first = cli_relay(env, tmp_path / "first.log")
    processes.append(first)

    async def posted() -> bool:
        return first.alive() and len(server.posts()) == 1

    await wait_until(posted, timeout=20, message="the create to reach Better Stack")
    # The relay measures the wait from its own record of the first attempt (committed before
    # the request went out), on the database clock: so does this test. The fake's arrival
    # times come later than that record by however long the request took to get there.
    first_attempt_at = await last_attempt_at(conn)
    await first.kill()
    second = cli_relay(env, tmp_path / "second.log")
    processes.append(second)
    await wait_for_alerts(conn, "sent", 1, timeout=25)
    [post] = server.posts()
    [lookup] = server.lists()
    waited = (await last_attempt_at(conn) - first_attempt_at).total_seconds()
    assert waited >= 7.0, f"the second attempt came {waited:.3f}s after the first, before 2 + 5 s"
    assert lookup.at > post.at, "the lookup came first"
    assert len(server.incident_list()) == 1, "no second incident"
    [row] = await alert_rows(conn)
    assert (row["state"], row["outcome"]) == ("sent", "found")
    second.proc.send_signal(signal.SIGTERM)
    assert await second.wait_exit() == 0
