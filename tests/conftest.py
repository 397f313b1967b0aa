"""Shared fixtures: a real PostgreSQL, one fresh migrated database per test.

The server is ``JOBFENCE_DATABASE_URL`` when set (CI points it at the machine's PostgreSQL),
otherwise an embedded PostgreSQL (pgserver) started once for the session. Each test gets its
own database cloned from a migrated template, so tests never see each other's rows and
``core.dead_letters`` can stay append-only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import tempfile
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from alert_helpers import TOKEN
from fake_betterstack import FakeBetterStack
from jobfence import db
from jobfence.schema import migrate
from support import with_dbname

# The shared queue conformance suite is a helper module: have pytest rewrite its asserts too.
pytest.register_assert_rewrite("queue_conformance")

_counter = itertools.count()


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    url = os.environ.get("JOBFENCE_DATABASE_URL", "").strip()
    if url:
        try:
            psycopg.connect(url, connect_timeout=5).close()
        except psycopg.OperationalError as exc:
            pytest.exit(f"JOBFENCE_DATABASE_URL is set but unreachable: {exc}", returncode=3)
        yield url
        return
    try:
        from pgserver import get_server
    except ImportError:
        pytest.exit(
            "JOBFENCE_DATABASE_URL is not set and the embedded PostgreSQL (pgserver) is not "
            "installed: pip install -e '.[dev,embedded]', or set JOBFENCE_DATABASE_URL",
            returncode=3,
        )

    data_dir = Path(tempfile.mkdtemp(prefix="jobfence-test-pg-"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = get_server(str(data_dir), cleanup_mode="stop")
    yield str(server.get_uri())
    server.cleanup()


@pytest.fixture(scope="session")
def template_dbname(server_url: str) -> Iterator[str]:
    name = f"jobfence_tpl_{os.getpid()}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')

    async def _migrate() -> None:
        async with await psycopg.AsyncConnection.connect(
            with_dbname(server_url, name), autocommit=True
        ) as conn:
            await migrate(conn)

    asyncio.run(_migrate())
    yield name
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def create_database(server_url: str, *, template: str | None) -> str:
    name = f"jobfence_t_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if template:
            admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        else:
            admin.execute(f'CREATE DATABASE "{name}"')
    return name


def drop_database(server_url: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(server_url: str, template_dbname: str) -> Iterator[str]:
    """A fresh, migrated database for this test alone."""
    name = create_database(server_url, template=template_dbname)
    yield with_dbname(server_url, name)
    drop_database(server_url, name)


@pytest.fixture
def empty_database_url(server_url: str) -> Iterator[str]:
    """A fresh database with no jobfence schema (for migration tests)."""
    name = create_database(server_url, template=None)
    yield with_dbname(server_url, name)
    drop_database(server_url, name)


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    p = await db.open_pool(database_url, min_size=1, max_size=12)
    yield p
    await p.close()


@pytest.fixture
async def points(conn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncConnection[Any]:
    """``conn``, on a database that holds the sample app's tables (``pointsapp``)."""
    import pointsapp

    await conn.execute(pointsapp.SCHEMA_SQL)
    return conn


@pytest.fixture
def autocommit_conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A sync connection to the test's database, each statement its own transaction."""
    with psycopg.connect(database_url, autocommit=True) as c:
        yield c


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    c = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    yield c
    await c.close()


# -- brokers ---------------------------------------------------------------------------------
# Each broker is checked once per session: a test that needs one is skipped locally when it
# does not answer, and fails under CI (CI=true), where every broker must run (STYLE habit 11).


def _broker_url(variable: str, default: str, port_default: int) -> str:
    import socket
    from urllib.parse import urlsplit

    url = os.environ.get(variable, "").strip() or default
    parts = urlsplit(url)
    try:
        socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or port_default), 3
        ).close()
    except OSError as exc:
        reason = f"{variable} ({url}) does not answer: {exc}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason}; CI runs every broker", pytrace=False)
        pytest.skip(reason)
    return url


@pytest.fixture(scope="session")
def redis_url() -> str:
    return _broker_url("JOBFENCE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0", 6379)


@pytest.fixture(scope="session")
def nats_url() -> str:
    return _broker_url("JOBFENCE_TEST_NATS_URL", "nats://127.0.0.1:4222", 4222)


@pytest.fixture(scope="session")
def amqp_url() -> str:
    return _broker_url("JOBFENCE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/", 5672)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """The root logger's handlers and level, and the ``jobfence`` logger's level, as they were
    before the test (which may call ``configure_logging``)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    jobfence_level = logging.getLogger("jobfence").level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    logging.getLogger("jobfence").setLevel(jobfence_level)


@pytest.fixture
def server() -> Iterator[FakeBetterStack]:
    """The fake Better Stack (``fake_betterstack.py``) on a free loopback port, for the token
    the alert tests use; closed after the test."""
    fake = FakeBetterStack(TOKEN).start()
    yield fake
    fake.close()
