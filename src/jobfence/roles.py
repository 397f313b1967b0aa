"""The database roles of a least-privilege deployment, as SQL a DBA reviews and applies.

``sql/roles.sql`` holds one named query per role, in the order they are applied; each
``{role}`` in it stands for that role's name. :func:`render_roles_sql` puts the names in
(``jobfence roles --print-sql``). docs/operations.md, "Deploying with least privilege", says
what each role may do and how to apply them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from jobfence._sql import load_queries
from jobfence.errors import ConfigError

ROLES = ("owner", "producer", "worker", "ops", "relay", "alert_relay")
"""The roles, in the order their SQL is applied."""

DEFAULT_NAMES: Mapping[str, str] = {role: f"jobfence_{role}" for role in ROLES}

# Names go into the SQL as quoted identifiers and as string literals: only plain lower-case
# identifiers, so that neither needs escaping and psql shows them as given.
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def role_names(names: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """Every role's name: ``names`` where given, else its default (``jobfence_<role>``).

    Raises :class:`~jobfence.errors.ConfigError` for an unknown role, a name that is not a
    plain lower-case identifier, or one name given to two roles."""
    chosen = dict(DEFAULT_NAMES)
    for role, name in (names or {}).items():
        if role not in DEFAULT_NAMES:
            raise ConfigError(f"unknown role {role!r}: the roles are {', '.join(ROLES)}")
        if name is None:
            continue
        if not _NAME.match(name):
            raise ConfigError(
                f"role name {name!r} (for the {role} role) must be 1-63 characters of lower-case"
                " letters, digits and _, not starting with a digit"
            )
        chosen[role] = name
    seen: dict[str, str] = {}
    for role, name in chosen.items():
        if name in seen:
            raise ConfigError(
                f"role name {name!r} is given to both the {seen[name]} and the {role} role:"
                " each role needs its own name"
            )
        seen[name] = role
    return chosen


def render_roles_sql(names: Mapping[str, str | None] | None = None) -> str:
    """The SQL that creates the roles and grants each what it needs, with ``names`` (see
    :func:`role_names`). Idempotent: apply it after every ``jobfence migrate``."""
    chosen = role_names(names)
    queries = load_queries("jobfence.sql", "roles.sql")
    parts = [
        "-- jobfence database roles: apply as a superuser after `jobfence migrate`, in one"
        " transaction",
        '-- (docs/operations.md, "Deploying with least privilege"). Idempotent.',
        "BEGIN;",
    ]
    for name, query in queries.items():
        text = query
        for role, value in chosen.items():
            text = text.replace(f"'{{{role}}}'", f"'{value}'").replace(f"{{{role}}}", f'"{value}"')
        parts.append(f"\n-- {name}\n{text}")
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"
