"""A process SIGKILLed while it holds a broker delivery: the message comes back, to another
client, with the next attempt (the broker kept the count), and is acked once."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from brokers import BROKERS, make_queue, on_broker
from jobfence import Message

TESTS = Path(__file__).parent
QUEUE = "crash.main"


@pytest.fixture(params=BROKERS)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str, str]]:
    async with on_broker(request, [QUEUE]) as found:
        yield found


async def test_a_delivery_held_by_a_sigkilled_process_comes_back_with_the_next_attempt(
    broker: tuple[str, str, str],
) -> None:
    kind, url, name = broker
    queue = make_queue(kind, url, name)
    lease = 2.0
    try:
        await queue.publish(Message(queue=QUEUE, consumer="c", job_id="held", body=b"{}"))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(TESTS / "broker_holder_proc.py"),
            kind,
            url,
            name,
            QUEUE,
            str(lease),
            stdout=asyncio.subprocess.PIPE,
            cwd=TESTS,
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
            assert line.decode().split() == ["held", "1"]
            assert await queue.receive([QUEUE], max_messages=1, lease_seconds=lease) == []
        finally:
            proc.send_signal(signal.SIGKILL)
            assert await proc.wait() == -signal.SIGKILL

        got = await queue.receive(
            [QUEUE], max_messages=1, lease_seconds=lease, wait_seconds=lease * 5
        )
        assert [(d.message.job_id, d.attempt) for d in got] == [("held", 2)]
        assert await queue.ack(got[0]) is True
        assert (await queue.size([QUEUE])).total == 0
    finally:
        await queue.close()
