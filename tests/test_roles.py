"""The runtime role of docs/operations.md ("Database roles"), with exactly the grants listed
there and nothing more: a producer publishes, a worker processes and dead-letters jobs, the Ops
service lists, shows, replays (one and in bulk) and discards, cleanup runs. A grant the docs
forget fails here with "permission denied"."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from pydantic import BaseModel

from jobfence import App, HardFailure, JobMeta, Message, PgQueue, Worker, db, ops
from jobfence.cleanup import cleanup_expired
from jobfence.ops import DeadLetterFilter, run_bulk_replay, start_bulk_replay

OPERATIONS = Path(__file__).parents[1] / "docs" / "operations.md"


def documented_grants(role: str) -> str:
    """The SQL block of operations.md that creates the runtime role, for ``role``."""
    text = OPERATIONS.read_text(encoding="utf-8")
    start = text.index("CREATE ROLE jobfence_app LOGIN;")
    return text[start : text.index("```", start)].replace("jobfence_app", role)


@pytest.fixture
def app_role_url(database_url: str) -> Iterator[str]:
    role = f"jobfence_app_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(documented_grants(role))  # type: ignore[arg-type]
    yield make_conninfo(database_url, user=role)
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f'DROP OWNED BY "{role}"')  # type: ignore[arg-type]
        admin.execute(f'DROP ROLE "{role}"')  # type: ignore[arg-type]


class Job(BaseModel):
    fail: bool


def build_app() -> App:
    app = App()

    @app.consumer("roles.consumer", queue="roles", schema=Job)
    async def handle(payload: Job, job: JobMeta, tx: psycopg.AsyncConnection[Any]) -> None:
        await tx.execute("SELECT 1")
        if payload.fail:
            raise HardFailure("refused")

    return app


def job(job_id: str, *, fail: bool) -> Message:
    return Message("roles", "roles.consumer", job_id, json.dumps({"fail": fail}).encode())


async def test_the_documented_runtime_role_runs_every_process(app_role_url: str) -> None:
    pool = await db.open_pool(app_role_url, min_size=1, max_size=6)
    queue = PgQueue(pool, poll_interval_seconds=0.05)
    try:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT current_user")
            assert (await cur.fetchone() or [""])[0].startswith("jobfence_app_")

        async def run_worker() -> None:
            worker = Worker(build_app(), pool, queue, poll_seconds=0.05)
            await asyncio.wait_for(worker.run(until="idle"), timeout=20)

        for i in range(3):
            await queue.publish(job(f"ok-{i}", fail=False))
        for i in range(3):
            await queue.publish(job(f"bad-{i}", fail=True))
        await run_worker()

        async with pool.connection() as conn:
            page = json.loads(await ops.list_dead_letters_json(conn, DeadLetterFilter()))
            assert sorted(item["job_id"] for item in page["items"]) == ["bad-0", "bad-1", "bad-2"]
            first, second, third = (item["id"] for item in page["items"])
            shown = json.loads(await ops.show_dead_letter_json(conn, first))
            assert shown["fence_exists"] is False
            assert (await ops.list_dead_letters(conn, DeadLetterFilter())).items

        replayed = await ops.replay(pool, queue, first, actor="ops@example.com")
        assert replayed.published
        discarded = await ops.discard(pool, second, reason="test data", actor="ops@example.com")
        assert discarded.status == "discarded"
        run = await start_bulk_replay(
            pool, DeadLetterFilter(queue="roles"), requested_by="ops@example.com"
        )
        assert not isinstance(run, int)
        finished = await run_bulk_replay(pool, queue, run.id, actor="ops@example.com")
        assert finished.counts["replayed"] == 1, finished.counts
        await run_worker()  # the two replayed jobs fail again: two new dead letters

        async with pool.connection() as conn:
            assert await ops.count_dead_letters(conn, DeadLetterFilter()) == 5
            assert third in [
                dl.id
                for dl in (
                    await ops.list_dead_letters(conn, DeadLetterFilter(status="replayed"))
                ).items
            ]
            await conn.execute(
                "UPDATE core.processed_jobs SET processed_at = now() - interval '2 days',"
                " expires_at = now() - interval '1 day'"
                " WHERE job_id = 'ok-0'"
            )
            cleaned = await cleanup_expired(conn)
            assert cleaned.deleted == 1
    finally:
        await queue.close()
        await pool.close()
