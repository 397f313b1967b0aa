"""The Ops API after a network blip to PostgreSQL: every request once the database is back
answers, and ``/readyz`` follows the database.

The API runs for real (``jobfence api`` in a subprocess, or uvicorn in this process on a pool
opened as the command opens it), through a TCP proxy that cuts every connection
(tests/tcp_proxy.py).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import AsyncConnection

from jobfence import db
from support import wait_until
from tcp_proxy import tcp_proxy
from test_api_support import PREFIX, ApiProcess, auth, insert_dead_letter, running_api

POOL_SIZE = 10
REQUESTS = 3 * POOL_SIZE  # more than the pool holds, of each kind


@pytest.mark.parametrize(
    "probed", [True, False], ids=["readyz-probed-during-the-blip", "nothing-during-the-blip"]
)
async def test_every_request_after_a_database_blip_succeeds_and_readyz_follows_the_database(
    database_url: str, conn: AsyncConnection[Any], tmp_path: Path, probed: bool
) -> None:
    ids = [await insert_dead_letter(conn, job_id=f"blip-{n}") for n in range(REQUESTS)]
    async with tcp_proxy(database_url) as proxy:
        url = proxy.url(database_url)
        api = ApiProcess(url, tmp_path, "--pool-size", str(POOL_SIZE), "--no-access-log")
        try:
            base_url = await api.base_url()
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                # The pool is full (opened so) and each of its connections has served.
                listed = await asyncio.gather(
                    *(client.get(PREFIX, headers=auth()) for _ in range(2 * POOL_SIZE))
                )
                assert {r.status_code for r in listed} == {200}
                assert proxy.carried >= POOL_SIZE

                proxy.down()
                loop = asyncio.get_running_loop()
                cut_at = loop.time()
                if probed:  # as a load balancer does
                    during = await client.get("/readyz")
                    assert during.status_code == 503, during.text
                    assert during.headers["content-type"].startswith("application/problem+json")
                # A blip of half a second (at least: the proxy stays down until /readyz said so).
                await asyncio.sleep(max(0.0, 0.5 - (loop.time() - cut_at)))
                proxy.up()

                async def answers() -> bool:
                    try:
                        c = await psycopg.AsyncConnection.connect(url, connect_timeout=2)
                    except psycopg.OperationalError:
                        return False
                    await c.close()
                    return True

                await wait_until(answers, timeout=10, message="the database through the proxy")

                statuses: list[tuple[str, int, str]] = []
                for n, dead_letter_id in enumerate(ids):
                    one = f"{PREFIX}/{dead_letter_id}"
                    # A write first: it is never tried twice, so only a connection checked
                    # before it is lent saves it.
                    for what, response in (
                        ("replay", await client.post(f"{one}/replay", headers=auth())),
                        ("show", await client.get(one, headers=auth())),
                        ("list", await client.get(PREFIX, headers=auth())),
                    ):
                        statuses.append((f"{what} #{n}", response.status_code, response.text))
                failed = [s for s in statuses if s[1] != 200]
                assert not failed, failed[:5]
                assert (await client.get("/readyz")).status_code == 200
            api.proc.send_signal(signal.SIGTERM)
            assert await api.wait_exit() == 0
        finally:
            api.cleanup()
    replayed = await conn.execute(
        "SELECT count(*) FROM core.dead_letters WHERE status = 'replayed' AND id = ANY(%s)",
        (ids,),
    )
    assert (await replayed.fetchone()) == (REQUESTS,)


async def test_reads_after_connections_were_cut_unnoticed_succeed(
    database_url: str, conn: AsyncConnection[Any]
) -> None:
    # The pool cannot see this cut without a round trip: each connection fails only when
    # used. A read that meets one is tried again once the pool has dropped the broken ones.
    ids = [await insert_dead_letter(conn, job_id=f"cut-{n}") for n in range(REQUESTS)]
    async with tcp_proxy(database_url) as proxy:
        pool = await db.open_pool(
            proxy.url(database_url),
            min_size=POOL_SIZE,
            max_size=POOL_SIZE,
            name="jobfence-api",
            large_reads=True,
            lend_checked=True,
        )
        try:
            async with running_api(pool) as api:
                listed = await asyncio.gather(
                    *(api.client.get(PREFIX, headers=auth()) for _ in range(POOL_SIZE))
                )
                assert {r.status_code for r in listed} == {200}
                assert pool.get_stats()["pool_available"] == POOL_SIZE

                proxy.cut_unnoticed()
                statuses: list[tuple[str, int, str]] = []
                for n, dead_letter_id in enumerate(ids):
                    for what, response in (
                        ("list", await api.client.get(PREFIX, headers=auth())),
                        (
                            "show",
                            await api.client.get(f"{PREFIX}/{dead_letter_id}", headers=auth()),
                        ),
                        ("ready", await api.client.get("/readyz")),
                    ):
                        statuses.append((f"{what} #{n}", response.status_code, response.text))
                failed = [s for s in statuses if s[1] != 200]
                assert not failed, failed[:5]
        finally:
            await pool.close()
