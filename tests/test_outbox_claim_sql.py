"""The outbox relay's claim, in SQL: what a batch costs PostgreSQL must not grow with the rows
waiting in the outbox (a broker that was down for an hour leaves a backlog to catch up on)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.sql import SQL as Statement

from jobfence.outbox import SQL

FILL = """
INSERT INTO jobfence.outbox (queue, consumer, job_id, body)
SELECT 'q', 'award_points', 'claim-' || g, convert_to('{"account_id": 1}', 'UTF8')
FROM generate_series(1, %(rows)s::bigint) AS g
"""
CLAIM = {"now": None, "limit": 500, "claim_seconds": 30}


def test_a_claim_updates_its_rows_through_the_primary_key_whatever_the_outbox_holds(
    autocommit_conn: psycopg.Connection[Any],
) -> None:
    """20,000 rows waiting: the claim of 500 finds them by the due index and updates them by
    the primary key. Joined with the ids it took, PostgreSQL planned a scan of the whole table
    for every batch, so a backlog slowed the relay down as it grew."""
    autocommit_conn.execute(FILL, {"rows": 20_000})
    autocommit_conn.execute("ANALYZE jobfence.outbox")
    with autocommit_conn.transaction():
        rows = autocommit_conn.execute(
            Statement("EXPLAIN (COSTS OFF) ") + SQL["outbox_claim"], CLAIM
        )
        plan = "\n".join(str(r[0]) for r in rows.fetchall())
    assert "Seq Scan" not in plan, plan
    assert "Index Scan using outbox_pkey on outbox" in plan, plan
    assert "Index Scan using outbox_due_idx on outbox" in plan, plan


def test_a_claim_updates_each_row_in_place_without_new_index_entries(
    autocommit_conn: psycopg.Connection[Any],
) -> None:
    """The outbox's pages keep room (fillfactor 45), so setting claimed_until, which no index
    holds, is a heap-only update: the claim adds nothing to the outbox's indexes, and the
    deletes after the confirms leave no extra dead index entries behind."""
    autocommit_conn.execute(FILL, {"rows": 2_000})
    with autocommit_conn.transaction():
        claimed = autocommit_conn.execute(SQL["outbox_claim"], CLAIM).fetchall()
        hot = autocommit_conn.execute(
            "SELECT pg_stat_get_xact_tuples_updated('jobfence.outbox'::regclass),"
            " pg_stat_get_xact_tuples_hot_updated('jobfence.outbox'::regclass)"
        ).fetchone()
    assert len(claimed) == 500
    assert hot == (500, 500)
