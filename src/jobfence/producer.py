"""Enqueueing from outside a worker's App: by consumer name, and on sync connections.

Every producer path is two steps. First the message is built, in one place per path:
:meth:`jobfence.App.message` when the payload's schema is known, :func:`build_message` when only
the consumer's name is. Then the one named query ``produce`` of ``sql/outbox.sql`` runs on
the caller's connection, never committing it: :func:`publish_async` for a psycopg
``AsyncConnection`` or SQLAlchemy's asyncio sessions, :func:`publish_sync` for a sync one. That
query is where the queue is chosen: it writes the PostgreSQL queue's row, or, when this
database's queue is an external broker (``jobfence.settings``), the outbox row the relay
publishes after the commit (:mod:`jobfence.outbox`). There is no second, sync core: a sync producer
differs only in how it hands the same statement to its driver.

Sync connections accepted: ``psycopg.Connection``; a psycopg2 connection (``jobfence[psycopg2]``);
a SQLAlchemy 2.x ``Session`` or ``Connection`` on the psycopg or psycopg2 driver
(``jobfence[sqlalchemy]``). Async: a psycopg ``AsyncConnection``, or a SQLAlchemy
``AsyncSession`` or ``AsyncConnection`` on the psycopg driver. psycopg2 and SQLAlchemy are
never imported here: a connection of theirs can only exist once its program has imported them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import psycopg
from psycopg import AsyncConnection
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError

from jobfence import tracing
from jobfence.adapters.pg_queue import publish_params, require_async_connection
from jobfence.codec import encode_payload, payload_problem
from jobfence.errors import ConfigError, JobRefused
from jobfence.limits import MAX_BODY_BYTES, identifiers_problem, message_size_problem
from jobfence.model import Message
from jobfence.outbox import SQL

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncSession

# What the async producers accept; SQLAlchemy's types are only named here, never imported.
AsyncTarget: TypeAlias = "AsyncConnection[Any] | AsyncSession | SAAsyncConnection"

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
# SQLAlchemy drivers whose paramstyle is the ``%(name)s`` of the named queries.
_SQLALCHEMY_DRIVERS = ("psycopg", "psycopg2")
_SYNC_KINDS = "a psycopg.Connection, a psycopg2 connection, or a SQLAlchemy Session or Connection"


def build_message(
    *,
    queue: str,
    consumer: str,
    body: bytes,
    job_id: str,
    tenant_id: str | None,
    correlation_id: str | None,
) -> Message:
    """The one step that turns an enqueue (typed or by name) into a :class:`Message`.

    Raises :class:`~jobfence.JobRefused`, before any SQL, when an identifier breaks a limit
    or the body is over ``MAX_BODY_BYTES`` (:mod:`jobfence.limits`)."""
    require_body_size(body)
    found = identifiers_problem(
        queue=queue,
        consumer=consumer,
        job_id=job_id,
        tenant_id=tenant_id,
        correlation_id=correlation_id,
    )
    if found is not None:
        raise JobRefused(*found)
    return Message(
        queue=queue,
        consumer=consumer,
        job_id=job_id,
        body=body,
        tenant_id=tenant_id,
        correlation_id=correlation_id,
    )


def require_body_size(body: bytes) -> None:
    """:class:`~jobfence.JobRefused` naming ``payload`` when ``body`` is over ``MAX_BODY_BYTES``:
    its dead letter could not hold it (the message gives its size, never its content)."""
    if len(body) > MAX_BODY_BYTES:
        raise JobRefused(
            "payload",
            f"payload is {len(body):,} bytes, over the limit of {MAX_BODY_BYTES:,} (64 MiB):"
            " a dead letter must be able to hold it; send a reference to the data instead",
        )


def checked_body(payload: BaseModel | Mapping[str, Any]) -> bytes:
    """``payload`` serialised, or :class:`~jobfence.JobRefused` when it holds what PostgreSQL
    cannot store (a NUL character or a lone surrogate in a string)."""
    try:
        body = encode_payload(payload if isinstance(payload, BaseModel) else dict(payload))
    except (UnicodeEncodeError, PydanticSerializationError) as exc:
        if "surrogate" not in str(exc):
            raise
        raise JobRefused(
            "payload", "payload contains a lone surrogate, which is not valid Unicode"
        ) from None
    if (problem := payload_problem(body)) is not None:
        raise JobRefused("payload", problem)
    return body


def require_async_target(conn: object) -> None:
    """Refuse, before any statement, what :func:`publish_async` cannot run on."""
    if isinstance(conn, AsyncConnection) or _is_sqlalchemy_async(conn):
        return
    require_async_connection(conn)  # raises TypeError, saying what to pass instead


async def publish_async(conn: AsyncTarget, message: Message, *, delay_seconds: float = 0.0) -> None:
    """Insert ``message`` on an async connection without committing it (the ``produce`` query:
    the queue row, or the outbox row when the queue is external): a psycopg
    ``AsyncConnection``, or a SQLAlchemy ``AsyncSession`` or ``AsyncConnection`` on the psycopg
    driver. Anything else raises ``TypeError`` before a statement runs. The job carries the
    current trace context, under a ``create`` span (:mod:`jobfence.tracing`). A body over
    ``MAX_BODY_BYTES`` raises :class:`~jobfence.JobRefused` before any statement."""
    require_body_size(message.body)
    if isinstance(conn, AsyncConnection):
        with tracing.create(message) as traced:
            cur = await conn.execute(SQL[_query(traced)], publish_params(traced, delay_seconds))
            _check_produced(await cur.fetchone(), message)
        return
    require_async_target(conn)
    sa_conn: Any = conn
    if _is_sqlalchemy_session(conn):
        sa_conn = await sa_conn.connection()  # the AsyncConnection of the session's transaction
    _require_sqlalchemy_driver(sa_conn, "enqueue")
    # Through SQLAlchemy, so that its transaction begins and covers the job (see publish_sync).
    with tracing.create(message) as traced:
        result = await sa_conn.exec_driver_sql(
            SQL.text(_query(traced)), publish_params(traced, delay_seconds)
        )
        _check_produced(result.fetchone(), message)


def _check_produced(row: Any, message: Message) -> None:
    """The ``produce`` query's answer: :class:`~jobfence.JobRefused` when it wrote nothing
    because the body is over the largest message the external queue's broker accepts (the
    statement raised nothing, so the caller's transaction is untouched)."""
    if row is not None and row[0] is None and row[1] is not None:
        raise JobRefused("payload", message_size_problem(len(message.body), row[1], row[2]))


