"""Observability at the edges: ``/metrics`` exposition and structured, redacted logs.

Metrics. The harness, the cleanup and the alert relay report through injected sinks
(:mod:`jobfence.adapters.prometheus`). What lives in the database (dead letters pending review,
queue depth) is read at scrape time by :class:`DatabaseCollector`; :func:`metrics_registry`
puts it on a registry, :func:`serve_metrics` serves a registry over HTTP from a thread (the
worker's ``--metrics-port``) and :class:`MetricsApp` serves it inside an ASGI application (the
API service). Labels stay bounded: queue, consumer, outcome, state; never a job id or an attempt.

Logs. :func:`configure_logging` writes one line per event, as text or as one JSON object
(timestamp, level, logger, message, and the job fields a job event carries: job_id, consumer,
queue, tenant_id, correlation_id, attempt, outcome). Every record passes through
:class:`RedactSecrets` first, so a configured token or database password never reaches the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import IO, Any, Literal

import psycopg
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from psycopg_pool import AsyncConnectionPool
from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from jobfence import config, tracing
from jobfence._sql import Queries
from jobfence.app import App
from jobfence.db import transaction_pooling
from jobfence.errors import ConfigError
from jobfence.redact import Redactor, printable

log = logging.getLogger("jobfence.observability")

CORE_SQL = Queries("jobfence.sql", "core.sql")
QUEUE_SQL = Queries("jobfence.adapters", "pg_queue.sql")

# A label value for what a registered app does not know, and one for the overflow beyond the
# series cap: a flood of poison messages naming random consumers cannot explode the series.
UNKNOWN_LABEL = "<unknown>"
OTHER_LABEL = "<other>"
DEFAULT_MAX_SERIES = 100
QUEUE_STATES = ("due", "scheduled", "leased")

# --------------------------------------------------------------------------------------------
# Metrics read from the database at scrape time
# --------------------------------------------------------------------------------------------


def _conninfo(database: AsyncConnectionPool[Any] | str) -> str:
    if isinstance(database, str):
        return database
    if isinstance(database.conninfo, str):
        return database.conninfo
    raise ConfigError("this pool computes its conninfo: pass the metrics a conninfo string")


def _cap(values: Mapping[tuple[str, str], float], max_series: int) -> dict[tuple[str, str], float]:
    """The ``max_series - 1`` largest entries, the rest summed under ``(<other>, <other>)``."""
    if len(values) <= max_series:
        return dict(values)
    ranked = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = dict(ranked[: max_series - 1])
    kept[(OTHER_LABEL, OTHER_LABEL)] = sum(v for _, v in ranked[max_series - 1 :])
    return kept


@dataclass(frozen=True, slots=True)
class _Snapshot:
    pending: dict[tuple[str, str], float]
    oldest_age_seconds: float
    depth: dict[tuple[str, str], float]


class DatabaseCollector:
    """Gauges computed from the database on every scrape, never failing the exposition.

    - ``jobfence_dead_letters_pending{queue, consumer}``: dead letters in ``pending_review``;
    - ``jobfence_dead_letter_oldest_pending_age_seconds``: age of the oldest of them by the
      database clock (0 when none is pending);
    - ``jobfence_queue_messages{queue, state}``: messages in the PostgreSQL queue, ``state``
      being ``due`` (receivable now), ``scheduled`` (a retry or delayed publish not yet due) or
      ``leased`` (held by a worker);
    - ``jobfence_metrics_database_up``: 1 when this scrape's queries succeeded, else 0 (and the
      gauges above are left out rather than reported stale).

    Each scrape opens one short connection of its own (``connect_timeout`` and
    ``statement_timeout`` of ``timeout_seconds``): it never takes a job's pooled connection,
    holds nothing between scrapes and needs no reconnect logic after a database restart.
    With ``app``, its registered (queue, consumer) pairs always have a series (0 when idle)
    and a dead letter naming an unregistered consumer is reported as consumer ``<unknown>``.
    At most ``max_series`` series per metric; the smallest rest is summed under ``<other>``.
    These are database-wide numbers: every process exposing them reports the same values,
    so aggregate them with ``max``, not ``sum``.
    """

    def __init__(
        self,
        database: AsyncConnectionPool[Any] | str,
        *,
        app: App | None = None,
        queue_depth: bool = True,
        max_series: int = DEFAULT_MAX_SERIES,
        timeout_seconds: float = 2.0,
    ) -> None:
        if max_series < 2:
            raise ConfigError(f"max_series must be >= 2, got {max_series}")
        if not 0 < timeout_seconds < float("inf"):
            raise ConfigError(f"timeout_seconds must be positive, got {timeout_seconds}")
        self._conninfo = _conninfo(database)
        self._app = app
        self._queue_depth = queue_depth
        self._max_series = max_series
        self._timeout = timeout_seconds
        self._state_lock = threading.Lock()
        self._was_up: bool | None = None

    def describe(self) -> Iterable[Metric]:
        """The metric names, without touching the database (called at registration)."""
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        try:
            snapshot: _Snapshot | None = self._query()
        except Exception as exc:
            snapshot = None
            self._note(up=False, exc=exc)
        else:
            self._note(up=True, exc=None)
        return list(self._families(snapshot))

    def _note(self, *, up: bool, exc: BaseException | None) -> None:
        """Log when the database goes away or comes back, not on every scrape."""
        with self._state_lock:
            before, self._was_up = self._was_up, up
        if before is up:
            return
        if exc is not None:
            text = " ".join(str(exc).split())[:300]
            log.warning("metrics: cannot read the database (%s: %s)", type(exc).__name__, text)
        elif before is False:
            log.info("metrics: database readable again")

    def _query(self) -> _Snapshot:
        timeout = max(int(self._timeout + 0.999), 2)  # libpq counts whole seconds, at least 2
        with psycopg.connect(
            self._conninfo,
            autocommit=True,
            connect_timeout=timeout,
            application_name="jobfence-metrics",
        ) as conn:
            # Behind a pooler in transaction mode, a session's setting would stay on the
            # server connection for other clients: there the timeout is the transaction's.
            pooled = transaction_pooling()
            with conn.transaction() if pooled else contextlib.nullcontext():
                conn.execute(
                    "SELECT set_config('statement_timeout', %s, %s)",
                    (f"{int(self._timeout * 1000)}ms", pooled),
                )
                rows = conn.execute(CORE_SQL["dead_letters_pending_summary"]).fetchall()
                depth_rows = (
                    conn.execute(QUEUE_SQL["depth"]).fetchall() if self._queue_depth else []
                )
        return self._snapshot(rows, depth_rows)

    def _snapshot(
        self, rows: list[tuple[Any, ...]], depth_rows: list[tuple[Any, ...]]
    ) -> _Snapshot:
        known = {(c.queue, c.name) for c in self._app.consumers.values()} if self._app else set()
        pending: dict[tuple[str, str], float] = dict.fromkeys(known, 0.0)
        oldest = 0.0
        for queue, consumer, count, age in rows:
            registered = self._app is None or self._app.get(consumer) is not None
            key = (queue, consumer if registered else UNKNOWN_LABEL)
            pending[key] = pending.get(key, 0.0) + float(count)
            oldest = max(oldest, float(age))
        depth: dict[tuple[str, str], float] = {}
        if self._queue_depth:
            queues = {q: (0.0, 0.0, 0.0) for q in (self._app.queues if self._app else [])}
            for queue, due, scheduled, leased in depth_rows:
                queues[queue] = (float(due), float(scheduled), float(leased))
            if len(queues) > self._max_series:  # the busiest queues, the rest as one
                ranked = sorted(queues.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
                rest = [v for _, v in ranked[self._max_series - 1 :]]
                queues = dict(ranked[: self._max_series - 1])
                queues[OTHER_LABEL] = (
                    sum(v[0] for v in rest),
                    sum(v[1] for v in rest),
                    sum(v[2] for v in rest),
                )
            for queue, values in queues.items():
                for state, value in zip(QUEUE_STATES, values, strict=True):
                    depth[(queue, state)] = value
        return _Snapshot(_cap(pending, self._max_series), oldest, depth)

    def _families(self, snapshot: _Snapshot | None) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "jobfence_metrics_database_up",
            "1 when the last scrape could read the database, 0 when it could not.",
            value=0.0 if snapshot is None else 1.0,
        )
        yield up
        pending = GaugeMetricFamily(
            "jobfence_dead_letters_pending",
            "Dead letters in pending_review, by queue and consumer.",
            labels=("queue", "consumer"),
        )
        oldest = GaugeMetricFamily(
            "jobfence_dead_letter_oldest_pending_age_seconds",
            "Age of the oldest dead letter pending review, in seconds (0 when none is).",
        )
        depth = GaugeMetricFamily(
            "jobfence_queue_messages",
            "Messages in the PostgreSQL queue, by queue and state (due, scheduled, leased).",
            labels=("queue", "state"),
        )
        if snapshot is not None:
            for (queue, consumer), value in sorted(snapshot.pending.items()):
                pending.add_metric((queue, consumer), value)
            oldest.add_metric((), snapshot.oldest_age_seconds)
            for (queue, state), value in sorted(snapshot.depth.items()):
                depth.add_metric((queue, state), value)
        yield pending
        yield oldest
        if self._queue_depth:
            yield depth


def metrics_registry(
    database: AsyncConnectionPool[Any] | str | None,
    *,
    app: App | None = None,
    registry: CollectorRegistry | None = None,
    queue_depth: bool = True,
    max_series: int = DEFAULT_MAX_SERIES,
    process: bool = True,
) -> CollectorRegistry:
    """A registry for ``/metrics``: the database gauges of :class:`DatabaseCollector` on
    ``database`` (a pool, whose conninfo is used for a separate short connection per scrape,
    or a conninfo string; None for none) and, with ``process``, the process's CPU, memory and
    file descriptors. Pass ``registry`` to add them to an existing one, e.g. the registry of
    the :class:`~jobfence.PrometheusMetrics` a worker reports to.
    """
    registry = registry if registry is not None else CollectorRegistry()
    if database is not None:
        registry.register(
            DatabaseCollector(database, app=app, queue_depth=queue_depth, max_series=max_series)
        )
    if process:
        ProcessCollector(registry=registry)
    return registry


@dataclass
class MetricsServer:
    """A running ``/metrics`` HTTP listener (a daemon thread); :meth:`close` stops it."""

    host: str
    port: int
    _stop: Callable[[], None]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._stop()


def serve_metrics(
    registry: CollectorRegistry, *, port: int, host: str = "127.0.0.1"
) -> MetricsServer:
    """Serve ``registry`` in the Prometheus text format on ``host:port`` from a thread.

    ``port=0`` takes a free port (see :attr:`MetricsServer.port`). Scrapes run in the server's
    threads, so the database collector never blocks the worker's event loop.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"metrics port must be between 0 and 65535, got {port}")
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror or exc})"
        ) from None

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5.0)

    return MetricsServer(host=host, port=int(httpd.server_port), _stop=stop)


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class MetricsApp:
    """An ASGI application that serves ``registry`` in the Prometheus text format.

    The scrape (with its database queries) runs in a thread, so the event loop never waits on
    it. Mount it in the API, e.g. ``api.add_route("/metrics", MetricsApp(registry),
    include_in_schema=False)`` (an instance is an ASGI app to Starlette, not an endpoint).
    """

    # The methods it answers; any other is a 405 naming them in ``Allow``.
    METHODS: tuple[str, ...] = ("GET", "HEAD")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # served on its own: nothing to start or stop
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        method = scope.get("method", "GET")
        if method not in self.METHODS:
            allow = [(b"allow", ", ".join(self.METHODS).encode())]
            await _respond(send, 405, b"method not allowed\n", "text/plain; charset=utf-8", allow)
            return
        body = await asyncio.to_thread(generate_latest, self.registry)
        await _respond(send, 200, b"" if method == "HEAD" else body, CONTENT_TYPE_LATEST)


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------------------------
# Structured logs
# --------------------------------------------------------------------------------------------

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_STANDARD_ATTRS = frozenset(RESERVED_ATTRS) | {"message", "asctime", "taskName"}


