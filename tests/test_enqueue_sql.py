"""``jobfence.enqueue``, the SQL function: the same message row and NOTIFY as the Python
producers, in the caller's transaction, with bad identifiers refused (SQLSTATE 22023) and
nothing written."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import PgQueue, Producer, Worker
from jobfence.adapters.pg_queue import NOTIFY_CHANNEL
from support import scalar

ROUTES = {"award_points": pointsapp.QUEUE}
ALL_COLUMNS = (
    "queue, consumer, job_id, body, tenant_id, correlation_id, attempts, run_at, lease_token,"
    " last_error, created_at"
)
ENQUEUE = "SELECT jobfence.enqueue(%s, %s, %s, %s, %s, %s, %s)"


def psql() -> str:
    """The psql that ships with pgserver (a dependency), or the machine's."""
    import pgserver

    bundled = Path(pgserver.__file__).parent / "pginstall" / "bin" / "psql"
    found = str(bundled) if bundled.exists() else shutil.which("psql")
    assert found is not None, "no psql found (neither pgserver's nor on PATH)"
    return found


def run_psql(database_url: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", "-", "-d", database_url],
        input=script,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def sync_conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(database_url)
    conn.execute(pointsapp.SCHEMA_SQL)  # type: ignore[arg-type]
    conn.commit()
    yield conn
    conn.close()


def rows(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    cur = conn.execute(f"SELECT {ALL_COLUMNS} FROM jobfence_queue.messages ORDER BY id")  # type: ignore[arg-type]
    return cur.fetchall()


async def run_worker(pool: AsyncConnectionPool[Any]) -> dict[str, int]:
    queue = PgQueue(pool)
    try:
        stats = await Worker(pointsapp.build_app(), pool, queue).run(until="idle")
    finally:
        await queue.close()
    return dict(stats.outcomes)


def test_sql_enqueue_writes_the_same_row_as_the_python_producer(
    sync_conn: psycopg.Connection[Any],
) -> None:
    # Keys in jsonb's order (shorter first, then bytewise), nested values, text JSON escapes.
    payload = {
        "mode": "ok",
        "note": 'café "quoted" \\ \n\t\u0001 🎉',
        "tags": [1, -2.5, True, None, {"a": {}, "b": []}],
        "points": 5,
        "account_id": 1,
    }
    # Both in one transaction: now(), so created_at and run_at, are the same for both rows.
    Producer(routes=ROUTES).enqueue_sync(
        sync_conn, "award_points", payload, job_id="same-1", tenant_id="tenant-é",
        correlation_id="corr-1", delay_seconds=90,
    )  # fmt: skip
    sync_conn.execute(
        ENQUEUE,
        ("award_points", "loyalty", "same-1", psycopg.types.json.Jsonb(payload), "tenant-é",
         "corr-1", "90 seconds"),
    )  # fmt: skip
    sync_conn.commit()
    by_python, by_sql = rows(sync_conn)
    for column, a, b in zip(ALL_COLUMNS.split(", "), by_python, by_sql, strict=True):
        assert a == b, column
    assert bytes(by_sql[3]).startswith(b'{"mode":"ok","note":"caf\xc3\xa9 \\"quoted\\" \\\\ \\n\\t')


def test_sql_enqueue_sends_the_same_notify_as_the_python_producer(database_url: str) -> None:
    with (
        psycopg.connect(database_url, autocommit=True) as listener,
        psycopg.connect(database_url) as producer_conn,
    ):
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")  # type: ignore[arg-type]
        producer_conn.execute(ENQUEUE, ("award_points", "loyalty", "n-1", "{}", None, None, "0"))
        assert list(listener.notifies(timeout=0.3)) == []  # not before commit
        producer_conn.commit()
        by_sql = list(listener.notifies(timeout=5, stop_after=1))
        Producer(routes=ROUTES).enqueue_sync(producer_conn, "award_points", {}, job_id="n-2")
        producer_conn.commit()
        by_python = list(listener.notifies(timeout=5, stop_after=1))
    assert [(n.channel, n.payload) for n in by_sql] == [(NOTIFY_CHANNEL, "loyalty")]
    assert [(n.channel, n.payload) for n in by_python] == [(NOTIFY_CHANNEL, "loyalty")]


async def test_sql_enqueue_from_psql_exists_exactly_when_it_commits_and_runs_once(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any], database_url: str
) -> None:
    done = run_psql(
        database_url,
        """
        BEGIN;
        UPDATE public.accounts SET points = 40 WHERE id = 9;
        SELECT jobfence.enqueue('award_points', 'loyalty', 'psql-1',
                                '{"account_id": 9, "points": 2}', correlation_id => 'c-1');
        COMMIT;
        BEGIN;
        SELECT jobfence.enqueue('award_points', 'loyalty', 'psql-2',
                                '{"account_id": 9, "points": 100}');
        ROLLBACK;
        """,
    )
    assert done.returncode == 0, done.stderr
    assert [r[2] for r in rows(sync_conn)] == ["psql-1"]
    sync_conn.rollback()

    assert await run_worker(pool) == {"succeeded": 1}
    assert await run_worker(pool) == {}
    async with pool.connection() as check:
        assert await scalar(check, "SELECT points FROM public.accounts WHERE id = 9") == 42
        assert await scalar(check, "SELECT count(*) FROM core.processed_jobs") == 1


async def test_sql_enqueue_of_a_payload_the_schema_rejects_is_poison(
    sync_conn: psycopg.Connection[Any], pool: AsyncConnectionPool[Any]
) -> None:
    sync_conn.execute(ENQUEUE, ("award_points", "loyalty", "p-1", '{"points": "many"}', None,
                                None, "0"))  # fmt: skip
    sync_conn.commit()
    assert await run_worker(pool) == {"poison": 1}
    async with pool.connection() as check:
        cur = await check.execute("SELECT job_id, attempts, error_class FROM core.dead_letters")
        assert await cur.fetchall() == [("p-1", 1, "SchemaInvalid")]


LONG = "é" * 513  # 513 characters, 1026 bytes in UTF-8
BAD_ARGUMENTS = [
    pytest.param(
        {"consumer": "award points"},
        "jobfence.enqueue: consumer 'award points' must be 1-200 characters of letters, digits"
        " and _ . : -",
        id="consumer-space",
    ),
    pytest.param(
        {"consumer": "c" * 201},
        f"jobfence.enqueue: consumer '{'c' * 201}' must be 1-200 characters of letters, digits"
        " and _ . : -",
        id="consumer-too-long",
    ),
    pytest.param(
        {"consumer": None},
        "jobfence.enqueue: consumer NULL must be 1-200 characters of letters, digits and _ . : -",
        id="consumer-null",
    ),
    pytest.param(
        {"queue": ""},
        "jobfence.enqueue: queue '' must be 1-200 characters of letters, digits and _ . : -",
        id="queue-empty",
    ),
    pytest.param(
        {"job_id": ""}, "jobfence.enqueue: job_id must be a non-empty string", id="job_id-empty"
    ),
    pytest.param(
        {"job_id": None}, "jobfence.enqueue: job_id must be a non-empty string", id="job_id-null"
    ),
    pytest.param(
        {"job_id": LONG},
        "jobfence.enqueue: job_id is 1026 bytes long (UTF-8), at most 1024 are allowed",
        id="job_id-too-long",
    ),
    pytest.param(
        {"tenant_id": "t" * 201},
        "jobfence.enqueue: tenant_id is 201 bytes long (UTF-8), at most 200 are allowed",
        id="tenant_id-too-long",
    ),
    pytest.param(
        {"correlation_id": "c" * 1025},
        "jobfence.enqueue: correlation_id is 1025 bytes long (UTF-8), at most 1024 are allowed",
        id="correlation_id-too-long",
    ),
    pytest.param(
        {"payload": None},
        "jobfence.enqueue: payload must be a JSON document, not NULL (a JSON null is"
        " 'null'::jsonb)",
        id="payload-null",
    ),
    pytest.param(
        {"delay": None}, "jobfence.enqueue: delay must be an interval, not NULL", id="delay-null"
    ),
    pytest.param(
        {"delay": "1000000 years"},
        "jobfence.enqueue: delay 1000000 years is over the limit of 3650 days",
        id="delay-a-million-years",
    ),
    pytest.param(
        {"delay": "3651 days"},
        "jobfence.enqueue: delay 3651 days is over the limit of 3650 days",
        id="delay-just-over-the-limit",
    ),
]
GOOD = {
    "consumer": "award_points",
    "queue": "loyalty",
    "job_id": "ok-1",
    "payload": '{"account_id": 1, "points": 1}',
    "tenant_id": None,
    "correlation_id": None,
    "delay": "0",
}


@pytest.mark.parametrize(("change", "message"), BAD_ARGUMENTS)
def test_sql_enqueue_refuses_a_bad_argument_with_a_clear_error_and_writes_nothing(
    sync_conn: psycopg.Connection[Any], change: dict[str, Any], message: str
) -> None:
    sync_conn.execute("INSERT INTO public.awards VALUES ('before', 1, 1)")  # the caller's work
    with pytest.raises(psycopg.errors.InvalidParameterValue) as refused:
        sync_conn.execute(ENQUEUE, tuple({**GOOD, **change}.values()))
    assert refused.value.sqlstate == "22023"
    assert refused.value.diag.message_primary == message
    sync_conn.rollback()
    assert rows(sync_conn) == []
    assert sync_conn.execute("SELECT count(*) FROM public.awards").fetchone() == (0,)


def test_sql_enqueue_accepts_identifiers_at_their_limits(
    sync_conn: psycopg.Connection[Any],
) -> None:
    at_limits = {
        **GOOD,
        "consumer": "c" * 200,
        "queue": "A-z_0.9:q",
        "job_id": "é" * 512,  # 1024 bytes
        "tenant_id": "t" * 200,
        "correlation_id": "c" * 1024,
        "delay": "-5 minutes",  # counts as none
    }
    sync_conn.execute(ENQUEUE, tuple(at_limits.values()))
    sync_conn.commit()
    (row,) = rows(sync_conn)
    assert row[:3] == ("A-z_0.9:q", "c" * 200, "é" * 512)
    assert row[7] == row[10]  # run_at = created_at: due now


def test_the_producer_role_can_enqueue_from_sql(database_url: str) -> None:
    from roles_support import deployed_roles

    with deployed_roles(database_url) as urls, psycopg.connect(urls["producer"]) as conn:
        conn.execute(ENQUEUE, tuple(GOOD.values()))
        conn.commit()
    with psycopg.connect(database_url) as admin:
        assert admin.execute("SELECT job_id FROM jobfence_queue.messages").fetchall() == [("ok-1",)]


JSON_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20
) | st.sampled_from([", ", ": ", '", "', '\\", ', "\\\\", '": "', "{}", "[]", "é, 🎉: "])
JSON_DOCS = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | JSON_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(JSON_TEXT, inner, max_size=4),
    max_leaves=12,
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(doc=JSON_DOCS)
def test_compact_json_is_the_compact_text_python_writes(
    sync_conn: psycopg.Connection[Any], doc: Any
) -> None:
    """Whatever the strings hold (separators, quotes, backslashes), jobfence.compact_json gives
    the bytes json.dumps(..., separators=(",", ":"), ensure_ascii=False) gives for the same
    document with jsonb's key order."""
    text, in_jsonb_order = sync_conn.execute(
        "SELECT jobfence.compact_json(%(d)s::jsonb), %(d)s::jsonb::text",
        {"d": json.dumps(doc)},
    ).fetchone()  # type: ignore[misc]
    expected = json.dumps(json.loads(in_jsonb_order), separators=(",", ":"), ensure_ascii=False)
    assert text == expected
    assert json.loads(text) == doc


