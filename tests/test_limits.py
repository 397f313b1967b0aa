"""Every job ends as one effect, one dead letter, or a refusal at enqueue: the identifier limits.

At enqueue, ``App.enqueue`` refuses a job whose identifiers break a limit (jobfence.limits) or
whose payload PostgreSQL cannot store, before any SQL, with an error naming the field and the
limit. At delivery (a message made by hand, an older producer), a message whose identifiers
cannot be fenced or stored ends as exactly one ``UnfenceableMessage`` dead letter that keeps
the whole message, and a replay refuses it. Without the limits, a 4,000-byte job_id or an
8,000-character correlation_id broke the fence's or the dead letter's btree index on every
delivery: the job looped under its lease forever with no record.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import (
    DeadLetterNotReplayable,
    JobRefused,
    MemoryQueue,
    Message,
    PgQueue,
    PrometheusMetrics,
    Worker,
    discard_dead_letter,
    open_pool,
    replay_dead_letter,
)
from jobfence.adapters.pg_queue import publish_on
from jobfence.codec import PAYLOAD_MESSAGE, encode_payload, original_message
from jobfence.limits import UNFENCEABLE, bounded
from support import run_jobfence, scalar
from test_api_support import PREFIX, assert_problem, auth, running_api, wait_bulk_finished

LONG_JOB_ID = "LONG-" + secrets.token_hex(4000)
LONG_CORRELATION_ID = "c" * 8000


def _random_text(n_bytes: int) -> str:
    """``n_bytes`` of UTF-8 that PostgreSQL cannot compress (random 2- and 3-byte characters):
    the widest index entry a value of that size makes."""
    chars: list[str] = []
    size = 0
    while size < n_bytes:
        room = n_bytes - size
        ch = chr(0x4E00 + secrets.randbelow(0x5000)) if room >= 3 else "a"
        chars.append(ch)
        size += len(ch.encode("utf-8"))
    return "".join(chars)


async def _run_worker(
    pool: AsyncConnectionPool[Any], queue: Any = None, **kwargs: Any
) -> PrometheusMetrics:
    metrics = PrometheusMetrics()
    kwargs.setdefault("poll_seconds", 0.05)
    own = queue is None
    queue = PgQueue(pool) if own else queue
    try:
        await asyncio.wait_for(
            Worker(
                pointsapp.build_app(), pool, queue, concurrency=1, metrics=metrics, **kwargs
            ).run(until="idle"),
            30,
        )
    finally:
        if own:
            await queue.close()
    return metrics


async def _dead_letters(conn: psycopg.AsyncConnection[Any]) -> list[dict[str, Any]]:
    async with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        await cur.execute(
            "SELECT id, job_id, queue, consumer, tenant_id, correlation_id, payload::text AS"
            " payload_text, payload_encoding, attempts, error_class, last_error, status"
            " FROM core.dead_letters ORDER BY id"
        )
        return await cur.fetchall()


# --- at enqueue --------------------------------------------------------------------------------


async def test_enqueue_refuses_a_4000_byte_job_id_before_any_sql_and_the_transaction_stays_usable(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    async with conn.transaction():
        await conn.execute("UPDATE public.accounts SET points = 7 WHERE id = 1")
        with pytest.raises(JobRefused) as refused:
            await app.enqueue(
                conn, "award_points", {"account_id": 1, "points": 5}, job_id=LONG_JOB_ID
            )
        # The same transaction carries on: more work, another job, and it commits.
        await app.enqueue(conn, "award_points", {"account_id": 2, "points": 5}, job_id="ok-1")
    assert str(refused.value) == (
        "job refused: job_id is 8,005 bytes of UTF-8, over the limit of 1,024"
    )
    assert refused.value.field == "job_id"
    assert isinstance(refused.value, ValueError)
    assert await scalar(conn, "SELECT points FROM public.accounts WHERE id = 1") == 7
    assert await scalar(conn, "SELECT array_agg(job_id) FROM jobfence_queue.messages") == ["ok-1"]


REFUSALS = [
    pytest.param({"job_id": ""}, "job_id", "job_id must be a non-empty string", id="empty-job-id"),
    pytest.param(
        {"job_id": "a\x00b"},
        "job_id",
        "job_id contains a NUL character (\\x00), which PostgreSQL text cannot hold",
        id="nul-job-id",
    ),
    pytest.param(
        {"job_id": "a\ud800"},
        "job_id",
        "job_id contains a lone surrogate, which is not valid Unicode",
        id="surrogate-job-id",
    ),
    pytest.param(
        {"correlation_id": LONG_CORRELATION_ID},
        "correlation_id",
        "correlation_id is 8,000 bytes of UTF-8, over the limit of 1,024",
        id="long-correlation-id",
    ),
    pytest.param(
        {"tenant_id": "é" * 101},
        "tenant_id",
        "tenant_id is 202 bytes of UTF-8, over the limit of 200",
        id="long-tenant-id-in-bytes",
    ),
    pytest.param(
        {"payload": {"account_id": 1, "points": 5, "mode": "a\x00"}},
        "payload",
        "payload contains \\u0000, which PostgreSQL text and jsonb cannot hold",
        id="nul-in-payload",
    ),
    pytest.param(
        {"payload": {"account_id": 1, "points": 5, "mode": "a\ud800"}},
        "payload",
        "payload contains a lone surrogate, which is not valid Unicode",
        id="surrogate-in-payload-dict",
    ),
    pytest.param(
        {"payload": pointsapp.Award(account_id=1, points=5, mode="a\ud800")},
        "payload",
        "payload contains a lone surrogate, which is not valid Unicode",
        id="surrogate-in-payload-model",
    ),
]


@pytest.mark.parametrize(("change", "field", "says"), REFUSALS)
async def test_enqueue_refuses_each_bad_identifier_or_payload_naming_the_field_and_the_limit(
    conn: psycopg.AsyncConnection[Any], change: dict[str, Any], field: str, says: str
) -> None:
    app = pointsapp.build_app()
    kwargs: dict[str, Any] = {
        "job_id": "j-1",
        "payload": {"account_id": 1, "points": 5},
        "tenant_id": None,
        "correlation_id": None,
        **change,
    }
    payload = kwargs.pop("payload")
    async with conn.transaction():
        with pytest.raises(JobRefused) as refused:
            await app.enqueue(conn, "award_points", payload, **kwargs)
        await app.enqueue(conn, "award_points", {"account_id": 1, "points": 5}, job_id="after")
    assert str(refused.value) == f"job refused: {says}"
    assert refused.value.field == field
    assert await scalar(conn, "SELECT array_agg(job_id) FROM jobfence_queue.messages") == ["after"]


async def test_identifiers_at_their_limits_are_fenced_and_dead_lettered(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    """The limits keep every index entry storable: the widest values they allow (random, so
    PostgreSQL cannot compress them) go through the fence and the dead letter's indexes."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = pointsapp.build_app()
    tenant, correlation = _random_text(200), _random_text(1024)
    ok_id, hard_id = "a" + _random_text(1023), "b" + _random_text(1023)
    for job_id, mode in ((ok_id, "ok"), (hard_id, "hard")):
        await app.enqueue(
            conn,
            "award_points",
            {"account_id": 1, "points": 5, "mode": mode},
            job_id=job_id,
            tenant_id=tenant,
            correlation_id=correlation,
        )
    metrics = await _run_worker(pool)
    assert metrics.count("succeeded") == 1
    assert metrics.count("dead_lettered") == 1
    assert await scalar(conn, "SELECT array_agg(job_id) FROM core.processed_jobs") == [ok_id]
    letters = await _dead_letters(conn)
    assert [(d["job_id"], d["tenant_id"], d["correlation_id"]) for d in letters] == [
        (hard_id, tenant, correlation)
    ]


