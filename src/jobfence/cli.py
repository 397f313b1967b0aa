"""The ``jobfence`` command: parse, call the library, format. No logic of its own."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import io
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import psycopg

from jobfence import cli_dead_letters, db, runtime, schema
from jobfence.app import App
from jobfence.blocked_loop import (
    DEFAULT_BLOCKED_LOOP_SECONDS,
    MAX_BLOCKED_LOOP_SECONDS,
    MIN_BLOCKED_LOOP_SECONDS,
    checked_blocked_loop_seconds,
)
from jobfence.cli_dead_letters import report_error, text_argument, usage_error
from jobfence.errors import ConfigError, JobfenceError
from jobfence.limits import MAX_LEASE_SECONDS
from jobfence.queues import add_queue_url_option

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from jobfence.adapters.betterstack import HeartbeatOnSuccess
    from jobfence.observability import MetricsServer
    from jobfence.ports import CleanupMetricsSink
    from jobfence.sync import SyncTransactionRunner
    from jobfence.worker import Worker


def _load_app(spec: str) -> App:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise JobfenceError(f"expected MODULE:ATTRIBUTE (e.g. myproject.jobs:app), got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(f"{missing}.")):
            raise JobfenceError(f"cannot import module {module_name!r}: {exc}") from None
        # The module exists but fails while importing: its own error, first line.
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        raise JobfenceError(
            f"module {module_name!r} does not import: {type(exc).__name__}: {first}"
        ) from None
    if not hasattr(module, attr):
        apps = sorted(name for name, value in vars(module).items() if isinstance(value, App))
        hint = f" (its jobfence.App: {', '.join(apps)})" if apps else ""
        raise JobfenceError(f"module {module_name!r} has no attribute {attr!r}{hint}")
    app = getattr(module, attr)
    if not isinstance(app, App):
        raise JobfenceError(f"{spec} is not a jobfence.App (found {type(app).__name__})")
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jobfence")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree, not installed
        return "unknown (not installed)"


# A migrate that applies the first migration creates the database's jobfence schema: nothing
# was ever enqueued there, so an exported JOBFENCE_QUEUE_URL is its first setup.
_FIRST_MIGRATION = 1


async def _cmd_migrate(args: argparse.Namespace) -> int:
    if args.print_sql:
        sys.stdout.write(schema.render_sql())
        return 0
    from jobfence.queue_record import adopt_queue, move_queue
    from jobfence.queues import parse_queue_url, queue_url_from_env

    if args.queue_url is None and (args.from_queue_url is not None or args.new_address):
        raise JobfenceError("--from-queue-url and --new-address go with --queue-url URL (a move)")
    # A bad queue URL is refused before anything is applied. --queue-url is the move; an
    # exported JOBFENCE_QUEUE_URL alone is checked against the record (main() has put the
    # flag into the variable, so look at the flag).
    given = args.queue_url if args.queue_url is not None else queue_url_from_env()
    target = parse_queue_url(given) if given is not None else None
    if args.from_queue_url is not None:
        parse_queue_url(args.from_queue_url)
    url = db.resolve_database_url()
    # Its advisory lock and lifted timeouts are held by the session, across transactions.
    await db.check_connection(url, needs_session="jobfence migrate")
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        try:
            # Each migration is said as soon as it is committed: should a later one fail, the
            # lines printed are what the database holds.
            applied = await schema.migrate(
                conn,
                lock_timeout=args.lock_timeout,
                lock_attempts=args.lock_attempts,
                on_applied=lambda m: print(f"applied {m.version:04d}_{m.name}", flush=True),
            )
        except schema.MigrationLockTimeout as exc:
            # Try again later: exit status 1, like the database's other refusals.
            return report_error(str(exc), 1, as_json=False)
        if not applied:
            print(f"already up to date (version {schema.latest_version():04d})")
        if target is None:
            return 0
        fresh = any(m.version == _FIRST_MIGRATION for m in applied)
        if args.queue_url is not None or fresh:
            # The explicit move, or the first setup of the schema this very run created.
            moved = await move_queue(
                conn, target, leaving_url=args.from_queue_url, new_address=args.new_address
            )
            print(f"jobs {'go' if moved else 'already go'} to {target.describe()}")
        else:
            await adopt_queue(conn, target)
            print(f"jobs go to {target.describe()}, as JOBFENCE_QUEUE_URL says")
    return 0


async def _cmd_roles(args: argparse.Namespace) -> int:
    from jobfence.roles import ROLES, render_roles_sql

    sys.stdout.write(render_roles_sql({role: getattr(args, role) for role in ROLES}))
    return 0


def _start_metrics_server(
    args: argparse.Namespace, registry: CollectorRegistry, *, database: str | None, app: App | None
) -> MetricsServer | None:
    """With ``--metrics-port``: serve ``registry`` (plus the database gauges when ``database``
    is given) on ``--metrics-host:--metrics-port``."""
    if args.metrics_port is None:
        return None
    from jobfence.observability import metrics_registry, serve_metrics

    metrics_registry(database, app=app, registry=registry)
    server = serve_metrics(registry, port=args.metrics_port, host=args.metrics_host)
    logging.getLogger("jobfence").info("metrics served at %s", server.url)
    return server


def _add_metrics_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port)",
    )
    p.add_argument(
        "--metrics-host",
        type=text_argument,
        default="127.0.0.1",
        metavar="HOST",
        help="(127.0.0.1)",
    )


async def _cmd_worker(args: argparse.Namespace) -> int:
    from jobfence.adapters.prometheus import PrometheusMetrics, PrometheusOutboxMetrics
    from jobfence.queues import queue_from_env
    from jobfence.worker import Worker

    app = _load_app(args.app)
    app.check_fence_ttls(
        lease_seconds=args.lease_seconds, max_handler_seconds=args.max_handler_seconds
    )
    url = db.resolve_database_url()
    if args.outbox_relay and db.transaction_pooling() and _on_a_broker():
        raise JobfenceError(
            db.transaction_pooling_refused("the outbox relay a worker runs on a broker")
            + "; or pass --no-outbox-relay, and run jobfence outbox-relay with such a URL"
        )
    # One more connection for the outbox relay's own, on a broker.
    pool = await db.open_pool(url, max_size=args.concurrency + 2, name="jobfence-worker")
    server: MetricsServer | None = None
    try:
        async with pool.connection() as conn:
            await schema.ensure_migrated(conn)
        async with queue_from_env(pool) as queue:
            metrics = PrometheusMetrics()
            server = _start_metrics_server(args, metrics.registry, database=url, app=app)
            worker = Worker(
                app,
                pool,
                queue,
                queues=args.queue or None,
                concurrency=args.concurrency,
                batch_size=args.batch_size,
                lease_seconds=args.lease_seconds,
                max_handler_seconds=args.max_handler_seconds,
                shutdown_grace_seconds=args.grace_seconds,
                blocked_loop_seconds=args.blocked_loop_seconds,
                metrics=metrics,
                outbox_relay=args.outbox_relay,
                outbox_metrics=PrometheusOutboxMetrics(metrics.registry),
                sync_runner=getattr(args, "sync_runner", None),
                trace_parent=args.trace_parent,
            )
            loop = asyncio.get_running_loop()
            stopped_by: list[signal.Signals] = []
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, _stop_worker, worker, sig, stopped_by)
            logging.getLogger("jobfence").info(
                "worker started: queues %s, concurrency %d%s",
                ", ".join(worker.queues),
                args.concurrency,
                ", with the outbox relay" if worker.outbox_relay is not None else "",
            )
            stats = await worker.run(until=args.until)
        counts = [f"{k} {v}" for k, v in sorted(stats.outcomes.items())]
        print("worker stopped: " + ", ".join([*counts, f"released {stats.released}"]))
        if len(stopped_by) > 1:
            # Stopped at once: exit as the signal's default action would say (130 for SIGINT).
            print(
                f"stopped at once by a second {stopped_by[-1].name}: {stats.cut_off} running"
                " job(s) cut off, rolled back and given back to the queue"
            )
            return 128 + stopped_by[-1].value
    finally:
        if server is not None:
            server.close()
        await pool.close()
    return 0


def _on_a_broker() -> bool:
    """Whether the queue (JOBFENCE_QUEUE_URL, which --queue-url sets) is a broker's."""
    from jobfence.queues import parse_queue_url, queue_url_from_env

    return parse_queue_url(queue_url_from_env()).external


