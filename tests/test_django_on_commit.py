"""``transaction.on_commit`` in handlers run by ``manage.py jobfence_worker`` (docs/django.md):
each test runs real worker processes of tests/djangoproject on the real PostgreSQL, with the
consumers of ``JOBS`` below (written to a module of the test's own, ``JOBFENCE["APP"]``).

A callback records, from a connection of its own, what it sees committed: its job's Point rows
and fence rows, in ``POINTS_MARKER_DIR/callbacks.<pid>``."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("django")

from test_django import (
    fences,
    manage,
    one,
    points,
    shell,
    start_worker,
    wait_for,
)

JOBS = '''
"""Consumers whose handlers register transaction.on_commit callbacks (test_django_on_commit)."""

import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from django.db import connection, transaction
from pydantic import BaseModel

from jobfence import App, HardFailure, JobMeta, RetryPolicy
from jobfence.contrib.django.settings import database_url
from points.models import Point

app = App()
FAST = RetryPolicy(max_retries=2, base_seconds=0.05, cap_seconds=0.2, rationale="tests: fast")


class Job(BaseModel):
    account: str
    cb: str = "record"  # record | raise | hard | robust_raise | slow | none, or one of LEFT_OPEN
    then: bool = False  # register a second callback ("second") after the first
    fail: str = ""  # "" | "always" | "hard": the handler raises after registering


def record(label: str, job: JobMeta) -> None:
    """What the callback sees committed, from a connection of its own."""
    with psycopg.connect(database_url(), autocommit=True) as conn:
        (seen,) = conn.execute(
            "SELECT count(*) FROM points_point WHERE job_id = %s", (job.job_id,)
        ).fetchone()
        (fenced,) = conn.execute(
            "SELECT count(*) FROM core.processed_jobs WHERE job_id = %s AND consumer = %s",
            (job.job_id, job.consumer),
        ).fetchone()
    workdir = Path(os.environ["POINTS_MARKER_DIR"])
    with (workdir / f"callbacks.{os.getpid()}").open("a") as out:
        out.write(f"{label} {job.job_id} points={seen} fence={fenced}\\n")


def callback(payload: Job, job: JobMeta) -> None:
    record("first", job)
    if payload.cb in ("raise", "robust_raise"):
        raise RuntimeError("the mail server refused the message")
    if payload.cb == "hard":
        raise HardFailure("the mail server refused the message for good")
    if payload.cb == "slow":  # until the job's delivery is gone from the queue (60 s at most)
        deadline = time.monotonic() + 60.0
        with psycopg.connect(database_url(), autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT count(*) FROM jobfence_queue.messages WHERE job_id = %s",
                    (job.job_id,),
                ).fetchone()
                if row[0] == 0:
                    break
                time.sleep(0.05)
        record("slow-done", job)
    # each leaves Django's connection in a transaction of its own, with a write in it
    if payload.cb == "autocommit_off":
        transaction.set_autocommit(False)
    elif payload.cb == "begin_sql":
        with connection.cursor() as cur:
            cur.execute("BEGIN")
    elif payload.cb == "atomic_not_left":
        transaction.atomic().__enter__()
    if payload.cb in ("autocommit_off", "begin_sql", "atomic_not_left"):
        Point.objects.create(job_id=job.job_id, account="left-open", amount=1)


def handle(payload: Job, job: JobMeta, tx: Any) -> None:
    Point.objects.create(job_id=job.job_id, account=payload.account, amount=1)
    if payload.cb != "none":
        transaction.on_commit(
            partial(callback, payload, job), robust=payload.cb == "robust_raise"
        )
    if payload.then:
        transaction.on_commit(partial(record, "second", job))
    if payload.fail == "always":
        raise RuntimeError(f"ledger timeout on attempt {job.attempt}")
    if payload.fail == "hard":
        raise HardFailure("account is closed")


@app.consumer("notify", queue="oc", schema=Job, retry=FAST)
def notify(payload: Job, job: JobMeta, tx: Any) -> None:
    handle(payload, job, tx)


@app.consumer("bulk_notify", queue="oc", schema=Job, retry=FAST, jobs_per_transaction=5)
def bulk_notify(payload: Job, job: JobMeta, tx: Any) -> None:
    handle(payload, job, tx)
'''

# A value only the payloads hold: no log line may show it.
SECRET = "acct-7f3c-private"


@pytest.fixture
def django_db(empty_database_url: str) -> str:
    """A fresh database migrated by ``manage.py migrate`` (as in test_django)."""
    done = manage(empty_database_url, "migrate", "-v", "0")
    assert done.returncode == 0, done.stderr
    return empty_database_url


@pytest.fixture
def project(django_db: str, tmp_path: Path) -> dict[str, str]:
    """The environment of a project whose JOBFENCE["APP"] is ``JOBS``."""
    (tmp_path / "oncommit_jobs.py").write_text(JOBS, encoding="utf-8")
    (tmp_path / "markers").mkdir()
    settings = {"APP": "oncommit_jobs:app", "WORKER": {"QUEUES": ["oc"]}}
    return {
        "PYTHONPATH": str(tmp_path),
        "DJANGOPROJECT_JOBFENCE": json.dumps(settings),
        "POINTS_MARKER_DIR": str(tmp_path / "markers"),
    }


def enqueue(
    url: str, env: dict[str, str], consumer: str, *jobs: tuple[str, dict[str, Any]]
) -> None:
    """Each (job_id, payload) for ``consumer``, in one atomic block."""
    lines = [
        "from django.db import transaction",
        "from jobfence.contrib.django import enqueue",
        "with transaction.atomic():",
    ]
    lines += [f"    enqueue({consumer!r}, {p!r}, job_id={j!r})" for j, p in jobs]
    shell(url, "\n".join(lines), **env)


def job(cb: str = "record", **more: Any) -> dict[str, Any]:
    return {"account": SECRET, "cb": cb, **more}


def work(url: str, env: dict[str, str], *args: str) -> tuple[str, str]:
    """``manage.py jobfence_worker --until empty ARGS``: its stdout (the summary) and stderr."""
    done = manage(url, "jobfence_worker", "--until", "empty", *args, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, done.stderr


def recorded(env: dict[str, str]) -> list[str]:
    """Every line the callbacks wrote, sorted."""
    workdir = Path(env["POINTS_MARKER_DIR"])
    return sorted(line for f in workdir.glob("callbacks.*") for line in f.read_text().splitlines())


def dead_letters(url: str) -> dict[str, tuple[int, str]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT job_id, attempts, error_class FROM core.dead_letters")
        return {r[0]: (r[1], r[2]) for r in rows.fetchall()}


def callback_errors(stderr: str) -> list[str]:
    """The log lines about callbacks (a traceback follows each); Django logs none of its own."""
    assert "in on_commit()" not in stderr, stderr  # Django's line for a robust callback
    return [line for line in stderr.splitlines() if "transaction.on_commit callback" in line]


def test_an_on_commit_callback_runs_once_after_the_job_and_its_fence_commit(
    django_db: str, project: dict[str, str]
) -> None:
    enqueue(django_db, project, "notify", ("n-1", job(then=True)), ("n-2", job()))
    out, err = work(django_db, project)
    assert "worker stopped: succeeded 2, released 0" in out, out + err
    assert recorded(project) == [
        "first n-1 points=1 fence=1",
        "first n-2 points=1 fence=1",
        "second n-1 points=1 fence=1",
    ]
    # the same job again: a duplicate, whose handler does not run, registers nothing
    enqueue(django_db, project, "notify", ("n-1", job(then=True)))
    out, err = work(django_db, project)
    assert "worker stopped: duplicate 1, released 0" in out, out + err
    assert len(recorded(project)) == 3
    assert points(django_db) == 2


def test_on_commit_callbacks_of_a_group_run_once_each_after_the_group_commits(
    django_db: str, project: dict[str, str]
) -> None:
    ids = [f"g-{i}" for i in range(4)]
    enqueue(django_db, project, "bulk_notify", *[(j, job(then=True)) for j in ids])
    out, err = work(django_db, project, "--batch-size", "5", "--concurrency", "1")
    assert "worker stopped: succeeded 4, released 0" in out, out + err
    assert "rolled back" not in err, err
    assert recorded(project) == sorted(
        f"{label} {j} points=1 fence=1" for j in ids for label in ("first", "second")
    )


def test_a_failing_handler_never_runs_its_on_commit_callbacks_on_any_attempt(
    django_db: str, project: dict[str, str]
) -> None:
    enqueue(
        django_db,
        project,
        "notify",
        ("flaky", job(then=True, fail="always")),
        ("closed", job(then=True, fail="hard")),
        ("fine", job()),
    )
    out, err = work(django_db, project)
    assert "worker stopped: dead_lettered 2, retried 2, succeeded 1, released 0" in out, out + err
    assert dead_letters(django_db) == {
        "flaky": (3, "RuntimeError"),
        "closed": (1, "jobfence.HardFailure"),
    }
    assert recorded(project) == ["first fine points=1 fence=1"]
    assert points(django_db) == 1


def test_in_a_rolled_back_group_only_the_succeeding_jobs_callbacks_run_once_each(
    django_db: str, project: dict[str, str]
) -> None:
    ids = ["r-0", "r-1", "r-bad", "r-2"]
    enqueue(
        django_db,
        project,
        "bulk_notify",
        *[(j, job(then=True, fail="hard" if j == "r-bad" else "")) for j in ids],
    )
    out, err = work(django_db, project, "--batch-size", "5", "--concurrency", "1")
    assert "worker stopped: dead_lettered 1, succeeded 3, released 0" in out, out + err
    assert "a group of 4 jobs rolled back (jobfence.HardFailure" in err, err
    assert recorded(project) == sorted(
        f"{label} {j} points=1 fence=1"
        for j in ("r-0", "r-1", "r-2")
        for label in ("first", "second")
    )
    assert dead_letters(django_db) == {"r-bad": (1, "jobfence.HardFailure")}


@pytest.mark.parametrize("how", ["raise", "hard"])
def test_a_callback_raising_after_the_commit_leaves_the_job_done_and_the_worker_goes_on(
    django_db: str, project: dict[str, str], how: str
) -> None:
    """The job's work and fence are committed when its callback raises (a RuntimeError, or even
    a HardFailure): it succeeded, is acked once, neither retried nor dead-lettered; the error
    is logged once, naming the job and the callback, with no payload value; the callbacks it
    registered after the one that raised do not run (Django's rule for a transaction); the
    jobs behind it run as usual."""
    enqueue(django_db, project, "notify", ("boom", job(how, then=True)), ("after", job(then=True)))
    out, err = work(django_db, project, "--concurrency", "1")
    assert "worker stopped: succeeded 2, released 0" in out, out + err
    assert dead_letters(django_db) == {}
    assert points(django_db, "boom") == points(django_db, "after") == 1
    assert fences(django_db) == 2
    assert recorded(project) == [
        "first after points=1 fence=1",
        "first boom points=1 fence=1",
        "second after points=1 fence=1",
    ]
    [line] = callback_errors(err)
    assert "job boom for notify" in line, err
    assert "callback" in line and "after the job committed" in line, line
    assert SECRET not in err


def test_a_robust_callback_that_raises_is_logged_once_and_the_jobs_later_callbacks_run(
    django_db: str, project: dict[str, str]
) -> None:
    enqueue(django_db, project, "notify", ("robust", job("robust_raise", then=True)))
    out, err = work(django_db, project, "--concurrency", "1")
    assert "worker stopped: succeeded 1, released 0" in out, out + err
    assert recorded(project) == [
        "first robust points=1 fence=1",
        "second robust points=1 fence=1",
    ]
    [line] = callback_errors(err)  # DEBUG
    assert "job robust for notify" in line, err
    assert SECRET not in err


def test_a_raising_callback_in_a_group_leaves_the_group_committed_and_the_others_callbacks_run(
    django_db: str, project: dict[str, str]
) -> None:
    enqueue(
        django_db,
        project,
        "bulk_notify",
        ("c-0", job(then=True)),
        ("c-boom", job("raise", then=True)),
        ("c-2", job(then=True)),
    )
    out, err = work(django_db, project, "--batch-size", "5", "--concurrency", "1")
    assert "worker stopped: succeeded 3, released 0" in out, out + err
    assert "rolled back" not in err, err
    assert dead_letters(django_db) == {}
    assert recorded(project) == [
        "first c-0 points=1 fence=1",
        "first c-2 points=1 fence=1",
        "first c-boom points=1 fence=1",
        "second c-0 points=1 fence=1",
        "second c-2 points=1 fence=1",
    ]
    [line] = callback_errors(err)  # DEBUG
    assert "job c-boom for bulk_notify" in line, err
    assert SECRET not in err


@pytest.mark.parametrize("how", ["autocommit_off", "begin_sql", "atomic_not_left"])
def test_a_callback_that_leaves_a_transaction_open_loses_no_later_job(
    django_db: str, project: dict[str, str], how: str
) -> None:
    """A callback that turns Django's autocommit off, sends BEGIN or enters an atomic block
    and does not leave it, then writes: Django's connection is left in a transaction, in which
    the next job's atomic block would be a savepoint that never commits, its job acked all the
    same. The connection is closed (what the callback left uncommitted rolls back), the warning
    names the job, and the next job commits."""
    enqueue(django_db, project, "notify", ("opener", job(how)), ("next", job()))
    out, err = work(django_db, project, "--concurrency", "1")
    assert "worker stopped: succeeded 2, released 0" in out, out + err
    assert points(django_db, "opener") == points(django_db, "next") == 1
    assert fences(django_db) == 2
    assert recorded(project) == ["first next points=1 fence=1", "first opener points=1 fence=1"]
    [line] = [x for x in err.splitlines() if "left Django's connection in a transaction" in x]
    assert "job opener for notify" in line, err
    assert SECRET not in err


def test_a_slow_callback_delays_the_ack_and_an_expired_lease_brings_a_duplicate_not_a_second_effect(
    django_db: str, project: dict[str, str], tmp_path: Path
) -> None:
    """The callback runs in the worker thread after the commit and before the ack: while it
    blocks, the job stays leased in the queue; once the lease (1 s) runs out, the job is
    delivered again, found by its fence and skipped (its handler and callbacks do not run
    again), and the callback's job is applied once."""
    enqueue(django_db, project, "notify", ("slow", job("slow")))
    log = tmp_path / "worker.log"
    worker = start_worker(django_db, log, "--concurrency", "2", "--lease-seconds", "1", **project)
    try:
        wait_for(
            lambda: "first slow points=1 fence=1" in recorded(project),
            message="the callback to start",
        )
        # committed, not yet acked: the delivery is still in the queue
        assert one(django_db, "SELECT count(*) FROM jobfence_queue.messages") == 1
        wait_for(
            lambda: "slow-done slow points=1 fence=1" in recorded(project),
            timeout=60,
            message=f"the redelivery to be skipped:\n{log.read_text()}",
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    text = log.read_text()
    summary = text.splitlines()[-1]
    assert summary.startswith("worker stopped: duplicate 1, succeeded 1"), text
    assert points(django_db, "slow") == 1
    assert fences(django_db) == 1
    assert dead_letters(django_db) == {}
    assert recorded(project) == ["first slow points=1 fence=1", "slow-done slow points=1 fence=1"]
    assert callback_errors(text) == [], text
