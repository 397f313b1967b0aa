"""The outbox with real processes: ``jobfence outbox-relay`` SIGKILLed mid-publish, its
metrics, and the queue URL checked at start-up (a bad scheme, an unreachable host, an adapter
not installed) by the real CLI, never printing the password.

The broker behind ``amqp://`` here is ``tests/outbox_relay_proc.py``'s: the PostgreSQL queue
table published to outside any transaction, so what the killed relay published survives it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import PgQueue, Worker
from jobfence.outbox import queue_setting, record_queue
from support import scalar, wait_until

TESTS_DIR = Path(__file__).parent
PROC = TESTS_DIR / "outbox_relay_proc.py"
PASSWORD = "s3cr%2Ft-pw"  # percent-encoded, as a URL carries it
DECODED = "s3cr/t-pw"


class Proc:
    def __init__(self, args: list[str], *, url: str, log: Path, **env: str) -> None:
        self.log = log
        full_env = {**os.environ, "JOBFENCE_DATABASE_URL": url, **env}
        full_env.pop("JOBFENCE_QUEUE_URL", None)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(PROC), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=TESTS_DIR,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_exit(self, within: float = 30.0) -> int:
        async def exited() -> bool:
            return self.proc.poll() is not None

        await wait_until(exited, timeout=within, message=f"the process to exit:\n{self.output()}")
        assert self.proc.returncode is not None
        return self.proc.returncode

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.cleanup()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_relay_killed_mid_publish_loses_nothing_and_each_job_applies_once(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
    tmp_path: Path,
    procs: list[Proc],
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    await record_queue(conn, "rabbitmq", "amqp://broker/")
    app = pointsapp.build_app()
    for n in (1, 2, 3):
        await app.enqueue(conn, "award_points", {"account_id": n, "points": 10}, job_id=f"k-{n}")
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 3
    relay_args = ["outbox-relay", "--queue-url", "amqp://broker/", "--poll-seconds", "0.05"]

    # 1. The broker confirms the first publish; the relay dies before its own commit.
    marker = tmp_path / "published"
    stalled = Proc(
        relay_args,
        url=database_url,
        log=tmp_path / "stalled.log",
        JOBFENCE_TEST_STALL_MARKER=str(marker),
    )
    procs.append(stalled)

    async def published_once() -> bool:
        assert stalled.proc.poll() is None, stalled.output()
        return marker.exists()

    await wait_until(published_once, timeout=30, message="the first publish")
    stalled.proc.send_signal(signal.SIGKILL)
    assert await stalled.wait_exit() == -signal.SIGKILL
    assert marker.read_text() == "k-1"
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 1
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 3  # nothing lost

    # 2. A new relay publishes everything again (k-1 a second time), with its metrics.
    port = _free_port()
    relay = Proc(
        [*relay_args, "--metrics-port", str(port)], url=database_url, log=tmp_path / "relay.log"
    )
    procs.append(relay)

    async def drained() -> bool:
        assert relay.proc.poll() is None, relay.output()
        return await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0

    await wait_until(drained, timeout=30, message="the outbox to drain")

    async def metrics_show_it() -> bool:
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        except httpx.HTTPError:
            return False
        lines = set(text.splitlines())
        return {
            "jobfence_outbox_published_total 3.0",
            "jobfence_outbox_failed_total 0.0",
            "jobfence_outbox_waiting 0.0",
            "jobfence_outbox_oldest_age_seconds 0.0",
        } <= lines

    await wait_until(metrics_show_it, timeout=20, message="the relay's metrics")
    relay.proc.send_signal(signal.SIGTERM)
    assert await relay.wait_exit() == 0, relay.output()
    assert "outbox relay stopped: published 3, failed publishes 0" in relay.output()

    # 3. At least once on the broker, exactly once in effect.
    cur = await conn.execute(
        "SELECT job_id, count(*) FROM jobfence_queue.messages GROUP BY 1 ORDER BY 1"
    )
    assert await cur.fetchall() == [("k-1", 2), ("k-2", 1), ("k-3", 1)]
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    try:
        stats = await Worker(app, pool, queue, poll_seconds=0.05, outbox_relay=False).run(
            until="empty"
        )
    finally:
        await queue.close()
    assert stats.outcomes == {"succeeded": 3, "duplicate": 1}
    cur = await conn.execute("SELECT job_id, count(*) FROM public.awards GROUP BY 1 ORDER BY 1")
    assert await cur.fetchall() == [("k-1", 1), ("k-2", 1), ("k-3", 1)]


def _run(database_url: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JOBFENCE_DATABASE_URL": database_url}
    env.pop("JOBFENCE_QUEUE_URL", None)
    env.update(extra)
    return subprocess.run(
        [sys.executable, str(PROC), *args],
        env=env,
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _assert_refused(done: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("jobfence: error: ")]
    for text in expected:
        assert text in line, line
    assert PASSWORD not in done.stderr + done.stdout
    assert DECODED not in done.stderr + done.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["worker", "pointsapp:app"],
        ["outbox-relay"],
        ["dead-letters", "replay", "1"],
        ["api"],
        ["demo"],
    ],
)
def test_a_queue_url_with_an_unknown_scheme_is_refused_at_start_up(
    database_url: str, command: list[str]
) -> None:
    done = _run(database_url, *command, "--queue-url", f"kafka://app:{PASSWORD}@broker:9092/")
    _assert_refused(
        done,
        "JOBFENCE_QUEUE_URL: 'kafka://app:***@broker:9092/' is not a queue URL",
        "amqp://, amqps://, nats://, tls://, redis://, rediss://",
    )


async def test_an_unreachable_broker_is_refused_at_start_up_without_its_password(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    port = _free_port()  # nothing listens there
    url = f"redis://app:{PASSWORD}@127.0.0.1:{port}/0"
    await record_queue(conn, "redis", f"redis://127.0.0.1:{port}/0")
    done = await asyncio.to_thread(
        _run, database_url, "worker", "pointsapp:app", "--queue-url", url
    )
    _assert_refused(
        done,
        f"cannot open the redis queue at redis://127.0.0.1:{port}/0: ConnectionError",
        f"Error connecting to redis://app:***@127.0.0.1:{port}/0",
    )


async def test_the_queue_url_variable_is_read_and_a_missing_adapter_names_its_extra(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await record_queue(conn, "nats", "nats://127.0.0.1:4222")
    done = await asyncio.to_thread(
        _run,
        database_url,
        "dead-letters",
        "replay-bulk",
        "--all",
        JOBFENCE_QUEUE_URL=f"nats://app:{PASSWORD}@127.0.0.1:4222",
    )
    assert done.returncode == 2, done
    assert "pip install 'jobfence[nats]'" in done.stderr
    assert "jobfence_test_adapter_not_installed is not installed" in done.stderr
    assert PASSWORD not in done.stderr and DECODED not in done.stderr
    # Refused before anything changed: no bulk run.
    assert (await queue_setting(conn)).kind == "nats"
    assert await scalar(conn, "SELECT count(*) FROM jobfence.bulk_replays") == 0


async def test_a_cli_replay_on_a_broker_the_database_moved_to_writes_the_outbox(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    cur = await conn.execute(
        """INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts,
               last_error, error_class)
           VALUES ('dl-1', 'loyalty', 'award_points', '{"account_id": 1, "points": 2}', 6,
                   'Flaky: timeout', 'Flaky') RETURNING id"""
    )
    row = await cur.fetchone()
    assert row is not None
    replay = ["dead-letters", "replay", str(row[0]), "--queue-url", "amqp://broker/"]
    # Not moved by the replay: refused, nothing changed.
    refused = await asyncio.to_thread(_run, database_url, *replay)
    assert refused.returncode == 2, refused
    assert "this database's jobs go to the PostgreSQL queue" in refused.stderr
    assert (await queue_setting(conn)).kind == "postgresql"
    assert await scalar(conn, "SELECT status FROM core.dead_letters") == "pending_review"

    moved = await asyncio.to_thread(_run, database_url, "migrate", "--queue-url", "amqp://broker/")
    assert moved.returncode == 0, moved
    done = await asyncio.to_thread(_run, database_url, *replay)
    assert done.returncode == 0, done
    assert (await queue_setting(conn)).kind == "rabbitmq"
    cur = await conn.execute("SELECT job_id FROM jobfence.outbox")
    assert await cur.fetchall() == [("dl-1",)]
    assert await scalar(conn, "SELECT status FROM core.dead_letters") == "replayed"
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0

    # A command on the PostgreSQL queue is now refused: its jobs would go where no one reads.
    refused = await asyncio.to_thread(_run, database_url, "worker", "pointsapp:app")
    assert refused.returncode == 2, refused
    assert "this database's jobs go to the rabbitmq queue at amqp://broker/" in refused.stderr


async def test_migrate_queue_url_moves_the_database_and_refuses_while_jobs_would_be_stranded(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    url = f"amqp://app:{PASSWORD}@rabbit.internal:5672/prod"
    moved = await asyncio.to_thread(_run, database_url, "migrate", "--queue-url", url)
    assert moved.returncode == 0, moved
    assert moved.stdout.splitlines()[-1] == (
        "jobs go to the rabbitmq queue at amqp://rabbit.internal:5672/prod"
    )
    setting = await queue_setting(conn)
    assert (setting.kind, setting.location) == ("rabbitmq", "amqp://rabbit.internal:5672/prod")
    assert PASSWORD not in moved.stdout + moved.stderr

    app = pointsapp.build_app()
    await app.enqueue(conn, "award_points", {"account_id": 1, "points": 1}, job_id="m-1")
    back = await asyncio.to_thread(_run, database_url, "migrate", "--queue-url", "postgresql")
    assert back.returncode == 2, back
    assert "the outbox still holds 1 message(s) for rabbitmq" in back.stderr
    assert (await queue_setting(conn)).kind == "rabbitmq"
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 1

    await conn.execute("DELETE FROM jobfence.outbox")  # as if the relay had published it
    back = await asyncio.to_thread(_run, database_url, "migrate", "--queue-url", "postgresql")
    assert back.returncode == 0, back
    assert back.stdout.splitlines()[-1] == "jobs go to the PostgreSQL queue"
    assert (await queue_setting(conn)).kind == "postgresql"


async def test_the_worker_command_on_a_broker_runs_the_relay_unless_told_not_to(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    await record_queue(conn, "rabbitmq", "amqp://broker/")
    app = pointsapp.build_app()
    for n in (1, 2):
        await app.enqueue(conn, "award_points", {"account_id": n, "points": 3}, job_id=f"w-{n}")
    args = ["worker", "pointsapp:app", "--queue-url", "amqp://broker/", "--until", "empty"]

    without = await asyncio.to_thread(_run, database_url, *args, "--no-outbox-relay")
    assert without.returncode == 0, without
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 2
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == 0

    done = await asyncio.to_thread(_run, database_url, *args)
    assert done.returncode == 0, done
    assert "with the outbox relay" in done.stderr
    assert done.stdout.strip() == "worker stopped: succeeded 2, released 0"
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == 2
