"""jobfence behind PgBouncer, each test with its own PgBouncer process (the ``pgbouncer``
binary, PgBouncer 1.18 or later; skipped with the reason when it is not installed).

In transaction mode every transaction may run on another server connection: prepared
statements, LISTEN, session advisory locks and session settings do not survive from one to the
next. ``JOBFENCE_DATABASE_POOL_MODE=transaction`` turns prepared statements off and the queue's
LISTEN off (workers poll), and refuses the parts that need a session; an undeclared pooler is
refused at start-up. In session mode everything works as on PostgreSQL directly.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import points_orm
import pointsapp
from jobfence import App, Producer, db
from jobfence.adapters.pg_queue import PgQueue
from jobfence.observability import DatabaseCollector
from jobfence.queues import queue_from_env
from support import scalar

TESTS = Path(__file__).parent
POOL_MODE = "JOBFENCE_DATABASE_POOL_MODE"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_pgbouncer(
    server_url: str, mode: str, pool_size: int
) -> tuple[subprocess.Popen[bytes], int, Path]:
    server = conninfo_to_dict(server_url)
    target = " ".join(
        f"{key}={server[key]}" for key in ("host", "port", "user", "password") if server.get(key)
    )
    folder = Path(tempfile.mkdtemp(prefix="jobfence-pgbouncer-"))
    folder.chmod(0o755)  # read by the unprivileged user PgBouncer switches to under root
    port = _free_port()
    (folder / "users.txt").write_text(f'"{server.get("user", "postgres")}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        f"""[databases]