def publish_sync(conn: object, message: Message, *, delay_seconds: float = 0.0) -> None:
    """Insert ``message`` on a sync connection without committing it (the ``produce`` query).

    The job exists exactly when the caller's transaction commits. A connection of any other
    kind is refused with a ``TypeError`` before a statement runs.

    The job carries the current trace context, under a ``create`` span (:mod:`jobfence.tracing`).
    A body over ``MAX_BODY_BYTES`` raises :class:`~jobfence.JobRefused` before any statement.
    """
    require_body_size(message.body)
    with tracing.create(message) as traced:
        _publish_sync(conn, traced, publish_params(traced, delay_seconds))


def _query(message: Message) -> str:
    """``produce``, or ``produce_traced`` for a job with a trace context (migration 0021)."""
    return "produce" if message.traceparent is None else "produce_traced"


def _publish_sync(conn: object, message: Message, params: dict[str, object]) -> None:
    query = _query(message)
    if isinstance(conn, psycopg.Connection):
        _check_produced(conn.execute(SQL[query], params).fetchone(), message)
        return
    if _is_psycopg2(conn):
        with conn.cursor() as cur:  # type: ignore[attr-defined]
            cur.execute(SQL.text(query), params)
            _check_produced(cur.fetchone(), message)
        return
    sa_conn = _sqlalchemy_connection(conn)
    if sa_conn is not None:
        _require_sqlalchemy_driver(sa_conn, "enqueue_sync")
        # Through SQLAlchemy, so that its own transaction begins (autobegin) and its commit or
        # rollback covers the job; a statement run behind its back on the DBAPI connection
        # would be rolled back when the connection returns to the pool.
        _check_produced(sa_conn.exec_driver_sql(SQL.text(query), params).fetchone(), message)
        return
    if isinstance(conn, AsyncConnection):
        raise TypeError(
            "enqueue_sync needs a sync connection, got psycopg.AsyncConnection:"
            " use `await app.enqueue(conn, ...)` or `await producer.enqueue(conn, ...)`"
        )
    raise TypeError(f"enqueue_sync needs {_SYNC_KINDS}, got {_kind(conn)}")


def _kind(conn: object) -> str:
    cls = type(conn)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_psycopg2(conn: object) -> bool:
    extensions = sys.modules.get("psycopg2.extensions")
    return extensions is not None and isinstance(conn, extensions.connection)


def _require_sqlalchemy_driver(sa_conn: Any, what: str) -> None:
    driver = sa_conn.dialect.driver
    if driver not in _SQLALCHEMY_DRIVERS:
        raise TypeError(
            f"{what} on SQLAlchemy needs the psycopg or psycopg2 driver, got {driver!r}"
            " (use a postgresql+psycopg:// or postgresql+psycopg2:// URL)"
        )


