"""No output carries a payload value or a secret, where a library jobfence calls would write one.

- A payload that is a pydantic model whose field was given a value of another type after
  validation (``award.points = "..."``, no ``validate_assignment``): pydantic's serializer warns
  on stderr quoting the value. ``App.enqueue``/``App.message`` refuse it (they validate what
  they publish) and no producer lets pydantic print it.
- A URL typed on the command line in the wrong place: argparse's usage error quotes it; the
  line shows it with its secrets as ``***``, as every other error line does.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel, ValidationError

from jobfence import App, Producer
from support import scalar

TESTS_DIR = Path(__file__).parent
CARD = "4111-1111-1111-1111"
SECRET = "Zq9-s3cr3t-Pw"


class Charge(BaseModel):
    account_id: int
    amount_cents: int


class Order(BaseModel):
    order_id: int
    charge: Charge


def charge_app() -> App:
    app = App()

    @app.consumer("charge", queue="billing", schema=Charge)
    async def charge(payload: Charge, job: Any, tx: Any) -> None:
        """Never runs here."""

    @app.consumer("order", queue="billing", schema=Order)
    async def order(payload: Order, job: Any, tx: Any) -> None:
        """Never runs here."""

    return app


def tampered_charge() -> Charge:
    """A valid Charge whose field was then given a card number (no validate_assignment)."""
    charge = Charge(account_id=7, amount_cents=500)
    charge.amount_cents = CARD  # type: ignore[assignment]
    return charge


# ------------------------------------------------------------------------------------------
# A payload value in pydantic's serializer warnings
# ------------------------------------------------------------------------------------------

PRODUCER_SCRIPT = textwrap.dedent(
    """
    import sys
    from pydantic import ValidationError
    from jobfence import Producer
    from test_output_leaks import charge_app, tampered_charge

    app = charge_app()
    for consumer, payload in [
        ("charge", tampered_charge()),
        ("order", {"order_id": 1, "charge": tampered_charge()}),
    ]:
        try:
            app.message(consumer, payload, job_id="j-1")
        except ValidationError as exc:
            print("refused", consumer, exc.error_count())
        else:
            print("published", consumer)
    body = Producer(routes={"charge": "billing"}).message(
        "charge", tampered_charge(), job_id="j-2"
    ).body
    print("producer", len(body))
    """
)


def test_a_payload_value_in_a_model_instance_never_reaches_stderr_when_a_job_is_produced() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TESTS_DIR), environ.get("PYTHONPATH")])
    )
    done = subprocess.run(
        [sys.executable, "-c", PRODUCER_SCRIPT],
        env=environ,
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert CARD not in done.stdout + done.stderr, done.stderr
    assert "4111" not in done.stderr, done.stderr
    # App validates what it publishes: a model that no longer fits its schema is refused, as a
    # mapping would be (the worker would dead-letter it as SchemaInvalid poison).
    assert done.stdout.splitlines()[:2] == ["refused charge 1", "refused order 1"], done.stdout
    # Producer does not validate (documented): the job goes, with no warning printed.
    assert done.stdout.splitlines()[2].startswith("producer "), done.stdout


async def test_app_enqueue_refuses_a_model_instance_that_no_longer_fits_its_schema(
    database_url: str,
) -> None:
    app = charge_app()
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning quoting the value fails the test
            with pytest.raises(ValidationError) as refused:
                await app.enqueue(conn, "charge", tampered_charge(), job_id="j-1")
        assert [e["loc"] for e in refused.value.errors()] == [("amount_cents",)]
        # Refused before any SQL: the caller's transaction goes on.
        await app.enqueue(conn, "charge", Charge(account_id=7, amount_cents=5), job_id="j-2")
        await conn.commit()
        assert await scalar(conn, "SELECT count(*) FROM jobfence_queue.messages") == 1
        assert await scalar(conn, "SELECT job_id FROM jobfence_queue.messages") == "j-2"


def test_producer_serialises_a_model_instance_without_a_warning_quoting_its_values() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        message = Producer(routes={"charge": "billing"}).message(
            "charge", tampered_charge(), job_id="j-1"
        )
    assert json.loads(message.body) == {"account_id": 7, "amount_cents": CARD}


# ------------------------------------------------------------------------------------------
# A secret in argparse's usage errors
# ------------------------------------------------------------------------------------------


def jobfence(*args: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JOBFENCE_")}
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", *args],
        env=environ,
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        # a flag the command does not take
        (["cleanup", "--queue-url", f"amqp://guest:{SECRET}@rabbit:5672/"], "guest:***@rabbit"),
        (["dead-letters", "list", "--queue-url", f"redis://:{SECRET}@redis:6379"], ":***@redis"),
        (
            ["dead-letters", "list", "--json", "--db", f"postgresql://app:{SECRET}@db/app"],
            "app:***@db",
        ),
        # a URL given to a flag that wants something else
        (["worker", "app:app", "--concurrency", f"nats://ops:{SECRET}@nats:4222"], "ops:***@nats"),
        (["migrate", f"postgresql://app:{SECRET}@db/app"], "app:***@db"),
    ],
    ids=["cleanup-flag", "dead-letters-flag", "dead-letters-json", "worker-value", "migrate-arg"],
)
def test_a_url_typed_on_the_command_line_shows_no_password_in_a_usage_error(
    argv: list[str], shown: str
) -> None:
    done = jobfence(*argv)
    assert done.returncode == 2, done.stderr
    assert "error: " in done.stderr, done.stderr
    assert SECRET not in done.stdout + done.stderr, done.stdout + done.stderr
    assert shown in done.stderr, done.stderr
    if "--json" in argv:
        assert shown in json.loads(done.stdout)["error"], done.stdout


class Note(BaseModel):
    account_id: int
    note: str


# A handler sends a payload value to PostgreSQL, which refuses it with a data exception
# (SQLSTATE class 22) whose message quotes it: each statement, and the SQLSTATE it raises.
DATA_ERRORS = {
    "invalid-text": ("SELECT CAST(%s AS int)", "22P02"),
    "out-of-range": ("SELECT CAST(%s AS int)", "22003"),
    "bad-json": ("SELECT CAST(%s AS jsonb)", "22P02"),
    "bad-date": ("SELECT CAST(%s AS date)", "22007"),
}
VALUES = {
    "invalid-text": "alice@example.com",
    "out-of-range": "4111111111",
    "bad-json": '{"ssn": 123-45-6789}',
    "bad-date": "born 1984-13-45 Zq9",
}


CASES = [
    *((kind, "psycopg", n) for kind in DATA_ERRORS for n in (1, 5)),
    ("invalid-text", "sqlalchemy", 1),
    ("invalid-text", "sqlalchemy", 5),
    ("out-of-range", "sqlalchemy-async", 1),
]


def _note_handler(flavour: str, statement: str) -> Any:
    """A consumer's handler that sends job ``refused``'s note to PostgreSQL with
    ``statement``: on the psycopg connection it is given, through a SQLAlchemy session on it
    (a ``def`` handler), or through an async SQLAlchemy session (SQLAlchemy wraps the error, and
    its message quotes the statement's parameters)."""
    from sqlalchemy import text

    from jobfence import JobMeta
    from jobfence.contrib.sqlalchemy import async_session_for, session_for

    bound = text(statement.replace("%s", ":v"))
    if flavour == "psycopg":

        async def on_psycopg(payload: Note, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
            if job.job_id == "refused":
                await tx.execute(statement, (payload.note,))

        return on_psycopg
    if flavour == "sqlalchemy":

        def on_session(payload: Note, job: JobMeta, tx: psycopg.Connection[Any]) -> None:
            with session_for(tx) as session:
                if job.job_id == "refused":
                    session.execute(bound, {"v": payload.note})

        return on_session

    async def on_async_session(
        payload: Note, job: JobMeta, tx: psycopg.AsyncConnection[Any]
    ) -> None:
        async with async_session_for(tx) as session:
            if job.job_id == "refused":
                await session.execute(bound, {"v": payload.note})

    return on_async_session


@pytest.mark.parametrize(("kind", "flavour", "per_transaction"), CASES)
async def test_a_value_the_database_refuses_reaches_no_log_line_dead_letter_error_or_incident(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
    *,
    kind: str,
    flavour: str,
    per_transaction: int,
) -> None:
    """PostgreSQL's message for a data exception quotes the value it refused
    (``invalid input syntax for type integer: "alice@example.com"``). A handler that sends a
    payload value there fails its job like any error (retried, then one dead letter), and the
    value reaches no log line (the retry's, the dead letter's, a rolled-back group's), no
    ``last_error`` and no Better Stack incident: the message is told with the value as
    ``<value>``, and the SQLSTATE. The dead letter's payload keeps it, as it keeps the whole
    job. The same through SQLAlchemy, whose error quotes the statement's parameters too."""
    from alert_helpers import TOKEN, make_relay, running, wait_for_alerts
    from fake_betterstack import FakeBetterStack
    from jobfence import PgQueue, RetryPolicy, Worker, open_pool

    statement, sqlstate = DATA_ERRORS[kind]
    value = VALUES[kind]
    app = App()
    policy = RetryPolicy(max_retries=1, base_seconds=0.01, cap_seconds=0.01, rationale="quick")

    app.consumer(
        "note", queue="notes", schema=Note, retry=policy, jobs_per_transaction=per_transaction
    )(_note_handler(flavour, statement))
    await app.enqueue(conn, "note", {"account_id": 1, "note": value}, job_id="refused")
    await app.enqueue(conn, "note", {"account_id": 2, "note": "fine"}, job_id="behind")
    pool = await open_pool(database_url, max_size=4)
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    try:
        worker = Worker(app, pool, queue, concurrency=1, poll_seconds=0.05)
        await asyncio.wait_for(worker.run(until="empty"), 30)
    finally:
        await queue.close()
        await pool.close()
    row = await (
        await conn.execute("SELECT error_class, last_error, payload FROM core.dead_letters")
    ).fetchall()
    assert len(row) == 1, row
    error_class, last_error, payload = row[0]
    assert error_class.startswith(("psycopg.errors.", "sqlalchemy.exc.")), error_class
    assert f"SQLSTATE {sqlstate}" in last_error.splitlines()[0], last_error
    assert value not in last_error, last_error
    assert payload["note"] == value, "the dead letter keeps the whole job"
    assert await scalar(conn, "SELECT count(*) FROM core.processed_jobs") == 1  # "behind"

    server = FakeBetterStack(TOKEN).start()
    try:
        async with running(make_relay(database_url, server)):
            await wait_for_alerts(conn, "sent", 1)
        [post] = server.posts()
    finally:
        server.close()
    description = post.json()["description"]
    assert f"SQLSTATE {sqlstate}" in description, description
    assert value not in json.dumps(post.json()), description
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"SQLSTATE {sqlstate}" in line for line in lines), lines
    leaked = [line for line in lines if value in line or "alice@" in line]
    assert not leaked, leaked


async def test_a_data_exception_an_orm_wraps_is_told_without_its_value(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Django raises its own ``DataError`` with the psycopg error's message, ``from`` it
    (``__cause__``); SQLAlchemy keeps it as ``orig``. Either is told as the data exception it
    wraps, without the value."""
    from jobfence.harness import describe_error, first_line

    value = "alice@example.com"
    with pytest.raises(psycopg.errors.InvalidTextRepresentation) as refused:
        await conn.execute("SELECT CAST(%s AS int)", (value,))
    await conn.rollback()

    class DataError(Exception):  # django.db.utils.DataError, as Django raises it
        pass

    try:
        raise DataError(*refused.value.args) from refused.value
    except DataError as exc:
        wrapped = exc
    assert value in str(wrapped)
    told = "(psycopg.errors.InvalidTextRepresentation) invalid input syntax for type integer:"
    assert first_line(wrapped) == f"{told} <value> [SQLSTATE 22P02]"
    assert value not in describe_error(wrapped)
