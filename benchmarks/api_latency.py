"""Ops API latency at 1,000,000 dead letters.

Seeds ``core.dead_letters`` with 1,000,000 rows (20 queues, 50 consumers, 200 tenants, 30 error
classes, created over 30 days, ~200-byte payloads with a few large ones; mostly
``pending_review``), starts the real API (``jobfence api`` in a subprocess, HS256 tokens) and
drives every endpoint over real HTTP with 32 concurrent clients (by default a minimal asyncio
HTTP/1.1 client, one keep-alive connection per client, closed loop: each client sends its next
request when the previous one has answered; ``--client wrk`` uses wrk instead, for a duration).
It does so for each ``--workers`` value in turn (``jobfence api --workers N``; default 1, then
2). Per endpoint it prints the client-side latency p50/p95/p99, requests per second, the p50 of
the same request sent by one client alone (the service time without queueing) and the CPU of
the load generator, the API processes and PostgreSQL during the run.

Then the bulk replay rate: ``POST /v1/core/dead-letters/replay-bulk`` on one error class seeded
with exactly 100,000 pending rows, progress polled until finished; and ``ops.run_bulk_replay``
in this process on a second such class, for comparison.

Every list query is also run straight on the database (the SQL the endpoint composes) and the
slowest of each kind is EXPLAIN ANALYZEd, so a miss can be told apart: query, or Python.

    .venv/bin/python benchmarks/api_latency.py                # seed, measure, drop (~5 min)
    .venv/bin/python benchmarks/api_latency.py --keep         # keep the seeded database
    .venv/bin/python benchmarks/api_latency.py --reuse        # reuse it (no seeding)
    .venv/bin/python benchmarks/api_latency.py --reuse --no-bulk --client wrk --workers 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import resource
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx
import jwt
import psutil
import psycopg
from common import admin_url_from_env, bench_url, machine_notes, scalar, server_notes, versions
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from jobfence import PgQueue, open_pool, ops
from jobfence.api.auth import PERMISSIONS
from jobfence.schema import migrate

DEFAULT_DB = "jobfence_apibench"
PREFIX = "/v1/core/dead-letters"
TARGET_P95 = 0.050  # every single-item call and list page at 1,000,000 rows
BUDGET_P95 = 1.0  # the spec's budget
SUBJECT = "apibench"  # the token's sub: resolved_by of what this script replays or discards
INPROC_ACTOR = "apibench-inprocess"

QUEUES = [
    "orders", "billing", "loyalty", "payments", "shipping", "invoices", "emails", "sms",
    "webhooks", "search-index", "reports", "exports", "imports", "inventory", "pricing",
    "refunds", "fraud-checks", "notifications", "analytics", "audit",
]  # fmt: skip
VERBS = ["apply", "notify", "sync"]
# Consumer c belongs to queue c % 20: queues 0-9 have three consumers, 10-19 two (50 in all).
CONSUMERS = [f"{QUEUES[q]}.{VERBS[k]}" for k in range(3) for q in range(20) if q < 10 or k < 2]
TENANTS = [f"tenant-{t:03d}" for t in range(1, 201)]
ERROR_CLASSES = [
    "TimeoutError", "ConnectionResetError", "psycopg.errors.DeadlockDetected",
    "psycopg.errors.SerializationFailure", "httpx.ReadTimeout", "httpx.ConnectError",
    "httpx.HTTPStatusError", "pydantic.ValidationError", "KeyError", "ValueError", "InvalidJson",
    "InvalidUtf8", "UnstorablePayload", "myapp.LedgerTimeout", "myapp.AccountLocked",
    "myapp.InsufficientFunds", "myapp.RateLimited", "myapp.UpstreamUnavailable",
    "stripe.CardError", "stripe.APIConnectionError", "smtplib.SMTPServerDisconnected",
    "botocore.ReadTimeoutError", "redis.ConnectionError", "PermissionError", "RuntimeError",
    "AssertionError", "ZeroDivisionError", "json.JSONDecodeError",
]  # fmt: skip
BULK_HTTP = "apibench.BulkProbeHttp"  # exactly --bulk-rows pending rows each
BULK_INPROC = "apibench.BulkProbeInProcess"
STATUSES = ["pending_review", "replayed", "discarded"]

# One set-based statement. Row g: queue skewed (queue 0 ~22% of rows, queue 19 ~1%), consumer
# one of its queue's, tenant skewed (5% none), error class skewed (18% to 1%), created_at
# spread over 30 days in id order with up to 2 minutes of jitter. Every stride-th row up to
# 2 * bulk rows belongs to one of the two bulk classes (pending, alternating); the others are
# 85% pending_review, 10% replayed, 5% discarded. Payloads ~200 bytes of JSON; 1 row in 1,000
# carries a 10 kB attachment (listed as a summary), 1 in 100,000 a 1 MB one, 1 in 5,000 is a
# base64-wrapped body that was not UTF-8 (error class InvalidUtf8), as the harness stores it.
SEED_SQL = """
INSERT INTO core.dead_letters (
    job_id, queue, consumer, tenant_id, payload, payload_encoding, attempts, last_error,
    error_class, correlation_id, status, discard_reason, created_at, resolved_at, resolved_by
)
SELECT job_id, queue, consumer, tenant_id,
       CASE WHEN b64 THEN jsonb_build_object(
                'encoding', 'base64',
                'data', encode('\\xfffe'::bytea || convert_to('order ' || g, 'UTF8'), 'base64'),
                'note', 'original bytes kept as base64: payload is not valid UTF-8 '
                        '(invalid start byte at byte 0)')
            ELSE jsonb_build_object(
                'order_id', g, 'account_id', 1 + (g * 7919) %% 100000,
                'amount_cents', (r_amount * 100000)::int,
                'currency', (ARRAY['EUR', 'USD', 'GBP', 'CHF'])[1 + g %% 4],
                'sku', 'SKU-' || upper(left(md5(g::text), 10)), 'quantity', 1 + g %% 5,
                'requested_at', created_at, 'idempotency_key', md5(g::text))
                 || CASE WHEN g %% 100000 = 50000
                         THEN jsonb_build_object('attachment', repeat(md5(g::text), 32768))
                         WHEN g %% 1000 = 500
                         THEN jsonb_build_object('attachment', repeat(md5(g::text), 320))
                         ELSE '{}'::jsonb END
       END,
       CASE WHEN b64 THEN 'base64' ELSE 'json' END,
       attempts,
       error_class || ': ' || (ARRAY[
           'upstream did not answer within 30s', 'connection reset by peer',
           'could not serialize access due to concurrent update', 'account is locked',
           'rate limited: retry after 60s', 'field required: amount_cents'])[1 + g %% 6]
           || format(' (attempt %%s, job %%s)', attempts, job_id)
           || CASE WHEN g %% 10 = 3 THEN concat_ws(chr(10), '',
                   'Traceback (most recent call last):',
                   '  File "/app/myapp/jobs.py", line 118, in handle',
                   '    await ledger.apply(payload.account_id, payload.amount_cents)',
                   '  File "/app/myapp/ledger.py", line 42, in apply',
                   '    raise ' || error_class || '(detail)') ELSE '' END,
       error_class, correlation_id, status,
       CASE WHEN status = 'discarded'
            THEN (ARRAY['duplicate of a processed order', 'customer cancelled',
                        'test data from staging', 'superseded by a manual correction'])
                 [1 + g %% 4] END,
       created_at,
       CASE WHEN status <> 'pending_review'
            THEN least(now(), created_at + r_resolve * interval '48 hours') END,
       CASE WHEN status <> 'pending_review'
            THEN (ARRAY['ops-alice', 'ops-bob', 'ops-carol', 'oncall-dave'])[1 + g %% 4] END
