"""The application: the registry of consumers a worker runs."""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, overload

import psycopg
from psycopg import AsyncConnection
from pydantic import BaseModel

from jobfence.errors import ConfigError
from jobfence.limits import name_problem
from jobfence.model import JobMeta, Message
from jobfence.producer import build_message, checked_body
from jobfence.retry import DEFAULT_RETRY_POLICY, RetryPolicy

if TYPE_CHECKING:
    from jobfence.producer import AsyncTarget

P = TypeVar("P", bound=BaseModel)

AsyncHandler = Callable[[P, JobMeta, AsyncConnection[Any]], Awaitable[None]]
# A plain ``def`` handler: it runs in a worker thread and gets a sync psycopg Connection that
# holds the work transaction, the fence already inserted (docs/sync.md).
SyncHandler = Callable[[P, JobMeta, psycopg.Connection[Any]], None]
Handler = AsyncHandler[P] | SyncHandler[P]


class _Register(Protocol[P]):
    """What ``App.consumer(...)`` returns: a decorator for an async or a sync handler."""

    @overload
    def __call__(
        self, handler: Callable[[P, JobMeta, AsyncConnection[Any]], Awaitable[None]]
    ) -> Callable[[P, JobMeta, AsyncConnection[Any]], Awaitable[None]]: ...

    @overload
    def __call__(
        self, handler: Callable[[P, JobMeta, psycopg.Connection[Any]], None]
    ) -> Callable[[P, JobMeta, psycopg.Connection[Any]], None]: ...


def is_generator_handler(handler: object) -> bool:
    """Whether ``handler`` is a generator function, sync or async (or an object whose
    ``__call__`` is one): calling it runs none of its body."""
    call = getattr(handler, "__call__", None)  # noqa: B004 - a callable object's __call__
    return any(
        inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f) for f in (handler, call)
    )