* = {target}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / "users.txt"}
pool_mode = {mode}
default_pool_size = {pool_size}
max_client_conn = 500
ignore_startup_parameters = extra_float_digits
"""
    )
    for name in ("users.txt", "pgbouncer.ini"):
        (folder / name).chmod(0o644)
    # PgBouncer refuses to run as root: it switches to an unprivileged user given with -u.
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
    with (folder / "pgbouncer.log").open("wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen(
            ["pgbouncer", *as_user, str(folder / "pgbouncer.ini")], stdout=log, stderr=log
        )
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(
                    f"PgBouncer did not start: {(folder / 'pgbouncer.log').read_text()[-2000:]}"
                ) from None
            time.sleep(0.05)
    return proc, port, folder


def pgbouncers(server_url: str) -> Iterator[Callable[..., str]]:
    """``bouncer(database_url, mode, pool_size=4)``: the URL of ``database_url``'s database
    through a PgBouncer of its own in ``mode`` (session or transaction). Without the binary:
    skipped, or failed under CI (``.ci/run`` installs it), as the brokers' tests are. On a
    server reached by a Unix socket (the embedded PostgreSQL of a run without
    JOBFENCE_DATABASE_URL): skipped, since PgBouncer, which refuses to run as root, runs as an
    unprivileged user that cannot open that socket; CI runs them on its TCP server."""
    if shutil.which("pgbouncer") is None:
        missing = "the pgbouncer binary is not installed (apt-get install pgbouncer)"
        if os.environ.get("CI"):
            pytest.fail(f"{missing}: .ci/run installs it")
        pytest.skip(missing)
    host = str(conninfo_to_dict(server_url).get("host") or "")
    if not host or host.startswith(("/", "@")):
        pytest.skip(
            "PgBouncer reaches PostgreSQL over TCP here, and this server listens on a Unix"
            " socket (the embedded PostgreSQL): set JOBFENCE_DATABASE_URL to a TCP server"
        )
    started: list[tuple[subprocess.Popen[bytes], Path]] = []

    def through(database_url: str, mode: str, pool_size: int = 4) -> str:
        proc, port, folder = _start_pgbouncer(server_url, mode, pool_size)
        started.append((proc, folder))
        params = conninfo_to_dict(database_url)
        params.update(host="127.0.0.1", port=str(port))
        params.pop("password", None)
        return make_conninfo("", **params)

    yield through
    for proc, folder in started:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


bouncer = pytest.fixture(pgbouncers, name="bouncer")


def _jobfence(url: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", *args],
        env={
            **{k: v for k, v in os.environ.items() if k != POOL_MODE},
            "JOBFENCE_DATABASE_URL": url,
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def _worker_until_empty(url: str, app: str, mode: str) -> None:
    """``jobfence worker APP --until empty`` through ``url`` with the pool mode declared: it
    ends cleanly, with no prepared-statement error, no failed job and no outage on the way."""
    result = _jobfence(
        url, "worker", app, "--concurrency", "4", "--until", "empty", **{POOL_MODE: mode}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prepared statement" not in result.stderr, result.stderr[-3000:]
    assert "failed" not in result.stderr and "went away" not in result.stderr, result.stderr[-3000:]


def test_an_undeclared_pooler_is_refused_at_start_up_with_one_line(
    database_url: str, bouncer: Callable[..., str]
) -> None:
    url = bouncer(database_url, "transaction")
    result = _jobfence(url, "cleanup")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "jobfence: error: JOBFENCE_DATABASE_URL reaches PostgreSQL through a connection pooler"
        " (PgBouncer): set JOBFENCE_DATABASE_POOL_MODE to its pool mode, session or transaction"
        " (operations.md, Behind PgBouncer)"
    ]
    # PostgreSQL directly, undeclared: no pooler found, the command runs.
    assert _jobfence(database_url, "cleanup").returncode == 0


@pytest.mark.parametrize("mode", ["transaction", "session"])
def test_a_worker_behind_pgbouncer_applies_each_of_300_jobs_exactly_once(
    database_url: str, bouncer: Callable[..., str], mode: str
) -> None:
    # Session mode holds a server connection per client: room for the worker's pool, its
    # LISTEN connection and the producer. Transaction mode shares three among them all.
    url = bouncer(database_url, mode, pool_size=3 if mode == "transaction" else 12)
    jobs = 300

    async def produce() -> None:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            await c.execute(pointsapp.SCHEMA_SQL)
        # A producer's own connection behind transaction pooling: no prepared statements.
        async with await psycopg.AsyncConnection.connect(url, prepare_threshold=None) as tx:
            for i in range(jobs):
                await pointsapp.app.enqueue(
                    tx, "award_points", {"account_id": 1, "points": 1}, job_id=f"j{i}"
                )
            await tx.commit()

    asyncio.run(produce())
    _worker_until_empty(url, "pointsapp:app", mode)

    async def check() -> None:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as c:
            cur = await c.execute("SELECT count(*), count(DISTINCT job_id) FROM public.awards")
            assert await cur.fetchone() == (jobs, jobs)
            assert await scalar(c, "SELECT points FROM public.accounts WHERE id = 1") == jobs
            assert await scalar(c, "SELECT count(*) FROM core.dead_letters") == 0
            assert await scalar(c, "SELECT count(*) FROM jobfence_queue.messages") == 0

    asyncio.run(check())


def test_cleanup_behind_transaction_pooling_runs_many_batches_without_prepared_statements(
    database_url: str, bouncer: Callable[..., str]
) -> None:
    url = bouncer(database_url, "transaction", pool_size=1)
    with psycopg.connect(database_url, autocommit=True) as c:
        c.execute(
            "INSERT INTO core.processed_jobs (job_id, consumer, processed_at, expires_at)"
            " SELECT 'j' || i, 'c', now() - interval '2 days', now() - interval '1 day'"
            " FROM generate_series(1, 30) i"
        )
    # One statement per batch, the same one 30 times: psycopg would prepare it from the 5th.
    result = _jobfence(url, "cleanup", "--batch-size", "1", **{POOL_MODE: "transaction"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "removed 30 expired fence rows" in result.stdout
    # The one server connection holds no statement prepared by it, that the next client's
    # statement of the same name (psycopg's _pg3_0, _pg3_1...) would run into.
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as other:
        assert other.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() == (0,)


@pytest.mark.parametrize(
    ("args", "env", "what"),
    [
        (["migrate"], {}, "jobfence migrate"),
        (
            ["outbox-relay"],
            {"JOBFENCE_QUEUE_URL": "redis://127.0.0.1:6379/0"},
            "jobfence outbox-relay",
        ),
        (
            ["alert-relay"],
            {
                "JOBFENCE_BETTERSTACK_TOKEN": "not-a-real-token",
                "JOBFENCE_BETTERSTACK_REQUESTER_EMAIL": "ops@example.com",
            },
            "jobfence alert-relay",
        ),
        (
            ["worker", "pointsapp:app"],
            {"JOBFENCE_QUEUE_URL": "redis://127.0.0.1:6379/0"},
            "the outbox relay a worker runs on a broker",
        ),
    ],
    ids=["migrate", "outbox-relay", "alert-relay", "worker-on-a-broker"],
)
def test_the_parts_that_need_a_session_are_refused_under_transaction_pooling(
    database_url: str, bouncer: Callable[..., str], args: list[str], env: dict[str, str], what: str
) -> None:
    url = bouncer(database_url, "transaction")
    result = _jobfence(url, *args, **{POOL_MODE: "transaction", **env})
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"jobfence: error: {what} needs a database session of its own")
    assert "pointing at PostgreSQL directly or at a pool in session mode" in lines[0]


def test_migrate_through_session_pooling_applies_the_schema(
    empty_database_url: str, bouncer: Callable[..., str]
) -> None:
    url = bouncer(empty_database_url, "session")
    result = _jobfence(url, "migrate", **{POOL_MODE: "session"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "applied 0001_core" in result.stdout
    assert "already up to date" in _jobfence(url, "migrate", **{POOL_MODE: "session"}).stdout


async def _received_within(queue: PgQueue, pool_url: str, seconds: float) -> float:
    """Seconds between a publish (after the receiver started waiting) and its receipt."""
    receiving = asyncio.ensure_future(
        queue.receive(["loyalty"], max_messages=1, lease_seconds=30, wait_seconds=seconds)
    )
    await asyncio.sleep(0.5)  # the receiver is waiting (its first look found nothing)
    started = time.monotonic()
    async with await psycopg.AsyncConnection.connect(pool_url, autocommit=True) as c:
        await c.execute("SELECT jobfence.enqueue('award_points', 'loyalty', 'j1', '{}'::jsonb)")
    got = await asyncio.wait_for(receiving, seconds + 5)
    assert [d.message.job_id for d in got] == ["j1"]
    return time.monotonic() - started


async def test_the_pg_queue_behind_session_pooling_is_woken_by_notify(
    database_url: str, bouncer: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = bouncer(database_url, "session")
    monkeypatch.setenv(POOL_MODE, "session")
    pool = await db.open_pool(url, max_size=2)
    queue = PgQueue(pool, poll_interval_seconds=30)  # only a NOTIFY wakes it within 30 s
    try:
        assert await _received_within(queue, url, 20) < 5
    finally:
        await queue.close()
        await pool.close()


async def test_the_pg_queue_behind_transaction_pooling_polls_and_holds_no_listen_connection(
    database_url: str, bouncer: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CLI's queue (``queue_from_env``) and a ``PgQueue(pool)`` a library user
    makes: both poll, holding no LISTEN that could never hear."""
    url = bouncer(database_url, "transaction")
    monkeypatch.setenv(POOL_MODE, "transaction")
    pool = await db.open_pool(url, max_size=2)
    try:
        async with queue_from_env(pool) as queue:
            assert isinstance(queue, PgQueue)
            # Found by the poll (once a second), with no LISTEN that could never hear.
            assert await _received_within(queue, url, 10) < 5
            assert queue._listener is None
        own = PgQueue(pool)
        try:
            assert await _received_within(own, url, 10) < 5
            assert own._listener is None
        finally:
            await own.close()
        async with pool.connection() as conn:
            assert conn.prepare_threshold is None
    finally:
        await pool.close()