FROM (
    SELECT g, b64, attempts, r_amount, r_resolve, created_at, correlation_id,
           gen_random_uuid()::text AS job_id,
           (%(queues)s::text[])[1 + q] AS queue,
           (%(queues)s::text[])[1 + q] || '.' || (ARRAY['apply', 'notify', 'sync'])[1 + k]
               AS consumer,
           CASE WHEN r_tenant < 0.05 THEN NULL
                ELSE 'tenant-' || lpad((1 + floor(200 * r_tenant2 ^ 1.5))::int::text, 3, '0')
           END AS tenant_id,
           CASE WHEN bulk = 1 THEN %(bulk_http)s WHEN bulk = 0 THEN %(bulk_inproc)s
                WHEN b64 THEN 'InvalidUtf8'
                ELSE (%(error_classes)s::text[])[1 + floor(28 * r_error ^ 2)::int] END
               AS error_class,
           CASE WHEN bulk IS NOT NULL OR r_status < 0.85 THEN 'pending_review'
                WHEN r_status < 0.95 THEN 'replayed' ELSE 'discarded' END AS status
    FROM (
        SELECT g, q,
               floor(random() * CASE WHEN q < 10 THEN 3 ELSE 2 END)::int AS k,
               CASE WHEN g %% %(stride)s = 0 AND g / %(stride)s <= 2 * %(bulk)s
                    THEN (g / %(stride)s) %% 2 END AS bulk,
               g %% 5000 = 2500 AS b64,
               1 + floor(random() * 8)::int AS attempts,
               random() AS r_amount, random() AS r_resolve, random() AS r_tenant,
               random() AS r_tenant2, random() AS r_error, random() AS r_status,
               now() - interval '30 days' * (1 - g::float8 / %(n)s)
                   - random() * interval '2 minutes' AS created_at,
               CASE WHEN random() < 0.8 THEN 'corr-' || left(md5('c' || (g / 4)), 24) END
                   AS correlation_id
        FROM (SELECT g, floor(20 * random() ^ 2)::int AS q
              FROM generate_series(1, %(n)s::bigint) AS g) AS base
    ) AS drawn
) AS seeded
"""

# Fence rows: ~1% of the dead letters' jobs already succeeded on a later delivery (replay
# moves those to replayed without republishing), plus unrelated fence rows.
FENCE_SQL = """
INSERT INTO core.processed_jobs (job_id, consumer, tenant_id, processed_at, expires_at)
SELECT job_id, consumer, tenant_id, now(), now() + interval '7 days'
FROM core.dead_letters WHERE id % 97 = 3 AND status = 'pending_review'
"""
UNRELATED_FENCE_SQL = """
INSERT INTO core.processed_jobs (job_id, consumer, tenant_id, processed_at, expires_at)
SELECT gen_random_uuid()::text, (%(consumers)s::text[])[1 + g %% 50], NULL, now(),
       now() + interval '7 days'
FROM generate_series(1, %(unrelated)s::int) AS g
"""

META_TABLE = "public.apibench_meta"

# Proposed (not in the migrations): the triage query "pending in this queue with this error
# class" as one index range, instead of a BitmapAnd of two indexes and a sort.
PROPOSED_INDEX = "apibench_proposed_pending_queue_error_idx"
PROPOSED_INDEX_SQL = f"""
CREATE INDEX IF NOT EXISTS {PROPOSED_INDEX} ON core.dead_letters
    (queue, error_class, created_at DESC, id DESC) WHERE status = 'pending_review'
"""


async def set_proposed_index(url: str, wanted: bool) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        if wanted:
            await conn.execute(PROPOSED_INDEX_SQL)
        else:
            await conn.execute(f"DROP INDEX IF EXISTS core.{PROPOSED_INDEX}")
        await conn.execute("ANALYZE core.dead_letters")


# ---------------------------------------------------------------------------------------------
# The database


async def _seeded(url: str) -> dict[str, Any] | None:
    try:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    except psycopg.OperationalError:
        return None
    async with conn:
        exists = await scalar(conn, "SELECT to_regclass(%s) IS NOT NULL", (META_TABLE,))
        if not exists:
            return None
        cur = await conn.execute(f"SELECT rows, bulk_rows, seconds FROM {META_TABLE}")
        row = await cur.fetchone()
    return None if row is None else {"rows": row[0], "bulk_rows": row[1], "seconds": row[2]}


async def seed(admin_url: str, url: str, dbname: str, rows: int, bulk_rows: int) -> float:
    """(Re)create the database, migrate it, insert the rows; seconds it took."""
    stride = rows // (2 * bulk_rows)
    started = time.perf_counter()
    async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
        await conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{dbname}"')
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)
        # Build the secondary indexes after the rows (the same definitions, from the
        # catalogue): sorting once is several times faster than a million random inserts.
        cur = await conn.execute(
            "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index"
            " WHERE indrelid = 'core.dead_letters'::regclass"
            " AND NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conindid = indexrelid)"
        )
        indexes = await cur.fetchall()
        await conn.execute("SET maintenance_work_mem = '256MB'")
        await conn.execute("SET synchronous_commit = off")
        async with conn.transaction():
            for name, _ in indexes:
                await conn.execute(f"DROP INDEX {name}")
            print(f"  inserting {rows:,} dead letters ...", flush=True)
            await conn.execute(
                SEED_SQL,
                {
                    "n": rows,
                    "stride": stride,
                    "bulk": bulk_rows,
                    "queues": QUEUES,
                    "error_classes": ERROR_CLASSES,
                    "bulk_http": BULK_HTTP,
                    "bulk_inproc": BULK_INPROC,
                },
            )
            print(f"  building {len(indexes)} indexes ...", flush=True)
            for _, definition in indexes:
                await conn.execute(definition)
            await conn.execute(FENCE_SQL)
            await conn.execute(
                UNRELATED_FENCE_SQL, {"consumers": CONSUMERS, "unrelated": rows // 5}
            )
            await conn.execute(
                f"CREATE TABLE {META_TABLE} (rows integer, bulk_rows integer, seconds float8)"
            )
        await conn.execute("VACUUM (ANALYZE) core.dead_letters")
        await conn.execute("VACUUM (ANALYZE) core.processed_jobs")
        # The renderings the insert trigger wrote (migration 0008), vacuumed like the rest: a
        # fresh table would otherwise have its hint bits set, and its pages dirtied, by the
        # first requests measured.
        await conn.execute("VACUUM (ANALYZE) jobfence.dead_letter_renderings")
        # Write the seed's dirty pages out now, not during the measurements (needs a superuser,
        # as the benchmark's database owner is here).
        await conn.execute("CHECKPOINT")
        seconds = time.perf_counter() - started
        await conn.execute(
            f"INSERT INTO {META_TABLE} VALUES (%s, %s, %s)", (rows, bulk_rows, seconds)
        )
    return seconds


async def reset(url: str) -> int:
    """Put back what a previous run changed: rows it resolved go back to pending_review (the
    append-only trigger is bypassed for this session, which needs a superuser), its messages
    and bulk runs go. Returns how many rows were reset. The updates leave the table and its
    indexes larger than a fresh seed (dead space VACUUM keeps for reuse): quote figures from a
    freshly seeded run."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn)  # migrations added since it was seeded
        async with conn.transaction():
            await conn.execute("SET LOCAL session_replication_role = replica")
            cur = await conn.execute(
                "UPDATE core.dead_letters SET status = 'pending_review', resolved_at = NULL,"
                " resolved_by = NULL, discard_reason = NULL WHERE resolved_by LIKE 'apibench%'"
            )
            count = cur.rowcount
            await conn.execute("DELETE FROM jobfence_queue.messages")
            await conn.execute("DELETE FROM jobfence.bulk_replay_items")
            await conn.execute("DELETE FROM jobfence.bulk_replays")
        if count:
            await conn.execute("VACUUM (ANALYZE) core.dead_letters")
        await conn.execute("VACUUM (ANALYZE) jobfence_queue.messages")
        await conn.execute("CHECKPOINT")
    return count


