"""JOBFENCE_DATABASE_URL is required: every command but the demo refuses at once, with a message
that says how to set it, when it is unset, blank or misspelt (never an empty embedded database
instead). ``embedded`` is the one explicit way to ask for the embedded PostgreSQL (pgserver), an
optional extra that no jobfence module imports until it is asked for."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from jobfence import ConfigError, resolve_database_url
from jobfence.cli import build_parser
from jobfence.config import similar_database_variables
from jobfence.schema import latest_version, migrations

TESTS_DIR = Path(__file__).parent
PASSWORD = "Pw-s3cr3t-0815"

# Every command that needs the database, with arguments it accepts.
COMMANDS = {
    "migrate": ["migrate"],
    "worker": ["worker", "pointsapp:app"],
    "api": ["api", "--port", "0"],
    "cleanup": ["cleanup"],
    "alert-relay": ["alert-relay"],
    "outbox-relay": ["outbox-relay", "--queue-url", "memory://"],
    "dead-letters list": ["dead-letters", "list"],
    "dead-letters show": ["dead-letters", "show", "1"],
    "dead-letters replay": ["dead-letters", "replay", "1", "--actor", "ops"],
    "dead-letters replay-bulk": ["dead-letters", "replay-bulk", "--queue", "q", "--actor", "ops"],
    "dead-letters discard": ["dead-letters", "discard", "1", "--reason", "why", "--actor", "ops"],
}

# The misspelling holds a real, reachable URL with a password: the command must neither use it
# nor print it.
MISSPELT_URL = f"postgresql://postgres:{PASSWORD}@127.0.0.1:5432/postgres"
SETTINGS = {
    "unset": ({}, "JOBFENCE_DATABASE_URL is not set"),
    "blank": ({"JOBFENCE_DATABASE_URL": "  "}, "JOBFENCE_DATABASE_URL is empty"),
    "misspelt": (
        {"JOBFENCE_DATABASE_URI": MISSPELT_URL},
        "JOBFENCE_DATABASE_URL is not set (JOBFENCE_DATABASE_URI is set: "
        "did you mean JOBFENCE_DATABASE_URL?)",
    ),
}

# Run before anything else in the child: pgserver cannot be imported, as in a production image
# installed without the ``embedded`` extra. Then every jobfence module is imported, and the CLI
# runs with the arguments that follow.
WITHOUT_PGSERVER = """
import importlib, pkgutil, sys
sys.modules["pgserver"] = None
import jobfence
for module in pkgutil.walk_packages(jobfence.__path__, "jobfence."):
    importlib.import_module(module.name)
from jobfence.cli import main
sys.exit(main(sys.argv[1:]))
"""


def clean_environ() -> dict[str, str]:
    """This process's environment without JOBFENCE_DATABASE_URL or anything resembling it."""
    similar = set(similar_database_variables(os.environ))
    return {
        name: value
        for name, value in os.environ.items()
        if name != "JOBFENCE_DATABASE_URL" and name not in similar
    }


