"""OpenTelemetry traces on the PostgreSQL queue, with the SDK's in-memory exporter: a request
that enqueues, the worker's process span, retries, poison, dead letters and their replay, the
SQL function and its session setting, and trace context that does not parse."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry.trace import SpanKind, StatusCode
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

import pointsapp
from alert_helpers import (
    HARD,
    TOKEN,
    make_relay,
    running,
    sink_for,
    wait_for_alerts,
    write_dead_letter,
)
from fake_betterstack import FakeBetterStack
from jobfence import PgQueue, Producer, RetryPolicy, Worker, ops, tracing
from jobfence.api.schemas import DeadLetterDetailOut
from jobfence.dead_letters import get_dead_letter, replay_dead_letter
from jobfence.model import Message
from jobfence.observability import json_formatter
from jobfence.ops.show import show_dead_letter_json
from roles_support import deployed_roles
from support import scalar, wait_until
from tracing_support import Traces, hexid, linked, parent_of, recording

CRASH_WORKER = Path(__file__).with_name("crash_worker.py")
FAST = RetryPolicy(
    max_retries=1, base_seconds=0.05, cap_seconds=0.1, rationale="a test: retries at once"
)


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traces]:
    yield from recording(monkeypatch)


class N(BaseModel):
    n: int


TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def _work(pool: AsyncConnectionPool[Any], app: Any, **options: Any) -> dict[str, int]:
    worker = Worker(app, pool, PgQueue(pool), poll_seconds=0.05, lease_seconds=30, **options)
    stats = await asyncio.wait_for(worker.run(until="empty"), 60)
    return dict(stats.outcomes)


async def _enqueue_in_request(
    traces: Traces, database_url: str, app: Any, payload: dict[str, Any], job_id: str
) -> Any:
    with traces.tracer.start_as_current_span("POST /orders") as request:
        async with await psycopg.AsyncConnection.connect(database_url) as tx:
            await app.enqueue(tx, "award_points", payload, job_id=job_id, correlation_id="c-1")
            await tx.commit()
    return request


# --- the boundary: what a message carries is parsed once, hostile values dropped -------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0\xff",
        "",
        TP.upper(),
        TP + "-00",
        "01" + TP[2:],
        "00-" + "0" * 32 + "-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0\n",
        "x" * 100_000,
    ],
)
def test_a_traceparent_that_is_not_w3c_version_00_is_dropped(value: object) -> None:
    assert tracing.valid_traceparent(value) is None  # only text at all
    assert tracing.carried(value, "a=b") == (None, None)


def test_a_valid_traceparent_and_tracestate_are_kept_from_text_or_header_bytes() -> None:
    assert tracing.valid_traceparent(TP) == TP
    assert tracing.carried(TP.encode(), b"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7") == (
        TP,
        "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
    )
    assert tracing.trace_id_of(TP) == "0af7651916cd43dd8448eb211c80319c"


@pytest.mark.parametrize(
    "value",
    [
        "a=b\r\nX-Injected: 1",
        "a=" + "v" * 600,
        ",".join(f"k{i}=v" for i in range(33)),
        "UPPER=v",
        "a=b=c",
        "=v",
        b"\xff=v",
        "1abc=v",
        "a=1,9=2",
    ],
)
def test_a_hostile_tracestate_is_dropped_and_the_traceparent_kept(value: object) -> None:
    assert tracing.valid_tracestate(value) is None
    assert tracing.carried(TP, value) == (TP, None)


@pytest.mark.parametrize(
    "value", ["a=1", "a=1,b=2", " a=1 ,\tb@sys=2", "1tenant@sys=v", "a=1,,b=2", "z/*_-9=v w"]
)
def test_a_tracestate_jobfence_keeps_is_one_opentelemetry_reads_whole_without_a_warning(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What jobfence keeps, OpenTelemetry reads whole: a member it cannot read (a key without a
    tenant starting with a digit) makes it drop the whole tracestate and log a WARNING quoting
    the member, a producer's value, on every span of the job."""
    span = pytest.importorskip("opentelemetry.trace")
    assert tracing.valid_tracestate(value) == value
    with caplog.at_level(logging.DEBUG, logger="opentelemetry"):
        state = span.TraceState.from_header([value])
    assert len(state) == value.count("=")
    assert not caplog.records


