"""Helpers shared by the tests: polling with deadlines, one-value queries, database names."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo


def with_dbname(url: str, dbname: str) -> str:
    params = conninfo_to_dict(url)
    params["dbname"] = dbname
    return make_conninfo("", **params)


async def wait_until(
    predicate: Callable[[], Awaitable[bool]],
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
    message: str = "condition",
) -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if await predicate():
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        await asyncio.sleep(interval)


async def scalar(conn: psycopg.AsyncConnection[Any], query: Any, params: Any = None) -> Any:
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    return None if row is None else row[0]


def print_sql_with_env(**env: str) -> subprocess.CompletedProcess[str]:
    """``jobfence migrate --print-sql`` (no database needed) in a real process, with ``env`` set:
    for the one-line errors of bad settings read at start-up."""
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", "migrate", "--print-sql"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def run_jobfence(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``jobfence ARGS`` in a real process against ``database_url``; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", *args],
        env={**os.environ, "JOBFENCE_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def job_groups(
    metrics: Any, result: str, *, queue: str = "loyalty", consumer: str = "award_points"
) -> float:
    """``jobfence_job_groups_total`` for ``result`` (group commit) in a PrometheusMetrics."""
    value = metrics.registry.get_sample_value(
        "jobfence_job_groups_total", {"queue": queue, "consumer": consumer, "result": result}
    )
    return float(value or 0.0)


def counting_chains(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the sync runner's chained round trips (a job's COMMIT with the next one's BEGIN
    and fence insert): one item per chain sent."""
    import jobfence.sync

    chained: list[int] = []
    original = jobfence.sync.commit_then_begin_sync

    def counted(*args: Any) -> Any:
        chained.append(1)
        return original(*args)

    monkeypatch.setattr(jobfence.sync, "commit_then_begin_sync", counted)
    return chained
