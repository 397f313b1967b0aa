"""Acceptance 4 and D6: poison goes straight to a dead letter, once, with its bytes intact.

Poison is a body that is not UTF-8 JSON PostgreSQL can hold, JSON the consumer's schema rejects,
or a message for a consumer that does not exist. Each is dead-lettered after its first delivery
(attempts = 1, no retry scheduled), counted as ``poison``, leaves no fence row and no effect, and
its original bytes can be recovered from the dead letter (and are what a replay republishes).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import Message, PgQueue, PrometheusMetrics, Worker, replay_dead_letter
from jobfence.adapters.pg_queue import publish_on
from jobfence.codec import (
    PAYLOAD_BASE64,
    PAYLOAD_JSON,
    decode_body,
    original_body,
    stored_payload,
)
from jobfence.errors import PoisonMessage
from jobfence.harness import UNKNOWN_CONSUMER_LABEL
from support import scalar

OUTCOMES = ("succeeded", "duplicate", "retried", "dead_lettered", "poison")


async def _run_one_poison(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    body: bytes,
    *,
    consumer: str = "award_points",
) -> tuple[dict[str, Any], PrometheusMetrics]:
    """Publish ``body`` raw, run a worker until idle, return the only dead letter and metrics."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    await publish_on(
        conn,
        Message(
            queue=pointsapp.QUEUE,
            consumer=consumer,
            job_id="poison-1",
            body=body,
            tenant_id="tenant-a",
            correlation_id="corr-1",
        ),
    )
    metrics = PrometheusMetrics()
    queue = PgQueue(pool)
    try:
        stats = await Worker(app, pool, queue, concurrency=1, metrics=metrics).run(until="idle")
    finally:
        await queue.close()
    assert dict(stats.outcomes) == {"poison": 1}

    cur = await conn.execute(
        "SELECT job_id, queue, consumer, tenant_id, correlation_id, payload::text,"
        " payload_encoding, attempts, error_class, last_error, status FROM core.dead_letters"
    )
    rows = await cur.fetchall()
    assert len(rows) == 1, rows
    keys = [
        "job_id",
        "queue",
        "consumer",
        "tenant_id",
        "correlation_id",
        "payload_text",
        "payload_encoding",
        "attempts",
        "error_class",
        "last_error",
        "status",
    ]
    return dict(zip(keys, rows[0], strict=True)), metrics


async def _assert_nothing_else_happened(
    conn: psycopg.AsyncConnection[Any], metrics: PrometheusMetrics, consumer: str
) -> None:
    """Zero retries, no fence, no effect, the queue row gone; the outcome counted as poison."""
    assert {o: metrics.count(o, consumer=consumer) for o in OUTCOMES} == {
        "succeeded": 0,
        "duplicate": 0,
        "retried": 0,
        "dead_lettered": 0,
        "poison": 1,
    }
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 0
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == 0


async def _assert_replay_republishes(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any], expected: bytes
) -> None:
    """D6: a replay republishes the bytes recovered from the dead letter, byte for byte."""
    dead_letter_id = await scalar(conn, "SELECT id FROM core.dead_letters")
    queue = PgQueue(pool)
    try:
        result = await replay_dead_letter(pool, queue, dead_letter_id, resolved_by="ops@test")
    finally:
        await queue.close()
    assert result.message.body == expected
    assert bytes(await scalar(conn, "SELECT body FROM jobfence_queue.messages")) == expected