def test_without_opentelemetry_jobfence_runs_and_never_imports_it(tmp_path: Path) -> None:
    """The extra absent (here: opentelemetry made unimportable): every module of jobfence
    imports, the producer and tracing paths run, and opentelemetry is never in sys.modules."""
    code = """
import importlib, pkgutil, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError("blocked: " + name)
        return None

sys.meta_path.insert(0, Block())
import jobfence
from jobfence import tracing
from jobfence.model import Delivery, Message
for info in pkgutil.walk_packages(jobfence.__path__, "jobfence."):
    # contrib: Django and SQLAlchemy; api: recent FastAPI releases import opentelemetry
    # themselves (FastAPI's own dependency, not jobfence's).
    if info.name.startswith(("jobfence.contrib", "jobfence.api")) or info.name.endswith(
        ".__main__"
    ):
        continue
    importlib.import_module(info.name)
assert not tracing.ENABLED
message = Message(queue="q", consumer="c", job_id="j", body=b"{}")
with tracing.create(message) as traced:
    assert traced is message
with tracing.process(Delivery(message=message, attempt=1, receipt=None), child=False) as span:
    assert span is None
assert tracing.current_traceparent() is None and tracing.current_ids() is None
import logging
from jobfence.observability import json_formatter
record = logging.LogRecord("jobfence", logging.INFO, "x.py", 1, "hello", None, None)
assert "trace_id" not in json_formatter().format(record)
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# --- producer to worker on the PostgreSQL queue ----------------------------------------------


async def test_a_request_that_enqueues_gives_a_create_span_and_a_linked_process_span(
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    user_spans: list[Any] = []

    @app.consumer("traced", queue=pointsapp.QUEUE, schema=N)
    async def traced(payload: N, job: Any, tx: Any) -> None:
        with traces.tracer.start_as_current_span("ledger call") as span:
            user_spans.append(span)

    with traces.tracer.start_as_current_span("POST /orders") as request:
        async with await psycopg.AsyncConnection.connect(database_url) as tx:
            await app.enqueue(tx, "traced", {"n": 1}, job_id="t-1", correlation_id="c-1")
            await tx.commit()
    row = await (
        await conn.execute("SELECT traceparent FROM jobfence_queue.messages WHERE job_id = 't-1'")
    ).fetchone()
    assert row is not None and row[0] is not None

    assert await _work(pool, app) == {"succeeded": 1}

    create = traces.one(f"create {pointsapp.QUEUE}")
    process = traces.one(f"process {pointsapp.QUEUE}")
    ledger = traces.one("ledger call")
    request_ids = (f"{request.get_span_context().trace_id:032x}",)
    assert hexid(create)[0] == request_ids[0]
    assert parent_of(create) == hexid(traces.one("POST /orders"))
    assert row[0].startswith(f"00-{hexid(create)[0]}-{hexid(create)[1]}-")
    assert create.kind == SpanKind.PRODUCER
    assert dict(create.attributes or {}) == {
        "messaging.system": "jobfence",
        "messaging.destination.name": pointsapp.QUEUE,
        "messaging.message.id": "t-1",
        "messaging.message.conversation_id": "c-1",
        "messaging.operation.type": "create",
        "messaging.operation.name": "create",
        "jobfence.consumer": "traced",
    }
    # Linked by default: a trace of its own, with a link to the producer's span.
    assert process.kind == SpanKind.CONSUMER
    assert parent_of(process) is None
    assert linked(process) == [hexid(create)]
    assert dict(process.attributes or {}) == {
        "messaging.system": "jobfence",
        "messaging.destination.name": pointsapp.QUEUE,
        "messaging.consumer.group.name": "traced",
        "messaging.message.id": "t-1",
        "messaging.message.conversation_id": "c-1",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "jobfence.attempt": 1,
        "jobfence.outcome": "succeeded",
    }
    assert process.status.status_code == StatusCode.UNSET
    # The handler's own span is the process span's child.
    assert parent_of(ledger) == hexid(process)
    assert user_spans


async def test_trace_parent_child_makes_the_process_span_the_producers_child(
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    await _enqueue_in_request(traces, database_url, app, {"account_id": 1, "points": 2}, "c-1")
    assert await _work(pool, app, trace_parent="child") == {"succeeded": 1}
    create = traces.one(f"create {pointsapp.QUEUE}")
    process = traces.one(f"process {pointsapp.QUEUE}")
    assert parent_of(process) == hexid(create)
    assert hexid(process)[0] == hexid(traces.one("POST /orders"))[0]
    assert not process.links


async def test_a_sync_handlers_spans_are_children_of_its_process_span(
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()

    @app.consumer("traced_sync", queue=pointsapp.QUEUE, schema=N)
    def traced_sync(payload: N, job: Any, tx: Any) -> None:
        with traces.tracer.start_as_current_span("sync ledger call"):
            pass

    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        await app.enqueue(tx, "traced_sync", {"n": 1}, job_id="s-1")
        await tx.commit()
    assert await _work(pool, app) == {"succeeded": 1}
    process = traces.one(f"process {pointsapp.QUEUE}")
    assert parent_of(traces.one("sync ledger call")) == hexid(process)


async def test_a_group_commit_has_one_span_with_the_batch_size_and_a_link_per_job(
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app(jobs_per_transaction=10)
    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        for i in range(3):
            await app.enqueue(tx, "award_points", {"account_id": 1, "points": 1}, job_id=f"g-{i}")
        await tx.commit()
    assert await _work(pool, app, concurrency=1, batch_size=10) == {"succeeded": 3}
    creates = traces.named(f"create {pointsapp.QUEUE}")
    groups = [
        s
        for s in traces.named(f"process {pointsapp.QUEUE}")
        if "messaging.batch.message_count" in (s.attributes or {})
    ]
    assert len(groups) == 1
    group = groups[0]
    assert (group.attributes or {})["messaging.batch.message_count"] == 3
    assert (group.attributes or {})["jobfence.outcome"] == "committed"
    assert sorted(linked(group)) == sorted(hexid(s) for s in creates)


# --- failures: retry, dead letter, poison; and replay ----------------------------------------


async def test_a_retried_then_dead_lettered_job_records_its_failed_attempts_trace(
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app(FAST)
    await _enqueue_in_request(
        traces, database_url, app, {"account_id": 1, "points": 1, "mode": "transient"}, "r-1"
    )
    assert await _work(pool, app) == {"retried": 1, "dead_lettered": 1}
    create = traces.one(f"create {pointsapp.QUEUE}")
    first, second = sorted(
        traces.named(f"process {pointsapp.QUEUE}"),
        key=lambda s: (s.attributes or {})["jobfence.attempt"],
    )
    for span, outcome in ((first, "retry"), (second, "dead_letter")):
        attributes = span.attributes or {}
        assert attributes["jobfence.outcome"] == outcome
        assert attributes["error.type"] == "pointsapp.Flaky"
        assert span.status.status_code == StatusCode.ERROR
        assert linked(span) == [hexid(create)]
    dead_id = await scalar(conn, "SELECT id FROM core.dead_letters WHERE job_id = 'r-1'")
    letter = await get_dead_letter(conn, dead_id)
    assert letter.trace_id == hexid(second)[0]
    assert (letter.traceparent or "").startswith(f"00-{hexid(second)[0]}-{hexid(second)[1]}-")
    detail = await ops.show_dead_letter(conn, dead_id)
    assert detail.dead_letter.trace_id == hexid(second)[0]
    # The API's item, rendered by PostgreSQL, and the model it documents.
    shown = json.loads(await show_dead_letter_json(conn, dead_id))
    assert shown["trace_id"] == hexid(second)[0]
    assert DeadLetterDetailOut.of(detail).trace_id == hexid(second)[0]

    # Replayed: a span of its own with the actor, linked to the failed attempt's span; the
    # replayed job's process span links to both.
    with traces.tracer.start_as_current_span("ops: replay"):
        await replay_dead_letter(pool, PgQueue(pool), dead_id, resolved_by="alice")
    replay = traces.one(f"replay {pointsapp.QUEUE}")
    assert replay.kind == SpanKind.PRODUCER
    assert (replay.attributes or {})["jobfence.actor"] == "alice"
    assert (replay.attributes or {})["messaging.operation.type"] == "create"
    assert linked(replay) == [hexid(second)]
    assert parent_of(replay) == hexid(traces.one("ops: replay"))
    traces.exporter.clear()
    await _work(pool, app)  # fails again (the same payload): still one trace to follow
    for replayed in traces.named(f"process {pointsapp.QUEUE}"):
        assert linked(replayed) == [hexid(replay), hexid(second)]
        assert dict(replayed.links[1].attributes or {}) == {"jobfence.link": "replayed_from"}


async def test_a_poison_message_has_a_process_span_with_outcome_poison(
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    producer = Producer(routes={"award_points": pointsapp.QUEUE})
    with traces.tracer.start_as_current_span("POST /orders"):
        async with await psycopg.AsyncConnection.connect(database_url) as tx:
            await producer.enqueue(tx, "award_points", {"account_id": "x"}, job_id="p-1")
            await tx.commit()
    assert await _work(pool, app) == {"poison": 1}
    process = traces.one(f"process {pointsapp.QUEUE}")
    assert (process.attributes or {})["jobfence.outcome"] == "poison"
    assert (process.attributes or {})["error.type"] == "SchemaInvalid"
    assert linked(process) == [hexid(traces.one(f"create {pointsapp.QUEUE}"))]
    letter = await get_dead_letter(
        conn, await scalar(conn, "SELECT id FROM core.dead_letters WHERE job_id = 'p-1'")
    )
    assert letter.trace_id == hexid(process)[0]


async def test_a_bulk_replay_gives_a_replay_span_per_dead_letter_linked_to_its_failure(
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    async with await psycopg.AsyncConnection.connect(database_url) as tx:
        for i in range(2):
            await app.enqueue(
                tx,
                "award_points",
                {"account_id": 1, "points": 1, "mode": "hard"},
                job_id=f"b-{i}",
            )
        await tx.commit()
    assert await _work(pool, app) == {"dead_lettered": 2}
    failed = {
        (s.attributes or {})["messaging.message.id"]: hexid(s)
        for s in traces.named(f"process {pointsapp.QUEUE}")
    }
    run = await ops.start_bulk_replay(
        pool, ops.DeadLetterFilter(queue=pointsapp.QUEUE), requested_by="bob"
    )
    assert not isinstance(run, int)
    await ops.run_bulk_replay(pool, PgQueue(pool), run.id, actor="bob")
    replays = traces.named(f"replay {pointsapp.QUEUE}")
    assert len(replays) == 2
    for replay in replays:
        job_id = (replay.attributes or {})["messaging.message.id"]
        assert (replay.attributes or {})["jobfence.actor"] == "bob"
        assert linked(replay) == [failed[str(job_id)]]


# --- the SQL function, the session setting, and hostile rows ---------------------------------


async def test_a_trigger_passes_the_trace_context_through_the_session_setting(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(
        """
        CREATE TABLE public.orders (id text PRIMARY KEY);
        CREATE FUNCTION public.order_job() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM jobfence.enqueue('award_points', 'loyalty', 'order-' || NEW.id,
                                     '{"account_id": 1, "points": 1}');
            RETURN NEW;
        END $$;
        CREATE TRIGGER order_job AFTER INSERT ON public.orders
            FOR EACH ROW EXECUTE FUNCTION public.order_job();
        """
    )
    async with conn.transaction():
        await conn.execute("SELECT set_config('jobfence.traceparent', %s, true)", (TP,))
        await conn.execute("SET LOCAL jobfence.tracestate = 'rojo=00f067aa0ba902b7'")
        await conn.execute("INSERT INTO public.orders VALUES ('1')")
    async with conn.transaction():
        await conn.execute("SET LOCAL jobfence.traceparent = '00-zz-not-a-traceparent'")
        await conn.execute("SET LOCAL jobfence.tracestate = 'rojo=00f067aa0ba902b7'")
        await conn.execute("INSERT INTO public.orders VALUES ('2')")
    async with conn.transaction():
        await conn.execute("INSERT INTO public.orders VALUES ('3')")
    cur = await conn.execute(
        "SELECT job_id, traceparent, tracestate FROM jobfence_queue.messages ORDER BY job_id"
    )
    assert await cur.fetchall() == [
        ("order-1", TP, "rojo=00f067aa0ba902b7"),
        ("order-2", None, None),  # not W3C: dropped, the job written all the same
        ("order-3", None, None),
    ]


async def test_jobfence_enqueue_takes_the_trace_context_as_arguments(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    other = "00-11111111111111111111111111111111-2222222222222222-00"
    async with conn.transaction():
        await conn.execute("SELECT set_config('jobfence.traceparent', %s, true)", (other,))
        await conn.execute(
            "SELECT jobfence.enqueue('c', 'q', 'with-args', '{}', NULL, NULL, '0', %s, %s)",
            (TP, "a=b"),
        )
        await conn.execute(
            "SELECT jobfence.enqueue('c', 'q', 'bad-args', '{}', NULL, NULL, '0', %s)",
            ("garbage\n",),
        )
        # The session's own setting is back after each call.
        await conn.execute("SELECT jobfence.enqueue('c', 'q', 'session', '{}')")
    cur = await conn.execute(
        "SELECT job_id, traceparent, tracestate FROM jobfence_queue.messages ORDER BY job_id"
    )
    assert await cur.fetchall() == [
        ("bad-args", None, None),
        ("session", other, None),
        ("with-args", TP, "a=b"),
    ]


async def test_a_queue_row_with_a_hostile_trace_context_runs_without_it(
    traces: Traces,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A producer-writable row: junk in its trace columns is dropped at receive, and the job
    runs (no link) like any other."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    for job_id, parent, state in (
        ("h-1", "x" * 10_000, "a=b"),
        ("h-2", TP, "a=b\r\nInjected: yes"),
    ):
        await conn.execute(
            "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body, traceparent,"
            " tracestate) VALUES (%s, 'award_points', %s, %s, %s, %s)",
            (pointsapp.QUEUE, job_id, b'{"account_id": 1, "points": 1}', parent, state),
        )
    assert await _work(pool, app) == {"succeeded": 2}
    spans = {
        (s.attributes or {})["messaging.message.id"]: s
        for s in traces.named(f"process {pointsapp.QUEUE}")
    }
    assert not spans["h-1"].links
    assert linked(spans["h-2"]) == [(TP[3:35], TP[36:52])]
    assert not spans["h-2"].links[0].context.trace_state


# --- logs -----------------------------------------------------------------------------------


def test_json_log_lines_carry_trace_and_span_ids_while_a_span_is_current(
    traces: Traces,
) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(json_formatter())
    log = logging.getLogger("jobfence.test_tracing")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("outside")
        with traces.tracer.start_as_current_span("inside") as span:
            log.warning("inside")
    finally:
        log.removeHandler(handler)
    outside, inside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert "trace_id" not in outside and "span_id" not in outside
    ctx = span.get_span_context()
    assert inside["trace_id"] == f"{ctx.trace_id:032x}"
    assert inside["span_id"] == f"{ctx.span_id:016x}"


# --- a SIGKILLed worker's redelivery ---------------------------------------------------------


def _crash_worker(database_url: str, workdir: Path) -> subprocess.Popen[bytes]:
    """``crash_worker.py crash``: takes the job (lease 1 s) and blocks inside its handler."""
    with (workdir / "crash.log").open("wb") as out:
        return subprocess.Popen(
            [sys.executable, str(CRASH_WORKER), "crash", database_url, str(workdir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


async def test_a_sigkilled_workers_job_is_redelivered_with_the_same_producer_link(
    traces: Traces,
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    tmp_path: Path,
) -> None:
    """The trace context lives in the queue row: the worker that took the job died (SIGKILL,
    its spans with it), and the next delivery's process span links to the same create span."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    await _enqueue_in_request(traces, database_url, app, {"account_id": 1, "points": 2}, "k-1")
    proc = _crash_worker(database_url, tmp_path)
    try:

        async def in_handler() -> bool:
            assert proc.poll() is None, (tmp_path / "crash.log").read_text()
            return (tmp_path / "in_handler").exists()

        await wait_until(in_handler, timeout=30, message="the worker to be inside its handler")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert await _work(pool, app) == {"succeeded": 1}
    process = traces.one(f"process {pointsapp.QUEUE}")
    assert (process.attributes or {})["jobfence.attempt"] == 2
    assert linked(process) == [hexid(traces.one(f"create {pointsapp.QUEUE}"))]


