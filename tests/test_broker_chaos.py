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
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

import chaosapp
from brokers import BROKERS, make_queue, on_broker
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
    async with on_broker(request, [chaosapp.QUEUE], prefix="jfchaos") as found:
        yield found


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


def _summary(output: str) -> Counter[str]:
    """The outcome counts of a worker's ``worker stopped: ...`` line."""
    (line,) = [x for x in output.splitlines() if x.startswith("worker stopped: ")]
    counts: Counter[str] = Counter()
    for part in line.removeprefix("worker stopped: ").split(", "):
        label, _, number = part.rpartition(" ")
        counts[label] = int(number)
    return counts


class Workload:
    """300 distinct jobs (ok, transient, hard, poison) and which of them are delivered twice."""

    def __init__(self) -> None:
        rng = random.Random(17)
        kinds = KINDS[:]
        rng.shuffle(kinds)
        self.kinds = {f"j{n:03d}": k for n, k in enumerate(kinds)}
        self.valid = sorted(j for j, k in self.kinds.items() if k in ("ok", "transient"))
        self.hard = sorted(j for j, k in self.kinds.items() if k == "hard")
        self.poison = sorted(j for j, k in self.kinds.items() if k == "poison")
        self.poison_on_broker = set(self.poison[:POISON_ON_BROKER])
        self.through_outbox = sorted(set(self.kinds) - self.poison_on_broker)
        self.twice = rng.sample(self.through_outbox[:200], ENQUEUED_TWICE)
        self.republished = rng.sample(self.through_outbox[200:], REPUBLISHED)

    def payload(self, job_id: str) -> dict[str, Any]:
        number = int(job_id[1:])
        return {"account_id": number % 10 + 1, "points": number + 1, "mode": self.kinds[job_id]}

    def message(self, job_id: str) -> Message:
        if job_id in self.poison_on_broker:  # not even JSON
            return Message(
                queue=chaosapp.QUEUE, consumer=chaosapp.CONSUMER, job_id=job_id, body=b'{"a":'
            )
        if self.kinds[job_id] == "poison":  # valid JSON, rejected by the schema
            body = b'{"account_id": 0, "points": "many"}'
            return Message(
                queue=chaosapp.QUEUE, consumer=chaosapp.CONSUMER, job_id=job_id, body=body
            )
        return chaosapp.app.message(chaosapp.CONSUMER, self.payload(job_id), job_id=job_id)

    def balances(self, job_ids: list[str]) -> dict[int, int]:
        expected: Counter[int] = Counter()
        for job_id in job_ids:
            expected[self.payload(job_id)["account_id"]] += self.payload(job_id)["points"]
        return dict(expected)


