"""No output carries a payload value or a secret, where a library jobfence calls would write one.

- A payload that is a pydantic model whose field was given a value of another type after
  validation (``award.points = "..."``, no ``validate_assignment``): pydantic's serializer warns
  on stderr quoting the value. ``App.enqueue``/``App.message`` refuse it (they validate what
  they publish) and no producer lets pydantic print it.
- A URL typed on the command line in the wrong place: argparse's usage error quotes it; the
  line shows it with its secrets as ``***``, as every other error line does.
"""

from __future__ import annotations

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