def test_a_metrics_scrape_behind_transaction_pooling_leaves_no_statement_timeout_behind(
    database_url: str, bouncer: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One server connection: whatever the scrape leaves on it, the next client finds.
    url = bouncer(database_url, "transaction", pool_size=1)
    monkeypatch.setenv(POOL_MODE, "transaction")
    DatabaseCollector(url, timeout_seconds=3)._query()
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as other:
        row = other.execute("SHOW statement_timeout").fetchone()
    assert row == ("0",)


# -- sync handlers, group commit, SQLAlchemy, producers, the Ops API and CLI ----------------


def _orm_app(jobs_per_transaction: int, flavour: str) -> App:
    app = App()
    handler = {
        "sync": pointsapp.apply_award_sync,
        "orm": points_orm.apply_award_orm,
        "orm-async": points_orm.apply_award_orm_async,
    }[flavour]
    app.consumer(
        "award_points",
        queue=pointsapp.QUEUE,
        schema=pointsapp.Award,
        jobs_per_transaction=jobs_per_transaction,
    )(handler)
    return app


# Loaded by the worker subprocesses below as test_pgbouncer:<name>.
sync_app = _orm_app(1, "sync")
sync_group_app = _orm_app(5, "sync")
orm_group_app = _orm_app(5, "orm")
orm_async_group_app = _orm_app(5, "orm-async")


@pytest.mark.parametrize(
    "app_name", ["sync_app", "sync_group_app", "orm_group_app", "orm_async_group_app"]
)
def test_sync_handlers_group_commit_and_sqlalchemy_behind_transaction_pooling(
    database_url: str, bouncer: Callable[..., str], app_name: str
) -> None:
    url = bouncer(database_url, "transaction", pool_size=3)
    jobs = 200
    with psycopg.connect(database_url, autocommit=True) as c:
        c.execute(pointsapp.SCHEMA_SQL)
    asyncio.run(pointsapp.enqueue_awards(database_url, [f"j{i}" for i in range(jobs)]))
    _worker_until_empty(url, f"test_pgbouncer:{app_name}", "transaction")
    with psycopg.connect(database_url, autocommit=True) as c:
        assert c.execute(
            "SELECT count(*), count(DISTINCT job_id) FROM public.awards"
        ).fetchone() == (jobs, jobs)
        assert c.execute("SELECT points FROM public.accounts WHERE id = 1").fetchone() == (jobs,)
        assert c.execute("SELECT count(*) FROM core.dead_letters").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM core.processed_jobs").fetchone() == (jobs,)


def test_producers_on_their_own_connections_behind_transaction_pooling(
    database_url: str, bouncer: Callable[..., str]
) -> None:
    import psycopg2
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    url = bouncer(database_url, "transaction", pool_size=2)
    producer = Producer(routes={"award_points": pointsapp.QUEUE})
    n = 12  # more than psycopg's prepare threshold (5) on each connection
    with psycopg.connect(url, prepare_threshold=None) as conn:
        for i in range(n):
            producer.enqueue_sync(
                conn, "award_points", {"account_id": 1, "points": 1}, job_id=f"p{i}"
            )
            conn.commit()  # each in its own transaction: each may get another server connection
    dsn = conninfo_to_dict(url)
    with psycopg2.connect(**dsn) as conn2:
        for i in range(n):
            pointsapp.app.enqueue_sync(
                conn2, "award_points", {"account_id": 1, "points": 1}, job_id=f"q{i}"
            )
            conn2.commit()
    engine = create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(url, prepare_threshold=None)
    )
    try:
        for i in range(n):
            with Session(engine) as session, session.begin():
                pointsapp.app.enqueue_sync(
                    session, "award_points", {"account_id": 1, "points": 1}, job_id=f"s{i}"
                )
    finally:
        engine.dispose()

    async def produce_async() -> None:
        async with await psycopg.AsyncConnection.connect(url, prepare_threshold=None) as aconn:
            for i in range(n):
                await producer.enqueue(
                    aconn, "award_points", {"account_id": 1, "points": 1}, job_id=f"a{i}"
                )
                await aconn.commit()

    asyncio.run(produce_async())
    with psycopg.connect(database_url, autocommit=True) as c:
        assert c.execute(
            "SELECT count(*), count(DISTINCT job_id) FROM jobfence_queue.messages"
        ).fetchone() == (4 * n, 4 * n)


