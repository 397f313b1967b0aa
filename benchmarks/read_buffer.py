"""What reading a list page costs the API process, two ways side by side in one run.

``--compare buffer`` (the default): with libpq's default input buffer and with the 256 KiB
one that ``jobfence api`` gives each pooled connection (``db.open_pool(..., large_reads=True)``),
both without an item cache. ``--compare cache``: with large reads, without an item cache
(every item rendered by PostgreSQL, what a page of items not cached yet costs) and with one
(``jobfence.ops.ItemCache``, filled by the warm-up, as ``jobfence api`` keeps it).

Seeds ``--rows`` dead letters of about the size the API benchmark's are (a 500-row page is
about 420 KB), one in ten discarded. Then, in alternating rounds, ``--connections`` tasks on
one event loop (uvloop, as in ``jobfence api``) each read the first page (``--limit`` rows)
through ``jobfence.ops.list_dead_letters_json``, the function the API's list route calls, for
``--seconds``, each way. Reported per page: the client process's CPU, the PostgreSQL
server's CPU of those connections, and pages per second.

    .venv/bin/python benchmarks/read_buffer.py                  # 2,000 rows, 500 a page
    .venv/bin/python benchmarks/read_buffer.py --limit 50       # a default page
    .venv/bin/python benchmarks/read_buffer.py --compare cache  # item cache off / on
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import psutil
import uvloop
from common import (
    admin_url_from_env,
    alternating,
    create_database,
    drop_database,
    machine_notes,
)

from jobfence import db, ops

DB = "jobfence_read_bench"
# Each comparison: its two ways, as (large reads, item cache bytes), the baseline first.
COMPARISONS = {
    "buffer": {"default (16 KiB)": (False, 0), "large reads (256 KiB)": (True, 0)},
    "cache": {"no item cache": (True, 0), "item cache": (True, 64 << 20)},
}

# Items like the API benchmark's: a 230-byte JSON payload and a traceback as last_error.
SEED = """
INSERT INTO core.dead_letters (job_id, queue, consumer, tenant_id, payload, payload_encoding,
                               attempts, last_error, error_class, correlation_id, created_at)
SELECT gen_random_uuid()::text, 'orders', 'orders.sync', 'tenant-' || (g %% 100),
       jsonb_build_object('order_id', g, 'sku', 'SKU-' || left(md5(g::text), 10),
                          'currency', 'USD', 'quantity', g %% 7, 'account_id', g * 7,
                          'amount_cents', g * 13, 'requested_at', now()::text,
                          'idempotency_key', md5(g::text)),
       'json', 1 + g %% 5,
       'httpx.HTTPStatusError: account is locked (attempt 1)' || E'\\nTraceback (most recent'
       || E' call last):\\n  File "/app/myapp/jobs.py", line 118, in handle\\n    await'
       || E' ledger.apply(payload.account_id, payload.amount_cents)\\n  File'
       || E' "/app/myapp/ledger.py", line 42, in apply\\n    raise httpx.HTTPStatusError(detail)',
       'httpx.HTTPStatusError', 'corr-' || md5(g::text), now() - g * interval '1 second'
FROM generate_series(1, %(rows)s) AS g
"""
RESOLVE = """
UPDATE core.dead_letters SET status = 'discarded', discard_reason = 'duplicate of an order',
       resolved_at = now(), resolved_by = 'bench'
WHERE id % 10 = 0
"""


@dataclass(frozen=True, slots=True)
class Round:
    pages_per_second: float
    client_ms: float
    server_ms: float
    page_bytes: int


async def measure(url: str, way: tuple[bool, int], args: argparse.Namespace) -> Round:
    large_reads, cache_bytes = way
    items = ops.ItemCache(cache_bytes)
    pool = await db.open_pool(
        url, min_size=args.connections, max_size=args.connections, large_reads=large_reads
    )
    try:
        conns = [await pool.getconn() for _ in range(args.connections)]
        backends = [psutil.Process(c.info.backend_pid) for c in conns]
        flt = ops.DeadLetterFilter()
        sizes = [0]
        counts = [0] * len(conns)

        async def loop(i: int, deadline: float) -> None:
            while time.monotonic() < deadline:
                page = await ops.list_dead_letters_json(
                    conns[i], flt, limit=args.limit, items=items
                )
                sizes[0] = len(page)
                counts[i] += 1

        def server_cpu() -> float:
            return sum(sum(p.cpu_times()[:2]) for p in backends)

        # Warm: the statements prepared on every connection, the cache filled, before the
        # clock starts.
        await asyncio.gather(*(loop(i, time.monotonic() + 0.5) for i in range(len(conns))))
        counts = [0] * len(conns)
        started, client0, server0 = time.monotonic(), time.process_time(), server_cpu()
        deadline = started + args.seconds
        await asyncio.gather(*(loop(i, deadline) for i in range(len(conns))))
        elapsed = time.monotonic() - started
        client, server = time.process_time() - client0, server_cpu() - server0
        for conn in conns:
            await pool.putconn(conn)
    finally:
        await pool.close()
    pages = sum(counts)
    return Round(pages / elapsed, 1000 * client / pages, 1000 * server / pages, sizes[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--limit", type=int, default=500, help="page size (500)")
    parser.add_argument("--connections", type=int, default=8, help="concurrent readers (8)")
    parser.add_argument("--seconds", type=float, default=4.0, help="per kind and round (4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--compare",
        choices=sorted(COMPARISONS),
        default="buffer",
        help="buffer: libpq's default buffer / large reads; cache: no item cache / item cache"
        " (buffer)",
    )
    args = parser.parse_args()
    kinds = COMPARISONS[args.compare]
    command = shlex.join([".venv/bin/python", "benchmarks/read_buffer.py", *sys.argv[1:]])
    print(f"machine: {machine_notes()}")
    admin_url = admin_url_from_env()
    url = asyncio.run(create_database(admin_url, DB))  # migrated
    results: dict[str, list[Round]] = {name: [] for name in kinds}
    try:

        async def seed() -> None:
            async with await db.open_pool(url, max_size=1) as pool, pool.connection() as conn:
                await conn.execute(SEED, {"rows": args.rows})
                await conn.execute(RESOLVE)
                await conn.execute("VACUUM ANALYZE core.dead_letters")
                await conn.execute("VACUUM ANALYZE jobfence.dead_letter_renderings")

        uvloop.run(seed())
        for label, name in alternating(kinds, args.rounds):
            got = uvloop.run(measure(url, kinds[name], args))
            results[name].append(got)
            print(
                f"{label}  {name:<20} {got.pages_per_second:6.0f} pages/s"
                f"  client {got.client_ms:.3f} ms/page  server {got.server_ms:.3f} ms/page"
                f"  ({got.page_bytes:,} bytes a page)",
                flush=True,
            )
    finally:
        asyncio.run(drop_database(admin_url, DB))
    baseline, other = (results[name] for name in kinds)

    def ratio(field: str) -> float:
        per_round = [
            float(getattr(new, field) / getattr(old, field))
            for old, new in zip(baseline, other, strict=True)
        ]
        return statistics.median(per_round)

    first, second = kinds
    print(
        f"{args.limit}-row page, median of {args.rounds} per-round ratios, {second} / {first}:"
        f" client CPU {ratio('client_ms'):.2f}, server CPU {ratio('server_ms'):.2f},"
        f" pages/s {ratio('pages_per_second'):.2f}"
    )
    print(f"machine at the end: {machine_notes()}")
    print(f"command: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
