"""A TCP proxy in front of PostgreSQL that can cut the network (no tests here).

It listens on 127.0.0.1 on an ephemeral port and pipes every connection to the target.
:meth:`TcpProxy.down` closes every connection it carries and closes each new one at once, as
a network blip does to a client; :meth:`TcpProxy.up` lets connections through again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.accepting = True
        self.refused = 0  # connections closed at once while down
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._doomed: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

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

    def down(self) -> None:
        """Cut every connection now and close every new one until :meth:`up`."""
        self.accepting = False
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    def cut_unnoticed(self) -> None:
        """Cut every connection it carries now without telling the client: each is closed
        only when the client next sends on it, as a peer that vanished answers with a reset.
        New connections go through."""
        self._doomed |= self._writers

    def up(self) -> None:
        self.accepting = True

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.accepting:
            self.refused += 1
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        if not self.accepting:  # cut while connecting
            writer.close()
            up_writer.close()
            return
        self._writers |= {writer, up_writer}
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink, (writer, up_writer)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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
    """A proxy in front of ``database_url``'s server (a host and port URL)."""
    params = conninfo_to_dict(database_url)
    proxy = TcpProxy(str(params.get("host", "127.0.0.1")), int(params.get("port", 5432)))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
