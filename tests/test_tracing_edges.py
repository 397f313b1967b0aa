"""OpenTelemetry traces at hostile edges, with the SDK's in-memory exporter: what a job's span
leaves behind once the job is over (the context work done later runs in), and what a span
records when the statement it wraps fails (never the values the statement carried)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
import sqlalchemy
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import pointsapp
from jobfence import App, HardFailure, PgQueue, Worker, tracing
from jobfence.dead_letters import replay_dead_letter
from jobfence.model import Delivery
from support import scalar
from tracing_support import Traces, hexid, linked, recording

SECRET = "s3cr3t-account-7731"


class Note(BaseModel):
    text: str


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traces]:
    yield from recording(monkeypatch)


def _sqlalchemy_url(database_url: str) -> sqlalchemy.URL:
    params = psycopg.conninfo.conninfo_to_dict(database_url)
    return sqlalchemy.URL.create(
        "postgresql+psycopg",
        username=str(params.get("user", "")) or None,
        password=str(params["password"]) if params.get("password") else None,
        host=str(params.get("host", "")) or None,
        port=int(params["port"]) if params.get("port") else None,
        database=str(params["dbname"]),
    )


def _span_text(span: Any) -> str:
    """Everything a span exports as text: its status, attributes, and its events' attributes."""
    parts = [str(span.status.description), repr(dict(span.attributes or {}))]
    parts += [f"{event.name} {dict(event.attributes or {})!r}" for event in span.events]
    return "\n".join(parts)


# --- a job's context stays with its job ------------------------------------------------------


