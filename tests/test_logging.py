"""Issue 4, structured logs: JSON lines from a real worker carry the job fields; a duplicate is
not a warning; configured secrets never appear in a log line, whatever logged them."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

import pointsapp
from cliapps import observed
from jobfence import Message
from jobfence.adapters.pg_queue import publish_on
from jobfence.observability import configure_logging
from support import print_sql_with_env

TESTS_DIR = Path(__file__).parent
JOB_FIELDS = ("job_id", "consumer", "queue", "tenant_id", "correlation_id", "attempt")
TOKEN = "bs-T0ken-5f1e9a"
JWT_SECRET = "jwt-S3cret-77aa"
PASSWORD = "Pw-s3cr3t-4711"


def run_worker(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``jobfence ARGS worker cliapps.observed:app --until empty`` to completion."""
    env = {**os.environ, **env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobfence.cli",
            *args,
            "worker",
            "cliapps.observed:app",
            "--queue",
            pointsapp.QUEUE,
            "--until",
            "empty",
        ],
        env=env,
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def json_lines(stderr: str) -> list[dict[str, Any]]:
    """Every line parses as one JSON object with the four base fields."""
    records = []
    for line in stderr.splitlines():
        record = json.loads(line)
        assert isinstance(record, dict), line
        assert {"timestamp", "level", "logger", "message"} <= record.keys(), line
        records.append(record)
    assert records
    return records


