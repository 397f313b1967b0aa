"""``jobfence api --workers N``: N processes serve one port, each with its own pool; they stop
together on SIGTERM; a bad N is refused in one line before anything starts."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from psycopg import AsyncConnection

from jobfence.cli import main
from support import scalar, wait_until
from test_api_support import PREFIX, ApiProcess, bearer, insert_dead_letter, make_token


def api_workers(pid: int) -> list[psutil.Process]:
    """The worker processes of ``jobfence api`` ``pid`` (not multiprocessing's helper)."""
    children = psutil.Process(pid).children()
    return [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "argument --workers: must be between 1 and 64, got 0"),
        ("65", "argument --workers: must be between 1 and 64, got 65"),
        ("two", "argument --workers: not a whole number: 'two'"),
    ],
)
def test_a_bad_workers_value_is_refused_in_one_line(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["api", "--workers", value])
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(message), last


async def test_two_workers_serve_one_port_and_stop_together_on_sigterm(
    database_url: str, tmp_path: Path, conn: AsyncConnection[Any]
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="workers-1")
    proc = ApiProcess(database_url, tmp_path, "--workers", "2", "--pool-size", "2")
    try:
        base_url = await proc.base_url()
        assert "jobfence api: 2 workers ready on http://127.0.0.1:" in proc.output()
        workers = api_workers(proc.proc.pid)
        assert len(workers) == 2
        headers = bearer(make_token())
        for _ in range(10):  # a new connection each time: the kernel picks the worker
            async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
                listed = await client.get(PREFIX, headers=headers)
                assert [item["id"] for item in listed.json()["items"]] == [dl_id]
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.wait_exit() == 0
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        proc.cleanup()


async def test_when_a_worker_dies_the_service_stops_with_status_1(
    database_url: str, tmp_path: Path
) -> None:
    proc = ApiProcess(database_url, tmp_path, "--workers", "2", "--pool-size", "1")
    try:
        await proc.base_url()
        first, second = api_workers(proc.proc.pid)
        first.kill()
        assert await proc.wait_exit() == 1
        assert "exited (status -9): stopping the others" in proc.output()
        assert not second.is_running() or second.status() == psutil.STATUS_ZOMBIE
    finally:
        proc.cleanup()


async def test_the_api_opens_its_pool_full_at_start(
    database_url: str, tmp_path: Path, conn: AsyncConnection[Any]
) -> None:
    proc = ApiProcess(database_url, tmp_path, "--pool-size", "3")
    try:
        await proc.base_url()  # listening: the pool is open, before any request

        async def three_open() -> bool:
            opened = await scalar(
                conn,
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            return bool(opened == 3)

        await wait_until(three_open, timeout=10, message="the API's 3 pooled connections")
    finally:
        proc.cleanup()
