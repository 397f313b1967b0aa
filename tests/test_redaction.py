"""No secret in any output: every URL form the docs accept, every secret variable, every command.

One module (``jobfence.redact``) shows a URL, a list of URLs, a libpq connection string or a
string that parses as none of them with its secrets as ``***``, and finds those secrets in
whatever a client library echoes. A property-based test puts random secrets with special
characters (``/ ? # @ % : & = '`` and more) into each documented variable and URL form, runs
the start-up and error paths of every command, and finds none of them in stdout, stderr or the
log records; a few real ``jobfence`` processes check the same end to end.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobfence import cli, queues
from jobfence.config import secrets_from_env
from jobfence.errors import ConfigError
from jobfence.observability import configure_logging
from jobfence.queues import parse_queue_url
from jobfence.redact import is_secret_key, printable, redact_text, redact_url, url_secrets

ROOT = Path(__file__).parent.parent
TESTS_DIR = Path(__file__).parent


def closed_port() -> int:
    """A loopback port nothing listens on (taken from the OS, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------------------------------
# The forms, one by one
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "secrets", "shown"),
    [
        (
            "postgresql://postgres:Db/Secret2@db.internal:5432/app",
            ["Db/Secret2", "Secret2"],
            "postgresql://postgres:***@db.internal:5432/app",
        ),
        ("amqp://guest:pa/ss?#@rabbit:5672/", ["pa/ss?#"], "amqp://guest:***@rabbit:5672/"),
        ("nats://s3cr3tToken@nats:4222", ["s3cr3tToken"], "nats://***@nats:4222"),
        (
            "nats://a:first-pw@n1:4222,nats://b:second-pw@n2:4222",
            ["first-pw", "second-pw"],
            "nats://a:***@n1:4222,nats://b:***@n2:4222",
        ),
        (
            "nats://a:first-pw@n1:4222,b:second-pw@n2:4222",
            ["first-pw", "second-pw"],
            "nats://a:***@n1:4222,b:***@n2:4222",
        ),
        ("redis://:p#ss@redis:6379/0", ["p#ss"], "redis://:***@redis:6379/0"),
        (
            "redis://redis:6379/0?password=r3dis-pw&db=1",
            ["r3dis-pw"],
            "redis://redis:6379/0?password=***",
        ),
        (
            "kafka://user@broker:9092?sasl_password=k4fka-pw",
            ["k4fka-pw"],
            "kafka://***@broker:9092?sasl_password=***",
        ),
        (
            "host=db port=5432 user=app password='it\\'s a \\\\ secret' dbname=app",
            ["it's a \\ secret"],
            "host=db port=5432 user=app password=*** dbname=app",
        ),
        (
            "host=db password='it''s secret' user=app",
            ["it''s secret' user=app"],
            "host=db password=***",
        ),
        ("app:bare-pw@db/app", ["bare-pw"], "app:***@db/app"),
        ("nats://to[k:en-pw@nats:4222", ["to[k:en-pw"], "nats://***@nats:4222"),
        # nats-py reads a user with an empty password as a token
        ("nats://t0ken-pw:@nats:4222", ["t0ken-pw"], "nats://***@nats:4222"),
        # no "://", and a password with a key=value in it: not a libpq connection string
        ("amqp:/guest:pa;x=y@rabbit", ["pa;x=y"], "amqp:***@rabbit"),
        (
            "postgresql://app@db/app?sslpassword=ssl-pw&application_name=x",
            ["ssl-pw"],
            "postgresql://app@db/app?sslpassword=***",
        ),
        ("postgresql://app@db:5432/app", [], "postgresql://app@db:5432/app"),
        ("embedded", [], "embedded"),
    ],
    ids=[
        "libpq-slash",
        "userinfo-specials",
        "nats-token",
        "nats-seed-list",
        "nats-seed-list-bare",
        "redis-hash",
        "redis-query",
        "unknown-scheme",
        "conninfo-quoted",
        "conninfo-badly-quoted",
        "no-scheme",
        "unparseable-userinfo",
        "token-empty-password",
        "one-slash-key-value-password",
        "libpq-query",
        "no-secret",
        "not-a-url",
    ],
)
def test_every_url_form_is_shown_with_its_secrets_as_stars(
    url: str, secrets: list[str], shown: str
) -> None:
    assert redact_url(url) == shown
    found = url_secrets(url)
    for secret in secrets:
        assert secret not in redact_url(url)
        assert any(secret in form or form in secret for form in found), (secret, found)