def _stop_worker(worker: Worker, sig: signal.Signals, stopped_by: list[signal.Signals]) -> None:
    """SIGTERM or SIGINT: the first lets running jobs finish (within the grace period), a second
    stops at once. Either way every job held is given back: nothing is lost."""
    stopped_by.append(sig)
    log = logging.getLogger("jobfence")
    again = "press Ctrl-C again" if sig == signal.SIGINT else f"send {sig.name} again"
    if len(stopped_by) == 1:
        worker.stop()
        running = worker.running
        if running:
            log.info(
                "stopping: waiting for %d running job(s) (up to %gs; %s to stop now)",
                running,
                worker.shutdown_grace_seconds,
                again,
            )
        else:
            log.info("stopping: no job is running")
    elif len(stopped_by) == 2:
        log.info(
            "stopping now: cutting off %d running job(s); they roll back and go back to the queue",
            worker.running,
        )
        worker.stop(now=True)


async def _cmd_outbox_relay(args: argparse.Namespace) -> int:
    from jobfence.adapters.prometheus import PrometheusOutboxMetrics
    from jobfence.config import ENV_QUEUE_URL
    from jobfence.outbox import OutboxRelay, OutboxRelaySettings
    from jobfence.queues import parse_queue_url, queue_from_env, queue_url_from_env

    if not parse_queue_url(queue_url_from_env()).external:
        raise JobfenceError(
            f"outbox-relay publishes to a broker: set {ENV_QUEUE_URL} or --queue-url to its URL"
            " (with the PostgreSQL queue, producers write the queue itself and there is no"
            " outbox to relay)"
        )
    url = db.resolve_database_url()
    # Its session advisory lock (one active relay), its LISTEN and its session settings.
    await db.check_connection(url, needs_session="jobfence outbox-relay")
    pool = await db.open_pool(url, max_size=2, name="jobfence-outbox-relay")
    server: MetricsServer | None = None
    try:
        async with pool.connection() as conn:
            await schema.ensure_migrated(conn)
        async with queue_from_env(pool) as queue:
            metrics = PrometheusOutboxMetrics()
            server = _start_metrics_server(args, metrics.registry, database=None, app=None)
            settings = OutboxRelaySettings(
                batch_size=args.batch_size, poll_seconds=args.poll_seconds
            )
            relay = OutboxRelay(url, queue, settings=settings, metrics=metrics)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, relay.stop)
            stats = await relay.run()
    finally:
        if server is not None:
            server.close()
        await pool.close()
    print(f"outbox relay stopped: {stats.summary()}")
    return 0


