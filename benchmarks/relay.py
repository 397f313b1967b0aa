"""The outbox relay's publish rate on each broker, this tree's against another tree's (main's),
and the end-to-end throughput through the outbox against the same workers fed directly.

    .venv/bin/python benchmarks/relay.py --baseline-python /work/main/.venv/bin/python
    .venv/bin/python benchmarks/relay.py --brokers nats --rows 5000 --no-e2e

Side by side in one run, per broker (RabbitMQ, NATS JetStream, Redis Streams on this machine):

1. **Publish rate**: rows written to ``jobfence.outbox`` in one statement, then
   ``OutboxRelay(...).run()`` timed until the outbox is empty (rows / seconds), alone
   (straight to the broker) and with every broker reply 50 ms late (``tests/tcp_proxy.py``'s
   ``reply_delay``, in front of the broker). Each measurement runs in a child process of the
   interpreter given: this tree's ``.venv`` for "now", ``--baseline-python`` (with its own
   ``jobfence`` importable, e.g. main's checkout and venv) for "before"; each child migrates its
   own database with its own ``jobfence``.
2. **End to end** (this tree only): N jobs committed to the outbox, then one
   ``Worker(app, pool, queue, concurrency=4)`` with its embedded relay, timed until every job
   is applied (``run(until="empty")``), against the same worker with ``outbox_relay=False`` on
   the same N jobs published straight to the broker beforehand (not timed). With
   ``--relay-process`` a third side runs the relay in a process of its own (as
   ``jobfence outbox-relay`` beside workers started with ``--no-outbox-relay``): the worker
   (``outbox_relay=False``) and the relay, connected beforehand, start together and the clock
   stops at the last job's handler.

Every job does ``UPDATE bench_accounts SET points = points + 1`` with its fence; the points are
checked. Broker names are random (``jfrelay<hex>``) and deleted afterwards; each child's
database (``jobfence_relay_bench_<n>``) is dropped at its end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from statistics import median
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.conninfo import make_conninfo

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(Path(__file__).resolve())
BROKER_URLS = {
    "rabbitmq": os.environ.get("JOBFENCE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    "nats": os.environ.get("JOBFENCE_TEST_NATS_URL", "nats://127.0.0.1:4222"),
    "redis": os.environ.get("JOBFENCE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
    # Set by the parent once it has started the cluster (``--brokers nats3``).
    "nats3": os.environ.get("JOBFENCE_BENCH_NATS_CLUSTER_URL", ""),
}
KIND = {"rabbitmq": "rabbitmq", "nats": "nats", "redis": "redis", "nats3": "nats"}
QUEUE = "bench"
CONSUMER = "bench_award"
OUTBOX_FILL = """
INSERT INTO jobfence.outbox (queue, consumer, job_id, body)
SELECT %(queue)s, %(consumer)s, %(prefix)s || g,
       convert_to(format('{"account_id":%%s,"points":1}', g %% 100 + 1), 'UTF8')