# --- at delivery -------------------------------------------------------------------------------


async def _assert_one_unfenceable_dead_letter(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    message: Message,
    metrics: PrometheusMetrics,
    says: str,
) -> dict[str, Any]:
    letters = await _dead_letters(conn)
    assert len(letters) == 1, letters
    row = letters[0]
    assert row["error_class"] == UNFENCEABLE
    assert row["attempts"] == 1
    assert says in row["last_error"]
    assert row["payload_encoding"] == PAYLOAD_MESSAGE
    # The whole message, identifiers included, comes back exactly as it was published.
    assert original_message(row["payload_text"]) == message
    assert says in json.loads(row["payload_text"])["note"]
    assert metrics.count("poison") == 1
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 0
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == 0
    # The alert is recorded with the dead letter (same transaction).
    assert await scalar(conn, "SELECT count(*) FROM jobfence.alert_outbox") == 1
    return row


async def _assert_replay_refused_then_discard(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any], row: dict[str, Any]
) -> None:
    queue = PgQueue(pool)
    try:
        with pytest.raises(DeadLetterNotReplayable) as refused:
            await replay_dead_letter(pool, queue, row["id"], resolved_by="ops@test")
    finally:
        await queue.close()
    assert f"dead letter {row['id']} cannot be replayed: its message can never be fenced" in str(
        refused.value
    )
    assert "discard it with a reason" in str(refused.value)
    # Nothing changed: still pending, nothing republished.
    assert await scalar(conn, "SELECT status FROM core.dead_letters") == "pending_review"
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
    discarded = await discard_dead_letter(
        pool, row["id"], reason="job_id over the limit; producer fixed", resolved_by="ops@test"
    )
    assert discarded.status == "discarded"