def test_a_password_that_libpq_misreads_is_hidden_in_what_libpq_says_of_it() -> None:
    url = "postgresql://postgres:Db/Secret2@127.0.0.1:5432/db"
    # libpq reads host=postgres port=Db dbname=Secret2@127.0.0.1:5432/db, and says so.
    said = 'dbname=Secret2@127.0.0.1:5432/db host=postgres port=Db: invalid port "Db" (Dbx)'
    assert redact_url(url, said) == (
        'dbname=***@127.0.0.1:5432/db host=postgres port=***: invalid port "***" (Dbx)'
    )


def test_secret_keys_are_recognised_by_what_they_name() -> None:
    secret = ["password", "sslpassword", "pwd", "token", "auth_token", "client_secret"]
    secret += ["api_key", "apikey", "signature", "credentials", "nkey", "jwt", "pass"]
    plain = ["user", "host", "port", "dbname", "db", "sslmode", "application_name", "vhost"]
    assert [k for k in secret if not is_secret_key(k)] == []
    assert [k for k in plain if is_secret_key(k)] == []


def test_printable_escapes_every_control_character_and_keeps_the_rest() -> None:
    assert printable("job-1 é ✓") == "job-1 é ✓"
    assert printable("a\nb\r\x1b[2J\x00\x85\u2028\t") == "a\\nb\\r\\x1b[2J\\x00\\x85\\u2028\\t"