# --- a switch of queue while producers write ------------------------------------------------


def _waits_for_a_lock(watcher: psycopg.Connection[Any], pid: int) -> bool:
    row = watcher.execute(
        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return row is not None and row[0] == "Lock"


def _wait_for_lock(watcher: psycopg.Connection[Any], pid: int, what: str) -> None:
    deadline = time.monotonic() + 10
    while not _waits_for_a_lock(watcher, pid):
        assert time.monotonic() < deadline, f"{what} never waited for the other's lock"
        time.sleep(0.01)


@pytest.mark.parametrize(
    "call",
    [
        "SELECT produced_id FROM jobfence.produce('award_points', 'loyalty', 'during', '\\x7b7d')",
        "SELECT jobfence.enqueue('award_points', 'loyalty', 'during', '{}')",
    ],
    ids=["produce", "enqueue"],
)
def test_an_enqueue_during_a_switch_of_queue_goes_to_the_queue_switched_to(
    database_url: str, call: str
) -> None:
    """jobfence.set_queue moves the database to a broker while a producer enqueues. The
    producer waits for the switch to commit, then writes to the outbox: a job written to the
    PostgreSQL queue then would wait where no worker reads."""
    with (
        psycopg.connect(database_url) as switcher,
        psycopg.connect(database_url) as producer,
        psycopg.connect(database_url, autocommit=True) as watcher,
    ):
        switcher.execute("SELECT jobfence.set_queue('rabbitmq', 'amqp://broker/')")
        pid = int(producer.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        producer.commit()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            enqueued = pool.submit(lambda: producer.execute(call).fetchone())  # type: ignore[arg-type]
            _wait_for_lock(watcher, pid, "the producer")
            switcher.commit()
            produced_id = enqueued.result(timeout=10)
        producer.commit()
        assert produced_id is not None and produced_id[0] is not None
        assert scalar_sync(watcher, "SELECT count(*) FROM jobfence_queue.messages") == 0
        assert scalar_sync(watcher, "SELECT job_id FROM jobfence.outbox") == "during"


def test_a_switch_of_queue_waits_for_an_open_enqueue_and_then_refuses(database_url: str) -> None:
    """The other order: a producer's transaction holds a new queue row when the switch comes.
    The switch waits for it to commit, then counts the row and refuses: the job stays where a
    worker reads it."""
    with (
        psycopg.connect(database_url) as switcher,
        psycopg.connect(database_url) as producer,
        psycopg.connect(database_url, autocommit=True) as watcher,
    ):
        producer.execute("SELECT jobfence.enqueue('award_points', 'loyalty', 'before', '{}')")
        pid = int(switcher.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        switcher.commit()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            switched = pool.submit(
                lambda: switcher.execute("SELECT jobfence.set_queue('rabbitmq', 'amqp://broker/')")
            )
            _wait_for_lock(watcher, pid, "the switch")
            producer.commit()
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="1 message"):
                switched.result(timeout=10)
        assert scalar_sync(watcher, "SELECT job_id FROM jobfence_queue.messages") == "before"
        assert scalar_sync(watcher, "SELECT queue_kind FROM jobfence.settings") == "postgresql"


def scalar_sync(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()  # type: ignore[arg-type]
    return None if row is None else row[0]
