"""A database that accepts connections but refuses writes: a standby after a failover (the name
still points at the old primary, now a replica), or ``default_transaction_read_only = on`` set on
the database or the role for a maintenance window. Every write fails with SQLSTATE 25006
(``ReadOnlySqlTransaction``, an ``InternalError``). For jobfence that is an outage for writing
(D7): each process pauses and says so once, nothing is counted as an attempt, what it holds is
given back, connections that were read-only are dropped (a new one resolves the host again), and
it resumes when writes work again.

Simulated with ``ALTER DATABASE <the test's database> SET default_transaction_read_only = on``,
which new sessions take; the sessions already open are ended, as a failover ends them. Every
test ends the read-only state in ``finally``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

import pointsapp
from brokers import make_queue, on_broker
from jobfence import App, JobMeta, PgQueue, PrometheusMetrics, RetryPolicy, Worker, db
from jobfence.errors import DatabaseUnavailable
from jobfence.outbox import OutboxRelay, OutboxRelaySettings, record_queue
from jobfence.queues import parse_queue_url
from support import run_jobfence, scalar, wait_until
from test_api_support import PREFIX, auth, insert_dead_letter, running_api

JOBS = 8


def _dbname(url: str) -> str:
    return str(conninfo_to_dict(url)["dbname"])


def _admin_url(url: str) -> str:
    params = conninfo_to_dict(url)
    params["dbname"] = "postgres"
    return make_conninfo("", **params)


def _end_other_sessions(admin: psycopg.Connection[Any], name: str, keep: list[int]) -> None:
    admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = %s AND pid <> pg_backend_pid() AND NOT pid = ANY(%s)",
        (name, keep),
    )


@contextlib.contextmanager
def read_only_switch(database_url: str, *, keep: list[int]) -> Iterator[Any]:
    """A switch for the test's database: ``switch(True)`` makes it read-only for new sessions
    and ends the others (except the sessions ``keep`` lists: the test's own), as a failover to a
    standby does; ``switch(False)`` makes it writable again for new sessions only (those opened
    meanwhile stay read-only: whoever holds one must drop it). Always writable on exit."""
    name = _dbname(database_url)
    admin = psycopg.connect(_admin_url(database_url), autocommit=True)

    def switch(read_only: bool) -> None:
        if read_only:
            admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
            _end_other_sessions(admin, name, keep)
        else:
            admin.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')

    try:
        yield switch
    finally:
        admin.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
        admin.close()


class Award(BaseModel):
    account_id: int


def _award_app(attempts: list[tuple[str, int]], *, retry: RetryPolicy | None = None) -> App:
    app = App()

    @app.consumer(
        "award",
        queue=pointsapp.QUEUE,
        schema=Award,
        **({"retry": retry} if retry is not None else {}),
    )
    async def award(payload: Award, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
        attempts.append((job.job_id, job.attempt))
        await tx.execute(
            "INSERT INTO public.awards (job_id, account_id, points) VALUES (%s, %s, 1)",
            (job.job_id, payload.account_id),
        )

    return app


def _lines(caplog: pytest.LogCaptureFixture, logger: str, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= level]


def _internal_errors(metrics: PrometheusMetrics) -> float:
    return float(metrics.jobs.labels(pointsapp.QUEUE, "award", "internal_error")._value.get())


async def test_a_pg_queue_worker_pauses_once_on_a_read_only_database_and_resumes_when_writable(
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The fetch (an UPDATE) is refused: one WARNING naming the read-only database, no line per
    fetch, no attempt counted; the pool's read-only connections are dropped, and the jobs run
    within seconds of the database accepting writes again."""
    caplog.set_level(logging.DEBUG, logger="jobfence.worker")
    await conn.execute(pointsapp.SCHEMA_SQL)
    attempts: list[tuple[str, int]] = []
    app = _award_app(attempts)
    async with conn.transaction():
        for i in range(JOBS):
            await app.enqueue(conn, "award", {"account_id": 1}, job_id=f"j{i}")
    metrics = PrometheusMetrics()
    queue = PgQueue(pool, poll_interval_seconds=0.1)
    worker = Worker(app, pool, queue, concurrency=2, poll_seconds=0.1, metrics=metrics)
    loop = asyncio.get_running_loop()
    with read_only_switch(database_url, keep=[conn.info.backend_pid]) as switch:
        switch(True)
        await pool.check()  # the worker starts with its pool's sessions on the read-only server
        run = asyncio.create_task(worker.run(until="empty"))
        try:

            async def refused_for_a_while() -> bool:
                assert not run.done(), run
                probes = [m for m in _lines(caplog, "jobfence.worker", 0) if "read-only" in m]
                return len(probes) >= 4  # the outage line and a few probes, or fetch failures

            await wait_until(refused_for_a_while, timeout=20, message="the worker to be refused")
            switch(False)
            writable_at = loop.time()
            await wait_until(
                lambda: _done(run), timeout=30, message="the worker to finish once writable"
            )
            resumed = loop.time() - writable_at
        finally:
            worker.stop(now=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run, 30)
            await queue.close()
    stats = run.result()
    warnings = _lines(caplog, "jobfence.worker", logging.WARNING)
    refused = [m for m in warnings if "read-only" in m]
    assert len(refused) == 1, warnings
    assert refused[0].startswith("database is read-only (ReadOnlySqlTransaction: "), warnings
    assert "SQLSTATE 25006" in refused[0], warnings
    assert not [m for m in warnings if m.startswith("cannot fetch jobs")], warnings
    backs = [m for m in _lines(caplog, "jobfence.worker") if "writable again" in m]
    assert len(backs) == 1, _lines(caplog, "jobfence.worker")
    assert resumed < 6.0
    assert sorted(attempts) == sorted((f"j{i}", 1) for i in range(JOBS))
    assert stats.outcomes["succeeded"] == JOBS
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0
    assert await scalar(conn, "SELECT count(*) FROM public.awards") == JOBS


async def _done(task: asyncio.Task[Any]) -> bool:
    return task.done()


@pytest.fixture(params=["redis", "rabbitmq"])
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    async with on_broker(request, [pointsapp.QUEUE], prefix="jfro") as found:
        yield found


async def test_a_broker_worker_burns_no_attempt_and_writes_no_dead_letter_while_writes_are_refused(
    broker: tuple[str, str, str],
    database_url: str,
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each delivery's fence insert is refused for several lease periods: the jobs are given
    back uncounted, none is retried, dead-lettered or an InternalFailure, and each runs once, at
    attempt 1, once the database accepts writes (its read-only connections dropped)."""
    caplog.set_level(logging.DEBUG, logger="jobfence.worker")
    kind, url, name = broker
    await conn.execute(pointsapp.SCHEMA_SQL)
    target = parse_queue_url(url)
    await record_queue(conn, target.kind, target.location)
    attempts: list[tuple[str, int]] = []
    policy = RetryPolicy(
        max_retries=1, base_seconds=0.1, cap_seconds=0.2, rationale="attempts must not burn"
    )
    app = _award_app(attempts, retry=policy)
    direct = make_queue(kind, url, name)
    queue = make_queue(kind, url, name)
    metrics = PrometheusMetrics()
    worker = Worker(
        app, pool, queue, concurrency=2, poll_seconds=0.05, lease_seconds=2, metrics=metrics
    )
    loop = asyncio.get_running_loop()
    with read_only_switch(database_url, keep=[conn.info.backend_pid]) as switch:
        try:
            for i in range(JOBS):
                await direct.publish(app.message("award", {"account_id": 1}, job_id=f"j{i}"))
            switch(True)
            await pool.check()  # its pool's sessions on the read-only server
            run = asyncio.create_task(worker.run())
            began = loop.time()

            async def refused_for_three_leases() -> bool:
                assert not run.done(), run
                return loop.time() - began > 6.0 and (
                    any("read-only" in m for m in _lines(caplog, "jobfence.worker"))
                    or _internal_errors(metrics) > 0
                    or metrics.count("retried") > 0
                )

            await wait_until(refused_for_three_leases, timeout=30, message="refused writes")
            switch(False)

            async def applied_all() -> bool:
                return await scalar(conn, "SELECT count(*) FROM public.awards") == JOBS

            try:
                await wait_until(applied_all, timeout=20, message="every job applied")
            except AssertionError as exc:
                raise AssertionError(
                    f"{exc}: outcomes {dict(worker.stats.outcomes)}, attempts {attempts},"
                    f" dead letters"
                    f" {await scalar(conn, 'SELECT count(*) FROM core.dead_letters')}, worker"
                    f" WARNINGs {_lines(caplog, 'jobfence.worker', logging.WARNING)[:3]},"
                    f" harness {_lines(caplog, 'jobfence.harness', logging.WARNING)[:2]}"
                ) from None
            worker.stop()
            stats = await asyncio.wait_for(run, 30)
        finally:
            worker.stop(now=True)
            await queue.close()
            await direct.close()
    assert sorted(attempts) == sorted((f"j{i}", 1) for i in range(JOBS)), attempts
    assert await scalar(conn, "SELECT count(*) FROM core.dead_letters") == 0
    assert stats.outcomes["internal_error"] == 0
    assert metrics.count("retried") == 0
    warnings = _lines(caplog, "jobfence.worker", logging.WARNING)
    assert len([m for m in warnings if m.startswith("database is read-only (")]) == 1, warnings
    assert not _lines(caplog, "jobfence.harness", logging.ERROR)


@pytest.mark.parametrize("per_transaction", [1, 5])
@pytest.mark.parametrize("made_read_only", ["transaction", "session"])
@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_a_handler_that_makes_its_own_transaction_read_only_fails_as_a_transient_failure(
    pool: AsyncConnectionPool[Any],
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    *,
    flavour: str,
    made_read_only: str,
    per_transaction: int,
) -> None:
    """A 25006 raised after the transaction's fence insert succeeded is the handler's failure,
    not an outage: retried, then dead-lettered, and the job behind it runs. The handler made
    its transaction read-only itself (``SET TRANSACTION READ ONLY``), or its session
    (``SET default_transaction_read_only``, which the server then reports for the session, as
    it does for a standby). A session's read-only state cannot change inside a transaction, so
    the fence insert (its first write) is where a read-only server refuses it: an ``async def``
    or a ``def`` handler, and a server that reports nothing about it (before PostgreSQL 14),
    are judged alike. In a group (``jobs_per_transaction``) the group rolls back and its jobs
    run one transaction each, the same way."""
    await conn.execute(pointsapp.SCHEMA_SQL)
    app = App()
    policy = RetryPolicy(max_retries=1, base_seconds=0.01, cap_seconds=0.01, rationale="quick")
    options: dict[str, Any] = {"retry": policy, "jobs_per_transaction": per_transaction}
    statements = ["SET TRANSACTION READ ONLY"]
    if made_read_only == "session":
        statements = ["SET default_transaction_read_only = on", *statements]
    write = "INSERT INTO public.awards (job_id, account_id, points) VALUES (%s, 1, 1)"

    if flavour == "async":

        @app.consumer("award", queue=pointsapp.QUEUE, schema=Award, **options)
        async def award(payload: Award, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
            if job.job_id == "own":
                for statement in statements:
                    await tx.execute(statement)
            await tx.execute(write, (job.job_id,))

    else:

        @app.consumer("award", queue=pointsapp.QUEUE, schema=Award, **options)
        def award_sync(payload: Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
            if job.job_id == "own":
                for statement in statements:
                    tx.execute(statement)
            tx.execute(write, (job.job_id,))

    await app.enqueue(conn, "award", {"account_id": 1}, job_id="own")
    await app.enqueue(conn, "award", {"account_id": 1}, job_id="behind")
    metrics = PrometheusMetrics()
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    worker = Worker(app, pool, queue, concurrency=1, poll_seconds=0.05, metrics=metrics)
    try:
        await asyncio.wait_for(worker.run(until="empty"), 30)
    finally:
        await queue.close()
    assert await scalar(conn, "SELECT error_class FROM core.dead_letters") == (
        "psycopg.errors.ReadOnlySqlTransaction"
    )
    assert await scalar(conn, "SELECT string_agg(job_id, ',') FROM public.awards") == "behind"
    assert metrics.count("retried") == 1
    assert not [m for m in _lines(caplog, "jobfence.worker") if "read-only" in m]


async def test_the_outbox_relay_pauses_once_on_a_read_only_database_and_publishes_when_writable(
    database_url: str,
    redis_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="jobfence.outbox")
    target = parse_queue_url(redis_url)
    await conn.execute(pointsapp.SCHEMA_SQL)
    await record_queue(conn, target.kind, target.location)
    async with on_broker(_Param("redis", redis_url), [pointsapp.QUEUE], prefix="jfro") as found:
        kind, url, name = found
        queue = make_queue(kind, url, name)
        relay = OutboxRelay(database_url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
        task: asyncio.Task[Any] | None = None
        with read_only_switch(database_url, keep=[conn.info.backend_pid]) as switch:
            try:
                await pointsapp.enqueue_awards(database_url, [f"r{i}" for i in range(JOBS)])
                switch(True)
                task = asyncio.create_task(relay.run())

                async def refused_twice() -> bool:
                    assert task is not None and not task.done(), task
                    lines = _lines(caplog, "jobfence.outbox", 0)
                    refused = [m for m in lines if "read-only" in m or "database error" in m]
                    return len(refused) > 1  # the outage's line, then a reconnection refused

                await wait_until(refused_twice, timeout=20, message="the relay to be refused")
                switch(False)

                async def published() -> bool:
                    return (await queue.size([pointsapp.QUEUE])).total == JOBS

                await wait_until(published, timeout=20, message="the outbox published")
            finally:
                relay.stop()
                await conn.execute("SELECT pg_notify('jobfence_outbox', '')")
                if task is not None:
                    await asyncio.wait_for(task, 30)
                await queue.close()
    lines = _lines(caplog, "jobfence.outbox", logging.WARNING)
    assert not [m for m in lines if "database error" in m], lines
    went = [m for m in lines if m.startswith("outbox relay: database is read-only (")]
    assert len(went) == 1 and "SQLSTATE 25006" in went[0], lines
    assert any("database writable again after" in m for m in _lines(caplog, "jobfence.outbox"))


class _Param:
    """What ``on_broker`` reads from a fixture request."""

    def __init__(self, broker: str, url: str) -> None:
        self.param = broker
        self._url = url

    def getfixturevalue(self, name: str) -> str:
        return self._url


async def test_cleanup_on_a_read_only_database_names_it_read_only(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    with read_only_switch(database_url, keep=[conn.info.backend_pid]) as switch:
        switch(True)
        done = await asyncio.to_thread(run_jobfence, database_url, "cleanup")
    assert done.returncode == 1, done
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("jobfence: error: the database is read-only (ReadOnlySqlTransaction: ")
    ), done.stderr
    assert "SQLSTATE 25006" in done.stderr, done.stderr


async def test_an_api_replay_on_a_read_only_database_answers_503_and_works_once_writable(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    dead_letter_id = await insert_dead_letter(conn, job_id="ro-1")
    api_pool = await db.open_pool(database_url, max_size=4, lend_checked=True)
    try:
        async with running_api(api_pool) as api:
            with read_only_switch(database_url, keep=[conn.info.backend_pid]) as switch:
                switch(True)
                refused = await api.client.post(f"{PREFIX}/{dead_letter_id}/replay", headers=auth())
                assert refused.status_code == 503, refused.text
                assert "read-only" in refused.json()["detail"], refused.text
                assert refused.headers["Retry-After"] == "5"
                switch(False)

                async def replayed() -> bool:
                    response = await api.client.post(
                        f"{PREFIX}/{dead_letter_id}/replay", headers=auth()
                    )
                    assert response.status_code in (200, 503), response.text
                    return response.status_code == 200

                await wait_until(replayed, timeout=15, message="the replay once writable")
    finally:
        await api_pool.close()


async def test_a_producer_on_a_read_only_database_gets_the_read_only_error(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    app = _award_app([])
    with read_only_switch(database_url, keep=[conn.info.backend_pid]) as switch:
        switch(True)
        async with await psycopg.AsyncConnection.connect(database_url) as producer:
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                await app.enqueue(producer, "award", {"account_id": 1}, job_id="p1")


async def test_a_multi_host_url_with_target_session_attrs_read_write_refuses_a_read_only_server(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """jobfence passes libpq's ``target_session_attrs`` through: with ``read-write``, a server
    that is read-only is skipped (here every host is, so connecting fails, an outage, not a
    write error), and a writable one is used."""
    params = conninfo_to_dict(database_url)
    host, port = params.get("host", "127.0.0.1"), params.get("port", "5432")
    params.update(host=f"{host},{host}", port=f"{port},{port}", target_session_attrs="read-write")
    url = make_conninfo("", **params)
    assert db.validate_url(url) == url
    with read_only_switch(database_url, keep=[conn.info.backend_pid]) as switch:
        switch(True)
        with pytest.raises(DatabaseUnavailable, match="session is read-only"):
            await db.open_pool(url, max_size=1)
        switch(False)
        pool = await db.open_pool(url, max_size=1)
        try:
            async with pool.connection() as writable:
                await writable.execute("CREATE TABLE public.written (x int)")
        finally:
            await pool.close()


def test_is_connection_loss_counts_a_read_only_refusal_as_an_outage() -> None:
    assert db.is_connection_loss(
        psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"),
        None,
    )


pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