async def _cmd_cleanup(args: argparse.Namespace) -> int:
    from jobfence.adapters.prometheus import PrometheusCleanupMetrics
    from jobfence.cleanup import cleanup_every, cleanup_expired

    url = db.resolve_database_url()
    await db.check_connection(url)
    metrics = PrometheusCleanupMetrics()
    sink = _cleanup_heartbeat(metrics)  # + the Better Stack heartbeat after each success
    server = _start_metrics_server(args, metrics.registry, database=None, app=None)
    try:
        async with await psycopg.AsyncConnection.connect(
            url, autocommit=True, **db.connect_options()
        ) as conn:
            await schema.ensure_migrated(conn)
            if (warning := await schema.autovacuum_warning(conn)) is not None:
                logging.getLogger("jobfence.cleanup").warning(warning)
            if args.every is None:
                try:
                    result = await cleanup_expired(conn, batch_size=args.batch_size, metrics=sink)
                except psycopg.Error:
                    sink.cleanup_failed()  # the heartbeat reports the failure (/fail)
                    raise
                print(f"removed {result.deleted} expired fence rows in {result.batches} batch(es)")
                return 0
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        total = await cleanup_every(
            url, interval_seconds=args.every, stop=stop, batch_size=args.batch_size, metrics=sink
        )
        print(f"removed {total} expired fence rows")
        return 0
    finally:
        await sink.aclose()
        if server is not None:
            server.close()


