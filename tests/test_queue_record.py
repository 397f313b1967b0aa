"""Where a database's jobs go changes only on purpose, and never strands jobs.

``jobfence.settings`` records the queue. ``jobfence migrate --queue-url URL`` is the one step
that moves it (refused while the queue it leaves still holds messages, on a broker too, and for
another address of the same broker without ``--new-address``); every other command compares
the queue it is given with the record, kind and place, and refuses any difference at start-up
without changing anything. The real CLI runs in a subprocess (``tests/broker_cli.py``: the real
adapters, named after the test) against the brokers of this machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

import pointsapp
from brokers import delete_everything, make_queue
from jobfence import ConfigError
from jobfence.adapters.memory import MemoryQueue
from jobfence.model import Message
from jobfence.outbox import OutboxRelay, broker_queues, queue_setting, record_queue
from jobfence.queues import parse_queue_url
from roles_support import deployed_roles
from support import scalar, wait_until

TESTS_DIR = Path(__file__).parent
CLI = TESTS_DIR / "broker_cli.py"
PASSWORD = "Sh0wn-n0t-%2Fever"


def _with_path(url: str, path: str, *, port: int | None = None, password: str = "") -> str:
    """``url`` with another path (and port, and password when given)."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    if password:
        auth = f"{parts.username or ''}:{password}"
    host = f"{parts.hostname}:{port or parts.port}"
    return urlunsplit((parts.scheme, f"{auth}@{host}" if auth else host, path, "", ""))


