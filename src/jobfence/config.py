"""Environment variables, read in one place with one prefix, only when asked (never at import)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ENV_DATABASE_URL = "JOBFENCE_DATABASE_URL"
ENV_EMBEDDED_DIR = "JOBFENCE_EMBEDDED_DIR"
DEFAULT_EMBEDDED_DIR = Path(".jobfence") / "pgdata"


def database_url_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The configured libpq URL, or None when jobfence should use its embedded PostgreSQL."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_DATABASE_URL, "").strip()
    return value or None


def embedded_dir_from_env(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    value = env.get(ENV_EMBEDDED_DIR, "").strip()
    return Path(value) if value else DEFAULT_EMBEDDED_DIR