@dataclass
class Samples:
    """Values to filter on, drawn from the seeded rows."""

    max_id: int
    jobs: list[str]
    correlations: list[str]
    pending_ids: list[int]  # ordinary (not bulk) pending rows, for replay and discard
    oldest: datetime
    newest: datetime
    table_mb: float
    index_mb: float
    rows: int


async def draw_samples(url: str, needed_pending: int, rng: random.Random) -> Samples:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        max_id = int(await scalar(conn, "SELECT max(id) FROM core.dead_letters"))
        rows = int(await scalar(conn, "SELECT count(*) FROM core.dead_letters"))
        ids = [rng.randint(1, max_id) for _ in range(3000)]
        cur = await conn.execute(
            "SELECT job_id, correlation_id FROM core.dead_letters WHERE id = ANY(%s)", (ids,)
        )
        found = await cur.fetchall()
        cur = await conn.execute(
            "SELECT id FROM core.dead_letters TABLESAMPLE SYSTEM (5) REPEATABLE (%s)"
            " WHERE status = 'pending_review' AND error_class <> ALL(%s) LIMIT %s",
            (rng.randint(0, 10**6), [BULK_HTTP, BULK_INPROC], needed_pending * 3),
        )
        pending = [r[0] for r in await cur.fetchall()]
        rng.shuffle(pending)
        cur = await conn.execute("SELECT min(created_at), max(created_at) FROM core.dead_letters")
        span = await cur.fetchone()
        assert span is not None
        cur = await conn.execute(
            "SELECT pg_table_size('core.dead_letters'), pg_indexes_size('core.dead_letters')"
        )
        sizes = await cur.fetchone()
        assert sizes is not None
    if len(pending) < needed_pending:
        raise SystemExit(f"only {len(pending)} pending rows sampled, {needed_pending} needed")
    return Samples(
        max_id=max_id,
        jobs=[r[0] for r in found],
        correlations=[r[1] for r in found if r[1] is not None],
        pending_ids=pending[:needed_pending],
        oldest=span[0],
        newest=span[1],
        table_mb=sizes[0] / 2**20,
        index_mb=sizes[1] / 2**20,
        rows=rows,
    )


# ---------------------------------------------------------------------------------------------
# The API process


