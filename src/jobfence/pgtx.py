"""A transaction whose BEGIN travels with its first statement, in one round trip.

``conn.transaction()`` sends BEGIN and waits for the answer before the first statement goes out.
On the job path that is one round trip per job for nothing: :func:`begin_with` queues BEGIN and
the first statement in psycopg's pipeline mode, leaves the pipeline once both have answered, and
from there on behaves like ``conn.transaction()``: statements run one at a time as usual (their
``rowcount`` and results as usual), ``conn.commit()`` inside it is refused, a nested
``conn.transaction()`` is a savepoint, and leaving the block commits, or rolls back on an
exception.

It enters psycopg's :class:`~psycopg.AsyncTransaction` itself: entering ``conn.transaction()``
inside a pipeline would also open nested pipelines that outlive ours, and every later statement
would then run pipelined (``rowcount`` of -1).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg import AsyncConnection, AsyncCursor
from psycopg.sql import SQL, Composed


@asynccontextmanager
async def begin_with(
    conn: AsyncConnection[Any], query: str | bytes | SQL | Composed, params: Mapping[str, Any]
) -> AsyncIterator[AsyncCursor[Any]]:
    """Open a transaction on ``conn`` (an autocommit connection) with ``query`` as its first
    statement; yield that statement's cursor."""
    tx = psycopg.AsyncTransaction(conn)
    entered = False
    try:
        async with conn.pipeline():
            await tx.__aenter__()
            entered = True
            cur = await conn.execute(query, params)
        yield cur
    except BaseException as exc:
        if entered and await tx.__aexit__(type(exc), exc, exc.__traceback__):
            return
        raise
    await tx.__aexit__(None, None, None)
