"""``jobfence worker`` stopped by SIGINT: the first says what it waits for and lets the running
jobs finish; a second stops at once, rolling back and giving back what it holds. Nothing is lost
either way: a second worker then applies every job exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pointsapp
from support import scalar, wait_until

TESTS_DIR = Path(__file__).parent
JOBS = 6
CONCURRENCY = 3


class CliWorker:
    """``jobfence worker cliapps.slow:app`` in a real process; its stderr and stdout in files."""

    def __init__(self, database_url: str, workdir: Path, *args: str, slow_seconds: float) -> None:
        self.stdout = workdir / "stdout.txt"
        self.stderr = workdir / "stderr.txt"
        env = {
            **os.environ,
            "JOBFENCE_DATABASE_URL": database_url,
            "SLOW_SECONDS": str(slow_seconds),
            "PYTHONUNBUFFERED": "1",
        }
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jobfence.cli", "worker", "cliapps.slow:app", *args],
                stdout=out,
                stderr=err,
                env=env,
                cwd=TESTS_DIR,
            )

    def output(self) -> str:
        return f"stdout:\n{self.stdout.read_text()}\nstderr:\n{self.stderr.read_text()}"

    async def wait_for_line(self, text: str, within: float = 20.0) -> str:
        async def printed() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the worker exited early:\n{self.output()}")
            return text in self.stderr.read_text()

        await wait_until(printed, timeout=within, message=f"{text!r} in:\n{self.output()}")
        [line] = [line for line in self.stderr.read_text().splitlines() if text in line]
        return line

    async def wait_exit(self, within: float) -> int:
        async def exited() -> bool:
            return self.proc.poll() is not None

        await wait_until(exited, timeout=within, message=f"the worker to exit:\n{self.output()}")
        assert self.proc.returncode is not None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def workers() -> Iterator[list[CliWorker]]:
    started: list[CliWorker] = []
    yield started
    for worker in started:
        worker.kill()


async def enqueue_jobs(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    async with conn.transaction():
        for i in range(JOBS):
            # One account each: the running jobs do not wait on each other's row lock.
            await app.enqueue(
                conn, "award_points", {"account_id": i + 1, "points": 1}, job_id=f"j{i}"
            )


async def wait_running(conn: psycopg.AsyncConnection[Any], count: int) -> None:
    """Until ``count`` handlers sleep inside their transactions."""

    async def running() -> bool:
        return (
            await scalar(
                conn,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state = 'active' AND query LIKE 'SELECT pg_sleep(%'",
            )
            == count
        )

    await wait_until(running, timeout=20, message=f"{count} handlers running")


async def assert_each_applied_once_by_a_second_worker(
    conn: psycopg.AsyncConnection[Any], database_url: str, workdir: Path, workers: list[CliWorker]
) -> None:
    second = CliWorker(database_url, workdir, "--until", "empty", slow_seconds=0)
    workers.append(second)
    assert await second.wait_exit(within=60) == 0, second.output()
    assert await scalar(conn, "SELECT count(*) FROM awards") == JOBS
    assert await scalar(conn, "SELECT count(DISTINCT job_id) FROM awards") == JOBS
    assert await scalar(conn, "SELECT sum(points) FROM accounts") == JOBS
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == JOBS
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0


async def test_a_second_sigint_stops_at_once_and_gives_every_job_back(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    tmp_path: Path,
    workers: list[CliWorker],
) -> None:
    await enqueue_jobs(conn)
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    worker = CliWorker(database_url, first_dir, "--concurrency", str(CONCURRENCY), slow_seconds=600)
    workers.append(worker)
    await wait_running(conn, CONCURRENCY)

    worker.proc.send_signal(signal.SIGINT)
    line = await worker.wait_for_line("stopping:")
    assert line.endswith(
        f"stopping: waiting for {CONCURRENCY} running job(s) (up to 30s; press Ctrl-C again to"
        " stop now)"
    )
    worker.proc.send_signal(signal.SIGINT)
    assert await worker.wait_exit(within=10) == 128 + signal.SIGINT, worker.output()

    out = worker.stdout.read_text()
    assert "worker stopped: released 6" in out
    assert (
        f"stopped at once by a second SIGINT: {CONCURRENCY} running job(s) cut off, rolled back"
        " and given back to the queue"
    ) in out
    assert "Traceback" not in worker.output()
    # Every job is back in the queue, its delivery not counted; no effect committed.
    assert await scalar(conn, "SELECT count(*) FROM awards") == 0
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 0
    assert (
        await scalar(
            conn,
            "SELECT count(*) FROM jobfence_queue.messages"
            " WHERE lease_token IS NULL AND attempts = 0",
        )
        == JOBS
    )
    await assert_each_applied_once_by_a_second_worker(conn, database_url, second_dir, workers)


async def test_one_sigint_says_what_it_waits_for_and_lets_running_jobs_finish(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    tmp_path: Path,
    workers: list[CliWorker],
) -> None:
    await enqueue_jobs(conn)
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    worker = CliWorker(
        database_url,
        first_dir,
        "--concurrency",
        str(CONCURRENCY),
        "--grace-seconds",
        "20",
        slow_seconds=2,
    )
    workers.append(worker)
    await wait_running(conn, CONCURRENCY)

    worker.proc.send_signal(signal.SIGINT)
    line = await worker.wait_for_line("stopping:")
    assert line.endswith(
        f"stopping: waiting for {CONCURRENCY} running job(s) (up to 20s; press Ctrl-C again to"
        " stop now)"
    )
    assert await worker.wait_exit(within=15) == 0, worker.output()
    out = worker.stdout.read_text()
    assert f"worker stopped: succeeded {CONCURRENCY}, released {JOBS - CONCURRENCY}" in out
    assert "stopped at once" not in out
    assert await scalar(conn, "SELECT count(*) FROM awards") == CONCURRENCY
    await assert_each_applied_once_by_a_second_worker(conn, database_url, second_dir, workers)
