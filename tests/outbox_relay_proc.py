"""``jobfence`` in a subprocess, with test brokers in the queue registry.

    python tests/outbox_relay_proc.py JOBFENCE-ARGS...

Before running the real command, the registry (``jobfence.queues.BACKENDS``) gets:

- ``amqp://``: a broker that is the PostgreSQL queue table of JOBFENCE_DATABASE_URL, used as
  a non-transactional queue (each publish commits on its own: the broker's confirm). It
  survives the relay's process, so a test can count what was published. With
  ``JOBFENCE_TEST_STALL_MARKER=PATH`` set, the first publish, once confirmed, writes PATH and
  blocks forever: the relay is stopped dead between the confirm and its own commit;
- ``nats://``: an adapter whose module is not installed;
- ``redis://``: an adapter whose ``open_queue`` connects to the URL's host and port over TCP,
  and whose error quotes the whole URL, as some clients do.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jobfence import cli, db
from jobfence.adapters.pg_queue import PgQueue
from jobfence.model import Message
from jobfence.ports import QueueCapabilities, QueuePort
from jobfence.queues import BACKENDS, Backend


class TableBroker(PgQueue):
    """The PostgreSQL queue's table, published to outside any transaction, like a broker."""

    capabilities = QueueCapabilities(transactional=False, delayed_publish=True)

    def __init__(self, pool: Any, marker: Path | None) -> None:
        super().__init__(pool)
        self._marker = marker
        self._own_pool = pool

    async def publish(self, message: Message, **kwargs: Any) -> None:
        await super().publish(message, **kwargs)  # committed: the broker confirmed it
        if self._marker is not None:
            tmp = self._marker.with_suffix(".tmp")
            tmp.write_text(message.job_id)
            tmp.rename(self._marker)
            await asyncio.Event().wait()  # until SIGKILL

    async def close(self) -> None:
        await super().close()
        await self._own_pool.close()


async def open_queue(url: str) -> QueuePort:
    scheme = url.partition("://")[0]
    if scheme == "redis":
        parts = urlsplit(url)
        try:
            _, writer = await asyncio.open_connection(parts.hostname, parts.port)
        except OSError as exc:
            raise ConnectionError(f"Error connecting to {url}: {exc}") from exc
        writer.close()
        raise AssertionError("the test expects nothing to listen there")
    pool = await db.open_pool(db.resolve_database_url(), max_size=2, name="test-broker")
    marker = os.environ.get("JOBFENCE_TEST_STALL_MARKER")
    return TableBroker(pool, Path(marker) if marker else None)


def main(argv: list[str]) -> int:
    BACKENDS["amqp"] = Backend("rabbitmq", "outbox_relay_proc", "rabbitmq")
    BACKENDS["nats"] = Backend("nats", "jobfence_test_adapter_not_installed", "nats")
    BACKENDS["redis"] = Backend("redis", "outbox_relay_proc", "redis")
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
