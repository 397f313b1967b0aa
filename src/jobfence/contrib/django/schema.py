"""jobfence's schema on a Django database: jobfence's own migration runner, on the database
of ``DATABASES``; called by the app's Django migration and after every ``manage.py migrate``."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import psycopg
from django.core.exceptions import ImproperlyConfigured

from jobfence import schema
from jobfence.config import POOL_MODE_TRANSACTION
from jobfence.contrib.django.settings import SETTING, database_url, jobfence_settings
from jobfence.db import behind_pooler


def apply_schema(using: str) -> list[str]:
    """Apply the pending jobfence migrations to ``DATABASES[using]`` when it is jobfence's
    database (``JOBFENCE["DATABASE_ALIAS"]``); the names applied. Idempotent, under jobfence's
    advisory lock, in its own transaction on its own connection.

    Its advisory lock and lifted timeouts belong to the session: under transaction pooling
    (``JOBFENCE["DATABASE_POOL_MODE"]`` or JOBFENCE_DATABASE_POOL_MODE ``transaction``) it is
    refused before it connects, and a pooler neither declares is refused once found, as
    ``jobfence migrate`` refuses them."""
    config = jobfence_settings()
    if using != config.database_alias:
        return []
    mode = config.pool_mode()
    if mode == POOL_MODE_TRANSACTION:
        raise ImproperlyConfigured(
            f"settings.{SETTING}: jobfence's schema migration (manage.py migrate) needs a"
            " database session of its own, which a pooler in transaction mode does not keep"
            f" (DATABASE_POOL_MODE transaction): run manage.py migrate with DATABASES[{using!r}]"
            " pointing at PostgreSQL directly or at a pool in session mode (docs/django.md)"
        )
    url = database_url(using)

    async def migrate() -> list[str]:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            if mode is None and await behind_pooler(conn):
                raise ImproperlyConfigured(
                    f"settings.{SETTING}: DATABASES[{using!r}] reaches PostgreSQL through a"
                    " connection pooler (PgBouncer): set DATABASE_POOL_MODE to its pool mode,"
                    " session or transaction (docs/django.md)"
                )
            return [f"{m.version:04d}_{m.name}" for m in await schema.migrate(conn)]

    # A thread of its own: works whether or not the caller runs an event loop.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="jobfence-migrate") as pool:
        return pool.submit(asyncio.run, migrate()).result()
