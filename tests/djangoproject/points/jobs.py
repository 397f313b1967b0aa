"""The project's jobs: ``award_points`` writes a Point through the ORM."""

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from django.db import DatabaseError, connection, transaction
from pydantic import BaseModel

from jobfence import App, HardFailure, JobMeta, RetryPolicy
from points.models import Point

app = App()


class Award(BaseModel):
    account: str
    amount: int
    fail: str = ""  # "" | "always" | "hard"
    pause_seconds: float = 0.0  # after the ORM write, before the commit
    hold: bool = False  # after the ORM write: write the marker, then wait for SIGKILL
    until_blocked: bool = False  # before the ORM write: wait for a duplicate blocked on the fence
    # after the ORM write: commit | close | commit_sql | caught | set_rollback |
    # rollback_begin_sql (then the write again), or one of
    # SWALLOWED (the refused call made, its error caught)
    misuse: str = ""


FAST = RetryPolicy(max_retries=2, base_seconds=0.05, cap_seconds=0.2, rationale="tests: fast")


@app.consumer("award_points", queue="points", schema=Award, retry=FAST)
def award_points(payload: Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
    if payload.until_blocked:
        note_overlap(job)
    Point.objects.create(job_id=job.job_id, account=payload.account, amount=payload.amount)
    if payload.misuse == "rollback_begin_sql":  # "retries" its work by hand, in a new transaction
        with connection.cursor() as cur:
            cur.execute("ROLLBACK")
            cur.execute("BEGIN")
        Point.objects.create(job_id=job.job_id, account=payload.account, amount=payload.amount)
    elif payload.misuse:
        misuse(payload.misuse, tx)
    if payload.pause_seconds:
        time.sleep(payload.pause_seconds)
    if payload.fail == "always":
        raise RuntimeError(f"ledger timeout on attempt {job.attempt}")
    if payload.fail == "hard":
        raise HardFailure("account is closed")
    workdir = Path(os.environ.get("POINTS_MARKER_DIR", "."))
    if payload.hold and not (workdir / "in_handler").exists():  # the first delivery only
        with connection.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            (pid,) = cur.fetchone()
        (workdir / "in_handler.tmp").write_text(f"{pid} {job.job_id}\n")
        (workdir / "in_handler.tmp").rename(workdir / "in_handler")
        threading.Event().wait()  # until SIGKILL: the commit never comes


@app.consumer("bulk_award", queue="bulk", schema=Award, retry=FAST, jobs_per_transaction=5)
def bulk_award(payload: Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
    """Group commit: up to 5 jobs' fences and Points in one atomic block."""
    award_points(payload, job, tx)


# Every way to end the transaction a handler could try, refused, with the error caught.
SWALLOWED = {
    "swallow_tx_commit": lambda tx: tx.commit(),
    "swallow_tx_rollback": lambda tx: tx.rollback(),
    "swallow_tx_close": lambda tx: tx.close(),
    "swallow_tx_autocommit": lambda tx: tx.set_autocommit(True),
    "swallow_commit": lambda tx: transaction.commit(),
    "swallow_rollback": lambda tx: transaction.rollback(),
    "swallow_set_autocommit": lambda tx: transaction.set_autocommit(True),
    "swallow_close": lambda tx: connection.close(),
}


def misuse(how: str, tx: psycopg.Connection[Any]) -> None:
    """What a handler must not do to its transaction (tests/test_django.py)."""
    if how in SWALLOWED:
        with contextlib.suppress(Exception):
            SWALLOWED[how](tx)
    elif how == "commit":
        tx.commit()
    elif how == "close":
        connection.close()
    elif how == "commit_sql":
        with connection.cursor() as cur:
            cur.execute("COMMIT")
    elif how == "caught":
        try:
            with connection.cursor() as cur:
                cur.execute("SELECT 1 / 0")
        except DatabaseError:
            pass  # caught, not raised: the transaction is aborted all the same
    elif how == "set_rollback":
        transaction.set_rollback(True)


BLOCKED = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
)


def note_overlap(job: JobMeta) -> None:
    """Wait (10 s at most) until another backend is blocked on a lock, the fence key this
    transaction holds uncommitted, then append ``<job_id> overlap|alone`` to
    ``POINTS_MARKER_DIR/ran.<pid>``."""
    from jobfence.contrib.django.settings import database_url

    seen = "alone"
    deadline = time.monotonic() + 10.0
    with psycopg.connect(database_url(), autocommit=True) as watcher:
        while time.monotonic() < deadline:
            row = watcher.execute(BLOCKED).fetchone()
            if row is not None and row[0] >= 1:
                seen = "overlap"
                break
            time.sleep(0.02)
    workdir = Path(os.environ["POINTS_MARKER_DIR"])
    with (workdir / f"ran.{os.getpid()}").open("a") as out:
        out.write(f"{job.job_id} {seen}\n")
