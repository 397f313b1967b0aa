"""``begin_with`` and ``Tx``: BEGIN and the first statement in one round trip, then a normal
transaction; COMMIT, the next BEGIN and its first statement in one round trip.

The job path relies on them for every job, so each property a handler may depend on is checked
on a real server: rowcounts, results, the refusal of ``commit()``, savepoints, commit and
rollback, and which transaction an error belongs to when a COMMIT and a BEGIN travel together.
"""

from __future__ import annotations

import gettext
import logging
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import AsyncConnection
from psycopg.pq import DiagnosticField, TransactionStatus

from jobfence.harness import FENCE_HELD
from jobfence.pgtx import (
    CommitRefused,
    NextBeginFailed,
    Tx,
    begin_with,
    commit_checked_sync,
    commit_then_begin_sync,
    main_transaction_sync,
    refusal_reason,
    refused_by_check,
)
from jobfence.sync import FenceConnection
from support import scalar
from translated_server import unavailable

INSERT = "INSERT INTO t (id) VALUES (%(id)s) ON CONFLICT DO NOTHING RETURNING id"


@pytest.fixture
async def table(conn: AsyncConnection[Any]) -> AsyncConnection[Any]:
    await conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL DEFAULT 0)")
    await conn.execute("INSERT INTO t (id) VALUES (1), (2)")
    return conn