def _cli(database_url: str, name: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "JOBFENCE_DATABASE_URL": database_url}
    full.pop("JOBFENCE_QUEUE_URL", None)
    full.update(JOBFENCE_TEST_BROKER_NAME=name, PYTHONPATH=str(TESTS_DIR), **env)
    return subprocess.run(
        [sys.executable, str(CLI), *args],
        env=full,
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def _run(
    database_url: str, name: str, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(_cli, database_url, name, *args, **env)


def _error(done: subprocess.CompletedProcess[str]) -> str:
    """The one ``jobfence: error:`` line of a command refused at start-up (exit status 2)."""
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("jobfence: error: ")]
    return line


async def _settings(conn: psycopg.AsyncConnection[Any]) -> tuple[Any, ...]:
    cur = await conn.execute("SELECT queue_kind, queue_location, updated_at FROM jobfence.settings")
    row = await cur.fetchone()
    assert row is not None
    return tuple(row)


async def _enqueue(conn: psycopg.AsyncConnection[Any], count: int, prefix: str) -> None:
    app = pointsapp.build_app()
    for n in range(count):
        await app.enqueue(
            conn, "award_points", {"account_id": n % 3 + 1, "points": 1}, job_id=f"{prefix}-{n}"
        )


@pytest.fixture
def name() -> str:
    return f"jfrec{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def cleanup(name: str) -> AsyncIterator[list[tuple[str, str]]]:
    """(broker, URL) pairs whose keys, streams or queues named after ``name`` go at the end."""
    used: list[tuple[str, str]] = []
    yield used
    for broker, url in used:
        await delete_everything(broker, url, name, [pointsapp.QUEUE])


# -- another address of the same broker kind -----------------------------------------------


async def test_a_relay_given_another_redis_database_is_refused_and_publishes_nothing_there(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    redis_url: str,
    name: str,
    cleanup: list[tuple[str, str]],
) -> None:
    db0, db5 = _with_path(redis_url, "/0"), _with_path(redis_url, "/5")
    cleanup += [("redis", db0), ("redis", db5)]
    await conn.execute(pointsapp.SCHEMA_SQL)
    moved = await _run(database_url, name, "migrate", "--queue-url", db0)
    assert moved.returncode == 0, moved
    await _enqueue(conn, 20, "r")
    before = await _settings(conn)

    relay = await _run(database_url, name, "outbox-relay", "--queue-url", db5)

    line = _error(relay)
    host = f"{urlsplit(redis_url).hostname}:{urlsplit(redis_url).port}"
    assert f"this database's jobs go to the redis queue at redis://{host}/0" in line, line
    assert f"given the redis queue at redis://{host}/5" in line, line
    assert await _settings(conn) == before
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 20
    import redis.asyncio as aioredis

    admin = aioredis.Redis.from_url(db5)
    assert [key async for key in admin.scan_iter(match=f"{name}:*")] == []
    await admin.aclose()

    # The queue the database records gets every job.
    worker = await _run(
        database_url, name, "worker", "pointsapp:app", "--queue-url", db0, "--until", "empty"
    )
    assert worker.returncode == 0, worker
    assert worker.stdout.strip() == "worker stopped: succeeded 20, released 0"
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == 20


@pytest.mark.parametrize("other", ["virtual host", "port"])
async def test_rabbitmq_on_another_virtual_host_or_port_is_refused_and_nothing_changes(  # noqa: PLR0917
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    amqp_url: str,
    name: str,
    cleanup: list[tuple[str, str]],
    other: str,
) -> None:
    cleanup.append(("rabbitmq", amqp_url))
    moved = await _run(database_url, name, "migrate", "--queue-url", amqp_url)
    assert moved.returncode == 0, moved
    before = await _settings(conn)
    parts = urlsplit(amqp_url)
    given = (
        _with_path(amqp_url, "/other", password=PASSWORD)
        if other == "virtual host"
        else _with_path(amqp_url, "/", port=(parts.port or 5672) + 1, password=PASSWORD)
    )
    for command in (
        ["worker", "pointsapp:app"],
        ["outbox-relay"],
        ["dead-letters", "replay", "1", "--actor", "ops"],
    ):
        done = await _run(database_url, name, *command, JOBFENCE_QUEUE_URL=given)
        line = _error(done)
        assert "this database's jobs go to the rabbitmq queue at amqp://" in line, line
        assert f"given the rabbitmq queue at {parse_queue_url(given).location}" in line, line
        assert "another address of that broker" in line, line
        assert PASSWORD not in done.stderr + done.stdout
        assert "n0t-/ever" not in done.stderr + done.stdout
        assert await _settings(conn) == before


async def test_moving_to_another_address_of_the_same_broker_needs_new_address_and_an_empty_queue(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    redis_url: str,
    name: str,
    cleanup: list[tuple[str, str]],
) -> None:
    db0, db5 = _with_path(redis_url, "/0"), _with_path(redis_url, "/5")
    cleanup += [("redis", db0), ("redis", db5)]
    assert (await _run(database_url, name, "migrate", "--queue-url", db0)).returncode == 0
    before = await _settings(conn)

    unconfirmed = _error(await _run(database_url, name, "migrate", "--queue-url", db5))
    assert "is another address of the redis broker this database's jobs go to" in unconfirmed
    assert "--new-address" in unconfirmed
    assert await _settings(conn) == before

    left = make_queue("redis", db0, name)  # a job already on the broker the move would leave
    await left.publish(
        Message(queue=pointsapp.QUEUE, consumer="award_points", job_id="on-db0", body=b"{}")
    )
    await left.close()
    full = _error(await _run(database_url, name, "migrate", "--queue-url", db5, "--new-address"))
    assert "the redis queue at redis://" in full and "/0 still holds 1 message(s)" in full, full
    assert await _settings(conn) == before

    await delete_everything("redis", db0, name, [pointsapp.QUEUE])  # as if a worker ran it
    moved = await _run(database_url, name, "migrate", "--queue-url", db5, "--new-address")
    assert moved.returncode == 0, moved
    setting = await queue_setting(conn)
    assert (setting.kind, setting.location) == ("redis", parse_queue_url(db5).location)
    # The same place again (another spelling of it) changes nothing.
    after = await _settings(conn)
    again = await _run(database_url, name, "migrate", "--queue-url", f"{db5}?socket_timeout=5")
    assert again.returncode == 0, again
    assert again.stdout.splitlines()[-1].startswith("jobs already go to the redis queue at ")
    assert await _settings(conn) == after


# -- a move away from a broker that still holds jobs -----------------------------------------


async def test_migrate_away_from_a_rabbitmq_holding_20_published_jobs_is_refused_until_they_ran(  # noqa: PLR0917
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    amqp_url: str,
    nats_url: str,
    name: str,
    cleanup: list[tuple[str, str]],
) -> None:
    cleanup += [("rabbitmq", amqp_url), ("nats", nats_url)]
    await conn.execute(pointsapp.SCHEMA_SQL)
    assert (await _run(database_url, name, "migrate", "--queue-url", amqp_url)).returncode == 0
    await _enqueue(conn, 20, "q")

    # The relay publishes the 20 jobs to RabbitMQ; no worker runs yet.
    env = {**os.environ, "JOBFENCE_DATABASE_URL": database_url, "JOBFENCE_QUEUE_URL": amqp_url}
    env.update(JOBFENCE_TEST_BROKER_NAME=name, PYTHONPATH=str(TESTS_DIR))
    relay = await asyncio.create_subprocess_exec(
        sys.executable,
        str(CLI),
        "outbox-relay",
        "--poll-seconds",
        "0.1",
        env=env,
        cwd=TESTS_DIR,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        async def published() -> bool:
            return await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0

        await wait_until(published, timeout=60, message="the relay to publish the 20 jobs")
        before = await _settings(conn)
        # A relay still running would go on publishing to RabbitMQ after the move.
        running = _error(await _run(database_url, name, "migrate", "--queue-url", nats_url))
        assert "an outbox relay is publishing to the rabbitmq queue at amqp://" in running
        assert await _settings(conn) == before
    finally:
        relay.send_signal(signal.SIGTERM)
        await asyncio.wait_for(relay.wait(), 30)

    refused = await _run(database_url, name, "migrate", "--queue-url", nats_url)

    line = _error(refused)
    assert "the rabbitmq queue at amqp://" in line and "still holds 20 message(s)" in line, line
    assert "jobfence worker APP --until empty" in line
    assert await _settings(conn) == before

    worker = await _run(
        database_url, name, "worker", "pointsapp:app", "--queue-url", amqp_url, "--until", "empty"
    )
    assert worker.returncode == 0, worker
    assert worker.stdout.strip() == "worker stopped: succeeded 20, released 0"

    moved = await _run(database_url, name, "migrate", "--queue-url", nats_url)
    assert moved.returncode == 0, moved
    assert moved.stdout.splitlines()[-1] == (
        f"jobs go to the nats queue at {parse_queue_url(nats_url).location}"
    )
    assert (await queue_setting(conn)).kind == "nats"


# -- a stray JOBFENCE_QUEUE_URL, memory:// -------------------------------------------------


async def test_a_stray_queue_url_on_a_replay_of_a_missing_dead_letter_leaves_the_record_unchanged(
    database_url: str, conn: psycopg.AsyncConnection[Any], redis_url: str, name: str
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    before = await _settings(conn)
    stray = _with_path(redis_url, "/7")

    done = await _run(
        database_url, name, "dead-letters", "replay", "999999", JOBFENCE_QUEUE_URL=stray
    )

    line = _error(done)
    assert "this database's jobs go to the PostgreSQL queue" in line, line
    assert "nothing was changed" in line
    assert await _settings(conn) == before
    # New jobs still go to the PostgreSQL queue, where its workers read them.
    await _enqueue(conn, 1, "after")
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 1
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0


async def test_memory_queue_url_is_never_recorded_in_a_real_database(
    database_url: str, conn: psycopg.AsyncConnection[Any], name: str
) -> None:
    before = await _settings(conn)
    for command in (["worker", "pointsapp:app"], ["outbox-relay"], ["migrate"]):
        line = _error(await _run(database_url, name, *command, JOBFENCE_QUEUE_URL="memory://"))
        assert "this database's jobs go to the PostgreSQL queue" in line, (command, line)
    moved = _error(await _run(database_url, name, "migrate", "--queue-url", "memory://"))
    assert "memory:// lives inside one process: it is never recorded in a database" in moved
    with pytest.raises(ConfigError, match="never recorded in a database"):
        await record_queue(conn, "memory", "memory://")
    assert await _settings(conn) == before


# -- no command but the move changes the record --------------------------------------------

COMMANDS: dict[str, tuple[list[str], bool]] = {
    # name: (arguments, refused at start-up because the queue differs)
    "worker": (["worker", "pointsapp:app", "--until", "empty"], True),
    "outbox-relay": (["outbox-relay"], True),
    "api": (["api", "--port", "0"], True),
    "demo": (["demo", "--jobs", "1", "--duplicates", "0"], True),
    "migrate": (["migrate"], True),
    "dead-letters replay": (["dead-letters", "replay", "999999", "--actor", "ops"], True),
    "dead-letters replay-bulk": (["dead-letters", "replay-bulk", "--all", "--actor", "ops"], True),
    "dead-letters list": (["dead-letters", "list"], False),
    "dead-letters discard": (
        ["dead-letters", "discard", "999999", "--reason", "r", "--actor", "ops"],
        False,
    ),
    "cleanup": (["cleanup"], False),
    "alert-relay": (["alert-relay"], False),
}


@pytest.mark.parametrize("recorded", ["postgresql", "redis"])
@pytest.mark.parametrize("command", list(COMMANDS))
async def test_no_command_but_the_move_ever_changes_the_record(  # noqa: PLR0917
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    redis_url: str,
    name: str,
    command: str,
    recorded: str,
) -> None:
    if recorded == "redis":
        await record_queue(conn, "redis", parse_queue_url(_with_path(redis_url, "/0")).location)
    before = await _settings(conn)
    args, compares = COMMANDS[command]
    env = {
        "JOBFENCE_QUEUE_URL": _with_path(redis_url, "/9"),
        "JOBFENCE_JWT_SECRET": "a3f9c2e87b1d4065f2a9e8c7d3b1f0a6e5d4c3b2",
    }

    try:
        done: subprocess.CompletedProcess[str] | None = await asyncio.to_thread(
            lambda: subprocess.run(
                [sys.executable, str(CLI), *args],
                env={
                    **os.environ,
                    "JOBFENCE_DATABASE_URL": database_url,
                    "JOBFENCE_TEST_BROKER_NAME": name,
                    "PYTHONPATH": str(TESTS_DIR),
                    **env,
                },
                cwd=TESTS_DIR,
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
        )
    except subprocess.TimeoutExpired:  # a command that serves on (alert-relay): it ran
        done = None

    if compares:
        assert done is not None
        line = _error(done)
        assert "this database's jobs go to" in line and "/9" in line, line
    assert await _settings(conn) == before


# -- migrate and an exported JOBFENCE_QUEUE_URL ----------------------------------------------


async def test_migrate_with_an_exported_queue_url_records_it_only_on_a_database_it_creates(
    empty_database_url: str, database_url: str, redis_url: str, name: str
) -> None:
    url = _with_path(redis_url, "/0")
    first = await _run(empty_database_url, name, "migrate", JOBFENCE_QUEUE_URL=url)
    assert first.returncode == 0, first
    assert first.stdout.splitlines()[-1] == f"jobs go to {parse_queue_url(url).describe()}"
    async with await psycopg.AsyncConnection.connect(empty_database_url, autocommit=True) as c:
        assert (await queue_setting(c)).location == parse_queue_url(url).location
        # The producing app started next writes the outbox, which the broker's relay reads.
        await c.execute(pointsapp.SCHEMA_SQL)
        await _enqueue(c, 1, "deploy")
        assert await scalar(c, "SELECT count(*) FROM jobfence.outbox") == 1
        assert await scalar(c, "SELECT count(*) FROM jobfence_queue.messages") == 0
    again = await _run(empty_database_url, name, "migrate", JOBFENCE_QUEUE_URL=url)
    assert again.returncode == 0, again
    assert again.stdout.splitlines()[-1].endswith("as JOBFENCE_QUEUE_URL says")

    # A database that already exists (here on the PostgreSQL queue) is only compared.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
        before = await _settings(c)
        line = _error(await _run(database_url, name, "migrate", JOBFENCE_QUEUE_URL=url))
        assert "this database's jobs go to the PostgreSQL queue" in line, line
        assert "jobfence migrate --queue-url URL" in line
        assert await _settings(c) == before


# -- what names a place ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("amqp://u:p@Rabbit:5672/", "amqp://other@rabbit/"),
        ("amqp://rabbit/prod", "amqp://rabbit:5672/prod?prefetch=50&heartbeat=10"),
        ("redis://h/0", "redis://:pw@h:6379"),
        ("nats://a:4222", "nats://user:pw@A"),
    ],
)
def test_the_same_place_whatever_the_user_default_port_or_tuning(a: str, b: str) -> None:
    assert parse_queue_url(a).place == parse_queue_url(b).place
    # A recorded location (no password) names the same place as the URL it came from.
    assert parse_queue_url(parse_queue_url(b).location).place == parse_queue_url(a).place


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("amqp://rabbit/", "amqp://rabbit/prod"),
        ("amqp://rabbit:5672/", "amqp://rabbit:5673/"),
        ("amqp://rabbit/", "amqp://rabbit.internal/"),
        ("redis://h/0", "redis://h/5"),
        ("redis://h:6379/0", "redis://h:6380/0"),
        ("nats://a:4222", "nats://b:4222"),
    ],
)
def test_another_place_for_another_host_port_virtual_host_or_database(a: str, b: str) -> None:
    assert parse_queue_url(a).place != parse_queue_url(b).place


