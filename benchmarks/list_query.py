"""What one list page costs PostgreSQL, straight on the database: the Ops API's list query
against the form that passed each whole row to the fallback renderer (before `0d29251`).

Seeds ``--rows`` small dead letters, a few of them (``--large``, spread evenly) with a payload
of ``--large-kib`` KiB of incompressible text, as a poison message's body can be. Then, in
alternating rounds, ``--connections`` connections run the first page (``--limit`` rows) of each
form for ``--seconds``; the figure is the server CPU of those connections per query. A page
holds one large row when ``--rows / --large <= --limit``.

    .venv/bin/python benchmarks/list_query.py                  # 2,000 rows, 4 large, 500 a page
    .venv/bin/python benchmarks/list_query.py --large 0        # no large payload
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import threading
import time

import psutil
import psycopg
from common import (
    admin_url_from_env,
    alternating,
    create_database,
    drop_database,
    machine_notes,
)

from jobfence import ops

DB = "jobfence_list_bench"
CURRENT_FALLBACK = "jobfence.render_dead_letter_head(ROW("
WHOLE_ROW_FALLBACK = "jobfence.render_dead_letter_head(d)"

SEED = """
INSERT INTO core.dead_letters (job_id, queue, consumer, payload, payload_encoding, attempts,
                               last_error, error_class, created_at)
SELECT 'job-' || g, 'orders', 'orders.apply',
       jsonb_build_object('order_id', g, 'sku', md5(g::text))
           || CASE WHEN %(large)s > 0 AND g %% (%(rows)s / %(large)s) = 0
                   THEN jsonb_build_object('blob', encode(%(blob)s::bytea, 'hex'))
                   ELSE '{}'::jsonb END,
       'json', 6, 'TimeoutError: upstream did not answer', 'TimeoutError',
       now() - g * interval '1 second'
FROM generate_series(1, %(rows)s) AS g
"""


def queries(limit: int) -> dict[str, str]:
    query, params = ops.list_page_query(ops.DeadLetterFilter(), limit=limit, how="rendered")
    current = query.decode()
    if CURRENT_FALLBACK not in current:
        raise SystemExit("the list query's fallback is not the expected form: update this script")
    for name, value in params.items():
        current = current.replace(f"%({name})s", str(value))
    start = current.index(CURRENT_FALLBACK)
    end = current.index("::core.dead_letters)", start) + len("::core.dead_letters)")
    return {"current": current, "whole row": current[:start] + WHOLE_ROW_FALLBACK + current[end:]}


def measure(url: str, query: str, connections: int, seconds: float) -> float:
    """Server CPU ms per query of ``connections`` connections looping ``query``."""
    conns = [psycopg.connect(url, autocommit=True) for _ in range(connections)]
    backends = [psutil.Process(c.info.backend_pid) for c in conns]
    counts = [0] * connections
    for conn in conns:  # prepared and warm before the clock starts
        for _ in range(6):
            conn.execute(query, prepare=True).fetchall()

    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in backends)

    deadline = time.monotonic() + seconds
    before = cpu()

    def loop(i: int) -> None:
        cur = conns[i].cursor(binary=True)
        while time.monotonic() < deadline:
            cur.execute(query, prepare=True)
            cur.fetchall()
            counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    used = cpu() - before
    for conn in conns:
        conn.close()
    return 1000 * used / sum(counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--large", type=int, default=4, help="rows with a large payload (4)")
    parser.add_argument("--large-kib", type=int, default=1024, help="its size in KiB (1024)")
    parser.add_argument("--limit", type=int, default=500, help="page size (500)")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0, help="per form and round (4)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "benchmarks/list_query.py", *sys.argv[1:]])
    print(f"machine: {machine_notes()}")
    admin_url = admin_url_from_env()
    url = asyncio.run(create_database(admin_url, DB))  # migrated
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            blob = os.urandom(args.large_kib * 512)  # hex doubles it
            conn.execute(SEED, {"rows": args.rows, "large": args.large, "blob": blob})
            conn.execute("VACUUM ANALYZE core.dead_letters")
            conn.execute("VACUUM ANALYZE jobfence.dead_letter_renderings")
        forms = queries(args.limit)
        results: dict[str, list[float]] = {name: [] for name in forms}
        for label, name in alternating(forms, args.rounds):
            ms = measure(url, forms[name], args.connections, args.seconds)
            results[name].append(ms)
            print(f"{label}  {name:<10} {ms:6.3f} ms/page", flush=True)
    finally:
        asyncio.run(drop_database(admin_url, DB))
    current, whole = (statistics.median(results[n]) for n in ("current", "whole row"))
    print(
        f"PostgreSQL CPU per {args.limit}-row page, median of {args.rounds} rounds: current"
        f" {current:.3f} ms, whole row {whole:.3f} ms; current / whole row {current / whole:.2f}"
    )
    print(f"machine at the end: {machine_notes()}")
    print(f"command: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
