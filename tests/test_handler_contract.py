"""jobfence ends the work transaction, never the handler: a call that would end it is refused,
and once one was refused the job fails as ``TransactionMisuse`` whatever the handler did with
the error. Each handler flavour here swallows each refused call: nothing it did is applied (the
transaction rolls back, fence included) and the job is dead-lettered at once. Django's flavour
runs under ``manage.py jobfence_worker`` in tests/test_django.py."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

import points_orm
import pointsapp
from jobfence import (
    App,
    ConfigError,
    JobMeta,
    PrometheusMetrics,
    TransactionMisuse,
    db,
    get_dead_letter,
)
from jobfence.contrib.sqlalchemy import async_session_for, session_for
from jobfence.guard import retire, retired
from jobfence.schema import migrate
from support import with_dbname
from test_acceptance_harness import awards, balance, dead_letter_ids, fences, queued, run_worker
from translated_server import german_server

CONSUMER = "award_points"
MISUSE = "jobfence.TransactionMisuse"


def app_with(handler: Any, **options: Any) -> App:
    app = App()
    app.consumer(CONSUMER, queue=pointsapp.QUEUE, schema=pointsapp.Award, **options)(handler)
    return app


async def assert_dead_lettered_with_nothing_applied(
    points: AsyncConnection[Any], job_id: str, what: str
) -> None:
    assert await awards(points, job_id) == 0
    assert await fences(points, job_id) == 0
    [dl_id] = await dead_letter_ids(points, job_id)
    dl = await get_dead_letter(points, dl_id)
    assert dl.attempts == 1
    assert dl.error_class == MISUSE
    assert dl.last_error.startswith(
        f"{MISUSE}: the fence transaction is committed by jobfence, with the handler's work and"
        f" its fence together; do not call {what}()"
    ), dl.last_error


async def run_one(
    app: App, pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], job_id: str
) -> dict[str, int]:
    await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id=job_id)
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert await queued(points) == 0
    return dict(stats.outcomes)


# -- async def handlers: the psycopg AsyncConnection ---------------------------------------------

ASYNC_CALLS: dict[str, Callable[[AsyncConnection[Any]], Awaitable[object]]] = {
    "commit": lambda tx: tx.commit(),
    "rollback": lambda tx: tx.rollback(),
    "close": lambda tx: tx.close(),
    "set_autocommit": lambda tx: tx.set_autocommit(False),
}


@pytest.mark.parametrize("what", sorted(ASYNC_CALLS))
async def test_an_async_handler_that_swallows_a_refused_call_is_dead_lettered_with_nothing_applied(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], what: str
) -> None:
    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        with contextlib.suppress(TransactionMisuse):
            await ASYNC_CALLS[what](tx)
        await tx.execute("SELECT 1")  # the connection is still the job's, and usable

    assert await run_one(app_with(award), pool, points, f"a-{what}") == {"dead_lettered": 1}
    await assert_dead_lettered_with_nothing_applied(points, f"a-{what}", what)
    assert await balance(points, 1) == 0


async def test_an_async_handler_that_raises_another_error_after_a_refusal_fails_as_misuse(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    """Not retried as the transient error it raised: the refusal decides."""

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        try:
            await tx.rollback()
        except TransactionMisuse as exc:
            raise pointsapp.Flaky("try again later") from exc

    assert await run_one(app_with(award), pool, points, "a-reraise") == {"dead_lettered": 1}
    await assert_dead_lettered_with_nothing_applied(points, "a-reraise", "rollback")


@pytest.mark.parametrize("statement", ["COMMIT", "ROLLBACK"])
async def test_an_async_handler_ending_its_transaction_with_sql_is_dead_lettered(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], statement: str
) -> None:
    """A statement cannot be stopped before it runs: jobfence finds the transaction ended when
    the handler returns. After a COMMIT the work committed with the fence (a replay is a
    duplicate); after a ROLLBACK both rolled back."""

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        await tx.execute(statement)

    job_id = f"a-sql-{statement.lower()}"
    assert await run_one(app_with(award), pool, points, job_id) == {"dead_lettered": 1}
    committed = int(statement == "COMMIT")
    assert await awards(points, job_id) == committed
    assert await fences(points, job_id) == committed
    [dl_id] = await dead_letter_ids(points, job_id)
    dl = await get_dead_letter(points, dl_id)
    assert (dl.attempts, dl.error_class) == (1, MISUSE)
    assert "the handler ended the fence transaction itself" in dl.last_error


# -- def handlers: the sync psycopg Connection ----------------------------------------------------


def _set_autocommit_attribute(tx: psycopg.Connection[Any]) -> None:
    tx.autocommit = False


SYNC_CALLS: dict[str, Callable[[psycopg.Connection[Any]], object]] = {
    "commit": lambda tx: tx.commit(),
    "rollback": lambda tx: tx.rollback(),
    "close": lambda tx: tx.close(),
    "set_autocommit": lambda tx: tx.set_autocommit(False),
    "autocommit": _set_autocommit_attribute,
}


@pytest.mark.parametrize("how", sorted(SYNC_CALLS))
async def test_a_sync_handler_that_swallows_a_refused_call_is_dead_lettered_with_nothing_applied(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], how: str
) -> None:
    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        pointsapp.apply_award_sync(payload, job, tx)
        with contextlib.suppress(TransactionMisuse):
            SYNC_CALLS[how](tx)
        tx.execute("SELECT 1")

    what = "set_autocommit" if how == "autocommit" else how
    assert await run_one(app_with(award), pool, points, f"s-{how}") == {"dead_lettered": 1}
    await assert_dead_lettered_with_nothing_applied(points, f"s-{how}", what)
    assert await balance(points, 1) == 0


# -- SQLAlchemy: sync and async sessions ----------------------------------------------------------

SESSION_CALLS: dict[str, tuple[str, Callable[[Any], object]]] = {
    "session.commit": ("commit", lambda session: session.commit()),
    "session.rollback": ("rollback", lambda session: session.rollback()),
    "session.connection().commit": ("commit", lambda session: session.connection().commit()),
    "session.connection().rollback": (
        "rollback",
        lambda session: session.connection().rollback(),
    ),
    "session.close": ("close", lambda session: session.close()),
    "session.reset": ("reset", lambda session: session.reset()),
    "session.connection().close": ("close", lambda session: session.connection().close()),
}


@pytest.mark.parametrize("how", sorted(SESSION_CALLS))
async def test_a_sqlalchemy_session_swallowing_a_refused_call_is_dead_lettered_unapplied(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], how: str
) -> None:
    what, call = SESSION_CALLS[how]

    def award(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        with session_for(tx) as session:
            session.add(points_orm.AwardRow(job_id=job.job_id, account_id=1, points=2))
            session.flush()
            with contextlib.suppress(TransactionMisuse):
                call(session)

    assert await run_one(app_with(award), pool, points, f"orm-{how}") == {"dead_lettered": 1}
    await assert_dead_lettered_with_nothing_applied(points, f"orm-{how}", what)


ASYNC_SESSION_CALLS: dict[str, tuple[str, Callable[[Any], Awaitable[object]]]] = {
    "session.commit": ("commit", lambda session: session.commit()),
    "session.rollback": ("rollback", lambda session: session.rollback()),
}


async def _connection_commit(session: Any) -> None:
    await (await session.connection()).commit()


async def _connection_rollback(session: Any) -> None:
    await (await session.connection()).rollback()


async def _connection_close(session: Any) -> None:
    await (await session.connection()).close()


ASYNC_SESSION_CALLS["session.connection().commit"] = ("commit", _connection_commit)
ASYNC_SESSION_CALLS["session.connection().rollback"] = ("rollback", _connection_rollback)
ASYNC_SESSION_CALLS["session.close"] = ("close", lambda session: session.close())
ASYNC_SESSION_CALLS["session.connection().close"] = ("close", _connection_close)


@pytest.mark.parametrize("how", sorted(ASYNC_SESSION_CALLS))
async def test_an_async_sqlalchemy_session_swallowing_a_refused_call_is_dead_lettered_unapplied(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], how: str
) -> None:
    what, call = ASYNC_SESSION_CALLS[how]

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        async with async_session_for(tx) as session:
            session.add(points_orm.AwardRow(job_id=job.job_id, account_id=1, points=2))
            await session.flush()
            with contextlib.suppress(TransactionMisuse):
                await call(session)

    assert await run_one(app_with(award), pool, points, f"aorm-{how}") == {"dead_lettered": 1}
    await assert_dead_lettered_with_nothing_applied(points, f"aorm-{how}", what)


# -- group commit -----------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_group_commit_a_job_swallowing_a_refused_call_is_dead_lettered_others_commit(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    """The refusal rolls the group back; each job then runs alone: the misusing one is
    dead-lettered at once with nothing applied, the others succeed once."""

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        if job.job_id == "g-bad":
            with contextlib.suppress(TransactionMisuse):
                await tx.rollback()

    def award_sync(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        pointsapp.apply_award_sync(payload, job, tx)
        if job.job_id == "g-bad":
            with contextlib.suppress(TransactionMisuse):
                tx.rollback()

    app = app_with(award if flavour == "async" else award_sync, jobs_per_transaction=5)
    ids = ["g-0", "g-1", "g-bad", "g-2", "g-3"]
    for job_id in ids:
        await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id=job_id)
    stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=5)

    assert dict(stats.outcomes) == {"succeeded": 4, "dead_lettered": 1}
    for job_id in ("g-0", "g-1", "g-2", "g-3"):
        assert await awards(points, job_id) == 1
        assert await fences(points, job_id) == 1
    await assert_dead_lettered_with_nothing_applied(points, "g-bad", "rollback")
    assert await balance(points, 1) == 8


# -- a handler that ends the fence transaction and begins another with SQL --------------------
#
# A statement cannot be refused before it runs, and a new BEGIN leaves the connection "in
# transaction" again: what jobfence checks at the commit is that the transaction it commits
# holds the job's fence. The same job is delivered twice (a redelivery): before that check,
# both deliveries ran the work after the BEGIN, committed and counted as succeeded.

RESTARTS = {"rollback-begin": ("ROLLBACK", "BEGIN"), "commit-begin": ("COMMIT", "BEGIN")}


def restarting_handler(flavour: str, statements: tuple[str, ...]) -> Any:
    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        for statement in statements:
            await tx.execute(statement)
        await pointsapp.apply_award(payload, job, tx)

    def award_sync(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        for statement in statements:
            tx.execute(statement)
        pointsapp.apply_award_sync(payload, job, tx)

    return award if flavour.startswith("async") else award_sync


@pytest.mark.parametrize("restart", sorted(RESTARTS))
@pytest.mark.parametrize("flavour", ["async", "sync", "async-group", "sync-group"])
async def test_a_handler_that_ends_its_transaction_and_begins_another_applies_nothing_twice(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str, restart: str
) -> None:
    """Each delivery fails as TransactionMisuse: what ran after the BEGIN rolls back, the job is
    dead-lettered once, and the balance moves by nothing, however many times it comes."""
    group = {"jobs_per_transaction": 5} if flavour.endswith("group") else {}
    app = app_with(restarting_handler(flavour, RESTARTS[restart]), **group)
    job_id = f"restart-{flavour}-{restart}"
    for _ in range(2):  # the job and its redelivery, fetched in one batch
        await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id=job_id)
    stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=5)

    assert "succeeded" not in stats.outcomes, dict(stats.outcomes)
    assert await queued(points) == 0, stats
    assert await awards(points, job_id) == 0
    assert await balance(points, 1) == 0
    # After a ROLLBACK nothing committed; after a COMMIT the fence committed (with no work).
    assert await fences(points, job_id) == int(restart == "commit-begin")
    [dl_id] = await dead_letter_ids(points, job_id)
    dl = await get_dead_letter(points, dl_id)
    assert (dl.attempts, dl.error_class) == (1, MISUSE)
    if flavour.endswith("group") and restart == "commit-begin":
        # The group's fence committed with the COMMIT: run alone, the job is found fenced and
        # dead-lettered for review (the redelivery in the same group is a duplicate).
        assert dict(stats.outcomes) == {"dead_lettered": 1, "duplicate": 1}
        assert "committed the group's transaction" in dl.last_error, dl.last_error
        return
    assert "the handler ended the fence transaction itself" in dl.last_error, dl.last_error


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_a_job_after_one_that_began_another_transaction_runs_once(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    """The next job waiting in the batch (whose BEGIN and fence would go with the commit) is not
    lost or applied twice when the commit before it is refused."""
    await chain_after_a_restarting_handler(pool, points, flavour)


@pytest.fixture(scope="module")
def german_server_url() -> Iterator[str]:
    with german_server() as url:
        yield url


@pytest.fixture
def german_url(german_server_url: str, request: pytest.FixtureRequest) -> str:
    """A fresh database on the German-speaking server, for this test alone."""
    name = f"jobfence_de_{request.node.callspec.id}"
    with psycopg.connect(german_server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return with_dbname(german_server_url, name)


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_on_a_server_speaking_german_a_handler_that_began_another_transaction_is_caught(
    german_url: str, flavour: str
) -> None:
    """A server whose lc_messages is German words the check's error in German. Before, jobfence
    looked for its English wording: on the chained path the refused COMMIT read as "committed,
    the next BEGIN failed", so the job whose handler ran ROLLBACK and BEGIN was acked as
    succeeded with nothing applied and no dead letter, on every such server."""
    async with await AsyncConnection.connect(german_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UndefinedObject, match="unbekannter"):
            await conn.execute("SELECT pg_catalog.current_setting('jobfence: spoken')")
        await migrate(conn)
        await conn.execute(pointsapp.SCHEMA_SQL)
        pool = await db.open_pool(german_url, min_size=1, max_size=6)
        try:
            await chain_after_a_restarting_handler(pool, conn, flavour)
        finally:
            await pool.close()


async def chain_after_a_restarting_handler(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], flavour: str
) -> None:
    """A job whose handler sends ROLLBACK and BEGIN, delivered twice, between good jobs in one
    batch: it is dead-lettered once with nothing applied; the good jobs apply once each."""
    bad = restarting_handler(flavour, RESTARTS["rollback-begin"])

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        if job.job_id == "chain-bad":
            await bad(payload, job, tx)
        else:
            await pointsapp.apply_award(payload, job, tx)

    def award_sync(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        if job.job_id == "chain-bad":
            bad(payload, job, tx)
        else:
            pointsapp.apply_award_sync(payload, job, tx)

    app = app_with(award if flavour == "async" else award_sync)
    for job_id in ("chain-bad", "chain-good", "chain-bad", "chain-good-2"):
        await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id=job_id)
    stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=5)

    assert stats.outcomes["succeeded"] == 2, dict(stats.outcomes)
    assert await awards(points, "chain-bad") == 0
    assert await awards(points, "chain-good") == 1
    assert await awards(points, "chain-good-2") == 1
    assert await balance(points, 1) == 4
    [dl_id] = await dead_letter_ids(points, "chain-bad")
    assert (await get_dead_letter(points, dl_id)).error_class == MISUSE


@pytest.mark.parametrize(
    "statements", [("COMMIT",), ("COMMIT", "BEGIN")], ids=["commit", "commit-begin"]
)
@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_group_commit_a_handler_committing_the_group_leaves_no_job_unseen(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    flavour: str,
    statements: tuple[str, ...],
) -> None:
    """A handler in a group sends COMMIT: every fence of the group commits with the work done so
    far, and the jobs after it in the group do not run in it. Before, the group rolled back what was
    left, each job then ran alone, found its fence and was skipped as a duplicate: the misuse
    and the work never done vanished. Now each job of the group whose fence that COMMIT
    committed is dead-lettered as TransactionMisuse, for review; nothing is applied twice."""
    bad = restarting_handler(flavour, statements)

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        if job.job_id == "gc-bad":
            await bad(payload, job, tx)
        else:
            await pointsapp.apply_award(payload, job, tx)

    def award_sync(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        if job.job_id == "gc-bad":
            bad(payload, job, tx)
        else:
            pointsapp.apply_award_sync(payload, job, tx)

    app = app_with(award if flavour == "async" else award_sync, jobs_per_transaction=5)
    ids = ["gc-0", "gc-1", "gc-bad", "gc-2", "gc-3"]
    for job_id in ids:
        await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id=job_id)
    stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=5)

    assert dict(stats.outcomes) == {"dead_lettered": 5}, dict(stats.outcomes)
    for job_id in ids:
        assert await fences(points, job_id) == 1, job_id
        [dl_id] = await dead_letter_ids(points, job_id)
        dl = await get_dead_letter(points, dl_id)
        assert (dl.attempts, dl.error_class) == (1, MISUSE), job_id
        assert "committed the group's transaction" in dl.last_error, dl.last_error
    # Applied at most once: the two jobs before the COMMIT, and the misusing one's own write
    # when it came after the BEGIN was rolled back.
    assert await awards(points) == 2 + int(statements == ("COMMIT",))
    assert await balance(points, 1) == 2 * (2 + int(statements == ("COMMIT",)))


async def test_a_handler_that_resets_every_setting_fails_as_misuse_with_nothing_applied(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    """RESET ALL also clears the transaction's mark that it holds the fence (fence_held): the
    check cannot tell it from a new transaction, so the job fails safe, nothing applied."""
    app = app_with(restarting_handler("async", ("RESET ALL",)))
    assert await run_one(app, pool, points, "reset-all") == {"dead_lettered": 1}
    assert await awards(points, "reset-all") == 0
    assert await fences(points, "reset-all") == 0
    [dl_id] = await dead_letter_ids(points, "reset-all")
    dl = await get_dead_letter(points, dl_id)
    assert (dl.attempts, dl.error_class) == (1, MISUSE)


# -- a setting a handler changes for the whole session ------------------------------------------
#
# A plain SET (without LOCAL) outlives its transaction: on a pooled connection it would apply to
# every later job there. A handler that turns on default_transaction_read_only would fail every
# job after it on its connection. The settings the server reports to the client are compared,
# once the job has committed, with their values when the connection was first lent.

SESSION_SETTER = "session-setter"


def session_recorder(flavour: str, statement: str, seen: list[tuple[str, int, str]]) -> Any:
    """A handler that applies the award and records (job_id, backend pid, TimeZone); for the
    job SESSION_SETTER (or every job, when ``statement`` starts with SET LOCAL) it first runs
    ``statement``."""

    def applies_to(job: JobMeta) -> bool:
        return job.job_id == SESSION_SETTER or statement.startswith("SET LOCAL")

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        if applies_to(job):
            await tx.execute(statement)
        cur = await tx.execute("SELECT pg_backend_pid(), current_setting('TimeZone')")
        pid, zone = (await cur.fetchone()) or (0, "")
        seen.append((job.job_id, pid, zone))
        await pointsapp.apply_award(payload, job, tx)

    def award_sync(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
        if applies_to(job):
            tx.execute(statement)
        pid, zone = tx.execute(
            "SELECT pg_backend_pid(), current_setting('TimeZone')"
        ).fetchone() or (
            0,
            "",
        )
        seen.append((job.job_id, pid, zone))
        pointsapp.apply_award_sync(payload, job, tx)

    return award if flavour == "async" else award_sync


@pytest.mark.parametrize("per_transaction", [1, 5])
@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_a_setting_a_handler_changes_for_its_session_does_not_reach_the_jobs_after_it(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    flavour: str,
    per_transaction: int,
) -> None:
    """A handler turns on default_transaction_read_only and sets the time zone for its
    session: its job commits; its connection is closed and replaced, with one WARNING naming
    the consumer and the settings (never their values); the jobs after it run with the
    settings as they were, each applied once."""
    seen: list[tuple[str, int, str]] = []
    statement = "SET default_transaction_read_only = on; SET TimeZone = 'Pacific/Chatham'"
    app = app_with(session_recorder(flavour, statement, seen), jobs_per_transaction=per_transaction)
    job_ids = [f"before-{n}" for n in range(3)] + [SESSION_SETTER]
    job_ids += [f"after-{n}" for n in range(6)]
    for job_id in job_ids:
        await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id=job_id)
    with caplog.at_level("WARNING"):
        stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=20)
    assert not [r for r in caplog.records if "went away" in r.getMessage()], "not an outage"

    assert stats.outcomes == {"succeeded": len(job_ids)}, dict(stats.outcomes)
    for job_id in job_ids:
        assert await awards(points, job_id) == 1, job_id
    assert await balance(points, 1) == 2 * len(job_ids)
    assert await queued(points) == 0
    zones = {job_id: zone for job_id, _pid, zone in seen}
    assert zones[SESSION_SETTER] == "Pacific/Chatham"
    # A group is one transaction: the jobs after the setter in its group share its session.
    later = job_ids[job_ids.index(SESSION_SETTER) + per_transaction :]
    assert {zones[job_id] for job_id in ["before-0", *later]} == {zones["before-0"]}
    assert zones["before-0"] != "Pacific/Chatham"
    pids = {job_id: pid for job_id, pid, _zone in seen}
    assert pids["after-5"] != pids[SESSION_SETTER], "the connection was replaced"
    warnings = [r.getMessage() for r in caplog.records if r.name == "jobfence.harness"]
    assert len(warnings) == 1, warnings
    which = (
        f"job {SESSION_SETTER}: the handler"
        if per_transaction == 1
        else "a group of 5 jobs from before-0: a handler"
    )
    assert warnings[0].startswith(
        f"{which} of consumer {CONSUMER} changed default_transaction_read_only, TimeZone for"
        " the whole session (a SET without LOCAL)"
    ), warnings[0]
    assert "Chatham" not in warnings[0]


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_a_set_local_in_every_handler_keeps_the_connection(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    flavour: str,
) -> None:
    """SET LOCAL ends with its transaction: no warning, and the jobs keep one connection."""
    seen: list[tuple[str, int, str]] = []
    app = app_with(session_recorder(flavour, "SET LOCAL TimeZone = 'Pacific/Chatham'", seen))
    job_ids = [f"local-{n}" for n in range(6)]
    for job_id in job_ids:
        await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id=job_id)
    with caplog.at_level("WARNING"):
        stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=20)
    assert not [r for r in caplog.records if "went away" in r.getMessage()], "not an outage"

    assert stats.outcomes == {"succeeded": 6}
    assert {zone for _job, _pid, zone in seen} == {"Pacific/Chatham"}
    assert len({pid for _job, pid, _zone in seen}) == 1
    assert [r.getMessage() for r in caplog.records if r.name == "jobfence.harness"] == []


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_a_session_setting_changed_while_a_rolled_back_group_runs_alone_is_caught(
    pool: AsyncConnectionPool[Any],
    points: AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    flavour: str,
) -> None:
    """A group rolls back (one of its jobs fails) and its jobs run one transaction each; the
    setter among them gets its connection replaced there too, and the rest of the group runs
    on other connections with the settings as they were."""
    seen: list[tuple[str, int, str]] = []
    statement = "SET default_transaction_read_only = on; SET TimeZone = 'Pacific/Chatham'"
    app = app_with(session_recorder(flavour, statement, seen), jobs_per_transaction=5)
    job_ids = ["before-0", SESSION_SETTER, "fails", "after-0", "after-1", "after-2", "after-3"]
    for job_id in job_ids:
        mode = "transient" if job_id == "fails" else "ok"
        await app.enqueue(
            points, CONSUMER, {"account_id": 1, "points": 2, "mode": mode}, job_id=job_id
        )
    with caplog.at_level("WARNING"):
        stats = await run_worker(app, pool, PrometheusMetrics(), concurrency=1, batch_size=20)
    assert not [r for r in caplog.records if "went away" in r.getMessage()], "not an outage"

    assert stats.outcomes == {"succeeded": 6, "retried": 1}, dict(stats.outcomes)
    for job_id in job_ids:
        assert await awards(points, job_id) == (0 if job_id == "fails" else 1), job_id
    zones = {job_id: zone for job_id, _pid, zone in seen}
    baseline = zones["before-0"]
    assert baseline != "Pacific/Chatham"
    assert {zones[f"after-{n}"] for n in range(4)} == {baseline}
    warnings = [r.getMessage() for r in caplog.records if r.name == "jobfence.harness"]
    assert [w for w in warnings if "for the whole session" in w] == [
        w for w in warnings if w.startswith(f"job {SESSION_SETTER}: the handler")
    ]
    assert len([w for w in warnings if "for the whole session" in w]) == 1, warnings


async def test_a_retired_connection_is_never_lent_again(database_url: str) -> None:
    """What a handler's session change does to its connection: a pool closes it when it comes
    back and lends a new one; a connection no pool opened is closed at once."""
    async with AsyncConnectionPool(database_url, min_size=1, max_size=1, open=False) as one:
        async with one.connection() as conn:
            first = conn.info.backend_pid
            retire(conn)
            assert retired(conn) and not conn.closed
        async with one.connection() as conn:
            assert conn.info.backend_pid != first
            assert not retired(conn)
    async with await AsyncConnection.connect(database_url) as plain:
        retire(plain)
        assert plain.closed


# -- what a handler is and returns: its work runs, or the job fails ------------------------------


def _yields_sync(payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]) -> Any:
    pointsapp.apply_award_sync(payload, job, tx)
    yield


async def _yields_async(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> Any:
    await pointsapp.apply_award(payload, job, tx)
    yield


class _YieldingCall:
    def __call__(self, payload: pointsapp.Award, job: JobMeta, tx: Any) -> Any:
        yield


@pytest.mark.parametrize(
    "handler",
    [_yields_sync, _yields_async, _YieldingCall()],
    ids=["def-with-yield", "async-def-with-yield", "object-whose-call-yields"],
)
def test_a_generator_function_is_refused_as_a_handler_when_registered(handler: Any) -> None:
    """Calling a generator function runs none of its body: as a handler, every job would be
    fenced and acked with nothing applied. It is refused where it is registered."""
    with pytest.raises(ConfigError) as refused:
        app_with(handler)
    assert str(refused.value) == (
        f"consumer {CONSUMER!r}: the handler is a generator function (it yields): calling it"
        " runs none of its body, so no job would be applied; make it a plain `def` or an"
        " `async def` without yield"
    )


async def _returns_unawaited_execute(
    payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]
) -> Any:
    return tx.execute(
        "INSERT INTO awards (job_id, account_id, points) VALUES (%s, %s, %s)",
        (job.job_id, payload.account_id, payload.points),
    )


async def _returns_unawaited_helper(
    payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]
) -> Any:
    return pointsapp.apply_award(payload, job, tx)


def _returns_a_generator(
    payload: pointsapp.Award, job: JobMeta, tx: psycopg.Connection[Any]
) -> Any:
    return (pointsapp.apply_award_sync(payload, job, tx) for _ in range(1))


@pytest.mark.parametrize(
    ("handler", "what"),
    [
        (_returns_unawaited_execute, "an awaitable it did not await: `await` it"),
        (_returns_unawaited_helper, "an awaitable it did not await: `await` it"),
        (_returns_a_generator, "a generator, whose body never ran: run the work in the handler"),
    ],
    ids=["async-returns-tx-execute", "async-returns-a-coroutine", "def-returns-a-generator"],
)
async def test_a_handler_returning_work_it_did_not_run_fails_with_nothing_applied(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any], handler: Any, what: str
) -> None:
    """A handler that returns its work instead of running it (``return tx.execute(...)``
    without ``await``) would have the job fenced and acked with nothing applied: the money
    lost without a trace. The job fails instead (retried, then dead-lettered, as any bug),
    with nothing applied and no fence."""
    app = app_with(handler)
    await app.enqueue(points, CONSUMER, {"account_id": 1, "points": 2}, job_id="unrun-1")
    stats = await run_worker(app, pool, PrometheusMetrics())
    assert stats.outcomes == {"retried": 1}
    assert await awards(points, "unrun-1") == 0
    assert await fences(points, "unrun-1") == 0
    cur = await points.execute("SELECT last_error FROM jobfence_queue.messages")
    [(last_error,)] = await cur.fetchall()
    assert last_error.startswith(
        f"TypeError: the handler of consumer {CONSUMER!r} returned {what}"
    ), last_error
