"""Clocks that disagree: a host's wall clock skewed against the server it talks to.

jobfence times jobs, leases, retries and fence expiry by the database's clock (``now()``) and
waits by monotonic clocks; these tests cover the places where a time from another host's clock
meets this host's: a Better Stack ``Retry-After`` given as an HTTP date, and a token's ``nbf``
and ``iat`` minted by an issuer whose clock runs a little ahead of the Ops API's; and where a
wall clock that steps (an NTP correction, a resumed VM) must not move a lease or a delay.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import AsyncIterator
from datetime import datetime, tzinfo
from types import SimpleNamespace
from typing import Any

import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from alert_helpers import (
    alert_rows,
    make_relay,
    running,
    wait_for_alerts,
    write_dead_letter,
)
from fake_betterstack import INCIDENTS, FakeBetterStack, respond
from jobfence import MemoryQueue, Message
from jobfence.adapters import betterstack, memory
from test_api_support import PREFIX, Api, assert_problem, bearer, make_token, running_api

HOUR = 3600.0


def skew_betterstack_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """This process's wall clock, as the Better Stack adapter reads it, ``seconds`` off."""
    real = time.time
    monkeypatch.setattr(betterstack, "time", SimpleNamespace(time=lambda: real() + seconds))


@pytest.mark.parametrize("skew", [-HOUR, HOUR], ids=["relay-clock-behind", "relay-clock-ahead"])
async def test_a_retry_after_date_is_honoured_whatever_the_relay_hosts_clock_says(
    database_url: str,
    conn: AsyncConnection[Any],
    server: FakeBetterStack,
    monkeypatch: pytest.MonkeyPatch,
    skew: float,
) -> None:
    """Better Stack rate-limits with ``Retry-After`` as an HTTP date, by its own clock (the
    one its ``Date`` header shows). A relay whose clock is an hour behind must not pause every
    delivery for an hour (the cap), nor one an hour ahead retry before the date."""
    skew_betterstack_clock(monkeypatch, skew)
    retry_at = email.utils.formatdate(time.time() + 3, usegmt=True)
    server.script(
        "POST",
        INCIDENTS,
        [respond(429, {"errors": "Rate limit exceeded"}, **{"Retry-After": retry_at})],
    )
    await write_dead_letter(conn, "j1")
    relay = make_relay(database_url, server)
    async with running(relay):
        await wait_for_alerts(conn, "sent", 1, timeout=20)
    first, second = server.posts()
    assert (first.status, second.status) == (429, 201)
    gap = second.at - first.at
    assert 1.0 <= gap <= 10.0, f"retried {gap:.1f}s after the 429, not at its Retry-After date"
    [row] = await alert_rows(conn)
    assert (row["state"], row["attempts"]) == ("sent", 2)


@pytest.fixture
async def api(pool: AsyncConnectionPool[Any]) -> AsyncIterator[Api]:
    async with running_api(pool) as running_:
        yield running_


@pytest.mark.parametrize("claim", ["iat", "nbf"])
async def test_a_token_minted_by_an_issuer_a_few_seconds_ahead_is_accepted_at_once(
    api: Api, claim: str
) -> None:
    """An issuer whose clock runs 5 s ahead of the API's stamps ``iat`` (and ``nbf``) with its
    own now: the client uses the token at once and must not get a 401 for those seconds."""
    issued = int(time.time()) + 5
    token = make_token(**{claim: issued}, expires_in=300)
    response = await api.client.get(PREFIX, headers=bearer(token))
    assert response.status_code == 200, response.text


async def test_a_token_whose_nbf_is_minutes_away_is_still_refused(api: Api) -> None:
    """The tolerance is for clocks, not for tokens meant for later."""
    token = make_token(nbf=int(time.time()) + 600, expires_in=900)
    problem = assert_problem(await api.client.get(PREFIX, headers=bearer(token)), 401)
    assert "not valid yet" in problem["detail"]


def step_memory_wall_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The wall clock as the memory queue's module reads it steps by ``seconds``."""

    class Stepped(datetime):
        @classmethod
        def now(cls, tz: tzinfo | None = None) -> Stepped:
            real = datetime.now(tz)
            return cls.fromtimestamp(real.timestamp() + seconds, tz)

    monkeypatch.setattr(memory, "datetime", Stepped)


def job(job_id: str) -> Message:
    return Message(queue="q", consumer="c", job_id=job_id, body=b"{}")


@pytest.mark.parametrize("step", [HOUR, -HOUR], ids=["forward", "back"])
async def test_a_wall_clock_step_moves_no_memory_queue_lease_or_delay(
    monkeypatch: pytest.MonkeyPatch, step: float
) -> None:
    """A step forward must not end a held lease (the job handed to a second holder while the
    first still runs it), nor one back hold a due job or a short delay for the hour."""
    queue = MemoryQueue(poll_interval_seconds=0.05)
    try:
        await queue.publish(job("held"))
        [held] = await queue.receive(["q"], max_messages=1, lease_seconds=60)
        await queue.publish(job("delayed"), delay_seconds=0.3)
        step_memory_wall_clock(monkeypatch, step)
        await queue.publish(job("due"))
        got = await queue.receive(["q"], max_messages=10, lease_seconds=60, wait_seconds=2.0)
        got += await queue.receive(["q"], max_messages=10, lease_seconds=60, wait_seconds=1.0)
        assert sorted(d.message.job_id for d in got) == ["delayed", "due"]
        assert await queue.ack(held), "the first holder still holds its lease"
    finally:
        await queue.close()
