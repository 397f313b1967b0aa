"""Fuzz the Ops API from its own OpenAPI document with schemathesis, over real HTTP.

The API runs in a thread of its own (uvicorn and its pool on that thread's event loop) on a
fresh database seeded with dead letters and a bulk replay, so generated ids sometimes hit real
rows. Every operation gets requests that fit the document (positive) and requests that do not
(negative), all with a token holding every permission. Checked: no 5xx, status codes,
content types, headers and bodies as documented, and invalid requests refused with a 4xx.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from jobfence import PgQueue, open_pool, ops
from jobfence.api import ApiSettings, create_app
from test_api_support import SECRET, auth, insert_dead_letter, loopback_socket

EXAMPLES_PER_OPERATION = 40
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


class ThreadedApi:
    """The API served from a thread, so the (synchronous) schemathesis calls can reach it."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.sock = loopback_socket()
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server: uvicorn.Server | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="fuzzed-api", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by the test
            self.error = exc

    async def _main(self) -> None:
        # A fixed-size pool: a pool that grows calls the global random() (psycopg_pool jitters
        # each new connection's lifetime), which Hypothesis refuses while it draws a case.
        pool = await open_pool(self.database_url, min_size=8, max_size=8)
        queue = PgQueue(pool)
        try:
            async with pool.connection() as conn:
                for i in range(40):
                    await insert_dead_letter(
                        conn, job_id=f"fz-{i}", queue=f"q{i % 3}", correlation_id=f"c{i}"
                    )
            await ops.start_bulk_replay(pool, ops.DeadLetterFilter(queue="q1"), requested_by="z")
            app = create_app(
                pool=pool, queue=queue, settings=ApiSettings(jwt_secret=SECRET, bulk_chunk_size=5)
            )
            config = uvicorn.Config(
                app, lifespan="on", log_config=None, log_level="warning", ws="none"
            )
            self.server = uvicorn.Server(config)
            await self.server.serve(sockets=[self.sock])
        finally:
            await queue.close()
            await pool.close()

    def __enter__(self) -> ThreadedApi:
        self.thread.start()
        deadline = threading.Event()
        for _ in range(300):
            if self.error is not None:
                raise self.error
            if self.server is not None and self.server.started:
                return self
            deadline.wait(0.05)
        raise AssertionError("the fuzzed API did not start within 15 s")

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()
        assert not self.thread.is_alive(), "the fuzzed API did not stop"
        if self.error is not None:
            raise self.error


@pytest.fixture
def live_api(database_url: str) -> Iterator[ThreadedApi]:
    with ThreadedApi(database_url) as api:
        yield api


def _fuzz(operation: Any, mode: schemathesis.GenerationMode, base_url: str) -> None:
    headers = auth()
    checks = [*CHECKS, negative_data_rejection] if mode.is_negative else CHECKS

    # The token is fixed, not generated: a mutation must not be "the header went missing"
    # (which the real header, sent anyway, would undo).
    @given(case=operation.as_strategy(generation_mode=mode, headers=headers))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        case.call_and_validate(base_url=base_url, checks=checks, timeout=10)

    run()


def test_fuzzing_from_the_openapi_document_finds_no_5xx_and_every_response_fits_it(
    live_api: ThreadedApi, database_url: str
) -> None:
    schema = schemathesis.openapi.from_url(f"{live_api.base_url}/openapi.json")
    # Single dead letters first (discard, then replay), bulk replays (which take whatever
    # pending rows their generated filter matches) last, so every route meets real rows.
    order = ["discard", "replay", "{id}", "dead-letters", "replay-bulk"]
    operations = sorted(
        (result.ok() for result in schema.get_all_operations()),
        key=lambda op: next(
            (i for i, tail in enumerate(order) if op.path.endswith(tail)), len(order)
        ),
    )
    assert len(operations) == 10
    for operation in operations:
        modes = [schemathesis.GenerationMode.POSITIVE]
        if operation.path not in ("/healthz", "/readyz"):  # no input to get wrong
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:
            try:
                _fuzz(operation, mode, live_api.base_url)
            except Exception as exc:
                exc.add_note(f"while fuzzing {operation.label} ({mode.value})")
                raise

    # The generated ids reached real rows: some seeded dead letters were replayed or discarded.
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'replayed'),"
            " count(*) FILTER (WHERE status = 'discarded') FROM core.dead_letters"
        ).fetchone()
    assert row is not None
    print(f"fuzzing replayed {row[0]} and discarded {row[1]} of 40 seeded dead letters")
    assert row[0] > 0
    assert row[1] > 0
