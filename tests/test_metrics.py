"""Issue 4, metrics: ``/metrics`` of real processes, parsed with prometheus_client's parser.

Every named series exists and moves as the harness, the queue, the dead letters and the cleanup
change; labels stay bounded; the database gauges never fail a scrape.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.routing import Route

import pointsapp
from cliapps import observed
from jobfence import Message
from jobfence.adapters.pg_queue import publish_on
from jobfence.adapters.prometheus import PrometheusAlertMetrics, PrometheusCleanupMetrics
from jobfence.observability import (
    DatabaseCollector,
    MetricsApp,
    metrics_registry,
    serve_metrics,
)
from support import wait_until

TESTS_DIR = Path(__file__).parent
NOWHERE = "postgresql://postgres@127.0.0.1:1/postgres"
BOUNDED_LABELS = {"queue", "consumer", "outcome", "state", "le", "kind", "reason"}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[set[str], Samples]:
    """Family names and every sample of a Prometheus text exposition."""
    families: set[str] = set()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def has(samples: Samples, name: str, **labels: str) -> bool:
    wanted = set(labels.items())
    return any(n == name and wanted <= ls for (n, ls) in samples)


class Process:
    """A ``jobfence`` command in a real process; its stderr lines are collected as they come."""

    def __init__(self, *args: str, url: str) -> None:
        env = {**os.environ, "JOBFENCE_DATABASE_URL": url}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jobfence.cli", "--log-format", "json", *args],
            env=env,
            cwd=TESTS_DIR,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    async def metrics_url(self) -> str:
        found: list[str] = []

        async def announced() -> bool:
            assert self.proc.poll() is None, "".join(self.lines)
            for line in list(self.lines):
                message = json.loads(line)["message"]
                if message.startswith("metrics served at "):
                    found.append(message.removeprefix("metrics served at "))
                    return True
            return False

        await wait_until(announced, timeout=20, message="the metrics URL in the log")
        return found[0]

    def stop(self) -> str:
        """SIGTERM, wait, return stdout; the process must exit cleanly."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        stdout, _ = self.proc.communicate(timeout=30)
        self._reader.join(timeout=5)
        assert self.proc.returncode == 0, "".join(self.lines)
        return stdout

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=10)


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for p in started:
        p.kill()
        for stream in (p.proc.stdout, p.proc.stderr):
            if stream is not None:
                stream.close()


async def scrape(url: str) -> tuple[set[str], Samples]:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(url)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


async def enqueue_the_workload(conn: psycopg.AsyncConnection[Any]) -> None:
    """3 successes, 1 duplicate, 1 transient failure (retried once, then dead-lettered),
    1 hard failure, 1 poison message."""
    app = observed.app
    for n in (1, 2, 3):
        await app.enqueue(conn, "award_points", {"account_id": n, "points": 10}, job_id=f"ok-{n}")
    await app.enqueue(conn, "award_points", {"account_id": 1, "points": 10}, job_id="ok-1")
    await app.enqueue(
        conn, "award_points", {"account_id": 4, "points": 1, "mode": "transient"}, job_id="flaky-1"
    )
    await app.enqueue(
        conn, "award_points", {"account_id": 5, "points": 1, "mode": "hard"}, job_id="closed-1"
    )
    await publish_on(
        conn,
        Message(queue=pointsapp.QUEUE, consumer="award_points", job_id="poison-1", body=b"{no"),
    )


JOB_IDS = ("ok-1", "ok-2", "ok-3", "flaky-1", "closed-1", "poison-1", "later-1", "elsewhere-1")


