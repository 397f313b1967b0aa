"""A ``--json`` command that ends with an error says so in JSON on stdout, as
docs/configuration.md shows: ``{"error": MESSAGE, "exit_code": N}``, the same message as its
``jobfence: error:`` line on stderr, whatever the error (refused, bad arguments, setting,
database)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from psycopg.conninfo import make_conninfo

from test_cli_dead_letters import dl


def json_error(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "Traceback" not in done.stderr
    doc = json.loads(done.stdout)
    assert doc == {"error": doc["error"], "exit_code": done.returncode}, doc
    assert done.returncode != 0
    [line] = done.stderr.strip().splitlines()[-1:]
    assert line == f"jobfence: error: {doc['error']}", done.stderr
    return doc


@pytest.mark.parametrize(
    ("args", "exit_code", "says"),
    [
        (["replay", "4242"], 1, "no dead letter with id 4242"),
        (["discard", "4242", "--reason", " "], 2, "reason"),
        (["show", "not-an-id"], 2, "dead-letters show: argument ID"),
        (["replay-bulk"], 2, "--all"),
        (["list", "--limit", "0"], 2, "--limit"),
    ],
    ids=["not-found", "blank-reason", "bad-argument", "no-filter", "bad-limit"],
)
def test_a_json_command_error_is_a_json_object_on_stdout(
    database_url: str, args: list[str], exit_code: int, says: str
) -> None:
    done = dl(*args, "--json", url=database_url)
    doc = json_error(done)
    assert doc["exit_code"] == exit_code
    assert says in doc["error"], doc


def test_a_json_command_without_a_database_setting_is_a_json_error(database_url: str) -> None:
    done = dl("list", "--json", url="")
    doc = json_error(done)
    assert doc["exit_code"] == 2
    assert doc["error"].startswith("JOBFENCE_DATABASE_URL is empty"), doc


def test_a_database_error_under_json_is_a_json_error(database_url: str) -> None:
    bad = make_conninfo(database_url, dbname="no_such_database_here")
    done = dl("list", "--json", url=bad)
    doc = json_error(done)
    assert doc["exit_code"] in (1, 2), doc
    assert "no_such_database_here" in doc["error"], doc


def test_without_json_an_error_prints_nothing_on_stdout(database_url: str) -> None:
    done = dl("replay", "4242", url=database_url)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.strip() == "jobfence: error: no dead letter with id 4242"