class Run:
    """One end-to-end run: the processes, the proxy, and the checks."""

    def __init__(
        self,
        *,
        work: Workload,
        conn: psycopg.AsyncConnection[Any],
        database_url: str,
        env: dict[str, str],
        logdir: Path,
        procs: list[Proc],
    ) -> None:
        self.work = work
        self.conn = conn
        self.database_url = database_url
        self.env = env
        self.logdir = logdir
        self.procs = procs
        self.workers: list[Proc] = []
        self.relay: Proc | None = None

    async def count(self, query: str, params: Any = None) -> int:
        return int(await scalar(self.conn, query, params))

    async def enqueue(self, job_ids: list[str], per_transaction: int = 10) -> None:
        """Each slice of ``job_ids`` in one producer transaction: through the outbox."""
        for i in range(0, len(job_ids), per_transaction):
            async with await psycopg.AsyncConnection.connect(self.database_url) as tx:
                for job_id in job_ids[i : i + per_transaction]:
                    await publish_async(tx, self.work.message(job_id))
                await tx.commit()

    async def start(self, label: str, args: list[str], ready: str, **extra: str) -> Proc:
        """Start a process and wait until it says ``ready`` (connected to the broker)."""
        proc = Proc(label, args, {**self.env, **extra}, self.logdir)
        self.procs.append(proc)

        async def up() -> bool:
            assert proc.alive(), f"{label} exited:\n{proc.output()}"
            return ready in proc.output()

        await wait_until(up, timeout=30, message=f"{label} to start")
        return proc

    def check_alive(self) -> None:
        for proc in (self.relay, *self.workers):
            assert proc is not None
            assert proc.alive(), f"{proc.name} died:\n{proc.output()}"

    async def applied(self) -> int:
        self.check_alive()
        return await self.count("SELECT count(DISTINCT job_id) FROM public.awards")

    async def wait_applied(self, at_least: int) -> None:
        async def enough() -> bool:
            return await self.applied() >= at_least

        await wait_until(enough, timeout=SETTLE_TIMEOUT, message=f"{at_least} jobs applied")

    async def kill_relay_inside_a_batch(self, job_ids: list[str], relay_app: str) -> int:
        """Enqueue ``job_ids`` 50 at a time until the relay is caught inside a batch: frozen
        (SIGSTOP) while it holds claimed rows (claimed, being published, not yet deleted: it
        keeps no transaction open meanwhile), once a job it published in that batch has been
        handled while the job's outbox row is still there (published, not deleted). Then
        SIGKILL it; returns the rows it left waiting. ``relay_app`` names its connection."""
        relay = self.relay
        assert relay is not None

        async def in_batch() -> bool:
            return bool(
                await self.count(
                    "SELECT count(*) FROM jobfence.outbox WHERE claimed_until > now()"
                    " AND EXISTS (SELECT FROM pg_stat_activity"
                    " WHERE datname = current_database() AND application_name = %s)",
                    (relay_app,),
                )
            )

        async def published_not_marked() -> bool:
            return bool(
                await self.count(
                    "SELECT count(*) FROM jobfence.outbox o WHERE EXISTS (SELECT FROM"
                    " core.processed_jobs p WHERE p.job_id = o.job_id) OR EXISTS (SELECT FROM"
                    " core.dead_letters d WHERE d.job_id = o.job_id)",
                )
            )

        remaining = job_ids[:]
        while remaining:
            chunk, remaining = remaining[:50], remaining[50:]
            await self.enqueue(chunk, per_transaction=50)
            with contextlib.suppress(AssertionError):
                await wait_until(in_batch, timeout=5, interval=0.002, message="a batch")
                os.kill(relay.pid, signal.SIGSTOP)
                caught = False
                try:
                    await wait_until(published_not_marked, timeout=3, message="a handled job")
                    caught = True
                finally:
                    if not caught:
                        os.kill(relay.pid, signal.SIGCONT)
                waiting = await self.count("SELECT count(*) FROM jobfence.outbox")
                assert waiting > 0
                await relay.kill()
                await self.enqueue(remaining)
                return waiting
        raise AssertionError("the relay was never caught inside a batch")

    async def rest_through_an_outage(
        self, job_ids: list[str], proxy: TcpProxy, direct: QueuePort
    ) -> tuple[int, int]:
        """Enqueue ``job_ids``; once they flow, drop every broker connection and refuse new
        ones for a second, and meanwhile send the duplicates. Returns the connections dropped
        and the jobs in flight (in the outbox or on the broker) during the outage."""
        work = self.work
        before = await self.applied()
        await self.enqueue(job_ids)
        await self.wait_applied(min(before + 10, len(work.valid)))
        dropped = proxy.carried
        proxy.down()
        outage_started = time.monotonic()
        await self.enqueue(work.twice)
        for job_id in work.republished + sorted(work.poison_on_broker):
            await direct.publish(work.message(job_id))
        in_flight = (await direct.size([chaosapp.QUEUE])).total
        in_flight += await self.count("SELECT count(*) FROM jobfence.outbox")
        # The outage's length, not a synchronisation:
        await asyncio.sleep(max(OUTAGE_SECONDS - (time.monotonic() - outage_started), 0))
        proxy.up()
        return dropped, in_flight

    async def wait_settled(self, direct: QueuePort, applied: int, pending: int) -> None:
        """Until ``applied`` distinct jobs have their effect, ``pending`` dead letters wait for
        review, and neither the outbox nor the broker holds anything."""
        last: list[int] = []
        want = [applied, pending, 0, 0]

        async def settled() -> bool:
            last[:] = [
                await self.applied(),
                await self.count(
                    "SELECT count(*) FROM core.dead_letters WHERE status = 'pending_review'"
                ),
                await self.count("SELECT count(*) FROM jobfence.outbox"),
                (await direct.size([chaosapp.QUEUE])).total,
            ]
            return last == want

        try:
            await wait_until(settled, timeout=SETTLE_TIMEOUT, interval=0.2, message="settling")
        except AssertionError as exc:
            if "timed out" not in str(exc):
                raise
            raise AssertionError(
                f"not settled: [applied, pending dead letters, outbox, on the broker] = {last},"
                f" expected {want}; logs in {self.logdir}"
            ) from None

    async def assert_each_applied_once(self, job_ids: list[str]) -> None:
        cur = await self.conn.execute(
            "SELECT job_id, count(*) FROM public.awards GROUP BY 1 HAVING count(*) > 1"
        )
        assert await cur.fetchall() == []  # no double effect
        cur = await self.conn.execute("SELECT DISTINCT job_id FROM public.awards ORDER BY 1")
        assert [r[0] for r in await cur.fetchall()] == sorted(job_ids)  # no lost job
        cur = await self.conn.execute("SELECT id, points FROM public.accounts WHERE points > 0")
        assert dict(await cur.fetchall()) == self.work.balances(job_ids)
        cur = await self.conn.execute("SELECT job_id FROM core.processed_jobs ORDER BY 1")
        assert [r[0] for r in await cur.fetchall()] == sorted(job_ids)

    async def assert_one_dead_letter_per_failure(self) -> None:
        work = self.work
        cur = await self.conn.execute(
            "SELECT job_id, error_class, status, count(*) FROM core.dead_letters"
            " GROUP BY 1, 2, 3 ORDER BY 1"
        )
        rows = await cur.fetchall()
        letters = {row[0]: row[1:] for row in rows}
        assert len(letters) == len(rows)  # one per job
        assert set(letters) == set(work.hard) | set(work.poison)
        assert {letters[j] for j in work.hard} == {("jobfence.HardFailure", "pending_review", 1)}
        assert {letters[j] for j in work.poison_on_broker} == {("InvalidJson", "pending_review", 1)}
        schema_invalid = set(work.poison) - work.poison_on_broker
        assert {letters[j] for j in schema_invalid} == {("SchemaInvalid", "pending_review", 1)}

    async def assert_hard_failures_replayed(self) -> None:
        work = self.work
        cur = await self.conn.execute(
            "SELECT status, error_class, count(*) FROM core.dead_letters GROUP BY 1, 2"
            " ORDER BY 1, 2"
        )
        assert await cur.fetchall() == [
            ("pending_review", "InvalidJson", len(work.poison_on_broker)),
            ("pending_review", "SchemaInvalid", len(work.poison) - len(work.poison_on_broker)),
            ("replayed", "jobfence.HardFailure", len(work.hard)),
        ]

    async def replay_hard_failures(self, queue_url: str) -> None:
        await self.conn.execute("INSERT INTO public.chaos_fixed VALUES (true)")
        done = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                str(CLI),
                *("dead-letters", "replay-bulk", "--error-class", "jobfence.HardFailure"),
                *("--queue-url", queue_url),
            ],
            env=self.env,
            cwd=TESTS,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done

    async def stop_all(self) -> Counter[str]:
        """SIGTERM the survivors; each exits 0. The workers' outcomes, summed."""
        survivors = [p for p in (*self.workers, self.relay) if p is not None]
        for proc in survivors:
            os.kill(proc.pid, signal.SIGTERM)
        outcomes: Counter[str] = Counter()
        for proc in survivors:
            assert await proc.wait_exit() == 0, proc.output()
        for proc in self.workers:
            outcomes += _summary(proc.output())
        return outcomes