async def enqueue_one_of_each_outcome(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = observed.app
    for _ in range(2):  # the same job twice: one success, one duplicate
        await app.enqueue(
            conn,
            "award_points",
            {"account_id": 1, "points": 5},
            job_id="ok-1",
            tenant_id="tenant-a",
            correlation_id="corr-1",
        )
    await app.enqueue(
        conn,
        "award_points",
        {"account_id": 2, "points": 1, "mode": "transient"},
        job_id="flaky-1",
        tenant_id="tenant-b",
        correlation_id="corr-2",
    )
    await app.enqueue(
        conn, "award_points", {"account_id": 3, "points": 1, "mode": "hard"}, job_id="closed-1"
    )
    await publish_on(
        conn,
        Message(queue=pointsapp.QUEUE, consumer="award_points", job_id="poison-1", body=b"{no"),
    )


async def test_json_logs_of_a_real_worker_parse_and_carry_the_job_fields_on_every_job_event(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await enqueue_one_of_each_outcome(conn)

    done = run_worker("--log-format", "json", "-v", env={"JOBFENCE_DATABASE_URL": database_url})

    records = json_lines(done.stderr)
    job_events = [r for r in records if "job_id" in r]
    for record in job_events:
        assert set(JOB_FIELDS) <= record.keys(), record
        assert isinstance(record["attempt"], int), record
    by_outcome = {r["outcome"]: r for r in job_events if "outcome" in r}
    assert set(by_outcome) == {"succeeded", "duplicate", "retried", "dead_lettered", "poison"}
    assert by_outcome["retried"]["job_id"] == "flaky-1"
    assert by_outcome["retried"]["attempt"] == 1
    assert by_outcome["retried"]["tenant_id"] == "tenant-b"
    assert by_outcome["retried"]["correlation_id"] == "corr-2"
    assert by_outcome["retried"]["error_class"] == "pointsapp.Flaky"
    assert by_outcome["succeeded"]["tenant_id"] == "tenant-a"
    assert by_outcome["succeeded"]["queue"] == pointsapp.QUEUE
    assert by_outcome["succeeded"]["consumer"] == "award_points"
    dead = [r for r in job_events if r.get("outcome") == "dead_lettered"]
    assert {(r["job_id"], r["attempt"], r["level"]) for r in dead} == {
        ("flaky-1", 2, "WARNING"),
        ("closed-1", 1, "WARNING"),
    }
    assert by_outcome["poison"]["job_id"] == "poison-1"
    assert by_outcome["poison"]["error_class"] == "InvalidJson"


async def test_a_duplicate_is_logged_at_debug_and_never_as_a_warning(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await enqueue_one_of_each_outcome(conn)

    verbose = run_worker("--log-format", "json", "-v", env={"JOBFENCE_DATABASE_URL": database_url})

    duplicate = [r for r in json_lines(verbose.stderr) if r.get("outcome") == "duplicate"]
    assert len(duplicate) == 1
    assert duplicate[0]["level"] == "DEBUG"
    assert duplicate[0]["job_id"] == "ok-1"
    # Nothing about ok-1 (its success or its duplicate) is a warning or worse.
    assert all(
        r["level"] == "DEBUG" for r in json_lines(verbose.stderr) if r.get("job_id") == "ok-1"
    )


def _uri_with_password(url: str, password: str) -> str:
    p = conninfo_to_dict(url)
    # A socket directory (the embedded server's host) must be percent-encoded in a URI.
    host = quote(str(p.get("host", "127.0.0.1")), safe="")
    return (
        f"postgresql://{p.get('user', 'postgres')}:{password}@{host}"
        f":{p.get('port', 5432)}/{p['dbname']}"
    )


@pytest.mark.parametrize("log_format", ["json", "text"])
async def test_configured_secrets_never_appear_in_any_log_line(
    database_url: str, conn: psycopg.AsyncConnection[Any], log_format: str
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    # A handler that logs the Better Stack token, the JWT secret and the database URL, in the
    # message, in extra fields and in a traceback, then fails with the token in its error.
    await observed.app.enqueue(
        conn, "award_points", {"account_id": 1, "points": 1, "mode": "leak"}, job_id="leak-1"
    )
    await observed.app.enqueue(conn, "award_points", {"account_id": 2, "points": 1}, job_id="ok-1")

    done = run_worker(
        "-v",  # every library's DEBUG lines too
        env={
            "JOBFENCE_DATABASE_URL": _uri_with_password(database_url, PASSWORD),
            "JOBFENCE_BETTERSTACK_TOKEN": TOKEN,
            "JOBFENCE_JWT_SECRET": JWT_SECRET,
            "JOBFENCE_LOG_FORMAT": log_format,  # the environment chooses the format
        },
    )

    output = done.stderr + done.stdout
    for secret in (TOKEN, JWT_SECRET, PASSWORD):
        assert secret not in output
    assert output.count("***") >= 5  # the handler's lines were logged, redacted
    if log_format == "json":
        records = json_lines(done.stderr)
        leaked = [r for r in records if r["logger"] == "observed.handler"]
        assert len(leaked) == 3
        assert any(r.get("authorization") == "Bearer ***" for r in leaked)
        assert any(
            "RuntimeError: 401 Unauthorized for token ***" in r.get("exc_info", "") for r in leaked
        )
    else:
        assert "Bearer ***" in done.stderr
        assert "Traceback" in done.stderr


def test_a_bad_jobfence_log_format_is_one_clear_error_line() -> None:
    done = print_sql_with_env(JOBFENCE_LOG_FORMAT="xml")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jobfence: error: JOBFENCE_LOG_FORMAT must be one of text, json, got 'xml'"
    ]


@pytest.mark.usefixtures("restore_logging")
def test_redaction_covers_arguments_extra_fields_tracebacks_and_stack_traces() -> None:
    stream = io.StringIO()
    configure_logging("json", secrets=[TOKEN, "", PASSWORD], stream=stream)
    configure_logging("json", secrets=[TOKEN, "", PASSWORD], stream=stream)  # replaces, not adds
    log = logging.getLogger("jobfence.test")

    log.info("token %s and %r", TOKEN, {"password": PASSWORD})
    log.info({"event": "dict message", "auth": [f"Bearer {TOKEN}"]})
    log.warning("extra", extra={"header": f"Bearer {TOKEN}", "count": 3, "nested": {"p": PASSWORD}})
    try:
        raise ValueError(f"bad token {TOKEN}")
    except ValueError:
        log.exception("failed", stack_info=True)
    log.info("nothing secret here: %d", 42)

    lines = stream.getvalue().splitlines()
    assert len(lines) == 5  # one handler, one line per event
    assert TOKEN not in stream.getvalue() and PASSWORD not in stream.getvalue()
    records = [json.loads(line) for line in lines]
    assert records[0]["message"] == "token *** and {'password': '***'}"
    assert records[1]["auth"] == ["Bearer ***"]
    assert (records[2]["header"], records[2]["count"], records[2]["nested"]) == (
        "Bearer ***",
        3,
        {"p": "***"},
    )
    assert "ValueError: bad token ***" in records[3]["exc_info"]
    assert "stack_info" in records[3]
    assert records[4]["message"] == "nothing secret here: 42"
