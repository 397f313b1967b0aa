"""A hand-made broker message whose fields do not parse is one dead letter, and the queue goes on.

Each test publishes straight to the real broker (not through the adapter), as a producer in
another language would. Every field jobfence reads from a message (consumer, job id, tenant,
correlation id, the deliveries its job already had, the broker's delivery count) is read in one
function with its bounds (``jobfence.adapters._shared.read_delivery``). A message that fails is
exactly one ``UnfenceableMessage`` dead letter that keeps the whole message, it is acked, and
the jobs behind it run. Without that, an attempt header ``abc`` looped once per lease forever
("cannot fetch jobs (ValueError ...)"), and ``-100`` ran the handler with ``job.attempt = -99``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pointsapp
from brokers import BROKERS, make_queue, on_broker
from jobfence import Delivery, Message, PrometheusMetrics, QueuePort, Worker
from jobfence.codec import PAYLOAD_MESSAGE, original_message
from jobfence.limits import UNFENCEABLE
from support import scalar

BODY = b'{"account_id": 1, "points": 5}'


@pytest.fixture(params=BROKERS)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str, QueuePort]]:
    async with on_broker(request, [pointsapp.QUEUE]) as (kind, url, name):
        queue = make_queue(kind, url, name)
        yield kind, url, name, queue
        await queue.close()


async def publish_raw(kind: str, url: str, name: str, fields: dict[str, Any]) -> None:
    """Publish a message straight to the broker, as the adapter would name its fields (the
    adapter's queue, stream or consumer group exists already), with ``fields`` as given."""
    if kind == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        await client.xadd(f"{name}:{{{pointsapp.QUEUE}}}:stream", {"body": BODY, **fields})
        await client.aclose()
    elif kind == "nats":
        import nats

        nc = await nats.connect(url)
        headers = {f"Jobfence-{k.title().replace('_', '-')}": str(v) for k, v in fields.items()}
        await nc.jetstream().publish(
            f"{name}.{pointsapp.QUEUE}", BODY, stream=name.upper(), headers=headers
        )
        await nc.close()
    else:
        import aio_pika

        connection = await aio_pika.connect(url)
        channel = await connection.channel(publisher_confirms=True)
        headers = {f"x-jobfence-{k.replace('_', '-')}": v for k, v in fields.items()}
        await channel.default_exchange.publish(
            aio_pika.Message(BODY, headers=headers), routing_key=f"{name}.{pointsapp.QUEUE}"
        )
        await connection.close()


def _message_fields(job_id: str, prior: object) -> dict[str, Any]:
    return {"consumer": "award_points", "job_id": job_id, "prior": prior}


async def _run_until_empty(
    pool: AsyncConnectionPool[Any], queue: QueuePort, **kwargs: Any
) -> PrometheusMetrics:
    metrics = PrometheusMetrics()
    worker = Worker(
        pointsapp.build_app(),
        pool,
        queue,
        concurrency=2,
        poll_seconds=0.05,
        lease_seconds=30,
        metrics=metrics,
        **kwargs,
    )
    await asyncio.wait_for(worker.run(until="empty"), 60)
    return metrics


async def _unfenceable_letters(conn: psycopg.AsyncConnection[Any]) -> list[dict[str, Any]]:
    async with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        await cur.execute(
            "SELECT job_id, error_class, attempts, payload::text AS payload_text,"
            " payload_encoding, last_error FROM core.dead_letters ORDER BY id"
        )
        return await cur.fetchall()


@pytest.mark.parametrize(
    "prior",
    [
        pytest.param("abc", id="abc"),
        pytest.param("-100", id="minus-100"),
        pytest.param(str(10**12), id="10e12"),
    ],
)
async def test_a_bad_attempt_header_is_one_dead_letter_and_the_jobs_behind_it_run(
    broker: tuple[str, str, str, QueuePort],
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    prior: str,
) -> None:
    kind, url, name, queue = broker
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    award = {"account_id": 1, "points": 5}
    await queue.publish(app.message("award_points", award, job_id="before"))
    # RabbitMQ carries numbers as numbers: a producer there would send -100 and 10^12 as ints.
    raw: object = int(prior) if kind == "rabbitmq" and prior != "abc" else prior
    await publish_raw(kind, url, name, _message_fields("bad-attempt", raw))
    for n in range(3):
        await queue.publish(app.message("award_points", award, job_id=f"after-{n}"))

    metrics = await _run_until_empty(pool, queue)

    assert metrics.count("succeeded") == 4
    assert metrics.count("poison") == 1
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 20
    (letter,) = await _unfenceable_letters(conn)
    assert letter["error_class"] == UNFENCEABLE
    assert letter["job_id"] == "bad-attempt"
    assert letter["attempts"] == 1  # the broker's own count: the header could not say
    assert letter["payload_encoding"] == PAYLOAD_MESSAGE
    assert "is not a whole number from 0 to 2147483646" in letter["last_error"]
    assert repr(prior) in letter["last_error"] or prior in letter["last_error"]
    kept = original_message(letter["payload_text"])
    assert kept == Message(pointsapp.QUEUE, "award_points", "bad-attempt", BODY)
    assert "cannot be read as it was published" in json.loads(letter["payload_text"])["note"]
    # Acked: nothing left on the broker, and no fence for the unread message.
    assert (await queue.size([pointsapp.QUEUE])).total == 0
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 4


async def test_on_nats_one_unreadable_header_does_not_fail_the_pull_batch(
    request: pytest.FixtureRequest,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The batch of one pull holds a good job, one with ``Jobfence-Prior: abc``, one without
    any header (a consumer-less message: poison) and one whose job id is percent-encoding
    that is not UTF-8: one receive hands out all four, and each bad one is its own dead
    letter."""
    request.param = "nats"
    async with on_broker(request, [pointsapp.QUEUE]) as (kind, url, name):
        queue = make_queue(kind, url, name)
        try:
            app = pointsapp.build_app()
            award = {"account_id": 1, "points": 5}
            await queue.publish(app.message("award_points", award, job_id="good-1"))
            await publish_raw(kind, url, name, _message_fields("bad-prior", "abc"))
            import nats

            nc = await nats.connect(url)
            js = nc.jetstream()
            await js.publish(f"{name}.{pointsapp.QUEUE}", BODY, stream=name.upper())
            await js.publish(
                f"{name}.{pointsapp.QUEUE}",
                BODY,
                stream=name.upper(),
                headers={"Jobfence-Consumer": "award_points", "Jobfence-Job-Id": "bad-%FF%FE"},
            )
            await nc.close()
            await queue.publish(app.message("award_points", award, job_id="good-2"))

            got: list[Delivery] = await queue.receive(
                [pointsapp.QUEUE], max_messages=10, lease_seconds=30
            )
            assert len(got) == 5
            unreadable = [d.unreadable for d in got if d.unreadable is not None]
            assert len(unreadable) == 2
            assert "header Jobfence-Prior 'abc' is not a whole number" in unreadable[0]
            assert (
                "header Jobfence-Job-Id 'bad-%FF%FE' is not valid percent-encoded"
                in (unreadable[1])
            )
            for delivery in got:  # give them back, uncounted, for the worker
                await queue.release(delivery)

            await conn.execute(pointsapp.SCHEMA_SQL)
            metrics = await _run_until_empty(pool, queue)
            assert metrics.count("succeeded") == 2
            assert metrics.count("poison") == 3
            letters = await _unfenceable_letters(conn)
            assert sorted(d["error_class"] for d in letters) == [UNFENCEABLE] * 3
            assert (await queue.size([pointsapp.QUEUE])).total == 0
        finally:
            await queue.close()


@pytest.mark.parametrize("status", ["404", "100", "503", "408"])
async def test_on_nats_a_user_header_named_status_is_a_delivery_like_any_other(
    request: pytest.FixtureRequest,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    status: str,
) -> None:
    """A producer's own header ``Status: 404`` (or 100, 503, 408) is not the server's status
    reply to a pull request (that one has no reply subject; a delivery always has one): the
    message runs as any other, and so do the jobs behind it. It used to end the pull batch
    (404, 408: it and the rest waited out AckWait and came back first, for ever), be skipped as
    a heartbeat (100), or fail every receive as "no responders" (503)."""
    request.param = "nats"
    async with on_broker(request, [pointsapp.QUEUE]) as (kind, url, name):
        queue = make_queue(kind, url, name)
        try:
            await conn.execute(pointsapp.SCHEMA_SQL)
            app = pointsapp.build_app()
            award = {"account_id": 1, "points": 5}
            await queue.publish(app.message("award_points", award, job_id="before"))
            import nats

            nc = await nats.connect(url)
            await nc.jetstream().publish(
                f"{name}.{pointsapp.QUEUE}",
                BODY,
                stream=name.upper(),
                headers={
                    "Jobfence-Consumer": "award_points",
                    "Jobfence-Job-Id": "user-status",
                    "Status": status,
                    "Description": "the producer's own",
                },
            )
            await nc.close()
            for n in range(3):
                await queue.publish(app.message("award_points", award, job_id=f"after-{n}"))

            metrics = await asyncio.wait_for(_run_until_empty(pool, queue), 20)

            assert (metrics.count("succeeded"), metrics.count("poison")) == (5, 0)
            assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 25
            assert await _unfenceable_letters(conn) == []
            assert (await queue.size([pointsapp.QUEUE])).total == 0
        finally:
            await queue.close()


async def _raw_hpub(url: str, subject: str, header_block: bytes, body: bytes) -> None:
    """Publish with NATS's own protocol, as a client in another language (or a buggy one)
    could: the header block's bytes exactly as given."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 4222)
    try:
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"headers":true}\r\n')
        size = len(header_block) + len(body)
        writer.write(b"HPUB %s %d %d\r\n" % (subject.encode(), len(header_block), size))
        writer.write(header_block + body + b"\r\nPING\r\n")
        await writer.drain()
        # The server answers the PING once it has handled the HPUB before it.
        assert (await asyncio.wait_for(reader.readline(), 5)).strip() == b"PONG"
    finally:
        writer.close()


async def test_on_nats_a_header_block_that_is_not_utf8_is_one_dead_letter_and_the_rest_run(
    request: pytest.FixtureRequest,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A header block whose first line is ``NATS/1.0 \\xff\\xfe\\xfd`` (a status that is not
    UTF-8) used to kill nats-py's read loop (``UnicodeDecodeError``) on every connection it
    reached: the worker then received nothing, for ever. It is one ``UnfenceableMessage``
    dead letter, and the connection and the jobs behind it go on."""
    request.param = "nats"
    async with on_broker(request, [pointsapp.QUEUE]) as (kind, url, name):
        queue = make_queue(kind, url, name)
        try:
            await conn.execute(pointsapp.SCHEMA_SQL)
            app = pointsapp.build_app()
            award = {"account_id": 1, "points": 5}
            await queue.publish(app.message("award_points", award, job_id="before"))
            await _raw_hpub(
                url,
                f"{name}.{pointsapp.QUEUE}",
                b"NATS/1.0 \xff\xfe\xfd\r\nJobfence-Consumer: award_points\r\n"
                b"Jobfence-Job-Id: bad-status-line\r\n\r\n",
                BODY,
            )
            for n in range(3):
                await queue.publish(app.message("award_points", award, job_id=f"after-{n}"))

            metrics = await asyncio.wait_for(_run_until_empty(pool, queue), 20)

            assert (metrics.count("succeeded"), metrics.count("poison")) == (4, 1)
            assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 20
            (letter,) = await _unfenceable_letters(conn)
            assert letter["error_class"] == UNFENCEABLE
            assert letter["job_id"] == "bad-status-line"
            assert "its header block cannot be read" in letter["last_error"]
            kept = original_message(letter["payload_text"])
            assert kept == Message(pointsapp.QUEUE, "award_points", "bad-status-line", BODY)
            assert (await queue.size([pointsapp.QUEUE])).total == 0
        finally:
            await queue.close()


async def test_on_redis_a_job_id_that_is_not_utf8_is_one_dead_letter(
    request: pytest.FixtureRequest,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    request.param = "redis"
    async with on_broker(request, [pointsapp.QUEUE]) as (kind, url, name):
        queue = make_queue(kind, url, name)
        try:
            await conn.execute(pointsapp.SCHEMA_SQL)
            app = pointsapp.build_app()
            award = {"account_id": 1, "points": 5}
            await queue.publish(app.message("award_points", award, job_id="good-1"))
            await publish_raw(
                kind, url, name, {"consumer": "award_points", "job_id": b"bad-\xff\xfe"}
            )
            await queue.publish(app.message("award_points", award, job_id="good-2"))
            metrics = await _run_until_empty(pool, queue)
            assert (metrics.count("succeeded"), metrics.count("poison")) == (2, 1)
            (letter,) = await _unfenceable_letters(conn)
            assert "field job_id is not valid UTF-8" in letter["last_error"]
            assert letter["job_id"] == "bad-\\xff\\xfe"
            assert (await queue.size([pointsapp.QUEUE])).total == 0
        finally:
            await queue.close()


async def test_on_rabbitmq_a_buffered_bad_attempt_header_goes_back_and_the_rest_too(
    request: pytest.FixtureRequest,
) -> None:
    """The adapter reads the attempt header in two places: at delivery, and when it gives a
    buffered message back to the queue (a busy receiver). Both read it the same way: the bad
    one goes back as it is, and the good one behind it goes back too (the give-back used to
    stop at the bad header, leaving the rest unacked on the channel)."""
    request.param = "rabbitmq"
    async with on_broker(request, [pointsapp.QUEUE]) as (kind, url, name):
        first = make_queue(kind, url, name)
        second = make_queue(kind, url, name)
        try:
            app = pointsapp.build_app()
            award = {"account_id": 1, "points": 5}
            await first.publish(app.message("award_points", award, job_id="taken"))
            await publish_raw(kind, url, name, _message_fields("bad-prior", "abc"))
            await first.publish(app.message("award_points", award, job_id="buffered"))
            (taken,) = await first.receive([pointsapp.QUEUE], max_messages=1, lease_seconds=1.0)
            assert taken.message.job_id == "taken"
            assert await first.ack(taken)
            # The other two wait in the first adapter's buffer; after 1 s unclaimed it gives
            # them back to the queue, where the second adapter takes them.
            seen: list[Delivery] = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while len(seen) < 2 and loop.time() < deadline:
                seen += await second.receive(
                    [pointsapp.QUEUE], max_messages=10, lease_seconds=30, wait_seconds=0.5
                )
            assert sorted(d.message.job_id for d in seen) == ["bad-prior", "buffered"]
            bad = next(d for d in seen if d.message.job_id == "bad-prior")
            assert bad.unreadable is not None and "x-jobfence-prior 'abc'" in bad.unreadable
            good = next(d for d in seen if d.message.job_id == "buffered")
            assert good.unreadable is None and good.attempt == 1
            for delivery in seen:
                assert await second.ack(delivery)
            assert (await second.size([pointsapp.QUEUE])).total == 0
        finally:
            await first.close()
            await second.close()


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        pytest.param(
            {"headers": [(b"x-\xff\xfe", b"S\x00\x00\x00\x01v")]},
            "property headers: a header name is not valid UTF-8",
            id="header-name-not-utf8",
        ),
        pytest.param(
            {"headers": [(b"sent-at", b"T" + (2**64 - 1).to_bytes(8, "big"))]},
            "property headers: a header value is a timestamp out of range",
            id="header-timestamp-out-of-range",
        ),
        pytest.param(
            {"message_id": b"caf\xe9-42"},
            "property message-id is not valid UTF-8",
            id="message-id-not-utf8",
        ),
        pytest.param(
            {"timestamp_property": 2**64 - 1},
            "property timestamp is out of range",
            id="timestamp-property-out-of-range",
        ),
    ],
)
async def test_on_rabbitmq_a_content_header_the_client_cannot_decode_is_one_dead_letter(
    request: pytest.FixtureRequest,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    fields: dict[str, Any],
    reason: str,
) -> None:
    """RabbitMQ passes on a content header that pamqp cannot decode (a header name or a
    message-id that is not UTF-8, a timestamp of 2^64-1). It used to kill the consumer's
    connection at every delivery, silently: no job ran, not even the one before it. Now the
    message is delivered without its properties and is one dead letter naming what could not
    be read (never the value), and the jobs around it run."""
    import amqp_raw

    request.param = "rabbitmq"
    async with on_broker(request, [pointsapp.QUEUE]) as (kind, url, name):
        queue = make_queue(kind, url, name)
        try:
            await conn.execute(pointsapp.SCHEMA_SQL)
            app = pointsapp.build_app()
            award = {"account_id": 1, "points": 5}
            await queue.publish(app.message("award_points", award, job_id="before"))
            entries = _raw_job_headers(b"hostile", *fields.get("headers", []))
            await amqp_raw.publish_raw(
                url,
                BODY,
                routing_key=f"{name}.{pointsapp.QUEUE}".encode(),
                headers=amqp_raw.table(entries),
                message_id=fields.get("message_id"),
                timestamp_property=fields.get("timestamp_property"),
            )
            for n in range(3):
                await queue.publish(app.message("award_points", award, job_id=f"after-{n}"))

            metrics = await asyncio.wait_for(_run_until_empty(pool, queue), 20)

            assert (metrics.count("succeeded"), metrics.count("poison")) == (4, 1)
            assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 20
            (letter,) = await _unfenceable_letters(conn)
            assert letter["error_class"] == UNFENCEABLE
            assert reason in letter["last_error"]
            assert "caf" not in letter["last_error"] and "sent-at" not in letter["last_error"]
            assert (await queue.size([pointsapp.QUEUE])).total == 0
        finally:
            await queue.close()


async def test_on_rabbitmq_a_routing_key_that_is_not_utf8_does_not_stall_the_queue(
    request: pytest.FixtureRequest,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message can reach a jobfence queue through another exchange bound to it, under a
    routing key that is not UTF-8 (RabbitMQ routes bytes). pamqp could not decode its
    ``basic.deliver``: aiormq's reader stopped, the worker saw an outage, reconnected, and the
    broker delivered the same message again, on every connection: no job behind it ran. The
    routing key is nothing to jobfence (the queue is known from the consumer), so the
    message is a job like any other: it runs once, the jobs around it run, and the worker
    keeps its one connection."""
    import aio_pika

    import amqp_raw
    from jobfence.adapters import rabbitmq

    opened = 0
    connect = rabbitmq._connect

    async def counted(url: str) -> Any:
        nonlocal opened
        opened += 1
        return await connect(url)

    monkeypatch.setattr(rabbitmq, "_connect", counted)
    request.param = "rabbitmq"
    async with on_broker(request, [pointsapp.QUEUE]) as (kind, url, name):
        queue = make_queue(kind, url, name)
        exchange = f"{name}.topic"
        admin = await aio_pika.connect(url)
        try:
            await conn.execute(pointsapp.SCHEMA_SQL)
            app = pointsapp.build_app()
            award = {"account_id": 1, "points": 5}
            await queue.publish(app.message("award_points", award, job_id="before"))
            # The queue exists now: bind it to a topic exchange of the test's own, for any key.
            channel = await admin.channel()
            topic = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC)
            bound = await channel.get_queue(f"{name}.{pointsapp.QUEUE}", ensure=True)
            await bound.bind(topic, routing_key="#")
            entries = _raw_job_headers(b"routed")
            await amqp_raw.publish_raw(
                url,
                BODY,
                exchange=exchange.encode(),
                routing_key=b"\xff\xfe",
                headers=amqp_raw.table(entries),
            )
            for n in range(3):
                await queue.publish(app.message("award_points", award, job_id=f"after-{n}"))

            metrics = await asyncio.wait_for(_run_until_empty(pool, queue), 20)

            assert (metrics.count("succeeded"), metrics.count("poison")) == (5, 0)
            assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 25
            assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 5
            assert await _unfenceable_letters(conn) == []
            assert (await queue.size([pointsapp.QUEUE])).total == 0
            assert opened == 1  # the worker never saw an outage, nor reconnected
        finally:
            await queue.close()
            with contextlib.suppress(Exception):
                channel = await admin.channel()
                await channel.exchange_delete(exchange)
            await admin.close()


def _raw_job_headers(job_id: bytes, *more: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """The AMQP header entries of an ``award_points`` job ``job_id``, then ``more``, raw."""
    import amqp_raw

    return [
        (b"x-jobfence-consumer", amqp_raw.long_string(b"award_points")),
        (b"x-jobfence-job-id", amqp_raw.long_string(job_id)),
        *more,
    ]


def _method_frame(payload: bytes) -> bytes:
    return struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce"


def _short(data: bytes) -> bytes:
    return bytes((len(data),)) + data


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        pytest.param(
            struct.pack(">HH", 60, 60)
            + _short(b"ctag1.x")
            + struct.pack(">Q", 7)
            + b"\x01"
            + _short(b"ex-\xff")
            + _short(b"\xff\xfe.key"),
            {
                "consumer_tag": "ctag1.x",
                "delivery_tag": 7,
                "redelivered": True,
                "exchange": "ex-\ufffd",
                "routing_key": "\ufffd\ufffd.key",
            },
            id="deliver",
        ),
        pytest.param(
            struct.pack(">HHQ", 60, 71, 9)
            + b"\x00"
            + _short(b"")
            + _short(b"caf\xe9")
            + struct.pack(">I", 3),
            {
                "delivery_tag": 9,
                "redelivered": False,
                "exchange": "",
                "routing_key": "caf\ufffd",
                "message_count": 3,
            },
            id="get-ok",
        ),
        pytest.param(
            struct.pack(">HHH", 60, 50, 312)
            + _short(b"NO_ROUTE")
            + _short(b"amq.topic")
            + _short(b"\xff"),
            {
                "reply_code": 312,
                "reply_text": "NO_ROUTE",
                "exchange": "amq.topic",
                "routing_key": "\ufffd",
            },
            id="return",
        ),
    ],
)
def test_a_message_method_whose_routing_key_is_not_utf8_is_read_only_on_jobfence_connections(
    payload: bytes, expected: dict[str, object]
) -> None:
    """On the connections jobfence opens, the bytes that are not UTF-8 in a message's
    ``basic.deliver``, ``basic.get-ok`` or ``basic.return`` are read as U+FFFD (never the
    bytes); for any other pamqp user the frame raises as before."""
    import pamqp.frame
    from pamqp.exceptions import UnmarshalingException

    from jobfence.adapters._amqp import tolerant_headers

    frame = _method_frame(payload)
    with tolerant_headers():
        used, channel, method = pamqp.frame.unmarshal(frame)
    assert (used, channel) == (len(frame), 1)
    assert {name: getattr(method, name) for name in method.__slots__} == expected
    with pytest.raises(UnmarshalingException):
        pamqp.frame.unmarshal(frame)


@pytest.mark.parametrize(
    "payload",
    [
        # channel.close whose reply text is not UTF-8: not a message, the broker's own frame
        pytest.param(struct.pack(">HHH", 20, 40, 406) + _short(b"\xff") + b"\x00\x00\x00\x00"),
        # a basic.deliver cut short after a routing key that is not UTF-8
        pytest.param(struct.pack(">HH", 60, 60) + _short(b"\xff")),
    ],
    ids=["channel-close", "deliver-cut-short"],
)
def test_a_method_frame_that_is_not_a_message_or_not_whole_still_fails(payload: bytes) -> None:
    import pamqp.frame
    from pamqp.exceptions import UnmarshalingException

    from jobfence.adapters._amqp import tolerant_headers

    with tolerant_headers(), pytest.raises(UnmarshalingException):
        pamqp.frame.unmarshal(_method_frame(payload))