def _cleanup_heartbeat(metrics: CleanupMetricsSink) -> HeartbeatOnSuccess:
    from jobfence.adapters.betterstack import BetterStackHeartbeat, HeartbeatOnSuccess
    from jobfence.config import betterstack_allow_http_from_env, cleanup_heartbeat_url_from_env

    url = cleanup_heartbeat_url_from_env()
    heartbeat = (
        BetterStackHeartbeat(url, name="cleanup", allow_http=betterstack_allow_http_from_env())
        if url
        else None
    )
    return HeartbeatOnSuccess(metrics, heartbeat)


async def _cmd_alert_relay(args: argparse.Namespace) -> int:
    from jobfence.adapters.prometheus import PrometheusAlertMetrics
    from jobfence.alerts import AlertRelay, retry_failed_alerts
    from jobfence.config import alert_config_from_env

    config = alert_config_from_env()
    overrides = {
        name: getattr(args, name)
        for name in ("max_error_classes", "max_new_incidents", "incident_period_seconds")
        if getattr(args, name) is not None
    }
    config = dataclasses.replace(config, **overrides)
    url = db.resolve_database_url()
    if args.retry_failed:
        await db.check_connection(url)
        async with await psycopg.AsyncConnection.connect(
            url, autocommit=True, **db.connect_options()
        ) as conn:
            await schema.ensure_migrated(conn)
            print(f"{await retry_failed_alerts(conn)} failed alert(s) queued for delivery again")
        return 0
    # Its session advisory lock (one active relay) and its session settings: refused under
    # transaction pooling before the relay is set up (and logs its settings).
    await db.check_connection(url, needs_session="jobfence alert-relay")
    metrics = PrometheusAlertMetrics()
    relay = AlertRelay.from_config(url, config, poll_seconds=args.poll_seconds, metrics=metrics)
    server = None
    try:
        server = _start_metrics_server(args, metrics.registry, database=None, app=None)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, relay.stop)
        stats = await relay.run()
    finally:
        await relay.aclose()
        if server is not None:
            server.close()
    print(f"alert relay stopped: {stats.summary()}")
    return 0


async def _cmd_api(args: argparse.Namespace) -> int:
    from jobfence.api.serve import ServeOptions, serve, serve_workers
    from jobfence.queues import queue_url_from_env

    options = ServeOptions(
        host=args.host,
        port=args.port,
        pool_size=args.pool_size,
        bulk_chunk_size=args.bulk_chunk_size,
        item_cache_mb=args.item_cache_mb,
        workers=args.workers,
        access_log=args.access_log,
        queue_url=queue_url_from_env(),
    )
    if options.workers == 1:
        return await serve(options)
    verbose = bool(args.verbose)
    from jobfence.config import log_format_from_env

    return await serve_workers(
        options,
        log_format=args.log_format or log_format_from_env(),
        log_level=logging.DEBUG if verbose else logging.INFO,
        other_level=logging.DEBUG if verbose else logging.WARNING,
    )


def _api_workers(text: str) -> int:
    from jobfence.api.serve import MAX_WORKERS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_WORKERS}, got {value}")
    return value


async def _cmd_demo(args: argparse.Namespace) -> int:
    from jobfence.demo import run_demo
    from jobfence.queues import queue_url_from_env

    return await run_demo(
        jobs=args.jobs, duplicates=args.duplicates, queue_url=queue_url_from_env()
    )