def jobfence(
    *args: str, env: Mapping[str, str], cwd: Path, without_pgserver: bool = False
) -> subprocess.CompletedProcess[str]:
    """``jobfence ARGS`` in a real process with exactly ``env`` (plus tests/ on the path)."""
    environ = {**env, "PYTHONPATH": str(TESTS_DIR)}
    command = ["-c", WITHOUT_PGSERVER] if without_pgserver else ["-m", "jobfence.cli"]
    return subprocess.run(
        [sys.executable, *command, *args],
        env=environ,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single ``jobfence: error: ...`` line a person sees, exit status 2, nothing else."""
    assert done.returncode == 2, done
    assert done.stdout == "", done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("jobfence: error: "), lines[0]
    return lines[0]


@pytest.fixture
def embedded_dir(tmp_path: Path) -> Iterator[Path]:
    """Where an embedded server would keep its data; stopped afterwards if one was started."""
    data_dir = tmp_path / "pgdata"
    yield data_dir
    if (data_dir / "postmaster.pid").exists():  # pragma: no cover - only if a test failed
        from pgserver import get_server

        get_server(str(data_dir.resolve()), cleanup_mode="stop").cleanup()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_command_that_needs_the_database_is_covered_here() -> None:
    """A new command must decide what it does without JOBFENCE_DATABASE_URL (and be added)."""
    commands = set()
    for name, parser in subcommands(build_parser()).items():
        nested = subcommands(parser)
        commands.update([f"{name} {inner}" for inner in nested] if nested else [name])
    assert commands - {"demo", "roles"} == set(COMMANDS)


def test_roles_print_sql_needs_no_database(tmp_path: Path, embedded_dir: Path) -> None:
    done = jobfence("roles", "--print-sql", env=clean_environ(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("-- jobfence database roles")
    assert done.stderr == ""
    assert not embedded_dir.exists()


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_command_without_the_database_url_refuses_at_once_and_starts_no_embedded_server(
    command: str, setting: str, tmp_path: Path, embedded_dir: Path
) -> None:
    extra, says = SETTINGS[setting]
    env = {**clean_environ(), "JOBFENCE_EMBEDDED_DIR": str(embedded_dir), **extra}
    line = one_error_line(jobfence(*COMMANDS[command], env=env, cwd=tmp_path))
    assert line.startswith(f"jobfence: error: {says}"), line
    assert "every command but demo needs it" in line
    assert "e.g. JOBFENCE_DATABASE_URL=postgresql://user@127.0.0.1:5432/dbname" in line
    assert "JOBFENCE_DATABASE_URL=embedded for a local embedded PostgreSQL" in line
    assert PASSWORD not in line
    # No embedded server was started: neither the configured folder nor the default exists.
    assert not embedded_dir.exists()
    assert not (tmp_path / ".jobfence").exists()


def test_the_refusal_comes_before_any_other_work(tmp_path: Path, embedded_dir: Path) -> None:
    """Neither the app module (which does not exist) nor the API's key is looked at first."""
    env = {**clean_environ(), "JOBFENCE_EMBEDDED_DIR": str(embedded_dir)}
    env.pop("JOBFENCE_JWT_SECRET", None)
    env.pop("JOBFENCE_JWT_PUBLIC_KEY", None)
    for args in (["worker", "no_such_module:app"], ["api"]):
        line = one_error_line(jobfence(*args, env=env, cwd=tmp_path))
        assert "JOBFENCE_DATABASE_URL is not set" in line, line
    assert not embedded_dir.exists()


def test_every_similarly_named_variable_is_named_and_none_of_their_values(
    tmp_path: Path, embedded_dir: Path
) -> None:
    env = {
        **clean_environ(),
        "JOBFENCE_EMBEDDED_DIR": str(embedded_dir),
        "DATABASE_URL": MISSPELT_URL,
        "JOBFENCE_DB_URL": MISSPELT_URL,
    }
    line = one_error_line(jobfence("dead-letters", "list", env=env, cwd=tmp_path))
    assert "(DATABASE_URL and JOBFENCE_DB_URL are set: did you mean JOBFENCE_DATABASE_URL?)" in line
    assert PASSWORD not in line
    assert "127.0.0.1:5432/postgres" not in line
    assert not embedded_dir.exists()


def test_names_close_to_the_database_url_are_recognised_and_other_settings_are_not() -> None:
    close = [
        "JOBFENCE_DATABASE_URI",
        "JOBFENCE_DB_URL",
        "JOBFENCE_DATABSE_URL",
        "JOBFENCE_DATABASE",
        "JOBFENCE_DSN",
        "JOBFENCE_POSTGRES_URL",
        "jobfence_database_url",
        "DATABASE_URL",
    ]
    other = [
        "JOBFENCE_EMBEDDED_DIR",
        "JOBFENCE_JWT_SECRET",
        "JOBFENCE_BETTERSTACK_API_URL",
        "JOBFENCE_LOG_FORMAT",
        "JOBFENCE_EVENT_LOOP",
        "JOBFENCE_ACTOR",
        "PGPASSWORD",
    ]
    env = {name: "x" for name in [*close, *other, "JOBFENCE_DATABASE_URL"]}
    assert similar_database_variables(env) == sorted(close)
    assert similar_database_variables({"JOBFENCE_DATABASE_URI": " "}) == []  # blank: not set


def test_migrate_print_sql_needs_no_database_url(tmp_path: Path, embedded_dir: Path) -> None:
    env = {**clean_environ(), "JOBFENCE_EMBEDDED_DIR": str(embedded_dir)}
    done = jobfence("migrate", "--print-sql", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "CREATE TABLE core.processed_jobs" in done.stdout
    assert not embedded_dir.exists()


def test_the_library_refuses_an_unset_url_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("JOBFENCE_DATABASE_URL", raising=False)
    monkeypatch.setenv("JOBFENCE_EMBEDDED_DIR", str(tmp_path / "pgdata"))
    with pytest.raises(ConfigError, match="JOBFENCE_DATABASE_URL is not set"):
        resolve_database_url()
    assert not (tmp_path / "pgdata").exists()


def test_embedded_is_the_explicit_way_to_ask_for_the_embedded_postgresql(
    tmp_path: Path, embedded_dir: Path
) -> None:
    env = {
        **clean_environ(),
        "JOBFENCE_DATABASE_URL": "embedded",
        "JOBFENCE_EMBEDDED_DIR": str(embedded_dir),
    }
    done = jobfence("migrate", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"applied {latest_version():04d}_{migrations()[-1].name}" in done.stdout
    # It says so at start, and where.
    assert (
        f"INFO jobfence.db: JOBFENCE_DATABASE_URL=embedded: using the embedded PostgreSQL in "
        f"{embedded_dir.resolve()}" in done.stderr
    )
    assert (embedded_dir / "PG_VERSION").exists()
    # The server stopped when the command exited; the data stayed.
    assert not (embedded_dir / "postmaster.pid").exists()
    again = jobfence("migrate", env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"already up to date (version {latest_version():04d})" in again.stdout


def test_without_pgserver_jobfence_imports_and_answers_help(tmp_path: Path) -> None:
    done = jobfence("--help", env=clean_environ(), cwd=tmp_path, without_pgserver=True)
    assert done.returncode == 0, done.stderr
    assert "usage: jobfence" in done.stdout
    assert "JOBFENCE_DATABASE_URL (required by every command but demo)" in done.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["migrate"], "already up to date"),
        (["dead-letters", "list"], "no dead letters match"),
    ],
)
def test_without_pgserver_commands_run_on_a_database_url(
    args: list[str], says: str, database_url: str, tmp_path: Path
) -> None:
    env = {**clean_environ(), "JOBFENCE_DATABASE_URL": database_url}
    done = jobfence(*args, env=env, cwd=tmp_path, without_pgserver=True)
    assert done.returncode == 0, done.stderr
    assert says in done.stdout.lower()


@pytest.mark.parametrize(
    ("args", "url", "says"),
    [
        (
            ["migrate"],
            "embedded",
            "jobfence: error: JOBFENCE_DATABASE_URL=embedded asks for the embedded PostgreSQL, "
            "but pgserver is not installed: pip install 'jobfence[embedded]'",
        ),
        (
            ["demo"],
            None,
            "jobfence: error: JOBFENCE_DATABASE_URL is not set, so the embedded PostgreSQL is "
            "used, but pgserver is not installed: pip install 'jobfence[embedded]' (or set "
            "JOBFENCE_DATABASE_URL to your database, e.g. "
            "postgresql://user@127.0.0.1:5432/dbname)",
        ),
    ],
    ids=["embedded", "demo"],
)
def test_embedded_without_pgserver_says_what_to_install(
    args: list[str], url: str | None, says: str, tmp_path: Path, embedded_dir: Path
) -> None:
    env = {**clean_environ(), "JOBFENCE_EMBEDDED_DIR": str(embedded_dir)}
    if url is not None:
        env["JOBFENCE_DATABASE_URL"] = url
    line = one_error_line(jobfence(*args, env=env, cwd=tmp_path, without_pgserver=True))
    assert line == says
    assert not embedded_dir.exists()


def test_the_demo_without_a_url_uses_the_embedded_postgresql(
    tmp_path: Path, embedded_dir: Path
) -> None:
    env = {**clean_environ(), "JOBFENCE_EMBEDDED_DIR": str(embedded_dir)}
    done = jobfence("demo", "--jobs", "3", "--duplicates", "1", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        f"JOBFENCE_DATABASE_URL not set: using the embedded PostgreSQL in "
        f"{embedded_dir.resolve()}" in done.stderr
    )
    assert (embedded_dir / "PG_VERSION").exists()
    assert not (embedded_dir / "postmaster.pid").exists()
