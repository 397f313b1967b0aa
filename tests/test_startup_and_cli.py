"""D3's start-up refusal, and the CLI's answer to every error a person can cause: one clear line
on stderr, a non-zero exit, no traceback, never a password."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import App, ConfigError, PgQueue, Worker
from jobfence.schema import migrations
from support import scalar

TESTS_DIR = Path(__file__).parent
# Nothing listens on port 1: a command that should fail before touching the database would
# show a connection error instead of the one expected, and fail its test.
NOWHERE = "postgresql://postgres@127.0.0.1:1/postgres"
PASSWORD = "Pw-s3cr3t-4711"
MINIMUM_TTL_SECONDS = 2 * 1162.5 + 3600  # 5925 s for the default retry policy


def run_cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    """``jobfence ARGS`` in a real process, able to import the modules in tests/."""
    env = {**os.environ, "JOBFENCE_DATABASE_URL": url}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", *args],
        env=env,
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single ``jobfence: error: ...`` line a person sees; fails on anything more."""
    assert done.returncode != 0, done
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("jobfence: error: "), lines[0]
    return lines[0]


def short_ttl_app(ttl: timedelta) -> App:
    app = App()
    app.consumer("short_fence", queue=pointsapp.QUEUE, schema=pointsapp.Award, fence_ttl=ttl)(
        pointsapp.apply_award
    )
    return app


