"""PgQueue: the queue contract, plus what only PostgreSQL gives (SKIP LOCKED, LISTEN/NOTIFY)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from jobfence import ConfigError, PgQueue, QueueCapabilities
from jobfence.adapters.pg_queue import NOTIFY_CHANNEL, publish_on
from queue_conformance import QUEUE, FakeClock, QueueConformance, QueueEnv, message
from support import scalar, wait_until
from tcp_proxy import tcp_proxy


async def listener_is_up(conn: psycopg.AsyncConnection[Any]) -> None:
    """Return once some session of this database has run LISTEN and sits idle, listening."""

    async def listening() -> bool:
        count = await scalar(
            conn,
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND state = 'idle' AND query = %s",
            (f"LISTEN {NOTIFY_CHANNEL}",),
        )
        return bool(count)

    await wait_until(listening, timeout=10.0, message="the queue's LISTEN connection")


class TestPgQueueConformance(QueueConformance):
    expected_capabilities = QueueCapabilities(
        transactional=True, delayed_publish=True, delayed_retry=True
    )

    @pytest.fixture
    async def env(
        self, pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
    ) -> AsyncIterator[QueueEnv]:
        clock = FakeClock()
        # A long poll interval, so only a NOTIFY can make a waiting receiver return early.
        queue = PgQueue(pool, clock=clock, poll_interval_seconds=30.0)
        yield QueueEnv(
            queue=queue,
            clock=clock,
            work_conn=conn,
            until_receiver_waits=lambda: listener_is_up(conn),
        )
        await queue.close()


async def test_concurrent_receivers_never_get_the_same_message(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    expected = {f"job-{i:03d}" for i in range(200)}
    async with conn.transaction():
        for job_id in sorted(expected):
            await publish_on(conn, message(job_id))
    queue = PgQueue(pool)

    async def receiver() -> list[str]:
        got: list[str] = []
        while batch := await queue.receive([QUEUE], max_messages=5, lease_seconds=300.0):
            got.extend(d.message.job_id for d in batch)
        return got

    results = await asyncio.gather(*(receiver() for _ in range(4)))
    await queue.close()

    received = [job_id for result in results for job_id in result]
    assert len(received) == len(set(received)), "a message was delivered to two receivers"
    assert set(received) == expected
    assert sum(1 for result in results if result) >= 2, "the receivers did not run concurrently"


async def test_a_waiting_receiver_wakes_on_notify_despite_a_long_poll_interval(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    queue = PgQueue(pool, poll_interval_seconds=30.0)
    receiver = asyncio.create_task(
        queue.receive([QUEUE], max_messages=5, lease_seconds=60.0, wait_seconds=10.0)
    )
    loop = asyncio.get_running_loop()
    try:
        await listener_is_up(conn)
        assert not receiver.done()
        async with conn.transaction():  # committed from a connection outside the queue's pool
            await publish_on(conn, message("notified"))
        committed = loop.time()
        got = await asyncio.wait_for(receiver, timeout=5.0)
        woke_after = loop.time() - committed
    finally:
        receiver.cancel()
        await queue.close()
    assert [d.message.job_id for d in got] == ["notified"]
    assert woke_after < 1.0


@contextlib.asynccontextmanager
async def gated_proxy(database_url: str, gate: asyncio.Event) -> AsyncIterator[str]:
    """A TCP proxy to the database that connects nobody until ``gate`` is set; yields its URL."""
    params = conninfo_to_dict(database_url)
    host = str(params.get("host") or "/var/run/postgresql")
    port = int(params.get("port") or 5432)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        await gate.wait()
        if host.startswith("/"):
            server_r, server_w = await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        else:
            server_r, server_w = await asyncio.open_connection(host, port)
        await asyncio.gather(
            pipe(client_r, server_w), pipe(server_r, client_w), return_exceptions=True
        )

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    proxy_port = server.sockets[0].getsockname()[1]
    try:
        params.pop("hostaddr", None)
        yield make_conninfo("", **{**params, "host": "127.0.0.1", "port": proxy_port})
    finally:
        server.close()


async def test_a_publish_committed_before_the_listener_listens_is_not_missed(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    """The receiver's first look finds nothing; a publish commits before its LISTEN runs, so
    that NOTIFY reaches nobody. The receiver must look again once it listens, not at the poll."""
    gate = asyncio.Event()

    async def first_look_done() -> bool:
        count = await scalar(
            conn,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = 'idle' AND query LIKE %s",
            # The fetch's text as pg_stat_activity keeps it (its first 1 kB): "WITH due AS" opens
            # the statement (after the BEGIN that sets its isolation level, where one is needed).
            ("%WITH due AS%",),
        )
        return bool(count)

    loop = asyncio.get_running_loop()
    async with gated_proxy(database_url, gate) as listen_conninfo:
        queue = PgQueue(pool, poll_interval_seconds=30.0, listen_conninfo=listen_conninfo)
        receiver = asyncio.create_task(
            queue.receive([QUEUE], max_messages=5, lease_seconds=60.0, wait_seconds=10.0)
        )
        try:
            await wait_until(first_look_done, message="the receiver's first look")
            async with conn.transaction():
                await publish_on(conn, message("early"))
            assert not receiver.done()
            gate.set()
            opened = loop.time()
            got = await asyncio.wait_for(receiver, timeout=15.0)
            woke_after = loop.time() - opened
        finally:
            receiver.cancel()
            await queue.close()
    assert [d.message.job_id for d in got] == ["early"]
    assert woke_after < 2.0


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("inf"), float("nan")])
async def test_a_poll_interval_that_cannot_find_a_delayed_job_is_refused(
    pool: AsyncConnectionPool[Any], seconds: float
) -> None:
    """A delayed job falls due with no NOTIFY: only the poll finds it. An infinite interval
    would leave it waiting for ever, and one of 0 or less would poll without pause."""
    with pytest.raises(ConfigError, match="poll_interval_seconds must be a positive, finite"):
        PgQueue(pool, poll_interval_seconds=seconds)


async def test_jobs_a_fetch_took_when_its_reply_was_lost_are_given_back_at_the_next_fetch(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A fetch whose reply the network lost has leased its jobs on the server, and nobody holds
    them: before, they waited out their lease (300 s by default) after every database blip
    that cut a fetch. The next fetch gives them back and takes them again, attempt uncounted."""
    expected = {f"lost-{i}" for i in range(5)}
    async with conn.transaction():
        for job_id in sorted(expected):
            await publish_on(conn, message(job_id))
    async with tcp_proxy(database_url) as proxy:
        proxy.reply_delay = 0.3  # each reply is held back long enough to be cut
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            proxy.url(database_url), min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
        )
        await pool.open(wait=True)
        queue = PgQueue(pool)
        try:
            fetch = asyncio.create_task(
                queue.receive([QUEUE], max_messages=10, lease_seconds=300.0)
            )

            async def leased() -> bool:
                count = await scalar(
                    conn,
                    "SELECT count(*) FROM jobfence_queue.messages WHERE lease_token IS NOT NULL",
                )
                return bool(count == len(expected))

            await wait_until(leased, message="the fetch to lease the jobs on the server")
            await proxy.cut()
            with pytest.raises(psycopg.OperationalError):
                await fetch
            proxy.reply_delay = 0.0
            proxy.up()
            again = await queue.receive([QUEUE], max_messages=10, lease_seconds=300.0)
        finally:
            await queue.close()
            await pool.close()
    assert {d.message.job_id for d in again} == expected
    assert {d.attempt for d in again} == {1}


