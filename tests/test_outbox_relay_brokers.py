"""The outbox relay on the real brokers of this machine, through a TCP proxy that adds latency
or cuts the broker away (never the shared services themselves): it always makes progress, backs
off once per broker outage, and is back within a second or two of the broker's return.

The figures each test measured are printed (``pytest -s`` shows them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from brokers import BROKERS, delete_everything, make_queue, on_broker, rabbitmq_max_message_size
from jobfence import JobRefused, Message, Producer, QueuePort, Worker, replay_dead_letter
from jobfence.adapters.nats import NatsQueue
from jobfence.codec import original_message
from jobfence.limits import UNFENCEABLE, bounded
from jobfence.outbox import OutboxRelay, OutboxRelaySettings, record_queue, write
from jobfence.queues import parse_queue_url
from support import scalar, wait_until
from tcp_proxy import TcpProxy

AWARD = "award_points"


def through(proxy: TcpProxy, url: str) -> str:
    """``url`` with its host and port replaced by the proxy's."""
    parts = urlsplit(url)
    userinfo, _, _ = parts.netloc.rpartition("@")
    netloc = f"{userinfo}@" if userinfo else ""
    return urlunsplit(parts._replace(netloc=f"{netloc}127.0.0.1:{proxy.port}"))


@contextlib.asynccontextmanager
async def proxied(url: str, *, reply_delay: float = 0.0) -> AsyncIterator[TcpProxy]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 0
    async with TcpProxy(host, port, reply_delay=reply_delay) as p:
        yield p


# nats-py drops the stream writer of a connection that broke without closing it (its reconnect
# opens a new one), which Python reports as an unraisable ResourceWarning when it is collected.
_NATS_LEAKS_A_WRITER = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(
    params=[
        pytest.param(kind, marks=_NATS_LEAKS_A_WRITER) if kind == "nats" else kind
        for kind in BROKERS
    ]
)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    async with on_broker(request, [pointsapp.QUEUE], prefix="jfrelay") as found:
        yield found


async def _external(conn: psycopg.AsyncConnection[Any], url: str) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    target = parse_queue_url(url)
    await record_queue(conn, target.kind, target.location)


async def _run(relay: OutboxRelay) -> asyncio.Task[Any]:
    task = asyncio.create_task(relay.run())

    async def active() -> bool:
        assert not task.done(), task
        return relay.active

    await wait_until(active, timeout=20, message="the relay to be active")
    return task


async def _stop(relay: OutboxRelay, task: asyncio.Task[Any], conn: Any) -> None:
    relay.stop()
    await conn.execute("SELECT pg_notify('jobfence_outbox', '')")
    await asyncio.wait_for(task, 30)


def _outbox_empty(conn: psycopg.AsyncConnection[Any]) -> Callable[[], Awaitable[bool]]:
    async def empty() -> bool:
        return await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0

    return empty


async def _relay_until_empty(
    database_url: str, queue: QueuePort, conn: psycopg.AsyncConnection[Any], *, timeout: float
) -> None:
    """A relay publishes to ``queue`` until the outbox is empty, then stops."""
    relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
    task = await _run(relay)
    try:
        await wait_until(_outbox_empty(conn), timeout=timeout, message="the outbox to empty")
    finally:
        await _stop(relay, task, conn)


