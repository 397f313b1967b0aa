"""A process that takes one message from a broker and dies holding it (the test SIGKILLs it).

    python tests/broker_holder_proc.py BROKER URL NAME QUEUE LEASE_SECONDS

It receives one message of QUEUE under a lease of LEASE_SECONDS, prints ``<job_id> <attempt>``
and blocks forever without acking.
"""

from __future__ import annotations

import asyncio
import sys

from brokers import make_queue


async def main(broker: str, url: str, name: str, queue_name: str, lease: float) -> None:
    queue = make_queue(broker, url, name)
    got = await queue.receive([queue_name], max_messages=1, lease_seconds=lease, wait_seconds=30)
    for delivery in got:
        print(delivery.message.job_id, delivery.attempt, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5], float(sys.argv[5])))