async def test_after_a_long_outage_the_queue_listens_again_within_seconds_of_the_return(
    database_url: str, pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    """The LISTEN connection is tried again at least every 2 s while the database is away, as
    the pools are: after an 8 s outage, a waiting receiver is woken by NOTIFY again within
    seconds, not after a backoff grown to 10 s (until then it polls)."""
    name = "jobfence-listen-through-proxy"  # tells the session apart, on TCP or a Unix socket
    async with tcp_proxy(database_url) as proxy:

        async def listening_through_the_proxy() -> bool:
            count = await scalar(
                conn,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state = 'idle' AND query = %s AND application_name = %s",
                (f"LISTEN {NOTIFY_CHANNEL}", name),
            )
            return bool(count)

        listen_conninfo = make_conninfo(proxy.url(database_url), application_name=name)
        queue = PgQueue(pool, listen_conninfo=listen_conninfo, poll_interval_seconds=30.0)
        waiting = asyncio.create_task(
            queue.receive([QUEUE], max_messages=1, lease_seconds=30, wait_seconds=600)
        )
        try:
            await wait_until(listening_through_the_proxy, message="the queue's LISTEN session")
            await proxy.cut()
            loop = asyncio.get_running_loop()
            await asyncio.sleep(8.0)  # the outage itself: its length is the experiment
            proxy.up()
            back = loop.time()
            await wait_until(
                listening_through_the_proxy, timeout=15, message="the queue to listen again"
            )
            took = loop.time() - back
            await publish_on(conn, message("woken"))
            (delivery,) = await asyncio.wait_for(waiting, 5)  # by NOTIFY, not the 30 s poll
            assert delivery.message.job_id == "woken"
        finally:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await queue.close()
    print(f"\nlistening again {took:.2f}s after the database came back")
    assert took < 3.5
