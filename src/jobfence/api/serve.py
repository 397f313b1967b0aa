"""Serving the Ops API (``jobfence api``): one process, or several sharing one port.

One process serves every request on one event loop, so it uses one core at most. With
``workers`` > 1 the command starts that many worker processes; each has its own pool (of
``pool_size`` connections) and its own listening socket on the same address with
``SO_REUSEPORT``, so the kernel spreads new connections over the workers evenly (a shared
socket would let whichever worker wakes first accept a burst of them all). The parent only
reserves the port, supervises and stops: when one worker exits, it stops the others and exits
with status 1, for the process manager to restart the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event

from jobfence import db, runtime, schema
from jobfence.errors import ConfigError

log = logging.getLogger("jobfence.api")

MAX_WORKERS = 64
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_STOP_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """What ``jobfence api`` was asked for (``port`` 0: any free port)."""

    host: str = "127.0.0.1"
    port: int = 8080
    pool_size: int = 10
    bulk_chunk_size: int = 500
    item_cache_mb: int = 64
    workers: int = 1
    access_log: bool = True
    # Where replays publish (jobfence.queues): None for the PostgreSQL queue. May hold a
    # password: never in repr.
    queue_url: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"workers must be between 1 and {MAX_WORKERS}, got {self.workers}")
        if self.item_cache_mb < 0:
            raise ConfigError(f"item_cache_mb must be >= 0, got {self.item_cache_mb}")
        if self.workers > 1 and not hasattr(socket, "SO_REUSEPORT"):
            raise ConfigError("workers > 1 needs SO_REUSEPORT (Linux): run one process per port")


async def serve(
    options: ServeOptions,
    *,
    url: str | None = None,
    sock: socket.socket | None = None,
    ready: Event | None = None,
) -> int:
    """Serve the API in this process until SIGTERM or SIGINT: on ``sock`` if given (a worker),
    else on ``options.host``/``options.port``. ``ready`` is set once it accepts requests."""
    import uvicorn

    from jobfence.api import ApiSettings, create_app
    from jobfence.queues import open_queue, parse_queue_url

    # The verifying key first: without one the API refuses to start, before any database work.
    settings = ApiSettings.from_env(
        bulk_chunk_size=options.bulk_chunk_size, item_cache_bytes=options.item_cache_mb << 20
    )
    url = url or db.resolve_database_url()
    # Opened full: the first burst of requests finds its connections ready instead of waiting
    # for the pool to grow one connection at a time.
    pool = await db.open_pool(
        url,
        min_size=options.pool_size,
        max_size=options.pool_size,
        name="jobfence-api",
        large_reads=True,
        lend_checked=True,
    )
    try:
        if sock is None:  # checked before the queue is opened: one elsewhere is not touched
            async with pool.connection() as conn:
                await schema.ensure_migrated(conn)
                await _adopt(conn, options)
        queue = await open_queue(parse_queue_url(options.queue_url), pool)
    except BaseException:
        await pool.close()
        raise
    try:
        app = create_app(pool=pool, queue=queue, settings=settings)
        # log_config=None: uvicorn's lines go through the handlers configured in main().
        port = options.port if sock is None else sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            host=options.host,
            port=port,
            log_config=None,
            log_level="info",
            access_log=options.access_log,
        )
        server = uvicorn.Server(config)
        # uvicorn stops gracefully on SIGTERM/SIGINT, then raises the signal again for the
        # handler it found: make that one harmless, so the stop ends with status 0.
        stopped = {sig: signal.signal(sig, lambda *_: None) for sig in _STOP_SIGNALS}
        try:
            serving = asyncio.create_task(server.serve(sockets=None if sock is None else [sock]))
            while ready is not None and not server.started:
                done, _ = await asyncio.wait({serving}, timeout=0.05)
                if done:
                    break
            if ready is not None and server.started:
                ready.set()
            await serving
        finally:
            for sig, handler in stopped.items():
                signal.signal(sig, handler)
    finally:
        await queue.close()
        await pool.close()
    return 0


async def _adopt(conn: object, options: ServeOptions) -> None:
    """Replays publish where this database's jobs go: the queue given must be the one the
    database records (jobfence.queue_record.adopt_queue), or the API refuses to start."""
    from psycopg import AsyncConnection

    from jobfence.queue_record import adopt_queue
    from jobfence.queues import parse_queue_url

    assert isinstance(conn, AsyncConnection)
    await adopt_queue(conn, parse_queue_url(options.queue_url))


def _address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host!r}: {exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    return family, (str(sockaddr[0]), int(sockaddr[1]))


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` with ``SO_REUSEPORT`` (not listening yet)."""
    family, address = _address(host, port)
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


