"""A command-line argument jobfence cannot use is refused by the argument parser, before any
work: exit status 2, one ``jobfence: error:`` line naming the flag (for a ``--json`` command,
the same error as a JSON object on stdout), no traceback, nothing changed.

Bytes that are not UTF-8 reach Python as lone surrogates, which neither PostgreSQL nor a
terminal takes: they crashed ``dead-letters list`` and ``replay-bulk`` with a traceback (no
JSON), or reached the database. An id is ASCII digits, as the HTTP API reads it: ``int()``
also took Arabic-Indic and fullwidth digits, ``+1``, `` 1`` and ``1_0``.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from test_cli_dead_letters import everything, one_error_line, seed
from test_cli_json_errors import json_error

TESTS_DIR = Path(__file__).parent
BAD = b"loy\xff"  # what `--queue $'loy\xff'` passes: not UTF-8
BAD_SHOWN = "'loy\\xff' is not valid UTF-8"
METRICS_HOST = ["--metrics-host", "{bad}"]
ARABIC_12 = "\u0661\u0662"  # Arabic-Indic digits: int() read 12
FULLWIDTH_07 = "\uff10\uff17"  # fullwidth digits: int() read 7
ARABIC_1 = "\u0661"
ARABIC_3 = "\u0663"


def jobfence(
    *args: str | bytes, url: str, env: dict[str, str] | None = None, cwd: Path = TESTS_DIR
) -> subprocess.CompletedProcess[str]:
    """``jobfence ARGS`` in a real process, each argument passed as given (bytes as bytes)."""
    run_env = {**os.environ, "JOBFENCE_DATABASE_URL": url, "JOBFENCE_ACTOR": "cli-test"}
    run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.getenv("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", *args],
        env={**run_env, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=60,
        check=False,
    )


def _filter_cases(command: str, *base: str) -> list[Any]:
    flags = ["--queue", "--consumer", "--tenant", "--error-class", "--job-id"]
    flags += ["--correlation-id", "--since", "--until"]
    return [
        pytest.param([command, *base, flag, "{bad}"], flag, id=f"{command}{flag}") for flag in flags
    ]


# Every free-text argument of jobfence dead-letters; replay-bulk is no dry run: it would
# replay whatever matched.
NOT_UTF8 = [
    *_filter_cases("list"),
    pytest.param(["list", "--cursor", "{bad}"], "--cursor", id="list--cursor"),
    pytest.param(["list", "--group-by", "{bad}"], "--group-by", id="list--group-by"),
    *_filter_cases("replay-bulk", "--actor", "bob"),
    pytest.param(
        ["replay-bulk", "--queue", "loyalty", "--actor", "{bad}"], "--actor", id="bulk--actor"
    ),
    pytest.param(["replay", "{id}", "--actor", "{bad}"], "--actor", id="replay--actor"),
    pytest.param(
        ["discard", "{id}", "--reason", "dup", "--actor", "{bad}"], "--actor", id="discard--actor"
    ),
    pytest.param(["discard", "{id}", "--reason", "{bad}"], "--reason", id="discard--reason"),
    pytest.param(["show", "{id}", "--payload-out", "{bad}"], "--payload-out", id="show--out"),
]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize(("args", "flag"), NOT_UTF8)
def test_a_dead_letters_argument_that_is_not_valid_utf8_is_one_error_line_and_changes_nothing(
    database_url: str, tmp_path: Path, args: list[str], flag: str, as_json: bool
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        pending = seed(conn, "order-1")
        seed(conn, "order-2", minutes=1)
        before = everything(conn)
        given = [BAD if a == "{bad}" else a.replace("{id}", str(pending)) for a in args]
        command = ["dead-letters", *given, *(["--json"] if as_json else [])]

        done = jobfence(*command, url=database_url, cwd=tmp_path)

        expected = f"dead-letters {args[0]}: argument {flag}: {BAD_SHOWN}"
        if as_json:
            assert json_error(done) == {"error": expected, "exit_code": 2}
            assert done.stderr.strip() == f"jobfence: error: {expected}"
        else:
            assert one_error_line(done) == f"jobfence: error: {expected}"
        assert done.returncode == 2
        assert everything(conn) == before
    assert list(tmp_path.iterdir()) == []  # no --payload-out file written


def test_an_actor_from_the_environment_that_is_not_valid_utf8_is_refused_and_changes_nothing(
    database_url: str,
) -> None:
    """``$JOBFENCE_ACTOR`` in bytes that are not UTF-8 is refused like ``--actor``, before any
    bulk run is recorded (it crashed with a traceback)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        seed(conn, "order-1")
        before = everything(conn)
        env = {
            **os.environb,
            b"JOBFENCE_DATABASE_URL": database_url.encode(),
            b"JOBFENCE_ACTOR": BAD,
        }
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "jobfence.cli",
                "dead-letters",
                "replay-bulk",
                "--queue",
                "loyalty",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert one_error_line(done) == (
            "jobfence: error: $JOBFENCE_ACTOR: 'loy\\xff' is not valid UTF-8; pass --actor NAME"
        )
        assert done.returncode == 2
        assert everything(conn) == before


