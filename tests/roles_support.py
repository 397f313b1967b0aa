"""The least-privilege roles of ``jobfence roles --print-sql``, applied to a test's database
with names of their own (role names are shared by the whole server), and one login role per
group role, to connect as."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg
from psycopg.conninfo import make_conninfo

from jobfence.roles import ROLES, render_roles_sql


@contextlib.contextmanager
def deployed_roles(database_url: str) -> Iterator[dict[str, str]]:
    """Apply the roles' SQL to ``database_url`` (migrated) and yield, for each role, the URL of
    a login role that is a member of it and has no privilege of its own. The SQL is applied
    twice: it must be idempotent. Everything is dropped afterwards."""
    tag = uuid.uuid4().hex[:8]
    names = {role: f"jf{tag}_{role}" for role in ROLES}
    logins = {role: f"jf{tag}_{role}_login" for role in ROLES}
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(render_roles_sql(names))  # type: ignore[arg-type]
        admin.execute(render_roles_sql(names))  # type: ignore[arg-type]
        for role, login in logins.items():
            admin.execute(f'CREATE ROLE "{login}" LOGIN IN ROLE "{names[role]}"')  # type: ignore[arg-type]
    try:
        yield {role: make_conninfo(database_url, user=login) for role, login in logins.items()}
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            for name in [*logins.values(), *names.values()]:
                admin.execute(f'REASSIGN OWNED BY "{name}" TO CURRENT_USER')  # type: ignore[arg-type]
                admin.execute(f'DROP OWNED BY "{name}"')  # type: ignore[arg-type]
                admin.execute(f'DROP ROLE "{name}"')  # type: ignore[arg-type]


def group_role(url: str) -> str:
    """The group role whose login ``url`` connects as (``jf<tag>_producer_login`` ->
    ``jf<tag>_producer``)."""
    user = psycopg.conninfo.conninfo_to_dict(url)["user"]
    assert isinstance(user, str) and user.endswith("_login")
    return user.removesuffix("_login")
