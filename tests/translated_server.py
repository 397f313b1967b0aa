"""A PostgreSQL server of its own that words its messages in German, as a server whose
``lc_messages`` is ``de_DE.UTF-8`` does: the machine's PostgreSQL binaries, started with
``LANGUAGE=de`` (gettext honours it over a ``C.UTF-8`` locale, so no German locale needs to be
generated). jobfence must not read its server's English: this is how tests prove it.

Run as root, the server runs as the ``postgres`` user (``runuser``). Locally, a machine without
PostgreSQL's binaries or their German catalogue skips the tests that need it; under CI they
fail, as a missing broker does."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

LANGUAGE = "de"
INITDB = ["--auth=trust", "-E", "UTF8", "--locale=C.UTF-8", "-N"]


def _binaries() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` whose server has a German catalogue."""
    for bindir in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        version = bindir.parent.name
        catalogue = Path(f"/usr/share/locale/{LANGUAGE}/LC_MESSAGES/postgres-{version}.mo")
        if (bindir / "initdb").exists() and catalogue.exists():
            return bindir
    return None


def unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}; CI runs the translated-server tests", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def german_server() -> Iterator[str]:
    """Start the server; yield its URL (database ``postgres``); stop it and remove its data."""
    bindir = _binaries()
    if bindir is None:
        unavailable("no PostgreSQL binaries with a German message catalogue on this machine")
        raise AssertionError("unreachable")
    as_user: list[str] = []
    home = Path(tempfile.mkdtemp(prefix="jobfence-de-pg-"))
    if os.geteuid() == 0:  # initdb refuses root: run the server as postgres
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(home)
            unavailable("running as root and there is no postgres user to run a server as")
            raise AssertionError("unreachable") from None
        os.chown(home, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    env = ["env", f"LANGUAGE={LANGUAGE}", "LC_ALL=C.UTF-8"]
    data = home / "data"
    port = _free_port()
    try:
        subprocess.run(
            [*as_user, *env, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", *INITDB],
            check=True,
            capture_output=True,
            timeout=120,
        )
        start = ["-l", str(home / "log"), "-w", "-t", "60", "start"]
        options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            [*as_user, *env, str(bindir / "pg_ctl"), "-D", str(data), "-o", options, *start],
            check=True,
            capture_output=True,
            timeout=90,
        )
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run(
                [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                check=False,
                capture_output=True,
                timeout=60,
            )
    finally:
        shutil.rmtree(home, ignore_errors=True)
