"""The client CPU of psycopg's wait for the server: its own against one that keeps the socket
registered with the event loop.

Every statement on an async psycopg connection waits for the server's answer through
``AsyncConnection.wait``: psycopg registers the socket with the event loop (``add_reader``),
arms a timer for its interrupt interval, awaits a future, then removes both again, for each
wait. The flame graphs put that event-loop work at a third of a worker's CPU per job. This
measures what it costs: two loops on one connection each, alternating rounds, each job being
``BEGIN``, one ``UPDATE`` and ``COMMIT`` (three round trips), with

- **psycopg**: psycopg's own wait (what jobfence uses);
- **kept**: a wait that registers the socket once per connection and keeps it registered,
  with no timer, resolving one future per wait (an experiment: it leaves out psycopg's
  interrupt handling, which cancels the query on the server when the waiting task is
  cancelled).

It prints the client CPU and wall time per job of each, per round, then the ratios.

    PYTHONPATH=src python benchmarks/wait_strategy.py            # 5,000 jobs x 4 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Generator
from statistics import median
from typing import Any

import psycopg
from common import admin_url_from_env, create_database, drop_database
from psycopg import waiting
from psycopg.waiting import READY_R, WAIT_R, WAIT_W

from jobfence import runtime

DBNAME = "jobfence_wait_strategy"


class KeptReader(psycopg.AsyncConnection[Any]):
    """An async connection whose waits for reading share one registration of its socket."""

    _kept_fd = -1
    _kept_future: asyncio.Future[None] | None = None

    async def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        if timeout is not None:
            return await super().wait(gen, interval, timeout)
        try:
            state = next(gen)
        except StopIteration as done:
            return done.value
        loop = asyncio.get_running_loop()
        try:
            while True:
                if state & WAIT_W or not state & WAIT_R:  # rare: psycopg's own wait for the rest
                    fd = self.pgconn.socket
                    return await waiting.wait_async(_resumed(gen, state), fd, interval=interval)
                fd = self.pgconn.socket
                if self._kept_fd != fd:
                    if self._kept_fd >= 0:
                        loop.remove_reader(self._kept_fd)
                    loop.add_reader(fd, self._readable)
                    self._kept_fd = fd
                future = self._kept_future = loop.create_future()
                try:
                    await future
                finally:
                    self._kept_future = None
                state = gen.send(READY_R)
        except StopIteration as done:
            return done.value

    def _readable(self) -> None:
        future = self._kept_future
        if future is None or future.done():
            # nobody waits: stop watching, or the loop would call this again and again
            asyncio.get_running_loop().remove_reader(self._kept_fd)
            self._kept_fd = -1
            return
        future.set_result(None)

    async def close(self) -> None:
        if self._kept_fd >= 0:
            asyncio.get_running_loop().remove_reader(self._kept_fd)
            self._kept_fd = -1
        await super().close()


def _resumed(gen: Any, state: int) -> Generator[int, int, Any]:
    """``gen``, whose last request was ``state``, as a generator starting with that request."""
    ready = yield state
    try:
        while True:
            ready = yield gen.send(ready)
    except StopIteration as done:
        return done.value


async def transactions(conn: psycopg.AsyncConnection[Any], jobs: int) -> None:
    for _ in range(jobs):
        await conn.execute("BEGIN")
        await conn.execute("UPDATE bench_w SET points = points + %s WHERE id = %s", (1, 1))
        await conn.execute("COMMIT")


async def main_async(jobs: int, rounds: int) -> None:
    admin = admin_url_from_env()
    url = await create_database(admin, DBNAME)
    kinds: dict[str, type[psycopg.AsyncConnection[Any]]] = {
        "psycopg": psycopg.AsyncConnection,
        "kept": KeptReader,
    }
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as setup:
            await setup.execute("CREATE TABLE bench_w (id int PRIMARY KEY, points bigint)")
            await setup.execute("INSERT INTO bench_w VALUES (1, 0)")
        cpu: dict[str, list[float]] = {name: [] for name in kinds}
        for n in range(rounds):
            order = list(kinds) if n % 2 == 0 else list(reversed(kinds))
            for name in order:
                async with await kinds[name].connect(url, autocommit=True) as conn:
                    started_cpu, started = time.process_time(), time.monotonic()
                    await transactions(conn, jobs)
                    used = time.process_time() - started_cpu
                    wall = time.monotonic() - started
                cpu[name].append(used)
                print(
                    f"round {n + 1} {name:>7}: {used / jobs * 1e6:5.0f} us client CPU,"
                    f" {wall / jobs * 1e6:5.0f} us wall per job (3 round trips)"
                )
        ratios = [k / p for k, p in zip(cpu["kept"], cpu["psycopg"], strict=True)]
        print(
            "client CPU, kept / psycopg, per round:",
            ", ".join(f"{r:.2f}" for r in ratios),
            f"(median {median(ratios):.2f})",
        )
        saved = [(p - k) / jobs / 3 * 1e6 for k, p in zip(cpu["kept"], cpu["psycopg"], strict=True)]
        print(f"client CPU saved per round trip: median {median(saved):.1f} us")
    finally:
        await drop_database(admin, DBNAME)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--loop", default=None, help="event loop (uvloop by default)")
    args = parser.parse_args()
    runtime.run(lambda: main_async(args.jobs, args.rounds), loop=args.loop)
    print(
        f"command: PYTHONPATH=src python benchmarks/wait_strategy.py --jobs {args.jobs}"
        f" --rounds {args.rounds}"
    )


if __name__ == "__main__":
    main()
