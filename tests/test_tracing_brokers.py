"""OpenTelemetry traces through the outbox relay to RabbitMQ, NATS JetStream and Redis Streams:
a request's job is created in the outbox, sent by the relay, and processed from the broker,
one trace joined by parent and link; a retry and a dead letter on the broker stay in it; a
hostile trace header on a broker message is dropped and the job runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
from opentelemetry.trace import SpanKind
from psycopg_pool import AsyncConnectionPool

import pointsapp
from brokers import BROKERS, make_queue, on_broker
from jobfence import Producer, QueuePort, RetryPolicy, Worker, ops
from jobfence.dead_letters import get_dead_letter
from jobfence.model import Message
from jobfence.outbox import OutboxRelaySettings, record_queue
from jobfence.queues import parse_queue_url
from support import scalar
from tracing_support import Traces, hexid, linked, parent_of, recording

FAST = RetryPolicy(
    max_retries=1, base_seconds=0.05, cap_seconds=0.1, rationale="a test: retries at once"
)


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traces]:
    yield from recording(monkeypatch)


@pytest.fixture(params=BROKERS)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, QueuePort]]:
    async with on_broker(request, [pointsapp.QUEUE], prefix="jftrace") as (kind, url, name):
        queue = make_queue(kind, url, name)
        yield kind, url, queue
        await queue.close()


async def _on_broker(conn: psycopg.AsyncConnection[Any], url: str) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    target = parse_queue_url(url)
    await record_queue(conn, target.kind, target.location)


async def _work(app: Any, pool: AsyncConnectionPool[Any], queue: QueuePort) -> dict[str, int]:
    worker = Worker(
        app,
        pool,
        queue,
        concurrency=2,
        poll_seconds=0.05,
        lease_seconds=30,
        outbox_settings=OutboxRelaySettings(poll_seconds=0.05),
    )
    stats = await asyncio.wait_for(worker.run(until="empty"), 90)
    return dict(stats.outcomes)


async def test_a_request_span_reaches_the_process_span_through_the_outbox_and_the_broker(
    broker: tuple[str, str, QueuePort],
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    _, url, queue = broker
    await _on_broker(conn, url)
    app = pointsapp.build_app()
    with traces.tracer.start_as_current_span("POST /orders"):
        async with await psycopg.AsyncConnection.connect(database_url) as tx:
            await app.enqueue(tx, "award_points", {"account_id": 1, "points": 2}, job_id="o-1")
            await tx.commit()
    assert await scalar(conn, "SELECT count(traceparent) FROM jobfence.outbox") == 1

    assert await _work(app, pool, queue) == {"succeeded": 1}

    request = traces.one("POST /orders")
    create = traces.one(f"create {pointsapp.QUEUE}")
    send = traces.one(f"send {pointsapp.QUEUE}")
    process = traces.one(f"process {pointsapp.QUEUE}")
    assert parent_of(create) == hexid(request)
    assert send.kind == SpanKind.PRODUCER
    assert parent_of(send) == hexid(create)
    assert (send.attributes or {})["messaging.operation.type"] == "send"
    assert hexid(send)[0] == hexid(request)[0]
    assert linked(process) == [hexid(send)]
    assert (process.attributes or {})["jobfence.outcome"] == "succeeded"


async def test_a_retry_and_a_dead_letter_on_a_broker_stay_linked_to_the_request_trace(
    broker: tuple[str, str, QueuePort],
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    _, url, queue = broker
    await _on_broker(conn, url)
    app = pointsapp.build_app(FAST)
    with traces.tracer.start_as_current_span("POST /orders"):
        async with await psycopg.AsyncConnection.connect(database_url) as tx:
            await app.enqueue(
                tx,
                "award_points",
                {"account_id": 1, "points": 2, "mode": "transient"},
                job_id="o-2",
            )
            await tx.commit()
    assert await _work(app, pool, queue) == {"retried": 1, "dead_lettered": 1}
    request_trace = hexid(traces.one("POST /orders"))[0]
    processes = sorted(
        traces.named(f"process {pointsapp.QUEUE}"),
        key=lambda s: (s.attributes or {})["jobfence.attempt"],
    )
    assert [(s.attributes or {})["jobfence.outcome"] for s in processes] == [
        "retry",
        "dead_letter",
    ]
    for span in processes:
        assert [trace for trace, _ in linked(span)] == [request_trace]
    letter = await get_dead_letter(
        conn, await scalar(conn, "SELECT id FROM core.dead_letters WHERE job_id = 'o-2'")
    )
    assert letter.trace_id == hexid(processes[-1])[0]


async def test_a_hostile_trace_header_on_a_broker_message_is_dropped_and_the_job_runs(
    broker: tuple[str, str, QueuePort],
    traces: Traces,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    _, url, queue = broker
    await _on_broker(conn, url)
    app = pointsapp.build_app()
    body = b'{"account_id": 1, "points": 1}'
    await queue.publish(
        Message(
            queue=pointsapp.QUEUE,
            consumer="award_points",
            job_id="h-1",
            body=body,
            traceparent="00-" + "f" * 32 + "-" + "e" * 16 + "-01" + "x" * 5000,
            tracestate="a=b",
        )
    )
    assert await _work(app, pool, queue) == {"succeeded": 1}
    assert not traces.one(f"process {pointsapp.QUEUE}").links


async def test_an_outbox_row_with_a_hostile_trace_context_is_published_without_it(
    broker: tuple[str, str, QueuePort],
    traces: Traces,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The outbox is producer-writable: junk in its trace columns is dropped by the relay, and
    the job goes out and runs like any other."""
    _, url, queue = broker
    await _on_broker(conn, url)
    app = pointsapp.build_app()
    await conn.execute(
        "INSERT INTO jobfence.outbox (queue, consumer, job_id, body, traceparent, tracestate)"
        " VALUES (%s, 'award_points', 'x-1', %s, %s, %s)",
        (pointsapp.QUEUE, b'{"account_id": 1, "points": 1}', "00-" + "z" * 52, "a=b\nc"),
    )
    assert await _work(app, pool, queue) == {"succeeded": 1}
    send = traces.one(f"send {pointsapp.QUEUE}")
    assert parent_of(send) is None
    assert linked(traces.one(f"process {pointsapp.QUEUE}")) == [hexid(send)]