# --- the alert's incident -------------------------------------------------------------------


async def test_the_alerts_incident_names_the_failed_attempts_trace_id(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await write_dead_letter(conn, "traced-1", traceparent=TP)
    await write_dead_letter(conn, "untraced-1")
    server = FakeBetterStack(TOKEN).start()
    try:
        sink = sink_for(server)
        relay = make_relay(database_url, server, sink=sink)
        async with running(relay):
            await wait_for_alerts(conn, "sent", 1)
        await sink.aclose()
        [post] = server.posts()
    finally:
        server.close()
    description = post.json()["description"]
    assert f"job traced-1, 1 attempt: {HARD}: account is closed (trace {TP[3:35]})" in description
    assert f"job untraced-1, 1 attempt: {HARD}: account is closed\n" in description + "\n"


# --- every sync producer path ---------------------------------------------------------------


def _sync_enqueue(kind: str, database_url: str, app: Any, job_id: str) -> None:
    payload = {"account_id": 1, "points": 1}
    if kind == "psycopg":
        with psycopg.connect(database_url) as sync_conn:
            app.enqueue_sync(sync_conn, "award_points", payload, job_id=job_id)
    elif kind == "psycopg2":
        import psycopg2

        pg2 = psycopg2.connect(database_url)
        try:
            Producer(routes={"award_points": pointsapp.QUEUE}).enqueue_sync(
                pg2, "award_points", payload, job_id=job_id
            )
            pg2.commit()
        finally:
            pg2.close()
    else:
        import sqlalchemy
        from sqlalchemy.orm import Session

        params = psycopg.conninfo.conninfo_to_dict(database_url)
        engine = sqlalchemy.create_engine(
            sqlalchemy.URL.create(
                "postgresql+psycopg",
                username=str(params.get("user", "")) or None,
                host=str(params.get("host", "")) or None,
                port=int(params["port"]) if params.get("port") else None,
                database=str(params["dbname"]),
            )
        )
        try:
            with Session(engine) as session, session.begin():
                app.enqueue_sync(session, "award_points", payload, job_id=job_id)
        finally:
            engine.dispose()


@pytest.mark.parametrize("kind", ["psycopg", "psycopg2", "sqlalchemy"])
def test_a_sync_producer_carries_the_request_context_under_a_create_span(
    traces: Traces, database_url: str, kind: str
) -> None:
    app = pointsapp.build_app()
    with traces.tracer.start_as_current_span("POST /orders") as request:
        _sync_enqueue(kind, database_url, app, f"sync-{kind}")
    create = traces.one(f"create {pointsapp.QUEUE}")
    assert parent_of(create) == (
        f"{request.get_span_context().trace_id:032x}",
        f"{request.get_span_context().span_id:016x}",
    )
    with psycopg.connect(database_url) as check:
        row = check.execute(
            "SELECT traceparent FROM jobfence_queue.messages WHERE job_id = %s", (f"sync-{kind}",)
        ).fetchone()
    assert row is not None
    assert row[0].startswith(f"00-{hexid(create)[0]}-{hexid(create)[1]}-")


# --- least-privilege roles ------------------------------------------------------------------


def test_the_producer_role_enqueues_a_traced_job_and_the_alert_relay_reads_its_trace(
    traces: Traces, database_url: str
) -> None:
    """The producer role has EXECUTE on the seven-argument functions only: the nine-argument
    forms that carry the trace context work for it too, from Python and from SQL."""
    app = pointsapp.build_app()
    with deployed_roles(database_url) as roles:
        with psycopg.connect(roles["producer"]) as producer:
            with traces.tracer.start_as_current_span("POST /orders"):
                app.enqueue_sync(
                    producer, "award_points", {"account_id": 1, "points": 1}, job_id="r-1"
                )
            producer.execute(
                "SELECT jobfence.enqueue('award_points', 'loyalty', 'r-2', '{}', NULL, NULL, '0',"
                " %s)",
                (TP,),
            )
            producer.commit()
        with psycopg.connect(database_url) as admin:
            admin.execute(
                "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts,"
                " last_error, error_class, traceparent) VALUES ('d-1', 'loyalty', 'c', '{}', 1,"
                " 'x', 'X', %s)",
                (TP,),
            )
            rows = admin.execute(
                "SELECT job_id, traceparent IS NOT NULL FROM jobfence_queue.messages ORDER BY 1"
            ).fetchall()
        assert rows == [("r-1", True), ("r-2", True)]
        with psycopg.connect(roles["alert_relay"]) as relay:
            assert relay.execute("SELECT traceparent FROM core.dead_letters").fetchall() == [(TP,)]


def test_dead_letters_show_prints_the_failed_attempts_trace_id(database_url: str) -> None:
    with psycopg.connect(database_url) as admin:
        row = admin.execute(
            "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts,"
            " last_error, error_class, traceparent) VALUES ('d-1', 'loyalty', 'c', '{}', 1,"
            " 'x', 'X', %s) RETURNING id",
            (TP,),
        ).fetchone()
    assert row is not None
    env = {**os.environ, "JOBFENCE_DATABASE_URL": database_url, "JOBFENCE_ACTOR": "t"}
    shown = [
        subprocess.run(
            [sys.executable, "-m", "jobfence.cli", "dead-letters", "show", str(row[0]), *json_],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        for json_ in ([], ["--json"])
    ]
    assert f"  trace_id:         {TP[3:35]}\n" in shown[0]
    as_json = json.loads(shown[1])
    assert (as_json["trace_id"], as_json["traceparent"]) == (TP[3:35], TP)


def test_without_an_sdk_a_producer_passes_on_the_context_it_is_called_in() -> None:
    """The API's no-op tracer records nothing, but a context a framework extracted from an
    incoming request (a remote span) still travels with the job; no context, no trace."""
    from opentelemetry import context, trace

    message = Message(queue="q", consumer="c", job_id="j", body=b"{}")
    with tracing.create(message) as traced:
        assert traced.traceparent is None
    remote = trace.SpanContext(
        trace_id=int(TP[3:35], 16),
        span_id=int(TP[36:52], 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(1),
    )
    token = context.attach(trace.set_span_in_context(trace.NonRecordingSpan(remote)))
    try:
        with tracing.create(message) as traced:
            assert (traced.traceparent, traced.tracestate) == (TP, None)
    finally:
        context.detach(token)


def test_a_dead_letters_traceparent_is_immutable(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as admin:
        row = admin.execute(
            "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts,"
            " last_error, error_class, traceparent) VALUES ('i-1', 'loyalty', 'c', '{}', 1,"
            " 'x', 'X', %s) RETURNING id",
            (TP,),
        ).fetchone()
        assert row is not None
        # Even with an allowed status change, which the guard of the other columns lets pass.
        for value in (None, "00-" + "1" * 32 + "-" + "2" * 16 + "-01"):
            with pytest.raises(psycopg.errors.IntegrityConstraintViolation, match="may change"):
                admin.execute(
                    "UPDATE core.dead_letters SET traceparent = %s, status = 'discarded',"
                    " discard_reason = 'test', resolved_at = now(), resolved_by = 't'"
                    " WHERE id = %s",
                    (value, row[0]),
                )
        admin.execute(
            "UPDATE core.dead_letters SET status = 'discarded', discard_reason = 'test',"
            " resolved_at = now(), resolved_by = 't' WHERE id = %s",
            (row[0],),
        )
