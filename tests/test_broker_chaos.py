"""End to end on each real broker, with everything going wrong at once.

Real ``jobfence worker`` processes (two at a time) and a separate ``jobfence outbox-relay``
process reach the broker through a TCP proxy the test controls. The producer enqueues the
workload in its own transactions (so through the outbox): valid jobs, jobs that fail
transiently and then succeed, hard failures and schema-invalid (poison) payloads, with 20%
duplicate deliveries (the same job_id enqueued again in another transaction, or republished
straight to the broker). Mid-run a worker is SIGKILLed (and replaced), the relay is SIGKILLed
while frozen inside a publishing batch (some rows published, none marked sent), and the proxy
drops every broker connection for a second.

Expected: every valid job applied exactly once, no double effect, every failure exactly one
pending dead letter with its error class, nothing left in the outbox or on the broker; then a
bulk replay of the hard failures (after the fix) applies each of them exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

import chaosapp
from brokers import BROKERS, delete_everything, make_queue
from jobfence import Message, QueuePort
from jobfence.outbox import record_queue
from jobfence.producer import publish_async
from jobfence.queues import parse_queue_url
from support import scalar, wait_until
from tcp_proxy import TcpProxy

TESTS = Path(__file__).parent
CLI = TESTS / "broker_cli.py"
LEASE_SECONDS = 4.0
OUTAGE_SECONDS = 1.0
SETTLE_TIMEOUT = 60.0

# The workload: 300 distinct jobs, and 60 more deliveries of some of them (20%).
KINDS = ["ok"] * 216 + ["transient"] * 30 + ["hard"] * 24 + ["poison"] * 30
ENQUEUED_TWICE = 40  # the same job_id enqueued again, in a transaction of its own
REPUBLISHED = 20  # the same job_id published again straight to the broker
POISON_ON_BROKER = 6  # of the poison, published straight to the broker (not JSON at all)


class Proc:
    """A ``tests/broker_cli.py`` process (the real CLI), its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(CLI), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=TESTS,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def wait_exit(self, within: float = 30.0) -> int:
        async def exited() -> bool:
            return self.proc.poll() is not None

        await wait_until(exited, timeout=within, message=f"{self.name} to exit:\n{self.output()}")
        assert self.proc.returncode is not None
        return self.proc.returncode

    async def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        assert await self.wait_exit() == -signal.SIGKILL

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.cleanup()


@pytest.fixture(params=BROKERS)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    kind: str = request.param
    url: str = request.getfixturevalue({"rabbitmq": "amqp_url"}.get(kind, f"{kind}_url"))
    name = f"jfchaos{uuid.uuid4().hex[:12]}"
    yield kind, url, name
    await delete_everything(kind, url, name, [chaosapp.QUEUE])


def _through(url: str, port: int) -> str:
    """``url`` with its host and port replaced by the proxy's (user and password kept)."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@127.0.0.1:{port}" if auth else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _direct_queue(kind: str, url: str, name: str) -> QueuePort:
    """The test's own adapter on the broker itself (not through the proxy), on the same names.
    On NATS it declares the workers' lease, so that publishing does not change the AckWait."""
    if kind == "nats":
        from jobfence.adapters.nats import NatsQueue

        return NatsQueue(
            url,
            stream=name.upper(),
            subject_prefix=name,
            default_lease_seconds=LEASE_SECONDS,
        )
    return make_queue(kind, url, name)


async def _count(conn: psycopg.AsyncConnection[Any], query: str, params: Any = None) -> int:
    return int(await scalar(conn, query, params))


def _summary(output: str) -> Counter[str]:
    """The outcome counts of a worker's ``worker stopped: ...`` line."""
    (line,) = [x for x in output.splitlines() if x.startswith("worker stopped: ")]
    counts: Counter[str] = Counter()
    for part in line.removeprefix("worker stopped: ").split(", "):
        label, _, number = part.rpartition(" ")
        counts[label] = int(number)
    return counts


