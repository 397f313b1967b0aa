"""An async handler that blocks the event loop: the worker says so, once per block, naming the
job and where, and says when the loop runs again. Real PostgreSQL, real workers; the handlers'
own ``time.sleep`` is the blocking under test."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

from jobfence import App, JobMeta, PgQueue, PrometheusMetrics, blocked_loop
from jobfence.cli import build_parser
from jobfence.errors import ConfigError
from jobfence.worker import Worker
from support import wait_until

QUEUE = "work"
LOGGER = "jobfence.blocked_loop"
THRESHOLD = 0.3
SECRET = "card-4111-1111-1111-1111"  # a payload value: in no line, whatever happens
TESTS_DIR = Path(__file__).parent


class Work(BaseModel):
    seconds: float = 0.0
    secret: str = SECRET


def blocking_app() -> App:
    """``block``: an async handler that sleeps (blocking the loop) with the payload's secret in
    a local variable and its arguments; ``quick``: an async handler that returns at once."""
    app = App()

    @app.consumer("block", queue=QUEUE, schema=Work)
    async def block(payload: Work, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        card = payload.secret  # a local holding a payload value
        assert card
        time.sleep(payload.seconds)  # noqa: ASYNC251 - blocking code in an async def handler

    @app.consumer("quick", queue=QUEUE, schema=Work)
    async def quick(payload: Work, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await tx.execute("SELECT 1")

    return app


async def run_jobs(
    pool: AsyncConnectionPool[Any],
    app: App,
    jobs: list[tuple[str, str, float]],
    *,
    concurrency: int = 4,
    **kwargs: Any,
) -> tuple[Worker, PrometheusMetrics]:
    """Publish ``jobs`` (consumer, job id, seconds), then run a worker until they are done."""
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    metrics = PrometheusMetrics()
    try:
        for consumer, job_id, seconds in jobs:
            await queue.publish(app.message(consumer, {"seconds": seconds}, job_id=job_id))
        worker = Worker(
            app,
            pool,
            queue,
            concurrency=concurrency,
            poll_seconds=0.05,
            outbox_relay=False,
            metrics=metrics,
            **kwargs,
        )
        stats = await asyncio.wait_for(worker.run(until="empty"), timeout=30)
    finally:
        await queue.close()
    assert stats.outcomes == {"succeeded": len(jobs)}
    return worker, metrics


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


def everything_in(record: logging.LogRecord) -> str:
    """A record's message and every field it carries, as a log pipeline would see them."""
    return record.getMessage() + json.dumps(record.__dict__, default=str)


def sample(metrics: PrometheusMetrics, name: str, **labels: str) -> float:
    return float(metrics.registry.get_sample_value(name, labels) or 0.0)


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "jobfence-blocked-loop"]


