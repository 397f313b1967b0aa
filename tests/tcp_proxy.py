"""A TCP proxy that a test can cut, in front of PostgreSQL or a broker (no tests here).

It listens on 127.0.0.1 on an ephemeral port and pipes every connection to its target: a host
and port, or, for a host that is a directory (the embedded PostgreSQL), that directory's Unix
socket ``.s.PGSQL.<port>``. Clients reach it over TCP either way.

- :meth:`TcpProxy.down` closes every connection it carries and closes each new one at once,
  as a network blip does to a client; :meth:`TcpProxy.up` lets connections through again.
- :meth:`TcpProxy.cut` does the same abruptly: every connection is reset (no goodbye), as a
  crashed host or a network fault would; new ones are reset until :meth:`TcpProxy.up`.
- :meth:`TcpProxy.cut_unnoticed` leaves the client unaware until it next sends.

:attr:`TcpProxy.carried` counts the client connections open now, :attr:`TcpProxy.refused`
the ones closed at once while down or cut.

``reply_delay`` (seconds) delays everything the target sends back by that much, as a distant
server would: latency, not a bandwidth limit (replies that arrive together leave together), so
a client that pipelines its requests waits one delay for the lot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, *, reply_delay: float = 0.0) -> None:
        self.target = (target_host, target_port)
        self.reply_delay = reply_delay
        self.port = 0
        self.accepting = True
        self.abrupt = False  # cut rather than down: reset connections instead of closing them
        self.refused = 0  # connections closed at once while down or cut
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._doomed: set[asyncio.StreamWriter] = set()
        self._upstream: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def for_database(cls, database_url: str) -> TcpProxy:
        """A proxy in front of ``database_url``'s server (TCP, or a Unix socket directory)."""
        params = conninfo_to_dict(database_url)
        return cls(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def __aenter__(self) -> TcpProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def url(self, database_url: str) -> str:
        """``database_url`` with its host and port replaced by the proxy's."""
        params = conninfo_to_dict(database_url)
        params.update(host="127.0.0.1", port=str(self.port))
        params.pop("hostaddr", None)
        return make_conninfo("", **params)

    @property
    def carried(self) -> int:
        """Client connections open through the proxy now."""
        return len(self._writers) // 2

    @property
    def upstream_ports(self) -> set[int]:
        """The local ports of the connections it opened to its target (how the target knows
        them); none when the target is a Unix socket (its socket name is a path, not a port)."""
        ports: set[int] = set()
        for writer in self._upstream:
            sockname = writer.get_extra_info("sockname")
            if isinstance(sockname, tuple) and not writer.is_closing():
                ports.add(int(sockname[1]))
        return ports

    def down(self) -> None:
        """Close every connection now and close every new one until :meth:`up`."""
        self.accepting = False
        self.abrupt = False
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def cut(self) -> None:
        """Reset every connection now (no goodbye) and every new one until :meth:`up`."""
        self.accepting = False
        self.abrupt = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        await asyncio.sleep(0)

    def cut_unnoticed(self) -> None:
        """Cut every connection it carries now without telling the client: each is closed
        only when the client next sends on it, as a peer that vanished answers with a reset.
        New connections go through."""
        self._doomed |= self._writers

    def up(self) -> None:
        self.accepting = True
        self.abrupt = False

    def _refuse(self, writer: asyncio.StreamWriter) -> None:
        if self.abrupt:
            writer.transport.abort()
        else:
            writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = self.target
        if host.startswith("/"):  # a Unix socket directory (the embedded PostgreSQL)
            return await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        return await asyncio.open_connection(host, port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.accepting:
            self.refused += 1
            self._refuse(writer)
            return
        try:
            up_reader, up_writer = await self._connect()
        except OSError:
            self._refuse(writer)
            return
        if not self.accepting:  # cut while connecting
            self._refuse(writer)
            up_writer.close()
            return
        self._writers |= {writer, up_writer}
        self._upstream.add(up_writer)
        for source, sink, delay in ((reader, up_writer, 0.0), (up_reader, writer, None)):
            if delay is None and self.reply_delay > 0:
                pipe = self._delayed_pipe(source, sink, (writer, up_writer))
            else:
                pipe = self._pipe(source, sink, (writer, up_writer))
            task = asyncio.create_task(pipe)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _delayed_pipe(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        """As :meth:`_pipe`, each chunk written ``reply_delay`` after it arrived."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await chunks.get()
                if not data:
                    return
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if sink in self._doomed or sink.is_closing():
                    return
                sink.write(data)
                await sink.drain()

        delivering = asyncio.create_task(deliver())
        try:
            while data := await source.read(65536):
                chunks.put_nowait((loop.time() + self.reply_delay, data))
            chunks.put_nowait((loop.time() + self.reply_delay, b""))
            await delivering
        except (OSError, RuntimeError):
            pass
        finally:
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, RuntimeError):
                await delivering
            for writer in pair:
                self._writers.discard(writer)
                self._doomed.discard(writer)
                self._upstream.discard(writer)
                writer.close()

    async def _pipe(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        try:
            while data := await source.read(65536):
                if sink in self._doomed:
                    break
                sink.write(data)
                await sink.drain()
        except (OSError, RuntimeError):
            pass
        finally:
            for writer in pair:
                self._writers.discard(writer)
                self._doomed.discard(writer)
                self._upstream.discard(writer)
                writer.close()

    async def close(self) -> None:
        self.down()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


@contextlib.asynccontextmanager
async def tcp_proxy(database_url: str) -> AsyncIterator[TcpProxy]:
    """A started proxy in front of ``database_url``'s server (TCP or a Unix socket)."""
    async with TcpProxy.for_database(database_url) as proxy:
        yield proxy
