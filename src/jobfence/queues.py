"""Which queue a command uses: ``JOBFENCE_QUEUE_URL`` / ``--queue-url``, resolved to an adapter.

Unset (or ``postgresql``), the queue is the PostgreSQL one in the jobfence database. Otherwise
the URL's scheme picks a broker adapter from a small registry, imported only when used:

========================  ===============================  ==============================
scheme                    adapter module                   extra
========================  ===============================  ==============================
``amqp://``, ``amqps://``  ``jobfence.adapters.rabbitmq``      ``jobfence[rabbitmq]``
``nats://``               ``jobfence.adapters.nats``          ``jobfence[nats]``
``redis://``, ``rediss://``  ``jobfence.adapters.redis_streams``  ``jobfence[redis]``
``memory://``             :class:`~jobfence.MemoryQueue` (in this process only: tests, demos)
========================  ===============================  ==============================

Each adapter module exposes one factory, the signature :data:`QueueFactory` names::

    async def open_queue(url: str) -> QueuePort

It connects (and declares what it needs on the broker), raising on a bad or unreachable URL;
the caller closes the queue. Whatever it raises becomes one :class:`~jobfence.errors.ConfigError`
line at start-up, with the URL's password replaced by ``***``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from jobfence.config import ENV_QUEUE_URL
from jobfence.errors import ConfigError
from jobfence.outbox import POSTGRESQL, queue_setting, record_queue
from jobfence.ports import QueuePort
from jobfence.redact import redact_url

if TYPE_CHECKING:
    from psycopg import AsyncConnection
    from psycopg_pool import AsyncConnectionPool

log = logging.getLogger("jobfence.queues")

# How long a broker adapter's open_queue may take at start-up.
OPEN_TIMEOUT_SECONDS = 15.0

# The factory every broker adapter module exposes as ``open_queue``.
QueueFactory = Callable[[str], Awaitable[QueuePort]]


@dataclass(frozen=True, slots=True)
class Backend:
    """A broker adapter: its ``kind`` (recorded in ``jobfence.settings``), the module that
    holds its ``open_queue`` factory, and the extra that installs its client."""

    kind: str
    module: str
    extra: str | None


BACKENDS: dict[str, Backend] = {
    "amqp": Backend("rabbitmq", "jobfence.adapters.rabbitmq", "rabbitmq"),
    "amqps": Backend("rabbitmq", "jobfence.adapters.rabbitmq", "rabbitmq"),
    "nats": Backend("nats", "jobfence.adapters.nats", "nats"),
    "redis": Backend("redis", "jobfence.adapters.redis_streams", "redis"),
    "rediss": Backend("redis", "jobfence.adapters.redis_streams", "redis"),
    "memory": Backend("memory", "jobfence.adapters.memory", None),
}
_SCHEMES = "amqp://, amqps://, nats://, redis://, rediss://"


def queue_url_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The value of JOBFENCE_QUEUE_URL, or None when unset or blank (the PostgreSQL queue)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_QUEUE_URL, "").strip()
    return value or None


@dataclass(frozen=True, slots=True)
class QueueTarget:
    """A resolved queue setting. ``url`` may hold a password: it is left out of ``repr``;
    ``location`` is the URL without it, safe to log and to record in the database."""

    kind: str
    location: str | None
    backend: Backend | None
    url: str | None = field(default=None, repr=False)

    @property
    def external(self) -> bool:
        return self.kind != POSTGRESQL

    def describe(self) -> str:
        if not self.external:
            return "the PostgreSQL queue"
        return f"the {self.kind} queue at {self.location}"


POSTGRESQL_QUEUE = QueueTarget(kind=POSTGRESQL, location=None, backend=None)


def parse_queue_url(url: str | None) -> QueueTarget:
    """Resolve a queue URL (None, empty or ``postgresql``: the PostgreSQL queue); a scheme
    that is not in the registry raises :class:`~jobfence.errors.ConfigError`."""
    text = (url or "").strip()
    if not text or text.lower() == POSTGRESQL:
        return POSTGRESQL_QUEUE
    scheme, sep, _ = text.partition("://")
    scheme = scheme.lower()
    if scheme in ("postgres", "postgresql"):
        raise ConfigError(
            f"{ENV_QUEUE_URL}: the PostgreSQL queue is the one in the jobfence database "
            f"(JOBFENCE_DATABASE_URL); leave {ENV_QUEUE_URL} unset for it, or set it to "
            f"postgresql, not to a URL ({redact_url(text)})"
        )
    backend = BACKENDS.get(scheme) if sep else None
    if backend is None:
        raise ConfigError(
            f"{ENV_QUEUE_URL}: {redact_url(text)!r} is not a queue URL this jobfence knows: "
            f"use one of {_SCHEMES}, or leave it unset for the PostgreSQL queue"
        )
    try:
        split = urlsplit(text)
        port = split.port
    except ValueError as exc:
        raise ConfigError(
            f"{ENV_QUEUE_URL}: {redact_url(text)!r} is not a valid URL "
            f"({redact_url(text, str(exc))})"
        ) from None
    host = split.hostname or ""
    shown = f"[{host}]" if ":" in host else host
    # Redacted too: a password written with / or ? unescaped is cut into host and path.
    location = redact_url(f"{scheme}://{shown}{f':{port}' if port else ''}{split.path}")
    return QueueTarget(kind=backend.kind, location=location, backend=backend, url=text)


def _factory(target: QueueTarget) -> QueueFactory:
    backend = target.backend
    assert backend is not None
    install = f": pip install 'jobfence[{backend.extra}]'" if backend.extra else ""
    try:
        module = importlib.import_module(backend.module)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or backend.module
        raise ConfigError(
            f"{target.describe()} needs the {backend.module} adapter and its client "
            f"({missing} is not installed){install}"
        ) from None
    factory = getattr(module, "open_queue", None)
    if not callable(factory):
        raise ConfigError(
            f"{backend.module} has no open_queue(url) factory: this jobfence's {target.kind} "
            "adapter is incomplete"
        )
    found: QueueFactory = factory
    return found


async def open_queue(target: QueueTarget, pool: AsyncConnectionPool[Any]) -> QueuePort:
    """The queue ``target`` names, ready: the PostgreSQL queue on ``pool``, or the broker's
    adapter connected. A failure is one :class:`~jobfence.errors.ConfigError` whose text never
    holds the URL's password."""
    if not target.external:
        from jobfence.adapters.pg_queue import PgQueue

        return PgQueue(pool)
    if target.kind == "memory":
        from jobfence.adapters.memory import MemoryQueue

        return MemoryQueue(poll_interval_seconds=0.2)
    factory = _factory(target)
    assert target.url is not None
    try:
        # Bounded: some clients keep retrying an unreachable server for minutes.
        return await asyncio.wait_for(factory(target.url), OPEN_TIMEOUT_SECONDS)
    except TimeoutError:
        raise ConfigError(
            redact_url(
                target.url,
                f"cannot open {target.describe()}: no answer within {OPEN_TIMEOUT_SECONDS:g}s",
            )
        ) from None
    except ConfigError as exc:
        raise ConfigError(redact_url(target.url, str(exc))) from None
    except Exception as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise ConfigError(
            f"cannot open {target.describe()}: {redact_url(target.url, reason)}"
        ) from None


