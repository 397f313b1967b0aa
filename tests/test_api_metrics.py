"""Issue 4: ``/metrics`` on the API service, real HTTP, parsed with prometheus_client."""

from __future__ import annotations

from typing import Any

import psycopg
from prometheus_client.parser import text_string_to_metric_families
from psycopg_pool import AsyncConnectionPool

from test_api_support import insert_dead_letter, running_api


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_the_api_serves_metrics_without_a_token_and_the_dead_letter_gauges_move(
    pool: AsyncConnectionPool[Any], conn: psycopg.AsyncConnection[Any]
) -> None:
    async with running_api(pool) as api:
        first = await api.client.get("/metrics")
        assert first.status_code == 200
        assert first.headers["content-type"].startswith("text/plain")
        before = _samples(first.text)
        assert before[("jobfence_metrics_database_up", ())] == 1
        assert before[("jobfence_dead_letter_oldest_pending_age_seconds", ())] == 0

        await insert_dead_letter(conn, job_id="m1", queue="loyalty", consumer="award_points")
        await insert_dead_letter(conn, job_id="m2", queue="loyalty", consumer="award_points")
        after = _samples((await api.client.get("/metrics")).text)
        key = (
            "jobfence_dead_letters_pending",
            (("consumer", "award_points"), ("queue", "loyalty")),
        )
        assert after[key] == 2
        assert after[("jobfence_dead_letter_oldest_pending_age_seconds", ())] >= 0

        # Not part of the authenticated API surface, nor of its OpenAPI document.
        spec = (await api.client.get("/openapi.json")).json()
        assert "/metrics" not in spec["paths"]