@dataclass(frozen=True, slots=True)
class _WorkerSpec:
    options: ServeOptions
    url: str
    port: int
    log_format: str
    log_level: int
    other_level: int


def _worker_main(spec: _WorkerSpec, ready: Event) -> None:  # pragma: no cover - subprocess
    from jobfence.observability import configure_logging

    configure_logging(spec.log_format, spec.log_level, other_level=spec.other_level)
    sock = reuse_port_socket(spec.options.host, spec.port)
    try:
        sys.exit(runtime.run(lambda: serve(spec.options, url=spec.url, sock=sock, ready=ready)))
    finally:
        sock.close()


async def serve_workers(
    options: ServeOptions, *, log_format: str, log_level: int, other_level: int
) -> int:
    """Run ``options.workers`` worker processes on one port until SIGTERM or SIGINT (then
    stop them gracefully, status 0) or until one of them exits (stop the others, status 1)."""
    from jobfence.api import ApiSettings
    from jobfence.queues import open_queue, parse_queue_url

    ApiSettings.from_env(bulk_chunk_size=options.bulk_chunk_size)  # refuse a bad key now
    url = db.resolve_database_url()
    await db.check_connection(url)
    pool = await db.open_pool(url, max_size=1, name="jobfence-api-start")
    try:
        async with pool.connection() as conn:
            await schema.ensure_migrated(conn)
            await _adopt(conn, options)
        # A bad or unreachable queue is refused here, before any worker starts.
        await (await open_queue(parse_queue_url(options.queue_url), pool)).close()
    finally:
        await pool.close()
    # Bound, never listening: it holds the port (the one chosen, for port 0) while the
    # workers bind their own sockets to it; only listening sockets receive connections.
    with reuse_port_socket(options.host, options.port) as holder:
        port = holder.getsockname()[1]
        context = multiprocessing.get_context("spawn")
        spec = _WorkerSpec(options, url, port, log_format, log_level, other_level)
        events = [context.Event() for _ in range(options.workers)]
        workers = [
            context.Process(
                target=_worker_main, args=(spec, event), name=f"jobfence-api-{n}", daemon=False
            )
            for n, event in enumerate(events)
        ]
        with _stop_on_signals() as stopping:
            for worker in workers:
                worker.start()
            while not all(event.is_set() for event in events):
                if not await _running(workers, stopping, 0.05):
                    break
            else:
                host = f"[{options.host}]" if ":" in options.host else options.host
                log.info(
                    "jobfence api: %d workers ready on http://%s:%d",
                    options.workers,
                    host,
                    port,
                )
            while await _running(workers, stopping, 0.2):
                pass
        failed = not stopping.is_set()
        if failed:
            dead = [w for w in workers if not w.is_alive()]
            log.error(
                "API worker %s exited (status %s): stopping the others",
                dead[0].name,
                dead[0].exitcode,
            )
        for worker in workers:
            if worker.is_alive() and worker.pid is not None:
                worker.terminate()  # SIGTERM: uvicorn's graceful stop
        for worker in workers:
            await asyncio.to_thread(worker.join, _STOP_TIMEOUT)
            if worker.is_alive():
                log.error(
                    "API worker %s did not stop within %.0f s: killed", worker.name, _STOP_TIMEOUT
                )
                worker.kill()
                await asyncio.to_thread(worker.join)
    return 1 if failed else 0


async def _running(
    workers: Sequence[multiprocessing.process.BaseProcess], stopping: asyncio.Event, wait: float
) -> bool:
    """After up to ``wait`` seconds: whether every worker runs and no stop was asked."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), wait)
    return not stopping.is_set() and all(w.is_alive() for w in workers)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[asyncio.Event]:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stopping.set)
    try:
        yield stopping
    finally:
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)