async def adopt_queue(
    conn: AsyncConnection[Any], target: QueueTarget, *, switch: bool = False
) -> None:
    """Check that ``target`` is where this database's producers send jobs
    (``jobfence.settings``), so that nothing is left where no worker reads it.

    A database still on its default PostgreSQL queue moves to ``target``'s broker the first
    time a command starts with it (refused while the PostgreSQL queue holds messages). Any
    other disagreement is refused (:class:`~jobfence.errors.ConfigError`), unless ``switch``
    (``jobfence migrate --queue-url``), which moves the database to ``target`` (refused while
    the queue it leaves holds messages)."""
    current = await queue_setting(conn)
    if current.kind == target.kind:
        if target.external and current.location != target.location:
            await record_queue(conn, target.kind, target.location)
        return
    if switch or (not current.external and target.external):
        await record_queue(conn, target.kind, target.location)
        log.info(
            "this database's jobs now go to %s%s",
            target.describe(),
            " through the outbox" if target.external else "",
        )
        return
    where = (
        f"the {current.kind} queue at {current.location or '?'} (through the outbox)"
        if current.external
        else "the PostgreSQL queue"
    )
    raise ConfigError(
        f"this database's jobs go to {where}, but this command was given "
        f"{target.describe()}: set {ENV_QUEUE_URL} (or --queue-url) to that queue, or move "
        "the database with `jobfence migrate --queue-url URL` (postgresql for the PostgreSQL "
        "queue)"
    )


@contextlib.asynccontextmanager
async def queue_from_env(
    pool: AsyncConnectionPool[Any], *, url: str | None = None
) -> AsyncIterator[QueuePort]:
    """The queue of a command: ``url``, else ``JOBFENCE_QUEUE_URL``, else the PostgreSQL queue.
    Opened (a broker connected, so a bad or unreachable URL fails here), checked against this
    database's setting (:func:`adopt_queue`), and closed on exit."""
    target = parse_queue_url(url if url is not None else queue_url_from_env())
    queue = await open_queue(target, pool)
    try:
        async with pool.connection() as conn:
            await adopt_queue(conn, target)
        yield queue
    finally:
        await queue.close()


def add_queue_url_option(parser: argparse.ArgumentParser) -> None:
    """``--queue-url`` for a command that publishes or consumes (the CLI's one definition)."""
    parser.add_argument(
        "--queue-url",
        default=None,
        metavar="URL",
        help="the queue: amqp://, amqps://, nats://, redis:// or rediss:// for a broker"
        " (default: JOBFENCE_QUEUE_URL, else the PostgreSQL queue in the jobfence database;"
        " prefer the variable: a flag shows in the process list)",
    )