def test_one_module_at_the_bottom_holds_the_helpers_and_no_circle_is_left() -> None:
    def jobfence_imports(module: str) -> set[str]:
        tree = ast.parse((ROOT / "src/jobfence" / f"{module}.py").read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        return {name for name in names if name.split(".")[0] == "jobfence"}

    assert jobfence_imports("redact") == set()
    # config reads bounds from limits, which like redact sits at the bottom (errors only).
    assert jobfence_imports("config") == {"jobfence.errors", "jobfence.limits", "jobfence.redact"}
    assert jobfence_imports("limits") == {"jobfence.errors"}
    assert "jobfence.queues" not in jobfence_imports("db")
    for module in ("db", "queues", "config", "observability"):
        source = (ROOT / "src/jobfence" / f"{module}.py").read_text()
        assert "def _passwords" not in source and "def url_passwords" not in source


# ------------------------------------------------------------------------------------------
# Random secrets through every command
# ------------------------------------------------------------------------------------------

# Secrets with the characters that break URL parsers, at least 8 long and with letters so that
# they cannot occur in an output by chance. (A password holding ``scheme://`` is the one form
# the redaction does not untangle.)
SPECIALS = "/?#@%:&=+!$'\"\\,;[]~*()"
LETTERS = "abcdefghkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789"
secret_text = (
    st.text(
        alphabet=st.sampled_from(
            "abcdefghkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789" + SPECIALS
        ),
        min_size=8,
        max_size=20,
    )
    .map(lambda s: f"Zq{s}")
    .filter(lambda s: "://" not in s and sum(ch.isalnum() for ch in s) >= 6)
)


def conninfo_quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Exactly ``values`` among the JOBFENCE_* variables (and ``values``' own), restored after."""

    def managed() -> list[str]:
        return [n for n in os.environ if n.startswith("JOBFENCE_") or n in values]

    saved = {name: os.environ.pop(name) for name in managed()}
    os.environ.update(values)
    try:
        yield
    finally:
        for name in managed():
            del os.environ[name]
        os.environ.update(saved)


class Records(logging.Handler):
    """Every record any logger emits, as the message and traceback it carries (before the
    output handler's redaction: jobfence's own records must hold no secret at all)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += logging.Formatter().formatException(record.exc_info)
        if record.name.startswith("jobfence"):
            self.texts.append(text)


def database_urls(secret: str, port: int) -> list[str]:
    """JOBFENCE_DATABASE_URL in each form the docs accept, each with ``secret``."""
    return [
        f"postgresql://postgres:{secret}@127.0.0.1:{port}/postgres",  # written unescaped
        f"postgresql://postgres:{quote(secret, safe='')}@127.0.0.1:{port}/postgres",
        f"postgresql://postgres@127.0.0.1:{port}/postgres?password={quote(secret, safe='')}",
        f"host=127.0.0.1 port={port} user=postgres password={conninfo_quoted(secret)}",
        f"postgres:{secret}@127.0.0.1:{port}/postgres",  # the scheme forgotten
    ]


def queue_urls(secret: str, port: int, other: int) -> list[str]:
    """JOBFENCE_QUEUE_URL in each form, each with ``secret``, every broker unreachable."""
    encoded = quote(secret, safe="")
    return [
        f"amqp://guest:{secret}@127.0.0.1:{port}/",
        f"amqp://guest:{encoded}@127.0.0.1:{port}/",
        f"nats://{encoded}@127.0.0.1:{port}",  # a token
        f"nats://{secret}@127.0.0.1:{port}",
        f"nats://127.0.0.1:{other},nats://u:{encoded}@127.0.0.1:{port}",  # a seed list
        f"nats://a:{encoded}@127.0.0.1:{other},b:{encoded}@127.0.0.1:{port}",
        f"redis://:{secret}@127.0.0.1:{port}/0",
        f"redis://127.0.0.1:{port}/0?password={encoded}",
        f"kafka://u:{secret}@127.0.0.1:{port}?password={encoded}",  # an unknown scheme
        f"postgresql://postgres:{secret}@127.0.0.1:{port}/postgres",  # refused: not a queue
        f"amqp:/guest:{secret}@127.0.0.1",  # does not parse as a URL at all
    ]


# The commands, each with what brings it to its start-up path and then to an error: a database
# or a broker that does not answer, or a setting it refuses.
QUEUE_COMMANDS = [
    ["worker", "cliapps.hostile:app", "--until", "empty"],
    ["outbox-relay"],
    ["api", "--port", "0"],
    ["dead-letters", "replay", "1"],
    ["dead-letters", "replay-bulk", "--all"],
    ["demo", "--jobs", "1"],
]
DATABASE_COMMANDS = [
    ["migrate"],
    ["worker", "cliapps.hostile:app", "--until", "empty"],
    ["cleanup"],
    ["dead-letters", "list"],
    ["dead-letters", "show", "1"],
    ["outbox-relay"],
    ["api", "--port", "0"],
    ["alert-relay"],
    ["dead-letters", "replay", "1"],
    ["dead-letters", "discard", "1", "--reason", "test"],
    ["demo", "--jobs", "1"],
]
# Commands that may succeed: what they print on the way must hold no secret either.
SUCCEEDING_COMMANDS = [["migrate", "--print-sql"]]


def run_main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse
        return int(exc.code or 0)


def assert_hidden(secret: str, output: str, records: Records) -> None:
    """Neither the secret nor a decoded form of it is in the output or a jobfence record."""
    forms = {secret, quote(secret, safe=""), secret.replace("\\", "\\\\")}
    for form in forms:
        assert form not in output, (secret, output)
        leaked = [text for text in records.texts if form in text]
        assert not leaked, (secret, leaked)


@pytest.fixture
def fast_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker that does not answer is given up after 0.5 s, not 15."""
    monkeypatch.setattr(queues, "OPEN_TIMEOUT_SECONDS", 0.5)


@pytest.mark.usefixtures("restore_logging", "fast_open")
@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(secrets=st.tuples(secret_text, secret_text, secret_text))
def test_no_random_secret_in_any_variable_reaches_stdout_stderr_or_a_log_record(
    database_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    secrets: tuple[str, str, str],
) -> None:
    secret, jwt, token = (
        secrets  # a URL's password or token, the JWT secret, the Better Stack token
    )
    monkeypatch.chdir(TESTS_DIR)
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    port, other = closed_port(), closed_port()
    records = Records()
    logging.getLogger().addHandler(records)
    jwt = (jwt * 3)[:48]  # long enough to be accepted: the API then starts
    common = {
        "JOBFENCE_JWT_SECRET": jwt,
        "JOBFENCE_BETTERSTACK_TOKEN": token,
        "JOBFENCE_BETTERSTACK_API_URL": f"http://127.0.0.1:{port}",
        "JOBFENCE_BETTERSTACK_RELAY_HEARTBEAT_URL": f"http://127.0.0.1:{port}/api/v1/heartbeat/{token}",
        "PGCONNECT_TIMEOUT": "2",
        "PGPASSWORD": secret,  # libpq's own variable: the database trusts loopback, unused
    }
    try:
        runs: list[tuple[dict[str, str], list[str], str]] = []
        for url in database_urls(secret, port):
            for argv in DATABASE_COMMANDS:
                runs.append(({**common, "JOBFENCE_DATABASE_URL": url}, argv, secret))
        for url in queue_urls(secret, port, other):
            for argv in QUEUE_COMMANDS:
                env = {**common, "JOBFENCE_DATABASE_URL": database_url, "JOBFENCE_QUEUE_URL": url}
                runs.append((env, argv, secret))
        for argv in SUCCEEDING_COMMANDS:
            runs.append(
                ({**common, "JOBFENCE_DATABASE_URL": database_urls(secret, port)[0]}, argv, secret)
            )
        for env, argv, hidden in runs:
            capsys.readouterr()
            with environment(env):
                code = run_main(["-v", *argv])
            out = capsys.readouterr()
            if argv not in SUCCEEDING_COMMANDS:
                assert code != 0, (argv, env, out)  # each reached its error path
            for each in (hidden, jwt, token):
                assert_hidden(each, out.out + out.err, records)
    finally:
        logging.getLogger().removeHandler(records)


# ------------------------------------------------------------------------------------------
# Real processes
# ------------------------------------------------------------------------------------------

SECRET = "Db/S3cr?t#x@y%z"


def jobfence(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JOBFENCE_")}
    environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(TESTS_DIR), environ.get("PYTHONPATH")])
    )
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", "-v", *args],
        env={**environ, **env},
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


