"""Transport security at each network boundary, as a user meets it: TLS to the brokers verifies
the server's certificate and host name by default, a setting that turns verification off is
logged (or refused when its value is ambiguous), a CA file and a client certificate can be
given, a password sent in clear text to another host is logged once at start-up, and so is a
database connection to another host whose certificate is not verified. Real servers: Redis and
NATS with TLS on free ports, RabbitMQ and PostgreSQL behind local proxies, all on loopback or
on this host's own non-loopback address; certificates are made here, for this test only."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import logging
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobfence import db
from jobfence.config import alert_config_from_env
from jobfence.errors import ConfigError
from jobfence.queues import open_broker, parse_queue_url
from jobfence.redact import redact_url, url_secrets
from nats_servers import NATS_SERVER, free_port, require_nats_server

SECRET = "s3cr3t-Pa55"
VERIFY_FAILED = r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"


# -- certificates ----------------------------------------------------------------------------


class Certs:
    """A private CA and a server certificate it signed for ``localhost`` only (not for
    127.0.0.1: a URL naming the address fails the host name check), and a client certificate."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "jobfence test CA")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        self.ca = self._write("ca.pem", ca.public_bytes(serialization.Encoding.PEM))
        self.cert, self.key = self._leaf("server", ca, ca_key, now)
        self.client_cert, self.client_key = self._leaf("client", ca, ca_key, now)

    def _leaf(
        self, name: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, now: Any
    ) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path = self._write(f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        key_path = self._write(
            f"{name}-key.pem",
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
        return cert_path, key_path

    def _write(self, name: str, data: bytes) -> Path:
        path = self.dir / name
        path.write_bytes(data)
        return path


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return Certs(tmp_path)


# -- servers and proxies ---------------------------------------------------------------------


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 15
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the server exited:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not listen:\n{log.read_text()}")
        time.sleep(0.05)


@contextlib.contextmanager
def _process(args: list[str], port: int, log: Path) -> Iterator[None]:
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_listening(port, proc, log)
        yield
    finally:
        proc.terminate()  # this process, by its own handle
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def redis_tls(certs: Certs) -> Iterator[int]:
    """A Redis with TLS only (no plain port), its certificate for ``localhost``."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    args = [server, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"]
    args += ["--tls-cert-file", str(certs.cert), "--tls-key-file", str(certs.key)]
    args += ["--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "no"]
    args += ["--save", "", "--appendonly", "no", "--dir", str(certs.dir)]
    with _process(args, port, certs.dir / "redis.log"):
        yield port


@pytest.fixture
def nats_tls(certs: Certs) -> Iterator[int]:
    """A JetStream nats-server that requires TLS, its certificate for ``localhost``."""
    require_nats_server()
    port = free_port()
    config = certs.dir / "nats.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f'jetstream {{ store_dir: "{certs.dir / "js"}" }}\n'
        f'tls {{ cert_file: "{certs.cert}"\n key_file: "{certs.key}" }}\n'
    )
    with _process([NATS_SERVER, "-c", str(config)], port, certs.dir / "nats.log"):
        yield port


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(Exception):
        writer.close()


@contextlib.asynccontextmanager
async def _forwarder(
    listen_host: str, target: tuple[str, int], tls: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    """A TCP proxy on ``listen_host`` (a free port) to ``target``; with ``tls``, it ends TLS
    (an ``amqps://`` endpoint in front of the plain RabbitMQ)."""
    tasks: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        writers.append(up_writer)
        for task in (
            asyncio.create_task(_pipe(reader, up_writer)),
            asyncio.create_task(_pipe(up_reader, writer)),
        ):
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(accept, listen_host, 0, ssl=tls)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in writers:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        await server.wait_closed()


def _server_tls(certs: Certs) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.cert, certs.key)
    return context


def _own_address() -> str:
    """This host's own non-loopback IPv4 address (a "remote" host the tests can listen on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe, contextlib.suppress(OSError):
        probe.connect(("192.0.2.1", 9))  # no packet is sent: it picks the route's source
        address = str(probe.getsockname()[0])
        if not ipaddress.ip_address(address).is_loopback and address != "0.0.0.0":
            return address
    pytest.skip("this host has no non-loopback IPv4 address to listen on")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the start-up warnings that are logged once per process."""
    try:
        from jobfence import transport
    except ImportError:  # before the module existed
        return
    monkeypatch.setattr(transport, "_warned", set())


# -- Redis (rediss://) -----------------------------------------------------------------------


async def test_rediss_verifies_the_certificate_and_host_name_by_default(
    redis_tls: int, certs: Certs
) -> None:
    with pytest.raises(ConfigError, match=VERIFY_FAILED):
        await open_broker(parse_queue_url(f"rediss://localhost:{redis_tls}/0"))
    # Trusted CA, but the URL names an address the certificate is not for.
    with pytest.raises(ConfigError, match=r"mismatch"):
        await open_broker(
            parse_queue_url(f"rediss://127.0.0.1:{redis_tls}/0?ssl_ca_certs={certs.ca}")
        )
    queue = await open_broker(
        parse_queue_url(f"rediss://localhost:{redis_tls}/0?ssl_ca_certs={certs.ca}")
    )
    await queue.close()


async def test_rediss_with_verification_turned_off_says_so_at_start_up(
    redis_tls: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    url = f"rediss://:{SECRET}@127.0.0.1:{redis_tls}/0?ssl_cert_reqs=none"
    with contextlib.suppress(ConfigError):  # no password on this Redis: AUTH may be refused
        await (await open_broker(parse_queue_url(url))).close()
    said = [line for line in _warnings(caplog) if "ssl_cert_reqs=none" in line]
    assert len(said) == 1, _warnings(caplog)
    assert "not verif" in said[0] and SECRET not in caplog.text
    caplog.clear()
    url = f"rediss://127.0.0.1:{redis_tls}/0?ssl_cert_reqs=required&ssl_check_hostname=false"
    with contextlib.suppress(ConfigError):
        await (await open_broker(parse_queue_url(url))).close()
    assert any("ssl_check_hostname=false" in line for line in _warnings(caplog)), caplog.text


# -- RabbitMQ (amqps://), behind a proxy that ends TLS ----------------------------------------


async def test_amqps_verifies_by_default_and_takes_a_ca_file(certs: Certs) -> None:
    async with _forwarder("127.0.0.1", ("127.0.0.1", 5672), _server_tls(certs)) as port:
        with pytest.raises(ConfigError, match=VERIFY_FAILED):
            await open_broker(parse_queue_url(f"amqps://guest:guest@localhost:{port}/"))
        url = f"amqps://guest:guest@localhost:{port}/?cafile={certs.ca}"
        queue = await open_broker(parse_queue_url(url))
        await queue.close()


async def test_amqps_no_verify_ssl_is_logged_at_start_up(
    certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with _forwarder("127.0.0.1", ("127.0.0.1", 5672), _server_tls(certs)) as port:
        url = f"amqps://guest:guest@localhost:{port}/?no_verify_ssl=1"
        queue = await open_broker(parse_queue_url(url))
        await queue.close()
    said = [line for line in _warnings(caplog) if "no_verify_ssl=1" in line]
    assert len(said) == 1, _warnings(caplog)
    assert "not verif" in said[0]


@pytest.mark.parametrize("value", ["false", "00", "no", "true", ""])
def test_amqp_no_verify_ssl_other_than_0_or_1_is_refused(value: str) -> None:
    # aiormq reads every value but "0" as "do not verify": no_verify_ssl=false turned it off.
    with pytest.raises(ConfigError, match="'no_verify_ssl' must be 0 or 1") as caught:
        parse_queue_url(f"amqps://app:{SECRET}@rabbit:5671/?no_verify_ssl={value}")
    assert SECRET not in str(caught.value)


# -- NATS (nats:// with a server requiring TLS, tls://) ---------------------------------------


async def test_nats_tls_verifies_by_default_and_takes_a_ca_file(
    nats_tls: int, certs: Certs
) -> None:
    with pytest.raises(ConfigError, match=VERIFY_FAILED):
        await open_broker(parse_queue_url(f"nats://localhost:{nats_tls}"))
    for scheme in ("nats", "tls"):
        url = f"{scheme}://localhost:{nats_tls}?tls_ca={certs.ca}"
        queue = await open_broker(parse_queue_url(url))
        await queue.close()


def test_nats_tls_settings_are_checked() -> None:
    target = parse_queue_url("tls://n1:4222,tls://n2:4222?tls_ca=/etc/ca.pem")
    assert target.kind == "nats" and target.settings.tls_ca == "/etc/ca.pem"
    assert target.place == parse_queue_url("nats://n2:4222,nats://n1:4222").place
    with pytest.raises(ConfigError, match="tls_key goes with tls_cert"):
        parse_queue_url("tls://n1:4222?tls_key=/etc/k.pem")
    with pytest.raises(ConfigError, match="each server of the list must be a tls:// URL"):
        parse_queue_url("tls://n1:4222,nats://n2:4222")


async def test_nats_tls_scheme_refuses_a_server_without_tls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The shared NATS on 4222 speaks plain text: tls:// insists, and sends no credentials.
    with pytest.raises(ConfigError, match="does not offer TLS") as caught:
        await open_broker(parse_queue_url(f"tls://app:{SECRET}@127.0.0.1:4222"))
    assert SECRET not in str(caught.value) and SECRET not in caplog.text


async def test_nats_client_certificate(nats_tls: int, certs: Certs) -> None:
    url = (
        f"tls://localhost:{nats_tls}?tls_ca={certs.ca}"
        f"&tls_cert={certs.client_cert}&tls_key={certs.client_key}"
    )
    queue = await open_broker(parse_queue_url(url))
    await queue.close()
    with pytest.raises(ConfigError, match="tls_cert"):
        await open_broker(parse_queue_url(f"tls://localhost:{nats_tls}?tls_cert=/nonexistent.pem"))


# -- a password in clear text to another host --------------------------------------------------


async def test_a_password_in_clear_text_to_another_host_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    host = _own_address()
    async with _forwarder(host, ("127.0.0.1", 5672)) as port:
        target = parse_queue_url(f"amqp://guest:guest@{host}:{port}/")
        for _ in range(2):
            queue = await open_broker(target)
            await queue.close()
    said = [line for line in _warnings(caplog) if "clear text" in line]
    assert len(said) == 1, _warnings(caplog)
    assert host in said[0] and "amqps://" in said[0] and "guest:guest" not in said[0]


@pytest.mark.parametrize(
    "url",
    [
        "amqp://guest:guest@127.0.0.1:5672/",  # loopback
        "amqp://127.0.0.1:5672/",
        "redis://127.0.0.1:6379/0",  # no password
        "nats://127.0.0.1:4222",
    ],
)
async def test_no_clear_text_warning_for_loopback_or_no_password(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    await (await open_broker(parse_queue_url(url))).close()
    assert not [line for line in _warnings(caplog) if "clear text" in line]


def test_clear_text_warnings_name_each_broker() -> None:
    from jobfence.transport import queue_transport_warnings

    for url, says in [
        (f"redis://:{SECRET}@redis.internal:6379/0", "rediss://"),
        (f"nats://app:{SECRET}@n1.internal:4222", "tls://"),
        (f"nats://{SECRET}@n1.internal:4222", "tls://"),
    ]:
        lines = queue_transport_warnings(parse_queue_url(url))
        assert len(lines) == 1 and says in lines[0] and SECRET not in lines[0], lines
    for url in [
        f"rediss://:{SECRET}@redis.internal:6379/0",
        f"amqps://app:{SECRET}@rabbit.internal:5671/",
        f"tls://app:{SECRET}@n1.internal:4222",
    ]:
        assert queue_transport_warnings(parse_queue_url(url)) == []


# -- PostgreSQL --------------------------------------------------------------------------------


async def test_database_on_another_host_without_verified_tls_is_logged(
    server_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    params = conninfo_to_dict(server_url)
    host = _own_address()
    target = (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    if target[0].startswith("/"):
        pytest.skip("the test database is on a Unix socket")
    async with _forwarder(host, target) as port:
        remote = make_conninfo(server_url, host=host, port=str(port), sslpassword=SECRET)
        for _ in range(2):
            await db.check_connection(remote)
    said = [line for line in _warnings(caplog) if "sslmode" in line]
    assert len(said) == 1, _warnings(caplog)
    assert host in said[0] and "verify-full" in said[0] and SECRET not in caplog.text
    caplog.clear()
    await db.check_connection(server_url)  # loopback: nothing to say
    assert not [line for line in _warnings(caplog) if "sslmode" in line]


def test_database_warning_needs_verification_not_just_encryption() -> None:
    from jobfence.transport import database_transport_warning

    common = {"host": "db.internal", "hostaddr": "10.0.0.5", "port": "5432"}
    for mode, warned in [
        ("disable", True),
        ("prefer", True),
        ("require", True),
        ("verify-ca", False),
        ("verify-full", False),
    ]:
        line = database_transport_warning({**common, "sslmode": mode}, ssl_in_use=mode != "disable")
        assert (line is not None) == warned, (mode, line)
    assert (
        database_transport_warning({"host": "/run/postgresql", "sslmode": "prefer"}, False) is None
    )
    assert database_transport_warning({"host": "localhost", "sslmode": "prefer"}, False) is None


def test_database_ssl_secrets_are_redacted() -> None:
    url = (
        "postgresql://app@db.internal/app?sslmode=verify-full&sslrootcert=/etc/ca.pem"
        f"&sslcert=/etc/client.pem&sslkey=/etc/client.key&sslpassword={SECRET}"
    )
    shown = redact_url(url)
    assert SECRET not in shown and "sslkey=***" in shown
    assert "sslrootcert=/etc/ca.pem" in shown  # a path locates, it does not authenticate
    assert SECRET in url_secrets(url)  # hidden in a libpq error quoting it alone, too
    assert "sslpassword=***" in redact_url(
        f"postgresql://app@db/app?sslmode=require&sslpassword={SECRET}"
    )
    text = f"host=db.internal sslpassword='{SECRET} x' sslmode=verify-full"
    assert SECRET not in redact_url(text)


async def test_database_error_does_not_show_the_sslpassword() -> None:
    url = f"postgresql://app@127.0.0.1:1/app?sslmode=require&sslpassword={SECRET}"
    with pytest.raises(Exception) as caught:
        await db.check_connection(url, connect_timeout=2)
    assert SECRET not in str(caught.value)


# -- Better Stack heartbeats -------------------------------------------------------------------


def test_heartbeat_url_in_clear_text_to_another_host_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from jobfence.adapters.betterstack import BetterStackHeartbeat
    from jobfence.alerts.relay import AlertRelay

    token = "hb-token-Zq81"
    config = alert_config_from_env(
        {
            "JOBFENCE_BETTERSTACK_TOKEN": "a-valid-looking-token-1234567890",
            "JOBFENCE_BETTERSTACK_REQUESTER_EMAIL": "ops@example.com",
            "JOBFENCE_BETTERSTACK_RELAY_HEARTBEAT_URL": (
                f"http://uptime.betterstack.com/api/v1/heartbeat/{token}"
            ),
        }
    )
    with pytest.raises(ConfigError, match="plain http://") as caught:
        AlertRelay.from_config("postgresql://app@127.0.0.1/app", config)
    assert token not in str(caught.value)
    assert "JOBFENCE_BETTERSTACK_ALLOW_HTTP" in str(caught.value)
    with pytest.raises(ConfigError, match="plain http://"):
        BetterStackHeartbeat(f"http://hb.example.com/{token}", name="cleanup")
    # Allowed: loopback, https, or the trusted-network switch.
    BetterStackHeartbeat(f"http://127.0.0.1:9/{token}", name="cleanup")
    BetterStackHeartbeat(f"https://hb.example.com/{token}", name="cleanup")
    BetterStackHeartbeat(f"http://hb.example.com/{token}", name="cleanup", allow_http=True)


def test_better_stack_clients_keep_verification_and_redirects_off() -> None:
    from jobfence.adapters.betterstack import (
        BetterStackHeartbeat,
        BetterStackIncidents,
        BetterStackSettings,
    )

    incidents = BetterStackIncidents(BetterStackSettings(token="t0ken-value"))
    heartbeat = BetterStackHeartbeat("https://hb.example.com/x", name="cleanup")
    for client in (incidents._client, heartbeat._client):
        assert client.follow_redirects is False
