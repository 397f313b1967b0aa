"""What a command says at start-up about how its connections travel: a WARNING, once per
process, for a connection to another host that sends a password in clear text or does not
verify the server's certificate. Nothing is refused here: a broker or a database on a private
network may be reached in clear on purpose. No line holds a password, a token or a URL's
credentials: hosts, ports, schemes and setting names only."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from jobfence.redact import redact_url

if TYPE_CHECKING:
    from jobfence.queues import QueueTarget

log = logging.getLogger("jobfence.transport")

# The warnings already logged by this process.
_warned: set[str] = set()

# What each plain broker scheme would be with TLS.
_TLS_SCHEME = {"amqp": "amqps", "redis": "rediss", "nats": "tls"}
# redis-py reads these values of ssl_check_hostname as false.
_FALSE = frozenset({"0", "f", "false", "n", "no"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this host."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_once(message: str) -> None:
    """Log ``message`` at WARNING the first time this process asks to."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _host(server: str) -> str:
    """The host of ``host:port``; of ``user:password@host:port`` too (never its credentials)."""
    return server.rpartition("@")[2].rpartition(":")[0].strip("[]")


def queue_transport_warnings(target: QueueTarget) -> list[str]:
    """What to warn about a broker URL: credentials sent in clear text to a host that is not
    loopback (``amqp://``, ``redis://``, ``nats://``: a NATS server may still ask for TLS, and
    ``tls://`` insists on it), and a TLS setting that turns off the verification of the
    server's certificate or host name."""
    if not target.external or target.url is None or target.client_url is None:
        return []
    lines: list[str] = []
    location = redact_url(target.location or "")  # redacted already when parse_queue_url made it
    scheme = target.client_url.partition("://")[0].lower()
    servers = target.client_url.partition("?")[0].split(",")
    with_credentials = any("@" in urlsplit(server).netloc for server in servers)
    remote = [_host(host) for host in target.hosts if not is_loopback(_host(host))]
    if scheme in _TLS_SCHEME and with_credentials and remote:
        secure = _TLS_SCHEME[scheme]
        unless = " unless the server asks for TLS" if scheme == "nats" else ""
        lines.append(
            f"the {target.kind} queue at {location} is reached with {scheme}://: its"
            f" credentials travel in clear text to {', '.join(remote)}{unless}; use"
            f" {secure}:// on a network you do not trust"
        )
    query = dict(parse_qsl(target.client_url.partition("?")[2], keep_blank_values=True))
    off: list[str] = []
    if scheme == "amqps" and query.get("no_verify_ssl") == "1":
        off.append("no_verify_ssl=1")
    if scheme == "rediss":
        reqs = query.get("ssl_cert_reqs", "").lower()
        if reqs in ("none", "optional"):
            off.append(f"ssl_cert_reqs={reqs}")
        if query.get("ssl_check_hostname", "").lower() in _FALSE:
            off.append(f"ssl_check_hostname={query['ssl_check_hostname']}")
    if off:
        lines.append(
            f"the {target.kind} queue at {location} is reached over TLS with"
            f" {' and '.join(off)}: the server's certificate or host name is not verified, so"
            " anyone between this host and the broker can pose as it and read the credentials"
            " and the jobs"
        )
    return lines


def database_transport_warning(params: Mapping[str, str], ssl_in_use: bool) -> str | None:
    """What to warn about a database connection (libpq's options as it used them, and whether
    the connection is encrypted): to a host that is not loopback or a Unix socket, an
    ``sslmode`` other than ``verify-full`` or ``verify-ca`` (libpq's default, ``prefer``,
    encrypts only when the server offers it and never checks whose certificate it is)."""
    host = params.get("host") or ""
    address = params.get("hostaddr") or host
    if not host or host.startswith("/") or host.startswith("@") or is_loopback(address):
        return None
    mode = params.get("sslmode") or "prefer"
    if mode in ("verify-full", "verify-ca"):
        return None
    port = params.get("port") or "5432"
    state = (
        "encrypted, but the server's certificate is not verified" if ssl_in_use else "not encrypted"
    )
    return (
        f"the database connection to {host}:{port} is {state} (sslmode={mode}): add"
        " sslmode=verify-full and sslrootcert=/path/to/ca.pem (sslrootcert=system for a public"
        " CA) to JOBFENCE_DATABASE_URL unless the network in between is trusted"
    )


def warn_about_database(conn: Any) -> None:
    """Log :func:`database_transport_warning` for an open psycopg connection, once."""
    info = conn.info
    params = {"host": info.host, "port": str(info.port)}
    with contextlib.suppress(Exception):  # libpq before 12 has no PQhostaddr
        params["hostaddr"] = info.hostaddr
    for option in conn.pgconn.info:
        if option.keyword == b"sslmode" and option.val:
            params["sslmode"] = option.val.decode()
    message = database_transport_warning(params, bool(conn.pgconn.ssl_in_use))
    if message is not None:
        warn_once(message)
