"""Helpers for the Ops API tests (no tests here): tokens, a live server, seeded dead letters.

The API runs for real: uvicorn on a loopback socket of its own, spoken to over HTTP with
httpx, on the test's own database (the conftest ``pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import jwt
import uvicorn
from fastapi import FastAPI
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from jobfence import PgQueue
from jobfence.api import ApiSettings, create_app
from jobfence.api.auth import PERMISSIONS
from jobfence.ports import QueuePort
from support import scalar, wait_until

SECRET = "test-secret-for-hs256-tokens-0123456789abcdef"
ALL_PERMISSIONS: tuple[str, ...] = PERMISSIONS
PREFIX = "/v1/core/dead-letters"
PROBLEM_JSON = "application/problem+json"


def make_token(
    *,
    permissions: Iterable[str] | None = ALL_PERMISSIONS,
    sub: str | None = "alice",
    expires_in: float | None = 300.0,
    key: Any = SECRET,
    algorithm: str = "HS256",
    **claims: Any,
) -> str:
    """A signed JWT; ``None`` leaves a claim out."""
    payload: dict[str, Any] = dict(claims)
    if permissions is not None:
        payload["permissions"] = list(permissions)
    if sub is not None:
        payload["sub"] = sub
    if expires_in is not None:
        payload["exp"] = int(time.time() + expires_in)
    return jwt.encode(payload, key, algorithm=algorithm)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def auth(*permissions: str, sub: str = "alice") -> dict[str, str]:
    """Headers with a valid token carrying ``permissions`` (all of them when none given)."""
    return bearer(make_token(permissions=permissions or ALL_PERMISSIONS, sub=sub))


def loopback_socket() -> socket.socket:
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so (else 40 ms per call).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port; yield its base URL."""
    sock = loopback_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="on", log_config=None, log_level="warning", ws="none")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="test-uvicorn")

    async def started() -> bool:
        if task.done():
            task.result()  # raise its error
            raise AssertionError("uvicorn stopped before it started")
        return server.started

    try:
        await wait_until(started, timeout=10, message="uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=15)
        sock.close()


@dataclass
class Api:
    """A running API: its HTTP client (base URL set), and what it runs on."""

    client: httpx.AsyncClient
    base_url: str
    pool: AsyncConnectionPool[Any]
    queue: QueuePort
    app: FastAPI


@contextlib.asynccontextmanager
async def running_api(
    pool: AsyncConnectionPool[Any],
    *,
    queue: QueuePort | None = None,
    settings: ApiSettings | None = None,
) -> AsyncIterator[Api]:
    own_queue = queue is None
    the_queue: QueuePort = queue if queue is not None else PgQueue(pool)
    app = create_app(
        pool=pool, queue=the_queue, settings=settings or ApiSettings(jwt_secret=SECRET)
    )
    try:
        async with (
            serve(app) as base_url,
            httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        ):
            yield Api(client=client, base_url=base_url, pool=pool, queue=the_queue, app=app)
    finally:
        if own_queue and isinstance(the_queue, PgQueue):
            await the_queue.close()


async def insert_dead_letter(
    conn: AsyncConnection[Any],
    *,
    job_id: str,
    queue: str = "loyalty",
    consumer: str = "award_points",
    tenant_id: str | None = "t1",
    payload: Any = None,
    error_class: str = "Flaky",
    correlation_id: str | None = None,
    created_at: datetime | None = None,
) -> int:
    """A pending dead letter as the harness writes it (``created_at`` may be set)."""
    row = await scalar(
        conn,
        "INSERT INTO core.dead_letters (job_id, queue, consumer, tenant_id, payload, attempts,"
        " last_error, error_class, correlation_id, created_at)"
        " VALUES (%s, %s, %s, %s, %s, 6, %s, %s, %s, coalesce(%s, now())) RETURNING id",
        (
            job_id,
            queue,
            consumer,
            tenant_id,
            Jsonb({"account_id": 1, "points": 5} if payload is None else payload),
            f"{error_class}: it failed",
            error_class,
            correlation_id,
            created_at,
        ),
    )
    return int(row)


async def dead_letter_row(conn: AsyncConnection[Any], dead_letter_id: int) -> dict[str, Any]:
    cur = await conn.execute(
        "SELECT status, discard_reason, resolved_by, resolved_at FROM core.dead_letters"
        " WHERE id = %s",
        (dead_letter_id,),
    )
    row = await cur.fetchone()
    assert row is not None
    return dict(zip(("status", "discard_reason", "resolved_by", "resolved_at"), row, strict=True))


async def queued_job_ids(conn: AsyncConnection[Any]) -> list[str]:
    cur = await conn.execute("SELECT job_id FROM jobfence_queue.messages ORDER BY id")
    return [r[0] for r in await cur.fetchall()]


def assert_problem(response: httpx.Response, status: int, **fields: Any) -> dict[str, Any]:
    """``response`` is an RFC 9457 problem with ``status`` (and ``fields``); return its body."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON), response.headers
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert isinstance(body["title"], str) and body["title"]
    assert isinstance(body["type"], str) and body["type"]
    assert body["instance"] == response.request.url.path
    for name, value in fields.items():
        assert body[name] == value, (name, body)
    return body


async def wait_bulk_finished(api: Api, run_id: int, *, timeout: float = 30.0) -> dict[str, Any]:
    last: dict[str, Any] = {}

    async def finished() -> bool:
        nonlocal last
        response = await api.client.get(f"{PREFIX}/replay-bulk/{run_id}", headers=auth())
        assert response.status_code == 200, response.text
        last = response.json()
        return bool(last["status"] == "finished" and not last["active"])

    await wait_until(finished, timeout=timeout, message=f"bulk replay {run_id} to finish")
    return last


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


class ApiProcess:
    """``jobfence api --port 0`` in a subprocess; its output kept in a file."""

    def __init__(self, database_url: str, workdir: Path, *args: str, **env: str) -> None:
        self.log = workdir / f"api-{id(self)}.log"
        environ = {
            key: value for key, value in os.environ.items() if not key.startswith("JOBFENCE_")
        }
        environ |= {
            "JOBFENCE_DATABASE_URL": database_url,
            "JOBFENCE_JWT_SECRET": SECRET,
            "PYTHONUNBUFFERED": "1",
        }
        environ |= env
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jobfence.cli", "api", "--port", "0", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environ,
                cwd=workdir,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def base_url(self, within: float = 30.0) -> str:
        found: list[str] = []

        async def listening() -> bool:
            match = re.search(
                r"(?:Uvicorn running on|workers ready on) (http://127\.0\.0\.1:\d+)",
                self.output(),
            )
            if match:
                found.append(match.group(1))
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"jobfence api exited early:\n{self.output()}")
            return False

        await wait_until(listening, timeout=within, message="jobfence api to listen")
        return found[0]

    async def wait_exit(self, within: float = 20.0) -> int:
        async def exited() -> bool:
            return self.proc.poll() is not None

        await wait_until(exited, timeout=within, message=f"jobfence api to exit:\n{self.output()}")
        assert self.proc.returncode is not None
        return self.proc.returncode

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
