"""Queue URLs as every command reads them (``JOBFENCE_QUEUE_URL`` / ``--queue-url``): a NATS seed
list, the adapters' production settings as query parameters, each refused with one line naming
the parameter when it is unknown or out of range, and the password hidden in every refusal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import psycopg
import pytest

from jobfence.adapters.nats import NatsQueue
from jobfence.adapters.rabbitmq import RabbitMQQueue
from jobfence.adapters.redis_streams import RedisStreamsQueue
from jobfence.config import secrets_from_env
from jobfence.errors import ConfigError
from jobfence.outbox import queue_setting
from jobfence.queues import BrokerSettings, open_queue, parse_queue_url
from nats_servers import free_port
from support import run_jobfence, wait_until

PASSWORD = "pa55-w0rd"
TESTS_DIR = Path(__file__).parent


# -- what a URL says -------------------------------------------------------------------------


def test_every_seeds_password_is_kept_out_of_the_log_lines() -> None:
    url = "nats://app:first-s3cret@a:4222,nats://app:second%2Fs3cret@b:4222?replicas=3"
    secrets = secrets_from_env({"JOBFENCE_QUEUE_URL": url})
    assert {"first-s3cret", "second%2Fs3cret", "second/s3cret"} <= set(secrets)


def test_a_password_with_a_comma_is_hidden_whole_outside_a_seed_list() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_queue_url("amqp://app:pa,ss-w0rd@rabbit/?prefetch=0")
    assert "pa,ss-w0rd" not in str(refused.value)
    assert "'amqp://app:***@rabbit/?prefetch=0'" in str(refused.value)


def test_a_nats_seed_list_names_every_server_and_hides_each_password() -> None:
    target = parse_queue_url(
        f"nats://app:{PASSWORD}@Nats-1:4222, nats://app:other-{PASSWORD}@nats-2:4223,nats://nats-3"
    )
    assert target.kind == "nats"
    assert target.hosts == ("nats-1:4222", "nats-2:4223", "nats-3:4222")
    assert target.location == "nats://nats-1:4222,nats://nats-2:4223,nats://nats-3"
    assert target.client_url is not None and target.client_url.count("nats://") == 3
    assert PASSWORD not in repr(target)
    with pytest.raises(ConfigError) as refused:
        parse_queue_url(
            f"nats://app:{PASSWORD}@a:4222,nats://app:second-{PASSWORD}@b:4222?replicas=9"
        )
    assert PASSWORD not in str(refused.value)
    assert "second" not in str(refused.value)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("nats://a:4222,nats://b:4222,nats://c:4222?replicas=3", BrokerSettings(replicas=3)),
        ("nats://a?replicas=1", BrokerSettings(replicas=1)),
        ("nats://a?replicas=5", BrokerSettings(replicas=5)),
        ("nats://a?stream_wait=1", BrokerSettings(stream_wait=1)),
        ("nats://a?replicas=3&stream_wait=35", BrokerSettings(replicas=3, stream_wait=35)),
        (
            "nats://a?stream=ORDERS_1&subject_prefix=app.jobs",
            BrokerSettings(stream="ORDERS_1", subject_prefix="app.jobs"),
        ),
        (
            "amqp://u:p@rabbit/?prefix=app.jobs:v2&prefetch=1",
            BrokerSettings(prefix="app.jobs:v2", prefetch=1),
        ),
        ("amqps://rabbit/vh?prefetch=65535&heartbeat=30", BrokerSettings(prefetch=65535)),
        (
            "redis://:p@redis:6379/3?prefix=app-jobs&socket_timeout=5",
            BrokerSettings(prefix="app-jobs"),
        ),
        ("rediss://redis/0", BrokerSettings()),
    ],
)
def test_every_url_parameter_is_accepted_within_its_range(
    url: str, expected: BrokerSettings
) -> None:
    assert parse_queue_url(url).settings == expected


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("nats://a?replicas=0", "'replicas' must be an integer from 1 to 5, got '0'"),
        ("nats://a?replicas=6", "'replicas' must be an integer from 1 to 5, got '6'"),
        ("nats://a?replicas=three", "'replicas' must be an integer from 1 to 5, got 'three'"),
        ("nats://a?replicas=-1", "'replicas' must be an integer from 1 to 5"),
        ("nats://a?replicas=", "'replicas' must be an integer from 1 to 5, got ''"),
        ("nats://a?replicas=1e3", "'replicas' must be an integer"),
        ("nats://a?stream_wait=0", "'stream_wait' must be a whole number of seconds from 1 to 35"),
        ("nats://a?stream_wait=36", "'stream_wait' must be a whole number of seconds from 1 to 35"),
        ("nats://a?stream_wait=2.5", "'stream_wait' must be a whole number of seconds"),
        ("redis://r?stream_wait=5", "unknown parameter 'stream_wait' for a redis queue URL"),
        ("nats://a?stream=a.b", "'stream' must be 1 to 200 letters, digits, _ or -"),
        ("nats://a?subject_prefix=a..b", "'subject_prefix' must be dot-separated tokens"),
        ("nats://a?subject_prefix=a.>", "'subject_prefix' must be dot-separated tokens"),
        ("nats://a?prefix=x", "unknown parameter 'prefix' for a nats queue URL"),
        ("nats://a?prefetch=10", "unknown parameter 'prefetch' for a nats queue URL"),
        ("amqp://h/?prefetch=0", "'prefetch' must be an integer from 1 to 65535, got '0'"),
        ("amqp://h/?prefetch=65536", "'prefetch' must be an integer from 1 to 65535"),
        ("amqp://h/?prefix=a%20b", "'prefix' must be 1 to 200 letters, digits, _ . - or :"),
        ("amqp://h/?replicas=3", "unknown parameter 'replicas' for a rabbitmq queue URL"),
        ("amqp://h/?max_deliveries=3", "unknown parameter 'max_deliveries'"),
        ("redis://h/0?prefix=a{b}", "'prefix' must be 1 to 200 characters, no braces"),
        ("redis://h/0?db=3", "the Redis database number goes in the path"),
        ("redis://h/x", "the path is the Redis database number"),
        ("nats://a?replicas=3&replicas=1", "the parameter 'replicas' is given twice"),
        ("nats://a?replicas", "the query is not name=value pairs"),
        ("nats://a?replicas=3,nats://b", "the parameters go once, after the last server"),
        ("redis://a,redis://b", "a list of servers separated by commas is for nats:// only"),
        ("amqp://a,amqp://b", "a list of servers separated by commas is for nats:// only"),
        ("nats://a,redis://b", "each server of the list must be a nats:// URL"),
        ("nats://a,,nats://b", "each server of the list must be a nats:// URL"),
        ("nats://:4222", "no host"),
        ("nats://a:70000", "not a valid URL"),
        ("nats://a:port", "not a valid URL"),
        ("nats://a/x", "a nats:// URL has no path"),
        ("nats://a#frag", "a queue URL has no #fragment"),
    ],
)
def test_a_bad_url_parameter_or_server_is_refused_naming_it(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_queue_url(url)
    assert says in str(refused.value)
    assert str(refused.value).startswith("JOBFENCE_QUEUE_URL: ")


@pytest.mark.parametrize(
    "url",
    [
        # a seed list whose second server has another scheme, or lost its scheme
        f"nats://a:pw1@h1:4222,redis://b:{PASSWORD}@h2:4222",
        f"nats://a:pw1@h1:4222,b:{PASSWORD}@h2:4222",
        # a password written with / unescaped: urllib reads its first part as the port
        f"redis://u:{PASSWORD}/x@redis.internal:6379/0",
    ],
    ids=["seed-list-other-scheme", "seed-list-no-scheme", "slash-in-password"],
)
def test_a_refused_queue_url_quotes_no_password_in_its_reason(url: str, database_url: str) -> None:
    """The refusal's reason may quote a piece of the URL (a server of the list, urllib's own
    error): the password is hidden there too, and from the command that takes the URL of the
    broker a move leaves (``--from-queue-url``, not an environment variable)."""
    with pytest.raises(ConfigError) as refused:
        parse_queue_url(url)
    assert PASSWORD not in str(refused.value), refused.value
    done = run_jobfence(
        database_url, "migrate", "--queue-url", "postgresql", "--from-queue-url", url
    )
    assert done.returncode == 2, done
    assert done.stderr.startswith("jobfence: error: "), done.stderr
    assert PASSWORD not in done.stdout + done.stderr, done.stderr


# A token or password written unescaped with a ':' and a '[' in it: no URL parser takes it, and
# where its user part ends is anyone's guess, so the whole user information is hidden.
TOKEN = "Zq9x[\\:kq" + PASSWORD


@pytest.mark.parametrize(
    "url",
    [
        f"nats://{TOKEN}@127.0.0.1:4222",
        f"nats://127.0.0.1:4222,nats://{TOKEN}@127.0.0.1:4223",
        f"amqp://{TOKEN}@127.0.0.1:5672/",
        f"redis://{TOKEN}@127.0.0.1:6379/0",
        f"rediss://{TOKEN}@127.0.0.1:6379/0",
    ],
    ids=["nats", "nats-seed-list", "amqp", "redis", "rediss"],
)
def test_a_queue_url_that_does_not_parse_is_refused_showing_no_part_of_its_token(
    url: str, database_url: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_queue_url(url)
    message = str(refused.value)
    assert "not a valid URL" in message, message
    assert "://***@127.0.0.1" in message, message
    for piece in ("Zq9x", "kq", PASSWORD):
        assert piece not in message, message
    done = run_jobfence(
        database_url, "migrate", "--queue-url", "postgresql", "--from-queue-url", url
    )
    assert done.returncode == 2, done
    assert "not a valid URL" in done.stderr, done.stderr
    for piece in ("Zq9x", "kq", PASSWORD):
        assert piece not in done.stdout + done.stderr, done.stderr


@pytest.mark.parametrize(
    "url",
    [
        "nats://a\x00b:4222",
        "nats://a:4222\n,nats://b",
        "amqp://h/?prefix=" + "x" * 5000,
        "amqp://h/?" + "&".join(f"p{i}=1" for i in range(500)),
        "redis://h/0?prefix=%ff%fe",
        "nats://" + "a," * 1000,
        "amqp://[::1/",
        "redis://h:-1/0",
        "nats://\u00e9\u00e8:4222?stream=\u00e9",
        "amqp://h/%00?prefetch=%31%30",
        "nats://a?replicas=\u0663",  # an Arabic-Indic digit three
        "nats://a?replicas=99999999999999999999",
    ],
)
def test_a_hostile_queue_url_ends_in_one_refusal_or_a_checked_target(url: str) -> None:
    try:
        target = parse_queue_url(url)
    except ConfigError as exc:
        assert "\n" not in str(exc)  # one line: the URL is shown escaped
        return
    assert target.kind in ("nats", "rabbitmq", "redis")
    assert 1 <= target.settings.replicas <= 5


@pytest.mark.parametrize(
    "url",
    [
        f"amqp://app:{PASSWORD}@Rabbit:5672/prod?prefix=app&prefetch=10&heartbeat=30",
        "amqp://rabbit",
        "amqp://rabbit/%2F",
        f"redis://:{PASSWORD}@redis/5?prefix=p:x&socket_timeout=3",
        "nats://a:4222,nats://b:4222,nats://c:4222?replicas=3&stream=JOBS&stream_wait=10",
    ],
)
def test_a_recorded_location_names_the_same_place_without_password_or_tuning(url: str) -> None:
    target = parse_queue_url(url)
    assert target.location is not None
    assert PASSWORD not in target.location
    for tuning in ("prefetch", "replicas", "stream_wait", "heartbeat", "socket_timeout"):
        assert tuning not in target.location
    assert parse_queue_url(target.location).place == target.place


def test_the_place_is_the_servers_path_and_names_not_the_order_credentials_or_tuning() -> None:
    one = parse_queue_url("nats://a:4222,nats://b:4222?replicas=3")
    two = parse_queue_url("nats://u:p@B,nats://A:4222?replicas=1")
    assert one.place == two.place
    assert one.place != parse_queue_url("nats://a,nats://b?stream=OTHER").place
    assert parse_queue_url("amqp://h/").place == parse_queue_url("amqp://h:5672/%2F").place
    assert parse_queue_url("amqp://h/").place != parse_queue_url("amqp://h/prod").place
    assert parse_queue_url("redis://h").place == parse_queue_url("redis://h:6379/0").place
    assert parse_queue_url("redis://h/0").place != parse_queue_url("redis://h/5").place
    assert parse_queue_url("redis://h/0").place != parse_queue_url("redis://h/0?prefix=x").place
    place = parse_queue_url("amqp://h/prod?prefix=app&prefetch=5").place
    assert (place.kind, place.hosts, place.path, place.names) == (
        "rabbitmq",
        frozenset({"h:5672"}),
        "prod",
        (("prefix", "app"),),
    )


# -- the settings reach the adapters ---------------------------------------------------------


async def test_url_parameters_set_the_adapters_they_open(
    nats_url: str, amqp_url: str, redis_url: str
) -> None:
    name = f"jftest{uuid.uuid4().hex[:10]}"
    opened: list[Any] = []
    try:
        nats_queue = await open_queue(
            parse_queue_url(
                f"{nats_url},nats://127.0.0.1:{free_port()}"
                f"?stream={name.upper()}&subject_prefix={name}&replicas=1"
            ),
            None,  # type: ignore[arg-type]  # a broker needs no pool
        )
        opened.append(nats_queue)
        assert isinstance(nats_queue, NatsQueue)
        assert (nats_queue._stream, nats_queue._subject_prefix) == (name.upper(), name)
        rabbit = await open_queue(parse_queue_url(f"{amqp_url}?prefix={name}&prefetch=7"), None)  # type: ignore[arg-type]
        opened.append(rabbit)
        assert isinstance(rabbit, RabbitMQQueue)
        assert (rabbit._prefix, rabbit._prefetch) == (name, 7)
        redis = await open_queue(parse_queue_url(f"{redis_url}?prefix={name}"), None)  # type: ignore[arg-type]
        opened.append(redis)
        assert isinstance(redis, RedisStreamsQueue)
        assert redis._prefix == name
    finally:
        for queue in opened:
            await queue.close()
        await _delete_stream(nats_url, name.upper())


async def _delete_stream(nats_url: str, stream: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


# -- from the command line -------------------------------------------------------------------


def _start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "jobfence.cli", "worker", "pointsapp:app"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


async def test_a_nats_seed_list_with_replicas_starts_the_worker_command(
    database_url: str, nats_url: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    name = f"jftest{uuid.uuid4().hex[:10]}"
    down = f"nats://127.0.0.1:{free_port()}"  # a seed that does not answer
    url = f"{nats_url},{down}?replicas=1&stream={name.upper()}&subject_prefix={name}"
    env = {
        **os.environ,
        "JOBFENCE_DATABASE_URL": database_url,
        "JOBFENCE_QUEUE_URL": url,
        "PYTHONPATH": str(TESTS_DIR),
    }
    # The one explicit step that moves the database to the broker, then the worker.
    moved = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "jobfence.cli", "migrate", "--queue-url", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert moved.returncode == 0, moved.stderr
    log = tmp_path / "worker.log"
    proc = _start_worker(env, log)
    try:

        async def started() -> bool:
            assert proc.poll() is None, log.read_text()
            return "worker started" in log.read_text()

        await wait_until(started, timeout=60, message="the worker to start")
        setting = await queue_setting(conn)
        assert setting.kind == "nats"
        assert setting.location == (
            f"{nats_url},{down}?stream={name.upper()}&subject_prefix={name}"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
        await _delete_stream(nats_url, name.upper())
    assert "Port could not be cast" not in log.read_text()


def test_a_bad_url_parameter_stops_a_command_with_one_line_and_no_password() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "jobfence.cli", "outbox-relay"],
        env={
            **os.environ,
            "JOBFENCE_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
            "JOBFENCE_QUEUE_URL": f"nats://app:{PASSWORD}@a:4222,nats://b:4222?replicas=7",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        "jobfence: error: JOBFENCE_QUEUE_URL: 'nats://app:***@a:4222,nats://b:4222?replicas=7': "
        "the parameter 'replicas' must be an integer from 1 to 5, got '7'"
    ]


async def test_asking_more_replicas_than_the_existing_stream_has_logs_a_warning(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"jftest{uuid.uuid4().hex[:10]}"
    url = f"{nats_url}?stream={name.upper()}&subject_prefix={name}"
    first = await open_queue(parse_queue_url(url), None)  # type: ignore[arg-type]
    await first.close()
    try:
        caplog.set_level(logging.WARNING, logger="jobfence")
        same = await open_queue(parse_queue_url(f"{url}&replicas=1"), None)  # type: ignore[arg-type]
        await same.close()
        assert not caplog.records
        more = await open_queue(parse_queue_url(f"{url}&replicas=3"), None)  # type: ignore[arg-type]
        await more.close()
        assert [r.getMessage() for r in caplog.records] == [
            f"the NATS stream {name.upper()} has 1 replica(s), fewer than the 3 asked for "
            "(replicas=3): it was created before with fewer; losing a server can stall its "
            f"jobs; raise it with nats stream edit {name.upper()} --replicas 3"
        ]
    finally:
        await _delete_stream(nats_url, name.upper())
