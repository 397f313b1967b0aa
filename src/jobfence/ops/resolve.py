"""Resolving one dead letter: replay (D8) or discard, as the Ops edges call them."""

from __future__ import annotations

from typing import Any

from psycopg_pool import AsyncConnectionPool

from jobfence.dead_letters import (
    DeadLetter,
    ReplayResult,
    discard_dead_letter,
    replay_dead_letter,
)
from jobfence.ports import QueuePort


async def replay(
    pool: AsyncConnectionPool[Any], queue: QueuePort, dead_letter_id: int, *, actor: str
) -> ReplayResult:
    return await replay_dead_letter(pool, queue, dead_letter_id, resolved_by=actor)


async def discard(
    pool: AsyncConnectionPool[Any], dead_letter_id: int, *, reason: str, actor: str
) -> DeadLetter:
    return await discard_dead_letter(pool, dead_letter_id, reason=reason, resolved_by=actor)
