"""The scale-out setup queues.md recommends, on a real cluster: three ``nats-server`` processes
on loopback, clustered, with JetStream, and a stream with three replicas asked for on the queue
URL (``nats://a,nats://b,nats://c?replicas=3``) as a command takes it.

These run on private servers (free ports, their own store directories), never on the shared
server on 4222; they need ``nats-server`` and skip without it, except under ``CI=true``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest
from nats.js.api import StreamInfo
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence.adapters.nats import NatsQueue
from jobfence.outbox import OutboxRelay, OutboxRelaySettings, record_queue
from jobfence.queues import open_queue, parse_queue_url
from nats_servers import NatsServer, nats_cluster
from support import scalar, wait_until

TESTS_DIR = Path(__file__).parent
JOBS = 3_000
WORKERS = 2
BATCH, CONCURRENCY = 50, 8
# More than the workers can hold at once: applied past it, they fetched after the kill.
IN_HAND = WORKERS * (BATCH + CONCURRENCY) + 50


def _url(servers: list[NatsServer], **params: str) -> str:
    query = "&".join(f"{name}={value}" for name, value in params.items())
    return ",".join(s.url for s in servers) + (f"?{query}" if query else "")


async def _stream_info(servers: list[NatsServer], stream: str) -> StreamInfo:
    """The stream's info, asked of whichever running server answers (again for up to 30 s
    while the cluster elects a leader)."""
    deadline = time.monotonic() + 30
    while True:
        up = [s.url for s in servers if s.running]
        try:
            nc = await nats.connect(up, connect_timeout=2, max_reconnect_attempts=1)
            try:
                return await nc.jetstream(timeout=3).stream_info(stream)
            finally:
                await nc.close()
        except (nats.errors.Error, OSError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_workers_opening_together_on_a_fresh_cluster_all_get_the_replicated_stream(
    tmp_path: Path,
) -> None:
    with nats_cluster(tmp_path) as servers:
        url = _url(servers, replicas="3", stream="RACE")
        target = parse_queue_url(url)
        # Six commands started at once, while the servers are still electing their leaders: each
        # races to create the stream; none may fail.
        opened = await asyncio.gather(
            *(open_queue(target, None) for _ in range(6)), return_exceptions=True
        )
        try:
            failed = [o for o in opened if isinstance(o, BaseException)]
            assert not failed, failed
            info = await _stream_info(servers, "RACE")
            assert info.config.num_replicas == 3
            assert info.cluster is not None and info.cluster.leader
            assert len(info.cluster.replicas or []) == 2
        finally:
            for queue in opened:
                if isinstance(queue, NatsQueue):
                    await queue.close()


class _Worker:
    def __init__(self, n: int, database_url: str, queue_url: str, log: Path) -> None:
        self.log = log
        env = {
            **os.environ,
            "JOBFENCE_DATABASE_URL": database_url,
            "JOBFENCE_QUEUE_URL": queue_url,
            "PYTHONPATH": str(TESTS_DIR),
        }
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jobfence.cli", "worker", "pointsapp:app"]
                + ["--lease-seconds", "4", "--concurrency", str(CONCURRENCY)]
                + ["--batch-size", str(BATCH)]
                + (["--no-outbox-relay"] if n else []),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=TESTS_DIR,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def workers() -> Iterator[list[_Worker]]:
    started: list[_Worker] = []
    yield started
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.wait(timeout=10)


@pytest.mark.timeout(150)
async def test_a_killed_stream_leader_loses_no_job_and_applies_none_twice(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    tmp_path: Path,
    workers: list[_Worker],
) -> None:
    started = time.monotonic()
    await conn.execute(pointsapp.SCHEMA_SQL)
    with nats_cluster(tmp_path) as servers:
        url = _url(servers, replicas="3")
        target = parse_queue_url(url)
        await record_queue(conn, target.kind, target.location)
        # The jobs go through the outbox, as every producer's do on a broker.
        app = pointsapp.build_app()
        async with conn.transaction():
            for n in range(JOBS):
                await app.enqueue(
                    conn,
                    "award_points",
                    {"account_id": n % 10 + 1, "points": 1},
                    job_id=f"c-{n}",
                )
        for n in range(WORKERS):
            workers.append(_Worker(n, database_url, url, tmp_path / f"worker-{n}.log"))

        async def applied() -> int:
            return int(await scalar(conn, "SELECT count(*) FROM public.awards"))

        async def a_third_applied() -> bool:
            for worker in workers:
                assert worker.proc.poll() is None, worker.output()
            return await applied() >= JOBS // 3

        await wait_until(a_third_applied, timeout=60, message="a third of the jobs applied")
        info = await _stream_info(servers, "JOBFENCE")
        assert info.config.num_replicas == 3  # from the URL
        assert info.cluster is not None
        leader = next(s for s in servers if s.name == info.cluster.leader)
        before = await applied()
        leader.kill()
        killed_at = time.monotonic()

        async def going_on() -> bool:
            return await applied() > before + IN_HAND

        await wait_until(going_on, timeout=30, interval=0.05, message="new jobs applied")
        resumed = time.monotonic() - killed_at
        leader.start()
        leader.wait_ready()

        async def all_applied() -> bool:
            for worker in workers:
                assert worker.proc.poll() is None, worker.output()
            return await applied() >= JOBS

        await wait_until(all_applied, timeout=60, message="every job applied")
        new_info = await _stream_info(servers, "JOBFENCE")
        assert new_info.cluster is not None

        async def drained() -> bool:
            return (
                await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
                and (await _stream_info(servers, "JOBFENCE")).state.messages == 0
            )

        await wait_until(drained, timeout=30, message="the outbox and the stream empty")
        for worker in workers:
            worker.proc.send_signal(signal.SIGTERM)
        for worker in workers:
            await asyncio.to_thread(worker.proc.wait, 30)

    # No job lost, none applied twice: one effect and one fence row per job, no dead letter.
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == JOBS
    assert await scalar(conn, "SELECT count(DISTINCT job_id) FROM public.awards") == JOBS
    assert await scalar(conn, "SELECT sum(points) FROM public.accounts") == JOBS
    assert (
        await scalar(conn, "SELECT count(*) FROM core.processed_jobs WHERE job_id LIKE 'c-%'")
        == JOBS
    )
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0
    internal = [w.output() for w in workers if "internal error" in w.output()]
    assert not internal, internal
    print(
        f"\nNATS cluster of 3, stream replicas=3: {JOBS} jobs by {WORKERS} worker processes; "
        f"the stream leader ({leader.name}) SIGKILLed after {before} applied and restarted; "
        f"the workers applied jobs fetched after the kill {resumed:.2f}s after it; new leader "
        f"{new_info.cluster.leader}; whole test {time.monotonic() - started:.1f}s"
    )
    assert resumed < 30, resumed


async def _trickle(database_url: str, produced: list[str], stop: asyncio.Event) -> None:
    """A producer committing one job every 50 ms through the outbox until ``stop``."""
    app = pointsapp.build_app()
    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        while not stop.is_set():
            job_id = f"f-{len(produced)}"
            await app.enqueue(tx, "award_points", {"account_id": 1, "points": 1}, job_id=job_id)
            await tx.commit()
            produced.append(job_id)
            await asyncio.sleep(0.05)


async def _stopped(relay: OutboxRelay, task: asyncio.Task[Any], conn: Any) -> None:
    relay.stop()
    await conn.execute("SELECT pg_notify('jobfence_outbox', '')")  # wakes it at once
    await asyncio.wait_for(task, 30)


async def _job_ids_on(queue: Any, count: int) -> set[str]:
    """The job ids on ``queue`` (acked), once ``count`` came or 30 s passed."""
    found: set[str] = set()
    deadline = time.monotonic() + 30
    while len(found) < count and time.monotonic() < deadline:
        for delivery in await queue.receive(
            [pointsapp.QUEUE], max_messages=200, lease_seconds=30, wait_seconds=1
        ):
            found.add(delivery.message.job_id)
            await queue.ack(delivery)
    return found


@pytest.mark.timeout(150)
async def test_after_a_stream_leader_is_killed_the_relay_publishes_within_seconds_of_the_new_leader(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A producer commits a job every 50 ms through the outbox while the relay publishes to a
    three-replica stream; the stream's leader is SIGKILLed. The relay sees one outage (no row
    is pushed back on its own), and publishes what was held back within seconds of the new
    leader's election. Every job reaches the stream, none is lost."""
    caplog.set_level(logging.INFO)
    await conn.execute(pointsapp.SCHEMA_SQL)
    with nats_cluster(tmp_path) as servers:
        url = _url(servers, replicas="3")
        target = parse_queue_url(url)
        await record_queue(conn, target.kind, target.location)
        produced: list[str] = []
        producing = asyncio.Event()
        queue = await open_queue(target, pool)
        relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
        task = asyncio.create_task(relay.run())
        producer = asyncio.create_task(_trickle(database_url, produced, producing))
        try:

            async def publishing() -> bool:
                assert not task.done(), task
                return relay.stats.published >= 20

            await wait_until(publishing, timeout=60, message="the relay publishing")
            info = await _stream_info(servers, "JOBFENCE")
            assert info.cluster is not None and info.config.num_replicas == 3
            leader = next(s for s in servers if s.name == info.cluster.leader)
            leader.kill()
            killed_at = time.monotonic()
            rest = [s for s in servers if s is not leader]

            async def new_leader() -> bool:
                found = await _stream_info(rest, "JOBFENCE")
                return found.cluster is not None and found.cluster.leader not in (
                    None,
                    leader.name,
                )

            await wait_until(new_leader, timeout=60, interval=0.05, message="a new leader")
            elected_at = time.monotonic()
            held_back = await scalar(conn, "SELECT max(id) FROM jobfence.outbox")

            async def held_back_published() -> bool:
                assert not task.done(), task
                left = await scalar(
                    conn, "SELECT count(*) FROM jobfence.outbox WHERE id <= %s", (held_back,)
                )
                return left == 0

            await wait_until(held_back_published, timeout=30, message="the held-back jobs")
            caught_up = time.monotonic() - elected_at
            election = elected_at - killed_at
        finally:
            producing.set()
            await producer
            await _stopped(relay, task, conn)

        # What the producer committed after that: published by a relay's next round.
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await OutboxRelay(database_url, queue).run_round(c)
        assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
        on_stream = await _job_ids_on(queue, len(produced))
        await queue.close()

    lines = [r.getMessage() for r in caplog.records if r.name == "jobfence.outbox"]
    print(
        f"\nNATS cluster of 3, stream replicas=3: {len(produced)} commits, one every 50 ms; "
        f"leader {leader.name} SIGKILLed; a new leader seen {election:.2f}s after the kill; "
        f"the jobs held back until then published {caught_up:.2f}s after it; "
        f"{relay.stats.outages} outage(s), "
        f"{relay.stats.failed} failed publish attempt(s)"
    )
    assert on_stream == set(produced)
    assert not [line for line in lines if "publishing job" in line], lines
    assert relay.stats.dead_lettered == 0
    assert caught_up < 5.0, caught_up