async def test_jobs_apply_once_through_crashes_a_cut_connection_and_a_killed_relay(
    broker: tuple[str, str, str],
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    tmp_path: Path,
    procs: list[Proc],
) -> None:
    kind, url, name = broker
    started = time.monotonic()
    rng = random.Random(17)
    kinds = KINDS[:]
    rng.shuffle(kinds)
    jobs = {f"j{n:03d}": k for n, k in enumerate(kinds)}
    valid = sorted(j for j, k in jobs.items() if k in ("ok", "transient"))
    hard = sorted(j for j, k in jobs.items() if k == "hard")
    poison = sorted(j for j, k in jobs.items() if k == "poison")
    poison_on_broker = set(poison[:POISON_ON_BROKER])
    first_copies = sorted(set(jobs) - poison_on_broker)
    twice = rng.sample(first_copies[:200], ENQUEUED_TWICE)  # enqueued again later
    republished = rng.sample(sorted(set(first_copies[200:])), REPUBLISHED)

    def payload(job_id: str) -> dict[str, Any]:
        number = int(job_id[1:])
        return {"account_id": number % 10 + 1, "points": number + 1, "mode": jobs[job_id]}

    app = chaosapp.app

    def message(job_id: str) -> Message:
        if jobs[job_id] == "poison":  # valid JSON, rejected by the schema
            body = b'{"account_id": 0, "points": "many"}'
            return Message(
                queue=chaosapp.QUEUE, consumer=chaosapp.CONSUMER, job_id=job_id, body=body
            )
        return app.message(chaosapp.CONSUMER, payload(job_id), job_id=job_id)

    async def enqueue(job_ids: list[str], per_transaction: int = 10) -> None:
        """Each slice of ``job_ids`` in one producer transaction (the outbox)."""
        for i in range(0, len(job_ids), per_transaction):
            async with await psycopg.AsyncConnection.connect(database_url) as tx:
                for job_id in job_ids[i : i + per_transaction]:
                    await publish_async(tx, message(job_id))
                await tx.commit()

    await conn.execute(chaosapp.SCHEMA_SQL)
    async with contextlib.AsyncExitStack() as stack:
        host, port = urlsplit(url).hostname or "127.0.0.1", urlsplit(url).port
        assert port is not None
        proxy = TcpProxy(host, port)
        await proxy.start()
        stack.push_async_callback(proxy.close)
        proxied = _through(url, proxy.port)
        target = parse_queue_url(proxied)
        await record_queue(conn, target.kind, target.location)
        direct = _direct_queue(kind, url, name)
        stack.push_async_callback(direct.close)

        env = {**os.environ, "JOBFENCE_DATABASE_URL": database_url}
        env["JOBFENCE_TEST_BROKER_NAME"] = name
        env.pop("JOBFENCE_QUEUE_URL", None)
        worker_args = [
            "worker",
            "chaosapp:app",
            "--queue-url",
            proxied,
            "--no-outbox-relay",
            "--concurrency",
            "4",
            "--lease-seconds",
            str(LEASE_SECONDS),
        ]
        relay_args = ["outbox-relay", "--queue-url", proxied, "--poll-seconds", "0.1"]

        def start(label: str, args: list[str], **extra: str) -> Proc:
            proc = Proc(label, args, {**env, **extra}, tmp_path)
            procs.append(proc)
            return proc

        order = sorted(first_copies)
        phase1, phase2, phase3 = order[:100], order[100:200], order[200:]

        # 1. The first third, then the relay and two workers.
        await enqueue(phase1)
        relay = start("relay-1", relay_args, PGAPPNAME=f"{name}-relay")
        workers = [start("worker-1", worker_args), start("worker-2", worker_args)]

        async def applied() -> int:
            for proc in (relay, *workers):
                assert proc.alive(), f"{proc.name} died:\n{proc.output()}"
            return await _count(conn, "SELECT count(DISTINCT job_id) FROM public.awards")

        async def some_applied() -> bool:
            return await applied() >= 30

        await wait_until(some_applied, timeout=SETTLE_TIMEOUT, message="the first jobs")

        # 2. SIGKILL a worker in the middle of the run; a replacement takes its place.
        await workers[0].kill()
        workers[0] = start("worker-3", worker_args)

        # 3. SIGKILL the relay inside a batch: frozen (SIGSTOP) while its transaction is open,
        #    once a job it published in that batch has been handled while the job's outbox
        #    row is still there (published, not yet marked sent).
        async def relay_in_batch() -> bool:
            return bool(
                await scalar(
                    conn,
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                    " AND state = 'idle in transaction'",
                    (f"{name}-relay",),
                )
            )

        async def published_not_marked() -> bool:
            return bool(
                await scalar(
                    conn,
                    "SELECT count(*) FROM jobfence.outbox o WHERE EXISTS (SELECT FROM"
                    " core.processed_jobs p WHERE p.job_id = o.job_id) OR EXISTS (SELECT FROM"
                    " core.dead_letters d WHERE d.job_id = o.job_id)",
                )
            )

        remaining = phase2[:]
        caught = False
        while remaining and not caught:
            chunk, remaining = remaining[:50], remaining[50:]
            await enqueue(chunk, per_transaction=50)
            with contextlib.suppress(AssertionError):
                await wait_until(relay_in_batch, timeout=5, interval=0.002, message="a batch")
                os.kill(relay.pid, signal.SIGSTOP)
                try:
                    await wait_until(published_not_marked, timeout=3, message="a handled job")
                    caught = True
                finally:
                    if not caught:
                        os.kill(relay.pid, signal.SIGCONT)
        assert caught, "the relay was never caught inside a batch"
        waiting = await _count(conn, "SELECT count(*) FROM jobfence.outbox")
        assert waiting > 0
        await relay.kill()
        assert await _count(conn, "SELECT count(*) FROM jobfence.outbox") >= waiting
        relay = start("relay-2", relay_args)
        await enqueue(remaining)

        # 4. The rest, with the duplicates: enqueued again in transactions of their own, and
        #    published again straight to the broker, with poison the schema never sees.
        await enqueue(phase3)
        await enqueue(twice)
        for job_id in republished:
            await direct.publish(message(job_id))
        for job_id in sorted(poison_on_broker):
            await direct.publish(
                Message(
                    queue=chaosapp.QUEUE,
                    consumer=chaosapp.CONSUMER,
                    job_id=job_id,
                    body=b'{"account_id":',
                )
            )

        # 5. The broker connection drops (every connection, new ones refused) for a second.
        before = await applied()

        async def flowing() -> bool:
            return await applied() >= before + 20

        await wait_until(flowing, timeout=SETTLE_TIMEOUT, message="jobs flowing again")
        proxy.down()
        await asyncio.sleep(OUTAGE_SECONDS)  # the outage's length, not a synchronisation
        proxy.up()

        # 6. Everything settles: each valid job applied, each failure dead-lettered once.
        async def settled() -> bool:
            for proc in (relay, *workers):
                assert proc.alive(), f"{proc.name} died:\n{proc.output()}"
            done = await _count(conn, "SELECT count(DISTINCT job_id) FROM public.awards")
            dead = await _count(
                conn, "SELECT count(*) FROM core.dead_letters WHERE status = 'pending_review'"
            )
            outbox = await _count(conn, "SELECT count(*) FROM jobfence.outbox")
            on_broker = (await direct.size([chaosapp.QUEUE])).total
            last[:] = [done, dead, outbox, on_broker]
            return last == [len(valid), len(hard) + len(poison), 0, 0]

        last: list[int] = []
        try:
            await wait_until(settled, timeout=SETTLE_TIMEOUT, interval=0.2, message="settling")
        except AssertionError:
            raise AssertionError(
                f"not settled: [applied, dead letters, outbox, on the broker] = {last}, expected"
                f" {[len(valid), len(hard) + len(poison), 0, 0]}; logs in {tmp_path}"
            ) from None
        settled_at = time.monotonic() - started

        cur = await conn.execute(
            "SELECT job_id, count(*) FROM public.awards GROUP BY 1 HAVING count(*) > 1"
        )
        assert await cur.fetchall() == []  # no double effect
        cur = await conn.execute("SELECT DISTINCT job_id FROM public.awards ORDER BY 1")
        assert [r[0] for r in await cur.fetchall()] == valid  # no lost job
        expected = Counter[int]()
        for job_id in valid:
            expected[payload(job_id)["account_id"]] += payload(job_id)["points"]
        cur = await conn.execute("SELECT id, points FROM public.accounts WHERE points > 0")
        assert dict(await cur.fetchall()) == dict(expected)
        cur = await conn.execute("SELECT job_id FROM core.processed_jobs ORDER BY 1")
        assert [r[0] for r in await cur.fetchall()] == valid
        cur = await conn.execute(
            "SELECT job_id, error_class, count(*) FROM core.dead_letters GROUP BY 1, 2 ORDER BY 1"
        )
        dead_letters = {row[0]: (row[1], row[2]) for row in await cur.fetchall()}
        assert set(dead_letters) == set(hard) | set(poison)
        assert {dead_letters[j] for j in hard} == {("jobfence.HardFailure", 1)}
        assert {dead_letters[j] for j in poison_on_broker} == {("InvalidJson", 1)}
        assert {dead_letters[j] for j in set(poison) - poison_on_broker} == {("SchemaInvalid", 1)}
        assert (await direct.size([chaosapp.QUEUE])).total == 0

        # 7. The fix, then a bulk replay of the hard failures: each applies exactly once.
        await conn.execute("INSERT INTO public.chaos_fixed VALUES (true)")
        replay = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                str(CLI),
                "dead-letters",
                "replay-bulk",
                "--error-class",
                "jobfence.HardFailure",
                "--queue-url",
                proxied,
            ],
            env=env,
            cwd=TESTS,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert replay.returncode == 0, replay

        async def replayed() -> bool:
            done = await _count(conn, "SELECT count(DISTINCT job_id) FROM public.awards")
            outbox = await _count(conn, "SELECT count(*) FROM jobfence.outbox")
            if (done, outbox) != (len(valid) + len(hard), 0):
                return False
            return (await direct.size([chaosapp.QUEUE])).total == 0

        await wait_until(replayed, timeout=SETTLE_TIMEOUT, interval=0.2, message="the replay")
        cur = await conn.execute(
            "SELECT job_id, count(*) FROM public.awards GROUP BY 1 HAVING count(*) > 1"
        )
        assert await cur.fetchall() == []
        cur = await conn.execute("SELECT DISTINCT job_id FROM public.awards ORDER BY 1")
        assert [r[0] for r in await cur.fetchall()] == sorted(valid + hard)
        cur = await conn.execute(
            "SELECT status, error_class, count(*) FROM core.dead_letters GROUP BY 1, 2"
            " ORDER BY 1, 2"
        )
        rows = await cur.fetchall()
        assert ("replayed", "jobfence.HardFailure", len(hard)) in rows, rows
        assert sum(n for status, _, n in rows if status == "pending_review") == len(poison), rows

        # 8. The survivors stop cleanly; between them they retried and fenced duplicates.
        outcomes: Counter[str] = Counter()
        for proc in (*workers, relay):
            os.kill(proc.pid, signal.SIGTERM)
        for proc in (*workers, relay):
            assert await proc.wait_exit() == 0, proc.output()
        for proc in workers:
            outcomes += _summary(proc.output())
        assert outcomes["retried"] > 0, outcomes
        assert outcomes["duplicate"] > 0, outcomes
        assert proxy.refused > 0  # clients came back during the outage and were turned away
        print(
            f"\n{kind}: settled in {settled_at:.1f}s, replayed by "
            f"{time.monotonic() - started:.1f}s; survivors' outcomes {dict(outcomes)}; "
            f"relay killed with {waiting} row(s) waiting; outage refused {proxy.refused}"
        )