def _is_sqlalchemy_session(conn: object) -> bool:
    asyncio_ext = sys.modules.get("sqlalchemy.ext.asyncio")
    return asyncio_ext is not None and isinstance(conn, asyncio_ext.AsyncSession)


def _is_sqlalchemy_async(conn: object) -> bool:
    asyncio_ext = sys.modules.get("sqlalchemy.ext.asyncio")
    return asyncio_ext is not None and isinstance(
        conn, asyncio_ext.AsyncSession | asyncio_ext.AsyncConnection
    )


def _sqlalchemy_connection(conn: object) -> Any:
    """The SQLAlchemy ``Connection`` behind a ``Session`` or ``Connection``, else None."""
    orm = sys.modules.get("sqlalchemy.orm")
    if orm is not None and isinstance(conn, orm.Session):
        return conn.connection()  # the Connection that holds the session's transaction
    engine = sys.modules.get("sqlalchemy.engine")
    if engine is not None and isinstance(conn, engine.Connection):
        return conn
    return None


class Producer:
    """Enqueues jobs by consumer name, without importing the consumer's code.

    ``routes`` maps each consumer name this producer may address to its queue, the two things
    a message needs besides its payload::

        producer = Producer(routes={"award_points": "loyalty"})
        producer.enqueue_sync(conn, "award_points", {"account_id": 7, "points": 10},
                              job_id="order-1:points")

    Routes are configuration, given once, rather than an argument of every call: the queue of a
    consumer is a deployment fact that a typo in one call site must not change. The payload is a
    mapping or a pydantic model; it is not validated here (the producer has no schema): the
    worker's App validates it, and a payload its schema rejects becomes a poison dead letter
    (``attempts = 1``), exactly as from any other producer. Use :meth:`jobfence.App.enqueue`
    to validate before enqueueing when the producer has the schema.
    """

    def __init__(self, *, routes: Mapping[str, str]) -> None:
        for consumer, queue in routes.items():
            for label, value in (("consumer name", consumer), ("queue name", queue)):
                if not isinstance(value, str) or not _NAME.match(value):
                    raise ConfigError(
                        f"Producer routes: {label} {value!r} must be 1-200 characters of"
                        " letters, digits and _ . : -"
                    )
        self._routes = dict(routes)

    @property
    def routes(self) -> Mapping[str, str]:
        return dict(self._routes)

    def message(
        self,
        consumer: str,
        payload: BaseModel | Mapping[str, Any],
        *,
        job_id: str,
        tenant_id: str | None = None,
        correlation_id: str | None = None,
    ) -> Message:
        """The message for ``consumer``, its payload serialised but not validated."""
        queue = self._routes.get(consumer)
        if queue is None:
            known = ", ".join(sorted(self._routes)) or "none"
            raise ConfigError(
                f"this Producer has no route for consumer {consumer!r} (it knows: {known});"
                " add it to Producer(routes={...})"
            )
        if not isinstance(payload, BaseModel | Mapping):
            raise TypeError(
                f"payload must be a mapping or a pydantic model, got {type(payload).__name__}"
            )
        return build_message(
            queue=queue,
            consumer=consumer,
            body=checked_body(payload),
            job_id=job_id,
            tenant_id=tenant_id,
            correlation_id=correlation_id,
        )

    async def enqueue(
        self,
        conn: AsyncTarget,
        consumer: str,
        payload: BaseModel | Mapping[str, Any],
        *,
        job_id: str,
        tenant_id: str | None = None,
        correlation_id: str | None = None,
        delay_seconds: float = 0.0,
    ) -> None:
        """Publish on the caller's async connection (see :func:`publish_async`), never
        committing it: the job exists exactly when that transaction commits."""
        require_async_target(conn)
        message = self.message(
            consumer, payload, job_id=job_id, tenant_id=tenant_id, correlation_id=correlation_id
        )
        await publish_async(conn, message, delay_seconds=delay_seconds)

    def enqueue_sync(
        self,
        conn: object,
        consumer: str,
        payload: BaseModel | Mapping[str, Any],
        *,
        job_id: str,
        tenant_id: str | None = None,
        correlation_id: str | None = None,
        delay_seconds: float = 0.0,
    ) -> None:
        """Publish on the caller's sync connection (see :func:`publish_sync`), never committing
        it: the job exists exactly when that transaction commits."""
        message = self.message(
            consumer, payload, job_id=job_id, tenant_id=tenant_id, correlation_id=correlation_id
        )
        publish_sync(conn, message, delay_seconds=delay_seconds)
