"""jobfence's schema on a Django database: jobfence's own migration runner, on the database
of ``DATABASES``; called by the app's Django migration and after every ``manage.py migrate``."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import psycopg

from jobfence import schema
from jobfence.contrib.django.settings import database_url, jobfence_settings


def apply_schema(using: str) -> list[str]:
    """Apply the pending jobfence migrations to ``DATABASES[using]`` when it is jobfence's
    database (``JOBFENCE["DATABASE_ALIAS"]``); the names applied. Idempotent, under jobfence's
    advisory lock, in its own transaction on its own connection."""
    if using != jobfence_settings().database_alias:
        return []
    url = database_url(using)

    async def migrate() -> list[str]:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            return [f"{m.version:04d}_{m.name}" for m in await schema.migrate(conn)]

    # A thread of its own: works whether or not the caller runs an event loop.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="jobfence-migrate") as pool:
        return pool.submit(asyncio.run, migrate()).result()