async def test_worker_metrics_endpoint_exposes_every_series_and_each_moves_as_the_harness_works(
    database_url: str, conn: psycopg.AsyncConnection[Any], processes: list[Process]
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    # Queue depth: one retry-like message scheduled in an hour, one due on a queue this worker
    # does not serve.
    await observed.app.enqueue(
        conn, "award_points", {"account_id": 6, "points": 1}, job_id="later-1", delay_seconds=3600
    )
    await observed.app.enqueue(
        conn, "other_points", {"account_id": 7, "points": 1}, job_id="elsewhere-1"
    )
    worker = Process(
        "worker",
        "cliapps.observed:app",
        "--queue",
        pointsapp.QUEUE,
        "--metrics-port",
        "0",
        "--concurrency",
        "2",
        url=database_url,
    )
    processes.append(worker)
    url = await worker.metrics_url()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")

    families, before = await scrape(url)
    assert {
        "jobfence_jobs",
        "jobfence_handler_duration_seconds",
        "jobfence_retries_scheduled",
        "jobfence_dead_letters_pending",
        "jobfence_dead_letter_oldest_pending_age_seconds",
        "jobfence_queue_messages",
        "jobfence_metrics_database_up",
        "process_resident_memory_bytes",
    } <= families
    assert value(before, "jobfence_metrics_database_up") == 1
    assert value(before, "jobfence_jobs_total") == 0
    # The app's consumers have a dead-letter series from the start (0): absent() is not needed.
    assert has(before, "jobfence_dead_letters_pending", queue="loyalty", consumer="award_points")
    assert value(before, "jobfence_dead_letters_pending") == 0
    assert value(before, "jobfence_dead_letter_oldest_pending_age_seconds") == 0
    assert value(before, "jobfence_queue_messages", queue="loyalty", state="scheduled") == 1
    assert value(before, "jobfence_queue_messages", queue="other", state="due") == 1

    await enqueue_the_workload(conn)

    after: Samples = {}

    async def all_handled() -> bool:
        nonlocal after
        _, after = await scrape(url)
        return (
            value(after, "jobfence_jobs_total") == 8
            and value(after, "jobfence_dead_letters_pending") == 3
        )

    await wait_until(all_handled, timeout=30, message="the workload's outcomes in /metrics")

    def jobs(outcome: str) -> float:
        return value(after, "jobfence_jobs_total", queue="loyalty", outcome=outcome)

    assert (
        jobs("succeeded"),
        jobs("duplicate"),
        jobs("retried"),
        jobs("dead_lettered"),
        jobs("poison"),
    ) == (3, 1, 1, 2, 1)
    assert value(after, "jobfence_retries_scheduled_total", consumer="award_points") == 1
    # Handlers that ran: 3 successes, 2 deliveries of the flaky job, 1 hard failure.
    assert value(after, "jobfence_handler_duration_seconds_count", consumer="award_points") == 6
    assert value(after, "jobfence_handler_duration_seconds_sum") > 0
    assert (
        value(after, "jobfence_dead_letters_pending", queue="loyalty", consumer="award_points") == 3
    )
    assert value(after, "jobfence_queue_messages", queue="loyalty", state="due") == 0
    assert value(after, "jobfence_queue_messages", queue="loyalty", state="leased") == 0
    assert value(after, "jobfence_queue_messages", queue="loyalty", state="scheduled") == 1
    assert value(after, "jobfence_queue_messages", queue="other", state="due") == 1

    # The oldest pending dead letter ages by the database clock, scrape after scrape.
    first_age = value(after, "jobfence_dead_letter_oldest_pending_age_seconds")
    assert first_age > 0

    async def aged() -> bool:
        _, again = await scrape(url)
        return value(again, "jobfence_dead_letter_oldest_pending_age_seconds") > first_age

    await wait_until(aged, timeout=10, message="the oldest dead letter's age to grow")

    # Bounded labels: never a job id, an attempt or anything but the documented names.
    for name, labels in after:
        assert {k for k, _ in labels} <= BOUNDED_LABELS, name
        assert not {v for _, v in labels} & set(JOB_IDS), name

    assert worker.stop().startswith("worker stopped: ")


async def test_cleanup_metrics_count_rows_removed_and_record_the_last_success_time(
    database_url: str, conn: psycopg.AsyncConnection[Any], processes: list[Process]
) -> None:
    async def expire(prefix: str, count: int) -> None:
        await conn.execute(
            "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at)"
            " SELECT %s || g, 'c', now() - interval '8 days', now() - interval '1 day'"
            " FROM generate_series(1, %s) AS g",
            (prefix, count),
        )

    await expire("first-", 5)
    started = time.time()
    cleanup = Process(
        "cleanup", "--every", "0.2", "--batch-size", "2", "--metrics-port", "0", url=database_url
    )
    processes.append(cleanup)
    url = await cleanup.metrics_url()
    seen: Samples = {}

    async def removed(count: int) -> bool:
        nonlocal seen
        families, seen = await scrape(url)
        assert {
            "jobfence_cleanup_rows_removed",
            "jobfence_cleanup_last_success_timestamp_seconds",
        } <= families
        return value(seen, "jobfence_cleanup_rows_removed_total") == count

    await wait_until(lambda: removed(5), timeout=20, message="5 rows removed")
    first_success = value(seen, "jobfence_cleanup_last_success_timestamp_seconds")
    assert started - 1 <= first_success <= time.time() + 1

    await expire("second-", 3)
    await wait_until(lambda: removed(8), timeout=20, message="8 rows removed")

    async def succeeded_again() -> bool:
        _, now = await scrape(url)
        return value(now, "jobfence_cleanup_last_success_timestamp_seconds") > first_success

    await wait_until(succeeded_again, timeout=10, message="a later successful round")
    assert cleanup.stop().strip() == "removed 8 expired fence rows"


def test_database_collector_reports_database_down_and_never_fails_the_scrape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = metrics_registry(NOWHERE, app=observed.app, process=False)
    with caplog.at_level("INFO", logger="jobfence.observability"):
        for _ in range(3):
            families, samples = parse(generate_latest(registry).decode())
            assert value(samples, "jobfence_metrics_database_up") == 0
            # No stale or invented numbers while the database cannot be read.
            assert not has(samples, "jobfence_dead_letters_pending")
            assert not has(samples, "jobfence_queue_messages")
            assert "jobfence_dead_letters_pending" in families  # the family is still described
    # Said once, not on every scrape.
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "cannot read the database" in warnings[0].getMessage()

    # Over real HTTP too: the exposition answers 200.
    server = serve_metrics(registry, port=0)
    try:
        response = httpx.get(server.url, timeout=10)
    finally:
        server.close()
    assert response.status_code == 200
    assert value(parse(response.text)[1], "jobfence_metrics_database_up") == 0


async def test_dead_letter_gauges_fold_unregistered_consumers_and_cap_the_series(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    # A flood of poison messages naming 30 consumers nobody registered, and 2 real dead letters.
    await conn.execute(
        "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts, last_error,"
        " error_class) SELECT 'p' || g, 'loyalty', 'ghost-' || g, '{}', 1, 'E: x', 'E'"
        " FROM generate_series(1, 30) AS g"
    )
    await conn.execute(
        "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts, last_error,"
        " error_class, created_at) SELECT 'r' || g, 'loyalty', 'award_points', '{}', 1, 'E: x',"
        " 'E', now() - interval '90 seconds' FROM generate_series(1, 2) AS g"
    )

    known = CollectorRegistry()
    known.register(DatabaseCollector(database_url, app=observed.app))
    _, samples = parse(generate_latest(known).decode())
    pending = {
        dict(ls)["consumer"]: v for (n, ls), v in samples.items() if n.endswith("letters_pending")
    }
    assert pending == {"award_points": 2, "<unknown>": 30, "other_points": 0}
    assert 90 <= value(samples, "jobfence_dead_letter_oldest_pending_age_seconds") < 120

    capped = CollectorRegistry()
    capped.register(DatabaseCollector(database_url, max_series=5, queue_depth=False))
    _, samples = parse(generate_latest(capped).decode())
    series = [ls for (n, ls) in samples if n == "jobfence_dead_letters_pending"]
    assert len(series) == 5
    assert value(samples, "jobfence_dead_letters_pending") == 32  # nothing lost, only folded
    assert value(samples, "jobfence_dead_letters_pending", consumer="award_points") == 2
    # The 4 largest of 31 groups stay (award_points and 3 ghosts), 27 ghosts are folded.
    assert value(samples, "jobfence_dead_letters_pending", consumer="<other>") == 27
    assert not has(samples, "jobfence_queue_messages")


async def test_metrics_app_serves_the_registry_inside_an_asgi_application(
    database_url: str,
) -> None:
    registry = metrics_registry(database_url, app=observed.app)
    api = Starlette(routes=[Route("/metrics", MetricsApp(registry))])
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        got = await client.get("/metrics")
        refused = await client.post("/metrics")
    assert got.status_code == 200
    assert got.headers["content-type"].startswith("text/plain; version=")
    samples = parse(got.text)[1]
    assert value(samples, "jobfence_metrics_database_up") == 1
    assert has(samples, "jobfence_queue_messages", queue="loyalty", state="due")
    assert refused.status_code == 405


def test_cleanup_and_alert_sinks_expose_their_named_series() -> None:
    registry = CollectorRegistry()
    cleanup = PrometheusCleanupMetrics(registry)
    alerts = PrometheusAlertMetrics(registry)
    cleanup.cleanup_rows_removed(7)
    cleanup.cleanup_succeeded()
    alerts.alert_sent("dead_letters")
    alerts.alert_failed("dead_letters", "rate_limited")
    alerts.alert_failed("escalation", "rejected")
    alerts.alerts_pending(4)

    _, samples = parse(generate_latest(registry).decode())
    assert value(samples, "jobfence_cleanup_rows_removed_total") == 7
    assert time.time() - value(samples, "jobfence_cleanup_last_success_timestamp_seconds") < 60
    assert value(samples, "jobfence_alerts_sent_total", kind="dead_letters") == 1
    assert value(samples, "jobfence_alerts_failed_total", reason="rate_limited") == 1
    assert value(samples, "jobfence_alerts_failed_total", kind="escalation") == 1
    assert value(samples, "jobfence_alerts_pending") == 4
