"""The real ``jobfence`` CLI in a subprocess, with each broker adapter's names set by the test.

    JOBFENCE_TEST_BROKER_NAME=NAME python tests/broker_cli.py JOBFENCE-ARGS...

Only how an adapter is named changes: ``amqp://``, ``nats://`` and ``redis://`` open the same
adapter classes as ``jobfence.queues`` does, connected the same way at start-up, but with the
prefix, stream and subjects named after NAME (``tests/brokers.py``), so that a test's queues
never meet another test's on the shared brokers and can be deleted afterwards. Everything else
(``jobfence worker``, ``outbox-relay``, ``dead-letters replay-bulk``) is the real command.
"""

from __future__ import annotations

import os
import sys

from brokers import make_queue
from jobfence import cli
from jobfence.ports import QueuePort
from jobfence.queues import BACKENDS, Backend, parse_queue_url


async def open_queue(url: str) -> QueuePort:
    kind = parse_queue_url(url).kind
    queue = make_queue(kind, url, os.environ["JOBFENCE_TEST_BROKER_NAME"])
    try:  # connect now, as each adapter's own open_queue does: a bad URL fails at start-up
        if kind == "rabbitmq":
            await queue._open_channel()  # type: ignore[attr-defined]
        elif kind == "nats":
            await queue._jetstream()  # type: ignore[attr-defined]
        else:
            await queue._redis.ping()  # type: ignore[attr-defined]
    except BaseException:
        await queue.close()
        raise
    return queue


def main(argv: list[str]) -> int:
    for scheme, backend in list(BACKENDS.items()):
        if backend.kind in ("rabbitmq", "nats", "redis"):
            BACKENDS[scheme] = Backend(backend.kind, "broker_cli", backend.extra)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
