"""The outbox on the real brokers of this machine: a job enqueued in a committed transaction is
published by the worker's own relay and applied once, a rolled-back one never exists; and
``JOBFENCE_QUEUE_URL`` pointing at a port where no broker listens fails at start-up, through the
real adapter and its client, without printing the password."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from brokers import BROKERS, make_queue, on_broker
from jobfence import QueuePort, Worker
from jobfence.outbox import OutboxRelaySettings, record_queue
from jobfence.queues import parse_queue_url
from support import scalar

SCHEMES = {"rabbitmq": "amqp", "nats": "nats", "redis": "redis"}
PASSWORD = "n0t-Sh0wn"


@pytest.fixture(params=BROKERS)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, QueuePort]]:
    async with on_broker(request, [pointsapp.QUEUE], prefix="jfoutbox") as (kind, url, name):
        queue = make_queue(kind, url, name)
        yield kind, url, queue
        await queue.close()


async def test_a_committed_enqueue_reaches_the_broker_through_the_outbox_and_applies_once(
    broker: tuple[str, str, QueuePort],
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    kind, url, queue = broker
    await conn.execute(pointsapp.SCHEMA_SQL)
    target = parse_queue_url(url)
    assert target.kind == kind
    await record_queue(conn, target.kind, target.location)
    app = pointsapp.build_app()
    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        for job_id in ("b-1", "b-2", "b-1"):
            await app.enqueue(tx, "award_points", {"account_id": 4, "points": 2}, job_id=job_id)
        await app.enqueue(
            tx, "award_points", {"account_id": 4, "points": 2}, job_id="b-3", delay_seconds=1
        )
        await tx.commit()
    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        await app.enqueue(tx, "award_points", {"account_id": 4, "points": 100}, job_id="gone")
        await tx.rollback()
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 4

    worker = Worker(
        app,
        pool,
        queue,
        concurrency=2,
        poll_seconds=0.05,
        lease_seconds=30,
        outbox_settings=OutboxRelaySettings(poll_seconds=0.05),
    )
    stats = await asyncio.wait_for(worker.run(until="empty"), 60)

    assert stats.outcomes == {"succeeded": 3, "duplicate": 1}
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 4") == 6
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
    assert (await queue.size([pointsapp.QUEUE])).total == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("kind", BROKERS)
async def test_an_unreachable_broker_fails_the_worker_at_start_up_without_its_password(
    database_url: str, kind: str
) -> None:
    port = _free_port()
    url = f"{SCHEMES[kind]}://app:{PASSWORD}@127.0.0.1:{port}/"
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await record_queue(conn, kind, parse_queue_url(url).location)
    env = {**os.environ, "JOBFENCE_DATABASE_URL": database_url, "JOBFENCE_QUEUE_URL": url}
    env["PYTHONPATH"] = os.path.dirname(__file__)
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "jobfence.cli", "worker", "pointsapp:app"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("jobfence: error: ")]
    assert errors, done.stderr
    assert errors[0].startswith(
        f"jobfence: error: cannot open the {kind} queue at {SCHEMES[kind]}://127.0.0.1:{port}/: "
    ), errors
    assert len(errors) == 1, done.stderr
    assert PASSWORD not in done.stderr + done.stdout