FROM generate_series(1, %(rows)s::bigint) AS g
"""


def admin_url() -> str:
    return os.environ.get("JOBFENCE_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


# -- the child: one measurement, with whatever jobfence its interpreter imports ----------------


def _queue(kind: str, url: str, name: str) -> Any:
    if kind == "redis":
        from jobfence.adapters.redis_streams import RedisStreamsQueue

        return RedisStreamsQueue(url, prefix=name)
    if kind in ("nats", "nats3"):
        from jobfence.adapters.nats import NatsQueue

        replicas = 3 if kind == "nats3" else 1
        return NatsQueue(url, stream=name.upper(), subject_prefix=name, replicas=replicas)
    from jobfence.adapters.rabbitmq import RabbitMQQueue

    return RabbitMQQueue(url, prefix=name)


async def _delete(kind: str, url: str, name: str) -> None:
    if kind == "redis":
        import redis.asyncio as aioredis

        admin = aioredis.Redis.from_url(url)
        keys = [key async for key in admin.scan_iter(match=f"{name}:*")]
        if keys:
            await admin.delete(*keys)
        await admin.aclose()
    elif kind in ("nats", "nats3"):
        import nats

        nc = await nats.connect(url.split(","))
        with contextlib.suppress(Exception):  # nothing was published
            await nc.jetstream().delete_stream(name.upper())
        await nc.close()
    else:
        import aio_pika

        connection = await aio_pika.connect(url)
        channel = await connection.channel()
        await channel.queue_delete(f"{name}.{QUEUE}")
        await connection.close()


def _through(port: int, url: str) -> str:
    parts = urlsplit(url)
    userinfo, _, _ = parts.netloc.rpartition("@")
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


async def _fresh_database(dbname: str) -> str:
    from jobfence.schema import migrate

    async with await psycopg.AsyncConnection.connect(admin_url(), autocommit=True) as conn:
        await conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{dbname}"')
    url = make_conninfo(admin_url(), dbname=dbname)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
    return url


async def _drop_database(dbname: str) -> None:
    async with await psycopg.AsyncConnection.connect(admin_url(), autocommit=True) as conn:
        await conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


async def child_relay(kind: str, rows: int, delay: float, dbname: str) -> dict[str, Any]:
    """Fill the outbox with ``rows`` rows, time the relay until it is empty."""
    sys.path.insert(0, str(ROOT / "tests"))
    from jobfence.outbox import OutboxRelay, OutboxRelaySettings, record_queue
    from tcp_proxy import TcpProxy

    url = await _fresh_database(dbname)
    broker_url = BROKER_URLS[kind]
    name = f"jfrelay{uuid.uuid4().hex[:10]}"
    parts = urlsplit(broker_url)
    # Alone, the relay talks to the broker itself: a proxy in this process would cost the relay
    # CPU and a hop per round trip that no deployment has.
    proxy = (
        TcpProxy(parts.hostname or "127.0.0.1", parts.port or 0, reply_delay=delay)
        if delay > 0
        else None
    )
    if proxy is not None:
        await proxy.start()
    queue = _queue(kind, _through(proxy.port, broker_url) if proxy else broker_url, name)
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await record_queue(conn, KIND[kind], broker_url)
            await conn.execute(
                OUTBOX_FILL, {"queue": QUEUE, "consumer": CONSUMER, "prefix": "r-", "rows": rows}
            )
            await conn.execute("VACUUM ANALYZE jobfence.outbox")
            settings = OutboxRelaySettings(poll_seconds=0.05)
            relay = OutboxRelay(url, queue, settings=settings)
            task = asyncio.create_task(relay.run())
            # The relay has no event for it: connected, locked and listening.
            while not relay.active and not task.done():  # noqa: ASYNC110
                await asyncio.sleep(0.001)
            started, cpu_started = time.perf_counter(), time.process_time()
            while True:
                cur = await conn.execute("SELECT count(*) FROM jobfence.outbox")
                left = (await cur.fetchone())[0]  # type: ignore[index]
                if left == 0 or task.done():
                    break
                await asyncio.sleep(0.01)
            elapsed = time.perf_counter() - started
            cpu = time.process_time() - cpu_started
            relay.stop()
            await conn.execute("SELECT pg_notify('jobfence_outbox', '')")
            await asyncio.wait_for(task, 60)
            size = await queue.size([QUEUE])
    finally:
        await queue.close()
        if proxy is not None:
            await proxy.close()
        await _delete(kind, broker_url, name)
        await _drop_database(dbname)
    return {
        "rows": rows,
        "seconds": elapsed,
        "rate": rows / elapsed,
        # This process's CPU (the relay, and the benchmark's count every 10 ms) per row.
        "cpu_us": cpu / rows * 1e6,
        "batch_size": settings.batch_size,
        "on_broker": size.total,
        "left": left,
    }


# -- end to end (this tree) ------------------------------------------------------------------


async def end_to_end(  # noqa: PLR0915
    kind: str, jobs: int, concurrency: int, rounds: int, *, relay_process: bool = False
) -> dict[str, Any]:
    from pydantic import BaseModel

    from jobfence import App, JobMeta, Worker, open_pool
    from jobfence.model import Message, Outgoing
    from jobfence.outbox import OutboxRelaySettings, record_queue

    class Award(BaseModel):
        account_id: int
        points: int

    app = App()
    handled = 0
    finished = asyncio.Event()

    @app.consumer(CONSUMER, queue=QUEUE, schema=Award)
    async def award(payload: Award, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
        nonlocal handled
        await tx.execute(
            "UPDATE bench_accounts SET points = points + %s WHERE id = %s",
            (payload.points, payload.account_id),
        )
        handled += 1
        if handled >= jobs:
            finished.set()

    modes = ["outbox", "direct", *(["process"] if relay_process else [])]
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    # CPU per job (us) of the broker's server, PostgreSQL's and the processes of this
    # benchmark (the worker, and the relay's child), in the timed part of each round.
    cpu: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    order = [mode for r in range(rounds) for mode in (modes if r % 2 == 0 else modes[::-1])]
    for mode in order:
        dbname = f"jobfence_relay_bench_e2e_{os.getpid()}"
        url = await _fresh_database(dbname)
        broker_url = BROKER_URLS[kind]
        name = f"jfrelay{uuid.uuid4().hex[:10]}"
        queue = _queue(kind, broker_url, name)
        pool = await open_pool(url, min_size=2, max_size=concurrency + 4)
        try:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await conn.execute(
                    "CREATE TABLE bench_accounts (id integer PRIMARY KEY, points bigint NOT NULL);"
                    " INSERT INTO bench_accounts SELECT g, 0 FROM generate_series(1, 100) g"
                )
                await record_queue(conn, KIND[kind], broker_url)
                if mode in ("outbox", "process"):
                    await conn.execute(
                        OUTBOX_FILL,
                        {"queue": QUEUE, "consumer": CONSUMER, "prefix": "e-", "rows": jobs},
                    )
                else:
                    for start in range(0, jobs, 500):
                        chunk = [
                            Outgoing(
                                Message(
                                    QUEUE,
                                    CONSUMER,
                                    f"e-{g}",
                                    f'{{"account_id":{g % 100 + 1},"points":1}}'.encode(),
                                )
                            )
                            for g in range(start + 1, min(start + 500, jobs) + 1)
                        ]
                        sent = await queue.publish_many(chunk)
                        assert all(r is None for r in sent), sent
                worker = Worker(
                    app,
                    pool,
                    queue,
                    concurrency=concurrency,
                    poll_seconds=0.05,
                    outbox_relay=mode == "outbox",
                    outbox_settings=OutboxRelaySettings(poll_seconds=0.05),
                )
                handled = 0
                finished.clear()
                before = _cpu_seconds(kind)
                if mode == "process":
                    elapsed = await _with_relay_process(kind, url, name, worker, finished)
                else:
                    started = time.perf_counter()
                    await asyncio.wait_for(worker.run(until="empty"), 600)
                    elapsed = time.perf_counter() - started
                for part, seconds in _cpu_seconds(kind).items():
                    used = seconds - before.get(part, 0.0)
                    cpu[mode].setdefault(part, []).append(used / jobs * 1e6)
                cur = await conn.execute("SELECT sum(points) FROM bench_accounts")
                total = (await cur.fetchone())[0]  # type: ignore[index]
                assert total == jobs, (total, jobs)
                rates[mode].append(jobs / elapsed)
        finally:
            await pool.close()
            await queue.close()
            await _delete(kind, broker_url, name)
            await _drop_database(dbname)
    # The median of the rounds (the upper one of two), each mode's rounds alternating first.
    result: dict[str, Any] = {mode: sorted(got)[len(got) // 2] for mode, got in rates.items()}
    result["rounds"] = {mode: [round(r) for r in got] for mode, got in rates.items()}
    result["cpu_us_per_job"] = {
        mode: {part: round(sorted(v)[len(v) // 2]) for part, v in parts.items()}
        for mode, parts in cpu.items()
    }
    return result


_SERVERS = {
    "rabbitmq": "beam.smp",
    "nats": "nats-server",
    "nats3": "nats-server",
    "redis": "redis-server",
}


def _cpu_seconds(kind: str) -> dict[str, float]:
    """CPU seconds (user + system) so far of the broker's server, of PostgreSQL's processes,
    and of this process with its children (the relay's, once it has ended)."""
    import psutil

    totals = {"broker": 0.0, "postgresql": 0.0}
    for proc in psutil.process_iter(["name"]):
        part = (
            "broker"
            if proc.info["name"] == _SERVERS[kind]
            else "postgresql"
            if proc.info["name"] in ("postgres", "postmaster")
            else None
        )
        if part is None:
            continue
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            totals[part] += times.user + times.system
    me = psutil.Process().cpu_times()
    totals["benchmark"] = me.user + me.system + me.children_user + me.children_system
    return totals


async def relay_child(kind: str, url: str, name: str) -> None:
    """The relay in a process of its own: connected, says "ready", starts at a line on stdin
    and stops once the outbox is empty."""
    from jobfence.outbox import OutboxRelay, OutboxRelaySettings

    queue = _queue(kind, BROKER_URLS[kind], name)
    await queue.size([QUEUE])  # connected (and declared) before the clock starts
    relay = OutboxRelay(url, queue, settings=OutboxRelaySettings(poll_seconds=0.05))
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        task = asyncio.create_task(relay.run())
        while True:
            cur = await conn.execute("SELECT count(*) FROM jobfence.outbox")
            if (await cur.fetchone())[0] == 0:  # type: ignore[index]
                break
            await asyncio.sleep(0.05)
        relay.stop()
        await conn.execute("SELECT pg_notify('jobfence_outbox', '')")
        await task
    await queue.close()


async def _with_relay_process(
    kind: str, url: str, name: str, worker: Any, finished: asyncio.Event
) -> float:
    """Seconds from the start of the worker and of a relay process together to the last
    job's handler."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        SCRIPT,
        "--relay-child",
        kind,
        "--db",
        url,
        "--name",
        name,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None
    ready = await asyncio.wait_for(child.stdout.readline(), 60)
    assert ready.strip() == b"ready", ready
    running = asyncio.create_task(worker.run())
    started = time.perf_counter()
    child.stdin.write(b"go\n")
    await child.stdin.drain()
    await asyncio.wait_for(finished.wait(), 600)
    elapsed = time.perf_counter() - started
    worker.stop()
    await running
    assert await asyncio.wait_for(child.wait(), 60) == 0
    return elapsed


def _run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``main()`` on the event loop jobfence's commands use (uvloop where installed), as the
    interpreter's own jobfence chooses it; asyncio's for a jobfence without that choice."""
    try:
        from jobfence import runtime
    except ImportError:
        return asyncio.run(main())
    return runtime.run(main)


# -- the parent ------------------------------------------------------------------------------


def run_child(python: str, kind: str, rows: int, delay: float, n: int) -> dict[str, Any]:
    out = subprocess.run(
        [
            python,
            str(Path(__file__).resolve()),
            "--child",
            kind,
            "--rows",
            str(rows),
            "--delay",
            str(delay),
            "--db",
            f"jobfence_relay_bench_{n}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "PYTHONPATH": ""},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{python} child failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def publish_rates(args: argparse.Namespace, kind: str, row: dict[str, Any], n: int) -> int:
    """The publish rates of ``kind`` into ``row``, now and before, alone and with the delay,
    ``args.rounds`` alternating rounds; returns the next database number."""
    now_python = sys.executable
    # On the cluster, the replication between its servers is the latency: no proxy in front.
    cases = [("alone", 0.0)] + ([] if kind == "nats3" else [("50ms", args.delay)])
    for label, delay in cases:
        now_rates: list[float] = []
        ratios: list[float] = []
        before_rates: list[float] = []
        cpu: dict[str, list[float]] = {"now": [], "before": []}
        for r in range(args.rounds):
            n += 1
            # Alternating which goes first, so that neither always meets a quieter minute.
            pair: dict[str, float] = {}
            sides = [("now", now_python)]
            if args.baseline_python:
                sides.append(("before", args.baseline_python))
            for side, python in sides if r % 2 == 0 else sides[::-1]:
                # The relay before publishes one message per confirm: a few seconds' worth.
                rows = args.rows
                if side == "before":
                    rows = args.baseline_rows if delay == 0 else max(int(2 / delay), 20)
                measured = run_child(python, kind, rows, delay, n)
                pair[side] = measured["rate"]
                cpu[side].append(measured["cpu_us"])
            now_rates.append(pair["now"])
            if "before" in pair:
                before_rates.append(pair["before"])
                ratios.append(pair["now"] / pair["before"])
        row[f"now_{label}"] = median(now_rates)
        row[f"cpu_us_{label}"] = {side: round(median(v), 1) for side, v in cpu.items() if v}
        if ratios:
            row[f"before_{label}"] = median(before_rates)
            row[f"ratio_{label}"] = median(ratios)
            row[f"ratios_{label}"] = [round(x, 1) for x in ratios]
    return n


def print_table(lines: list[dict[str, Any]]) -> None:
    print()
    print(
        "| broker | relay now | relay before | ratio | 50 ms: now | 50 ms: before | ratio |"
        " end to end | workers fed directly | ratio | relay in its own process | ratio |"
    )
    print("|---" * 12 + "|")
    for row in lines:
        cells = [row["broker"]]
        for label in ("alone", "50ms"):
            if f"now_{label}" not in row:
                cells += ["", "", ""]
                continue
            cells.append(f"{row[f'now_{label}']:,.0f}/s")
            if f"ratio_{label}" in row:
                low, high = min(row[f"ratios_{label}"]), max(row[f"ratios_{label}"])
                cells += [
                    f"{row[f'before_{label}']:,.0f}/s",
                    f"{row[f'ratio_{label}']:.1f}x ({low}-{high})",
                ]
            else:
                cells += ["", ""]
        if "e2e" in row:
            e2e = row["e2e"]
            cells += [
                f"{e2e['outbox']:,.0f}/s",
                f"{e2e['direct']:,.0f}/s",
                f"{e2e['outbox'] / e2e['direct']:.2f}",
            ]
            if "process" in e2e:
                cells += [f"{e2e['process']:,.0f}/s", f"{e2e['process'] / e2e['direct']:.2f}"]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default="rabbitmq,nats,redis")
    parser.add_argument("--rows", type=int, default=20000, help="rows for this tree's relay")
    parser.add_argument(
        "--baseline-python",
        default="/work/main/.venv/bin/python",
        help="an interpreter importing the jobfence to compare with ('' to skip)",
    )
    parser.add_argument("--baseline-rows", type=int, default=3000)
    parser.add_argument("--delay", type=float, default=0.05, help="broker reply delay (s)")
    parser.add_argument("--jobs", type=int, default=5000, help="end-to-end jobs")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--e2e-rounds", type=int, default=2, help="alternating, median")
    parser.add_argument("--rounds", type=int, default=3, help="publish-rate rounds, alternating")
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument(
        "--relay-process",
        action="store_true",
        help="end to end also with the relay in a process of its own",
    )
    parser.add_argument("--child")
    parser.add_argument("--relay-child")
    parser.add_argument("--name")
    parser.add_argument("--db")
    args = parser.parse_args()
    if args.relay_child:
        _run(lambda: relay_child(args.relay_child, args.db, args.name))
        return
    if args.child:
        print(json.dumps(_run(lambda: child_relay(args.child, args.rows, args.delay, args.db))))
        return

    now_python = sys.executable
    brokers = [b for b in args.brokers.split(",") if b]
    print(f"# {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"# now: {now_python}; before: {args.baseline_python or '(none)'}")
    lines: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if "nats3" in brokers:
            stack.enter_context(_nats_cluster())
        _measure(args, brokers, lines)

    print_table(lines)
    print(f"# rates: medians of {args.rounds} rounds; ratios: the median of the per-round ratios")
    print(f"# cpu pressure: {Path('/proc/pressure/cpu').read_text().splitlines()[0]}")


@contextlib.contextmanager
def _nats_cluster() -> Iterator[None]:
    """Three JetStream servers clustered on loopback (``tests/nats_servers.py``), their URL in
    the environment the children inherit; streams on it have three replicas."""
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from nats_servers import nats_cluster

    with (
        tempfile.TemporaryDirectory(prefix="jfrelay-nats3-") as tmp,
        nats_cluster(Path(tmp)) as servers,
    ):
        url = ",".join(s.url for s in servers)
        _run(functools.partial(_jetstream_ready, url))
        os.environ["JOBFENCE_BENCH_NATS_CLUSTER_URL"] = BROKER_URLS["nats3"] = url
        print(f"# nats3: a 3-server JetStream cluster at {url}, streams with 3 replicas")
        yield


async def _jetstream_ready(url: str, within: float = 60.0) -> None:
    """Until the cluster's JetStream answers (its meta leader elected)."""
    import nats

    deadline = time.monotonic() + within
    while True:
        try:
            nc = await nats.connect(url.split(","), connect_timeout=2, max_reconnect_attempts=1)
            try:
                await nc.jetstream(timeout=2).account_info()
                return
            finally:
                await nc.close()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def _measure(args: argparse.Namespace, brokers: list[str], lines: list[dict[str, Any]]) -> None:
    n = 0
    for kind in brokers:
        row: dict[str, Any] = {"broker": kind}
        n = publish_rates(args, kind, row, n)
        if not args.no_e2e:
            row["e2e"] = _run(
                functools.partial(
                    end_to_end,
                    kind,
                    args.jobs,
                    args.concurrency,
                    args.e2e_rounds,
                    relay_process=args.relay_process,
                )
            )
        lines.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
