"""Where a database's jobs go: the record in ``jobfence.settings``, compared by every command and
changed by one explicit step.

Producers read the record, not ``JOBFENCE_QUEUE_URL``: they write the PostgreSQL queue's table,
or the outbox when the record names a broker. So a command given a queue only compares it with
the record (:func:`adopt_queue`: the kind and the place, :attr:`QueueTarget.place`), and
refuses any difference at start-up, changing nothing. :func:`move_queue` (``jobfence migrate
--queue-url URL``) is the one step that changes the record, refused while the queue it leaves
still holds messages: the PostgreSQL queue's table, the outbox, or the broker
(:meth:`~jobfence.ports.QueuePort.backlog`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg import AsyncConnection

from jobfence.config import ENV_QUEUE_URL
from jobfence.errors import ConfigError
from jobfence.outbox import (
    RELAY_LOCK_KEY,
    QueueSetting,
    broker_queues,
    queue_setting,
    record_queue,
)
from jobfence.outbox import SQL as OUTBOX_SQL
from jobfence.queues import QueueTarget, open_broker, parse_queue_url
from jobfence.redact import redact_url

log = logging.getLogger("jobfence.queues")


def _shown(location: str | None) -> str:
    """A recorded location as one line: control characters escaped, at most 300 characters."""
    if not location:
        return "?"
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in location)
    return text if len(text) <= 300 else f"{text[:300]}..."


def _recorded(current: QueueSetting) -> str:
    if not current.external:
        return "the PostgreSQL queue"
    return f"the {current.kind} queue at {_shown(current.location)} (through the outbox)"


def _same_place(current: QueueSetting, target: QueueTarget) -> bool:
    """Whether ``target`` names the queue the database records: the same kind and, for a
    broker, the same :attr:`QueueTarget.place` as the recorded location's (a location the
    parser refuses names no place a command can be given)."""
    if current.kind != target.kind:
        return False
    if not current.external:
        return True
    try:
        recorded = parse_queue_url(current.location).place if current.location else None
    except ConfigError:
        return False
    return recorded is not None and recorded == target.place


async def adopt_queue(conn: AsyncConnection[Any], target: QueueTarget) -> None:
    """Check that ``target`` is where this database's jobs go (``jobfence.settings``), so
    that nothing is published or consumed where the others do not look.

    The kind and the place (:attr:`QueueTarget.place`: servers, virtual host, database number,
    prefix, stream) must both match; any difference is refused with a
    :class:`~jobfence.errors.ConfigError` naming both queues (never a password), and nothing
    changes. Only :func:`move_queue` (``jobfence migrate --queue-url URL``) changes the record.
    """
    current = await queue_setting(conn)
    if _same_place(current, target):
        return
    same_kind = current.external and current.kind == target.kind
    raise ConfigError(
        redact_url(
            target.url or "",
            f"this database's jobs go to {_recorded(current)}, but this command was given "
            f"{target.describe()}{' (another address of that broker)' if same_kind else ''}:"
            f" nothing was changed. Set {ENV_QUEUE_URL} (or --queue-url) to the queue the"
            " database records, or move the database with `jobfence migrate --queue-url URL`"
            " (postgresql for the PostgreSQL queue)",
        )
    )


async def _left_behind(
    conn: AsyncConnection[Any], current: QueueSetting, leaving_url: str | None
) -> int:
    """How many messages the broker this database leaves still holds."""
    if leaving_url is not None:
        leaving = parse_queue_url(leaving_url)
        unknown = leaving.kind == current.kind and not current.location  # no address recorded
        if not unknown and not _same_place(current, leaving):
            raise ConfigError(
                f"--from-queue-url names {leaving.describe()}, but this database's jobs go to "
                f"{_recorded(current)}: give that queue's URL, the one the move leaves"
            )
    elif current.location:
        leaving = parse_queue_url(current.location)
    else:
        raise ConfigError(
            f"this database records the {current.kind} queue without its address: a move first"
            " counts what that queue still holds, so give its URL with --from-queue-url URL"
        )
    try:
        queue = await open_broker(leaving)
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}. A move first counts what the queue it leaves still holds: give that "
            "queue's full URL (with its password) with --from-queue-url URL"
        ) from None
    try:
        return await queue.backlog(await broker_queues(conn))
    except Exception as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise ConfigError(
            f"cannot count what {leaving.describe()} still holds: "
            f"{redact_url(leaving.url or '', reason)}"
        ) from None
    finally:
        await queue.close()


@contextlib.asynccontextmanager
async def _no_relay_publishing(
    conn: AsyncConnection[Any], current: QueueSetting
) -> AsyncIterator[None]:
    """Leaving a broker: hold the outbox relay's lock while the broker is counted and the
    record changes, so that no relay publishes to it after the count; refused while a relay
    holds it (it would go on publishing to the broker left behind)."""
    if not current.external:
        yield
        return
    cur = await conn.execute(OUTBOX_SQL["outbox_try_lock"], {"key": RELAY_LOCK_KEY})
    row = await cur.fetchone()
    if row is None or not row[0]:
        raise ConfigError(
            f"an outbox relay is publishing to {_recorded(current)}: stop it (jobfence"
            " outbox-relay, and the workers' own relay: restart them with --no-outbox-relay)"
            " before the move, or it goes on publishing there"
        )
    try:
        yield
    finally:
        # (In a failed transaction the lock stays until the session ends: move_queue is
        # meant for an autocommit connection.)
        with contextlib.suppress(psycopg.Error):
            await conn.execute(OUTBOX_SQL["outbox_unlock"], {"key": RELAY_LOCK_KEY})


async def move_queue(
    conn: AsyncConnection[Any],
    target: QueueTarget,
    *,
    leaving_url: str | None = None,
    new_address: bool = False,
) -> bool:
    """The one step that changes where this database's jobs go (``jobfence migrate
    --queue-url URL``), on an autocommit connection. Returns False, changing nothing, when
    ``target`` already names the recorded place.

    Refused (:class:`~jobfence.errors.ConfigError`, nothing changed) for ``memory://`` (it
    lives inside one process), for another address of the broker kind already recorded unless
    ``new_address`` confirms it, for a broker that cannot be opened, and while the queue it
    leaves still holds messages: the PostgreSQL queue's table, the outbox when moving back to
    PostgreSQL, or the broker (:meth:`~jobfence.ports.QueuePort.backlog`, opened with
    ``leaving_url``, else with the recorded location, which has no password)."""
    if target.kind == "memory":
        raise ConfigError(
            "memory:// lives inside one process: it is never recorded in a database (give a"
            " broker's URL, or postgresql)"
        )
    current = await queue_setting(conn)
    if _same_place(current, target):
        return False
    if current.external and current.kind == target.kind and not new_address:
        raise ConfigError(
            f"{target.describe()} is another address of the {target.kind} broker this "
            f"database's jobs go to ({_shown(current.location)}): what the queue there still "
            "holds would be left where no worker reads it. Once its workers emptied it (jobfence"
            " worker APP --until empty) and stopped, confirm the move with --new-address"
        )
    if target.external:  # a bad or unreachable URL is refused before anything changes
        await (await open_broker(target)).close()
    async with _no_relay_publishing(conn, current):
        if current.external and current.kind != "memory":
            left = await _left_behind(conn, current, leaving_url)
            if left:
                raise ConfigError(
                    f"the {current.kind} queue at {_shown(current.location)} still holds {left}"
                    " message(s): run its workers until it is empty (jobfence worker APP"
                    " --until empty), stop them, then move"
                )
        await record_queue(conn, target.kind, target.location)
    log.info(
        "this database's jobs now go to %s%s (they went to %s)",
        target.describe(),
        " through the outbox" if target.external else "",
        _recorded(current),
    )
    return True
