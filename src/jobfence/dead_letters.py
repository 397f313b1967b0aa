"""Dead letters at the library level: read one, replay it (D8), discard it with a reason."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection, AsyncCursor, IsolationLevel
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from jobfence import outbox, tracing
from jobfence.codec import (
    PAYLOAD_MESSAGE,
    MalformedPayload,
    identifier_problem,
    original_body,
    original_message,
)
from jobfence.errors import (
    DeadLetterConflict,
    DeadLetterNotFound,
    DeadLetterNotReplayable,
    QueueMoved,
)
from jobfence.harness import SQL
from jobfence.model import Message
from jobfence.pgtx import begin_with
from jobfence.ports import QueuePort

MAX_DISCARD_REASON = 2000
# What the CLI and the API say about a reason they refuse.
BLANK_DISCARD_REASON = "a discard requires a non-blank reason"
LONG_DISCARD_REASON = f"a discard reason is at most {MAX_DISCARD_REASON} characters"


# A replay and a discard are written for READ COMMITTED: their UPDATE of a row a concurrent
# replay or discard changed re-reads it after the wait and finds it no longer pending (a clear
# conflict). At REPEATABLE READ or SERIALIZABLE, which a database may set as its default
# (default_transaction_isolation) for the application's own code, that UPDATE fails instead
# with a serialization failure; so they pin their level.
RESOLVE_ISOLATION = IsolationLevel.READ_COMMITTED


def _check_actor(resolved_by: str) -> None:
    if not resolved_by or not resolved_by.strip():
        raise ValueError("resolved_by must name who resolves the dead letter")


@dataclass(frozen=True, slots=True)
class DeadLetter:
    id: int
    job_id: str
    queue: str
    consumer: str
    tenant_id: str | None
    payload: Any
    payload_encoding: str
    attempts: int
    last_error: str
    error_class: str
    correlation_id: str | None
    status: str
    discard_reason: str | None
    created_at: datetime
    resolved_at: datetime | None
    resolved_by: str | None
    # The W3C traceparent of the failed attempt's process span (jobfence.tracing), if traced.
    traceparent: str | None = None

    @property
    def trace_id(self) -> str | None:
        """The trace id of the attempt that failed (32 hex digits), when it was traced."""
        return tracing.trace_id_of(self.traceparent)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay did. ``published`` is False when the job's fence row already existed
    (``already_processed``): the dead letter moved to replayed without republishing, because
    the fence would skip the job anyway. ``message`` is what was (or would have been) sent."""

    dead_letter_id: int
    message: Message
    published: bool = True

    @property
    def already_processed(self) -> bool:
        return not self.published


async def get_dead_letter(conn: AsyncConnection[Any], dead_letter_id: int) -> DeadLetter:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(SQL["dead_letter_get"], {"id": dead_letter_id})
        row = await cur.fetchone()
    if row is None:
        raise DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
    return DeadLetter(**row)


async def _not_pending(cur: AsyncCursor[Any], dead_letter_id: int) -> Exception:
    """Why a status change found no pending row: unknown id (404) or its current status (409)."""
    status = await cur.connection.execute(SQL["dead_letter_status"], {"id": dead_letter_id})
    found = await status.fetchone()
    if found is None:
        return DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
    return DeadLetterConflict(dead_letter_id, found[0])


def replay_message(row: Mapping[str, Any]) -> Message:
    """D8: the message a replay publishes, from a dead letter's row (its columns, with the
    payload as text in ``payload_text``): the original bytes, the same job_id and
    correlation_id, to the consumer that failed only.

    A dead letter that kept its whole message (``payload_encoding`` ``message``) gives back
    that message, identifiers as they were; if one of them breaks a limit the message can
    never be fenced, and :class:`~jobfence.DeadLetterNotReplayable` is raised instead."""
    dead_letter_id = row.get("id", row.get("dead_letter_id", 0))
    try:
        if row["payload_encoding"] == PAYLOAD_MESSAGE:
            message = original_message(row["payload_text"])
            problem = identifier_problem(message)
            if problem is not None:
                raise DeadLetterNotReplayable(dead_letter_id, problem)
            return message
        body = original_body(row["payload_text"], row["payload_encoding"])
    except MalformedPayload as exc:  # a row written by hand
        raise DeadLetterNotReplayable(dead_letter_id, str(exc), unreadable=True) from None
    return Message(
        queue=row["queue"],
        consumer=row["consumer"],
        job_id=row["job_id"],
        body=body,
        tenant_id=row["tenant_id"],
        correlation_id=row["correlation_id"],
    )