def test_a_dead_letters_argument_holding_a_nul_character_is_refused_by_the_parser(
    database_url: str,
) -> None:
    """A shell cannot pass a NUL, a program calling jobfence.cli.main can: refused the same
    way, not sent to PostgreSQL (which refused it as a database error, exit status 1)."""
    call = (
        "import sys; from jobfence.cli import main; "
        "sys.exit(main(['dead-letters', 'list', '--queue', 'loy\\x00alty']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", call],
        env={**os.environ, "JOBFENCE_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert one_error_line(done) == (
        "jobfence: error: dead-letters list: argument --queue: 'loy\\x00alty' holds a NUL character"
    )
    assert done.returncode == 2


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        pytest.param(["worker", "pointsapp:app", "--queue", "{bad}"], "--queue", id="worker-queue"),
        pytest.param(["worker", "{bad}"], "app", id="worker-app"),
        pytest.param(
            ["worker", "pointsapp:app", "--until", "empty", "--metrics-port", "0", *METRICS_HOST],
            "--metrics-host",
            id="worker-metrics-host",
        ),
        pytest.param(["api", "--port", "0", "--host", "{bad}"], "--host", id="api-host"),
        pytest.param(["migrate", "--queue-url", "{bad}"], "--queue-url", id="migrate-queue-url"),
        pytest.param(
            ["migrate", "--queue-url", "postgresql", "--from-queue-url", "{bad}"],
            "--from-queue-url",
            id="migrate-from-queue-url",
        ),
    ],
)
def test_a_command_argument_that_is_not_valid_utf8_is_refused_before_it_starts(
    empty_database_url: str, args: list[str], flag: str
) -> None:
    done = jobfence(
        *(BAD if a == "{bad}" else a for a in args),
        url=empty_database_url,
        env={"JOBFENCE_JWT_SECRET": secrets.token_hex(32)},
    )
    assert (done.returncode, done.stdout) == (2, ""), done
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"jobfence {args[0]}: error: argument {flag}: {BAD_SHOWN}"
    with psycopg.connect(empty_database_url) as conn:  # migrate applied nothing
        assert conn.execute("SELECT to_regnamespace('jobfence')").fetchone() == (None,)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(
            ["show", ARABIC_12], f"argument ID: not a dead letter id: '{ARABIC_12}'", id="arabic"
        ),
        pytest.param(
            ["replay", FULLWIDTH_07],
            f"argument ID: not a dead letter id: '{FULLWIDTH_07}'",
            id="fullwidth",
        ),
        pytest.param(
            ["discard", "+1", "--reason", "dup"],
            "argument ID: not a dead letter id: '+1'",
            id="plus",
        ),
        pytest.param(["show", "1_0"], "argument ID: not a dead letter id: '1_0'", id="underscore"),
        pytest.param(["show", " 1"], "argument ID: not a dead letter id: ' 1'", id="space"),
        pytest.param(
            ["replay-bulk", "--resume", ARABIC_1],
            f"argument --resume: not a bulk replay id: '{ARABIC_1}'",
            id="resume",
        ),
        pytest.param(
            ["replay-bulk", "--all", "--max-items", ARABIC_3],
            f"argument --max-items: not a whole number from 1 to 1000000: '{ARABIC_3}'",
            id="max-items",
        ),
        pytest.param(
            ["list", "--limit", ARABIC_3],
            f"argument --limit: not a whole number from 1 to 500: '{ARABIC_3}'",
            id="limit",
        ),
    ],
)
def test_an_id_or_count_in_other_than_ascii_digits_is_refused_and_changes_nothing(
    database_url: str, args: list[str], says: str
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        for n in range(12):  # 1 to 12: what ARABIC_12, FULLWIDTH_07 and +1 were read as
            seed(conn, f"order-{n}", minutes=n)
        before = everything(conn)

        done = jobfence("dead-letters", *args, url=database_url)

        assert one_error_line(done) == f"jobfence: error: dead-letters {args[0]}: {says}"
        assert done.returncode == 2
        assert everything(conn) == before