async def test_begin_with_sends_begin_and_the_first_statement_as_one_transaction(
    table: AsyncConnection[Any],
) -> None:
    async with begin_with(table, INSERT, {"id": 10}) as cur:
        assert await cur.fetchone() == (10,)
        assert table.info.transaction_status == TransactionStatus.INTRANS
        backend_xid = await scalar(
            table, "SELECT backend_xid FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        )
        assert backend_xid is not None, "the insert ran inside the open transaction"
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 10") == 1


async def test_statements_after_the_first_report_rowcount_and_results_as_usual(
    table: AsyncConnection[Any],
) -> None:
    async with begin_with(table, INSERT, {"id": 11}):
        cur = await table.execute("UPDATE t SET v = v + 1 WHERE id = ANY(%s)", ([1, 2],))
        assert cur.rowcount == 2
        cur = await table.execute("SELECT id FROM t ORDER BY id")
        assert await cur.fetchall() == [(1,), (2,), (11,)]
        assert table._pipeline is None, "the pipeline must not outlive the first statement"


async def test_commit_inside_is_refused_and_a_nested_transaction_is_a_savepoint(
    table: AsyncConnection[Any],
) -> None:
    async with begin_with(table, INSERT, {"id": 12}):
        with pytest.raises(psycopg.ProgrammingError, match="commit"):
            await table.commit()
        with pytest.raises(psycopg.ProgrammingError, match="rollback"):
            await table.rollback()
        with pytest.raises(ZeroDivisionError):
            async with table.transaction():
                await table.execute("UPDATE t SET v = 100 WHERE id = 1")
                raise ZeroDivisionError
        await table.execute("UPDATE t SET v = 5 WHERE id = 2")
    assert await scalar(table, "SELECT v FROM t WHERE id = 1") == 0, "the savepoint rolled back"
    assert await scalar(table, "SELECT v FROM t WHERE id = 2") == 5
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 12") == 1


async def test_an_exception_in_the_block_rolls_everything_back(
    table: AsyncConnection[Any],
) -> None:
    with pytest.raises(RuntimeError, match="handler failed"):
        async with begin_with(table, INSERT, {"id": 13}) as cur:
            assert await cur.fetchone() == (13,)
            await table.execute("UPDATE t SET v = 9 WHERE id = 1")
            raise RuntimeError("handler failed")
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 13") == 0
    assert await scalar(table, "SELECT v FROM t WHERE id = 1") == 0


async def test_a_failing_first_statement_raises_and_leaves_the_connection_usable(
    table: AsyncConnection[Any],
) -> None:
    with pytest.raises(psycopg.errors.UndefinedTable):
        async with begin_with(table, "INSERT INTO missing VALUES (%(id)s)", {"id": 1}):
            raise AssertionError("the block must not run")
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert table._pipeline is None
    assert await scalar(table, "SELECT count(*) FROM t") == 2


async def other_sees(database_url: str, query: str) -> Any:
    async with await AsyncConnection.connect(database_url, autocommit=True) as other:
        return await scalar(other, query)


async def test_commit_then_begin_commits_one_transaction_and_opens_the_next(
    table: AsyncConnection[Any], database_url: str
) -> None:
    first, cur = await Tx.begin(table, INSERT, {"id": 20})
    assert await cur.fetchone() == (20,)
    await table.execute("UPDATE t SET v = 1 WHERE id = 1")
    second, cur = await first.commit_then_begin(INSERT, {"id": 21})
    assert await cur.fetchone() == (21,)
    assert await other_sees(database_url, "SELECT count(*) FROM t WHERE id = 20") == 1
    assert await other_sees(database_url, "SELECT v FROM t WHERE id = 1") == 1
    assert await other_sees(database_url, "SELECT count(*) FROM t WHERE id = 21") == 0
    assert table.info.transaction_status == TransactionStatus.INTRANS

    # The chained transaction is an ordinary one: rowcounts, the refused commit(), savepoints.
    cur = await table.execute("UPDATE t SET v = v + 1 WHERE id = ANY(%s)", ([1, 2],))
    assert cur.rowcount == 2
    with pytest.raises(psycopg.ProgrammingError, match="commit"):
        await table.commit()
    with pytest.raises(ZeroDivisionError):
        async with table.transaction():
            await table.execute("UPDATE t SET v = 100 WHERE id = 2")
            raise ZeroDivisionError
    await second.commit()
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 21") == 1
    assert await scalar(table, "SELECT v FROM t WHERE id = 2") == 1, "the savepoint rolled back"


async def test_a_chained_transaction_rolls_back_alone(table: AsyncConnection[Any]) -> None:
    first, _ = await Tx.begin(table, INSERT, {"id": 30})
    second, _ = await first.commit_then_begin(INSERT, {"id": 31})
    await table.execute("UPDATE t SET v = 7 WHERE id = 1")
    assert not await second.rollback(RuntimeError("handler failed"))
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert await scalar(table, "SELECT array_agg(id ORDER BY id) FROM t") == [1, 2, 30]
    assert await scalar(table, "SELECT v FROM t WHERE id = 1") == 0


async def test_when_the_next_first_statement_fails_the_commit_stands(
    table: AsyncConnection[Any],
) -> None:
    first, _ = await Tx.begin(table, INSERT, {"id": 40})
    with pytest.raises(NextBeginFailed) as caught:
        await first.commit_then_begin("INSERT INTO missing VALUES (%(id)s)", {"id": 1})
    assert isinstance(caught.value.__cause__, psycopg.errors.UndefinedTable)
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert table._pipeline is None
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 40") == 1
    async with begin_with(table, INSERT, {"id": 41}):  # the connection goes on as usual
        pass
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 41") == 1


async def test_when_the_commit_fails_its_error_is_raised_and_nothing_is_begun(
    table: AsyncConnection[Any],
) -> None:
    # A deferred constraint is checked at COMMIT: the COMMIT itself fails.
    await table.execute(
        "CREATE TABLE child (parent int REFERENCES t (id) DEFERRABLE INITIALLY DEFERRED)"
    )
    first, _ = await Tx.begin(table, INSERT, {"id": 50})
    await table.execute("INSERT INTO child VALUES (999)")
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        await first.commit_then_begin(INSERT, {"id": 51})
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert table._pipeline is None
    assert await scalar(table, "SELECT count(*) FROM t WHERE id IN (50, 51)") == 0
    assert await scalar(table, "SELECT count(*) FROM child") == 0
    async with begin_with(table, INSERT, {"id": 52}):
        pass
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 52") == 1


@pytest.mark.parametrize("step", ["begin", "commit_then_begin", "commit"])
async def test_a_connection_lost_before_a_query_raises_its_error_and_leaves_nothing_committed(
    table: AsyncConnection[Any], database_url: str, caplog: pytest.LogCaptureFixture, step: str
) -> None:
    """The server ends the connection (a restart, pg_terminate_backend) while a transaction is
    open: the next query raises the connection's error, nothing of the transaction committed,
    and nothing else is logged (no ROLLBACK on the dead connection logged as ignored)."""
    async with await AsyncConnection.connect(database_url, autocommit=True) as victim:
        first = None
        if step != "begin":
            first, _ = await Tx.begin(victim, INSERT, {"id": 110})
            await victim.execute("UPDATE t SET v = 11 WHERE id = 1")
        await table.execute("SELECT pg_terminate_backend(%s)", (victim.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError):
            if first is None:
                await Tx.begin(victim, INSERT, {"id": 111})
            elif step == "commit":
                await first.commit(PASS)
            else:
                await first.commit_then_begin(INSERT, {"id": 111}, PASS)
        assert victim.info.transaction_status in (
            TransactionStatus.UNKNOWN,
            TransactionStatus.IDLE,
        )
    assert await other_sees(database_url, "SELECT count(*) FROM t WHERE id IN (110, 111)") == 0
    assert await other_sees(database_url, "SELECT v FROM t WHERE id = 1") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# -- a check sent ahead of the COMMIT, in the same round trip ----------------------------------
#
# The check fails by reading a setting named "jobfence: <reason>" (as fence_held does): the
# server skips the COMMIT, the transaction is rolled back, CommitRefused is raised. Each way the
# pipeline can fail is told apart: the check, the COMMIT itself, the next transaction's first
# statement.

REFUSE = b"SELECT CASE WHEN false THEN 'held' ELSE current_setting('jobfence: not this one') END"
PASS = b"SELECT CASE WHEN true THEN 'held' ELSE current_setting('jobfence: not this one') END"


async def test_a_failing_check_refuses_the_commit_and_nothing_commits(
    table: AsyncConnection[Any], database_url: str
) -> None:
    tx, _ = await Tx.begin(table, INSERT, {"id": 60})
    await table.execute("UPDATE t SET v = 6 WHERE id = 1")
    with pytest.raises(CommitRefused, match="not this one") as caught:
        await tx.commit(REFUSE)
    assert isinstance(caught.value.__cause__, psycopg.errors.UndefinedObject)
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert table._pipeline is None and table._num_transactions == 0
    assert await other_sees(database_url, "SELECT count(*) FROM t WHERE id = 60") == 0
    assert await other_sees(database_url, "SELECT v FROM t WHERE id = 1") == 0
    async with begin_with(table, INSERT, {"id": 61}):  # the connection goes on as usual
        pass
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 61") == 1


async def test_a_passing_check_commits_as_a_plain_commit(table: AsyncConnection[Any]) -> None:
    tx, _ = await Tx.begin(table, INSERT, {"id": 62})
    await tx.commit(PASS)
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 62") == 1


async def test_a_failing_check_before_a_chained_begin_commits_neither_and_is_not_next_begin_failed(
    table: AsyncConnection[Any], database_url: str
) -> None:
    first, _ = await Tx.begin(table, INSERT, {"id": 70})
    with pytest.raises(CommitRefused):
        await first.commit_then_begin(INSERT, {"id": 71}, REFUSE)
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert table._pipeline is None and table._num_transactions == 0
    assert await other_sees(database_url, "SELECT count(*) FROM t WHERE id IN (70, 71)") == 0
    async with begin_with(table, INSERT, {"id": 72}):
        pass
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 72") == 1


async def test_with_a_passing_check_a_failed_commit_and_a_failed_next_begin_stay_apart(
    table: AsyncConnection[Any],
) -> None:
    passing = PASS
    # The next transaction's first statement fails: this one committed.
    first, _ = await Tx.begin(table, INSERT, {"id": 80})
    with pytest.raises(NextBeginFailed):
        await first.commit_then_begin("INSERT INTO missing VALUES (%(id)s)", {"id": 1}, passing)
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 80") == 1
    # The COMMIT itself fails (a deferred constraint): its error, nothing committed or begun.
    await table.execute(
        "CREATE TABLE child (parent int REFERENCES t (id) DEFERRABLE INITIALLY DEFERRED)"
    )
    second, _ = await Tx.begin(table, INSERT, {"id": 81})
    await table.execute("INSERT INTO child VALUES (999)")
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        await second.commit_then_begin(INSERT, {"id": 82}, passing)
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert await scalar(table, "SELECT count(*) FROM t WHERE id IN (81, 82)") == 0
    third, _ = await Tx.begin(table, INSERT, {"id": 83})
    await table.execute("INSERT INTO child VALUES (999)")
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        await third.commit(passing)
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert await scalar(table, "SELECT count(*) FROM t WHERE id = 83") == 0


# A check that outlives a statement_timeout the handler set for its transaction: the check itself
# is cancelled (57014), so the COMMIT after it is skipped and nothing commits.
SLOW_CHECK = b"SELECT pg_sleep(0.3)::text"


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_a_check_cancelled_by_a_timeout_is_never_taken_for_a_committed_transaction(
    table: AsyncConnection[Any], database_url: str, flavour: str
) -> None:
    """The check fails with an error other than its refusal (a query cancel): the transaction
    did not commit, and the error says so, not NextBeginFailed (which would have the job
    counted as done and acked while nothing of it committed)."""
    if flavour == "async":
        first, _ = await Tx.begin(table, INSERT, {"id": 120})
        await table.execute("SET LOCAL statement_timeout = '50ms'")
        with pytest.raises(psycopg.errors.QueryCanceled):
            await first.commit_then_begin(INSERT, {"id": 121}, SLOW_CHECK)
        assert table.info.transaction_status == TransactionStatus.IDLE
        assert table._num_transactions == 0
    else:
        with FenceConnection.connect(database_url, autocommit=True) as conn:
            tx = main_transaction_sync(conn)
            tx.__enter__()
            conn.execute("INSERT INTO t (id) VALUES (120)")
            conn.execute("SET LOCAL statement_timeout = '50ms'")
            with pytest.raises(psycopg.errors.QueryCanceled):
                commit_then_begin_sync(conn, tx, SLOW_CHECK, INSERT, {"id": 121})
            assert conn.info.transaction_status == TransactionStatus.IDLE
            assert conn._num_transactions == 0
    assert await other_sees(database_url, "SELECT count(*) FROM t WHERE id IN (120, 121)") == 0


async def test_a_next_statement_cancelled_after_a_checked_commit_is_not_told_committed_either(
    table: AsyncConnection[Any], database_url: str
) -> None:
    """The same cancel (57014) could come from the check or from the next statement: after a
    check, such an error is raised as it is, never as NextBeginFailed. Here the COMMIT stood;
    the caller treats the outcome as unknown, and the fence tells on the next delivery."""
    await table.execute("SET statement_timeout = '50ms'")  # the session: the next one too
    first, _ = await Tx.begin(table, INSERT, {"id": 130})
    with pytest.raises(psycopg.errors.QueryCanceled):
        await first.commit_then_begin("SELECT pg_sleep(0.3)", {}, PASS)
    await table.execute("SET statement_timeout = 0")
    assert table.info.transaction_status == TransactionStatus.IDLE
    assert await other_sees(database_url, "SELECT count(*) FROM t WHERE id = 130") == 1


@pytest.mark.parametrize("failure", ["check", "commit", "none"])
async def test_the_sync_runner_sends_the_check_with_its_commit_and_tells_its_failures_apart(
    table: AsyncConnection[Any], database_url: str, failure: str
) -> None:
    await table.execute(
        "CREATE TABLE child (parent int REFERENCES t (id) DEFERRABLE INITIALLY DEFERRED)"
    )
    with FenceConnection.connect(database_url, autocommit=True) as conn:
        tx = main_transaction_sync(conn)
        tx.__enter__()
        conn.execute("INSERT INTO t (id) VALUES (90)")
        if failure == "commit":
            conn.execute("INSERT INTO child VALUES (999)")
        check = REFUSE if failure == "check" else PASS
        if failure == "check":
            with pytest.raises(CommitRefused):
                commit_checked_sync(conn, tx, check)
        elif failure == "commit":
            with pytest.raises(psycopg.errors.ForeignKeyViolation):
                commit_checked_sync(conn, tx, check)
        else:
            commit_checked_sync(conn, tx, check)
        assert conn.info.transaction_status == TransactionStatus.IDLE
        assert conn._pipeline is None and conn._num_transactions == 0
        assert conn.execute("SELECT 1").fetchone() == (1,)  # usable
    committed = await other_sees(database_url, "SELECT count(*) FROM t WHERE id = 90")
    assert committed == int(failure == "none")


async def test_the_first_error_of_a_chain_is_raised_every_time(
    table: AsyncConnection[Any],
) -> None:
    """The error raised is the failing check's or COMMIT's, never one of a statement the
    server skipped after it, which could read as a lost connection. Repeated (when it was a
    pipeline, about half the tries of a group's refused COMMIT raised ``PipelineAborted``)."""
    await table.execute(
        "CREATE TABLE child (parent int REFERENCES t (id) DEFERRABLE INITIALLY DEFERRED)"
    )
    for n in range(25):
        first, _ = await Tx.begin(table, INSERT, {"id": 1000 + n})
        with pytest.raises(CommitRefused):
            await first.commit_then_begin(INSERT, {"id": 2000 + n}, REFUSE)
        assert table.info.transaction_status == TransactionStatus.IDLE
        first, _ = await Tx.begin(table, INSERT, {"id": 3000 + n})
        await table.execute("INSERT INTO child VALUES (999)")
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            await first.commit_then_begin(INSERT, {"id": 4000 + n}, PASS)
        assert table.info.transaction_status == TransactionStatus.IDLE
        first, _ = await Tx.begin(table, INSERT, {"id": 5000 + n})
        await table.execute("UPDATE t SET v = v + 1 WHERE id = 1")
        with pytest.raises(CommitRefused):
            await first.commit(REFUSE)
        assert table.info.transaction_status == TransactionStatus.IDLE
    assert await scalar(table, "SELECT count(*) FROM t WHERE id >= 1000") == 0
    assert await scalar(table, "SELECT v FROM t WHERE id = 1") == 0


# -- the same chain on a sync connection (the sync runner's COMMIT with the next job's BEGIN) -


def sync_chain(
    database_url: str, failure: str, n: int = 0
) -> tuple[type[BaseException] | None, FenceConnection]:
    """One chained COMMIT + BEGIN on a sync connection, failing as ``failure`` says: "check"
    (refused), "commit" (a deferred constraint), "next" (the next first statement), "none".
    The exception class raised (None if none) and the connection, still open."""
    conn = FenceConnection.connect(database_url, autocommit=True)
    tx = main_transaction_sync(conn)
    tx.__enter__()
    conn.execute("INSERT INTO t (id) VALUES (%s)", (100 + n,))
    if failure == "commit":
        conn.execute("INSERT INTO child VALUES (999)")
    check = REFUSE if failure == "check" else PASS
    query = "INSERT INTO missing VALUES (%(id)s)" if failure == "next" else INSERT
    try:
        nxt, rows = commit_then_begin_sync(conn, tx, check, query, {"id": 200 + n})
    except (CommitRefused, NextBeginFailed, psycopg.errors.ForeignKeyViolation) as exc:
        assert conn.info.transaction_status == TransactionStatus.IDLE
        assert conn._pipeline is None and conn._num_transactions == 0
        return type(exc), conn
    assert rows == [(200 + n,)]
    assert conn.info.transaction_status == TransactionStatus.INTRANS
    conn.execute("UPDATE t SET v = v + 1 WHERE id = 1")
    nxt.__exit__(None, None, None)
    return None, conn


@pytest.mark.parametrize(
    ("failure", "raised", "committed"),
    [
        ("none", None, [1, 1]),
        ("next", NextBeginFailed, [1, 0]),
        ("commit", psycopg.errors.ForeignKeyViolation, [0, 0]),
        ("check", CommitRefused, [0, 0]),
    ],
)
async def test_the_sync_chain_commits_then_begins_and_tells_each_failure_apart(
    table: AsyncConnection[Any],
    database_url: str,
    failure: str,
    raised: type[BaseException] | None,
    committed: list[int],
) -> None:
    """A failed next statement after a COMMIT that stands is NextBeginFailed; a failed COMMIT
    raises its own error; a refused check is CommitRefused; in every case the connection is
    idle and usable. Repeated, since when psycopg reads each result depends on timing."""
    await table.execute(
        "CREATE TABLE child (parent int REFERENCES t (id) DEFERRABLE INITIALLY DEFERRED)"
    )
    for n in range(25):
        got, conn = sync_chain(database_url, failure, n)
        with conn:
            assert got is raised, n
            assert conn.execute("SELECT 1").fetchone() == (1,)  # usable
        first = await other_sees(database_url, f"SELECT count(*) FROM t WHERE id = {100 + n}")
        second = await other_sees(database_url, f"SELECT count(*) FROM t WHERE id = {200 + n}")
        assert [first, second] == committed, n
    bumped = await scalar(table, "SELECT v FROM t WHERE id = 1")
    assert bumped == (25 if failure == "none" else 0)


# The server words the check's error in its own language (lc_messages): a refusal is told apart
# by the setting's name, which no translation touches. tests/test_handler_contract.py runs a
# worker against a server speaking German; this covers every language the server ships.

UNRECOGNIZED = 'unrecognized configuration parameter "%s"'  # guc.c's message


def server_wordings() -> dict[str, str]:
    """``UNRECOGNIZED`` in English and as each of the machine's PostgreSQL message catalogues
    words it (one per language)."""
    wordings = {"en": UNRECOGNIZED}
    for catalogue in sorted(Path("/usr/share/locale").glob("*/LC_MESSAGES/postgres-*.mo")):
        with catalogue.open("rb") as f:
            wording = gettext.GNUTranslations(f).gettext(UNRECOGNIZED)
        wordings.setdefault(catalogue.parts[-3], wording)
    return wordings


def server_error(cls: type[psycopg.Error], message: str, sqlstate: str) -> psycopg.Error:
    """An error as psycopg builds it from the server's answer."""
    fields = {DiagnosticField.MESSAGE_PRIMARY: message.encode(), DiagnosticField.SQLSTATE: sqlstate}
    return cls(
        message, info={k: v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
    )


def test_a_refused_commit_is_recognised_in_every_language_the_server_speaks() -> None:
    found = re.search(r"'jobfence: ([^']+)'", FENCE_HELD.decode())
    assert found is not None, "fence_held names its reason"
    reason = found.group(1)
    wordings = server_wordings()
    if len(wordings) < 10:  # Debian's postgresql-15 ships a dozen
        unavailable(f"only {sorted(wordings)} of PostgreSQL's message catalogues are here")
    for language, wording in wordings.items():
        refused = server_error(
            psycopg.errors.UndefinedObject, wording % f"jobfence: {reason}", "42704"
        )
        assert refused_by_check(refused), (language, str(refused))
        assert refusal_reason(refused) == reason, language
        other = server_error(psycopg.errors.UndefinedObject, wording % "app.tenant", "42704")
        assert not refused_by_check(other), (language, str(other))
    # The words alone are not a refusal: an error of another kind quoting them is not.
    quoted = server_error(psycopg.errors.RaiseException, f"jobfence: {reason}", "P0001")
    assert not refused_by_check(quoted)