async def replay_dead_letter(
    pool: AsyncConnectionPool[Any],
    queue: QueuePort,
    dead_letter_id: int,
    *,
    resolved_by: str,
) -> ReplayResult:
    """D8: republish the original payload with the same job_id and correlation_id, to the
    consumer that failed only, and move the dead letter to ``replayed``.

    A dead letter whose job already has its fence row (it succeeded on a later delivery) is
    moved to replayed without republishing: the fence would skip the job anyway.

    With a transactional queue (the PostgreSQL one) the publish and the transition commit
    together. With an external broker the message is written to the outbox
    (:mod:`jobfence.outbox`) in the transaction that makes the transition: both commit or
    neither does, so a dead letter is never ``replayed`` without its message on its way; the
    outbox relay publishes it after the commit (at least once; the fence absorbs a repeat).
    """
    _check_actor(resolved_by)
    params = {"id": dead_letter_id, "resolved_by": resolved_by}
    # The status changes first and commits with the publish (or the outbox row): three round
    # trips (BEGIN with the UPDATE, the publish, COMMIT). A publish that fails rolls it back.
    async with (
        pool.connection() as conn,
        begin_with(
            conn, SQL["dead_letter_claim_replay"], params, isolation=RESOLVE_ISOLATION
        ) as cur,
    ):
        row = await cur.fetchone()
        if row is None:
            raise await _not_pending(cur, dead_letter_id)
        assert cur.description is not None
        record = {column.name: value for column, value in zip(cur.description, row, strict=True)}
        message = replay_message(record)
        published = not record["fenced"]
        if published:
            await publish_with(
                conn, queue, message, actor=resolved_by, failed=record["traceparent"]
            )
    return ReplayResult(dead_letter_id=dead_letter_id, message=message, published=published)


async def publish_with(
    conn: AsyncConnection[Any],
    queue: QueuePort,
    message: Message,
    *,
    actor: str,
    failed: str | None,
    external: bool | None = None,
) -> bool | None:
    """A replay's publish inside the transaction on ``conn`` that marks its dead letter
    ``replayed``: on the queue itself when it is transactional, else as an outbox row.

    Where the database's jobs go is read first (:func:`outbox.external_after_moves`), as a
    producer's statement reads it, once any move in progress is over: a replay from the
    PostgreSQL queue that raced ``jobfence migrate --queue-url`` to a broker writes the outbox
    of the new queue, not the table no worker reads any more; one from a broker that raced a
    move back to the PostgreSQL queue is refused (:class:`~jobfence.errors.QueueMoved`), not
    written to an outbox no relay publishes any more. ``external``: what an earlier call in
    the same transaction read and returned (a bulk replay's chunk reads it once); the return
    value is what this call read (None for a queue no database records: memory://).

    It runs under a ``replay`` span with the ``actor``, linked to the failed attempt's span
    (``failed``: the dead letter's traceparent); the message carries the replay's context."""
    capabilities = queue.capabilities
    if external is None and capabilities.recorded:
        external = await outbox.external_after_moves(conn)
    with tracing.replay(message, failed=failed, actor=actor) as traced:
        if capabilities.transactional and not external:
            await queue.publish(traced, tx=conn)
            return external
        if not capabilities.transactional and capabilities.recorded and not external:
            raise QueueMoved(
                "this database's jobs now go to the postgresql queue (it was moved after this"
                " process started), and this process publishes to a broker: nothing was"
                " replayed; replay it again from a process on the PostgreSQL queue"
            )
        await outbox.write(conn, traced)
    return external


async def discard_dead_letter(
    pool: AsyncConnectionPool[Any],
    dead_letter_id: int,
    *,
    reason: str,
    resolved_by: str,
) -> DeadLetter:
    """Move a pending dead letter to ``discarded``. A blank reason is refused here, and by the
    database's own constraint if this check is bypassed."""
    if not reason or not reason.strip():
        raise ValueError(BLANK_DISCARD_REASON)
    if len(reason) > MAX_DISCARD_REASON:
        raise ValueError(LONG_DISCARD_REASON)
    _check_actor(resolved_by)
    params = {"id": dead_letter_id, "reason": reason, "resolved_by": resolved_by}
    async with (
        pool.connection() as conn,
        begin_with(conn, SQL["dead_letter_discard"], params, isolation=RESOLVE_ISOLATION) as cur,
    ):
        row = await cur.fetchone()
        if row is None:
            raise await _not_pending(cur, dead_letter_id)
        assert cur.description is not None
        return DeadLetter(**{c.name: v for c, v in zip(cur.description, row, strict=True)})