def _seed_dead_letters(database_url: str, count: int) -> None:
    with psycopg.connect(database_url, autocommit=True) as c:
        c.execute(
            "INSERT INTO core.dead_letters (job_id, queue, consumer, tenant_id, payload,"
            " attempts, last_error, error_class)"
            " SELECT 'd' || i, 'loyalty', 'award_points', 't1',"
            " '{\"account_id\": 1, \"points\": 5}'::jsonb, 6, 'Flaky: it failed', 'Flaky'"
            " FROM generate_series(1, %s) i",
            (count,),
        )


def _replayed_once(database_url: str, count: int) -> None:
    with psycopg.connect(database_url, autocommit=True) as c:
        assert c.execute(
            "SELECT count(*) FROM core.dead_letters WHERE status = 'replayed'"
        ).fetchone() == (count,)
        assert c.execute(
            "SELECT count(*), count(DISTINCT job_id) FROM jobfence_queue.messages"
        ).fetchone() == (count, count)


def test_dead_letter_commands_behind_transaction_pooling(
    database_url: str, bouncer: Callable[..., str]
) -> None:
    url = bouncer(database_url, "transaction", pool_size=2)
    _seed_dead_letters(database_url, 40)
    env = {POOL_MODE: "transaction", "JOBFENCE_ACTOR": "ops"}
    listed = _jobfence(url, "dead-letters", "list", "--limit", "5", **env)
    assert listed.returncode == 0, listed.stderr[-3000:]
    shown = _jobfence(url, "dead-letters", "replay", "1", **env)
    assert shown.returncode == 0, shown.stderr[-3000:]
    bulk = _jobfence(url, "dead-letters", "replay-bulk", "--queue", "loyalty", **env)
    assert bulk.returncode == 0, bulk.stderr[-3000:]
    assert "prepared statement" not in bulk.stderr
    _replayed_once(database_url, 40)