async def test_a_blocked_loop_logs_a_warning_naming_the_job_how_long_where_and_what_to_do(
    pool: AsyncConnectionPool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    jobs = [("block", "job-that-blocks", 1.2)] + [("quick", f"quick-{i}", 0) for i in range(8)]
    _, metrics = await run_jobs(pool, blocking_app(), jobs, blocked_loop_seconds=THRESHOLD)

    warnings = [r for r in lines(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in lines(caplog)]
    warning = warnings[0]
    text = warning.getMessage()
    assert text.startswith("the event loop has been blocked for ")
    assert "(over 0.3s) by the async handler of job job-that-blocks for block, at " in text
    # where: this file, the line of the time.sleep call, the handler's name; nothing else of it
    where = text.split(", at ", 1)[1].split(": the worker's", 1)[0]
    assert where.startswith("test_blocked_loop.py:"), where
    assert "blocking_app.<locals>.block" in where
    assert "the worker's other jobs, its fetches, acks and lease extensions wait" in text
    assert "make it a def handler, which runs in a worker thread, or use an async library" in text
    blocked = float(text.split("blocked for ", 1)[1].split("s ", 1)[0])
    assert THRESHOLD <= blocked < 1.2
    fields = warning.__dict__
    assert (fields["job_id"], fields["consumer"], fields["queue"]) == (
        "job-that-blocks",
        "block",
        QUEUE,
    )
    assert fields["attempt"] == 1
    assert fields["blocked_seconds"] == pytest.approx(blocked, abs=0.06)
    # No payload value, neither the argument's nor the local variable's, in any line.
    for record in lines(caplog):
        assert SECRET not in everything_in(record)
        assert "card" not in record.getMessage()
    labels = {"queue": QUEUE, "consumer": "block"}
    assert sample(metrics, "jobfence_event_loop_blocked_total", **labels) == 1


async def test_the_warning_shows_the_innermost_frames_and_the_handlers_own_line(
    pool: AsyncConnectionPool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Blocked deep inside a library: its innermost frames, then the handler's line that led
    there (the frames between are left out)."""
    caplog.set_level(logging.INFO, logger=LOGGER)

    def level(n: int, seconds: float) -> None:
        if n == 0:
            time.sleep(seconds)
        else:
            level(n - 1, seconds)

    app = App()

    @app.consumer("deep", queue=QUEUE, schema=Work)
    async def deep(payload: Work, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        level(8, payload.seconds)

    await run_jobs(pool, app, [("deep", "deep-1", 1.0)], blocked_loop_seconds=THRESHOLD)

    (warning,) = [r for r in lines(caplog) if r.levelno == logging.WARNING]
    where = warning.getMessage().split(", at ", 1)[1].split(": the worker's", 1)[0]
    frames = where.split(" <- ")
    assert len(frames) == 6, frames  # 4 innermost, "...", the handler's own
    assert all(".<locals>.level" in frame for frame in frames[:4]), frames
    assert frames[4] == "..."
    assert frames[5].endswith(".<locals>.deep"), frames


async def test_one_warning_per_blocking_episode(
    pool: AsyncConnectionPool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A block 8 times the threshold is one WARNING, not one per check; two blocks, one after
    the other, are two, each followed by its own line when the loop runs again."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    jobs = [("block", "first", 2.4), ("block", "second", 1.0)]
    _, metrics = await run_jobs(
        pool, blocking_app(), jobs, concurrency=1, blocked_loop_seconds=THRESHOLD
    )

    seen = [(r.levelname, r.__dict__["job_id"]) for r in lines(caplog)]
    assert seen == [
        ("WARNING", "first"),
        ("INFO", "first"),
        ("WARNING", "second"),
        ("INFO", "second"),
    ]
    labels = {"queue": QUEUE, "consumer": "block"}
    assert sample(metrics, "jobfence_event_loop_blocked_total", **labels) == 2


async def test_a_line_when_the_loop_runs_again_says_how_long_it_was_blocked(
    pool: AsyncConnectionPool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    _, metrics = await run_jobs(
        pool, blocking_app(), [("block", "blocker", 1.5)], blocked_loop_seconds=THRESHOLD
    )

    warning, again = lines(caplog)
    assert (warning.levelname, again.levelname) == ("WARNING", "INFO")
    text = again.getMessage()
    assert text.startswith("the event loop runs again after being blocked for ")
    assert text.endswith("s by the async handler of job blocker for block")
    seconds = float(text.split("blocked for ", 1)[1].split("s ", 1)[0])
    assert 1.5 <= seconds < 2.5  # the whole block, not the part seen when it was noticed
    assert again.__dict__["blocked_seconds"] == pytest.approx(seconds, abs=0.06)
    assert again.__dict__["job_id"] == "blocker"
    assert SECRET not in everything_in(again)
    labels = {"queue": QUEUE, "consumer": "block"}
    assert sample(metrics, "jobfence_event_loop_blocked_seconds_count", **labels) == 1
    total = sample(metrics, "jobfence_event_loop_blocked_seconds_sum", **labels)
    assert total == pytest.approx(seconds, abs=0.06)


async def test_blocking_outside_any_handler_is_reported_without_a_job(
    pool: AsyncConnectionPool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Another task on the worker's loop that blocks it: the same WARNING, naming no job, and
    counted with empty labels."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    app = blocking_app()
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    metrics = PrometheusMetrics()
    worker = Worker(
        app,
        pool,
        queue,
        poll_seconds=0.05,
        outbox_relay=False,
        metrics=metrics,
        blocked_loop_seconds=THRESHOLD,
    )

    def something_else_blocking() -> None:
        time.sleep(1.0)

    async def other_task() -> None:
        await wait_until(lambda: _true(bool(watchdog_threads())), message="the watchdog")
        something_else_blocking()

    try:
        running = asyncio.create_task(worker.run())
        await other_task()
        await wait_until(lambda: _true(len(lines(caplog)) == 2), message="the INFO line")
        worker.stop()
        await asyncio.wait_for(running, timeout=10)
    finally:
        await queue.close()

    warning, again = lines(caplog)
    assert " outside any async handler, at " in warning.getMessage()
    assert "something_else_blocking" in warning.getMessage()
    assert "job_id" not in warning.__dict__
    assert again.getMessage().endswith("s outside any async handler")
    assert sample(metrics, "jobfence_event_loop_blocked_total", queue="", consumer="") == 1


async def _true(value: bool) -> bool:
    return value


async def test_a_sync_handler_sleeping_does_not_trigger_it(
    pool: AsyncConnectionPool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A ``def`` handler runs in a worker thread: its sleep holds no event loop."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    app = App()

    @app.consumer("sync_sleep", queue=QUEUE, schema=Work)
    def sync_sleep(payload: Work, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        time.sleep(payload.seconds)

    jobs = [("sync_sleep", "sync-1", 1.5), ("sync_sleep", "sync-2", 1.5)]
    _, metrics = await run_jobs(pool, app, jobs, concurrency=2, blocked_loop_seconds=THRESHOLD)

    assert lines(caplog) == []
    assert (
        sample(metrics, "jobfence_event_loop_blocked_total", queue=QUEUE, consumer="sync_sleep")
        == 0
    )


async def test_turned_off_with_zero_nothing_watches_the_loop(
    pool: AsyncConnectionPool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    app = blocking_app()
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    await queue.publish(app.message("block", {"seconds": 1.0}, job_id="unwatched"))
    worker = Worker(app, pool, queue, poll_seconds=0.05, outbox_relay=False, blocked_loop_seconds=0)
    try:
        running = asyncio.create_task(worker.run(until="empty"))
        await wait_until(lambda: _true(worker.running > 0), message="the job to start")
        assert watchdog_threads() == []
        stats = await asyncio.wait_for(running, timeout=20)
    finally:
        await queue.close()
    assert stats.outcomes == {"succeeded": 1}
    assert lines(caplog) == []


async def test_the_watchdog_thread_is_a_daemon_and_stops_with_the_worker(
    pool: AsyncConnectionPool[Any],
) -> None:
    """It never keeps the process alive at exit, and a worker that stops leaves none behind;
    two workers on one loop share one."""
    app = blocking_app()
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    workers = [
        Worker(app, pool, queue, poll_seconds=0.05, outbox_relay=False, blocked_loop_seconds=1)
        for _ in range(2)
    ]
    try:
        running = [asyncio.create_task(w.run()) for w in workers]
        await wait_until(lambda: _true(len(watchdog_threads()) == 1), message="the watchdog")
        (thread,) = watchdog_threads()
        assert thread.daemon
        workers[0].stop()
        await asyncio.wait_for(running[0], timeout=10)
        assert thread.is_alive()  # the other worker still runs on this loop
        workers[1].stop()
        await asyncio.wait_for(running[1], timeout=10)
        await wait_until(lambda: _true(not thread.is_alive()), message="the watchdog to stop")
    finally:
        await queue.close()
    assert watchdog_threads() == []


@pytest.mark.parametrize("value", [-1, 0.05, math.nan, math.inf, 86401, True, "1"])
def test_bad_configuration_is_refused(value: Any, pool: AsyncConnectionPool[Any]) -> None:
    app = blocking_app()
    queue = PgQueue(pool)
    with pytest.raises(ConfigError, match="blocked_loop_seconds must be "):
        Worker(app, pool, queue, blocked_loop_seconds=value)


@pytest.mark.parametrize("text", ["-1", "0.05", "nan", "inf", "1e308", "soon"])
def test_bad_configuration_is_refused_on_the_command_line(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["worker", "m:app", "--blocked-loop-seconds", text])
    assert exited.value.code == 2
    assert (
        "argument --blocked-loop-seconds: must be 0 (off) or a number of seconds from 0.1 to"
        f" 86400, got {text!r}"
    ) in capsys.readouterr().err


def test_the_setting_defaults_to_one_second_and_zero_turns_it_off(
    pool: AsyncConnectionPool[Any],
) -> None:
    parse = build_parser().parse_args
    assert parse(["worker", "m:app"]).blocked_loop_seconds == 1.0
    assert parse(["worker", "m:app", "--blocked-loop-seconds", "0"]).blocked_loop_seconds == 0
    assert parse(["worker", "m:app", "--blocked-loop-seconds", "2.5"]).blocked_loop_seconds == 2.5
    queue = PgQueue(pool)
    assert Worker(blocking_app(), pool, queue).blocked_loop_seconds == 1.0
    assert Worker(blocking_app(), pool, queue, blocked_loop_seconds=0).blocked_loop_seconds == 0


APP_MODULE = """
import time
from typing import Any

from psycopg import AsyncConnection
from pydantic import BaseModel

from jobfence import App, JobMeta


class Work(BaseModel):
    seconds: float
    secret: str


app = App()


@app.consumer("block", queue="work", schema=Work)
async def block(payload: Work, job: JobMeta, tx: AsyncConnection[Any]) -> None:
    time.sleep(payload.seconds)
"""


def test_the_cli_worker_warns_by_default(database_url: str, tmp_path: Path) -> None:
    """``jobfence worker`` (and so ``manage.py jobfence_worker``, which runs it) watches its
    loop without being asked: a JSON WARNING line naming the job, no payload value in it."""
    (tmp_path / "blockingjobs.py").write_text(textwrap.dedent(APP_MODULE))
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "SELECT jobfence.enqueue('block', 'work', 'cli-blocker', %s::jsonb)",
            (json.dumps({"seconds": 1.6, "secret": SECRET}),),
        )
    env = {**os.environ, "JOBFENCE_DATABASE_URL": database_url}
    command = ["jobfence.cli", "--log-format", "json", "worker", "blockingjobs:app"]
    done = subprocess.run(
        [sys.executable, "-m", *command, "--until", "empty"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    ours = [r for r in records if r["logger"] == LOGGER]
    assert [r["level"] for r in ours] == ["WARNING", "INFO"], done.stderr
    assert ours[0]["job_id"] == "cli-blocker"
    assert "(over 1s) by the async handler of job cli-blocker for block, at " in ours[0]["message"]
    assert "blockingjobs.py:" in ours[0]["message"]
    assert SECRET not in done.stderr + done.stdout


def test_the_django_worker_setting_becomes_the_flag() -> None:
    """``manage.py jobfence_worker`` runs ``jobfence worker``: watched by default, and
    ``JOBFENCE["WORKER"]["BLOCKED_LOOP_SECONDS"]`` sets its flag."""
    pytest.importorskip("django")
    from jobfence.contrib.django.settings import JobfenceSettings

    argv = JobfenceSettings(worker={"BLOCKED_LOOP_SECONDS": 0}).worker_argv()
    assert argv == ["--blocked-loop-seconds", "0"]
    args = build_parser().parse_args(["worker", "m:app", *argv])
    assert args.blocked_loop_seconds == 0


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_a_paused_idle_loop_is_not_reported_as_a_blocked_one(
    loop_kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A process paused (SIGSTOP, a suspended container or VM) while its loop waited for work,
    as the watchdog finds it when the process runs again before the loop does: the loop has not
    run for longer than the threshold, but nothing held it. The watchdog looks at the loop
    thread's stack at that moment: waiting in uvloop's C code (under ``Runner.run``) or in
    asyncio's selector, it is idle, and no WARNING is logged. (The pause is made by holding
    the loop's beat and moving its last beat into the past.)"""
    if loop_kind == "uvloop":
        pytest.importorskip("uvloop")
    caplog.set_level(logging.INFO, LOGGER)
    found: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        watching = blocked_loop.watch(1.0)
        assert watching is not None
        dog = blocked_loop._WATCHDOGS[loop]
        dog._stopped.set()  # its thread and beat stop: this test plays both
        if dog._timer is not None:
            dog._timer.cancel()
        done = asyncio.Event()
        loop_thread = threading.get_ident()

        def paused_then_checked() -> None:
            try:
                deadline = time.monotonic() + 10
                while True:  # until the loop waits for I/O, idle
                    frame = sys._current_frames()[loop_thread]
                    if frame.f_code.co_name in ("run", "select"):
                        break
                    assert time.monotonic() < deadline, "the loop never went idle"
                    time.sleep(0.01)
                dog._stopped.clear()
                dog._ran = time.monotonic() - 5.0  # the pause: 5 s without a beat
                dog._check()
                dog._stopped.set()
                found.append(frame.f_code.co_name)
            finally:
                loop.call_soon_threadsafe(done.set)

        threading.Thread(target=paused_then_checked).start()
        await asyncio.wait_for(done.wait(), 20)
        watching.close()

    if loop_kind == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    assert found == ["run" if loop_kind == "uvloop" else "select"]
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == []
