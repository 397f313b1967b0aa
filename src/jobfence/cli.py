"""The ``jobfence`` command: parse, call the library, format. No logic of its own."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from jobfence import cli_dead_letters, db, runtime, schema
from jobfence.app import App
from jobfence.errors import JobfenceError
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


async def _cmd_migrate(args: argparse.Namespace) -> int:
    if args.print_sql:
        sys.stdout.write(schema.render_sql())
        return 0
    from jobfence.queues import adopt_queue, parse_queue_url

    # A bad queue URL is refused before anything is applied.
    target = parse_queue_url(args.queue_url) if args.queue_url is not None else None
    url = db.resolve_database_url()
    await db.check_connection(url)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        applied = await schema.migrate(conn)
        if applied:
            for m in applied:
                print(f"applied {m.version:04d}_{m.name}")
        else:
            print(f"already up to date (version {schema.latest_version():04d})")
        if target is not None:
            await adopt_queue(conn, target, switch=True)
            print(f"jobs go to {target.describe()}")
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
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="(127.0.0.1)")


async def _cmd_worker(args: argparse.Namespace) -> int:
    from jobfence.adapters.prometheus import PrometheusMetrics, PrometheusOutboxMetrics
    from jobfence.queues import queue_from_env
    from jobfence.worker import Worker

    app = _load_app(args.app)
    app.check_fence_ttls()
    url = db.resolve_database_url()
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
                metrics=metrics,
                outbox_relay=args.outbox_relay,
                outbox_metrics=PrometheusOutboxMetrics(metrics.registry),
                sync_runner=getattr(args, "sync_runner", None),
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
    await db.check_connection(url)
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
    server = _start_metrics_server(args, metrics.registry, database=None, app=None)
    sink = _cleanup_heartbeat(metrics)  # + the Better Stack heartbeat after each success
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
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
    from jobfence.config import cleanup_heartbeat_url_from_env

    url = cleanup_heartbeat_url_from_env()
    return HeartbeatOnSuccess(metrics, BetterStackHeartbeat(url, name="cleanup") if url else None)


async def _cmd_alert_relay(args: argparse.Namespace) -> int:
    from jobfence.adapters.prometheus import PrometheusAlertMetrics
    from jobfence.alerts import AlertRelay, retry_failed_alerts
    from jobfence.config import alert_config_from_env

    config = alert_config_from_env()
    url = db.resolve_database_url()
    if args.retry_failed:
        await db.check_connection(url)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await schema.ensure_migrated(conn)
            print(f"{await retry_failed_alerts(conn)} failed alert(s) queued for delivery again")
        return 0
    metrics = PrometheusAlertMetrics()
    relay = AlertRelay.from_config(url, config, poll_seconds=args.poll_seconds, metrics=metrics)
    server = None
    try:
        await db.check_connection(url)
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


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535, got {value}")
    return value


async def _cmd_demo(args: argparse.Namespace) -> int:
    from jobfence.demo import run_demo
    from jobfence.queues import queue_url_from_env

    return await run_demo(
        jobs=args.jobs, duplicates=args.duplicates, queue_url=queue_url_from_env()
    )


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_outbox_relay_parser(sub: Any) -> None:
    p = sub.add_parser(
        "outbox-relay",
        help="publish the outbox to the broker (needs JOBFENCE_QUEUE_URL or --queue-url)",
    )
    add_queue_url_option(p)
    p.add_argument(
        "--poll-seconds", type=_positive_float, default=1.0, help="idle wait between rounds (1)"
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=500,
        help="rows claimed and published together, their confirms outstanding at once (500)",
    )
    _add_metrics_options(p)
    p.set_defaults(func=_cmd_outbox_relay)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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

    p = sub.add_parser("migrate", help="apply the schema migrations (idempotent, locked)")
    p.add_argument(
        "--print-sql",
        action="store_true",
        help="print the migrations as one SQL script instead of applying them",
    )
    p.add_argument(
        "--queue-url",
        default=None,
        metavar="URL",
        help="also record where this database's jobs go: a broker's URL (producers then write"
        " the outbox), or postgresql for the PostgreSQL queue; refused while the queue left"
        " behind still holds messages",
    )
    p.set_defaults(func=_cmd_migrate)

    p = sub.add_parser("worker", help="run the consumers of MODULE:APP")
    p.add_argument("app", help="the jobfence.App to run, as MODULE:ATTRIBUTE")
    p.add_argument("--queue", action="append", help="only these queues (repeatable)")
    p.add_argument("--concurrency", type=_positive_int, default=4, help="jobs at once (4)")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="messages per fetch")
    p.add_argument(
        "--lease-seconds", type=_positive_float, default=300.0, help="lease per delivery (300)"
    )
    p.add_argument(
        "--max-handler-seconds",
        type=_positive_float,
        default=None,
        metavar="S",
        help="keep each job's lease alive while it waits and its handler runs, up to S seconds"
        " of handler time; then the job is left to be delivered again (off)",
    )
    p.add_argument(
        "--grace-seconds",
        type=_positive_float,
        default=30.0,
        help="on SIGTERM or SIGINT, time running jobs get to finish; a second signal stops at"
        " once (30)",
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
    p.add_argument("--batch-size", type=_positive_int, default=5000, help="rows per batch (5000)")
    p.add_argument(
        "--every",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="repeat every SECONDS until SIGTERM (a failed round is logged and retried)",
    )
    _add_metrics_options(p)
    p.set_defaults(func=_cmd_cleanup)

    p = sub.add_parser("demo", help="run the points-awarding demo workload")
    p.add_argument("--jobs", type=_positive_int, default=200, help="distinct award jobs (200)")
    p.add_argument(
        "--duplicates", type=_non_negative_int, default=50, help="duplicate deliveries (50)"
    )
    add_queue_url_option(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "api",
        help="serve the Ops management HTTP API (needs JOBFENCE_JWT_SECRET or "
        "JOBFENCE_JWT_PUBLIC_KEY)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=_port, default=8080, help="port to listen on; 0: any (8080)")
    p.add_argument(
        "--pool-size", type=_positive_int, default=10, help="database connections at most (10)"
    )
    p.add_argument(
        "--bulk-chunk-size",
        type=_positive_int,
        default=500,
        help="dead letters per transaction in a bulk replay (500)",
    )
    p.add_argument(
        "--item-cache-mb",
        type=_non_negative_int,
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

    p = sub.add_parser(
        "alert-relay",
        help="deliver dead-letter alerts to Better Stack (needs JOBFENCE_BETTERSTACK_TOKEN)",
    )
    p.add_argument(
        "--poll-seconds", type=_positive_float, default=1.0, help="idle wait between rounds (1)"
    )
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="queue the alerts Better Stack refused (401, 422...) for delivery again, and exit",
    )
    _add_metrics_options(p)
    p.set_defaults(func=_cmd_alert_relay)

    _add_outbox_relay_parser(sub)
    cli_dead_letters.add_parser(sub)  # jobfence dead-letters ...: its commands set func
    return parser


def main(
    argv: Sequence[str] | None = None, *, sync_runner: SyncTransactionRunner | None = None
) -> int:
    """Run one ``jobfence`` command. ``sync_runner``: what ``worker`` runs the transactions of
    sync handlers on, instead of its own psycopg pool (``manage.py jobfence_worker`` gives
    Django's, see docs/django.md)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.sync_runner = sync_runner
    from jobfence.config import ENV_QUEUE_URL, log_format_from_env
    from jobfence.observability import configure_logging
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
        print(f"jobfence: error: {exc}", file=sys.stderr)
        return 2
    # jobfence's own start-up and progress lines (the database in use, retry-policy overrides
    # with their rationale) are INFO; other libraries stay at WARNING unless -v. Configured
    # secrets (tokens, the database password) are redacted from every line.
    configure_logging(
        log_format,
        logging.DEBUG if args.verbose else logging.INFO,
        other_level=logging.DEBUG if args.verbose else logging.WARNING,
    )
    func: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] = args.func
    try:
        return runtime.run(lambda: func(args))
    except JobfenceError as exc:
        print(f"jobfence: error: {exc}", file=sys.stderr)
        return 2
    except psycopg.Error as exc:
        # Permission denied, a lost connection...: one line, never the password.
        reason = " ".join(str(exc).split())
        print(f"jobfence: error: database error ({type(exc).__name__}): {reason}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (``jobfence dead-letters list | head``): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
