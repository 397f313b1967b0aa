"""One dead letter whole: for ``show``, its payload's bytes, and its JSON rendering."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection

from jobfence._sql import Queries
from jobfence.codec import MalformedPayload, original_body
from jobfence.dead_letters import (
    DeadLetter,
    get_dead_letter,
)
from jobfence.errors import DeadLetterNotFound, DeadLetterNotReplayable

SQL = Queries("jobfence.sql", "ops.sql")


@dataclass(frozen=True, slots=True)
class DeadLetterDetail:
    dead_letter: DeadLetter
    fence_exists: bool


async def show_dead_letter(conn: AsyncConnection[Any], dead_letter_id: int) -> DeadLetterDetail:
    """One dead letter whole, and whether a fence row exists for its (job_id, consumer)."""
    letter = await get_dead_letter(conn, dead_letter_id)
    cur = await conn.execute(
        SQL["fence_exists_for"], {"job_id": letter.job_id, "consumer": letter.consumer}
    )
    row = await cur.fetchone()
    return DeadLetterDetail(dead_letter=letter, fence_exists=bool(row and row[0]))


async def payload_body(conn: AsyncConnection[Any], dead_letter_id: int) -> bytes:
    """The bytes a replay of the dead letter publishes: the original bytes of a base64 payload,
    the stored JSON document's text (UTF-8) otherwise."""
    cur = await conn.execute(SQL["payload_body"], {"id": dead_letter_id})
    row = await cur.fetchone()
    if row is None:
        raise DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
    try:
        return original_body(row[0], row[1])
    except MalformedPayload as exc:  # a row written by hand: no bytes a replay could publish
        raise DeadLetterNotReplayable(dead_letter_id, str(exc), unreadable=True) from None


async def show_dead_letter_json(conn: AsyncConnection[Any], dead_letter_id: int) -> str:
    """What :func:`show_dead_letter` reads, as the API's JSON, rendered by PostgreSQL in one
    statement (see :func:`list_dead_letters_json`)."""
    cur = await conn.execute(SQL["show_json"], {"id": dead_letter_id})
    row = await cur.fetchone()
    if row is None:
        raise DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
    text: str = row[0]
    return text