def _seconds(high: float) -> Callable[[str], float]:
    """An argparse type for a number of seconds above 0 and at most ``high``; argparse puts the
    flag's name in front of the refusal."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value <= high:  # NaN and inf fail too
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds from 0 (excluded) to {high:g}, got {text!r}"
            )
        return value

    return parse


def _blocked_loop_seconds(text: str) -> float:
    """``--blocked-loop-seconds``: 0 (off) or seconds from 0.1 to 86400, as ``Worker`` takes."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    try:
        return checked_blocked_loop_seconds(value)
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"must be 0 (off) or a number of seconds from {MIN_BLOCKED_LOOP_SECONDS:g} to"
            f" {MAX_BLOCKED_LOOP_SECONDS:g}, got {text!r}"
        ) from None


def _duration_arg(text: str) -> float:
    from jobfence.config import parse_duration

    try:
        return parse_duration(text, name="the duration")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _whole(low: int, high: int) -> Callable[[str], int]:
    """An argparse type for a whole number from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be a whole number from {low} to {high}, got {text!r}"
            )
        return value

    return parse


# The ranges of the commands' numeric flags: wide enough for any real use, narrow enough that a
# value out of them (1e308, inf, a typo's extra zeros) is refused at start-up instead of failing
# later, at every fetch or round.
_lease_seconds = _seconds(MAX_LEASE_SECONDS)
_handler_seconds = _seconds(MAX_LEASE_SECONDS)
_grace_seconds = _seconds(86400)
_every_seconds = _seconds(7 * 86400)
_poll_seconds = _seconds(3600)
_port = _whole(0, 65535)
_concurrency = _whole(1, 10_000)
_fetch_batch = _whole(1, 10_000)
_rows_batch = _whole(1, 1_000_000)
_pool_size = _whole(1, 10_000)
_jobs = _whole(1, 1_000_000)
_duplicates = _whole(0, 1_000_000)
_item_cache_mb = _whole(0, 1_048_576)
_alert_bound = _whole(1, 1_000_000)
_lock_attempts = _whole(1, 1000)


def _lock_timeout(text: str) -> float:
    """``migrate --lock-timeout``: 0 (wait as long as it takes) or seconds up to 3600."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 3600:  # NaN and inf fail too
        raise argparse.ArgumentTypeError(
            f"must be 0 (no limit) or a number of seconds up to 3600, got {text!r}"
        )
    return value


def _add_alert_relay_parser(sub: Any) -> None:
    p = sub.add_parser(
        "alert-relay",
        help="deliver dead-letter alerts to Better Stack (needs JOBFENCE_BETTERSTACK_TOKEN)",
    )
    p.add_argument(
        "--poll-seconds", type=_poll_seconds, default=1.0, help="idle wait between rounds (1)"
    )
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="queue the alerts Better Stack refused (401, 422...) for delivery again, and exit",
    )
    p.add_argument(
        "--max-error-classes",
        type=_alert_bound,
        default=None,
        metavar="N",
        help="error classes of a consumer with an incident of their own at a time; the others "
        "share one (JOBFENCE_ALERT_MAX_ERROR_CLASSES, 5)",
    )
    p.add_argument(
        "--max-new-incidents",
        type=_alert_bound,
        default=None,
        metavar="N",
        help="new incidents per --incident-period; beyond, one alert storm incident counts the "
        "rest (JOBFENCE_ALERT_MAX_NEW_INCIDENTS, 10)",
    )
    p.add_argument(
        "--incident-period",
        dest="incident_period_seconds",
        type=_duration_arg,
        default=None,
        metavar="DURATION",
        help="the period of --max-new-incidents, such as 600, 10m or 1h "
        "(JOBFENCE_ALERT_INCIDENT_PERIOD, 10m)",
    )
    _add_metrics_options(p)
    p.set_defaults(func=_cmd_alert_relay)


def _add_roles_parser(sub: Any) -> None:
    p = sub.add_parser(
        "roles",
        help="print the SQL that creates the least-privilege database roles (owner, producer,"
        " worker, ops, relay, alert relay) and their grants",
    )
    p.add_argument(
        "--print-sql",
        action="store_true",
        required=True,
        help="print the SQL, to review and apply as a superuser after `jobfence migrate`",
    )
    for role in ("owner", "producer", "worker", "ops", "relay", "alert_relay"):
        p.add_argument(
            f"--{role.replace('_', '-')}",
            dest=role,
            default=None,
            metavar="NAME",
            help=f"the {role.replace('_', ' ')} role's name (jobfence_{role})",
        )
    p.set_defaults(func=_cmd_roles)


