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
from typing import Any

import psycopg

from jobfence import db, schema
from jobfence.app import App
from jobfence.errors import JobfenceError


def _load_app(spec: str) -> App:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise JobfenceError(f"expected MODULE:ATTRIBUTE (e.g. myproject.jobs:app), got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise JobfenceError(f"cannot import module {module_name!r}: {exc}") from None
    app = getattr(module, attr, None)
    if not isinstance(app, App):
        raise JobfenceError(f"{spec} is not a jobfence.App (found {type(app).__name__})")
    return app


async def _cmd_migrate(args: argparse.Namespace) -> int:
    if args.print_sql:
        sys.stdout.write(schema.render_sql())
        return 0
    url = db.resolve_database_url()
    await db.check_connection(url)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        applied = await schema.migrate(conn)
    if applied:
        for m in applied:
            print(f"applied {m.version:04d}_{m.name}")
    else:
        print(f"already up to date (version {schema.latest_version():04d})")
    return 0


async def _cmd_worker(args: argparse.Namespace) -> int:
    from jobfence.adapters.pg_queue import PgQueue
    from jobfence.worker import Worker

    app = _load_app(args.app)
    app.check_fence_ttls()
    url = db.resolve_database_url()
    pool = await db.open_pool(url, max_size=args.concurrency + 2, name="jobfence-worker")
    try:
        async with pool.connection() as conn:
            await schema.ensure_migrated(conn)
        queue = PgQueue(pool)
        worker = Worker(
            app,
            pool,
            queue,
            queues=args.queue or None,
            concurrency=args.concurrency,
            batch_size=args.batch_size,
            lease_seconds=args.lease_seconds,
            shutdown_grace_seconds=args.grace_seconds,
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        logging.getLogger("jobfence").info(
            "worker started: queues %s, concurrency %d", ", ".join(worker.queues), args.concurrency
        )
        stats = await worker.run(until=args.until)
        await queue.close()
        counts = [f"{k} {v}" for k, v in sorted(stats.outcomes.items())]
        print("worker stopped: " + ", ".join([*counts, f"released {stats.released}"]))
    finally:
        await pool.close()
    return 0


async def _cmd_cleanup(args: argparse.Namespace) -> int:
    from jobfence.cleanup import cleanup_every, cleanup_expired

    url = db.resolve_database_url()
    await db.check_connection(url)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await schema.ensure_migrated(conn)
        if args.every is None:
            result = await cleanup_expired(conn, batch_size=args.batch_size)
            print(f"removed {result.deleted} expired fence rows in {result.batches} batch(es)")
            return 0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    total = await cleanup_every(
        url, interval_seconds=args.every, stop=stop, batch_size=args.batch_size
    )
    print(f"removed {total} expired fence rows")
    return 0


async def _cmd_demo(args: argparse.Namespace) -> int:
    from jobfence.demo import run_demo

    return await run_demo(jobs=args.jobs, duplicates=args.duplicates)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobfence",
        description="Exactly-one-effect queue consumers on PostgreSQL. The database is "
        "JOBFENCE_DATABASE_URL, or an embedded PostgreSQL in ./.jobfence/pgdata when unset.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("migrate", help="apply the schema migrations (idempotent, locked)")
    p.add_argument(
        "--print-sql",
        action="store_true",
        help="print the migrations as one SQL script instead of applying them",
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
        "--grace-seconds",
        type=_positive_float,
        default=30.0,
        help="on SIGTERM, time to finish jobs (30)",
    )
    p.add_argument(
        "--until",
        choices=("stopped", "idle", "empty"),
        default="stopped",
        help="stop when nothing is due (idle), when the queues are empty, or on SIGTERM",
    )
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
    p.set_defaults(func=_cmd_cleanup)

    p = sub.add_parser("demo", help="run the points-awarding demo workload")
    p.add_argument("--jobs", type=_positive_int, default=200, help="distinct award jobs (200)")
    p.add_argument(
        "--duplicates", type=_non_negative_int, default=50, help="duplicate deliveries (50)"
    )
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # jobfence's own start-up and progress lines (the database in use, retry-policy overrides
    # with their rationale) are INFO; other libraries stay at WARNING unless -v.
    logging.getLogger("jobfence").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    func: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] = args.func
    try:
        return asyncio.run(func(args))
    except JobfenceError as exc:
        print(f"jobfence: error: {exc}", file=sys.stderr)
        return 2
    except psycopg.Error as exc:
        # Permission denied, a lost connection...: one line, never the password.
        reason = " ".join(str(exc).split())
        print(f"jobfence: error: database error ({type(exc).__name__}): {reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
