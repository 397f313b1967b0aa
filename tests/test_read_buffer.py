"""Pools that list dead letters read a large result in large pieces (``db.open_pool``'s
``large_reads``, on for ``jobfence api`` and ``jobfence dead-letters``).

libpq reads a result into an input buffer of 16 KiB, at most its free space per read; the pool
grows each connection's buffer once, when it opens the connection. What is measured: how much
of a result already waiting in the socket one read (``PQconsumeInput``) takes.
"""

from __future__ import annotations

import array
import fcntl
import select
import termios
from pathlib import Path
from typing import Any

import psycopg

from jobfence import db
from support import scalar, wait_until
from test_api_support import ApiProcess

# 140 rows of 700 bytes, like a list page's items: many messages, none large, so libpq never
# grows its buffer for this result itself. Small enough to wait whole in the socket, so that
# nothing arrives during the one read measured.
ROWS = 140
MANY_ROWS = f"SELECT repeat('x', 700) FROM generate_series(1, {ROWS})".encode()
WAITING = ROWS * (1 + 4 + 2 + 4 + 700)  # the DataRow messages: wait for all of them


def _waiting_bytes(fd: int) -> int:
    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return buf[0]


async def _one_read_takes(conn: psycopg.AsyncConnection[Any]) -> tuple[int, int]:
    """Send MANY_ROWS, wait until WAITING bytes of the answer sit in the socket, read once:
    (bytes waiting before the read, bytes still waiting after it). Then finish the result."""
    pgconn = conn.pgconn
    fd = pgconn.socket
    pgconn.send_query(MANY_ROWS)
    while pgconn.flush():
        select.select([], [fd], [], 5)

    async def waiting() -> bool:
        return _waiting_bytes(fd) >= WAITING

    await wait_until(waiting, timeout=10, message=f"{WAITING} bytes waiting in the socket")
    before = _waiting_bytes(fd)
    pgconn.consume_input()
    after = _waiting_bytes(fd)
    while pgconn.is_busy():
        select.select([fd], [], [], 5)
        pgconn.consume_input()
    rows = 0
    while (result := pgconn.get_result()) is not None:
        rows += result.ntuples
    assert rows == ROWS
    return before, after


async def test_a_pool_with_large_reads_takes_all_that_is_waiting_in_one_read(
    database_url: str,
) -> None:
    pool = await db.open_pool(database_url, min_size=1, max_size=1, large_reads=True)
    try:
        async with pool.connection() as conn:
            before, after = await _one_read_takes(conn)
            assert before >= WAITING
            assert after == 0, f"one read left {after} of {before} bytes waiting"
            # The connection is left as it was: usable, idle, autocommit.
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            cur = await conn.execute("SELECT 1")
            assert await cur.fetchone() == (1,)
    finally:
        await pool.close()


async def test_a_pool_without_large_reads_takes_16_kib_per_read(database_url: str) -> None:
    """The same measurement on a default pool: what the option changes (and why the test
    above can fail)."""
    pool = await db.open_pool(database_url, min_size=1, max_size=1)
    try:
        async with pool.connection() as conn:
            before, after = await _one_read_takes(conn)
            assert before >= WAITING
            assert before - after <= 16 * 1024
    finally:
        await pool.close()


async def test_the_api_grows_the_read_buffer_of_every_pooled_connection(
    database_url: str, tmp_path: Path, conn: psycopg.AsyncConnection[Any]
) -> None:
    """``jobfence api`` asks for large reads: each pooled connection's last statement is the
    one row that grows its buffer (but the one that then checked the schema)."""
    proc = ApiProcess(database_url, tmp_path, "--pool-size", "3")
    try:
        await proc.base_url()

        async def grown() -> bool:
            count = await scalar(
                conn,
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND query = %s",
                (db._GROW_READ_BUFFER.decode(),),
            )
            return bool(count >= 2)

        await wait_until(grown, timeout=10, message="2 of the API's 3 connections grown")
    finally:
        proc.cleanup()
