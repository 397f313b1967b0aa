"""The least-privilege roles of ``jobfence roles --print-sql`` (docs/operations.md, "Deploying
with least privilege"): each test connects as a login role that holds one group role and
nothing else, and proves both what that role can do and what it cannot.

The whole set of producer paths also runs as the producer role in tests/test_producers.py."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client import generate_latest
from psycopg import errors
from psycopg.conninfo import make_conninfo
from pydantic import BaseModel

from alert_helpers import TOKEN, fast_settings, make_relay, running, wait_for_alerts
from fake_betterstack import FakeBetterStack
from jobfence import (
    App,
    HardFailure,
    JobMeta,
    MemoryQueue,
    Message,
    PgQueue,
    RetryPolicy,
    Worker,
    db,
    ops,
)
from jobfence.adapters.pg_queue import publish_on
from jobfence.cleanup import cleanup_expired
from jobfence.cli import main
from jobfence.observability import metrics_registry
from jobfence.ops import DeadLetterFilter, run_bulk_replay, start_bulk_replay
from jobfence.outbox import OutboxRelay, record_queue
from jobfence.roles import DEFAULT_NAMES, ROLES, render_roles_sql
from jobfence.schema import migrate
from roles_support import deployed_roles, group_role
from support import scalar

QUEUE = "roles"
CONSUMER = "roles.consumer"


@pytest.fixture
def roles(database_url: str) -> Iterator[dict[str, str]]:
    with deployed_roles(database_url) as urls:
        yield urls


class Job(BaseModel):
    mode: str


def build_app() -> App:
    app = App()
    fast = RetryPolicy(
        max_retries=1, base_seconds=0.05, cap_seconds=0.1, rationale="tests: retry at once"
    )

    @app.consumer(CONSUMER, queue=QUEUE, schema=Job, retry=fast)
    async def handle(payload: Job, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
        if payload.mode == "hard":
            raise HardFailure("refused")
        if payload.mode == "flaky" and job.attempt == 1:
            raise RuntimeError("try again")

    return app


def job(job_id: str, mode: str) -> Message:
    return Message(QUEUE, CONSUMER, job_id, json.dumps({"mode": mode}).encode())


def denied(conn: psycopg.Connection[Any], statement: str) -> None:
    """``statement`` fails with "permission denied" and changes nothing."""
    with pytest.raises(errors.InsufficientPrivilege), conn.transaction():
        conn.execute(statement)  # type: ignore[arg-type]


# -- the command ------------------------------------------------------------------------------


def test_roles_print_sql_prints_every_role_under_the_given_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(["roles", "--print-sql", "--producer", "shop_producer", "--alert-relay", "pager"]) == 0
    )
    printed = capsys.readouterr().out
    assert printed == render_roles_sql({"producer": "shop_producer", "alert_relay": "pager"})
    assert printed.startswith("-- jobfence database roles")
    assert '"shop_producer"' in printed and '"pager"' in printed
    for role in ("owner", "worker", "ops", "relay"):
        assert f'"{DEFAULT_NAMES[role]}"' in printed
    assert "jobfence_producer" not in printed and "{" not in printed.replace("DO $$", "")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ops", 'ops"; DROP TABLE x; --'], "must be 1-63 characters of lower-case letters"),
        (["--worker", "Worker"], "must be 1-63 characters of lower-case letters"),
        (["--worker", "same", "--relay", "same"], "is given to both the worker and the relay"),
    ],
    ids=["injection", "upper-case", "one-name-twice"],
)
def test_roles_print_sql_refuses_a_name_it_could_not_print_safely(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["roles", "--print-sql", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def test_every_security_definer_function_pins_its_search_path(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p"
            " JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname IN ('jobfence', 'core', 'jobfence_queue') AND p.prosecdef"
            " ORDER BY 1"
        ).fetchall()
    names = [name.split("(")[0] for name, _ in rows]
    assert {"jobfence.produce", "jobfence.enqueue"} <= set(names)
    for name, config in rows:
        assert config == ["search_path=pg_catalog, pg_temp"], name


def test_the_owner_owns_everything_and_runs_an_upgrades_migrations(
    database_url: str, roles: dict[str, str]
) -> None:
    owner = group_role(roles["owner"])
    with psycopg.connect(database_url, autocommit=True) as admin:
        not_owned = admin.execute(
            "SELECT c.oid::regclass::text FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('jobfence', 'core', 'jobfence_queue')"
            "   AND pg_get_userbyid(c.relowner) <> %s"
            " UNION ALL SELECT p.oid::regprocedure::text FROM pg_proc p"
            " JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname IN ('jobfence', 'core', 'jobfence_queue')"
            "   AND pg_get_userbyid(p.proowner) <> %s",
            (owner, owner),
        ).fetchall()
        assert not_owned == []
        # An upgrade: 0019 is not applied yet. The owner's login applies it, as the owner.
        admin.execute(
            "DROP FUNCTION jobfence.produce(text, text, text, bytea, text, text, interval)"
        )
        admin.execute("DELETE FROM jobfence.schema_migrations WHERE version = 19")
        login = psycopg.conninfo.conninfo_to_dict(roles["owner"])["user"]
        admin.execute(f'ALTER ROLE "{login}" SET role = "{owner}"')  # type: ignore[arg-type]

    async def owner_migrates() -> list[int]:
        async with await psycopg.AsyncConnection.connect(roles["owner"], autocommit=True) as c:
            return [m.version for m in await migrate(c)]

    assert asyncio.run(owner_migrates()) == [19]
    with psycopg.connect(database_url) as admin:
        assert admin.execute(
            "SELECT DISTINCT pg_get_userbyid(proowner) FROM pg_proc WHERE proname = 'produce'"
        ).fetchall() == [(owner,)]


def test_a_role_that_inserted_queue_rows_before_the_upgrade_still_enqueues_after_it(
    database_url: str,
) -> None:
    role = f"jobfence_old_producer_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        # The database before 0019, and a producer role with the grants documented then.
        admin.execute(
            "DROP FUNCTION jobfence.produce(text, text, text, bytea, text, text, interval)"
        )
        admin.execute("DELETE FROM jobfence.schema_migrations WHERE version = 19")
        admin.execute(
            f"CREATE ROLE {role} LOGIN;"  # type: ignore[arg-type]
            f" GRANT USAGE ON SCHEMA jobfence, jobfence_queue TO {role};"
            f" GRANT INSERT ON jobfence_queue.messages, jobfence.outbox TO {role};"
            f" GRANT SELECT ON jobfence.settings TO {role};"
        )
    try:

        async def upgrade() -> list[int]:
            async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
                return [m.version for m in await migrate(c)]

        assert asyncio.run(upgrade()) == [19]
        with psycopg.connect(make_conninfo(database_url, user=role)) as conn:
            build_app().enqueue_sync(conn, CONSUMER, {"mode": "ok"}, job_id="after-upgrade")
            conn.execute(
                "SELECT jobfence.enqueue(%s, %s, %s, %s::jsonb)", (CONSUMER, QUEUE, "sql", "{}")
            )
            conn.commit()
        with psycopg.connect(database_url) as admin:
            assert admin.execute("SELECT count(*) FROM jobfence_queue.messages").fetchall() == [
                (2,)
            ]
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {role}")  # type: ignore[arg-type]
            admin.execute(f"DROP ROLE {role}")  # type: ignore[arg-type]


# -- the producer -----------------------------------------------------------------------------


def test_the_producer_enqueues_from_python_and_sql_and_reads_or_rewrites_nothing(
    database_url: str, roles: dict[str, str]
) -> None:
    app = build_app()
    with psycopg.connect(roles["producer"]) as conn:
        app.enqueue_sync(conn, CONSUMER, {"mode": "ok"}, job_id="py-1", delay_seconds=-60)
        conn.execute(
            "SELECT jobfence.enqueue(%s, %s, %s, %s::jsonb)", (CONSUMER, QUEUE, "sql-1", "{}")
        )
        conn.commit()

        denied(conn, "SELECT body FROM jobfence_queue.messages")
        denied(conn, "SELECT id FROM jobfence_queue.messages")
        denied(conn, "SELECT payload FROM core.dead_letters")
        denied(conn, "SELECT queue_kind FROM jobfence.settings")
        denied(conn, "SELECT body FROM jobfence.outbox")
        denied(conn, "UPDATE jobfence_queue.messages SET attempts = 99")
        denied(conn, "UPDATE jobfence_queue.messages SET lease_token = gen_random_uuid()")
        denied(conn, "DELETE FROM jobfence_queue.messages")
        denied(
            conn,
            "INSERT INTO jobfence_queue.messages (queue, consumer, job_id, body, attempts, run_at)"
            " VALUES ('roles', 'roles.consumer', 'forged', '\\x7b7d', 1000, '-infinity')",
        )
        denied(
            conn,
            "INSERT INTO jobfence.outbox (queue, consumer, job_id, body, prior_attempts)"
            " VALUES ('roles', 'roles.consumer', 'forged', '\\x7b7d', 1000)",
        )
        denied(conn, "UPDATE jobfence.settings SET queue_kind = 'rabbitmq'")
        denied(conn, "SELECT jobfence.set_queue('rabbitmq', NULL)")
        denied(conn, "CREATE TABLE jobfence.mine (id int)")

    with psycopg.connect(database_url) as admin:
        rows = admin.execute(
            "SELECT job_id, attempts, lease_token, last_error, run_at >= created_at"
            " FROM jobfence_queue.messages ORDER BY id"
        ).fetchall()
    assert rows == [("py-1", 0, None, None, True), ("sql-1", 0, None, None, True)]


def test_the_producer_enqueues_to_the_outbox_when_the_queue_is_a_broker(
    database_url: str, roles: dict[str, str]
) -> None:
    async def to_broker() -> None:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await record_queue(c, "rabbitmq", "amqp://broker/")

    asyncio.run(to_broker())
    with psycopg.connect(roles["producer"]) as conn:
        build_app().enqueue_sync(conn, CONSUMER, {"mode": "ok"}, job_id="o-1")
        conn.execute(
            "SELECT jobfence.enqueue(%s, %s, %s, %s::jsonb)", (CONSUMER, QUEUE, "o-2", "{}")
        )
        conn.commit()
        denied(conn, "UPDATE jobfence.outbox SET prior_attempts = 1000")
        denied(conn, "SELECT job_id FROM jobfence.outbox")
    with psycopg.connect(database_url) as admin:
        assert admin.execute(
            "SELECT job_id, attempts, prior_attempts FROM jobfence.outbox ORDER BY id"
        ).fetchall() == [("o-1", 0, 0), ("o-2", 0, 0)]
        assert admin.execute("SELECT count(*) FROM jobfence_queue.messages").fetchall() == [(0,)]


def test_a_producer_function_refuses_what_would_break_the_queue(roles: dict[str, str]) -> None:
    with psycopg.connect(roles["producer"], autocommit=True) as conn:
        for args, message in [
            (("c", "q", "", b"{}"), "jobfence.produce: job_id must be a non-empty string"),
            (("bad name", "q", "j", b"{}"), "jobfence.produce: consumer 'bad name' must be"),
            (("c", "q", "j" * 1025, b"{}"), "jobfence.produce: job_id is 1025 bytes long"),
            (("c", "q", "j", None), "jobfence.produce: body must be the bytes of a JSON"),
        ]:
            with pytest.raises(errors.InvalidParameterValue) as refused:
                conn.execute("SELECT jobfence.produce(%s, %s, %s, %s)", args)
            assert message in str(refused.value)


# -- the worker -------------------------------------------------------------------------------


async def test_the_worker_processes_retries_and_dead_letters_and_cleans_up(
    database_url: str, roles: dict[str, str]
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admin:
        for job_id, mode in [("ok", "ok"), ("flaky", "flaky"), ("hard", "hard")]:
            await publish_on(admin, job(job_id, mode))

    pool = await db.open_pool(roles["worker"], min_size=1, max_size=4)
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    try:
        worker = Worker(build_app(), pool, queue, poll_seconds=0.05)
        stats = await asyncio.wait_for(worker.run(until="empty"), timeout=30)
        assert stats.outcomes == {"succeeded": 2, "retried": 1, "dead_lettered": 1}
        async with pool.connection() as conn:
            await conn.execute(
                "UPDATE core.processed_jobs SET processed_at = now() - interval '2 days',"
                " expires_at = now() - interval '1 day' WHERE job_id = 'ok'"
            )
            assert (await cleanup_expired(conn)).deleted == 1
            await conn.set_autocommit(True)
            for statement in [
                "UPDATE core.dead_letters SET status = 'discarded', discard_reason = 'x'",
                "DELETE FROM core.dead_letters",
                "SELECT * FROM jobfence.bulk_replays",
                "SELECT * FROM jobfence.alerts",
            ]:
                with pytest.raises(errors.InsufficientPrivilege):
                    await conn.execute(statement)  # type: ignore[arg-type]
    finally:
        await queue.close()
        await pool.close()
    async with await psycopg.AsyncConnection.connect(database_url) as admin:
        assert await scalar(admin, "SELECT job_id FROM core.dead_letters") == "hard"
        assert await scalar(admin, "SELECT count(*) FROM jobfence.alert_outbox") == 1


# -- the Ops API and CLI ----------------------------------------------------------------------


async def test_the_ops_role_lists_shows_replays_and_discards_but_never_rewrites_a_dead_letter(
    database_url: str, roles: dict[str, str]
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admin:
        for i in range(4):
            await publish_on(admin, job(f"bad-{i}", "hard"))
        admin_pool = await db.open_pool(database_url, min_size=1, max_size=2)
        try:
            worker_queue = PgQueue(admin_pool, poll_interval_seconds=0.05)
            await Worker(build_app(), admin_pool, worker_queue, poll_seconds=0.05).run(
                until="empty"
            )
            await worker_queue.close()
        finally:
            await admin_pool.close()

    pool = await db.open_pool(roles["ops"], min_size=1, max_size=4)
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    try:
        async with pool.connection() as conn:
            page = json.loads(await ops.list_dead_letters_json(conn, DeadLetterFilter()))
            ids = sorted(item["id"] for item in page["items"])
            assert len(ids) == 4
            shown = json.loads(await ops.show_dead_letter_json(conn, ids[0]))
            assert shown["fence_exists"] is False and shown["payload"] == {"mode": "hard"}
        assert (await ops.replay(pool, queue, ids[0], actor="ops@example.com")).published
        discarded = await ops.discard(pool, ids[1], reason="test data", actor="ops@example.com")
        assert discarded.status == "discarded"
        run = await start_bulk_replay(
            pool, DeadLetterFilter(queue=QUEUE), requested_by="ops@example.com"
        )
        assert not isinstance(run, int)
        finished = await run_bulk_replay(pool, queue, run.id, actor="ops@example.com")
        assert finished.counts["replayed"] == 2, finished.counts

        async with pool.connection() as conn:
            await conn.set_autocommit(True)
            for statement in [
                "DELETE FROM core.dead_letters",
                "TRUNCATE core.dead_letters",
                "UPDATE core.dead_letters SET payload = '{}'",
                "UPDATE core.dead_letters SET last_error = 'rewritten', job_id = 'other'",
                "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts,"
                " last_error, error_class) VALUES ('x', 'q', 'c', '{}', 1, 'e', 'E')",
                "SELECT body FROM jobfence_queue.messages",
                "UPDATE jobfence_queue.messages SET attempts = 0",
                "DELETE FROM jobfence_queue.messages",
                "UPDATE jobfence.settings SET queue_kind = 'postgresql'",
            ]:
                with pytest.raises(errors.InsufficientPrivilege):
                    await conn.execute(statement)  # type: ignore[arg-type]
    finally:
        await queue.close()
        await pool.close()
    async with await psycopg.AsyncConnection.connect(database_url) as admin:
        cur = await admin.execute("SELECT job_id FROM jobfence_queue.messages ORDER BY job_id")
        replayed = sorted({f"bad-{i}" for i in range(4)} - {discarded.job_id})
        assert [r[0] for r in await cur.fetchall()] == replayed


async def test_the_ops_role_replays_to_the_outbox_and_serves_metrics(
    database_url: str, roles: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admin:
        await publish_on(admin, job("to-outbox", "hard"))
        admin_pool = await db.open_pool(database_url, min_size=1, max_size=2)
        try:
            worker_queue = PgQueue(admin_pool, poll_interval_seconds=0.05)
            await Worker(build_app(), admin_pool, worker_queue, poll_seconds=0.05).run(
                until="empty"
            )
            await worker_queue.close()
        finally:
            await admin_pool.close()
        await record_queue(admin, "rabbitmq", "amqp://broker/")
        dead_letter_id = await scalar(admin, "SELECT id FROM core.dead_letters")

    registry = metrics_registry(roles["ops"], process=False)
    scraped = generate_latest(registry).decode()
    assert 'jobfence_dead_letters_pending{consumer="roles.consumer",queue="roles"} 1.0' in scraped
    assert "jobfence_queue_messages" in scraped
    assert "cannot read the database" not in caplog.text

    pool = await db.open_pool(roles["ops"], min_size=1, max_size=2)
    queue = MemoryQueue()
    try:
        assert (await ops.replay(pool, queue, dead_letter_id, actor="ops@example.com")).published
    finally:
        await queue.close()
        await pool.close()
    async with await psycopg.AsyncConnection.connect(database_url) as admin:
        cur = await admin.execute("SELECT job_id, attempts, prior_attempts FROM jobfence.outbox")
        assert await cur.fetchall() == [("to-outbox", 0, 0)]


# -- the relays -------------------------------------------------------------------------------


async def test_the_relay_role_publishes_the_outbox_and_reads_nothing_else(
    database_url: str, roles: dict[str, str]
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admin:
        await record_queue(admin, "rabbitmq", "amqp://broker/")
        await build_app().enqueue(admin, CONSUMER, {"mode": "ok"}, job_id="r-1")

    queue = MemoryQueue(poll_interval_seconds=0.05)
    relay = OutboxRelay(roles["relay"], queue)
    async with await psycopg.AsyncConnection.connect(roles["relay"], autocommit=True) as conn:
        await relay.run_round(conn)
        assert relay.stats.published == 1
        assert (await queue.size([QUEUE])).total == 1
        assert await scalar(conn, "SELECT count(*) FROM jobfence.outbox") == 0
        for statement in [
            "SELECT job_id FROM core.dead_letters",
            "SELECT body FROM jobfence_queue.messages",
            "INSERT INTO jobfence.outbox (queue, consumer, job_id, body)"
            " VALUES ('q', 'c', 'j', '\\x7b7d')",
        ]:
            with pytest.raises(errors.InsufficientPrivilege):
                await conn.execute(statement)  # type: ignore[arg-type]
    await queue.close()


async def test_the_alert_relay_role_opens_incidents_without_reading_payloads(
    database_url: str, roles: dict[str, str]
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admin:
        await publish_on(admin, job("page-me", "hard"))
        admin_pool = await db.open_pool(database_url, min_size=1, max_size=2)
        try:
            worker_queue = PgQueue(admin_pool, poll_interval_seconds=0.05)
            await Worker(build_app(), admin_pool, worker_queue, poll_seconds=0.05).run(
                until="empty"
            )
            await worker_queue.close()
        finally:
            await admin_pool.close()

        server = FakeBetterStack(TOKEN).start()
        try:
            relay = make_relay(roles["alert_relay"], server, settings=fast_settings())
            async with running(relay):
                await wait_for_alerts(admin, "sent", 1)
            assert relay.stats.rounds > 0
        finally:
            server.close()
    async with await psycopg.AsyncConnection.connect(roles["alert_relay"]) as conn:
        for statement in [
            "SELECT payload FROM core.dead_letters",
            "SELECT correlation_id FROM core.dead_letters",
            "UPDATE core.dead_letters SET status = 'replayed'",
            "SELECT body FROM jobfence.outbox",
        ]:
            with pytest.raises(errors.InsufficientPrivilege):
                await conn.execute(statement)  # type: ignore[arg-type]
            await conn.rollback()


def test_every_role_is_in_the_printed_sql_and_in_the_docs() -> None:
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "operations.md").read_text(encoding="utf-8")
    section = docs[docs.index("## Deploying with least privilege") :]
    for role in ROLES:
        assert f"`{DEFAULT_NAMES[role]}`" in section, role


def test_the_django_producer_enqueues_as_the_producer_role(empty_database_url: str) -> None:
    from test_django import enqueue_code, manage, one, shell

    done = manage(empty_database_url, "migrate", "-v", "0")
    assert done.returncode == 0, done.stderr
    with deployed_roles(empty_database_url) as urls:
        shell(urls["producer"], enqueue_code(("dj-1", {"account": "ann", "amount": 5})))
        refused = manage(
            urls["producer"],
            "shell",
            "-c",
            "from django.db import connection\n"
            "connection.cursor().execute('SELECT body FROM jobfence_queue.messages')",
        )
        assert refused.returncode != 0
        assert "permission denied for schema jobfence_queue" in refused.stderr
    assert one(empty_database_url, "SELECT array_agg(job_id) FROM jobfence_queue.messages") == [
        "dj-1"
    ]
