"""Private ``nats-server`` processes with JetStream on loopback, for tests that stop a server:
one standalone server, or a cluster of three. Each server has its own ports (free ones) and its
own store directory, so stopping or killing one never touches the shared server on 4222."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


@dataclass
class NatsServer:
    """One ``nats-server`` process: ``start`` (again after a stop, with the same ports and
    store), ``kill`` (SIGKILL) or ``stop`` (SIGTERM, waits)."""

    name: str
    port: int
    cluster_port: int | None
    store: Path
    log: Path
    routes: list[int] = field(default_factory=list)
    cluster_name: str = ""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [NATS_SERVER, "-a", "127.0.0.1", "-p", str(self.port), "-n", self.name]
        args += ["-js", "-sd", str(self.store)]
        if self.cluster_port is not None:
            args += ["--cluster_name", self.cluster_name]
            args += ["--cluster", f"nats://127.0.0.1:{self.cluster_port}"]
            args += ["--routes", ",".join(f"nats://127.0.0.1:{p}" for p in self.routes)]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, within: float = 20.0) -> None:
        deadline = time.monotonic() + within
        while not _answers(self.port):
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"nats-server {self.name} exited:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"nats-server {self.name} did not listen within {within}s")
            time.sleep(0.05)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def require_nats_server() -> None:
    if not os.path.exists(NATS_SERVER):
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"nats-server not found at {NATS_SERVER} (CI=true)")
        pytest.skip("nats-server is not installed")


@contextlib.contextmanager
def nats_standalone(tmp: Path) -> Iterator[NatsServer]:
    """One JetStream server on a free port, started; stopped (and its store removed) on exit."""
    require_nats_server()
    server = NatsServer("jf-solo", free_port(), None, tmp / "solo-store", tmp / "solo.log")
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


@contextlib.contextmanager
def nats_cluster(tmp: Path, size: int = 3) -> Iterator[list[NatsServer]]:
    """``size`` JetStream servers clustered on loopback (free client and cluster ports, a
    store directory each), started together; all killed on exit."""
    require_nats_server()
    cluster_name = f"jf{uuid.uuid4().hex[:8]}"
    ports = [(free_port(), free_port()) for _ in range(size)]
    servers = [
        NatsServer(
            name=f"{cluster_name}-n{i}",
            port=port,
            cluster_port=cport,
            store=tmp / f"store-n{i}",
            log=tmp / f"nats-n{i}.log",
            routes=[c for j, (_, c) in enumerate(ports) if j != i],
            cluster_name=cluster_name,
        )
        for i, (port, cport) in enumerate(ports)
    ]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.kill()
