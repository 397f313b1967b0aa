"""Named SQL queries loaded from ``.sql`` files shipped in the package.

A file holds several queries, each introduced by a header line ``-- name: <query_name>``.
Queries use psycopg's ``%(param)s`` placeholders. Files are read once, on first use.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from psycopg.sql import SQL

_HEADER = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def parse_queries(text: str) -> dict[str, str]:
    """Split a ``.sql`` file into its named queries."""
    queries: dict[str, str] = {}
    matches = list(_HEADER.finditer(text))
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip()
        name = match.group(1)
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = body
    return queries


@functools.cache
def load_queries(package: str, filename: str) -> dict[str, str]:
    """Return the named queries of ``package/filename``."""
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    return parse_queries(text)


class Queries:
    """Attribute access to one file's named queries, as ready-to-run psycopg queries."""

    def __init__(self, package: str, filename: str) -> None:
        self._raw = load_queries(package, filename)
        self._compiled: dict[str, SQL] = {
            name: SQL(body)  # trusted text shipped in the package itself
            for name, body in self._raw.items()
        }

    def __getitem__(self, name: str) -> SQL:
        return self._compiled[name]

    def names(self) -> list[str]:
        return sorted(self._raw)

    def text(self, name: str) -> str:
        return self._raw[name]
