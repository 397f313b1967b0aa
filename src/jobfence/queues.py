"""Which queue a command uses: ``JOBFENCE_QUEUE_URL`` / ``--queue-url``, resolved to an adapter.

Unset (or ``postgresql``), the queue is the PostgreSQL one in the jobfence database. Otherwise
the URL's scheme picks a broker adapter from a small registry, imported only when used:

========================  ===============================  ==============================
scheme                    adapter module                   extra
========================  ===============================  ==============================
``amqp://``, ``amqps://``  ``jobfence.adapters.rabbitmq``      ``jobfence[rabbitmq]``
``nats://``, ``tls://``   ``jobfence.adapters.nats``          ``jobfence[nats]``
``redis://``, ``rediss://``  ``jobfence.adapters.redis_streams``  ``jobfence[redis]``
``memory://``             :class:`~jobfence.MemoryQueue` (in this process only: tests, demos)
========================  ===============================  ==============================

Each adapter module exposes one factory, the signature :data:`QueueFactory` names::

    async def open_queue(url: str) -> QueuePort

``url`` is the whole URL: a NATS seed list (``nats://a:4222,nats://b:4222``) and the adapter's
settings as query parameters (``?replicas=3``, ``?prefix=shop&prefetch=200``), which
:func:`parse_queue_url` reads and checks into a :class:`QueueTarget` (the one place a queue URL
is parsed). It connects (and declares what it needs on the broker), raising on a bad or
unreachable URL; the caller closes the queue. Whatever it raises becomes one
:class:`~jobfence.errors.ConfigError` line at start-up, with the URL's password replaced by
``***``.

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
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from jobfence.config import ENV_QUEUE_URL
from jobfence.errors import ConfigError
from jobfence.outbox import POSTGRESQL
from jobfence.ports import QueuePort
from jobfence.redact import redact_url

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

log = logging.getLogger("jobfence.queues")

# How long a broker adapter's open_queue may take at start-up.
OPEN_TIMEOUT_SECONDS = 45.0

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
    "tls": Backend("nats", "jobfence.adapters.nats", "nats"),  # NATS, TLS required
    "redis": Backend("redis", "jobfence.adapters.redis_streams", "redis"),
    "rediss": Backend("redis", "jobfence.adapters.redis_streams", "redis"),
    "memory": Backend("memory", "jobfence.adapters.memory", None),
}
_SCHEMES = "amqp://, amqps://, nats://, tls://, redis://, rediss://"


def queue_url_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The value of JOBFENCE_QUEUE_URL, or None when unset or blank (the PostgreSQL queue)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_QUEUE_URL, "").strip()
    return value or None


# Where jobs live on a broker: the adapters' defaults, which a URL's parameters may change.
DEFAULT_PREFIX = "jobfence"  # RabbitMQ queue names, Redis keys
DEFAULT_STREAM = "JOBFENCE"  # the NATS JetStream stream
DEFAULT_SUBJECT_PREFIX = "jobfence"  # NATS subjects
MAX_REPLICAS = 5  # JetStream's largest replica count
# How long a NATS open waits for its stream by default, and at most: within OPEN_TIMEOUT_SECONDS,
# with room left for the first connection's tries.
DEFAULT_STREAM_WAIT_SECONDS = 30
MAX_STREAM_WAIT_SECONDS = 35

_DEFAULT_PORTS = {
    "amqp": 5672,
    "amqps": 5671,
    "nats": 4222,
    "tls": 4222,
    "redis": 6379,
    "rediss": 6379,
}
# The same name rules as the adapters' constructors (which check them again).
_RABBIT_NAME = re.compile(r"^[A-Za-z0-9_.\-:]{1,200}$")
_NATS_STREAM = re.compile(r"^[A-Za-z0-9_\-]{1,200}$")
_NATS_SUBJECT = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
_REDIS_PREFIX = re.compile(r"^[^{}\s]{1,200}$")


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    """The jobfence settings a broker URL carries as query parameters, parsed and checked
    (the adapters' defaults where the URL gives none). ``prefix``, ``stream`` and
    ``subject_prefix`` name where the jobs are; ``replicas``, ``stream_wait`` and ``prefetch``
    only tune."""

    prefix: str = DEFAULT_PREFIX
    stream: str = DEFAULT_STREAM
    subject_prefix: str = DEFAULT_SUBJECT_PREFIX
    replicas: int = 1
    stream_wait: int = DEFAULT_STREAM_WAIT_SECONDS  # seconds a NATS open waits for its stream
    prefetch: int | None = None  # None: the RabbitMQ adapter's own (the first receive's + 100)
    # NATS over TLS: the CA file that verifies the servers (None: the system's), and a client
    # certificate with its key.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


@dataclass(frozen=True, slots=True)
class _Param:
    """One query parameter jobfence reads from a broker URL."""

    parse: Callable[[str], str | int]
    allowed: str  # what a value may be, for the refusal
    names_place: bool  # part of where the jobs are (else a tuning setting)


def _integer(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"[0-9]{1,6}", text) or not low <= int(text) <= high:
            raise ValueError(text)
        return int(text)

    return parse


def _path(text: str) -> str:
    if not 1 <= len(text) <= 4096 or not text.isprintable():
        raise ValueError(text)
    return text


def _matching(pattern: re.Pattern[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not pattern.match(text):
            raise ValueError(text)
        return text

    return parse


# The jobfence parameters each kind of broker URL accepts, by kind.
_PARAMS: dict[str, dict[str, _Param]] = {
    "rabbitmq": {
        "prefix": _Param(
            _matching(_RABBIT_NAME), "1 to 200 letters, digits, _ . - or :", names_place=True
        ),
        "prefetch": _Param(_integer(1, 65535), "an integer from 1 to 65535", names_place=False),
    },
    "nats": {
        "stream": _Param(
            _matching(_NATS_STREAM), "1 to 200 letters, digits, _ or -", names_place=True
        ),
        "subject_prefix": _Param(
            _matching(_NATS_SUBJECT),
            "dot-separated tokens of letters, digits, _ or -",
            names_place=True,
        ),
        "replicas": _Param(
            _integer(1, MAX_REPLICAS), f"an integer from 1 to {MAX_REPLICAS}", names_place=False
        ),
        "stream_wait": _Param(
            _integer(1, MAX_STREAM_WAIT_SECONDS),
            f"a whole number of seconds from 1 to {MAX_STREAM_WAIT_SECONDS}",
            names_place=False,
        ),
        "tls_ca": _Param(_path, "the path of a PEM file", names_place=False),
        "tls_cert": _Param(_path, "the path of a PEM file", names_place=False),
        "tls_key": _Param(_path, "the path of a PEM file", names_place=False),
    },
    "redis": {
        "prefix": _Param(
            _matching(_REDIS_PREFIX),
            "1 to 200 characters, no braces or spaces",
            names_place=True,
        ),
    },
}
# The clients' own URL parameters, passed on to them as they are (the client checks them).
_CLIENT_PARAMS: dict[str, frozenset[str]] = {
    "rabbitmq": frozenset(
        {
            "heartbeat",
            "timeout",
            "name",
            "auth",
            "cafile",
            "capath",
            "cadata",
            "keyfile",
            "certfile",
            "no_verify_ssl",
            "interleave",
            "happy_eyeballs_delay",
        }
    ),
    "nats": frozenset(),
    "redis": frozenset(
        {
            "socket_timeout",
            "socket_connect_timeout",
            "socket_read_size",
            "socket_keepalive",
            "retry_on_timeout",
            "max_connections",
            "health_check_interval",
            "ssl_check_hostname",
            "ssl_cert_reqs",
            "ssl_ca_certs",
            "ssl_ca_path",
            "ssl_certfile",
            "ssl_keyfile",
            "ssl_min_version",
            "timeout",
            "protocol",
            "client_name",
        }
    ),
}


@dataclass(frozen=True, slots=True)
class QueuePlace:
    """Where a queue URL's jobs are, whatever its credentials and tuning: the broker's kind,
    its servers (``host:port``, lower-case, the default port filled in; a set, so the order of
    a seed list does not matter), ``path`` (RabbitMQ's vhost, default ``/``; Redis's database
    number, default ``0``; empty for NATS), and the settings that name the jobs' place
    (``prefix``; NATS's ``stream`` and ``subject_prefix``), sorted by name."""

    kind: str
    hosts: frozenset[str]
    path: str
    names: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class QueueTarget:
    """A resolved queue setting. ``url`` (as given) and ``client_url`` (what the client
    connects to: jobfence's parameters removed) may hold a password: both are left out of
    ``repr``; ``location`` is the URL without it and without tuning settings, safe to log and
    to record in the database (:func:`parse_queue_url` of a location gives the same
    :attr:`place`)."""

    kind: str
    location: str | None
    backend: Backend | None
    url: str | None = field(default=None, repr=False)
    client_url: str | None = field(default=None, repr=False)
    hosts: tuple[str, ...] = ()
    path: str = ""
    settings: BrokerSettings = BrokerSettings()

    @property
    def external(self) -> bool:
        return self.kind != POSTGRESQL

    @property
    def place(self) -> QueuePlace:
        """Where this URL's jobs are: see :class:`QueuePlace`."""
        names: tuple[tuple[str, str], ...] = ()
        for name, param in _PARAMS.get(self.kind, {}).items():
            if param.names_place:
                names += ((name, str(getattr(self.settings, name))),)
        return QueuePlace(self.kind, frozenset(self.hosts), self.path, tuple(sorted(names)))

    def describe(self) -> str:
        if not self.external:
            return "the PostgreSQL queue"
        return f"the {self.kind} queue at {self.location}"


POSTGRESQL_QUEUE = QueueTarget(kind=POSTGRESQL, location=None, backend=None)


def parse_queue_url(url: str | None) -> QueueTarget:
    """Resolve a queue URL (None, empty or ``postgresql``: the PostgreSQL queue) into a
    :class:`QueueTarget`, or refuse it with one :class:`~jobfence.errors.ConfigError` that
    names what is wrong and never shows the password: a scheme that is not in the registry, a
    server without a host or with a bad port, a seed list (``nats://a:4222,nats://b:4222``,
    NATS only), a bad path, and a query parameter this kind of broker does not take, given
    twice, or with a value out of its range."""
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
    if backend.kind == "memory":
        return QueueTarget(
            kind=backend.kind, location=f"{scheme}://", backend=backend, url=text, client_url=text
        )

    def refuse(why: str) -> ConfigError:
        # The reason may quote a piece of the URL (a server of a list, urllib's own error).
        return ConfigError(f"{ENV_QUEUE_URL}: {redact_url(text)!r}: {redact_url(text, why)}")

    servers_text, _, query = text.partition("?")
    if "://" in query:
        raise refuse("the parameters go once, after the last server of the list")
    if "#" in text:
        raise refuse("a queue URL has no #fragment (percent-encode # in a password as %23)")
    parts = [part.strip() for part in servers_text.split(",")]
    if len(parts) > 1 and backend.kind != "nats":
        raise refuse("a list of servers separated by commas is for nats:// only; give one server")
    hosts, shown, path = _parse_servers(scheme, parts, refuse)
    place_path = _place_path(backend.kind, path, refuse)
    settings, client_query = _parse_query(backend.kind, query, refuse)
    names = [
        f"{name}={quote(str(getattr(settings, name)), safe='')}"
        for name, param in _PARAMS[backend.kind].items()
        if param.names_place and _given(query, name)
    ]
    # Redacted too: a password written with / or ? unescaped may be cut into host and path.
    location = redact_url(text, ",".join(shown) + path + (f"?{'&'.join(names)}" if names else ""))
    client = ",".join(parts) + (f"?{client_query}" if client_query else "")
    return QueueTarget(
        kind=backend.kind,
        location=location,
        backend=backend,
        url=text,
        client_url=client,
        hosts=tuple(hosts),
        path=place_path,
        settings=settings,
    )


def _parse_servers(
    scheme: str, parts: list[str], refuse: Callable[[str], ConfigError]
) -> tuple[list[str], list[str], str]:
    """Each server of a URL (several in a NATS seed list): its ``host:port`` (default port
    filled in), how it is shown (without credentials), and the URL's path."""
    hosts: list[str] = []
    shown: list[str] = []
    path = ""
    for part in parts:
        part_scheme, _, rest = part.partition("://")
        if part_scheme.lower() != scheme or not rest:
            raise refuse(f"each server of the list must be a {scheme}:// URL, got {part!r}")
        try:
            split = urlsplit(part)
            port = split.port
        except ValueError as exc:
            raise refuse(f"not a valid URL ({exc})") from None
        host = (split.hostname or "").lower()
        if not host:
            raise refuse(f"no host (write it as {scheme}://HOST:PORT)")
        bracketed = f"[{host}]" if ":" in host else host
        hosts.append(f"{bracketed}:{port or _DEFAULT_PORTS[scheme]}")
        shown.append(f"{scheme}://{bracketed}{f':{port}' if port else ''}")
        if len(parts) > 1 and split.path not in ("", "/"):
            raise refuse(f"a {scheme}:// server has no path")
        path = split.path
    return hosts, shown, path


def _place_path(kind: str, path: str, refuse: Callable[[str], ConfigError]) -> str:
    """What a URL's path names: RabbitMQ's vhost (default ``/``), Redis's database number
    (default ``0``); a NATS URL has none."""
    if kind == "rabbitmq":
        return unquote(path[1:]) if len(path) > 1 else "/"
    if kind == "redis":
        number = path[1:] if path.startswith("/") else path
        if number and not re.fullmatch(r"[0-9]{1,5}", number):
            raise refuse(
                f"the path is the Redis database number, an integer from 0 to 99999, got {number!r}"
            )
        return str(int(number or "0"))
    if path not in ("", "/"):
        raise refuse("a nats:// URL has no path")
    return ""


def _given(query: str, name: str) -> bool:
    return any(key == name for key, _ in parse_qsl(query, keep_blank_values=True))


def _parse_query(
    kind: str, query: str, refuse: Callable[[str], ConfigError]
) -> tuple[BrokerSettings, str]:
    """The jobfence settings in a broker URL's query, checked, and the rest of the query (the
    client's own parameters) to pass on."""
    ours = _PARAMS[kind]
    theirs = _CLIENT_PARAMS[kind]
    values: dict[str, str | int] = {}
    passed: list[tuple[str, str]] = []
    seen: set[str] = set()
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise refuse("the query is not name=value pairs separated by &") from None
    for name, value in pairs:
        if name in seen:
            raise refuse(f"the parameter {name!r} is given twice")
        seen.add(name)
        param = ours.get(name)
        if param is not None:
            try:
                values[name] = param.parse(value)
            except ValueError:
                raise refuse(
                    f"the parameter {name!r} must be {param.allowed}, got {value!r}"
                ) from None
        elif kind == "redis" and name == "db":
            raise refuse("the Redis database number goes in the path (redis://HOST:PORT/N)")
        elif kind == "rabbitmq" and name == "no_verify_ssl" and value not in ("0", "1"):
            # aiormq reads any value but 0 as "do not verify" (no_verify_ssl=false too).
            raise refuse(
                f"the parameter 'no_verify_ssl' must be 0 or 1 (1 turns off the verification"
                f" of the server's certificate), got {value!r}"
            )
        elif name in theirs:
            passed.append((name, value))
        else:
            accepted = ", ".join(sorted(ours)) or "none"
            client = f"; the client's own: {', '.join(sorted(theirs))}" if theirs else ""
            raise refuse(
                f"unknown parameter {name!r} for a {kind} queue URL "
                f"(jobfence's: {accepted}{client})"
            )
    if "tls_key" in values and "tls_cert" not in values:
        raise refuse("the parameter tls_key goes with tls_cert (the client certificate)")
    settings = BrokerSettings(**values)  # type: ignore[arg-type]
    return settings, urlencode(passed)


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
        from jobfence.db import transaction_pooling

        if transaction_pooling():
            log.info(
                "the PostgreSQL queue behind a pooler in transaction mode: no LISTEN, workers"
                " find new jobs by polling, once a second"
            )
            return PgQueue(pool, listen=False)
        return PgQueue(pool)
    if target.kind == "memory":
        from jobfence.adapters.memory import MemoryQueue

        return MemoryQueue(poll_interval_seconds=0.2)
    return await open_broker(target)


async def open_broker(target: QueueTarget) -> QueuePort:
    """A broker's adapter, connected (``open_queue`` for a broker target)."""
    factory = _factory(target)
    assert target.url is not None
    from jobfence.transport import queue_transport_warnings, warn_once

    for message in queue_transport_warnings(target):
        warn_once(message)
    bound = asyncio.timeout(OPEN_TIMEOUT_SECONDS)
    try:
        # Bounded: some clients keep retrying an unreachable server for minutes.
        async with bound:
            return await factory(target.url)
    except TimeoutError as exc:
        if not bound.expired():  # a client's own timeout (nats-py's subclasses TimeoutError)
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            raise ConfigError(
                f"cannot open {target.describe()}: {redact_url(target.url, reason)}"
            ) from None
        raise ConfigError(
            redact_url(
                target.url,
                f"cannot open {target.describe()}: the broker did not connect and set up its "
                f"queues within {OPEN_TIMEOUT_SECONDS:g}s",
            )
        ) from None
    except ConfigError as exc:
        raise ConfigError(
            redact_url(target.url, f"cannot open {target.describe()}: {exc}")
        ) from None
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
        help="the queue: amqp://, amqps://, nats:// or tls:// (or a comma-separated seed list),"
        " redis://"
        " or rediss:// for a broker, its settings as query parameters (?replicas=3)"
        " (default: JOBFENCE_QUEUE_URL, else the PostgreSQL queue in the jobfence database;"
        " prefer the variable: a flag shows in the process list)",
    )
