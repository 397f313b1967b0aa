"""What a producer puts in a job cannot forge a log line, and no payload value reaches a log.

A producer chooses a job's id, tenant, correlation id and payload (``jobfence.enqueue`` in
SQL needs no more than INSERT), and a handler's error text may hold what it read. A real
``jobfence worker`` (the default text log format, then JSON) runs such jobs: no line of its
output starts with a forged timestamp, no raw ESC reaches the terminal, and a schema-invalid
payload's value is in neither the log, the dead letter's ``last_error``, nor the alert, while
the dead letter's payload keeps it for the operator.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel, Field, ValidationError, field_validator

from alert_helpers import make_relay, running, wait_for_alerts
from cliapps import hostile
from fake_betterstack import FakeBetterStack
from jobfence.codec import describe_validation_error
from jobfence.observability import configure_logging

TESTS_DIR = Path(__file__).parent
FORGED_AT = "2026-12-01 19:00:00,000"
FORGED = f"{FORGED_AT} CRITICAL jobfence.worker: FORGED database wiped\x1b[2J"
CARD = "4111-1111-1111-1111"
JOBFENCE = [sys.executable, "-m", "jobfence.cli"]
ENQUEUE = "SELECT jobfence.enqueue(%s, %s, %s, %s::jsonb, %s, %s)"


def run_worker(database_url: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``jobfence worker cliapps.hostile:app --until empty`` to completion."""
    environ = {**os.environ, "JOBFENCE_DATABASE_URL": database_url, **env}
    environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TESTS_DIR), environ.get("PYTHONPATH")])
    )
    if "JOBFENCE_LOG_FORMAT" not in env:
        environ.pop("JOBFENCE_LOG_FORMAT", None)  # the default: text
    done = subprocess.run(
        [*JOBFENCE, "worker", "cliapps.hostile:app", "--queue", hostile.QUEUE, "--until", "empty"],
        env=environ,
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def show_dead_letter(database_url: str, dead_letter_id: int) -> subprocess.CompletedProcess[str]:
    """``jobfence dead-letters show ID``, which must succeed."""
    return subprocess.run(
        [*JOBFENCE, "dead-letters", "show", str(dead_letter_id)],
        env={**os.environ, "JOBFENCE_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


async def enqueue_hostile_jobs(conn: psycopg.AsyncConnection[Any]) -> None:
    """Through the SQL function, as any producer role can: a forged job id, tenant and
    correlation id on a job whose handler fails (its error holds an ESC), and on a job whose
    payload the schema rejects (a card number where a number is wanted)."""
    await conn.execute(
        ENQUEUE,
        ("charge", hostile.QUEUE, f"inj\n{FORGED}", '{"n": 1}', f"t\r{FORGED}", f"c\n{FORGED}"),
    )
    await conn.execute(
        ENQUEUE, ("charge", hostile.QUEUE, f"card\n{FORGED}", json.dumps({"n": CARD}), None, None)
    )


def assert_no_forged_line(output: str) -> None:
    lines = output.split("\n")
    assert not [line for line in lines if line.startswith(FORGED_AT)], output
    assert not [line for line in lines if re.match(r"\S+ \S+ CRITICAL ", line)], output
    assert "\x1b" not in output and "\r" not in output


async def test_a_forged_job_id_cannot_start_a_log_line_of_its_own_in_the_text_log(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await enqueue_hostile_jobs(conn)

    done = run_worker(database_url)  # the default format: text

    assert_no_forged_line(done.stderr + done.stdout)
    # The lines are there, the forged text escaped inside them.
    dead = [line for line in done.stderr.splitlines() if "dead-lettered after" in line]
    assert len(dead) == 1, done.stderr
    assert re.match(r"\d{4}-\d\d-\d\d \S+ WARNING jobfence.harness: job inj\\n2026-12-01 ", dead[0])
    assert "declined \\x1b[31mred\\x1b[0m" in dead[0]  # the handler's error, escaped
    poison = [line for line in done.stderr.splitlines() if "is poison" in line]
    assert len(poison) == 1 and "job card\\n" in poison[0], done.stderr


async def test_the_warning_of_a_session_setting_change_shows_a_forged_job_id_escaped(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The WARNING that a handler changed a setting for its whole session names the job: a
    forged id stays inside that line, escaped, and the setting's new value is in no line."""
    await conn.execute(
        ENQUEUE, ("zone", hostile.QUEUE, f"tz\n{FORGED}", '{"n": 1}', None, f"c\n{FORGED}")
    )

    done = run_worker(database_url)

    output = done.stderr + done.stdout
    assert_no_forged_line(output)
    changed = [line for line in done.stderr.splitlines() if "for the whole session" in line]
    assert len(changed) == 1, done.stderr
    assert re.match(
        # The id holds control characters: shown as its start, escaped, with its length and
        # a digest.
        r"\d{4}-\d\d-\d\d \S+ WARNING jobfence.harness: job tz\\n2026-12-01 19:00:00,000 "
        r"CRITICAL jobfence.worker: FORGED data\.\.\.\[78 bytes, sha256 [0-9a-f]{16}\]: the "
        r"handler of consumer zone changed TimeZone for the whole session",
        changed[0],
    ), changed[0]
    assert hostile.SESSION_ZONE not in output
    row = await (
        await conn.execute("SELECT count(*) FROM core.processed_jobs WHERE consumer = 'zone'")
    ).fetchone()
    assert row == (1,)  # the job itself committed


async def test_dead_letters_show_prints_a_hostile_job_id_and_last_error_escaped(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await enqueue_hostile_jobs(conn)
    run_worker(database_url)
    cur = await conn.execute(
        "SELECT id FROM core.dead_letters WHERE error_class <> 'SchemaInvalid'"
    )
    [(dead_letter_id,)] = await cur.fetchall()

    done = show_dead_letter(database_url, dead_letter_id)

    assert_no_forged_line(done.stdout + done.stderr)
    assert "declined \\x1b[31mred\\x1b[0m" in done.stdout  # last_error, escaped
    assert "inj\\n2026-12-01 19:00:00,000 CRITICAL" in done.stdout  # the job id, escaped


# U+009B is the 8-bit CSI (``\x9b2J`` clears the screen where C1 controls are honoured), U+0085
# is NEL (next line), U+2028 the line separator, U+202E a right-to-left override.
C1_HOSTILE = "evil\x9b2J\x85\u2028FORGED\u202e"


@pytest.mark.parametrize(
    "args",
    [["show", "{id}"], ["list", "--json"], ["show", "{id}", "--json"]],
    ids=["show-payload", "list-json", "show-json"],
)
def test_dead_letters_json_and_payloads_print_no_raw_control_character(
    database_url: str, args: list[str]
) -> None:
    """What ``jobfence.enqueue`` lets any producer write (ids, an error text, a payload string)
    holding C1 controls and line separators: the JSON that ``--json`` and ``show``'s payload
    print escapes each of them as ``\\uXXXX``, and reads back as it was stored."""
    with psycopg.connect(database_url, autocommit=True) as c:
        row = c.execute(
            "INSERT INTO core.dead_letters (job_id, queue, consumer, tenant_id, payload,"
            " payload_encoding, attempts, last_error, error_class, correlation_id)"
            " VALUES (%s, 'loyalty', 'award_points', %s, %s, 'json', 1, %s, 'x.Failed', %s)"
            " RETURNING id",
            (C1_HOSTILE, C1_HOSTILE, json.dumps({"note": C1_HOSTILE}), C1_HOSTILE, C1_HOSTILE),
        ).fetchone()
    assert row is not None
    done = subprocess.run(
        [*JOBFENCE, "dead-letters", *(a.format(id=row[0]) for a in args)],
        env={**os.environ, "JOBFENCE_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    out = done.stdout + done.stderr
    assert "evil" in out
    assert [ch for ch in out if ch != "\n" and not ch.isprintable()] == [], out
    if "--json" in args:
        document = json.loads(done.stdout)
        shown = document["items"][0] if "items" in document else document
        assert shown["job_id"] == C1_HOSTILE


async def test_json_logs_carry_the_forged_values_escaped_in_the_message_and_the_fields(
    database_url: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await enqueue_hostile_jobs(conn)

    done = run_worker(database_url, JOBFENCE_LOG_FORMAT="json")

    assert_no_forged_line(done.stderr + done.stdout)
    records = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    assert "CRITICAL" not in {r["level"] for r in records}
    dead = [r for r in records if "dead-lettered after" in r["message"]]
    assert len(dead) == 1
    for record in records:  # decoded, no value holds a control character either
        for value in record.values():
            if isinstance(value, str):
                assert value.isprintable(), record
    assert dead[0]["job_id"].startswith("inj\\n2026-12-01")
    assert dead[0]["tenant_id"].startswith("t\\r2026-12-01")
    assert dead[0]["correlation_id"].startswith("c\\n2026-12-01")


INT_PARSING = "Input should be a valid integer, unable to parse string as an integer"


@pytest.mark.parametrize(
    ("consumer", "body", "says"),
    [
        (
            "charge",
            {"n": CARD},
            f"payload does not match Card: 1 validation error: n: {INT_PARSING} [int_parsing]",
        ),
        (  # the card number is a key of a mapping: pydantic's location holds it
            "tally",
            {"points": {CARD: 5}},
            "payload does not match Tally: 1 validation error: points.<key>.[key]:"
            f" {INT_PARSING} [int_parsing]",
        ),
        (  # an unknown key under extra="forbid": the location is the key itself
            "strict",
            {"amount": 1, CARD: 2},
            "payload does not match Strict: 1 validation error: <key>: Extra inputs are not"
            " permitted [extra_forbidden]",
        ),
    ],
    ids=["value", "mapping-key", "unknown-key"],
)
async def test_a_schema_invalid_payload_value_is_in_no_log_no_last_error_and_no_alert(
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    consumer: str,
    body: dict[str, Any],
    says: str,
) -> None:
    await conn.execute(ENQUEUE, (consumer, hostile.QUEUE, "card-1", json.dumps(body), None, None))

    done = run_worker(database_url, JOBFENCE_LOG_FORMAT="text")

    assert CARD not in done.stderr + done.stdout
    [poison] = [line for line in done.stderr.splitlines() if "is poison" in line]
    assert poison.endswith(f"is poison, dead-lettered without retry: {says}"), poison
    cur = await conn.execute("SELECT last_error, payload, error_class FROM core.dead_letters")
    [(last_error, payload, error_class)] = await cur.fetchall()
    assert error_class == "SchemaInvalid"
    assert CARD not in last_error
    assert last_error == f"SchemaInvalid: {says}"  # names the field and the error
    assert payload == body  # the operator still has the value

    server = FakeBetterStack("bst-test-token-7f3a").start()
    try:
        async with running(make_relay(database_url, server)):
            await wait_for_alerts(conn, "sent", 1)
        [post] = server.posts()
        assert "SchemaInvalid" in post.body.decode()
        assert CARD not in post.body.decode()
    finally:
        server.close()


class Checkout(BaseModel):
    kind: str = Field(pattern="^(card|iban)$")
    amount: int = Field(gt=0)
    card: str = ""

    @field_validator("card")
    @classmethod
    def luhn(cls, value: str) -> str:
        raise ValueError(f"{value} fails the Luhn check")


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ({"kind": CARD, "amount": 1}, "kind: String should match pattern '^(card|iban)$'"),
        ({"kind": "card", "amount": CARD}, "amount: Input should be a valid integer"),
        ({"kind": "card", "amount": 1, "card": CARD}, "card: Value error, … [value_error]"),
        ({"kind": ["x", CARD], "amount": 1}, "kind: Input should be a valid string"),
        ({"amount": 1, CARD: 2}, "kind: Field required [missing]"),
    ],
    ids=["pattern", "int", "validator-text", "list", "missing"],
)
def test_a_validation_error_is_told_by_field_and_error_without_the_input(
    payload: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        Checkout.model_validate(payload)
    assert CARD in str(caught.value)  # pydantic's own text quotes it
    text = describe_validation_error(caught.value)
    assert says in text
    assert CARD not in text and "\n" not in text


class Ledger(BaseModel):
    by_owner: dict[str, int]
    checkout: Checkout = Field(alias="Checkout")


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (
            {"by_owner": {"alice": "x"}, "Checkout": {"kind": "card", "amount": 1}},
            "by_owner.<key>:",
        ),
        ({"by_owner": {}, "Checkout": {"kind": "card", "amount": "x"}}, "Checkout.amount:"),
    ],
    ids=["mapping-key", "alias-and-nested-field"],
)
def test_a_key_of_a_mapping_in_the_payload_is_shown_as_key_and_the_schemas_names_as_they_are(
    payload: dict[str, Any], says: str
) -> None:
    """With the consumer's schema, a location shows only the names the schema declares (its
    fields, their aliases, those of its nested models): a key of a mapping is the payload's
    own value, however plain it looks. Without a schema (a handler's own ValidationError), a
    part that is not an identifier is shown as ``<key>``."""
    with pytest.raises(ValidationError) as caught:
        Ledger.model_validate(payload)
    assert says in describe_validation_error(caught.value, Ledger)
    assert "alice" not in describe_validation_error(caught.value, Ledger)
    with pytest.raises(ValidationError) as caught:
        Ledger.model_validate({"by_owner": {CARD: "x"}, "Checkout": {"kind": "card", "amount": 1}})
    assert "by_owner.<key>:" in describe_validation_error(caught.value)


@pytest.mark.usefixtures("restore_logging")
def test_a_traceback_in_the_text_log_is_indented_so_its_lines_cannot_pass_for_records() -> None:
    stream = io.StringIO()
    configure_logging("text", secrets=[], stream=stream)
    log = logging.getLogger("jobfence.test")
    try:
        raise RuntimeError(f"handler said\n{FORGED}")
    except RuntimeError:
        log.exception("failed with %s", f"x\n{FORGED}", stack_info=True)
    log.info("next")

    lines = stream.getvalue().splitlines()
    assert_no_forged_line(stream.getvalue())
    assert " ERROR jobfence.test: failed with x\\n2026-12-01" in lines[0]
    assert all(line.startswith("  ") for line in lines[1:-1])
    assert "  Traceback (most recent call last):" in lines
    assert f"  {FORGED_AT} CRITICAL jobfence.worker: FORGED database wiped\\x1b[2J" in lines
    assert lines[-1].endswith(" INFO jobfence.test: next")
