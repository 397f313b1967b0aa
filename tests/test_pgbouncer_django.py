"""jobfence.contrib.django behind PgBouncer (tests/djangoproject, each test with its own
PgBouncer process: the ``bouncer`` fixture of tests/test_pgbouncer.py).

The worker's ``def`` handlers run on Django's own connection, which Django opens without
prepared statements (``prepare_threshold`` None unless ``OPTIONS`` sets it); the worker's own
pool follows ``JOBFENCE["DATABASE_POOL_MODE"]``. jobfence's schema migration needs a session of
its own: ``manage.py migrate`` refuses it under transaction pooling.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from test_django import fences, manage, one, points
from test_pgbouncer import pgbouncers

pytest.importorskip("django")


pgbouncer = pytest.fixture(pgbouncers, name="pgbouncer")


def _jobfence_setting(**keys: object) -> dict[str, str]:
    return {"DJANGOPROJECT_JOBFENCE": json.dumps(keys)}


def test_the_django_worker_behind_transaction_pooling_applies_each_job_once(
    empty_database_url: str, pgbouncer: Callable[..., str]
) -> None:
    done = manage(empty_database_url, "migrate", "-v", "0")  # PostgreSQL directly
    assert done.returncode == 0, done.stderr
    url = pgbouncer(empty_database_url, "transaction", pool_size=3)
    setting = _jobfence_setting(DATABASE_POOL_MODE="transaction")
    jobs = 60
    code = "\n".join(
        [
            "from django.db import transaction",
            "from jobfence.contrib.django import enqueue",
            f"for i in range({jobs}):",
            "    with transaction.atomic():",
            "        enqueue('bulk_award' if i % 2 else 'award_points',"
            " {'account': 'a', 'amount': 1}, job_id=f'j{i}')",
        ]
    )
    done = manage(url, "shell", "-v", "0", "-c", code, **setting)
    assert done.returncode == 0, done.stderr[-3000:]
    done = manage(
        url,
        "jobfence_worker",
        "--queue",
        "points",
        "--queue",
        "bulk",
        "--until",
        "empty",
        "--concurrency",
        "3",
        **setting,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "prepared statement" not in done.stderr, done.stderr[-3000:]
    assert points(empty_database_url) == jobs
    assert fences(empty_database_url) == jobs
    assert one(empty_database_url, "SELECT count(*) FROM core.dead_letters") == 0


def test_manage_migrate_refuses_jobfence_schema_under_transaction_pooling(
    empty_database_url: str, pgbouncer: Callable[..., str]
) -> None:
    url = pgbouncer(empty_database_url, "transaction")
    done = manage(url, "migrate", "-v", "0", **_jobfence_setting(DATABASE_POOL_MODE="transaction"))
    assert done.returncode != 0, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("django.core.exceptions.ImproperlyConfigured: settings.JOBFENCE:")
    assert "needs a database session of its own" in last
    assert "PostgreSQL directly or at a pool in session mode" in last
    # Nothing of jobfence's schema was applied through the pooler.
    assert one(empty_database_url, "SELECT to_regclass('jobfence.schema_migrations')") is None


def test_manage_migrate_refuses_an_undeclared_pooler_and_runs_in_session_mode(
    empty_database_url: str, pgbouncer: Callable[..., str]
) -> None:
    url = pgbouncer(empty_database_url, "session")
    done = manage(url, "migrate", "-v", "0")
    assert done.returncode != 0, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert "reaches PostgreSQL through a connection pooler (PgBouncer)" in last
    assert "DATABASE_POOL_MODE" in last
    done = manage(url, "migrate", "-v", "0", **_jobfence_setting(DATABASE_POOL_MODE="session"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert one(empty_database_url, "SELECT count(*) FROM jobfence.schema_migrations") > 0
