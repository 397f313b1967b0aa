"""Alerting configuration (read from the environment in one place) and its command-line edges:
``jobfence alert-relay`` refuses to start without a token, ``jobfence cleanup`` sends its
heartbeat, and no secret (token, heartbeat URL) shows in a repr, a message or a log line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pytest

from alert_helpers import TOKEN, relay_env
from fake_betterstack import FakeBetterStack
from jobfence import ConfigError
from jobfence.adapters.betterstack import BetterStackSettings, parse_retry_after
from jobfence.alerts import AlertRelay
from jobfence.config import alert_config_from_env


def test_alert_config_defaults() -> None:
    config = alert_config_from_env({})
    assert config.api_url == "https://uptime.betterstack.com"
    assert config.token is None
    assert config.notify == {"email", "push"}
    assert config.group_window_seconds == 60.0
    assert config.escalate_after_seconds == 72 * 3600.0
    assert config.timeout_seconds == 10.0
    assert (config.requester_email, config.team_name, config.policy_id, config.team_wait) == (
        None,
        None,
        None,
        None,
    )
    assert config.relay_heartbeat_url is None
    assert config.cleanup_heartbeat_url is None
    assert config.allow_http is False
    assert (config.state_max_age_seconds, config.update_interval_seconds) == (60.0, 600.0)
    assert config.delivery_bound_seconds == 600.0


def test_alert_config_reads_every_variable() -> None:
    config = alert_config_from_env(
        {
            "JOBFENCE_BETTERSTACK_API_URL": "http://127.0.0.1:9999",
            "JOBFENCE_BETTERSTACK_TOKEN": "tok",
            "JOBFENCE_BETTERSTACK_REQUESTER_EMAIL": "oncall@example.com",
            "JOBFENCE_BETTERSTACK_TEAM_NAME": "Platform",
            "JOBFENCE_BETTERSTACK_POLICY_ID": "42",
            "JOBFENCE_BETTERSTACK_TEAM_WAIT": "600",
            "JOBFENCE_BETTERSTACK_NOTIFY": "call, SMS",
            "JOBFENCE_BETTERSTACK_TIMEOUT": "5s",
            "JOBFENCE_BETTERSTACK_RELAY_HEARTBEAT_URL": "https://hb.example/relay",
            "JOBFENCE_BETTERSTACK_CLEANUP_HEARTBEAT_URL": "https://hb.example/cleanup",
            "JOBFENCE_ALERT_GROUP_WINDOW": "2m",
            "JOBFENCE_ALERT_ESCALATE_AFTER": "3d",
            "JOBFENCE_BETTERSTACK_ALLOW_HTTP": "1",
            "JOBFENCE_ALERT_STATE_MAX_AGE": "30s",
            "JOBFENCE_ALERT_UPDATE_INTERVAL": "5m",
            "JOBFENCE_ALERT_DELIVERY_BOUND": "20m",
        }
    )
    assert config.api_url == "http://127.0.0.1:9999"
    assert config.token == "tok"
    assert config.requester_email == "oncall@example.com"
    assert (config.team_name, config.policy_id, config.team_wait) == ("Platform", "42", 600)
    assert config.notify == {"call", "sms"}
    assert config.timeout_seconds == 5.0
    assert config.group_window_seconds == 120.0
    assert config.escalate_after_seconds == 3 * 86400.0
    assert config.relay_heartbeat_url == "https://hb.example/relay"
    assert config.cleanup_heartbeat_url == "https://hb.example/cleanup"
    assert config.allow_http is True
    assert (config.state_max_age_seconds, config.update_interval_seconds) == (30.0, 300.0)
    assert config.delivery_bound_seconds == 1200.0
    assert (
        alert_config_from_env({"JOBFENCE_ALERT_ESCALATE_AFTER": "off"}).escalate_after_seconds
        is None
    )
    assert alert_config_from_env({"JOBFENCE_BETTERSTACK_NOTIFY": "none"}).notify == frozenset()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("JOBFENCE_BETTERSTACK_API_URL", "uptime.betterstack.com"),
        ("JOBFENCE_BETTERSTACK_NOTIFY", "email,pager"),
        ("JOBFENCE_BETTERSTACK_TEAM_WAIT", "ten"),
        ("JOBFENCE_BETTERSTACK_TIMEOUT", "0"),
        ("JOBFENCE_ALERT_GROUP_WINDOW", "-5"),
        ("JOBFENCE_ALERT_ESCALATE_AFTER", "72 hours"),
        ("JOBFENCE_ALERT_STATE_MAX_AGE", "0"),
        ("JOBFENCE_ALERT_UPDATE_INTERVAL", "often"),
        ("JOBFENCE_ALERT_DELIVERY_BOUND", "-1m"),
        # a digit int() cannot read (str.isdigit() says yes): a traceback before
        ("JOBFENCE_BETTERSTACK_TEAM_WAIT", "\u00b2"),
        # someone's "never": past what the database can date, the relay looped on errors
        ("JOBFENCE_ALERT_ESCALATE_AFTER", "99999999d"),
        ("JOBFENCE_ALERT_INCIDENT_PERIOD", "99999999d"),
        ("JOBFENCE_ALERT_GROUP_WINDOW", "999999999d"),
    ],
)
def test_alert_config_refuses_a_bad_value_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        alert_config_from_env({name: value})


def test_a_duration_flag_past_what_the_database_can_date_is_refused_as_a_bad_argument() -> None:
    """``--incident-period 99999999d``: refused before anything runs (exit status 2, the usage
    line), where the relay started and then failed every round in SQL, never paging."""
    done = subprocess.run(
        [sys.executable, "-m", "jobfence.cli", "alert-relay", "--incident-period", "99999999d"],
        env={**os.environ, "JOBFENCE_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines()[-1] == (
        "jobfence alert-relay: error: argument --incident-period: the duration must be a"
        " positive duration of at most 3,650 days, such as 90, 90s, 15m, 72h or 3d, got"
        " '99999999d'"
    )


def test_secrets_stay_out_of_reprs() -> None:
    config = alert_config_from_env(
        {
            "JOBFENCE_BETTERSTACK_TOKEN": "tok-secret-1",
            "JOBFENCE_BETTERSTACK_RELAY_HEARTBEAT_URL": "https://hb.example/hb-secret-2",
            "JOBFENCE_BETTERSTACK_CLEANUP_HEARTBEAT_URL": "https://hb.example/hb-secret-3",
        }
    )
    for text in (repr(config), repr(BetterStackSettings(token="tok-secret-1"))):
        for secret in ("tok-secret-1", "hb-secret-2", "hb-secret-3"):
            assert secret not in text


def test_retry_after_is_read_as_seconds_or_as_an_http_date() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    now = datetime(2026, 8, 17, 12, 0, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(later, now=now.timestamp()) == pytest.approx(30.0)
    earlier = format_datetime(now - timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(earlier, now=now.timestamp()) == 0.0


def test_alert_relay_without_a_token_is_refused_in_one_line(
    database_url: str, server: FakeBetterStack
) -> None:
    env = relay_env(database_url, server)
    del env["JOBFENCE_BETTERSTACK_TOKEN"]
    result = subprocess.run(
        [sys.executable, "-m", "jobfence.cli", "alert-relay"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "jobfence: error: JOBFENCE_BETTERSTACK_TOKEN is not set: the alert relay needs a "
        "Better Stack Uptime API token"
    )
    assert server.requests == []


def test_cleanup_sends_its_heartbeat_after_a_successful_run_without_logging_the_url(
    database_url: str, server: FakeBetterStack
) -> None:
    url = server.heartbeat_url("cleanup")
    env = relay_env(database_url, server, JOBFENCE_BETTERSTACK_CLEANUP_HEARTBEAT_URL=url)
    result = subprocess.run(
        [sys.executable, "-m", "jobfence.cli", "-v", "cleanup"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert [(b.method, b.path) for b in server.heartbeats] == [
        ("GET", "/api/v1/heartbeat/cleanup-secret-token")
    ]
    assert "cleanup-secret-token" not in result.stdout + result.stderr


def run_relay(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", "alert-relay"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_alert_relay_with_a_token_but_no_requester_email_is_refused_at_start_up(
    database_url: str, server: FakeBetterStack
) -> None:
    env = relay_env(database_url, server)
    del env["JOBFENCE_BETTERSTACK_REQUESTER_EMAIL"]
    result = run_relay(env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "jobfence: error: JOBFENCE_BETTERSTACK_REQUESTER_EMAIL is not set: with a token, "
        "Better Stack needs the e-mail of the person the relay's incidents are opened for "
        "(requester_email)"
    )
    assert server.requests == []


def test_alert_relay_refuses_plain_http_to_a_non_loopback_host_unless_allowed(
    database_url: str, server: FakeBetterStack, tmp_path: Path
) -> None:
    env = relay_env(
        database_url, server, JOBFENCE_BETTERSTACK_API_URL="http://betterstack.example.com"
    )
    result = run_relay(env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "jobfence: error: JOBFENCE_BETTERSTACK_API_URL is plain http:// to "
        "betterstack.example.com: the token would travel in clear text. Use https://, or set "
        "JOBFENCE_BETTERSTACK_ALLOW_HTTP=1 if the network in between is trusted"
    )
    assert TOKEN not in result.stdout + result.stderr

    # Allowed explicitly, it starts (and, with nothing to deliver, sends nothing).
    env["JOBFENCE_BETTERSTACK_ALLOW_HTTP"] = "1"
    log = tmp_path / "relay.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jobfence.cli", "alert-relay", "--poll-seconds", "0.05"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while "alert relay active" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        assert "alert relay active" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


async def test_an_http_loopback_api_url_needs_no_permission() -> None:
    config = alert_config_from_env(
        {
            "JOBFENCE_BETTERSTACK_TOKEN": "tok",
            "JOBFENCE_BETTERSTACK_REQUESTER_EMAIL": "oncall@example.com",
            "JOBFENCE_BETTERSTACK_API_URL": "http://127.0.0.1:9",
        }
    )
    relay = AlertRelay.from_config("postgresql://unused", config)
    await relay.aclose()
    assert relay.settings.lost_answer_wait_seconds == 10.0 + 5.0, "timeout plus the margin"
    with pytest.raises(ConfigError, match="JOBFENCE_BETTERSTACK_ALLOW_HTTP must be 1 or 0"):
        alert_config_from_env({"JOBFENCE_BETTERSTACK_ALLOW_HTTP": "maybe"})


@pytest.mark.parametrize(
    ("token", "message"),
    [
        pytest.param("   ", "is blank", id="blank"),
        pytest.param(TOKEN + "\n", "contains a space, a line break", id="final-newline"),
        pytest.param("tok en-secret-9", "contains a space, a line break", id="inner-space"),
    ],
)
def test_alert_relay_refuses_a_token_that_cannot_be_one_naming_the_variable(
    database_url: str, server: FakeBetterStack, token: str, message: str
) -> None:
    env = relay_env(database_url, server, JOBFENCE_BETTERSTACK_TOKEN=token)
    result = run_relay(env)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"jobfence: error: JOBFENCE_BETTERSTACK_TOKEN {message}"), last
    assert (token.strip() or token) not in result.stdout + result.stderr.replace(
        "JOBFENCE_BETTERSTACK_TOKEN", ""
    )
    assert server.requests == []


def test_alert_relay_flags_override_the_bound_variables(
    database_url: str, server: FakeBetterStack, tmp_path: Path
) -> None:
    env = relay_env(
        database_url,
        server,
        JOBFENCE_ALERT_MAX_NEW_INCIDENTS="7",
        JOBFENCE_ALERT_MAX_ERROR_CLASSES="4",
        JOBFENCE_ALERT_INCIDENT_PERIOD="5m",
    )
    log = tmp_path / "relay.log"
    args = ["--poll-seconds", "0.05", "--max-new-incidents", "2", "--incident-period", "1h"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jobfence.cli", "alert-relay", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while "alert relay active" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = log.read_text()
    assert "at most 2 new incidents per 1h, 4 error classes per consumer" in text, text
    assert "escalated 0, storms 0" in text
    bad = run_relay({**env, "JOBFENCE_ALERT_MAX_NEW_INCIDENTS": "many"})
    assert bad.returncode == 2
    assert "JOBFENCE_ALERT_MAX_NEW_INCIDENTS must be a whole number" in bad.stderr