async def test_a_hand_made_message_with_a_4000_byte_job_id_is_one_unfenceable_dead_letter(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    message = Message(
        queue=pointsapp.QUEUE,
        consumer="award_points",
        job_id=LONG_JOB_ID,
        body=b'{"account_id": 1, "points": 5}',
        tenant_id="tenant-a",
        correlation_id="corr-1",
    )
    await publish_on(conn, message)
    metrics = await _run_worker(pool)

    row = await _assert_one_unfenceable_dead_letter(
        pool, conn, message, metrics, "job_id is 8,005 bytes of UTF-8, over the limit of 1,024"
    )
    # The job_id column holds a bounded, recognisable stand-in; the others are kept as they are.
    assert row["job_id"] == bounded(LONG_JOB_ID)
    assert row["job_id"].startswith("LONG-") and "8005 bytes, sha256 " in row["job_id"]
    assert (row["queue"], row["consumer"], row["tenant_id"], row["correlation_id"]) == (
        "loyalty",
        "award_points",
        "tenant-a",
        "corr-1",
    )
    await _assert_replay_refused_then_discard(pool, conn, row)


async def test_a_failing_hand_made_job_with_an_8000_char_correlation_id_is_one_dead_letter(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(pointsapp.SCHEMA_SQL)
    message = Message(
        queue=pointsapp.QUEUE,
        consumer="award_points",
        job_id="fails-1",
        body=b'{"account_id": 1, "points": 5, "mode": "hard"}',
        correlation_id=LONG_CORRELATION_ID,
    )
    await publish_on(conn, message)
    metrics = await _run_worker(pool)

    row = await _assert_one_unfenceable_dead_letter(
        pool,
        conn,
        message,
        metrics,
        "correlation_id is 8,000 bytes of UTF-8, over the limit of 1,024",
    )
    assert row["job_id"] == "fails-1"
    assert row["correlation_id"] == bounded(LONG_CORRELATION_ID)
    await _assert_replay_refused_then_discard(pool, conn, row)


async def test_nul_characters_in_identifiers_from_another_queue_are_one_dead_letter_each(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    """A broker other than PostgreSQL can carry a NUL or a lone surrogate in an identifier."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    queue = MemoryQueue(poll_interval_seconds=0.05)
    sent = [
        Message(pointsapp.QUEUE, "award_points", "nul\x00id", b'{"account_id": 1, "points": 5}'),
        Message(
            pointsapp.QUEUE,
            "award_points",
            "ok-id",
            b'{"account_id": 1, "points": 5}',
            tenant_id="t\ud800",
        ),
    ]
    for message in sent:
        await queue.publish(message)
    metrics = await _run_worker(pool, queue)
    letters = await _dead_letters(conn)
    assert [original_message(d["payload_text"]) for d in letters] == sent
    assert [d["error_class"] for d in letters] == [UNFENCEABLE, UNFENCEABLE]
    assert letters[0]["job_id"] == bounded("nul\x00id")
    assert letters[0]["job_id"].startswith("nul\\x00id...")
    assert letters[1]["tenant_id"] == bounded("t\ud800")
    assert metrics.count("poison") == 2
    assert (await queue.size([pointsapp.QUEUE])).total == 0


# --- property: one effect, one dead letter or one refusal ------------------------------------

SPECIAL = ["\x00", "a\ud800b", "é" * 600, "x" * 1100, "𝄞" * 300, ""]
parts = st.text(max_size=12) | st.sampled_from(SPECIAL)
jobs = st.lists(
    st.fixed_dictionaries(
        {
            "job_id": parts,
            "tenant_id": st.none() | st.text(max_size=8) | st.sampled_from(["t" * 201, "\x00"]),
            "correlation_id": st.none() | st.text(max_size=8) | st.just("c" * 8000),
            "note": parts,
            "fails": st.booleans(),
            "bypass": st.booleans(),
        }
    ),
    min_size=1,
    max_size=4,
)


def _pg_text_ok(message: Message) -> bool:
    """Whether the PostgreSQL queue's text columns can carry the message's identifiers."""
    for value in (message.queue, message.consumer, message.job_id):
        if "\x00" in value or any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            return False
    for optional in (message.tenant_id, message.correlation_id):
        if optional is not None and (
            "\x00" in optional or any(0xD800 <= ord(c) <= 0xDFFF for c in optional)
        ):
            return False
    return True


async def _generated_example(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    n: int,
    generated: list[dict[str, Any]],
) -> None:
    """Enqueue (or publish by hand) one example's jobs, run the workers, check each job."""
    app = pointsapp.build_app()
    memory = MemoryQueue(poll_interval_seconds=0.05)
    expected: dict[str, str] = {}  # job_id -> effect | dead_letter | refused
    for i, job in enumerate(generated):
        job_id = f"p{n}.{i}-{job['job_id']}" if job["job_id"] else ""
        if job_id in expected:
            continue
        payload = {
            "account_id": 1,
            "points": 1,
            "mode": "hard" if job["fails"] else f"note:{job['note']}",
        }
        ids = {"tenant_id": job["tenant_id"], "correlation_id": job["correlation_id"]}
        try:
            await app.enqueue(conn, "award_points", payload, job_id=job_id, **ids)
        except JobRefused:
            if not job["bypass"]:
                expected[job_id] = "refused"
                continue
            try:
                body = encode_payload(payload)
            except UnicodeEncodeError:
                body = json.dumps(payload).encode("ascii")  # \ud800 as an escape
            message = Message(pointsapp.QUEUE, "award_points", job_id, body, **ids)
            if _pg_text_ok(message):
                await publish_on(conn, message)
            else:
                await memory.publish(message)
            expected[job_id] = "dead_letter"
        else:
            expected[job_id] = "dead_letter" if job["fails"] else "effect"
    await _run_worker(pool, lease_seconds=30)
    await _run_worker(pool, memory, lease_seconds=30)

    cur = await conn.execute("SELECT job_id FROM public.awards WHERE job_id LIKE %s", (f"p{n}.%",))
    effects = [r[0] for r in await cur.fetchall()]
    cur = await conn.execute(
        "SELECT job_id, payload_encoding, payload::text FROM core.dead_letters"
        " WHERE status = 'pending_review'"
    )
    letters = []
    for job_id, encoding, payload_text in await cur.fetchall():
        letters.append(
            original_message(payload_text).job_id if encoding == PAYLOAD_MESSAGE else job_id
        )
    # Resolved, so that the next example may dead-letter the same (job_id, consumer).
    await conn.execute(
        "UPDATE core.dead_letters SET status = 'discarded', discard_reason = 'seen',"
        " resolved_at = now(), resolved_by = 'test' WHERE status = 'pending_review'"
    )
    for job_id, outcome in expected.items():
        found = (effects.count(job_id), letters.count(job_id))
        assert found == {"effect": (1, 0), "dead_letter": (0, 1), "refused": (0, 0)}[outcome], (
            job_id[:80],
            outcome,
            found,
        )
    assert len(effects) + len(letters) == sum(o != "refused" for o in expected.values())
    assert (await memory.size([pointsapp.QUEUE])).total == 0
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0


@pytest.fixture
def example_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_every_generated_job_ends_as_one_effect_one_dead_letter_or_one_refusal(
    database_url: str, example_loop: asyncio.AbstractEventLoop
) -> None:
    """Generated identifiers and payloads (long, unicode, NUL, empty, lone surrogates), through
    ``App.enqueue`` and a real worker. A refused job, when ``bypass`` is set, is also published
    by hand (to the PostgreSQL queue when its columns can hold it, else to an in-memory queue):
    then it must end as one dead letter."""
    run = example_loop.run_until_complete
    pool = run(open_pool(database_url, min_size=1, max_size=4))
    conn = run(psycopg.AsyncConnection.connect(database_url, autocommit=True))
    run(conn.execute(pointsapp.SCHEMA_SQL))
    counter = itertools.count()

    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(generated=jobs)
    def check(generated: list[dict[str, Any]]) -> None:
        run(_generated_example(pool, conn, next(counter), generated))

    try:
        check()
    finally:
        run(conn.close())
        run(pool.close())


# --- an UnfenceableMessage dead letter for operators: list, show, replay refused --------------


async def _unfenceable_dead_letter(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> int:
    await conn.execute(pointsapp.SCHEMA_SQL)
    await publish_on(
        conn,
        Message(pointsapp.QUEUE, "award_points", LONG_JOB_ID, b'{"account_id": 1, "points": 5}'),
    )
    await _run_worker(pool)
    return int(await scalar(conn, "SELECT id FROM core.dead_letters"))


async def test_an_unfenceable_dead_letter_lists_shows_and_its_replay_is_a_409_over_http(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    dl_id = await _unfenceable_dead_letter(pool, conn)
    async with running_api(pool) as api:
        listed = await api.client.get(PREFIX, params={"error_class": UNFENCEABLE}, headers=auth())
        assert listed.status_code == 200, listed.text
        [item] = listed.json()["items"]
        assert (item["id"], item["job_id"]) == (dl_id, bounded(LONG_JOB_ID))
        assert item["payload_encoding"] == "message"
        shown = await api.client.get(f"{PREFIX}/{dl_id}", headers=auth())
        assert shown.status_code == 200, shown.text
        kept = shown.json()["payload"]
        assert kept["encoding"] == "message"
        assert "job_id is 8,005 bytes" in kept["note"]

        replay = await api.client.post(f"{PREFIX}/{dl_id}/replay", headers=auth())
        problem = assert_problem(
            replay, 409, type="urn:jobfence:problem:not-replayable", current_status="pending_review"
        )
        assert problem["detail"].startswith(
            f"dead letter {dl_id} cannot be replayed: its message can never be fenced (job_id is"
            " 8,005 bytes of UTF-8, over the limit of 1,024)"
        )
        bulk = await api.client.post(
            f"{PREFIX}/replay-bulk", json={"error_class": UNFENCEABLE}, headers=auth()
        )
        assert bulk.status_code == 202, bulk.text
        run = await wait_bulk_finished(api, bulk.json()["id"])
        assert run["counts"]["failed"] == 1, run
    assert await scalar(conn, "SELECT status FROM core.dead_letters") == "pending_review"
    assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 0
    detail = await scalar(conn, "SELECT detail FROM jobfence.bulk_replay_items")
    assert "can never be fenced" in detail


async def test_the_cli_refuses_to_replay_an_unfenceable_dead_letter_and_says_why(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any], database_url: str
) -> None:
    dl_id = await _unfenceable_dead_letter(pool, conn)
    done = await asyncio.to_thread(
        run_jobfence, database_url, "dead-letters", "replay", str(dl_id), "--actor", "ops"
    )
    assert done.returncode == 1, done
    assert "cannot be replayed: its message can never be fenced (job_id is 8,005 bytes" in (
        done.stderr
    )
    assert "discard it with a reason" in done.stderr
    assert await scalar(conn, "SELECT status FROM core.dead_letters") == "pending_review"
    shown = await asyncio.to_thread(run_jobfence, database_url, "dead-letters", "show", str(dl_id))
    assert shown.returncode == 0, shown
    assert "error_class:      UnfenceableMessage" in shown.stdout
    assert f"job_id:           {bounded(LONG_JOB_ID)}" in shown.stdout
    assert "payload_encoding: message" in shown.stdout