SubprocessCase = Callable[[str, int], tuple[list[str], dict[str, str]]]


@pytest.mark.parametrize(
    "case",
    [
        lambda db, port: (
            ["migrate"],
            {"JOBFENCE_DATABASE_URL": f"postgresql://postgres:{SECRET}@127.0.0.1:{port}/db"},
        ),
        lambda db, port: (
            ["worker", "cliapps.hostile:app", "--until", "empty"],
            {
                "JOBFENCE_DATABASE_URL": db,
                "JOBFENCE_QUEUE_URL": f"nats://127.0.0.1:{port},nats://u:{SECRET}@127.0.0.1:{port}",
            },
        ),
        lambda db, port: (
            ["outbox-relay"],
            {
                "JOBFENCE_DATABASE_URL": db,
                "JOBFENCE_QUEUE_URL": f"redis://:{SECRET}@127.0.0.1:{port}",
            },
        ),
        lambda db, port: (
            ["api", "--port", "0"],
            {
                "JOBFENCE_DATABASE_URL": (
                    f"host=127.0.0.1 port={port} password={conninfo_quoted(SECRET)}"
                ),
                "JOBFENCE_JWT_SECRET": SECRET * 3,
            },
        ),
        lambda db, port: (
            ["worker", "cliapps.hostile:app"],
            {"JOBFENCE_DATABASE_URL": db, "JOBFENCE_QUEUE_URL": f"kafka://h?password={SECRET}"},
        ),
        lambda db, port: (
            ["worker", "cliapps.hostile:app"],
            {"JOBFENCE_DATABASE_URL": db, "JOBFENCE_QUEUE_URL": f"amqp://guest:{SECRET}@h:{port}/"},
        ),
        lambda db, port: (
            ["outbox-relay"],
            {
                "JOBFENCE_DATABASE_URL": db,
                "JOBFENCE_QUEUE_URL": f"nats://{quote(SECRET, safe='')}@127.0.0.1:{port}",
            },
        ),
    ],
    ids=[
        "migrate-libpq",
        "worker-nats-seed-list",
        "outbox-relay-redis",
        "api-conninfo",
        "kafka",
        "amqp-slash",
        "nats-token",
    ],
)
def test_a_real_jobfence_process_prints_no_secret(database_url: str, case: SubprocessCase) -> None:
    argv, env = case(database_url, closed_port())
    done = jobfence(*argv, env={**env, "PGCONNECT_TIMEOUT": "2"})
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("jobfence: error: "), done.stderr
    output = done.stdout + done.stderr
    for form in (SECRET, quote(SECRET, safe=""), "S3cr?t#x", "S3cr"):
        assert form not in output, output


