"""Environment variables, read in one place with one prefix, only when asked (never at import)."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from jobfence.errors import ConfigError
from jobfence.limits import MAX_DELAY_DAYS, MAX_DELAY_SECONDS
from jobfence.redact import url_secrets

ENV_DATABASE_URL = "JOBFENCE_DATABASE_URL"
ENV_EMBEDDED_DIR = "JOBFENCE_EMBEDDED_DIR"
DEFAULT_EMBEDDED_DIR = Path(".jobfence") / "pgdata"
# The one value of JOBFENCE_DATABASE_URL that asks for the embedded PostgreSQL (pgserver).
EMBEDDED = "embedded"
EXAMPLE_DATABASE_URL = "postgresql://user@127.0.0.1:5432/dbname"


# How JOBFENCE_DATABASE_URL reaches PostgreSQL when a connection pooler (PgBouncer) sits in
# between: its pool mode. Unset: PostgreSQL directly (a pooler found at start-up is refused).
ENV_DATABASE_POOL_MODE = "JOBFENCE_DATABASE_POOL_MODE"
POOL_MODE_SESSION = "session"
POOL_MODE_TRANSACTION = "transaction"
POOL_MODES = (POOL_MODE_SESSION, POOL_MODE_TRANSACTION)


def database_pool_mode_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """JOBFENCE_DATABASE_POOL_MODE: ``session`` or ``transaction`` (any case), None when unset
    or blank; anything else is a :class:`ConfigError`."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_DATABASE_POOL_MODE, "").strip().lower()
    if not value:
        return None
    if value not in POOL_MODES:
        raise ConfigError(
            f"{ENV_DATABASE_POOL_MODE} must be {' or '.join(POOL_MODES)} (the pool mode of the"
            f" PgBouncer that {ENV_DATABASE_URL} goes through), or unset for PostgreSQL directly"
        )
    return value


# The queue (``jobfence.queues``): unset for the PostgreSQL queue, else a broker's URL.
ENV_QUEUE_URL = "JOBFENCE_QUEUE_URL"


def database_url_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The value of JOBFENCE_DATABASE_URL (a libpq URL, or ``embedded``), or None when it is
    unset or blank."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_DATABASE_URL, "").strip()
    return value or None


def is_embedded(value: str) -> bool:
    """Whether a JOBFENCE_DATABASE_URL value asks for the embedded PostgreSQL."""
    return value.strip().lower() == EMBEDDED


# Words that make a JOBFENCE_* variable look like an attempt at JOBFENCE_DATABASE_URL.
_DATABASE_WORDS = frozenset({"DATABASE", "DB", "DSN", "POSTGRES", "POSTGRESQL", "PG", "PGURL"})


def similar_database_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The names (never the values: they may hold a password) of set variables that look like
    a misspelt JOBFENCE_DATABASE_URL: ``DATABASE_URL``, the name in another case, and any
    ``JOBFENCE_*`` name close to it (``JOBFENCE_DATABASE_URI``, ``JOBFENCE_DB_URL``...)."""
    env = os.environ if environ is None else environ
    found = []
    for name, value in env.items():
        if name == ENV_DATABASE_URL or not value.strip():
            continue
        upper = name.strip().upper()
        close = upper.startswith("JOBFENCE_") and (
            difflib.SequenceMatcher(None, upper, ENV_DATABASE_URL).ratio() >= 0.8
            or not _DATABASE_WORDS.isdisjoint(re.split(r"[^A-Z0-9]+", upper[9:]))
        )
        if close or upper in (ENV_DATABASE_URL, "DATABASE_URL"):
            found.append(name)
    return sorted(found)


def missing_database_url_message(environ: Mapping[str, str] | None = None) -> str:
    """What to say when JOBFENCE_DATABASE_URL is unset or blank: its name, an example, the
    embedded choice, and the similarly named variables that are set (by name only)."""
    env = os.environ if environ is None else environ
    state = "is empty" if ENV_DATABASE_URL in env else "is not set"
    similar = similar_database_variables(env)
    hints = (
        f" ({' and '.join(similar)} {'is' if len(similar) == 1 else 'are'} set: "
        f"did you mean {ENV_DATABASE_URL}?)"
        if similar
        else ""
    )
    return (
        f"{ENV_DATABASE_URL} {state}{hints}; every command but demo needs it: set it to your "
        f"database, e.g. {ENV_DATABASE_URL}={EXAMPLE_DATABASE_URL} "
        f"(or {ENV_DATABASE_URL}={EMBEDDED} for a local embedded PostgreSQL)"
    )


def embedded_dir_from_env(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    value = env.get(ENV_EMBEDDED_DIR, "").strip()
    return Path(value) if value else DEFAULT_EMBEDDED_DIR


# The Ops management API (``jobfence api``): how bearer tokens are verified (D9).
ENV_JWT_SECRET = "JOBFENCE_JWT_SECRET"
ENV_JWT_PUBLIC_KEY = "JOBFENCE_JWT_PUBLIC_KEY"
ENV_JWT_ISSUER = "JOBFENCE_JWT_ISSUER"
ENV_JWT_AUDIENCE = "JOBFENCE_JWT_AUDIENCE"


def _optional(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def jwt_secret_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The HS256 shared secret that verifies API tokens, or None. Never logged or echoed."""
    env = os.environ if environ is None else environ
    # Taken as written (not stripped): whitespace may be part of a secret.
    return env.get(ENV_JWT_SECRET) or None