async def test_with_50ms_confirms_and_a_2s_idle_transaction_timeout_the_relay_empties_the_outbox(
    broker: tuple[str, str, str],
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """No transaction stays open while the broker is waited for: 300 rows, every reply of the
    broker 50 ms late, PostgreSQL killing any session idle in a transaction for 2 s."""
    kind, url, name = broker
    await _external(conn, url)
    dbname = conn.info.dbname
    await conn.execute(f'ALTER DATABASE "{dbname}" SET idle_in_transaction_session_timeout = 2000')
    await pointsapp.enqueue_awards(database_url, [f"s-{n}" for n in range(300)])
    async with proxied(url, reply_delay=0.05) as proxy:
        queue = make_queue(kind, through(proxy, url), name)
        relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
        loop = asyncio.get_running_loop()
        started = loop.time()
        task = await _run(relay)
        try:

            async def empty() -> bool:
                return await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0

            await wait_until(empty, timeout=60, interval=0.05, message="the outbox to empty")
            took = loop.time() - started
        finally:
            await _stop(relay, task, conn)
            size = await queue.size([pointsapp.QUEUE])
            await queue.close()
    print(
        f"\n{kind}: 300 rows with 50 ms confirms published in {took:.2f}s,"
        f" {size.total} messages on the broker"
    )
    assert relay.stats.published >= 300
    assert 300 <= size.total <= 310, size  # every row, at most a few twice
    if kind == "nats":  # a row sent twice has the same Nats-Msg-Id: JetStream keeps one
        assert size.total == 300, size
    assert relay.stats.failed == 0


def _close_from_the_broker(proxy: TcpProxy) -> None:
    """As a RabbitMQ that shuts down does: the broker closes the connections the proxy carries
    (``connection.close``, 320 CONNECTION_FORCED), our own only, never the others'."""
    rabbitmqctl = shutil.which("rabbitmqctl")
    if rabbitmqctl is None:
        return
    ports = proxy.upstream_ports
    listed = subprocess.run(
        [rabbitmqctl, "-q", "list_connections", "pid", "peer_port"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    for line in listed.splitlines():
        pid, _, port = line.partition("\t")
        if port.strip().isdigit() and int(port) in ports:
            subprocess.run(
                [rabbitmqctl, "-q", "close_connection", pid, "broker going down"],
                capture_output=True,
                timeout=60,
                check=False,
            )


async def _broker_away(kind: str, proxy: TcpProxy, relay: OutboxRelay) -> None:
    """Cut the broker away (RabbitMQ first closes the connection itself, as when it stops) and
    wait until the relay has seen it."""
    if kind == "rabbitmq":
        await asyncio.to_thread(_close_from_the_broker, proxy)
    await proxy.cut()

    async def seen() -> bool:
        return relay.broker_down

    await wait_until(seen, timeout=20, message="the outage to be seen")


async def test_a_broker_outage_under_a_trickle_of_commits_is_one_backoff_and_two_log_lines(
    broker: tuple[str, str, str],
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The broker goes away for about 4 s while a producer commits a job every 50 ms: the relay
    stops publishing (a NOTIFY does not wake it), probes with one message at a bounded, jittered
    backoff, logs the outage as two lines, and publishes what was held back within a second or
    two of the broker's return."""
    caplog.set_level(logging.INFO)
    kind, url, name = broker
    await _external(conn, url)
    loop = asyncio.get_running_loop()
    producing = asyncio.Event()
    produced = 0

    async def trickle() -> None:
        nonlocal produced
        while not producing.is_set():
            await pointsapp.enqueue_awards(database_url, [f"t-{produced}"])
            produced += 1
            await asyncio.sleep(0.05)

    async with proxied(url) as proxy:
        queue: QueuePort = make_queue(kind, through(proxy, url), name)
        relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
        task = await _run(relay)
        producer = asyncio.create_task(trickle())
        try:

            async def some_published() -> bool:
                return relay.stats.published >= 5

            await wait_until(some_published, timeout=20, message="publishes before the outage")
            await _broker_away(kind, proxy, relay)
            await asyncio.sleep(4.0)
            held_back = await scalar(conn, "SELECT max(id) FROM jobfence.outbox")
            assert held_back is not None and relay.broker_down
            failed_during = relay.stats.failed
            proxy.up()
            back_at = loop.time()

            async def held_back_published() -> bool:
                left = await scalar(
                    conn, "SELECT count(*) FROM jobfence.outbox WHERE id <= %s", (held_back,)
                )
                return left == 0

            await wait_until(held_back_published, timeout=30, message="the held-back jobs")
            recovered = loop.time() - back_at
        finally:
            producing.set()
            await producer
            await _stop(relay, task, conn)
            await queue.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "jobfence.outbox"]
    print(
        f"\n{kind}: {produced} commits; {failed_during} failed publish attempts during the"
        f" outage; last held-back job published {recovered:.2f}s after the broker's return"
    )
    assert len([line for line in lines if "broker went away" in line]) == 1, lines
    assert len([line for line in lines if "broker back after" in line]) == 1, lines
    assert not [line for line in lines if "publishing job" in line], lines
    assert relay.stats.outages == 1
    # One for the batch the outage caught, then one per probe: 0.5 s doubling to 2 s, halved
    # at most by the jitter, over about 4 s.
    assert failed_during <= 10, failed_during
    assert recovered < 5.0
    noisy = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and r.name != "jobfence.outbox"
        and "runs without AOF" not in r.getMessage()  # the test Redis's own
    ]
    assert not noisy, [f"{r.name}: {r.getMessage()}" for r in noisy]
    assert "StopAsyncIteration" not in caplog.text


@pytest.fixture(params=["redis"])
async def one_broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    """One broker, for what does not depend on which."""
    async with on_broker(request, [pointsapp.QUEUE], prefix="jfrelay") as found:
        yield found


DATABASE_OUTAGE_SECONDS = 8.0


async def test_the_relay_logs_a_database_outage_as_two_lines_and_resumes_within_seconds(
    one_broker: tuple[str, str, str],
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The relay's database goes away for 8 s (a proxy between them is cut) while producers
    commit: one WARNING when it goes, one INFO when it is back, no line per failed reconnect,
    and what waited is published within seconds of the database's return. (Reconnecting 0.5 s
    doubling to 30 s apart, it was published about 7 s after it.)"""
    caplog.set_level(logging.INFO)
    kind, url, name = one_broker
    await _external(conn, url)
    queue = make_queue(kind, url, name)
    loop = asyncio.get_running_loop()

    async def outbox_empty() -> bool:
        return await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0

    async with TcpProxy.for_database(database_url) as proxy:
        relay = OutboxRelay(
            proxy.url(database_url), queue, settings=OutboxRelaySettings(poll_seconds=0.05)
        )
        task = await _run(relay)
        try:
            await pointsapp.enqueue_awards(database_url, ["before"])
            await wait_until(outbox_empty, message="the job before the outage published")
            await proxy.cut()

            async def noticed() -> bool:
                return "outbox relay: database went away" in caplog.text

            await wait_until(noticed, message="the relay to notice the outage")
            await pointsapp.enqueue_awards(database_url, [f"during-{n}" for n in range(5)])
            await asyncio.sleep(DATABASE_OUTAGE_SECONDS)  # the outage's length is the experiment
            proxy.up()
            back_at = loop.time()
            await wait_until(outbox_empty, timeout=30, message="the jobs that waited published")
            recovered = loop.time() - back_at
        finally:
            await _stop(relay, task, conn)
            size = await queue.size([pointsapp.QUEUE])
            await queue.close()
    print(f"\n{kind}: published {recovered:.2f}s after the database's return")
    lines = [r.getMessage() for r in caplog.records if r.name == "jobfence.outbox"]
    assert len([line for line in lines if "database went away" in line]) == 1, lines
    assert len([line for line in lines if "database back after" in line]) == 1, lines
    assert not [line for line in lines if "database error" in line or "still" in line], lines
    assert recovered < 4.0
    assert size.total == 6


@contextlib.contextmanager
def private_nats(tmp_path: Path, *, max_payload: int) -> Iterator[str]:
    """A NATS server of this test's own (JetStream, ``max_payload`` bytes), on a free port."""
    nats_server = shutil.which("nats-server")
    if nats_server is None:
        pytest.skip("nats-server is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / f"nats-{port}.conf"
    config.write_text(
        f'port: {port}\nmax_payload: {max_payload}\njetstream {{ store_dir: "{tmp_path}/js" }}\n'
    )
    proc = subprocess.Popen(
        [nats_server, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError("the private nats-server did not start")
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


async def test_a_message_over_the_brokers_limit_is_a_dead_letter_with_its_alert_then_replayable(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
    tmp_path: Path,
) -> None:
    """1.5 MB on a NATS server whose max_payload is 1 MB: refused for good, so a dead letter of
    its own class (``PublishRefused``) with its alert at once, no retry, no outage, while the
    messages around it are published; once the limit is raised, its replay goes through."""
    with private_nats(tmp_path, max_payload=1024 * 1024) as small:
        await _external(conn, small)
        blob = json.dumps({"account_id": 1, "points": 1, "note": "x" * 1_500_000}).encode()
        for job_id, body in (("small-1", b"{}"), ("too-big", blob), ("small-2", b"{}")):
            await write(conn, Message(pointsapp.QUEUE, AWARD, job_id, body))
        queue = NatsQueue(small, stream="JFBIG", subject_prefix="jfbig")
        relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
        try:
            async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
                await relay.run_round(c)
            assert relay.stats.published == 2 and relay.stats.dead_lettered == 1
            assert relay.stats.outages == 0 and not relay.broker_down
            assert (await queue.size([pointsapp.QUEUE])).total == 2

            # The relay recorded the server's limit: a producer now refuses such a job at
            # enqueue, naming the limit, and its transaction goes on.
            producer = Producer(routes={AWARD: pointsapp.QUEUE})
            async with await psycopg.AsyncConnection.connect(database_url) as tx:
                with pytest.raises(JobRefused) as refused:
                    await producer.enqueue(
                        tx, AWARD, {"note": "x" * 1_500_000}, job_id="refused-at-enqueue"
                    )
                assert refused.value.field == "payload"
                assert "1,048,576 bytes" in str(refused.value), refused.value
                assert "nats" in str(refused.value)
                await producer.enqueue(tx, AWARD, {"note": "small"}, job_id="still-fine")
                await tx.commit()
            cur = await conn.execute("SELECT job_id FROM jobfence.outbox")
            assert await cur.fetchall() == [("still-fine",)]
            await conn.execute("DELETE FROM jobfence.outbox")
        finally:
            await queue.close()
    cur = await conn.execute(
        "SELECT id, job_id, error_class, last_error, attempts, octet_length(payload::text) > 1e6"
        " FROM core.dead_letters"
    )
    ((dead_letter_id, job_id, error_class, last_error, attempts, whole),) = await cur.fetchall()
    assert (job_id, error_class, attempts, whole) == ("too-big", "PublishRefused", 1, True)
    assert "max_payload of 1,048,576 bytes" in last_error, last_error
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
    assert await _alerts_of(conn, dead_letter_id) == 1

    # The cause fixed (a server that takes 4 MB): the replay is published and applied once.
    with private_nats(tmp_path / "large", max_payload=4 * 1024 * 1024) as large:
        queue = NatsQueue(large, stream="JFBIG", subject_prefix="jfbig")
        try:
            await _replayed_and_published(database_url, pool, queue, dead_letter_id)
            (delivery,) = await queue.receive(
                [pointsapp.QUEUE], max_messages=5, lease_seconds=30, wait_seconds=10
            )
            assert delivery.message.job_id == "too-big"
            assert len(delivery.message.body) > 1_500_000
            await queue.ack(delivery)
        finally:
            await queue.close()


async def _replayed_and_published(
    database_url: str, pool: AsyncConnectionPool[Any], queue: QueuePort, dead_letter_id: int
) -> None:
    """Replay the dead letter, then one relay round publishes it, and only it."""
    result = await replay_dead_letter(pool, queue, dead_letter_id, resolved_by="ops")
    assert result.published
    relay = OutboxRelay(database_url, queue)
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
        await relay.run_round(c)
    assert relay.stats.published == 1 and relay.stats.dead_lettered == 0


async def test_a_refused_message_whose_job_id_no_dead_letter_could_hold_does_not_stop_the_relay(
    database_url: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    """A row written straight into the outbox with a 3,000-character job id (over the limit of
    1,024 bytes, and over what an index entry of core.dead_letters can hold) and a body over
    NATS's max_payload. Such a row is one dead letter of class UnfenceableMessage, its job id a
    bounded stand-in, and the rows beside it are published once each. Before, its dead letter
    could not be inserted: the relay's round failed, and the same batch was published again
    every round, forever."""
    long_id = secrets.token_hex(1500)  # random: an index entry cannot compress it
    with private_nats(tmp_path, max_payload=1024 * 1024) as small:
        await _external(conn, small)
        blob = json.dumps({"account_id": 1, "points": 1, "note": "x" * 1_500_000}).encode()
        for job_id, body in (("small-1", b"{}"), (long_id, blob), ("small-2", b"{}")):
            await conn.execute(
                "INSERT INTO jobfence.outbox (queue, consumer, job_id, body)"
                " VALUES (%s, %s, %s, %s)",
                (pointsapp.QUEUE, AWARD, job_id, body),
            )
        queue = NatsQueue(small, stream="JFLONGID", subject_prefix="jflongid")
        relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
        try:
            async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
                await relay.run_round(c)
                await relay.run_round(c)
            assert (relay.stats.published, relay.stats.dead_lettered) == (2, 1)
            assert relay.stats.outages == 0
            assert (await queue.size([pointsapp.QUEUE])).total == 2
        finally:
            await queue.close()
    assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
    cur = await conn.execute("SELECT id, job_id, error_class, payload FROM core.dead_letters")
    ((dead_letter_id, job_id, error_class, payload),) = await cur.fetchall()
    assert (job_id, error_class) == (bounded(long_id), UNFENCEABLE)
    kept = original_message(json.dumps(payload))
    assert (kept.job_id, kept.body) == (long_id, blob)
    assert await _alerts_of(conn, dead_letter_id) == 1


async def _alerts_of(conn: psycopg.AsyncConnection[Any], dead_letter_id: int) -> int:
    """How many alerts were recorded for the dead letter."""
    return int(
        await scalar(
            conn,
            "SELECT count(*) FROM jobfence.alert_outbox WHERE dead_letter_id = %s",
            (dead_letter_id,),
        )
    )


async def _bodies_on(queue: QueuePort, *, count: int) -> dict[str, int]:
    """The size of each job's body on ``queue`` (acked), once ``count`` jobs came or 20 s
    passed."""
    got: dict[str, int] = {}
    deadline = time.monotonic() + 20
    while len(got) < count and time.monotonic() < deadline:
        for delivery in await queue.receive(
            [pointsapp.QUEUE], max_messages=10, lease_seconds=30, wait_seconds=2
        ):
            got[delivery.message.job_id] = len(delivery.message.body)
            await queue.ack(delivery)
    return got


@pytest.mark.serial  # sets the broker's max_message_size for every connection
async def test_a_message_over_rabbitmqs_max_message_size_is_a_dead_letter_and_the_others_go_on(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
    amqp_url: str,
) -> None:
    """RabbitMQ closes the publishing channel at a message over its ``max_message_size``, and
    every message beside it on that channel fails with it. The relay makes the big one a dead
    letter of class ``PublishRefused`` (with its alert) and publishes the others in the same
    round, none counted as failed; a second one is refused without being sent; once the limit
    is raised, the replay goes through."""
    from jobfence.adapters.rabbitmq import RabbitMQQueue

    name = f"jfbig{uuid.uuid4().hex[:12]}"
    await _external(conn, amqp_url)
    blob = json.dumps({"account_id": 1, "points": 1, "note": "x" * 6000}).encode()
    job_ids = ["small-1", "too-big", *(f"small-{n}" for n in range(2, 7))]
    for job_id in job_ids:
        await write(
            conn, Message(pointsapp.QUEUE, AWARD, job_id, blob if job_id == "too-big" else b"{}")
        )
    queue = RabbitMQQueue(amqp_url, prefix=name)
    try:
        with rabbitmq_max_message_size(4096):
            relay = OutboxRelay(
                database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05)
            )
            async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
                await relay.run_round(c)
            assert relay.stats.published == 6 and relay.stats.dead_lettered == 1
            assert relay.stats.failed == 0 and relay.stats.outages == 0
            assert not relay.broker_down
            assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0

            # RabbitMQ does not announce its limit, and may raise it: nothing is recorded for
            # producers. Within the minute, another body over the limit is refused unsent,
            # and the channel stays open for the message beside it.
            assert (
                await scalar(conn, "SELECT queue_max_message_bytes FROM jobfence.settings") is None
            )
            await write(conn, Message(pointsapp.QUEUE, AWARD, "too-big-2", blob))
            await write(conn, Message(pointsapp.QUEUE, AWARD, "small-7", b"{}"))
            async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
                await relay.run_round(c)
            assert relay.stats.published == 7 and relay.stats.dead_lettered == 2
            assert relay.stats.failed == 0

        cur = await conn.execute(
            "SELECT id, job_id, error_class, last_error, attempts, octet_length(payload::text)"
            " FROM core.dead_letters ORDER BY id"
        )
        dead = await cur.fetchall()
        assert [row[1:3] + row[4:] for row in dead] == [
            ("too-big", "PublishRefused", 1, len(blob)),
            ("too-big-2", "PublishRefused", 1, len(blob)),
        ]
        dead_letter_id, last_error = dead[0][0], dead[0][3]
        assert "max_message_size of 4,096 bytes" in last_error, last_error
        assert await _alerts_of(conn, dead_letter_id) == 1

        # The limit raised again: the replay is published (a new adapter, as after a restart)
        # and reaches the queue whole, beside the seven others.
        await queue.close()
        queue = RabbitMQQueue(amqp_url, prefix=name)
        await _replayed_and_published(database_url, pool, queue, dead_letter_id)
        got = await _bodies_on(queue, count=8)
        assert got == {
            job_id: len(blob) if job_id == "too-big" else 2 for job_id in [*job_ids, "small-7"]
        }
    finally:
        await queue.close()
        await delete_everything("rabbitmq", amqp_url, name, [pointsapp.QUEUE])


async def test_a_queue_rabbitmq_will_not_declare_holds_back_its_rows_alone_and_the_others_go_on(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    amqp_url: str,
) -> None:
    """A queue someone declared on the broker as a classic queue (jobfence declares quorum
    queues): RabbitMQ refuses its declaration and closes the channel. The relay pushes that
    queue's rows back with the broker's error, and publishes the rows of the other queues in
    the same round."""
    from jobfence.adapters.rabbitmq import RabbitMQQueue

    name = f"jfdecl{uuid.uuid4().hex[:12]}"
    await _external(conn, amqp_url)
    admin = await aio_pika.connect(amqp_url)
    channel = await admin.channel()
    await channel.declare_queue(f"{name}.declared-otherwise", durable=True)
    for n in range(6):
        queue_name = "declared-otherwise" if n % 3 == 1 else pointsapp.QUEUE
        await write(conn, Message(queue_name, AWARD, f"d-{n}", b"{}"))
    queue = RabbitMQQueue(amqp_url, prefix=name)
    try:
        relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await relay.run_round(c)
        assert relay.stats.published == 4 and relay.stats.failed == 2
        assert relay.stats.outages == 0 and not relay.broker_down
        cur = await conn.execute(
            "SELECT job_id, attempts, last_error FROM jobfence.outbox ORDER BY job_id"
        )
        held = await cur.fetchall()
        assert [row[:2] for row in held] == [("d-1", 1), ("d-4", 1)]
        assert all("PRECONDITION_FAILED" in row[2] for row in held), held
        assert sorted(await _bodies_on(queue, count=4)) == ["d-0", "d-2", "d-3", "d-5"]
    finally:
        await queue.close()
        await channel.queue_delete(f"{name}.declared-otherwise")
        await admin.close()
        await delete_everything("rabbitmq", amqp_url, name, [pointsapp.QUEUE])


async def test_a_relay_sigkilled_mid_batch_on_a_broker_loses_nothing_and_each_job_applies_once(
    broker: tuple[str, str, str],
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
) -> None:
    """2,000 rows; the relay process is SIGKILLed once some are on the broker and some still in
    the outbox (its claims in flight). The next relay takes over at once, every job is on the
    broker at least once, and the workers apply each exactly once."""
    kind, url, name = broker
    await _external(conn, url)
    jobs = 2000
    await conn.execute(
        "INSERT INTO jobfence.outbox (queue, consumer, job_id, body)"
        " SELECT %s, %s, 'k-' || g, convert_to('{\"account_id\": 1, \"points\": 1}', 'UTF8')"
        " FROM generate_series(1, %s) g",
        (pointsapp.QUEUE, AWARD, jobs),
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(Path(__file__).parent / "outbox_relay_kill_proc.py"),
        database_url,
        kind,
        url,
        name,
        cwd=Path(__file__).parent,
    )
    queue = make_queue(kind, url, name)
    try:

        async def mid_batch() -> bool:
            assert proc.returncode is None
            return (await queue.size([pointsapp.QUEUE])).total >= 300

        await wait_until(mid_batch, timeout=60, interval=0.005, message="publishes under way")
        proc.kill()
        await asyncio.wait_for(proc.wait(), 30)
        left = await scalar(conn, "SELECT count(*) FROM jobfence.outbox")
        claimed = await scalar(
            conn, "SELECT count(*) FROM jobfence.outbox WHERE claimed_until > now()"
        )
        assert 0 < left < jobs, left  # killed mid-way: nothing lost so far

        await _relay_until_empty(database_url, queue, conn, timeout=60)  # the next relay
        on_broker = (await queue.size([pointsapp.QUEUE])).total
        assert on_broker >= jobs
        if kind == "nats":  # the next relay sends a row again with its Nats-Msg-Id: dropped
            assert on_broker == jobs
        app = pointsapp.build_app()
        stats = await asyncio.wait_for(
            Worker(app, pool, queue, poll_seconds=0.05, outbox_relay=False).run(until="empty"),
            120,
        )
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 30)
        await queue.close()
    print(
        f"\n{kind}: killed with {left} rows in the outbox ({claimed} claimed);"
        f" {on_broker - jobs} message(s) published twice"
    )
    assert stats.outcomes.get("succeeded") == jobs, stats.outcomes
    assert stats.outcomes.get("duplicate", 0) == on_broker - jobs
    cur = await conn.execute("SELECT count(DISTINCT job_id), count(*) FROM public.awards")
    assert await cur.fetchone() == (jobs, jobs)


@pytest.fixture(params=[pytest.param("nats", marks=_NATS_LEAKS_A_WRITER)])
async def jetstream(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    async with on_broker(request, [pointsapp.QUEUE], prefix="jfrelay") as found:
        yield found


async def _consume_all(pool: AsyncConnectionPool[Any], queue: QueuePort) -> Any:
    """A worker without a relay of its own, run until ``queue`` is empty; its stats."""
    worker = Worker(pointsapp.build_app(), pool, queue, poll_seconds=0.05, outbox_relay=False)
    return await asyncio.wait_for(worker.run(until="empty"), 60)


async def test_a_row_the_relay_publishes_again_after_a_late_ack_is_one_message_on_jetstream(
    jetstream: tuple[str, str, str],
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JetStream stores a message and its ack comes too late: the relay counts a failed publish
    and publishes the row again. The stream drops the second copy (the row's ``Nats-Msg-Id``),
    so the job is delivered once, at attempt 1."""
    from jobfence.adapters import nats as nats_adapter

    kind, url, name = jetstream
    await _external(conn, url)
    monkeypatch.setattr(nats_adapter, "_ACKS_WITHIN", 0.3)
    await pointsapp.enqueue_awards(database_url, ["late-1"])
    direct = make_queue(kind, url, name)
    async with proxied(url, reply_delay=1.0) as proxy:
        queue = make_queue(kind, through(proxy, url), name)
        relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
        task = await _run(relay)
        try:

            async def failed_once() -> bool:
                return relay.stats.failed >= 1

            await wait_until(failed_once, timeout=30, message="a publish whose ack came late")
            proxy.reply_delay = 0.0
            await wait_until(_outbox_empty(conn), timeout=30, message="the outbox to empty")
        finally:
            await _stop(relay, task, conn)
            await queue.close()
    try:
        assert (await direct.size([pointsapp.QUEUE])).total == 1
        stats = await _consume_all(pool, direct)
    finally:
        await direct.close()
    assert stats.outcomes == {"succeeded": 1}, stats.outcomes


async def test_two_outbox_rows_of_the_same_job_are_two_messages_on_jetstream(
    jetstream: tuple[str, str, str],
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    pool: AsyncConnectionPool[Any],
) -> None:
    """A row's publish id is its own: the same job enqueued twice (or replayed) is two rows and
    two messages, and the fence, not the broker, makes the second a duplicate."""
    kind, url, name = jetstream
    await _external(conn, url)
    await pointsapp.enqueue_awards(database_url, ["twice-1"])
    await pointsapp.enqueue_awards(database_url, ["twice-1"])
    queue = make_queue(kind, url, name)
    try:
        await _relay_until_empty(database_url, queue, conn, timeout=30)
        assert (await queue.size([pointsapp.QUEUE])).total == 2
        stats = await _consume_all(pool, queue)
    finally:
        await queue.close()
    assert stats.outcomes == {"succeeded": 1, "duplicate": 1}, stats.outcomes
