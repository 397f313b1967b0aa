"""jobfence's settings in a Django project: the ``JOBFENCE`` dict of ``settings.py`` and the
database of ``DATABASES``, read in this one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from psycopg.conninfo import make_conninfo

from jobfence.config import ENV_DATABASE_POOL_MODE, POOL_MODES, database_pool_mode_from_env

SETTING = "JOBFENCE"
KEYS = ("DATABASE_ALIAS", "APP", "WORKER", "DATABASE_POOL_MODE")
# WORKER key -> (``jobfence worker`` flag, the type its value must have)
WORKER_FLAGS: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "QUEUES": ("--queue", (list, tuple)),
    "CONCURRENCY": ("--concurrency", int),
    "BATCH_SIZE": ("--batch-size", int),
    "LEASE_SECONDS": ("--lease-seconds", (int, float)),
    "MAX_HANDLER_SECONDS": ("--max-handler-seconds", (int, float)),
    "GRACE_SECONDS": ("--grace-seconds", (int, float)),
    "BLOCKED_LOOP_SECONDS": ("--blocked-loop-seconds", (int, float)),
}
# What Django's postgresql backend adds for its own connections, none of it libpq's.
_NOT_LIBPQ = ("cursor_factory", "context", "prepare_threshold")


@dataclass(frozen=True, slots=True)
class JobfenceSettings:
    """``settings.JOBFENCE``, checked. ``database_alias`` ("default"): the ``DATABASES`` entry
    holding jobfence's schema and queue; ``app``: the ``jobfence.App`` as
    ``"MODULE:ATTRIBUTE"``; ``worker``: ``manage.py jobfence_worker``'s defaults;
    ``database_pool_mode``: the pool mode of the PgBouncer in front of that database
    (``session`` or ``transaction``), None when not set."""

    database_alias: str = "default"
    app: str | None = None
    worker: Mapping[str, Any] = field(default_factory=dict)
    database_pool_mode: str | None = None

    def pool_mode(self) -> str | None:
        """``DATABASE_POOL_MODE``, else JOBFENCE_DATABASE_POOL_MODE, else None."""
        return self.database_pool_mode or database_pool_mode_from_env()

    def export_pool_mode(self) -> None:
        """Make ``DATABASE_POOL_MODE``, when set, this process's JOBFENCE_DATABASE_POOL_MODE,
        which jobfence's commands and connections follow (as ``DATABASES`` gives them
        JOBFENCE_DATABASE_URL)."""
        if self.database_pool_mode is not None:
            os.environ[ENV_DATABASE_POOL_MODE] = self.database_pool_mode

    def worker_argv(self, *, with_queues: bool = True) -> list[str]:
        """``worker`` as ``jobfence worker`` flags (a flag on the command line wins)."""
        argv: list[str] = []
        for key, value in self.worker.items():
            flag = WORKER_FLAGS[key][0]
            if key == "QUEUES":
                if not with_queues:
                    continue
                for queue in value:
                    argv += [flag, str(queue)]
            else:
                argv += [flag, str(value)]
        return argv


def _problem(text: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"settings.{SETTING}: {text} (docs/django.md)")


def jobfence_settings() -> JobfenceSettings:
    """``settings.JOBFENCE`` (optional: every key has a default), refused clearly when wrong."""
    raw = getattr(settings, SETTING, {})
    if not isinstance(raw, Mapping):
        raise _problem(f"must be a dict, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in KEYS)
    if unknown:
        raise _problem(f"unknown key(s) {', '.join(unknown)}; the keys are {', '.join(KEYS)}")
    alias = raw.get("DATABASE_ALIAS", "default")
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        have = ", ".join(sorted(settings.DATABASES)) or "none"
        raise _problem(f"DATABASE_ALIAS {alias!r} is not in settings.DATABASES (it has {have})")
    engine = settings.DATABASES[alias].get("ENGINE", "")
    if connections[alias].vendor != "postgresql":
        raise _problem(
            f"DATABASES[{alias!r}] uses {engine!r}: jobfence needs PostgreSQL"
            " (django.db.backends.postgresql)"
        )
    app = raw.get("APP")
    if app is not None and (not isinstance(app, str) or ":" not in app):
        raise _problem(f"APP must be 'MODULE:ATTRIBUTE' (e.g. 'myproject.jobs:app'), got {app!r}")
    worker = raw.get("WORKER", {})
    if not isinstance(worker, Mapping):
        raise _problem(f"WORKER must be a dict, got {type(worker).__name__}")
    for key, value in worker.items():
        if key not in WORKER_FLAGS:
            raise _problem(f"unknown WORKER key {key!r}; the keys are {', '.join(WORKER_FLAGS)}")
        kind = WORKER_FLAGS[key][1]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise _problem(f"WORKER[{key!r}] has the wrong type: {value!r}")
    mode = raw.get("DATABASE_POOL_MODE")
    if mode is not None and (not isinstance(mode, str) or mode.strip().lower() not in POOL_MODES):
        raise _problem(
            f"DATABASE_POOL_MODE must be {' or '.join(repr(m) for m in POOL_MODES)} (the pool"
            f" mode of the PgBouncer in front of the database), got {mode!r}"
        )
    return JobfenceSettings(
        database_alias=alias,
        app=app,
        worker=dict(worker),
        database_pool_mode=None if mode is None else mode.strip().lower(),
    )


def require_app(config: JobfenceSettings) -> str:
    """The ``APP`` setting, which the worker needs."""
    if config.app is None:
        raise _problem("APP is not set: name your jobfence.App as 'MODULE:ATTRIBUTE'")
    return config.app


def database_url(alias: str | None = None) -> str:
    """The libpq connection string of ``DATABASES[alias]`` (default: ``DATABASE_ALIAS``), as
    Django's own connections use it; it holds the password: never print it (``jobfence.redact.
    redact_url``)."""
    alias = jobfence_settings().database_alias if alias is None else alias
    params = connections[alias].get_connection_params()
    for key in _NOT_LIBPQ:
        params.pop(key, None)
    return make_conninfo("", **{k: v for k, v in params.items() if v is not None})