def jwt_public_key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The PEM public key (RS256 or ES256) that verifies API tokens, or None.

    The value is the PEM text itself (its line breaks may be written ``\\n``, as on one line of
    a ``.env`` file), or the path of a file holding it.
    """
    env = os.environ if environ is None else environ
    value = _optional(env, ENV_JWT_PUBLIC_KEY)
    if value is None:
        return None
    if value.startswith("-----BEGIN"):
        return value if "\n" in value else value.replace("\\n", "\n")
    try:
        return Path(value).read_text()
    except OSError as exc:
        raise ConfigError(
            f"{ENV_JWT_PUBLIC_KEY} is neither PEM text nor a readable file "
            f"({type(exc).__name__}: {exc.strerror or exc})"
        ) from None


def jwt_issuer_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``iss`` every API token must carry, or None to accept any issuer."""
    return _optional(os.environ if environ is None else environ, ENV_JWT_ISSUER)


def jwt_audience_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``aud`` every API token must name, or None not to check the audience."""
    return _optional(os.environ if environ is None else environ, ENV_JWT_AUDIENCE)


def _choice_from_env(environ: Mapping[str, str] | None, name: str, choices: tuple[str, ...]) -> str:
    """The variable's value, case-insensitive, one of ``choices`` (unset or empty: the first)."""
    env = os.environ if environ is None else environ
    value = env.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


# The event loop of every command: uvloop where it is installed, unless told otherwise.
ENV_EVENT_LOOP = "JOBFENCE_EVENT_LOOP"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def event_loop_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``auto`` (the default: uvloop where it is installed), ``uvloop`` or ``asyncio``."""
    return _choice_from_env(environ, ENV_EVENT_LOOP, EVENT_LOOPS)


# Logs (``jobfence --log-format``): text for people, json for log pipelines.
ENV_LOG_FORMAT = "JOBFENCE_LOG_FORMAT"
LOG_FORMATS = ("text", "json")


def log_format_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``text`` (the default) or ``json``."""
    return _choice_from_env(environ, ENV_LOG_FORMAT, LOG_FORMATS)