async def test_d3_a_worker_refuses_to_start_when_a_fence_ttl_is_shorter_than_the_minimum(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    app = short_ttl_app(timedelta(hours=1))
    await conn.execute(pointsapp.SCHEMA_SQL)
    await app.enqueue(conn, "short_fence", {"account_id": 1, "points": 5}, job_id="waiting")
    queue = PgQueue(pool)
    try:
        with pytest.raises(ConfigError) as refused:
            await Worker(app, pool, queue).run(until="idle")
    finally:
        await queue.close()

    message = str(refused.value)
    assert "'short_fence'" in message  # the consumer
    assert "3600s" in message  # its TTL
    assert f"{MINIMUM_TTL_SECONDS:g}s" in message  # the minimum
    with pytest.raises(ConfigError, match="short_fence"):
        app.check_fence_ttls()
    # Refusing to start touched nothing: the job waits, undelivered, with no fence.
    assert await scalar(conn, "SELECT attempts FROM jobfence_queue.messages") == 0
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 0


def test_d3_the_minimum_fence_ttl_itself_is_accepted_and_one_second_less_is_not() -> None:
    minimum = timedelta(seconds=MINIMUM_TTL_SECONDS)
    assert short_ttl_app(minimum).consumers["short_fence"].minimum_fence_ttl == minimum
    short_ttl_app(minimum).check_fence_ttls()
    App().check_fence_ttls()  # no consumers, nothing to refuse
    pointsapp.build_app().check_fence_ttls()  # the 7-day default
    with pytest.raises(ConfigError, match=r"fence TTL 5924s \(1\.65h\) is shorter than"):
        short_ttl_app(minimum - timedelta(seconds=1)).check_fence_ttls()


async def test_d3_a_worker_whose_lease_outlasts_the_fence_margin_refuses_to_start(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    """A fence TTL of 2 h covers the default policy's window (minimum 5,925 s), not a worker
    whose lease is 3 h: a job committed by a worker killed before its ack comes back when its
    lease ends, after its fence expired, and would run again. The hour of D3's margin becomes
    twice the lease when that is longer; the default lease (300 s) leaves D3's minimum as is."""
    app = short_ttl_app(timedelta(hours=2))
    await conn.execute(pointsapp.SCHEMA_SQL)
    await app.enqueue(conn, "short_fence", {"account_id": 1, "points": 5}, job_id="waiting")
    queue = PgQueue(pool)
    try:
        with pytest.raises(ConfigError) as refused:
            await Worker(app, pool, queue, lease_seconds=3 * 3600).run(until="idle")
    finally:
        await queue.close()
    message = str(refused.value)
    assert "'short_fence'" in message and "fence TTL 7200s" in message
    assert "twice the worker's lease of 10800s" in message
    assert f"{MINIMUM_TTL_SECONDS - 3600 + 21600:g}s" in message  # 2 x window + 2 x lease
    assert await scalar(conn, "SELECT attempts FROM jobfence_queue.messages") == 0
    app.check_fence_ttls(lease_seconds=300)  # the default lease: D3's minimum
    with pytest.raises(ConfigError, match="twice the worker's lease"):
        app.check_fence_ttls(lease_seconds=3600)


async def test_d3_a_worker_letting_handlers_run_past_the_fence_margin_refuses_to_start(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    """A fence dates from the start of its transaction. A worker that lets a handler run for
    up to 3 h (``max_handler_seconds``) commits a fence up to 3 h old; killed before its ack,
    the job comes back a lease later, and a 2 h TTL (enough for the default policy and lease)
    would have let cleanup delete that fence already. The handler's time is added to D3's
    margin."""
    app = short_ttl_app(timedelta(hours=2))
    await conn.execute(pointsapp.SCHEMA_SQL)
    await app.enqueue(conn, "short_fence", {"account_id": 1, "points": 5}, job_id="waiting")
    queue = PgQueue(pool)
    try:
        with pytest.raises(ConfigError) as refused:
            await Worker(app, pool, queue, max_handler_seconds=3 * 3600).run(until="idle")
    finally:
        await queue.close()
    message = str(refused.value)
    assert "fence TTL 7200s" in message
    assert "1h + the worker's max_handler_seconds of 10800s" in message
    assert f"the minimum {MINIMUM_TTL_SECONDS + 10800:g}s" in message
    assert await scalar(conn, "SELECT attempts FROM jobfence_queue.messages") == 0
    app.check_fence_ttls(lease_seconds=300, max_handler_seconds=600)  # within the TTL


def test_a_fence_ttl_past_what_postgresql_can_date_is_refused_at_registration() -> None:
    """``now() + fence_ttl`` must be a timestamp PostgreSQL can store, or every fence insert of
    the consumer fails and none of its jobs runs: over 36,500 days is refused at once."""
    with pytest.raises(ConfigError, match=r"fence_ttl must be positive and at most 36,500 days"):
        short_ttl_app(timedelta.max)
    short_ttl_app(timedelta(days=36_500))  # a century: accepted


def test_d3_jobfence_worker_with_a_too_short_fence_ttl_prints_one_error_line() -> None:
    line = one_error_line(run_cli("worker", "cliapps.short_ttl:app", url=NOWHERE))
    assert "consumer 'short_fence'" in line
    assert "fence TTL 3600s" in line
    assert f"minimum {MINIMUM_TTL_SECONDS:g}s" in line


@pytest.mark.parametrize(
    ("args", "url", "says"),
    [
        pytest.param(
            ["migrate"],
            "not a url",
            "JOBFENCE_DATABASE_URL is not a valid libpq connection string or URL",
            id="bad-url",
        ),
        pytest.param(
            ["migrate"], NOWHERE, "cannot connect to the database at", id="unreachable-migrate"
        ),
        pytest.param(
            ["worker", "pointsapp:app"],
            NOWHERE,
            "cannot connect to the database at",
            id="unreachable-worker",
        ),
        pytest.param(
            ["worker", "no_such_module:app"],
            NOWHERE,
            "cannot import module 'no_such_module'",
            id="unknown-module",
        ),
        pytest.param(
            ["worker", "cliapps.short_ttl:not_an_app"],
            NOWHERE,
            "cliapps.short_ttl:not_an_app is not a jobfence.App (found dict)",
            id="not-an-app",
        ),
        pytest.param(
            ["worker", "pointsapp"],
            NOWHERE,
            "expected MODULE:ATTRIBUTE (e.g. myproject.jobs:app), got 'pointsapp'",
            id="no-attribute",
        ),
    ],
)
def test_cli_errors_a_person_can_cause_print_one_clear_line(
    args: list[str], url: str, says: str
) -> None:
    line = one_error_line(run_cli(*args, url=url))
    assert says in line


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://postgres:{PASSWORD}@127.0.0.1:1/postgres",
        f"host=127.0.0.1 port=1 user=postgres password={PASSWORD} dbname=postgres",
        f"postgresql://postgres:{PASSWORD}@[::1/postgres",  # unparseable: libpq quotes the URI
        f"postgresql://postgres:{PASSWORD}%zz@127.0.0.1/postgres",  # libpq quotes the token
        f"postgresql://postgres:{PASSWORD}@127.0.0.1/postgres?bogus=1",
        f"postgresql://postgres@[::1/postgres?password={PASSWORD}",
        # A percent-escape that decodes to a byte that is not UTF-8 (a password with % in it,
        # written unescaped): psycopg's parser raised UnicodeDecodeError, a traceback.
        f"postgresql://postgres:{PASSWORD}%82@127.0.0.1:1/postgres",
        f"postgresql://postgres@127.0.0.1:1/postgres?password={PASSWORD}%C3%28",
    ],
    ids=[
        "uri-unreachable",
        "keyword-unreachable",
        "bad-ipv6",
        "bad-percent",
        "bad-param",
        "query-password",
        "percent-not-utf8",
        "query-percent-not-utf8",
    ],
)
def test_the_password_in_a_database_url_never_appears_in_error_output(url: str) -> None:
    done = run_cli("migrate", url=url)
    line = one_error_line(done)
    assert PASSWORD not in done.stderr + done.stdout
    assert "cannot connect" in line or "not a valid libpq connection string" in line


def test_jobfence_migrate_twice_applies_then_says_already_up_to_date(
    empty_database_url: str,
) -> None:
    first = run_cli("migrate", url=empty_database_url)
    second = run_cli("migrate", url=empty_database_url)

    assert (first.returncode, first.stderr) == (0, "")
    assert first.stdout.splitlines() == [f"applied {m.version:04d}_{m.name}" for m in migrations()]
    assert (second.returncode, second.stderr) == (0, "")
    assert second.stdout.splitlines() == [
        f"already up to date (version {migrations()[-1].version:04d})"
    ]
