"""A flame graph of one jobfence worker process, on the PostgreSQL queue or on RabbitMQ.

The jobs are put on the queue first (enqueued into ``jobfence_queue.messages``, or published
straight to RabbitMQ); then py-spy starts a worker process and samples it while
``Worker(app, pool, queue, concurrency=1).run(until="idle")`` handles them, one transaction per
job, with throughput.py's work statement. Set-up is not sampled; the worker process's imports
are (a thin tower at the left or right of the graph). py-spy is on PyPI (``pip install py-spy``).

    PYTHONPATH=src /tmp/benchvenv/bin/python benchmarks/flame.py --queue pg --out docs/flame-pg.svg
    PYTHONPATH=src /tmp/benchvenv/bin/python benchmarks/flame.py --queue rabbitmq \
        --out docs/flame-rabbitmq.svg --jobs 20000

``--idle`` keeps py-spy's idle samples (time waiting on the server) in the picture.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import broker_systems as bs
import psycopg
from common import (
    QUEUE,
    Tracker,
    admin_url_from_env,
    build_jobfence_app,
    create_database,
    drop_database,
    enqueue_jobfence,
)

from jobfence import PgQueue, QueuePort, Worker, open_pool, runtime
from jobfence.schema import migrate

DBNAME = "jobfence_flame"
BROKER_URL = bs.DEFAULT_URLS["rabbitmq"]


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("flame.py: py-spy is not installed (pip install py-spy)")
    return found


async def set_up(args: argparse.Namespace, url: str, name: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
        if args.queue == "pg":
            await enqueue_jobfence(conn, "f:", 0, args.jobs)
        else:
            await bs.publish(bs.JOBFENCE_RABBITMQ, _urls(BROKER_URL), name, "f:", args.jobs)
        await conn.execute("VACUUM (ANALYZE)")
        await conn.execute("CHECKPOINT")


async def work(args: argparse.Namespace) -> None:
    """The sampled process: the worker over the jobs already queued."""
    tracker = Tracker()
    pool = await open_pool(args.url, min_size=2, max_size=3, name="flame")
    queue: QueuePort
    if args.queue == "pg":
        queue = PgQueue(pool, poll_interval_seconds=0.05)
    else:
        queue = bs.jobfence_queue(bs.JOBFENCE_RABBITMQ, BROKER_URL, args.name)
    try:
        worker = Worker(build_jobfence_app(tracker), pool, queue, concurrency=1, poll_seconds=0.05)
        await queue.size([QUEUE])
        started, cpu = time.monotonic(), time.process_time()
        await worker.run(until="idle" if args.queue == "pg" else "empty")
        wall, cpu = time.monotonic() - started, time.process_time() - cpu
    finally:
        await queue.close()
        await pool.close()
    if tracker.count != args.jobs:
        raise SystemExit(f"flame.py: handled {tracker.count} of {args.jobs} jobs")
    print(
        f"{args.queue}: {args.jobs:,} jobs in {wall:.2f} s ({args.jobs / wall:,.0f}/s),"
        f" worker CPU {cpu * 1000 / args.jobs:.3f} ms per job; flame graph: {args.out}"
    )


def sample(args: argparse.Namespace, url: str, name: str) -> None:
    """Run :func:`work` in a child process that py-spy starts and samples (py-spy cannot
    attach to a running process on every kernel; started by it, it always can)."""
    command = [_py_spy(), "record", "--rate", str(args.rate), "--output", str(args.out)]
    command += ["--format", args.format, "--nonblocking"] + (["--idle"] if args.idle else [])
    command += ["--", sys.executable, __file__, "--worker", "--url", url, "--name", name]
    command += ["--queue", args.queue, "--jobs", str(args.jobs), "--out", str(args.out)]
    command += ["--loop", args.loop] if args.loop else []
    subprocess.run(command, check=True, stderr=subprocess.DEVNULL if not args.verbose else None)
    shorten_paths(args.out, f"jobfence worker, {args.queue} queue, {args.jobs:,} jobs: flame.py")


def shorten_paths(out: Path, title: str) -> None:
    """File names relative to the import path (``jobfence/harness.py``, ``psycopg/...``), so
    that the picture reads the same on every machine and names no local directory; ``title``
    in place of py-spy's command line (which names the database URL)."""
    text = re.sub(r'(<text id="title"[^>]*>)[^<]*(</text>)', rf"\g<1>{title}\g<2>", out.read_text())
    for prefix in sorted({p for p in sys.path if p and p.startswith("/")}, key=len, reverse=True):
        text = text.replace(prefix.rstrip("/") + "/", "")
    out.write_text(text)


async def prepare(args: argparse.Namespace) -> tuple[str, str, str]:
    admin = admin_url_from_env()
    return admin, await create_database(admin, DBNAME), bs.new_name()


async def clean_up(args: argparse.Namespace, admin: str, name: str) -> None:
    if args.queue == "rabbitmq":
        await bs.delete_run(bs.JOBFENCE_RABBITMQ, _urls(BROKER_URL), name)
    await drop_database(admin, DBNAME)


def _urls(rabbitmq: str) -> bs.Urls:
    return bs.Urls(rabbitmq=rabbitmq, nats=bs.DEFAULT_URLS["nats"], redis=bs.DEFAULT_URLS["redis"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", choices=("pg", "rabbitmq"), default="pg")
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--out", type=Path, required=True, help="the file to write")
    parser.add_argument(
        "--format", default="flamegraph", help="py-spy's output: flamegraph (SVG) or raw (folded)"
    )
    parser.add_argument("--idle", action="store_true", help="keep idle samples")
    parser.add_argument("--loop", default=None, help="event loop (as `jobfence worker --loop`)")
    parser.add_argument("--verbose", action="store_true", help="show py-spy's own output")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        runtime.run(lambda: work(args), loop=args.loop)
        return
    admin, url, name = runtime.run(lambda: prepare(args))
    try:
        runtime.run(lambda: set_up(args, url, name))
        sample(args, url, name)
    finally:
        runtime.run(lambda: clean_up(args, admin, name))


if __name__ == "__main__":
    main()