class ApiServer:
    """``jobfence api --port 0`` in a subprocess, its log in a file."""

    def __init__(
        self, url: str, secret: str, workdir: Path, pool_size: int, workers: int = 1
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "api.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBFENCE_")}
        env |= {
            "JOBFENCE_DATABASE_URL": url,
            "JOBFENCE_JWT_SECRET": secret,
            "PYTHONUNBUFFERED": "1",
        }
        self.command = [
            sys.executable, "-m", "jobfence.cli", "api", "--port", "0",
            "--pool-size", str(pool_size), "--workers", str(workers),
        ]  # fmt: skip
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def base_url(self, within: float = 60.0) -> str:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            match = re.search(
                r"(?:Uvicorn running on|workers ready on) (http://127\.0\.0\.1:\d+)",
                self.output(),
            )
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise SystemExit(f"jobfence api exited early:\n{self.output()}")
            await asyncio.sleep(0.1)
        raise SystemExit(f"jobfence api did not start within {within} s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def make_token(secret: str) -> str:
    claims = {"sub": SUBJECT, "permissions": list(PERMISSIONS), "exp": int(time.time()) + 7200}
    return jwt.encode(claims, secret, algorithm="HS256")


# ---------------------------------------------------------------------------------------------
# Measuring


def _postgres_cpu() -> dict[int, float]:
    found: dict[int, float] = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        times = proc.info.get("cpu_times")
        if proc.info.get("name") == "postgres" and times is not None:
            found[proc.pid] = times.user + times.system
    return found


class CpuMeter:
    """CPU seconds of this process (the load generator), the API process, the local PostgreSQL
    processes (all of them: other load on the server shows up) and the whole machine."""

    def __init__(self, api_pids: list[int]) -> None:
        # With --workers, the API's own processes are the children of each `jobfence api`.
        parents = [psutil.Process(pid) for pid in api_pids]
        self.api = parents + [child for p in parents for child in p.children(recursive=True)]

    def snap(self) -> dict[str, Any]:
        api = [proc.cpu_times() for proc in self.api]
        machine = psutil.cpu_times()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk, once it has exited
        return {
            "client": time.process_time() + children.ru_utime + children.ru_stime,
            "api": sum(times.user + times.system for times in api),
            "pg": _postgres_cpu(),
            "busy": machine.user + machine.system + machine.nice + machine.irq + machine.softirq,
            "wall": time.perf_counter(),
        }

    @staticmethod
    def share(start: dict[str, Any], end: dict[str, Any]) -> dict[str, float]:
        """Each party's CPU as a share of one core over the interval; machine: of all cores."""
        wall = end["wall"] - start["wall"]
        pg = sum(end["pg"][pid] - start["pg"][pid] for pid in end["pg"] if pid in start["pg"])
        return {
            "client": (end["client"] - start["client"]) / wall,
            "api": (end["api"] - start["api"]) / wall,
            "pg": pg / wall,
            "machine": (end["busy"] - start["busy"]) / wall / (os.cpu_count() or 1),
            "api_cpu_s": end["api"] - start["api"],
            "client_cpu_s": end["client"] - start["client"],
        }


@dataclass
class Req:
    method: str
    path: str
    params: dict[str, Any] | None = None
    body: dict[str, Any] | None = None

    def query(self) -> dict[str, str] | None:
        if self.params is None:
            return None
        return {
            k: (v.isoformat() if isinstance(v, datetime) else str(v))
            for k, v in self.params.items()
        }


@dataclass
class Result:
    name: str
    kind: str  # "list", "item", "write"
    requests: int
    concurrency: int
    seconds: float
    latencies: list[float] = field(repr=False)
    errors: dict[str, int]
    serial_p50: float
    cpu: dict[str, float]
    processes: int = 1  # API processes serving
    fixed: dict[float, float] | None = None  # percentiles as wrk reports them (seconds)
    cache_hit_share: float | None = None  # list items from the API's item cache, under load

    def pct(self, q: float) -> float:
        if self.fixed is not None:
            return self.fixed[q]
        ordered = sorted(self.latencies)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    def summary(self) -> dict[str, Any]:
        return {
            "endpoint": self.name,
            "kind": self.kind,
            "api_processes": self.processes,
            "requests": self.requests,
            "concurrency": self.concurrency,
            "p50_ms": self.pct(0.50) * 1000,
            "p95_ms": self.pct(0.95) * 1000,
            "p99_ms": self.pct(0.99) * 1000,
            "max_ms": max(self.latencies) * 1000,
            "requests_per_s": self.rate,
            "one_client_p50_ms": self.serial_p50 * 1000,
            "errors": self.errors,
            "cpu_share": self.cpu,
            "api_cpu_ms_per_request": self.cpu["api_cpu_s"] / self.requests * 1000,
            "item_cache_hit_share": self.cache_hit_share,
        }


class RawHttp:
    """A minimal HTTP/1.1 client on one keep-alive connection (asyncio streams), for the load:
    a fraction of httpx's CPU per request, which matters when the load generator shares two
    cores with the API and PostgreSQL. Reads Content-Length and chunked bodies."""

    def __init__(self, base_url: str, token: str) -> None:
        parsed = urlsplit(base_url)
        assert parsed.hostname is not None and parsed.port is not None
        self.host, self.port = parsed.hostname, parsed.port
        self.head = f"Host: {parsed.netloc}\r\nAuthorization: Bearer {token}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None

    async def request(self, req: Req) -> tuple[int, bytes]:
        target = req.path
        query = req.query()
        if query:
            target += "?" + urlencode(query)
        body = b"" if req.body is None else json.dumps(req.body).encode()
        head = f"{req.method} {target} HTTP/1.1\r\n{self.head}"
        if req.body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        message = head.encode() + b"\r\n" + body
        reused = self.writer is not None
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None and self.writer is not None
        self.writer.write(message)
        status_line = await self.reader.readline()
        if not status_line and reused:
            # The server closed the idle connection (uvicorn's keep-alive timeout is 5 s):
            # open a new one and send again, as httpx does.
            await self.close()
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.write(message)
            status_line = await self.reader.readline()
        try:
            status = int(status_line.split()[1])
            length, chunked, close = 0, False, False
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                elif name == b"connection":
                    close = value.strip().lower() == b"close"
            if chunked:
                parts = []
                while size := int((await self.reader.readline()).split(b";")[0], 16):
                    parts.append(await self.reader.readexactly(size))
                    await self.reader.readline()
                await self.reader.readline()
                data = b"".join(parts)
            else:
                data = await self.reader.readexactly(length)
        except (IndexError, ValueError, asyncio.IncompleteReadError):
            await self.close()
            raise
        if close:
            await self.close()
        return status, data


async def item_cache_counts(base_urls: list[str]) -> tuple[float, float] | None:
    """The list item cache's hits and misses so far, summed over the API processes reached
    at ``base_urls`` (``/metrics``); None from an API without one (an older jobfence)."""
    hits = misses = 0.0
    async with httpx.AsyncClient(timeout=10) as client:
        for base_url in base_urls:
            text = (await client.get(f"{base_url}/metrics")).text
            found = {
                sample.name: sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
            }
            if "jobfence_api_item_cache_hits_total" not in found:
                return None
            hits += found["jobfence_api_item_cache_hits_total"]
            misses += found["jobfence_api_item_cache_misses_total"]
    return hits, misses


class LoadClients:
    """``size`` concurrent clients: one keep-alive connection each (``raw``), or httpx
    AsyncClients with a pool of ``size`` connections (``httpx``). Client ``slot`` talks to
    ``base_urls[slot % len(base_urls)]``."""

    def __init__(
        self, kind: str, base_urls: list[str], token: str, size: int, workdir: Path
    ) -> None:
        self.kind = kind
        self.size = size
        self.base_urls = base_urls
        self.token = token
        self.workdir = workdir
        self.wrk_seconds = 5.0
        if kind == "wrk" and len(base_urls) > 1:
            raise SystemExit("--client wrk drives one address: use --workers, not --api-procs")
        self.raw = (  # wrk: slot 0 still sends the requests timed one at a time
            [RawHttp(base_urls[slot % len(base_urls)], token) for slot in range(size)]
            if kind in ("raw", "wrk")
            else []
        )
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        self.clients = [
            httpx.AsyncClient(
                base_url=base_url,
                headers={"Authorization": f"Bearer {token}"},
                limits=limits,
                timeout=120,
            )
            for base_url in base_urls
        ]
        self.httpx = self.clients[0]

    async def close(self) -> None:
        for conn in self.raw:
            await conn.close()
        for client in self.clients:
            await client.aclose()

    async def send(self, slot: int, req: Req) -> tuple[float, str]:
        started = time.perf_counter()
        try:
            if self.raw:
                status, _ = await self.raw[slot].request(req)
            else:
                client = self.clients[slot % len(self.clients)]
                response = await client.request(
                    req.method, req.path, params=req.query(), json=req.body
                )
                status = response.status_code
            outcome = str(status)
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
            outcome = type(exc).__name__
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        return time.perf_counter() - started, outcome


WRK_SCRIPT = """
local reqs = {%(reqs)s}
local i = 0
wrk.headers["Authorization"] = %(auth)s
request = function()
  i = i + 1
  local r = reqs[((i - 1) %% #reqs) + 1]
  if r[3] then
    -- headers given replace wrk.headers: repeat the token
    return wrk.format(r[1], r[2], {["Content-Type"] = "application/json",
                                   ["Authorization"] = wrk.headers["Authorization"]}, r[3])
  end
  return wrk.format(r[1], r[2])
end
done = function(summary, latency, requests)
  io.write(string.format(
    'WRKJSON {"requests": %%d, "p50": %%d, "p95": %%d, "p99": %%d, "max": %%d,'
    .. ' "bad_status": %%d, "socket_errors": %%d, "duration_us": %%d}\\n',
    summary.requests, latency:percentile(50), latency:percentile(95), latency:percentile(99),
    latency.max, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write
      + summary.errors.timeout,
    summary.duration))
end
"""


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


async def run_wrk(clients: LoadClients, reqs: list[Req], seconds: float) -> dict[str, Any]:
    """``reqs`` in turn (from the first again at the end) for ``seconds`` through wrk: one
    thread, ``clients.size`` connections. wrk runs for a duration, not a count."""
    entries = []
    for req in reqs:
        target = req.path + ("?" + urlencode(req.query() or {}) if req.params else "")
        body = "nil" if req.body is None else json.dumps(json.dumps(req.body))
        entries.append(f"{{{json.dumps(req.method)}, {json.dumps(target)}, {body}}}")
    script = clients.workdir / "wrk.lua"
    script.write_text(
        WRK_SCRIPT
        % {
            "reqs": ",\n".join(entries),
            "auth": json.dumps(f"Bearer {clients.token}"),
        }
    )
    proc = await asyncio.create_subprocess_exec(
        "wrk", "-t1", f"-c{clients.size}", f"-d{seconds:g}s", "--timeout", "30s", "-s", str(script),
        clients.base_urls[0],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    text = out.decode(errors="replace")
    match = re.search(r"WRKJSON (\{.*\})", text)
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"wrk failed ({proc.returncode}):\n{text}")
    found: dict[str, Any] = json.loads(match.group(1))
    return found


async def drive(
    clients: LoadClients,
    meter: CpuMeter,
    phase: Phase,
    *,
    serial: list[Req],
    loaded: list[Req],
) -> Result:
    """``serial`` one at a time (service time), then ``loaded`` by all the clients."""
    alone = sorted([(await clients.send(0, req))[0] for req in serial])
    serial_p50 = alone[len(alone) // 2] if alone else float("nan")
    latencies = [0.0] * len(loaded)
    outcomes = [""] * len(loaded)
    todo = iter(enumerate(loaded))

    async def one_client(slot: int) -> None:
        for i, req in todo:  # the clients share one iterator: each request is sent once
            latencies[i], outcomes[i] = await clients.send(slot, req)

    fixed = None
    errors: dict[str, int] = {}
    cache_before = await item_cache_counts(clients.base_urls)
    if clients.kind == "wrk":
        start = meter.snap()
        found = await run_wrk(clients, loaded, clients.wrk_seconds)
        end = meter.snap()
        count, seconds = found["requests"], found["duration_us"] / 1e6
        fixed = {q: found[f"p{round(q * 100)}"] / 1e6 for q in (0.50, 0.95, 0.99)}
        latencies = [found["max"] / 1e6]
        if found["bad_status"]:
            errors["4xx/5xx"] = found["bad_status"]
        if found["socket_errors"]:
            errors["socket"] = found["socket_errors"]
    else:
        start = meter.snap()
        await asyncio.gather(*(one_client(slot) for slot in range(clients.size)))
        end = meter.snap()
        count, seconds = len(loaded), end["wall"] - start["wall"]
        for outcome in outcomes:
            if outcome != "200":
                errors[outcome] = errors.get(outcome, 0) + 1
    result = Result(
        name=phase.name,
        kind=phase.kind,
        requests=count,
        concurrency=clients.size,
        seconds=seconds,
        latencies=latencies,
        errors=errors,
        serial_p50=serial_p50,
        cpu=CpuMeter.share(start, end),
        fixed=fixed,
    )
    cache_after = await item_cache_counts(clients.base_urls)
    if cache_before is not None and cache_after is not None:
        hits = cache_after[0] - cache_before[0]
        misses = cache_after[1] - cache_before[1]
        result.cache_hit_share = hits / (hits + misses) if hits + misses else None
    s = result.summary()
    share = result.cache_hit_share
    print(
        f"  {phase.name:<40} p50 {s['p50_ms']:7.1f}  p95 {s['p95_ms']:7.1f}"
        f"  p99 {s['p99_ms']:7.1f} ms  {s['requests_per_s']:5.0f} req/s"
        f"  alone p50 {s['one_client_p50_ms']:6.1f} ms  API CPU/req"
        f" {s['api_cpu_ms_per_request']:5.1f} ms"
        + ("" if share is None else f"  items cached {share:.0%}")
        + (f"  ERRORS {errors}" if errors else ""),
        flush=True,
    )
    return result


@dataclass
class Phase:
    name: str
    kind: str
    make: Any  # (i, rng) -> Req; None for the writes, whose requests are listed
    sql_filter: bool = True  # a list whose SQL is checked on the database


def list_phases(samples: Samples, deep_cursor: str) -> list[Phase]:
    span = samples.newest - samples.oldest

    def window(rng: random.Random) -> dict[str, Any]:
        start = samples.oldest + (span - timedelta(days=1)) * rng.random()
        return {"created_from": start, "created_to": start + timedelta(days=1)}

    return [
        Phase("list first page", "list", lambda i, r: Req("GET", PREFIX)),
        Phase(
            "list first page, limit=500", "list", lambda i, r: Req("GET", PREFIX, {"limit": 500})
        ),
        Phase(
            "list deep cursor (page 201)",
            "list",
            lambda i, r: Req("GET", PREFIX, {"cursor": deep_cursor}),
        ),
        Phase(
            "list status=<each of 3>",
            "list",
            lambda i, r: Req("GET", PREFIX, {"status": STATUSES[i % 3]}),
        ),
        Phase("list queue=", "list", lambda i, r: Req("GET", PREFIX, {"queue": r.choice(QUEUES)})),
        Phase(
            "list consumer=",
            "list",
            lambda i, r: Req("GET", PREFIX, {"consumer": r.choice(CONSUMERS)}),
        ),
        Phase(
            "list tenant_id=",
            "list",
            lambda i, r: Req("GET", PREFIX, {"tenant_id": r.choice(TENANTS)}),
        ),
        Phase(
            "list error_class=",
            "list",
            lambda i, r: Req("GET", PREFIX, {"error_class": r.choice(ERROR_CLASSES)}),
        ),
        Phase(
            "list job_id=",
            "list",
            lambda i, r: Req("GET", PREFIX, {"job_id": r.choice(samples.jobs)}),
        ),
        Phase(
            "list correlation_id=",
            "list",
            lambda i, r: Req("GET", PREFIX, {"correlation_id": r.choice(samples.correlations)}),
        ),
        Phase(
            "list created_from..created_to (1 day)",
            "list",
            lambda i, r: Req("GET", PREFIX, window(r)),
        ),
        Phase(
            "list pending + queue + error_class",
            "list",
            lambda i, r: Req(
                "GET",
                PREFIX,
                {
                    "status": "pending_review",
                    "queue": r.choice(QUEUES),
                    "error_class": r.choice(ERROR_CLASSES),
                },
            ),
        ),
        Phase(
            "list discarded + tenant_id",
            "list",
            lambda i, r: Req(
                "GET", PREFIX, {"status": "discarded", "tenant_id": r.choice(TENANTS)}
            ),
        ),
        Phase(
            "show",
            "item",
            lambda i, r: Req("GET", f"{PREFIX}/{r.randint(1, samples.max_id)}"),
            sql_filter=False,
        ),
    ]


async def walk_cursor(client: httpx.AsyncClient, pages: int) -> tuple[str, float]:
    """Follow ``next_cursor`` ``pages`` times from the first page; the cursor of the page after
    and the mean seconds per page."""
    cursor: str | None = None
    started = time.perf_counter()
    for _ in range(pages):
        response = await client.get(PREFIX, params={"cursor": cursor} if cursor else None)
        response.raise_for_status()
        cursor = response.json()["next_cursor"]
        if cursor is None:
            raise SystemExit("ran out of pages while walking the cursor")
    assert cursor is not None
    return cursor, (time.perf_counter() - started) / pages


# ---------------------------------------------------------------------------------------------
# The list queries on the database


def list_query(req: Req) -> tuple[sql.Composable, dict[str, Any]]:
    """The SQL ``GET /v1/core/dead-letters`` runs for ``req`` (``ops.list_page_query``)."""
    params = dict(req.params or {})
    limit = int(params.pop("limit", ops.DEFAULT_PAGE))
    cursor = params.pop("cursor", None)
    query, query_params = ops.list_page_query(
        ops.DeadLetterFilter(**params), limit=limit, cursor=cursor
    )
    # Kept as one SQL text (it is trusted: composed by jobfence) so EXPLAIN can prefix it.
    return sql.SQL(query.decode()), query_params


def _plan_nodes(node: dict[str, Any]) -> Iterator[str]:
    label = node["Node Type"]
    if "Index Name" in node:
        label += f" {node['Index Name']}"
    if "Actual Rows" in node:
        removed = node.get("Rows Removed by Filter")
        label += f" (rows {node['Actual Rows']:g}" + (
            f", removed by filter {removed:g})" if removed else ")"
        )
    yield label
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


async def check_sql(
    url: str, phases: list[tuple[Phase, list[Req]]], per_phase: int
) -> list[dict[str, Any]]:
    """Run each list phase's first ``per_phase`` queries on one connection (as the API does,
    prepared after 5 runs by psycopg), then EXPLAIN ANALYZE the slowest one."""
    found = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for phase, reqs in phases:
            timings = []
            for req in reqs[:per_phase]:
                query, params = list_query(req)
                started = time.perf_counter()
                cur = await conn.execute(query, params)
                await cur.fetchall()
                timings.append((time.perf_counter() - started, req))
            timings.sort(key=lambda t: t[0])
            worst_s, worst = timings[-1]
            query, params = list_query(worst)
            cur = await conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + query, params
            )
            row = await cur.fetchone()
            assert row is not None
            plan = row[0][0]
            text_cur = await conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, BUFFERS) ") + query, params, prepare=False
            )
            text = "\n".join(r[0] for r in await text_cur.fetchall())
            entry = {
                "endpoint": phase.name,
                "sql_p50_ms": timings[len(timings) // 2][0] * 1000,
                "sql_p95_ms": timings[max(0, math.ceil(0.95 * len(timings)) - 1)][0] * 1000,
                "sql_max_ms": worst_s * 1000,
                "worst_params": worst.query(),
                "worst_execution_ms": plan["Execution Time"],
                "worst_plan": " > ".join(_plan_nodes(plan["Plan"])),
                "worst_plan_text": text,
            }
            found.append(entry)
            print(
                f"  {phase.name:<44} SQL p50 {entry['sql_p50_ms']:6.2f}  p95 "
                f"{entry['sql_p95_ms']:6.2f}  max {entry['sql_max_ms']:6.2f} ms;"
                f" slowest: {entry['worst_plan']}",
                flush=True,
            )
    return found


# ---------------------------------------------------------------------------------------------
# Bulk replay


async def bulk_over_http(client: httpx.AsyncClient, expected: int) -> dict[str, Any]:
    body = {"error_class": BULK_HTTP, "max_items": max(expected, 1)}
    started = time.perf_counter()
    response = await client.post(f"{PREFIX}/replay-bulk", json=body)
    accepted = time.perf_counter()
    if response.status_code != 202:
        raise SystemExit(f"bulk replay refused: {response.status_code} {response.text}")
    run = response.json()
    polls: list[float] = []
    while True:
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        progress = await client.get(f"{PREFIX}/replay-bulk/{run['id']}")
        polls.append(time.perf_counter() - t0)
        progress.raise_for_status()
        state = progress.json()
        if state["status"] == "finished" and not state["active"]:
            break
        if state["status"] != "finished" and not state["active"]:
            raise SystemExit(f"bulk replay {run['id']} stopped: {state}")
    finished = time.perf_counter()
    created = datetime.fromisoformat(state["created_at"])
    done = datetime.fromisoformat(state["finished_at"])
    polls.sort()
    return {
        "run_id": run["id"],
        "total": state["total"],
        "counts": state["counts"],
        "post_seconds": accepted - started,
        "wall_seconds": finished - started,
        "rows_per_s": state["total"] / (finished - started),
        "db_seconds": (done - created).total_seconds(),
        "db_rows_per_s": state["total"] / max((done - created).total_seconds(), 1e-9),
        "progress_polls": len(polls),
        "progress_p50_ms": polls[len(polls) // 2] * 1000,
        "progress_max_ms": polls[-1] * 1000,
    }


async def bulk_in_process(url: str, chunk_size: int, expected: int) -> dict[str, Any]:
    pool = await open_pool(url, max_size=4, name="apibench-bulk")
    queue = PgQueue(pool)
    try:
        started = time.perf_counter()
        run = await ops.start_bulk_replay(
            pool,
            ops.DeadLetterFilter(error_class=BULK_INPROC),
            max_items=max(expected, 1),
            requested_by=INPROC_ACTOR,
        )
        assert isinstance(run, ops.BulkReplay)
        snapshot = time.perf_counter()
        done = await ops.run_bulk_replay(
            pool, queue, run.id, actor=INPROC_ACTOR, chunk_size=chunk_size
        )
        finished = time.perf_counter()
    finally:
        await queue.close()
        await pool.close()
    return {
        "run_id": run.id,
        "total": done.total,
        "counts": done.counts,
        "snapshot_seconds": snapshot - started,
        "wall_seconds": finished - started,
        "rows_per_s": done.total / (finished - started),
        "run_rows_per_s": done.total / (finished - snapshot),
    }


async def verify_bulk(url: str, http: dict[str, Any], inproc: dict[str, Any]) -> list[str]:
    problems = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for error_class, result in ((BULK_HTTP, http), (BULK_INPROC, inproc)):
            pending = await scalar(
                conn,
                "SELECT count(*) FROM core.dead_letters"
                " WHERE error_class = %s AND status = 'pending_review'",
                (error_class,),
            )
            if pending:
                problems.append(f"{error_class}: {pending} rows still pending")
            published = await scalar(
                conn,
                "SELECT count(*) FROM jobfence_queue.messages m JOIN core.dead_letters d"
                " ON d.job_id = m.job_id AND d.consumer = m.consumer WHERE d.error_class = %s",
                (error_class,),
            )
            if published != result["counts"]["replayed"]:
                problems.append(
                    f"{error_class}: {published} messages published,"
                    f" {result['counts']['replayed']} replayed"
                )
            result["published"] = published
    return problems


# ---------------------------------------------------------------------------------------------
# Report


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


def print_table(results: list[Result]) -> None:
    header = (
        f"{'endpoint':<40} {'procs':>5} {'n':>5} {'p50':>7} {'p95':>7} {'p99':>7} {'max':>7}"
        f" {'req/s':>6} {'alone':>6} {'API ms':>7} {'CPU client/API/PG':>18} {'cached':>6}"
        "  p95<50ms p95<1s"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        s = r.summary()
        cpu = r.cpu
        shares = f"{cpu['client']:.0%}/{cpu['api']:.0%}/{cpu['pg']:.0%}"
        target = "met" if s["p95_ms"] < TARGET_P95 * 1000 else "MISSED"
        budget = "met" if s["p95_ms"] < BUDGET_P95 * 1000 else "MISSED"
        err = f"  errors {r.errors}" if r.errors else ""
        cached = "" if r.cache_hit_share is None else f"{r.cache_hit_share:.0%}"
        print(
            f"{r.name:<40} {r.processes:>5} {r.requests:>5} {_ms(r.pct(0.5)):>7}"
            f" {_ms(r.pct(0.95)):>7} {_ms(r.pct(0.99)):>7} {_ms(max(r.latencies)):>7}"
            f" {r.rate:>6.0f}"
            f" {_ms(r.serial_p50):>6} {s['api_cpu_ms_per_request']:>7.1f} {shares:>18}"
            f" {cached:>6}  {target:<8} {budget}{err}"
        )


async def prepare_database(args: argparse.Namespace, admin_url: str, url: str) -> float | None:
    """Seed (or, with --reuse, reset) the database; the seeding's seconds, None if reused."""
    meta = await _seeded(url) if args.reuse else None
    if meta and (meta["rows"], meta["bulk_rows"]) != (args.rows, args.bulk_rows):
        print(
            f"--reuse: {args.db} holds {meta['rows']:,} rows (bulk {meta['bulk_rows']:,}):"
            " seeding it again"
        )
        meta = None
    if meta:
        print(f"reusing {args.db} (seeded in {meta['seconds']:.0f} s)")
        count = await reset(url)
        print(f"  reset {count:,} rows a previous run had resolved")
        return None
    print(f"seeding {args.db}: {args.rows:,} dead letters ({args.bulk_rows:,} x 2 bulk probes)")
    seconds = await seed(admin_url, url, args.db, args.rows, args.bulk_rows)
    print(f"  seeded in {seconds:.0f} s")
    return seconds


@dataclass
class Measured:
    results: list[Result]
    sql_checks: list[dict[str, Any]]
    http_bulk: dict[str, Any] | None
    walk_s: float
    api_log: str


async def measure_api(
    args: argparse.Namespace,
    url: str,
    samples: Samples,
    *,
    workers: int,
    pending_ids: list[int],
    bulk: bool,
    sql_checks: bool,
) -> Measured:
    """Start ``jobfence api --workers <workers>``, drive every endpoint, check the list SQL
    (``sql_checks``), bulk-replay (``bulk``); replay and discard take ``pending_ids``."""
    rng = random.Random(args.seed)
    secret = secrets.token_hex(32)
    token = make_token(secret)
    results: list[Result] = []
    # wrk runs for --wrk-seconds: replay and discard need enough distinct pending ids.
    writes = args.serial + (args.wrk_ids if args.client == "wrk" else args.requests)
    with tempfile.TemporaryDirectory(prefix="apibench-") as tmp:
        servers = [
            ApiServer(url, secret, Path(tmp) / f"api-{n}", args.pool_size, workers)
            for n in range(args.api_procs)
        ]
        clients: LoadClients | None = None
        try:
            base_urls = [await server.base_url() for server in servers]
            meter = CpuMeter([server.proc.pid for server in servers])
            print(f"API: {shlex.join(servers[0].command)} -> {', '.join(base_urls)}")
            clients = LoadClients(args.client, base_urls, token, args.concurrency, Path(tmp))
            clients.wrk_seconds = args.wrk_seconds
            helper = clients.httpx  # the walk, the bulk run and its polls
            for _ in range(3):  # warm up: the pool's connections, first-request imports
                (await helper.get(PREFIX)).raise_for_status()
            deep_cursor, walk_s = await walk_cursor(helper, args.deep_pages)
            print(
                f"walked {args.deep_pages} pages of {ops.DEFAULT_PAGE} ({_ms(walk_s)} ms per"
                f" page, one client)\n\n{args.concurrency} concurrent clients ({args.client})"
                f" x {args.requests} requests per endpoint, after {args.serial} sent one at a"
                " time ('alone'); latency in ms"
            )
            planned: list[tuple[Phase, list[Req]]] = []
            for phase in list_phases(samples, deep_cursor):
                if not wanted(args, phase.name):
                    continue
                reqs = [phase.make(i, rng) for i in range(writes)]
                planned.append((phase, reqs))
                results.append(
                    await drive(
                        clients,
                        meter,
                        phase,
                        serial=reqs[: args.serial],
                        loaded=reqs[args.serial :],
                    )
                )
            # Before any write, on the rows the endpoints were measured on.
            print(
                f"\nlist queries straight on the database ({args.sql_checks} per endpoint, one"
                " connection, no HTTP); EXPLAIN ANALYZE of the slowest"
            )
            checked = (
                await check_sql(url, [(p, r) for p, r in planned if p.sql_filter], args.sql_checks)
                if args.sql_checks and sql_checks
                else []
            )
            print()
            ids = pending_ids
            writes_planned = (
                (
                    Phase("replay", "write", None),
                    [Req("POST", f"{PREFIX}/{i}/replay") for i in ids[:writes]],
                ),
                (
                    Phase("discard", "write", None),
                    [
                        Req("POST", f"{PREFIX}/{i}/discard", body={"reason": "apibench"})
                        for i in ids[writes:]
                    ],
                ),
            )
            for phase, reqs in writes_planned:
                if not wanted(args, phase.name):
                    continue
                results.append(
                    await drive(
                        clients,
                        meter,
                        phase,
                        serial=reqs[: args.serial],
                        loaded=reqs[args.serial :],
                    )
                )
            http_bulk = None
            if bulk:
                print(f"\nbulk replay over HTTP: {BULK_HTTP} ({args.bulk_rows:,} pending rows)")
                http_bulk = await bulk_over_http(helper, args.bulk_rows)
                print_bulk_http(http_bulk)
        finally:
            if clients is not None:
                await clients.close()
            for server in servers:
                server.stop()
            api_log = "\n".join(server.output() for server in servers)
    for result in results:
        result.processes = workers * args.api_procs
    return Measured(results, checked, http_bulk, walk_s, api_log)


def wanted(args: argparse.Namespace, name: str) -> bool:
    return not args.only or any(part in name for part in args.only)


def print_bulk_http(http_bulk: dict[str, Any]) -> None:
    print(
        f"  {http_bulk['total']:,} rows in {http_bulk['wall_seconds']:.1f} s:"
        f" {http_bulk['rows_per_s']:,.0f} rows/s (snapshot POST"
        f" {http_bulk['post_seconds']:.2f} s; progress GET p50"
        f" {http_bulk['progress_p50_ms']:.0f} ms, max"
        f" {http_bulk['progress_max_ms']:.0f} ms); {http_bulk['counts']}"
    )


def report(
    args: argparse.Namespace,
    samples: Samples,
    measured: Measured,
    inproc_bulk: dict[str, Any] | None,
    problems: list[str],
) -> dict[str, Any]:
    results = measured.results
    http_bulk = measured.http_bulk
    print(f"\nresults ({samples.rows:,} dead letters; latency in ms, measured by the client)")
    print_table(results)
    print(
        "n: requests under load; alone: p50 of the same requests sent one at a time; API ms:"
        " API process CPU per request;\nCPU: share of one core used by the load generator (this"
        " process), the API process and all local postgres processes during the loaded run;"
        "\ncached: share of the listed items the API took from its item cache under load"
    )
    if http_bulk and inproc_bulk:
        print(
            f"bulk replay of {args.bulk_rows:,} rows: HTTP {http_bulk['rows_per_s']:,.0f} rows/s"
            f" (POST to finished seen), in process {inproc_bulk['rows_per_s']:,.0f} rows/s"
            f" (snapshot + ops.run_bulk_replay, chunks of {args.bulk_chunk_size})"
        )
    missed = [r.name for r in results if r.pct(0.95) >= TARGET_P95]
    over_budget = [r.name for r in results if r.pct(0.95) >= BUDGET_P95]
    print(f"target p95 < 50 ms: {'met by all' if not missed else 'MISSED by ' + ', '.join(missed)}")
    print(
        "budget p95 < 1 s: "
        + ("met by all" if not over_budget else "MISSED by " + ", ".join(over_budget))
    )
    errors = {r.name: r.errors for r in results if r.errors}
    for problem in problems:
        print(f"CHECK FAILED: {problem}")
    if errors:
        print(f"REQUEST ERRORS: {errors}")
        print(measured.api_log[-4000:])
    return {
        "rows": samples.rows,
        "table_mib": samples.table_mb,
        "index_mib": samples.index_mb,
        "deep_walk_ms_per_page": measured.walk_s * 1000,
        "results": [r.summary() for r in results],
        "bulk_http": http_bulk,
        "bulk_in_process": inproc_bulk,
        "sql_checks": measured.sql_checks,
        "target_missed": missed,
        "budget_missed": over_budget,
        "problems": problems,
        "errors": errors,
        "ok": not problems and not errors,
    }


async def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    started = time.perf_counter()
    admin_url = args.admin_url or admin_url_from_env()
    url = bench_url(admin_url, args.db)
    print(f"machine: {machine_notes()}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    seed_seconds = await prepare_database(args, admin_url, url)
    await set_proposed_index(url, args.proposal_index)
    if args.proposal_index:
        print(f"with the proposed index: {' '.join(PROPOSED_INDEX_SQL.split())}")
    print("server: " + ", ".join(f"{k} {v}" for k, v in (await server_notes(url)).items()))
    # Replays and discards, distinct ids.
    per_run = 2 * (args.serial + (args.wrk_ids if args.client == "wrk" else args.requests))
    samples = await draw_samples(url, per_run * len(args.workers), random.Random(args.seed))
    print(
        f"core.dead_letters: {samples.rows:,} rows, table {samples.table_mb:,.0f} MiB,"
        f" indexes {samples.index_mb:,.0f} MiB"
    )
    runs = []
    for n, workers in enumerate(args.workers):
        print(f"\n=== {args.api_procs} x jobfence api --workers {workers}")
        runs.append(
            await measure_api(
                args,
                url,
                samples,
                workers=workers,
                pending_ids=samples.pending_ids[n * per_run : (n + 1) * per_run],
                bulk=not args.no_bulk and n == len(args.workers) - 1,
                sql_checks=n == 0,
            )
        )
    measured = Measured(
        results=[r for m in runs for r in m.results],
        sql_checks=runs[0].sql_checks,
        http_bulk=runs[-1].http_bulk,
        walk_s=runs[0].walk_s,
        api_log="\n".join(m.api_log for m in runs),
    )
    inproc_bulk = None
    problems: list[str] = []
    if measured.http_bulk is not None:
        print(f"\nbulk replay in process (ops.run_bulk_replay): {BULK_INPROC}")
        inproc_bulk = await bulk_in_process(url, args.bulk_chunk_size, args.bulk_rows)
        print(
            f"  {inproc_bulk['total']:,} rows in {inproc_bulk['wall_seconds']:.1f} s:"
            f" {inproc_bulk['rows_per_s']:,.0f} rows/s (snapshot"
            f" {inproc_bulk['snapshot_seconds']:.2f} s); {inproc_bulk['counts']}"
        )
        problems = await verify_bulk(url, measured.http_bulk, inproc_bulk)
    summary = {"command": command, "args": vars(args), "seed_seconds": seed_seconds}
    summary |= report(args, samples, measured, inproc_bulk, problems)
    summary["elapsed_seconds"] = time.perf_counter() - started
    print(f"\nmachine at the end: {machine_notes()}")
    print(f"elapsed: {summary['elapsed_seconds']:.0f} s")
    print(f"command: {command}")
    if not args.keep:
        async with await psycopg.AsyncConnection.connect(admin_url, autocommit=True) as conn:
            await conn.execute(f'DROP DATABASE IF EXISTS "{args.db}" WITH (FORCE)')
        print(f"dropped {args.db} (--keep keeps it for --reuse)")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--admin-url",
        default=None,
        help="server to create the benchmark database on "
        "(default $JOBFENCE_DATABASE_URL or postgresql://postgres@127.0.0.1:5432/postgres)",
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="dead letters (1,000,000)")
    parser.add_argument(
        "--bulk-rows", type=int, default=100_000, help="rows per bulk replay (100,000)"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent clients (32)")
    parser.add_argument(
        "--client",
        choices=["raw", "httpx", "wrk"],
        default="raw",
        help="load generator: one keep-alive connection per client driven by a minimal asyncio"
        " HTTP/1.1 client (raw, the default), httpx.AsyncClient with a pool, or wrk (one thread,"
        " --concurrency connections, a Lua script with the requests: the least CPU; needs wrk"
        " installed, else falls back to raw)",
    )
    parser.add_argument(
        "--requests", type=int, default=640, help="requests per endpoint under load (640)"
    )
    parser.add_argument(
        "--wrk-seconds",
        type=float,
        default=5.0,
        help="--client wrk: seconds per endpoint under load, instead of --requests (5)",
    )
    parser.add_argument(
        "--wrk-ids",
        type=int,
        default=4000,
        help="--client wrk: distinct pending dead letters for replay and for discard; once"
        " used up, wrk sends them again and the 409s count as errors (4000)",
    )
    parser.add_argument(
        "--serial", type=int, default=20, help="requests per endpoint sent one at a time (20)"
    )
    parser.add_argument(
        "--deep-pages", type=int, default=200, help="pages to follow for the deep cursor (200)"
    )
    parser.add_argument("--pool-size", type=int, default=10, help="jobfence api --pool-size (10)")
    parser.add_argument(
        "--workers",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 2],
        help="jobfence api --workers: measure each of these comma-separated values in turn"
        " (1,2; the bulk replay runs with the last)",
    )
    parser.add_argument(
        "--api-procs",
        type=int,
        default=1,
        help="jobfence api processes, each on its own port; the clients are spread over them (1)",
    )
    parser.add_argument(
        "--proposal-index",
        action="store_true",
        help="measure with the proposed partial index for pending + queue + error_class"
        " (created in the benchmark database only; dropped again without this flag)",
    )
    parser.add_argument(
        "--bulk-chunk-size", type=int, default=ops.BULK_CHUNK, help="in-process chunk size (500)"
    )
    parser.add_argument(
        "--sql-checks",
        type=int,
        default=60,
        help="list queries per endpoint run straight on the database; 0: none (60)",
    )
    parser.add_argument("--seed", type=int, default=3, help="random seed of the request mix (3)")
    parser.add_argument(
        "--db", default=DEFAULT_DB, help=f"benchmark database ({DEFAULT_DB}), recreated"
    )
    parser.add_argument(
        "--keep", "--keep-db", action="store_true", help="keep the database at the end"
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="reuse the database if seeded with the same --rows/--bulk-rows (implies --keep)",
    )
    parser.add_argument(
        "--only",
        type=lambda text: [part.strip() for part in text.split(",") if part.strip()],
        default=[],
        help="only the endpoints whose name contains one of these comma-separated texts"
        " (e.g. 'pending + queue,show'; the names are those of the table)",
    )
    parser.add_argument("--no-bulk", action="store_true", help="skip the bulk replays")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if args.reuse:
        args.keep = True
    if args.client == "wrk" and not wrk_available():
        print(
            "wrk is not installed (Debian/Ubuntu: apt-get install -y wrk; macOS: brew install"
            " wrk): using the raw asyncio driver instead",
            file=sys.stderr,
        )
        args.client = "raw"
    if args.rows < 4 * args.bulk_rows:
        parser.error("--rows must be at least 4 x --bulk-rows")
    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    summary = asyncio.run(run(args, command))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2, default=str)
        print(f"results written to {args.json}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
