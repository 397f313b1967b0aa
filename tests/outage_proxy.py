"""A TCP proxy in front of PostgreSQL that a test can cut: every connection through it drops at
once and new ones are refused until it is restored. A network outage, without touching the
server that other tests share."""

from __future__ import annotations

import asyncio

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class OutageProxy:
    def __init__(self, url: str) -> None:
        params = conninfo_to_dict(url)
        self._target = (str(params.get("host", "127.0.0.1")), int(params.get("port", 5432)))
        self._url = url
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.down = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    @property
    def url(self) -> str:
        """``url`` with the proxy as host and port."""
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        params = conninfo_to_dict(self._url)
        params.update(host="127.0.0.1", port=str(port))
        return make_conninfo("", **params)

    def cut(self) -> None:
        """Drop every connection and refuse new ones."""
        self.down = True
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()

    def restore(self) -> None:
        self.down = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        # Every transport is aborted: each connection's task ends on its own.
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        host, port = self._target
        try:
            if host.startswith("/"):  # a Unix socket directory (the embedded server)
                up_reader, up_writer = await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
            else:
                up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_writer))
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._tasks.discard(task)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            sink.transport.abort()
            self._open.discard(sink)