async def test_acceptance_4_a_schema_invalid_payload_is_dead_lettered_with_zero_retries(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    # Valid JSON that the Award schema rejects: account_id must be >= 1.
    body = b'{"account_id": 0, "points": 5}'
    row, metrics = await _run_one_poison(pool, conn, body)

    assert row["attempts"] == 1
    assert row["error_class"] == "SchemaInvalid"
    assert row["status"] == "pending_review"
    assert "Award" in row["last_error"]
    assert "account_id" in row["last_error"]  # the message names the field
    assert (row["job_id"], row["queue"], row["consumer"]) == ("poison-1", "loyalty", "award_points")
    assert (row["tenant_id"], row["correlation_id"]) == ("tenant-a", "corr-1")
    assert row["payload_encoding"] == PAYLOAD_JSON
    assert json.loads(original_body(row["payload_text"], row["payload_encoding"])) == json.loads(
        body
    )
    await _assert_nothing_else_happened(conn, metrics, "award_points")
    await _assert_replay_republishes(
        pool, conn, original_body(row["payload_text"], row["payload_encoding"])
    )


POISON_BODIES = [
    pytest.param(
        b'{"account_id": 1, "points": 5', "InvalidJson", "not valid JSON", id="invalid-json"
    ),
    pytest.param(b"\xff\xfe", "InvalidUtf8", "not valid UTF-8", id="invalid-utf8"),
    pytest.param(
        b'{"account_id": 1, "points": 5, "mode": "\\u0000"}',
        "UnstorablePayload",
        "\\u0000",
        id="json-escaped-nul",
    ),
    pytest.param(
        b'{"account_id": 1, "points": 5, "mode": "\x00"}',
        "InvalidJson",
        "not valid JSON",
        id="raw-nul-byte",
    ),
    pytest.param(
        b'{"account_id": 1, "points": 5, "mode": "\\ud800"}',
        "UnstorablePayload",
        "surrogate",
        id="lone-surrogate-escape",
    ),
    pytest.param(b"[" * 5000 + b"]" * 5000, "InvalidJson", "not valid JSON", id="nested-5000-deep"),
    pytest.param(
        b'{"account_id": 1, "points": 5, "rate": 1e1000000}',
        "UnstorablePayload",
        "a number beyond what PostgreSQL's jsonb can hold",
        id="number-too-large-for-jsonb",
    ),
    pytest.param(
        b'{"account_id": 1, "points": 5, "rate": 1e-16384}',
        "UnstorablePayload",
        "a number beyond what PostgreSQL's jsonb can hold",
        id="number-too-small-for-jsonb",
    ),
    pytest.param(
        b'{"account_id": 1, "points": 5, "rate": 0.' + b"1" * 16384 + b"}",
        "UnstorablePayload",
        "a number beyond what PostgreSQL's jsonb can hold",
        id="fraction-too-long-for-jsonb",
    ),
]


@pytest.mark.parametrize(("body", "error_class", "says"), POISON_BODIES)
async def test_a_body_that_is_not_storable_json_is_dead_lettered_once_with_its_exact_bytes(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    body: bytes,
    error_class: str,
    says: str,
) -> None:
    row, metrics = await _run_one_poison(pool, conn, body)

    assert row["attempts"] == 1
    assert row["error_class"] == error_class
    assert says in row["last_error"]
    assert row["payload_encoding"] == PAYLOAD_BASE64
    wrapper = json.loads(row["payload_text"])
    assert wrapper["encoding"] == "base64"
    assert says in wrapper["note"]  # an operator reading the row sees why it is wrapped
    assert original_body(row["payload_text"], row["payload_encoding"]) == body
    await _assert_nothing_else_happened(conn, metrics, "award_points")
    await _assert_replay_republishes(pool, conn, body)


async def test_a_message_for_a_consumer_that_does_not_exist_is_dead_lettered_once(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    body = b'{"account_id": 1, "points": 5}'
    row, metrics = await _run_one_poison(pool, conn, body, consumer="no_such_consumer")

    assert row["attempts"] == 1
    assert row["error_class"] == "UnknownConsumer"
    assert "no_such_consumer" in row["last_error"]
    assert row["consumer"] == "no_such_consumer"
    assert row["payload_encoding"] == PAYLOAD_JSON
    assert json.loads(original_body(row["payload_text"], row["payload_encoding"])) == json.loads(
        body
    )
    # Metric labels stay bounded: an unregistered consumer name is counted under one label.
    await _assert_nothing_else_happened(conn, metrics, UNKNOWN_CONSUMER_LABEL)


# --- codec round trips (no worker): what stored_payload writes, jsonb keeps, original_body undoes


@pytest.fixture(scope="module")
def jsonb(server_url: str) -> Iterator[psycopg.Connection[Any]]:
    """One connection for the round trips: the cast needs no table, so any database does."""
    with psycopg.connect(server_url, autocommit=True) as db:
        yield db


def _through_jsonb(db: psycopg.Connection[Any], payload_text: str) -> str:
    """What the dead letter's ``payload::text`` gives back after PostgreSQL stored it as jsonb."""
    row = db.execute("SELECT %s::jsonb::text", (payload_text,)).fetchone()
    assert row is not None
    return str(row[0])


def _document(data: bytes | str) -> Any:
    # Decimal: jsonb keeps numbers exactly (1e308 comes back as 1000...0), floats would not.
    return json.loads(data, parse_float=Decimal)


def _is_storable_json(body: bytes) -> bool:
    try:
        decode_body(body)
    except PoisonMessage:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200) | st.text(max_size=60).map(lambda s: s.encode("utf-8")))
def test_any_bytes_survive_stored_payload_jsonb_and_original_body(
    jsonb: psycopg.Connection[Any], body: bytes
) -> None:
    payload_text, encoding = stored_payload(body)
    back = _through_jsonb(jsonb, payload_text)
    recovered = original_body(back, encoding)
    if _is_storable_json(body):
        assert encoding == PAYLOAD_JSON
        assert _document(recovered) == _document(body)
    else:
        assert encoding == PAYLOAD_BASE64
        assert recovered == body
        assert base64.b64decode(json.loads(back)["data"]) == body


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_documents = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


@settings(max_examples=300, deadline=None)
@given(document=json_documents, ensure_ascii=st.booleans())
def test_json_documents_are_kept_as_the_same_document_and_only_nul_forces_base64(
    jsonb: psycopg.Connection[Any], document: Any, ensure_ascii: bool
) -> None:
    body = json.dumps(document, ensure_ascii=ensure_ascii).encode("utf-8")
    payload_text, encoding = stored_payload(body)
    back = _through_jsonb(jsonb, payload_text)
    recovered = original_body(back, encoding)
    if _has_nul(document):
        assert encoding == PAYLOAD_BASE64
        assert recovered == body
    else:
        assert encoding == PAYLOAD_JSON
        assert _document(recovered) == _document(body)


def test_original_body_refuses_an_unknown_encoding_marker() -> None:
    with pytest.raises(ValueError, match="unknown payload encoding 'rot13'"):
        original_body('{"a": 1}', "rot13")


@pytest.mark.parametrize(
    "number",
    ["1e131071", "1.5e131070", "-1e131071", "1e-16383", "0." + "1" * 16383, "1e308", "1e-400"],
)
async def test_a_number_jsonb_can_hold_is_read_not_refused(
    conn: psycopg.AsyncConnection[Any], number: str
) -> None:
    """The numbers at the edges of what jsonb holds: PostgreSQL stores each, so the worker
    reads it (the refusal above is only for what a dead letter could not store)."""
    body = f'{{"account_id": 1, "points": 5, "rate": {number}}}'
    await conn.execute("SELECT %s::jsonb", (body,))
    assert decode_body(body.encode())["points"] == 5
