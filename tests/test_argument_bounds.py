"""Bad arguments get one clear refusal that names the argument and its bounds, before anything
is written or started: a delay that is not a finite number of seconds within its limit, on every
enqueue path, and a numeric flag of a command out of its range. Without them, a NaN delay failed
with a bare "cannot convert float NaN to integer", and ``worker --lease-seconds 1e308`` started,
then failed every fetch with an OverflowError."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from brokers import BROKERS, make_queue, on_broker
from jobfence import (
    ConfigError,
    JobRefused,
    MemoryQueue,
    Message,
    PgQueue,
    Producer,
    Worker,
    outbox,
)
from jobfence.limits import MAX_DELAY_SECONDS
from support import scalar

ROUTES = {"award_points": pointsapp.QUEUE}
PAYLOAD = {"account_id": 1, "points": 5}

BAD_DELAYS = [
    pytest.param(
        float("nan"), "delay_seconds must be a finite number of seconds, got nan", id="nan"
    ),
    pytest.param(
        float("inf"), "delay_seconds must be a finite number of seconds, got inf", id="inf"
    ),
    pytest.param(
        float("-inf"), "delay_seconds must be a finite number of seconds, got -inf", id="minus-inf"
    ),
    pytest.param(
        1e15,
        "delay_seconds is 1e+15 seconds, over the limit of 315,360,000 (3,650 days)",
        id="1e15",
    ),
    pytest.param("10", "delay_seconds must be a number of seconds, not str", id="a-string"),
]


@pytest.fixture
def sync_conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(database_url)
    yield conn
    conn.close()


@pytest.mark.parametrize(("delay", "says"), BAD_DELAYS)
async def test_every_enqueue_path_refuses_a_bad_delay_naming_it_and_writes_nothing(
    conn: psycopg.AsyncConnection[Any],
    sync_conn: psycopg.Connection[Any],
    delay: Any,
    says: str,
) -> None:
    app = pointsapp.build_app()
    producer = Producer(routes=ROUTES)
    refusals: list[JobRefused] = []
    attempts = [
        lambda: app.enqueue(conn, "award_points", PAYLOAD, job_id="a", delay_seconds=delay),
        lambda: producer.enqueue(conn, "award_points", PAYLOAD, job_id="b", delay_seconds=delay),
        lambda: outbox.write(
            conn, app.message("award_points", PAYLOAD, job_id="c"), delay_seconds=delay
        ),
    ]
    for attempt in attempts:
        with pytest.raises(JobRefused) as refused:
            await attempt()
        refusals.append(refused.value)
    for sync_attempt in (
        lambda: app.enqueue_sync(
            sync_conn, "award_points", PAYLOAD, job_id="d", delay_seconds=delay
        ),
        lambda: producer.enqueue_sync(
            sync_conn, "award_points", PAYLOAD, job_id="e", delay_seconds=delay
        ),
    ):
        with pytest.raises(JobRefused) as refused:
            sync_attempt()
        refusals.append(refused.value)
    assert [(r.field, str(r)) for r in refusals] == [("delay_seconds", f"job refused: {says}")] * 5
    sync_conn.commit()
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0


async def test_a_delay_at_its_limit_or_negative_is_accepted(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    app = pointsapp.build_app()
    await app.enqueue(conn, "award_points", PAYLOAD, job_id="far", delay_seconds=MAX_DELAY_SECONDS)
    await app.enqueue(conn, "award_points", PAYLOAD, job_id="now", delay_seconds=-5)
    cur = await conn.execute(
        "SELECT job_id, round(extract(epoch FROM run_at - now()) / 86400)"
        " FROM jobfence_queue.messages ORDER BY job_id"
    )
    assert await cur.fetchall() == [("far", 3650), ("now", 0)]


def _worker(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["worker", "pointsapp:app", "--lease-seconds", "1e308"],
            "argument --lease-seconds: must be a number of seconds from 0 (excluded) to"
            " 604800, got '1e308'",
        ),
        (
            ["worker", "pointsapp:app", "--lease-seconds", "nan"],
            "argument --lease-seconds: must be a number of seconds from 0 (excluded) to"
            " 604800, got 'nan'",
        ),
        (
            ["worker", "pointsapp:app", "--max-handler-seconds", "1e20"],
            "argument --max-handler-seconds: must be a number of seconds from 0 (excluded) to"
            " 604800, got '1e20'",
        ),
        (
            ["worker", "pointsapp:app", "--grace-seconds", "inf"],
            "argument --grace-seconds: must be a number of seconds from 0 (excluded) to"
            " 86400, got 'inf'",
        ),
        (
            ["worker", "pointsapp:app", "--concurrency", "100000"],
            "argument --concurrency: must be a whole number from 1 to 10000, got '100000'",
        ),
        (
            ["worker", "pointsapp:app", "--concurrency", "2.5"],
            "argument --concurrency: must be a whole number from 1 to 10000, got '2.5'",
        ),
        (
            ["worker", "pointsapp:app", "--batch-size", "0"],
            "argument --batch-size: must be a whole number from 1 to 10000, got '0'",
        ),
        (
            ["worker", "pointsapp:app", "--metrics-port", "70000"],
            "argument --metrics-port: must be a whole number from 0 to 65535, got '70000'",
        ),
        (
            ["worker", "pointsapp:app", "--metrics-port", "http"],
            "argument --metrics-port: must be a whole number from 0 to 65535, got 'http'",
        ),
        (
            ["cleanup", "--every", "1e308"],
            "argument --every: must be a number of seconds from 0 (excluded) to 604800,"
            " got '1e308'",
        ),
        (
            ["cleanup", "--batch-size", "1e9"],
            "argument --batch-size: must be a whole number from 1 to 1000000, got '1e9'",
        ),
        (
            ["outbox-relay", "--poll-seconds", "1e308"],
            "argument --poll-seconds: must be a number of seconds from 0 (excluded) to"
            " 3600, got '1e308'",
        ),
        (
            ["alert-relay", "--poll-seconds", "-1"],
            "argument --poll-seconds: must be a number of seconds from 0 (excluded) to"
            " 3600, got '-1'",
        ),
        (
            ["api", "--port", "-1"],
            "argument --port: must be a whole number from 0 to 65535, got '-1'",
        ),
        (
            ["api", "--pool-size", "0"],
            "argument --pool-size: must be a whole number from 1 to 10000, got '0'",
        ),
        (
            ["demo", "--duplicates", "-1"],
            "argument --duplicates: must be a whole number from 0 to 1000000, got '-1'",
        ),
    ],
)
def test_a_numeric_flag_out_of_its_range_is_refused_at_start_up_naming_the_flag(
    args: list[str], says: str
) -> None:
    result = _worker(*args)
    assert result.returncode == 2, result
    assert says in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("broker", ["memory", "postgresql", *BROKERS])
async def test_every_queue_adapter_refuses_a_nan_delay_naming_it(
    request: pytest.FixtureRequest, pool: AsyncConnectionPool[Any], broker: str
) -> None:
    """A NaN delay is not "no delay" on a broker (``nan > 0`` is False): refused everywhere."""
    message = Message(pointsapp.QUEUE, "award_points", "j", b"{}")
    if broker in ("memory", "postgresql"):
        queue: Any = MemoryQueue() if broker == "memory" else PgQueue(pool)
        try:
            with pytest.raises(JobRefused, match="delay_seconds must be a finite number"):
                await queue.publish(message, delay_seconds=float("nan"))
        finally:
            await queue.close()
        return
    request.param = broker
    async with on_broker(request, [pointsapp.QUEUE]) as (kind, url, name):
        queue = make_queue(kind, url, name)
        try:
            with pytest.raises(JobRefused, match="delay_seconds must be a finite number"):
                await queue.publish(message, delay_seconds=float("nan"))
        finally:
            await queue.close()


@pytest.mark.parametrize("lease", [1e308, float("inf"), 604_801.0])
def test_a_worker_refuses_a_lease_over_seven_days(
    pool: AsyncConnectionPool[Any], lease: float
) -> None:
    with pytest.raises(ConfigError, match=r"lease_seconds must be"):
        Worker(pointsapp.build_app(), pool, MemoryQueue(), lease_seconds=lease)