class RedactSecrets(logging.Filter):
    """Replace every configured secret in a record (message, arguments, traceback, stack and
    extra fields) with ``***``, and the secrets of any URL or ``password=``-like pair it holds
    (:class:`jobfence.redact.Redactor`), before any formatter sees it. Never drops a record."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.redact = Redactor(secrets)

    def _value(self, value: object) -> object:
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, dict):
            return {k: self._value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._value(v) for v in value]
        if value is None or isinstance(value, bool | int | float):
            return value
        text = str(value)
        redacted = self.redact(text)
        return value if redacted == text else redacted

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, dict):
            record.msg = self._value(record.msg)
        else:
            try:
                text = record.getMessage()
            except Exception:  # mismatched arguments: keep the evidence, minus the secrets
                text = f"{record.msg} {record.args!r}"
            redacted = self.redact(text)
            if redacted != text or record.args:
                record.msg, record.args = redacted, None
        if record.exc_info:
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.exc_info, record.exc_text = None, self.redact(text)
        elif record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        for key, value in list(record.__dict__.items()):
            if key not in _STANDARD_ATTRS:
                record.__dict__[key] = self._value(value)
        return True


def _block(text: str, indent: str = "") -> str:
    """A traceback or a stack: each line escaped (:func:`jobfence.redact.printable`), then
    prefixed with ``indent``."""
    return "\n".join(indent + printable(line) for line in text.split("\n"))


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT`` lines that nothing logged can forge: the message has every character
    that is not printable escaped (a newline as ``\\n``, ESC as ``\\x1b``), so a job id, a
    name or an error text a producer chose stays inside its line; a traceback or a stack
    follows on lines of its own, each escaped and indented by two spaces, so that none of
    them (an exception's message may hold newlines) can pass for the start of a record."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = printable(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + _block(record.exc_text.rstrip("\n"), "  ")
        if record.stack_info:
            line += "\n" + _block(self.formatStack(record.stack_info), "  ")
        return line


class _JsonFormatter(JsonFormatter):
    """pythonjsonlogger's formatter, with the message and every text field escaped as in the
    text format (a traceback keeps its line breaks: JSON escapes them)."""

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        for key, value in log_data.items():
            if isinstance(value, str):
                log_data[key] = (
                    _block(value) if key in ("exc_info", "stack_info") else printable(value)
                )
        return log_data


class _TracedJsonFormatter(_JsonFormatter):
    """Adds ``trace_id`` and ``span_id`` while an OpenTelemetry span is current."""

    def add_fields(
        self,
        log_record: dict[str, Any],
        record: logging.LogRecord,
        message_dict: dict[str, Any],
    ) -> None:
        super().add_fields(log_record, record, message_dict)
        ids = tracing.current_ids()
        if ids is not None:
            log_record["trace_id"], log_record["span_id"] = ids


def json_formatter() -> logging.Formatter:
    """One JSON object per line: timestamp (ISO 8601, UTC), level, logger, message, the
    record's extra fields (job_id, consumer, queue, tenant_id, correlation_id, attempt,
    outcome on job events), trace_id and span_id while an OpenTelemetry span is current
    (docs/observability.md), and exc_info when there is a traceback. Text values are escaped
    (:func:`jobfence.redact.printable`), like the text format's."""
    formatter = _TracedJsonFormatter if tracing.ENABLED else _JsonFormatter
    return formatter(
        "{levelname}{name}{message}",
        style="{",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp=True,
    )