def _add_outbox_relay_parser(sub: Any) -> None:
    p = sub.add_parser(
        "outbox-relay",
        help="publish the outbox to the broker (needs JOBFENCE_QUEUE_URL or --queue-url)",
    )
    add_queue_url_option(p)
    p.add_argument(
        "--poll-seconds", type=_poll_seconds, default=1.0, help="idle wait between rounds (1)"
    )
    p.add_argument(
        "--batch-size",
        type=_fetch_batch,
        default=500,
        help="rows claimed and published together, their confirms outstanding at once (500)",
    )
    _add_metrics_options(p)
    p.set_defaults(func=_cmd_outbox_relay)


def _add_migrate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("migrate", help="apply the schema migrations (idempotent, locked)")
    p.add_argument(
        "--print-sql",
        action="store_true",
        help="print the migrations as one SQL script instead of applying them",
    )
    p.add_argument(
        "--queue-url",
        type=text_argument,
        default=None,
        metavar="URL",
        help="move this database's jobs to this queue: a broker's URL (producers then write"
        " the outbox), or postgresql for the PostgreSQL queue; refused while the queue left"
        " behind still holds messages. Without it, an exported JOBFENCE_QUEUE_URL is only"
        " checked against the database's queue (recorded on a database this run creates)",
    )
    p.add_argument(
        "--from-queue-url",
        type=text_argument,
        default=None,
        metavar="URL",
        help="the broker the move leaves, with its password, to count what it still holds"
        " (default: its recorded address, which has no password)",
    )
    p.add_argument(
        "--new-address",
        action="store_true",
        help="confirm a move to another address of the broker kind the database is on"
        " (another host, port, virtual host, database number or prefix)",
    )
    p.add_argument(
        "--lock-timeout",
        type=_lock_timeout,
        default=schema.DEFAULT_LOCK_TIMEOUT,
        metavar="SECONDS",
        help="how long a migration's statement waits for a table's lock before the migration is"
        " rolled back and tried again later: the statements queued behind it wait at most"
        f" that long (0: no limit; default {schema.DEFAULT_LOCK_TIMEOUT:g})",
    )
    p.add_argument(
        "--lock-attempts",
        type=_lock_attempts,
        default=schema.DEFAULT_LOCK_ATTEMPTS,
        metavar="N",
        help="tries per migration before giving up with exit status 1, paused 1 s, 2 s, 4 s..."
        f" (at most 30 s) apart (default {schema.DEFAULT_LOCK_ATTEMPTS})",
    )
    p.set_defaults(func=_cmd_migrate)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors redacted (:func:`cli_dead_letters.usage_error`):
    a URL typed in the wrong place is quoted with its password as ``***``."""

    def error(self, message: str) -> NoReturn:
        super().error(usage_error(message))


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(
        prog="jobfence",
        description="Exactly-one-effect queue consumers on PostgreSQL. The database is "
        "JOBFENCE_DATABASE_URL (required by every command but demo), e.g. "
        "postgresql://user@127.0.0.1:5432/dbname, or 'embedded': an embedded PostgreSQL in "
        "JOBFENCE_EMBEDDED_DIR (./.jobfence/pgdata), needs pip install 'jobfence[embedded]'.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument(
        "--version", action="version", version=f"jobfence {_version()}", help="print the version"
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="log lines as text or one JSON object each (default: JOBFENCE_LOG_FORMAT, or text)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _add_migrate_parser(sub)

    p = sub.add_parser("worker", help="run the consumers of MODULE:APP")
    p.add_argument("app", type=text_argument, help="the jobfence.App to run, as MODULE:ATTRIBUTE")
    p.add_argument(
        "--queue", type=text_argument, action="append", help="only these queues (repeatable)"
    )
    p.add_argument("--concurrency", type=_concurrency, default=4, help="jobs at once (4)")
    p.add_argument("--batch-size", type=_fetch_batch, default=None, help="messages per fetch")
    p.add_argument(
        "--lease-seconds", type=_lease_seconds, default=300.0, help="lease per delivery (300)"
    )
    p.add_argument(
        "--max-handler-seconds",
        type=_handler_seconds,
        default=None,
        metavar="S",
        help="keep each job's lease alive while it waits and its handler runs, up to S seconds"
        " of handler time; then the job is left to be delivered again (off)",
    )
    p.add_argument(
        "--trace-parent",
        choices=("link", "child"),
        default="link",
        help="with OpenTelemetry, a job's process span links to its producer's span (link) or"
        " is its child (child) (link)",
    )
    p.add_argument(
        "--grace-seconds",
        type=_grace_seconds,
        default=30.0,
        help="on SIGTERM or SIGINT, time running jobs get to finish; a second signal stops at"
        " once (30)",
    )
    p.add_argument(
        "--blocked-loop-seconds",
        type=_blocked_loop_seconds,
        default=DEFAULT_BLOCKED_LOOP_SECONDS,
        metavar="S",
        help="log a WARNING when the event loop has not run for S seconds (an async handler"
        " running blocking code), naming the job and where; 0: off (1)",
    )
    p.add_argument(
        "--until",
        choices=("stopped", "idle", "empty"),
        default="stopped",
        help="stop when nothing is due (idle), when the queues are empty, or on SIGTERM",
    )
    add_queue_url_option(p)
    p.add_argument(
        "--no-outbox-relay",
        dest="outbox_relay",
        action="store_false",
        help="on a broker, do not run the outbox relay in this worker (run jobfence"
        " outbox-relay instead)",
    )
    _add_metrics_options(p)
    p.set_defaults(func=_cmd_worker)

    p = sub.add_parser("cleanup", help="delete expired fence rows in bounded batches")
    p.add_argument("--batch-size", type=_rows_batch, default=5000, help="rows per batch (5000)")
    p.add_argument(
        "--every",
        type=_every_seconds,
        default=None,
        metavar="SECONDS",
        help="repeat every SECONDS until SIGTERM (a failed round is logged and retried)",
    )
    _add_metrics_options(p)
    p.set_defaults(func=_cmd_cleanup)

    p = sub.add_parser("demo", help="run the points-awarding demo workload")
    p.add_argument("--jobs", type=_jobs, default=200, help="distinct award jobs (200)")
    p.add_argument("--duplicates", type=_duplicates, default=50, help="duplicate deliveries (50)")
    add_queue_url_option(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "api",
        help="serve the Ops management HTTP API (needs JOBFENCE_JWT_SECRET or "
        "JOBFENCE_JWT_PUBLIC_KEY)",
    )
    p.add_argument(
        "--host",
        type=text_argument,
        default="127.0.0.1",
        help="address to listen on (127.0.0.1)",
    )
    p.add_argument("--port", type=_port, default=8080, help="port to listen on; 0: any (8080)")
    p.add_argument(
        "--pool-size", type=_pool_size, default=10, help="database connections at most (10)"
    )
    p.add_argument(
        "--bulk-chunk-size",
        type=_fetch_batch,
        default=500,
        help="dead letters per transaction in a bulk replay (500)",
    )
    p.add_argument(
        "--item-cache-mb",
        type=_item_cache_mb,
        default=64,
        help="MiB of list items kept in memory per process, never stale (docs/configuration.md);"
        " 0: none (64)",
    )
    p.add_argument(
        "--workers",
        type=_api_workers,
        default=1,
        help="API processes sharing the port, each with its own pool of --pool-size"
        " connections (1; Linux)",
    )
    p.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no uvicorn.access line per request (a proxy in front logs them already)",
    )
    add_queue_url_option(p)
    p.set_defaults(func=_cmd_api)

    _add_alert_relay_parser(sub)

    _add_roles_parser(sub)
    _add_outbox_relay_parser(sub)
    cli_dead_letters.add_parser(sub)  # jobfence dead-letters ...: its commands set func
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    sync_runner: SyncTransactionRunner | None = None,
    follow_logging: bool = False,
) -> int:
    """Run one ``jobfence`` command. ``sync_runner``: what ``worker`` runs the transactions of
    sync handlers on, instead of its own psycopg pool (``manage.py jobfence_worker`` gives
    Django's, see docs/django.md). ``follow_logging``: when the root logger has handlers
    already (a framework's logging settings), log through them instead of adding one
    (:func:`jobfence.observability.follow_configured_logging`)."""
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    if "--json" in words:
        # A usage mistake in a --json command: argparse's lines on stderr, and the error as
        # JSON on stdout, like any other error of a --json command.
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                args = parser.parse_args(words)
        except SystemExit as exc:
            sys.stderr.write(said.getvalue())
            if exc.code in (0, None):
                raise
            lines = said.getvalue().strip().splitlines() or ["invalid arguments"]
            message = lines[-1].removeprefix("jobfence: error: ")
            return report_error_json(message, int(exc.code) if isinstance(exc.code, int) else 2)
        sys.stderr.write(said.getvalue())
    else:
        args = parser.parse_args(words)
    args.sync_runner = sync_runner
    as_json = bool(getattr(args, "json", False))
    from jobfence.config import ENV_QUEUE_URL, log_format_from_env
    from jobfence.observability import configure_logging, follow_configured_logging
    from jobfence.queues import parse_queue_url, queue_url_from_env

    try:
        if getattr(args, "queue_url", None) is not None:
            # The flag overrides the variable; from here on both say the same (and the
            # log redaction knows its password).
            os.environ[ENV_QUEUE_URL] = args.queue_url
        if args.command != "migrate" and hasattr(args, "queue_url"):
            parse_queue_url(queue_url_from_env())  # a bad URL is refused before any work
        log_format = args.log_format or log_format_from_env()
        # Before any other work: a command that needs the database refuses at once when
        # JOBFENCE_DATABASE_URL is unset, blank or unusable; only the demo defaults to embedded.
        if args.command == "demo":
            db.check_database_setting(embedded_when_unset=True)
        elif not getattr(args, "print_sql", False):
            db.check_database_setting()
    except JobfenceError as exc:
        return report_error(str(exc), 2, as_json=as_json)
    # jobfence's own start-up and progress lines (the database in use, retry-policy overrides
    # with their rationale) are INFO; other libraries stay at WARNING unless -v. Configured
    # secrets (tokens, the database password) are redacted from every line.
    level = logging.DEBUG if args.verbose else logging.INFO
    if follow_logging and follow_configured_logging(level):
        if args.verbose:  # asked for on this command line: every logger at DEBUG
            logging.getLogger().setLevel(logging.DEBUG)
            logging.getLogger("jobfence").setLevel(logging.DEBUG)
    else:
        configure_logging(
            log_format, level, other_level=logging.DEBUG if args.verbose else logging.WARNING
        )
    func: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] = args.func
    try:
        return runtime.run(lambda: func(args))
    except JobfenceError as exc:
        return report_error(str(exc), 2, as_json=as_json)
    except psycopg.Error as exc:
        if db.is_read_only(exc):  # a standby, or default_transaction_read_only: try again later
            return report_error(
                f"the database is read-only ({type(exc).__name__}: {exc}; {db.READ_ONLY_HINT})",
                1,
                as_json=as_json,
            )
        # Permission denied, a lost connection...: one line, never the password.
        return report_error(f"database error ({type(exc).__name__}): {exc}", 1, as_json=as_json)
    except BrokenPipeError:
        # The reader went away (``jobfence dead-letters list | head``): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130


def report_error_json(message: str, exit_code: int) -> int:
    """:func:`report_error` for a --json command, its line on stderr written already."""
    print(json.dumps({"error": message, "exit_code": exit_code}), flush=True)
    return exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
