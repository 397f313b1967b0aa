"""An outbox relay in a process of its own, on a real broker, for a test to SIGKILL mid-batch.

    python tests/outbox_relay_kill_proc.py DATABASE_URL BROKER BROKER_URL NAME

``BROKER`` is ``redis``, ``nats`` or ``rabbitmq``; ``NAME`` names the broker's keys, stream or
queues (``brokers.make_queue``). Batches of 100, so that a kill lands between the confirm of
some batches and the delete of their rows.
"""

from __future__ import annotations

import asyncio
import sys

from brokers import make_queue
from jobfence.outbox import OutboxRelay, OutboxRelaySettings


async def main(database_url: str, broker: str, url: str, name: str) -> None:
    queue = make_queue(broker, url, name)
    relay = OutboxRelay(
        database_url, queue, settings=OutboxRelaySettings(batch_size=100, poll_seconds=0.05)
    )
    try:
        await relay.run()  # until SIGKILL
    finally:
        await queue.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
