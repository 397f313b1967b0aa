"""The alert outbox: recorded in the dead letter's own transaction, counted for metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection

from jobfence._sql import Queries

SQL = Queries("jobfence.sql", "alerts.sql")


async def record_dead_letter_alerts(
    conn: AsyncConnection[Any], dead_letter_ids: Sequence[int]
) -> None:
    """Record that these dead letters need alerting, on the caller's connection.

    Call it inside the transaction that inserted the dead letters, with the ids that insert
    returned: the outbox rows then commit (or roll back) with them, so a committed dead letter
    always has its alert recorded, and a dead letter that was not inserted (a redelivered
    failure, D5) records nothing. Never commits.
    """
    if dead_letter_ids:
        await conn.execute(SQL["outbox_record"], {"dead_letter_ids": list(dead_letter_ids)})


@dataclass(frozen=True, slots=True)
class AlertCounts:
    """Alerts by state, for gauges.

    ``pending``: incidents waiting to be delivered (retries included); ``sent``, ``failed``
    (refused for good: 401, 422...) and ``cancelled`` (an escalation whose dead letters were all
    resolved before it went out) since the beginning. ``dead_letters_awaiting_alert``: dead
    letters recorded but not yet covered by a delivered or failed incident (grouping windows
    still open included). ``oldest_pending_at``: when the oldest pending alert was created.
    """

    pending: int
    sent: int
    failed: int
    cancelled: int
    dead_letters_awaiting_alert: int
    oldest_pending_at: datetime | None


async def alert_counts(conn: AsyncConnection[Any]) -> AlertCounts:
    cur = await conn.execute(SQL["alert_counts"])
    row = await cur.fetchone()
    assert row is not None
    pending, sent, failed, cancelled, awaiting, oldest = row
    return AlertCounts(
        pending=int(pending),
        sent=int(sent),
        failed=int(failed),
        cancelled=int(cancelled),
        dead_letters_awaiting_alert=int(awaiting),
        oldest_pending_at=oldest,
    )