def configure_logging(
    format: LogFormat | str = "text",
    level: int | str = logging.INFO,
    *,
    secrets: Iterable[str] | None = None,
    stream: IO[str] | None = None,
    other_level: int | str = logging.WARNING,
) -> logging.Handler:
    """Log to ``stream`` (stderr) as ``text`` or ``json``, one event per line.

    jobfence's loggers log at ``level``, other libraries at ``other_level``. The handler
    redacts ``secrets`` from every record; by default they are the configured ones
    (:func:`jobfence.config.secrets_from_env`: the Better Stack token, the JWT secret, the
    database password...). Calling it again replaces the handler it installed before.
    """
    if format not in LOG_FORMATS:
        raise ConfigError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {format!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    if format == "json":
        handler.setFormatter(json_formatter())
    else:
        handler.setFormatter(TextFormatter(TEXT_FORMAT))
    handler.addFilter(RedactSecrets(config.secrets_from_env() if secrets is None else secrets))
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    for old in list(root.handlers):
        if old.get_name() == _HANDLER_NAME:
            root.removeHandler(old)
            old.close()
    root.addHandler(handler)
    root.setLevel(other_level)
    logging.getLogger("jobfence").setLevel(level)
    return handler


def follow_configured_logging(
    level: int | str = logging.INFO, *, secrets: Iterable[str] | None = None
) -> bool:
    """When the application configured the root logger already (a root handler, as Django's
    ``LOGGING`` with a ``root`` entry installs), use its handlers instead of adding one: each
    gets a filter redacting ``secrets`` (by default the configured ones), and jobfence's
    loggers log at ``level`` unless that configuration set their level. Returns False, changing
    nothing, when the root logger has no handler of the application's (then call
    :func:`configure_logging`)."""
    root = logging.getLogger()
    theirs = [h for h in root.handlers if h.get_name() != _HANDLER_NAME]
    if not theirs:
        return False
    redact = RedactSecrets(config.secrets_from_env() if secrets is None else secrets)
    for handler in theirs:
        for old in [f for f in handler.filters if isinstance(f, RedactSecrets)]:
            handler.removeFilter(old)
        handler.addFilter(redact)
    ours = logging.getLogger("jobfence")
    if ours.level == logging.NOTSET:
        ours.setLevel(level)
    return True


_HANDLER_NAME = "jobfence"
