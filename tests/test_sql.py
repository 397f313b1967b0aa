"""Every named query shipped in a ``.sql`` file is prepared against a migrated database.

``PREPARE`` parses and analyses a statement without running it, so a misspelt table, column,
function or a type mismatch fails here rather than in production on the first failing job.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from importlib import resources
from typing import Any

import psycopg
import pytest

from jobfence._sql import load_queries
from support import with_dbname

QUERY_FILES = [
    ("jobfence.sql", "core.sql"),
    ("jobfence.sql", "ops.sql"),
    ("jobfence.sql", "alerts.sql"),
    ("jobfence.sql", "outbox.sql"),
    ("jobfence.adapters", "pg_queue.sql"),
]
# Shipped SQL that is not a query to prepare: DO blocks and GRANTs, applied whole elsewhere.
APPLIED_ELSEWHERE = {
    (
        "jobfence.sql",
        "roles.sql",
    ): "tests/test_roles.py applies it, twice, and connects as each role",
}
PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def _shipped_query_files() -> set[tuple[str, str]]:
    """Every ``.sql`` file in the package outside ``migrations`` (which test_schema covers)."""
    found = set()
    pending = [("jobfence", resources.files("jobfence"))]
    while pending:
        package, folder = pending.pop()
        for entry in folder.iterdir():
            if entry.is_dir() and entry.name not in ("migrations", "__pycache__"):
                pending.append((f"{package}.{entry.name}", entry))
            elif entry.name.endswith(".sql") and entry.is_file():
                found.add((package, entry.name))
    return found


def to_dollar_params(query: str) -> tuple[str, list[str]]:
    """``%(name)s`` placeholders to ``$1, $2 ...`` (one number per distinct name)."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    converted = PLACEHOLDER.sub(number, query)
    assert "%(" not in converted and "%s" not in converted, "a placeholder was not converted"
    return converted.replace("%%", "%"), names


NAMED_QUERIES = [
    pytest.param(package, filename, name, id=f"{filename}:{name}")
    for package, filename in QUERY_FILES
    for name in sorted(load_queries(package, filename))
]


@pytest.fixture(scope="module")
def migrated(server_url: str, template_dbname: str) -> Iterator[psycopg.Connection[Any]]:
    """One migrated database for the whole module: preparing statements changes nothing."""
    name = f"jobfence_sql_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_dbname}"')  # type: ignore[arg-type]
    try:
        with psycopg.connect(with_dbname(server_url, name), autocommit=True) as conn:
            yield conn
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # type: ignore[arg-type]


def test_every_query_file_shipped_in_the_package_is_covered_here() -> None:
    assert _shipped_query_files() == set(QUERY_FILES) | set(APPLIED_ELSEWHERE)
    for package, filename in QUERY_FILES:
        assert load_queries(package, filename), f"{filename} holds no named query"


@pytest.mark.parametrize(("package", "filename", "name"), NAMED_QUERIES)
def test_named_query_prepares_against_the_migrated_schema(
    migrated: psycopg.Connection[Any], package: str, filename: str, name: str
) -> None:
    query, params = to_dollar_params(load_queries(package, filename)[name])
    statement = f"jobfence_check_{name}"
    migrated.execute(f"PREPARE {statement} AS {query}")  # type: ignore[arg-type]
    try:
        # The server inferred a type for every parameter: none is left ambiguous.
        row = migrated.execute(
            "SELECT cardinality(parameter_types) FROM pg_prepared_statements WHERE name = %s",
            (statement,),
        ).fetchone()
        assert row == (len(params),)
    finally:
        migrated.execute(f"DEALLOCATE {statement}")  # type: ignore[arg-type]


def test_a_typo_in_a_query_fails_to_prepare(migrated: psycopg.Connection[Any]) -> None:
    # The check above can fail: the same conversion and PREPARE on a misspelt column.
    query, _ = to_dollar_params(
        "SELECT job_idd FROM core.processed_jobs WHERE consumer = %(consumer)s"
    )
    with pytest.raises(psycopg.errors.UndefinedColumn, match="job_idd"):
        migrated.execute(f"PREPARE jobfence_typo AS {query}")  # type: ignore[arg-type]


# Queries that answer the same caller with the same row shape: one takes rows another would
# skip, so a column added to one and not the other fails only on the rarer path.
SAME_ROWS = [
    (("jobfence.sql", "ops.sql"), "bulk_take_chunk", "bulk_take_chunk_waiting"),
]


@pytest.mark.parametrize(("source", "first", "second"), SAME_ROWS)
def test_queries_that_feed_the_same_code_return_the_same_columns(
    migrated: psycopg.Connection[Any], source: tuple[str, str], first: str, second: str
) -> None:
    queries = load_queries(*source)
    columns = []
    for name in (first, second):
        query, params = to_dollar_params(queries[name])
        statement = f"jobfence_shape_{name}"
        migrated.execute(f"PREPARE {statement} AS {query}")  # type: ignore[arg-type]
        try:
            # Run with NULL parameters: no row, but the columns' names and types.
            nulls = ", ".join(["NULL"] * len(params))
            cur = migrated.execute(f"EXECUTE {statement} ({nulls})")  # type: ignore[arg-type]
            assert cur.description is not None
            columns.append([(c.name, c.type_code) for c in cur.description])
        finally:
            migrated.execute(f"DEALLOCATE {statement}")  # type: ignore[arg-type]
    assert columns[0] == columns[1], f"{first} and {second} differ"
