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

Whether the queue a command is given is the one its database records, and the one step that
moves a database to another queue: :mod:`jobfence.queue_record`.
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
from urllib.parse import parse_qs, unquote, urlsplit

from jobfence.config import ENV_QUEUE_URL
from jobfence.errors import ConfigError
from jobfence.outbox import POSTGRESQL
from jobfence.ports import QueuePort

if TYPE_CHECKING:
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


def _passwords(url: str) -> list[str]:
    try:
        password = urlsplit(url).password
    except ValueError:
        return []
    if not password:
        return []
    return sorted({password, unquote(password)}, key=len, reverse=True)


def redact_url(url: str, text: str | None = None) -> str:
    """``text`` (default: ``url`` itself) with the URL's password replaced by ``***``."""
    result = url if text is None else text
    for secret in _passwords(url):
        result = result.replace(secret, "***")
    return result


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

    @property
    def place(self) -> str:
        """Where this queue's messages go, as :func:`queue_place` writes it."""
        return queue_place(self.kind, self.url if self.url is not None else self.location)


POSTGRESQL_QUEUE = QueueTarget(kind=POSTGRESQL, location=None, backend=None)

# The settings a queue URL may carry that name where messages go, with their defaults (the
# adapters' constructor arguments of the same names). Any other setting only tunes a client.
PLACE_SETTINGS: dict[str, dict[str, str]] = {
    "rabbitmq": {"prefix": "jobfence"},
    "nats": {"stream": "JOBFENCE", "subject_prefix": "jobfence"},
    "redis": {"prefix": "jobfence"},
}
_DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671, "nats": 4222, "redis": 6379, "rediss": 6379}


def queue_place(kind: str, url: str | None) -> str:
    """What names where the messages of a ``kind`` queue at ``url`` go, written so that two
    URLs give the same string exactly when they name the same place: the kind; the servers'
    hosts and ports (default ports filled in; a NATS seed list as a set, in any order); the
    RabbitMQ virtual host or the Redis database number; and the :data:`PLACE_SETTINGS` (prefix,
    stream, subject prefix). Never the user or the password, nor a setting that only tunes a
    client (replicas, prefetch, timeouts). The PostgreSQL queue is ``postgresql``."""
    if kind == POSTGRESQL:
        return POSTGRESQL
    if kind == "memory":
        return "memory://"
    text = (url or "").strip()
    scheme = text.partition("://")[0].lower()
    servers: set[str] = set()
    path = ""
    query: dict[str, list[str]] = {}
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        split = urlsplit(piece if "://" in piece else f"{scheme}://{piece}")
        try:
            port = split.port
        except ValueError:
            port = None
        host = (split.hostname or "").lower()
        shown = f"[{host}]" if ":" in host else host
        servers.add(f"{shown}:{port or _DEFAULT_PORTS.get(split.scheme.lower(), '')}")
        path = split.path or path
        if split.query:
            query = parse_qs(split.query)
    where = ""
    if kind == "rabbitmq":
        vhost = unquote(path[1:]) if len(path) > 1 else ""
        where = vhost or "/"
    elif kind == "redis":
        number = path.strip("/") or (query.get("db") or ["0"])[-1]
        where = number.strip() or "0"
    named = [
        f"{name}={(query.get(name) or [default])[-1]}"
        for name, default in sorted(PLACE_SETTINGS.get(kind, {}).items())
    ]
    return f"{kind}://{','.join(sorted(servers))}/{where}?{'&'.join(named)}"


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
            f"{ENV_QUEUE_URL}: {redact_url(text)!r} is not a valid URL ({exc})"
        ) from None
    host = split.hostname or ""
    shown = f"[{host}]" if ":" in host else host
    location = f"{scheme}://{shown}{f':{port}' if port else ''}{split.path}"
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
    return await open_broker(target)


async def open_broker(target: QueueTarget) -> QueuePort:
    """A broker's adapter, connected (``open_queue`` for a broker target)."""
    factory = _factory(target)
    assert target.url is not None
    try:
        # Bounded: some clients keep retrying an unreachable server for minutes.
        return await asyncio.wait_for(factory(target.url), OPEN_TIMEOUT_SECONDS)
    except TimeoutError:
        raise ConfigError(
            f"cannot open {target.describe()}: no answer within {OPEN_TIMEOUT_SECONDS:g}s"
        ) from None
    except ConfigError as exc:
        raise ConfigError(redact_url(target.url, str(exc))) from None
    except Exception as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise ConfigError(
            f"cannot open {target.describe()}: {redact_url(target.url, reason)}"
        ) from None


@contextlib.asynccontextmanager
async def queue_from_env(
    pool: AsyncConnectionPool[Any], *, url: str | None = None
) -> AsyncIterator[QueuePort]:
    """The queue of a command: ``url``, else ``JOBFENCE_QUEUE_URL``, else the PostgreSQL queue.
    Checked against this database's record first (:func:`adopt_queue`: a queue elsewhere is
    refused before anything connects to it), then opened (a broker connected, so a bad or
    unreachable URL fails here), and closed on exit."""
    from jobfence.queue_record import adopt_queue

    target = parse_queue_url(url if url is not None else queue_url_from_env())
    async with pool.connection() as conn:
        await adopt_queue(conn, target)
    queue = await open_queue(target, pool)
    try:
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