async def test_jobs_apply_once_through_crashes_a_cut_connection_and_a_killed_relay(
    broker: tuple[str, str, str],
    database_url: str,
    conn: psycopg.AsyncConnection[Any],
    tmp_path: Path,
    procs: list[Proc],
) -> None:
    kind, url, name = broker
    started = time.monotonic()
    work = Workload()
    await conn.execute(chaosapp.SCHEMA_SQL)
    parts = urlsplit(url)
    assert parts.port is not None
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port)
    await proxy.start()
    direct = _direct_queue(kind, url, name)
    try:
        proxied = _through(url, proxy.port)
        target = parse_queue_url(proxied)
        await record_queue(conn, target.kind, target.location)
        env = {
            **os.environ,
            "JOBFENCE_DATABASE_URL": database_url,
            "JOBFENCE_TEST_BROKER_NAME": name,
        }
        env.pop("JOBFENCE_QUEUE_URL", None)
        run = Run(
            work=work,
            conn=conn,
            database_url=database_url,
            env=env,
            logdir=tmp_path,
            procs=procs,
        )
        worker_args = ["worker", "chaosapp:app", "--queue-url", proxied, "--no-outbox-relay"]
        worker_args += ["--concurrency", "4", "--lease-seconds", str(LEASE_SECONDS)]
        relay_args = ["outbox-relay", "--queue-url", proxied, "--poll-seconds", "0.1"]
        relay_app = f"{name}-relay"
        phases = work.through_outbox[:100], work.through_outbox[100:200], work.through_outbox[200:]

        # 1. A first third, then the relay and two workers.
        await run.enqueue(phases[0])
        # Until the first relay is killed (step 3), every connection the proxy accepts delays
        # the broker's replies by 200 ms (the proxy sets a connection's delay when it accepts
        # it; one address, so the same queue as the database records): the relay keeps no
        # transaction open while its confirms come, and this keeps it inside a batch (its
        # messages delivered and handled, its rows not yet deleted) long enough to be caught
        # there, whenever it opens its connections. The first workers' replies come late too.
        proxy.reply_delay = 0.2
        run.relay = await run.start(
            "relay-1", relay_args, "outbox relay active", PGAPPNAME=relay_app
        )
        for label in ("worker-1", "worker-2"):
            run.workers.append(await run.start(label, worker_args, "worker started"))
        await run.wait_applied(30)

        # 2. SIGKILL a worker mid-run; a replacement takes its place.
        await run.workers[0].kill()
        run.workers[0] = await run.start("worker-3", worker_args, "worker started")

        # 3. SIGKILL the relay inside a batch, rows waiting; another relay takes over.
        waiting = await run.kill_relay_inside_a_batch(phases[1], relay_app)
        proxy.reply_delay = 0.0
        run.relay = await run.start("relay-2", relay_args, "outbox relay active")

        # 4. The rest; once they flow, the proxy drops every broker connection and refuses new
        #    ones for a second. Meanwhile the duplicates: enqueued again in transactions of
        #    their own (they wait in the outbox), and published again straight to the broker,
        #    with poison that is not even JSON.
        dropped, in_flight = await run.rest_through_an_outage(phases[2], proxy, direct)
        assert dropped >= 3  # at least the relay's and each worker's connection

        # 5. Everything settles: each valid job applied once, each failure one dead letter.
        await run.wait_settled(direct, len(work.valid), len(work.hard) + len(work.poison))
        await run.assert_each_applied_once(work.valid)
        await run.assert_one_dead_letter_per_failure()

        # 6. The fix, then a bulk replay of the hard failures: each applies exactly once.
        await run.replay_hard_failures(proxied)
        await run.wait_settled(direct, len(work.valid) + len(work.hard), len(work.poison))
        await run.assert_each_applied_once(work.valid + work.hard)
        await run.assert_hard_failures_replayed()

        # 7. The survivors stop cleanly; between them they retried and fenced duplicates.
        outcomes = await run.stop_all()
        assert outcomes["retried"] > 0, outcomes
        assert outcomes["duplicate"] > 0, outcomes
        print(
            f"\n{kind}: done in {time.monotonic() - started:.1f}s; the survivors' outcomes"
            f" {dict(outcomes)}; relay killed with {waiting} row(s) waiting;"
            f" {dropped} connection(s) dropped, {in_flight} job(s) in flight and"
            f" {proxy.refused} connection(s) refused during the outage"
        )
    finally:
        await direct.close()
        await proxy.close()