# -- what the move counts on a broker that cannot list its queues ----------------------------


async def test_the_runtime_roles_relay_writes_down_each_queue_it_publishes_to_without_a_grant(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """RabbitMQ cannot list its queues, so the move counts those the relay published to; the
    relay writes them down through a function, as the relay role of `jobfence roles`."""
    with deployed_roles(database_url) as roles:
        await record_queue(conn, "rabbitmq", "amqp://broker/")
        app = pointsapp.build_app()
        for n in range(3):
            await app.enqueue(conn, "award_points", {"account_id": 1, "points": 1}, job_id=f"b{n}")
        queue = MemoryQueue()
        relay_url = roles["relay"]
        async with await psycopg.AsyncConnection.connect(relay_url, autocommit=True) as relay_conn:
            await OutboxRelay(relay_url, queue).run_round(relay_conn)
        assert await queue.backlog([]) == 3
        assert await broker_queues(conn) == [pointsapp.QUEUE]
        # Forgotten once the database moves on.
        await queue.close()
        await record_queue(conn, "nats", "nats://broker:4222")
        assert await broker_queues(conn) == []


async def test_from_queue_url_must_name_the_broker_the_move_leaves(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    redis_url: str,
    name: str,
    cleanup: list[tuple[str, str]],
) -> None:
    db0, db3 = _with_path(redis_url, "/0"), _with_path(redis_url, "/3")
    cleanup.append(("redis", db0))
    assert (await _run(database_url, name, "migrate", "--queue-url", db0)).returncode == 0
    before = await _settings(conn)

    wrong = _error(
        await _run(
            database_url, name, "migrate", "--queue-url", "postgresql", "--from-queue-url", db3
        )
    )
    assert f"--from-queue-url names {parse_queue_url(db3).describe()}, but" in wrong, wrong
    assert await _settings(conn) == before
    alone = _error(await _run(database_url, name, "migrate", "--from-queue-url", db0))
    assert "--from-queue-url and --new-address go with --queue-url URL" in alone

    moved = await _run(
        database_url, name, "migrate", "--queue-url", "postgresql", "--from-queue-url", db0
    )
    assert moved.returncode == 0, moved
    assert moved.stdout.splitlines()[-1] == "jobs go to the PostgreSQL queue"
    assert (await queue_setting(conn)).kind == "postgresql"


async def test_a_hostile_recorded_location_is_refused_in_one_line(
    database_url: str, conn: psycopg.AsyncConnection[Any], redis_url: str, name: str
) -> None:
    hostile = "redis://h:6379/0\njobfence: error: all good\x1b[2J" + "x" * 1000
    await conn.execute(
        "UPDATE jobfence.settings SET queue_kind = 'redis', queue_location = %s", (hostile,)
    )
    before = await _settings(conn)
    done = await _run(database_url, name, "worker", "pointsapp:app", JOBFENCE_QUEUE_URL=redis_url)
    line = _error(done)
    assert "this database's jobs go to the redis queue at redis://h:6379/0\\njobfence" in line
    assert "\x1b" not in done.stderr and "all good" not in done.stderr.replace(line, "")
    assert len(line) < 1000
    assert await _settings(conn) == before