async def test_batched_acks_are_not_sent_under_an_earlier_jobs_process_span(
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The worker acknowledges finished jobs in batches, from a task of its own: that task must
    not run in the context of the job that happened to start it, or an instrumented queue
    client's ack spans (and any log line of the batcher) name that job's trace."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    await pointsapp.enqueue_awards(database_url, [f"ack-{i}" for i in range(10)])
    queue = PgQueue(pool)
    seen: list[tuple[Any, list[str]]] = []
    ack_many = queue.ack_many

    async def spying(deliveries: Sequence[Delivery]) -> None:
        current = trace.get_current_span().get_span_context()
        seen.append((current, [d.message.job_id for d in deliveries]))
        await ack_many(deliveries)

    queue.ack_many = spying  # type: ignore[method-assign]
    worker = Worker(
        app, pool, queue, concurrency=1, poll_seconds=0.05, lease_seconds=30, ack_batch_size=2
    )
    stats = await asyncio.wait_for(worker.run(until="empty"), 60)
    assert dict(stats.outcomes) == {"succeeded": 10}

    assert seen, "no batched ack was sent"
    process_of = {
        s.get_span_context().span_id: (s.attributes or {}).get("messaging.message.id")
        for s in traces.named(f"process {pointsapp.QUEUE}")
        if s.get_span_context() is not None
    }
    under = [
        f"the acks of {ids} were sent under the process span of job {process_of.get(ctx.span_id)}"
        for ctx, ids in seen
        if ctx.is_valid
    ]
    assert not under, under


async def test_a_replayed_jobs_follow_up_job_does_not_link_to_the_failed_attempt(
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """With ``trace_parent="child"``, a replayed job's process span is the child of its
    ``replay`` span, whose context carries the failed attempt's ids (``tracestate``
    ``jobfence=...``). A job its handler enqueues is a new job, not a replay: its process span
    links to its own producer's span only."""
    app = App()
    failing = [True]

    @app.consumer("first", queue=pointsapp.QUEUE, schema=Note)
    async def first(payload: Note, job: Any, tx: Any) -> None:
        if failing[0]:
            raise HardFailure("not yet")
        await app.enqueue(tx, "second", {"text": "next"}, job_id=f"{job.job_id}:next")

    @app.consumer("second", queue=pointsapp.QUEUE, schema=Note)
    async def second(payload: Note, job: Any, tx: Any) -> None:
        pass

    async def work() -> dict[str, int]:
        worker = Worker(
            app, pool, PgQueue(pool), poll_seconds=0.05, lease_seconds=30, trace_parent="child"
        )
        return dict((await asyncio.wait_for(worker.run(until="empty"), 60)).outcomes)

    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        await app.enqueue(tx, "first", {"text": "a"}, job_id="f-1")
        await tx.commit()
    assert await work() == {"dead_lettered": 1}
    failed = hexid(traces.one(f"process {pointsapp.QUEUE}"))
    dead_id = await scalar(conn, "SELECT id FROM core.dead_letters WHERE job_id = 'f-1'")
    failing[0] = False
    traces.exporter.clear()
    await replay_dead_letter(pool, PgQueue(pool), dead_id, resolved_by="alice")
    assert await work() == {"succeeded": 2}

    processes = {
        (s.attributes or {}).get("messaging.message.id"): s
        for s in traces.named(f"process {pointsapp.QUEUE}")
    }
    replayed, follow_up = processes["f-1"], processes["f-1:next"]
    assert hexid(replayed)[0] == hexid(traces.one(f"replay {pointsapp.QUEUE}"))[0]
    assert linked(replayed) == [failed]  # the replay's own job: linked to what failed
    assert failed not in linked(follow_up), "a new job's span links to another job's failure"
    creates = [
        s
        for s in traces.named(f"create {pointsapp.QUEUE}")
        if (s.attributes or {}).get("messaging.message.id") == "f-1:next"
    ]
    assert len(creates) == 1 and hexid(follow_up)[0] == hexid(creates[0])[0]


# --- what a span records when the statement it wraps fails -----------------------------------


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_a_failed_enqueue_through_sqlalchemy_leaves_no_payload_value_on_its_create_span(
    flavour: str, traces: Traces, database_url: str
) -> None:
    """SQLAlchemy's error text quotes the statement's parameters, the job's body among them:
    the ``create`` span records the error's class, never its text."""
    app = pointsapp.build_app()

    @app.consumer("note", queue=pointsapp.QUEUE, schema=Note)
    async def note(payload: Note, job: Any, tx: Any) -> None:
        pass

    url = _sqlalchemy_url(database_url)
    blocker = await psycopg.AsyncConnection.connect(database_url)
    try:
        # A maintenance statement holds the queue table: the producer's lock_timeout runs out.
        await blocker.execute("LOCK TABLE jobfence_queue.messages IN ACCESS EXCLUSIVE MODE")
        if flavour == "async":
            engine = create_async_engine(url)
            async with AsyncSession(engine) as session:
                await session.execute(sqlalchemy.text("SET LOCAL lock_timeout = '50ms'"))
                with pytest.raises(sqlalchemy.exc.OperationalError) as raised:
                    await app.enqueue(session, "note", {"text": SECRET}, job_id="sa-1")
            await engine.dispose()
        else:
            sync_engine = sqlalchemy.create_engine(url)
            with Session(sync_engine) as sync_session:
                sync_session.execute(sqlalchemy.text("SET LOCAL lock_timeout = '50ms'"))
                with pytest.raises(sqlalchemy.exc.OperationalError) as raised:
                    app.enqueue_sync(sync_session, "note", {"text": SECRET}, job_id="sa-1")
            sync_engine.dispose()
        assert SECRET in str(raised.value)  # the application's own exception keeps it all
    finally:
        await blocker.close()

    create = traces.one(f"create {pointsapp.QUEUE}")
    assert SECRET not in _span_text(create)
    assert create.status.status_code == StatusCode.ERROR
    assert (create.attributes or {}).get("error.type") == "OperationalError"


# --- an exporter that does not answer ---------------------------------------------------------


class _HungExporter(SpanExporter):
    """An exporter whose endpoint never answers: each export blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        self.release.wait(60)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.release.set()


async def test_a_hung_span_exporter_neither_slows_the_jobs_nor_holds_up_the_workers_stop(
    monkeypatch: pytest.MonkeyPatch,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """With the batch span processor the documentation asks for, export runs in the SDK's own
    thread: a dead endpoint costs the worker nothing, and jobfence never waits for a flush."""
    exporter = _HungExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=10))
    tracer = provider.get_tracer("jobfence", tracing.SEMCONV_VERSION)
    monkeypatch.setattr(tracing, "_tracer", lambda: tracer)
    try:
        await conn.execute(pointsapp.SCHEMA_SQL)
        app = pointsapp.build_app()
        await pointsapp.enqueue_awards(database_url, [f"h-{i}" for i in range(40)])
        worker = Worker(app, pool, PgQueue(pool), concurrency=4, poll_seconds=0.05)
        started = time.monotonic()
        stats = await asyncio.wait_for(worker.run(until="empty"), 20)
        elapsed = time.monotonic() - started
        assert dict(stats.outcomes) == {"succeeded": 40}
        assert exporter.calls >= 1  # the exporter was called, and is still stuck
        assert not exporter.release.is_set()
        assert elapsed < 10, f"the worker took {elapsed:.1f}s behind a hung exporter"
    finally:
        exporter.release.set()
        provider.shutdown()