async def test_a_poison_message_and_its_bulk_replay_on_a_broker_stay_linked(
    broker: tuple[str, str, QueuePort],
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Poison from a producer without the schema, then a bulk replay through the outbox: the
    replay's send span is the replay span's child, and the replayed job's process span links
    to that send and to the attempt that failed."""
    _, url, queue = broker
    await _on_broker(conn, url)
    app = pointsapp.build_app()
    with traces.tracer.start_as_current_span("POST /orders"):
        async with await psycopg.AsyncConnection.connect(database_url) as tx:
            await Producer(routes={"award_points": pointsapp.QUEUE}).enqueue(
                tx, "award_points", {"account_id": "x"}, job_id="p-1"
            )
            await tx.commit()
    assert await _work(app, pool, queue) == {"poison": 1}
    failed = traces.one(f"process {pointsapp.QUEUE}")
    assert (failed.attributes or {})["jobfence.outcome"] == "poison"
    assert linked(failed) == [hexid(traces.one(f"send {pointsapp.QUEUE}"))]

    traces.exporter.clear()
    run = await ops.start_bulk_replay(
        pool, ops.DeadLetterFilter(queue=pointsapp.QUEUE), requested_by="carol"
    )
    assert not isinstance(run, int)
    await ops.run_bulk_replay(pool, queue, run.id, actor="carol")
    assert await _work(app, pool, queue) == {"poison": 1}  # the same payload: poison again
    replay = traces.one(f"replay {pointsapp.QUEUE}")
    send = traces.one(f"send {pointsapp.QUEUE}")
    assert (replay.attributes or {})["jobfence.actor"] == "carol"
    assert linked(replay) == [hexid(failed)]
    assert parent_of(send) == hexid(replay)
    assert linked(traces.one(f"process {pointsapp.QUEUE}")) == [hexid(send), hexid(failed)]