async def test_the_ops_api_behind_transaction_pooling_lists_and_bulk_replays(
    database_url: str, bouncer: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobfence.api import ApiSettings
    from test_api_support import PREFIX, SECRET, auth, running_api, wait_bulk_finished

    url = bouncer(database_url, "transaction", pool_size=2)
    monkeypatch.setenv(POOL_MODE, "transaction")
    _seed_dead_letters(database_url, 40)
    pool = await db.open_pool(url, max_size=4, large_reads=True, lend_checked=True)
    settings = ApiSettings(jwt_secret=SECRET, bulk_chunk_size=3)
    try:
        async with running_api(pool, settings=settings) as api:
            for _ in range(8):  # pages, the same statements again and again
                page = await api.client.get(f"{PREFIX}?limit=5", headers=auth())
                assert page.status_code == 200, page.text
                one = await api.client.get(f"{PREFIX}/1", headers=auth())
                assert one.status_code == 200, one.text
            started = await api.client.post(
                f"{PREFIX}/replay-bulk", json={"queue": "loyalty"}, headers=auth()
            )
            assert started.status_code == 202, started.text
            done = await wait_bulk_finished(api, started.json()["id"])
            assert done["status"] == "finished", done
    finally:
        await pool.close()
    _replayed_once(database_url, 40)


@pytest.mark.parametrize(
    "mode", ["statement", "sesion", "session\x1b[2J s3cr3t-Zq9", "transaction; DROP", " "]
)
def test_a_pool_mode_that_is_not_one_is_refused_with_one_line_and_nothing_is_touched(
    database_url: str, conn_sync_count: Callable[[], int], mode: str
) -> None:
    """``JOBFENCE_DATABASE_POOL_MODE`` is a setting anyone may mistype or fill with garbage:
    anything but ``session`` or ``transaction`` (or blank: unset) is one line and exit status
    2, naming the variable and the two values, never echoing what it held; no fence is
    touched. Runs on any server (no PgBouncer needed)."""
    before = conn_sync_count()
    result = _jobfence(database_url, "cleanup", **{POOL_MODE: mode})
    if not mode.strip():  # blank is unset: PostgreSQL directly
        assert result.returncode == 0, result.stderr[-2000:]
        return
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("jobfence: error: JOBFENCE_DATABASE_POOL_MODE must be"), lines
    assert "session or transaction" in lines[0]
    assert "s3cr3t" not in result.stderr and "\x1b" not in result.stderr
    assert "DROP" not in result.stderr and "sesion" not in result.stderr
    assert conn_sync_count() == before


@pytest.fixture
def conn_sync_count(database_url: str) -> Callable[[], int]:
    """The number of fence rows, read on a connection of the test's own."""

    def count() -> int:
        with psycopg.connect(database_url, autocommit=True) as c:
            row = c.execute("SELECT count(*) FROM core.processed_jobs").fetchone()
        return int(row[0]) if row else 0

    return count