def secrets_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values that must never appear in a log line: every ``JOBFENCE_*`` variable whose name
    says TOKEN, SECRET or PASSWORD (``JOBFENCE_BETTERSTACK_TOKEN``, ``JOBFENCE_JWT_SECRET``...),
    the ``JOBFENCE_*_HEARTBEAT_URL`` values (the URL carries the heartbeat's token),
    ``PGPASSWORD``, and the secrets in ``JOBFENCE_DATABASE_URL`` and ``JOBFENCE_QUEUE_URL``
    (passwords, tokens, secret query parameters) in every form they may be echoed in
    (:func:`jobfence.redact.url_secrets`)."""
    env = os.environ if environ is None else environ
    found = [
        value
        for name, value in env.items()
        if value
        and (
            name == "PGPASSWORD"
            or (name.startswith("JOBFENCE_") and name.endswith("_HEARTBEAT_URL"))
            or (
                name.startswith("JOBFENCE_")
                and any(word in name for word in ("TOKEN", "SECRET", "PASSWORD"))
            )
        )
    ]
    url = database_url_from_env(env)
    if url is not None:
        found.extend(url_secrets(url))
    queue_url = env.get(ENV_QUEUE_URL, "").strip()
    if queue_url:
        found.extend(url_secrets(queue_url))
    return found


# Better Stack alerting (``jobfence alert-relay``) and the heartbeats of the relay and cleanup.
ENV_BETTERSTACK_API_URL = "JOBFENCE_BETTERSTACK_API_URL"
ENV_BETTERSTACK_TOKEN = "JOBFENCE_BETTERSTACK_TOKEN"
ENV_BETTERSTACK_REQUESTER_EMAIL = "JOBFENCE_BETTERSTACK_REQUESTER_EMAIL"
ENV_BETTERSTACK_TEAM_NAME = "JOBFENCE_BETTERSTACK_TEAM_NAME"
ENV_BETTERSTACK_POLICY_ID = "JOBFENCE_BETTERSTACK_POLICY_ID"
ENV_BETTERSTACK_TEAM_WAIT = "JOBFENCE_BETTERSTACK_TEAM_WAIT"
ENV_BETTERSTACK_NOTIFY = "JOBFENCE_BETTERSTACK_NOTIFY"
ENV_BETTERSTACK_TIMEOUT = "JOBFENCE_BETTERSTACK_TIMEOUT"
ENV_RELAY_HEARTBEAT_URL = "JOBFENCE_BETTERSTACK_RELAY_HEARTBEAT_URL"
ENV_CLEANUP_HEARTBEAT_URL = "JOBFENCE_BETTERSTACK_CLEANUP_HEARTBEAT_URL"
ENV_ALERT_GROUP_WINDOW = "JOBFENCE_ALERT_GROUP_WINDOW"
ENV_ALERT_ESCALATE_AFTER = "JOBFENCE_ALERT_ESCALATE_AFTER"
ENV_BETTERSTACK_ALLOW_HTTP = "JOBFENCE_BETTERSTACK_ALLOW_HTTP"
ENV_ALERT_STATE_MAX_AGE = "JOBFENCE_ALERT_STATE_MAX_AGE"
ENV_ALERT_UPDATE_INTERVAL = "JOBFENCE_ALERT_UPDATE_INTERVAL"
ENV_ALERT_DELIVERY_BOUND = "JOBFENCE_ALERT_DELIVERY_BOUND"
ENV_ALERT_MAX_ERROR_CLASSES = "JOBFENCE_ALERT_MAX_ERROR_CLASSES"
ENV_ALERT_MAX_NEW_INCIDENTS = "JOBFENCE_ALERT_MAX_NEW_INCIDENTS"
ENV_ALERT_INCIDENT_PERIOD = "JOBFENCE_ALERT_INCIDENT_PERIOD"
DEFAULT_BETTERSTACK_API_URL = "https://uptime.betterstack.com"
NOTIFY_CHANNELS = ("call", "sms", "email", "push")
DEFAULT_NOTIFY = frozenset({"email", "push"})
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True, slots=True)
class AlertConfig:
    """Better Stack alerting as configured in the environment. Secrets (the token, the
    heartbeat URLs, which hold a token of their own) are left out of ``repr``."""

    api_url: str
    token: str | None = field(repr=False)
    requester_email: str | None
    team_name: str | None
    policy_id: str | None
    team_wait: int | None
    notify: frozenset[str]
    timeout_seconds: float
    group_window_seconds: float
    escalate_after_seconds: float | None
    relay_heartbeat_url: str | None = field(repr=False)
    cleanup_heartbeat_url: str | None = field(repr=False)
    allow_http: bool = False
    state_max_age_seconds: float = 60.0
    update_interval_seconds: float = 600.0
    delivery_bound_seconds: float = 600.0
    max_error_classes: int = 5
    max_new_incidents: int = 10
    incident_period_seconds: float = 600.0


def _count_or(env: Mapping[str, str], name: str, default: int) -> int:
    """A whole number from 1 to 1,000,000 (unset: ``default``)."""
    text = _optional(env, name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 1_000_000:
        raise ConfigError(f"{name} must be a whole number from 1 to 1000000, got {text!r}")
    return int(text)


def parse_duration(text: str, *, name: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``72h`` or ``3d``; positive, and at most 3,650
    days (past that, the database cannot date what the duration counts to)."""
    match = _DURATION.match(text.strip().lower())
    seconds = float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
    if not 0 < seconds <= MAX_DELAY_SECONDS:
        raise ConfigError(
            f"{name} must be a positive duration of at most {MAX_DELAY_DAYS:,} days, such as"
            f" 90, 90s, 15m, 72h or 3d, got {text!r}"
        )
    return seconds


def _duration_or(env: Mapping[str, str], name: str, default: float) -> float:
    text = _optional(env, name)
    return parse_duration(text, name=name) if text else default


def _flag(env: Mapping[str, str], name: str) -> bool:
    text = (_optional(env, name) or "0").lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise ConfigError(f"{name} must be 1 or 0, got {text!r}")


def cleanup_heartbeat_url_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The cleanup's Better Stack heartbeat URL, or None (it holds a secret: never logged)."""
    return _optional(os.environ if environ is None else environ, ENV_CLEANUP_HEARTBEAT_URL)


def betterstack_allow_http_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """JOBFENCE_BETTERSTACK_ALLOW_HTTP: whether plain http:// to a host that is not loopback is
    allowed for the Better Stack API and heartbeat URLs (a trusted network)."""
    return _flag(os.environ if environ is None else environ, ENV_BETTERSTACK_ALLOW_HTTP)


def alert_config_from_env(environ: Mapping[str, str] | None = None) -> AlertConfig:
    """Read the Better Stack settings (all optional here; the relay requires the token).

    ``JOBFENCE_BETTERSTACK_NOTIFY`` lists the channels among call, sms, email, push (default
    ``email,push``; ``none`` for none). ``JOBFENCE_ALERT_GROUP_WINDOW`` defaults to 60s,
    ``JOBFENCE_ALERT_ESCALATE_AFTER`` to 72h (``off`` disables escalation, D4).
    """
    env = os.environ if environ is None else environ
    api_url = _optional(env, ENV_BETTERSTACK_API_URL) or DEFAULT_BETTERSTACK_API_URL
    if not re.match(r"^https?://[^/?#\s]+", api_url):
        raise ConfigError(
            f"{ENV_BETTERSTACK_API_URL} must be an http(s) URL such as "
            f"{DEFAULT_BETTERSTACK_API_URL}"
        )
    notify_text = (_optional(env, ENV_BETTERSTACK_NOTIFY) or "").lower()
    if not notify_text:
        notify = DEFAULT_NOTIFY
    elif notify_text == "none":
        notify = frozenset()
    else:
        notify = frozenset(part.strip() for part in notify_text.split(",") if part.strip())
        unknown = sorted(notify - set(NOTIFY_CHANNELS))
        if unknown:
            raise ConfigError(
                f"{ENV_BETTERSTACK_NOTIFY} lists unknown channel(s) {', '.join(unknown)}; "
                f"use a comma-separated subset of {', '.join(NOTIFY_CHANNELS)}, or none"
            )
    team_wait_text = _optional(env, ENV_BETTERSTACK_TEAM_WAIT)
    team_wait = None
    if team_wait_text is not None:
        if not (team_wait_text.isascii() and team_wait_text.isdigit()):
            raise ConfigError(
                f"{ENV_BETTERSTACK_TEAM_WAIT} must be a whole number of seconds, "
                f"got {team_wait_text!r}"
            )
        team_wait = int(team_wait_text)
    timeout_text = _optional(env, ENV_BETTERSTACK_TIMEOUT)
    window_text = _optional(env, ENV_ALERT_GROUP_WINDOW)
    escalate_text = _optional(env, ENV_ALERT_ESCALATE_AFTER)
    escalate_after: float | None = 72 * 3600.0
    if escalate_text is not None:
        escalate_after = (
            None
            if escalate_text.lower() in ("off", "never", "none")
            else parse_duration(escalate_text, name=ENV_ALERT_ESCALATE_AFTER)
        )
    return AlertConfig(
        api_url=api_url,
        # Taken as written (not stripped), like the JWT secret.
        token=env.get(ENV_BETTERSTACK_TOKEN) or None,
        requester_email=_optional(env, ENV_BETTERSTACK_REQUESTER_EMAIL),
        team_name=_optional(env, ENV_BETTERSTACK_TEAM_NAME),
        policy_id=_optional(env, ENV_BETTERSTACK_POLICY_ID),
        team_wait=team_wait,
        notify=notify,
        timeout_seconds=(
            parse_duration(timeout_text, name=ENV_BETTERSTACK_TIMEOUT) if timeout_text else 10.0
        ),
        group_window_seconds=(
            parse_duration(window_text, name=ENV_ALERT_GROUP_WINDOW) if window_text else 60.0
        ),
        escalate_after_seconds=escalate_after,
        relay_heartbeat_url=_optional(env, ENV_RELAY_HEARTBEAT_URL),
        cleanup_heartbeat_url=cleanup_heartbeat_url_from_env(env),
        allow_http=_flag(env, ENV_BETTERSTACK_ALLOW_HTTP),
        state_max_age_seconds=_duration_or(env, ENV_ALERT_STATE_MAX_AGE, 60.0),
        update_interval_seconds=_duration_or(env, ENV_ALERT_UPDATE_INTERVAL, 600.0),
        delivery_bound_seconds=_duration_or(env, ENV_ALERT_DELIVERY_BOUND, 600.0),
        max_error_classes=_count_or(env, ENV_ALERT_MAX_ERROR_CLASSES, 5),
        max_new_incidents=_count_or(env, ENV_ALERT_MAX_NEW_INCIDENTS, 10),
        incident_period_seconds=_duration_or(env, ENV_ALERT_INCIDENT_PERIOD, 600.0),
    )
