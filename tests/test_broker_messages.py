"""What a person reads when a broker is wrong or away: an unknown RabbitMQ vhost said so, a
refused port in one line (no extra line from the client), a short NATS outage in about two lines
(went away, back) as for the database, and NATS's "no responders" (a stream or consumer without
a leader) taken as the broker being unavailable, not as an error inside jobfence."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats
import psycopg
import pytest

import pointsapp
from jobfence import PrometheusMetrics, QueueUnavailable, Worker, db
from jobfence.adapters.nats import NatsQueue
from jobfence.model import Message
from jobfence.outbox import record_queue
from jobfence.queues import parse_queue_url
from nats_servers import NatsServer, free_port, nats_standalone, require_nats_server
from support import scalar, wait_until

TESTS_DIR = Path(__file__).parent
REPR = re.compile(r"<[A-Za-z_][\w.]*[ >]|0x[0-9a-f]{6,}")


def _move(database_url: str, queue_url: str) -> subprocess.CompletedProcess[str]:
    """``jobfence migrate --queue-url`` (the move): it opens the new queue before it records it."""
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", "migrate", "--queue-url", queue_url],
        env={**os.environ, "JOBFENCE_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def _with_path(url: str, path: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=path))


async def test_an_unknown_rabbitmq_vhost_is_said_so_in_one_line(
    database_url: str, amqp_url: str
) -> None:
    vhost = f"jftest-{uuid.uuid4().hex[:8]}"
    done = await asyncio.to_thread(_move, database_url, _with_path(amqp_url, f"/{vhost}"))
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        f"jobfence: error: cannot open the rabbitmq queue at amqp://127.0.0.1:5672/{vhost}: "
        f"RabbitMQ refused the virtual host '{vhost}': it does not exist, or the user "
    ), lines
    assert "InvalidFrameError" not in done.stderr
    assert not REPR.search(done.stderr), done.stderr


async def test_a_refused_rabbitmq_port_prints_one_line_and_no_client_error(
    database_url: str, amqp_url: str
) -> None:
    port = free_port()
    parts = urlsplit(amqp_url)
    url = urlunsplit(parts._replace(netloc=f"app:s3cret-pw@127.0.0.1:{port}"))
    done = await asyncio.to_thread(_move, database_url, url)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        f"jobfence: error: cannot open the rabbitmq queue at amqp://127.0.0.1:{port}/: "
        "AMQPConnectionError: [Errno 111] Conn"
    ), lines
    assert "aiormq" not in done.stderr
    assert "s3cret-pw" not in done.stderr + done.stdout


# nats-py drops the stream writer of a connection that broke without closing it (its reconnect
# opens a new one), which Python reports as an unraisable ResourceWarning when it is collected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.timeout(120)
async def test_a_short_nats_outage_logs_about_two_lines_and_no_client_tracebacks(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    jobs, outage_seconds = 60, 8.0
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    with nats_standalone(tmp_path) as server:
        target = parse_queue_url(server.url)
        await record_queue(conn, target.kind, target.location)
        async with conn.transaction():
            for i in range(jobs):
                payload = {"account_id": i % 10 + 1, "points": 1, "mode": "slow"}
                await app.enqueue(conn, "award_points", payload, job_id=f"n{i}")
        pool = await db.open_pool(database_url, max_size=5)
        queue = NatsQueue(server.url)
        metrics = PrometheusMetrics()
        worker = Worker(
            app, pool, queue, concurrency=2, poll_seconds=0.1, lease_seconds=5, metrics=metrics
        )
        caplog.set_level(logging.INFO, logger="jobfence")
        run = asyncio.create_task(worker.run(until="empty"))
        try:

            async def published_and_some_done() -> bool:
                outbox = await scalar(conn, "SELECT count(*) FROM jobfence.outbox")
                return outbox == 0 and metrics.count("succeeded") >= 5

            await wait_until(published_and_some_done, timeout=30, message="the first jobs")
            before = len(caplog.records)
            server.kill()
            await asyncio.sleep(outage_seconds)  # the outage itself: its length is the experiment
            server.start()
            server.wait_ready()
            await asyncio.wait_for(run, timeout=60)
        finally:
            worker.stop()
            await asyncio.wait_for(asyncio.shield(run), timeout=30)
            await queue.close()
            await pool.close()

    during = caplog.records[before:]
    messages = [r.getMessage() for r in during if r.levelno >= logging.INFO]
    from_client = [r for r in during if r.name.startswith("nats") and r.levelno >= logging.WARNING]
    assert not from_client, [r.getMessage() for r in from_client]
    went = [m for m in messages if m.startswith("broker went away (QueueUnavailable: NATS")]
    back = [m for m in messages if m.startswith("broker back after ")]
    print("\n".join(["", *messages]))
    assert len(went) == 1, messages
    assert len(back) == 1, messages
    warnings = [r.getMessage() for r in during if r.levelno >= logging.WARNING]
    assert len(warnings) <= 3, warnings  # went away; the acks' and the relay's first failure
    assert not [m for m in messages if REPR.search(m)], messages
    assert await scalar(conn, "SELECT count(*) FROM awards") == jobs
    assert await scalar(conn, "SELECT count(DISTINCT job_id) FROM awards") == jobs
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0


async def test_no_responders_from_nats_is_the_broker_unavailable(nats_url: str) -> None:
    """A stream without a leader answers nobody: JetStream's "no responders". Here the stream
    is deleted behind the adapter's back, which gives the same answer on one server."""
    name = f"jftest{uuid.uuid4().hex[:10]}"
    queue = NatsQueue(nats_url, stream=name.upper(), subject_prefix=name)
    message = Message(queue="q", consumer="c", job_id="j1", body=b"{}")
    try:
        await queue.publish(message)
        nc = await nats.connect(nats_url)
        try:
            await nc.jetstream().delete_stream(name.upper())
        finally:
            await nc.close()
        with pytest.raises(QueueUnavailable, match="NATS unreachable: NoStreamResponseError"):
            await queue.publish(message)
    finally:
        await queue.close()


async def test_a_stream_nats_cannot_create_fails_the_start_up_saying_what_did_not_answer(
    database_url: str, tmp_path: Path
) -> None:
    """A command whose replicated stream cannot be created (one server of a cluster of three
    up: no quorum) ends in one line naming the stream and how long it waited, not "no answer
    within 45s"."""
    require_nats_server()
    ports = [(free_port(), free_port()) for _ in range(3)]
    lone = NatsServer(
        name="jf-lone",
        port=ports[0][0],
        cluster_port=ports[0][1],
        store=tmp_path / "store",
        log=tmp_path / "lone.log",
        routes=[ports[1][1], ports[2][1]],
        cluster_name=f"jf{uuid.uuid4().hex[:8]}",
    )
    lone.start()
    try:
        lone.wait_ready()
        done = await asyncio.to_thread(_move, database_url, f"{lone.url}?replicas=3&stream_wait=3")
    finally:
        lone.kill()
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        f"jobfence: error: cannot open the nats queue at {lone.url}: QueueUnavailable: NATS "
        "JetStream did not create or confirm the stream JOBFENCE (3 replica(s)) within 3s; "
        "last answer: "
    ), lines
    assert "no answer within" not in done.stderr