def is_async_handler(handler: object) -> bool:
    """Whether ``handler`` is a coroutine function (or an object whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - a callable object's async __call__
    )


DEFAULT_FENCE_TTL = timedelta(days=7)
# A group holds every one of its jobs' locks until its commit: keep groups short.
MAX_JOBS_PER_TRANSACTION = 100
# A fence kept longer is kept for good; PostgreSQL's timestamps end long after, at 294276 AD.
MAX_FENCE_TTL = timedelta(days=36_500)


@dataclass(frozen=True, slots=True)
class Consumer(Generic[P]):
    """One consumer: its name (the fence's ``consumer``), queue, payload schema and handler.

    ``jobs_per_transaction`` above 1 lets a worker commit up to that many of this consumer's
    waiting jobs in one transaction (group commit, ``docs/concepts.md``): each job still gets its
    fence in the transaction that holds its work; a failing job rolls the group back and its
    jobs run again one transaction each.

    ``sync`` (derived from the handler, not given): the handler is a plain ``def``, run in a
    worker thread on a sync connection (docs/sync.md)."""

    name: str
    queue: str
    schema: type[P]
    handler: Handler[P]
    retry: RetryPolicy = DEFAULT_RETRY_POLICY
    fence_ttl: timedelta = DEFAULT_FENCE_TTL
    jobs_per_transaction: int = 1
    sync: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sync", not is_async_handler(self.handler))

    @property
    def minimum_fence_ttl(self) -> timedelta:
        """D3: the fence must outlive twice the worst-case retry window plus an hour."""
        return self.minimum_fence_ttl_under(0.0)

    def minimum_fence_ttl_under(
        self, lease_seconds: float, max_handler_seconds: float | None = None
    ) -> timedelta:
        """D3's minimum for a worker whose lease is ``lease_seconds``: the hour of margin, or
        twice the lease when that is longer (a job whose ack was lost, its worker killed after
        the commit, comes back when its lease ends, and the fence must still be there); plus
        the worker's ``max_handler_seconds`` when it lets a handler run that long (a fence
        dates from the start of its transaction, and commits up to that much later)."""
        margin = max(3600.0, 2 * lease_seconds) + (max_handler_seconds or 0.0)
        return timedelta(seconds=2 * self.retry.retry_window_seconds + margin)


class App:
    """Consumers registered by name. Workers, the CLI and replay look consumers up here.

    Register with the :meth:`consumer` decorator::

        app = App()

        @app.consumer("award_points", queue="loyalty", schema=AwardPoints)
        async def award_points(payload: AwardPoints, job: JobMeta, tx: AsyncConnection) -> None:
            await tx.execute("UPDATE accounts SET points = points + %s WHERE id = %s", ...)
    """

    def __init__(self) -> None:
        self._consumers: dict[str, Consumer[Any]] = {}

    @property
    def consumers(self) -> Mapping[str, Consumer[Any]]:
        return dict(self._consumers)

    @property
    def queues(self) -> list[str]:
        return sorted({c.queue for c in self._consumers.values()})

    def consumer(
        self,
        name: str,
        *,
        queue: str,
        schema: type[P],
        retry: RetryPolicy = DEFAULT_RETRY_POLICY,
        fence_ttl: timedelta = DEFAULT_FENCE_TTL,
        jobs_per_transaction: int = 1,
    ) -> _Register[P]:
        """Register the decorated function as consumer ``name`` of ``queue``: an ``async def``
        gets the work transaction's ``AsyncConnection``; a plain ``def`` runs in a worker thread
        and gets a sync ``psycopg.Connection`` holding the work transaction (docs/sync.md)."""

        def register(handler: Any) -> Any:
            self.add(
                Consumer(
                    name=name,
                    queue=queue,
                    schema=schema,
                    handler=handler,
                    retry=retry,
                    fence_ttl=fence_ttl,
                    jobs_per_transaction=jobs_per_transaction,
                )
            )
            return handler

        return register  # one function serves both overloads

    def add(self, consumer: Consumer[Any]) -> None:
        for label, value in (("consumer name", consumer.name), ("queue name", consumer.queue)):
            if (problem := name_problem(label, value)) is not None:
                raise ConfigError(problem)
        if consumer.name in self._consumers:
            raise ConfigError(f"consumer {consumer.name!r} is registered twice")
        if not callable(consumer.handler):
            raise ConfigError(f"consumer {consumer.name!r}: the handler must be a function")
        if is_generator_handler(consumer.handler):
            raise ConfigError(
                f"consumer {consumer.name!r}: the handler is a generator function (it yields):"
                " calling it runs none of its body, so no job would be applied; make it a plain"
                " `def` or an `async def` without yield"
            )
        if not (isinstance(consumer.schema, type) and issubclass(consumer.schema, BaseModel)):
            raise ConfigError(f"consumer {consumer.name!r}: schema must be a pydantic model class")
        if not timedelta(0) < consumer.fence_ttl <= MAX_FENCE_TTL:
            raise ConfigError(
                f"consumer {consumer.name!r}: fence_ttl must be positive and at most"
                f" {MAX_FENCE_TTL.days:,} days, got {consumer.fence_ttl}"
            )
        group = consumer.jobs_per_transaction
        if (
            isinstance(group, bool)
            or not isinstance(group, int)
            or not (1 <= group <= MAX_JOBS_PER_TRANSACTION)
        ):
            raise ConfigError(
                f"consumer {consumer.name!r}: jobs_per_transaction must be an integer from 1 to"
                f" {MAX_JOBS_PER_TRANSACTION}, got {group!r}"
            )
        self._consumers[consumer.name] = consumer

    def get(self, name: str) -> Consumer[Any] | None:
        return self._consumers.get(name)

    def message(
        self,
        consumer: str,
        payload: BaseModel | Mapping[str, Any],
        *,
        job_id: str,
        tenant_id: str | None = None,
        correlation_id: str | None = None,
    ) -> Message:
        """Build the message for ``consumer``, checking the payload against its schema.

        Raises :class:`~jobfence.JobRefused` when an identifier breaks a limit (``job_id``
        1-1,024 bytes of UTF-8, ``tenant_id`` at most 200, ``correlation_id`` at most 1,024, no
        NUL character or lone surrogate in any) or when the payload holds what PostgreSQL
        cannot store (a NUL character or a lone surrogate in a string).

        What is checked is the body, as the worker will validate it: a model instance whose
        field was given a value of another type after validation (a nested one too) raises
        pydantic's ``ValidationError`` here, instead of becoming ``SchemaInvalid`` poison."""
        target = self._consumers.get(consumer)
        if target is None:
            raise ConfigError(f"no consumer named {consumer!r} is registered")
        validated = (
            payload if isinstance(payload, target.schema) else target.schema.model_validate(payload)
        )
        body = checked_body(validated)
        target.schema.model_validate(json.loads(body))
        return build_message(
            queue=target.queue,
            consumer=target.name,
            body=body,
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
        """Publish on the caller's connection, never committing it: to the PostgreSQL queue, or,
        when this database's queue is a broker, to the outbox (:mod:`jobfence.outbox`), which
        the relay publishes after the commit.

        Inside the caller's transaction the job exists exactly when that transaction commits.
        ``conn`` is a psycopg ``AsyncConnection``, or a SQLAlchemy ``AsyncSession`` or
        ``AsyncConnection`` on the psycopg driver; anything else raises ``TypeError`` before
        any statement runs (a sync connection has :meth:`enqueue_sync`).
        A job refused (:class:`~jobfence.JobRefused`, see :meth:`message`) is refused before
        any SQL runs, so the caller's transaction stays usable.
        """
        from jobfence.producer import publish_async, require_async_target

        require_async_target(conn)
        await publish_async(
            conn,
            self.message(
                consumer,
                payload,
                job_id=job_id,
                tenant_id=tenant_id,
                correlation_id=correlation_id,
            ),
            delay_seconds=delay_seconds,
        )

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
        """:meth:`enqueue` for sync code: the same message and the same SQL, on the caller's
        sync connection (``psycopg.Connection``, psycopg2, SQLAlchemy ``Session`` or
        ``Connection``), never committing it. The job exists exactly when it commits."""
        from jobfence.producer import publish_sync

        publish_sync(
            conn,
            self.message(
                consumer,
                payload,
                job_id=job_id,
                tenant_id=tenant_id,
                correlation_id=correlation_id,
            ),
            delay_seconds=delay_seconds,
        )

    def check_fence_ttls(
        self, *, lease_seconds: float = 0.0, max_handler_seconds: float | None = None
    ) -> None:
        """D3: refuse consumers whose fence TTL does not cover their retry window, and (for a
        worker whose lease is ``lease_seconds``) twice the lease when that is over an hour, and
        the worker's ``max_handler_seconds`` when it has one."""
        for consumer in self._consumers.values():
            minimum = consumer.minimum_fence_ttl_under(lease_seconds, max_handler_seconds)
            if consumer.fence_ttl < minimum:
                margin = (
                    "1h"
                    if 2 * lease_seconds <= 3600
                    else f"twice the worker's lease of {lease_seconds:g}s, as a job whose ack"
                    " was lost comes back when its lease ends"
                )
                if max_handler_seconds:
                    margin += (
                        f" + the worker's max_handler_seconds of {max_handler_seconds:g}s, as a"
                        " fence dates from the start of its transaction"
                    )
                raise ConfigError(
                    f"consumer {consumer.name!r}: fence TTL {_fmt(consumer.fence_ttl)} is shorter "
                    f"than the minimum {_fmt(minimum)} (2 x retry window "
                    f"{consumer.retry.retry_window_seconds:g}s + {margin}); a late copy after"
                    " expiry would apply the work twice"
                )


def _fmt(delta: timedelta) -> str:
    seconds = delta.total_seconds()
    return f"{seconds:g}s ({seconds / 3600:.2f}h)"