@settings(max_examples=500, deadline=None)
@given(secret=secret_text)
def test_no_random_secret_shows_in_any_url_form_as_shown_or_as_refused(secret: str) -> None:
    """The forms of the subprocess property above, many more times and without processes: each
    URL as jobfence shows it, and the refusal of a queue URL that does not parse, hold neither
    the secret nor a decoded form of it. (The stars a secret is replaced by are set aside
    first: a password ``*`` next to them is not a leak.)"""
    for url in [*queue_urls(secret, 1, 2), *database_urls(secret, 1)]:
        try:
            parse_queue_url(url)
            refusal = ""
        except ConfigError as exc:
            refusal = str(exc)
        for text in (redact_url(url), refusal):
            seen = text.replace("***", "\x00")
            for form in {secret, quote(secret, safe=""), secret.replace("\\", "\\\\")}:
                assert form not in seen, (url, text)


def test_the_configured_secrets_cover_every_form_of_each_url() -> None:
    env = {
        "JOBFENCE_DATABASE_URL": "postgresql://postgres:Db/Secret2@127.0.0.1:5432/db",
        "JOBFENCE_QUEUE_URL": "nats://n1:4222,nats://u:seed-pw%2F2@n2:4222",
        "JOBFENCE_JWT_SECRET": "jwt-secret-value",
    }
    found = secrets_from_env(env)
    assert {"Db/Secret2", "Secret2", "seed-pw%2F2", "seed-pw/2", "jwt-secret-value"} <= set(found)
    said = "port=Db dbname=Secret2@x; nats: seed-pw/2 refused; jwt jwt-secret-value"
    assert redact_text(said, found) == "port=*** dbname=***@x; nats: *** refused; jwt ***"


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_url_or_a_secret_pair_in_any_log_line_is_hidden_even_when_not_configured(
    log_format: str,
) -> None:
    stream = io.StringIO()
    configure_logging(log_format, secrets=[], stream=stream)
    logging.getLogger("aiormq.connection").warning(
        "cannot connect to %s (auth token=%s)", "amqp://guest:Gu3st-pw@rabbit:5672/", "T0k-9"
    )
    output = stream.getvalue()
    assert "Gu3st-pw" not in output and "T0k-9" not in output
    assert "amqp://guest:***@rabbit:5672/" in output and "token=***" in output
