"""A queue held in this process's memory: for unit tests and for applications' own tests.

It keeps the contract every queue adapter passes (``tests/queue_conformance.py``): delayed
publish, a lease per delivery with attempt counting, redelivery with the next attempt when a
lease runs out, and ack, extend, retry and release that act only while the delivery still holds
its lease. It is not transactional: no database transaction can roll it back, so ``publish`` and
``ack`` refuse a caller's ``tx`` and the harness acks after the work transaction commits (a
crash in between means one more delivery, which the fence absorbs).

Messages live in one dict and every ``receive`` scans it: fine for tests, not for volume.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from psycopg import AsyncConnection

from jobfence.adapters._shared import (
    check_prior_attempts,
    publish_each,
    receipt_of,
    refuse_tx,
)
from jobfence.errors import ConfigError
from jobfence.limits import checked_delay
from jobfence.model import Delivery, Message, Outgoing
from jobfence.ports import Clock, QueueCapabilities, QueueSize

# Shared by every MemoryQueue, so a receipt from one queue never matches a message of another.
_ids = itertools.count(1)
_lease_tokens = itertools.count(1)


class _SystemClock:
    """UTC time that never steps: read once from the wall clock, then moved on by
    ``time.monotonic``, so that a wall clock that steps (an NTP correction, a resumed VM) moves
    no lease and no delay."""

    def __init__(self) -> None:
        self._start = datetime.now(UTC)
        self._started = time.monotonic()

    def now(self) -> datetime:
        return self._start + timedelta(seconds=time.monotonic() - self._started)


@dataclass(frozen=True, slots=True)
class MemoryReceipt:
    id: int
    lease_token: int


@dataclass(slots=True)
class _Entry:
    id: int
    message: Message
    run_at: datetime
    attempts: int = 0
    lease_token: int | None = None


def _receipt(delivery: Delivery) -> MemoryReceipt:
    return receipt_of(delivery, MemoryReceipt, "MemoryQueue")


def _refuse_tx(operation: str) -> ConfigError:
    return refuse_tx("MemoryQueue", operation, instead=", or use PgQueue")


class MemoryQueue:
    """The in-memory queue adapter. ``clock`` (default: real UTC time) drives leases and delays.

    A receiver waiting in ``receive(wait_seconds=...)`` wakes at once on a publish, retry or
    release, and otherwise checks again every ``poll_interval_seconds`` or when the next
    message falls due by ``clock``, whichever comes first.
    """

    capabilities = QueueCapabilities(
        transactional=False, recorded=False, delayed_publish=True, delayed_retry=True
    )

    def __init__(self, *, clock: Clock | None = None, poll_interval_seconds: float = 1.0) -> None:
        if not poll_interval_seconds > 0:
            raise ConfigError(f"poll_interval_seconds must be > 0, got {poll_interval_seconds}")
        self._clock: Clock = clock if clock is not None else _SystemClock()
        self._poll_interval = poll_interval_seconds
        self._entries: dict[int, _Entry] = {}
        self._wakeup = asyncio.Event()
        self._closed = False

    async def publish(
        self,
        message: Message,
        *,
        delay_seconds: float = 0.0,
        tx: AsyncConnection[Any] | None = None,
        prior_attempts: int = 0,
    ) -> None:
        if tx is not None:
            raise _refuse_tx("publish")
        entry_id = next(_ids)
        self._entries[entry_id] = _Entry(
            id=entry_id,
            message=message,
            run_at=self._clock.now() + timedelta(seconds=checked_delay(delay_seconds)),
            attempts=check_prior_attempts(prior_attempts),
        )
        self._wakeup.set()

    async def publish_many(self, outgoing: Sequence[Outgoing]) -> list[Exception | None]:
        """Each message with :meth:`publish`, one after the other (no round trip to wait for
        that pipelining would save)."""

        async def one(item: Outgoing) -> None:
            await self.publish(item.message, prior_attempts=item.prior_attempts)

        return await publish_each(one, outgoing)

    async def receive(
        self,
        queues: Sequence[str],
        *,
        max_messages: int,
        lease_seconds: float,
        wait_seconds: float = 0.0,
    ) -> list[Delivery]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        while True:
            self._wakeup.clear()
            deliveries = self._take(queues, max_messages, lease_seconds)
            remaining = deadline - loop.time()
            if deliveries or remaining <= 0 or self._closed:
                return deliveries
            timeout = min(remaining, self._poll_interval, self._seconds_until_next_due(queues))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)

    def _take(
        self, queues: Sequence[str], max_messages: int, lease_seconds: float
    ) -> list[Delivery]:
        now = self._clock.now()
        wanted = set(queues)
        due = sorted(
            (e for e in self._entries.values() if e.message.queue in wanted and e.run_at <= now),
            key=lambda e: (e.run_at, e.id),
        )[: max(max_messages, 0)]
        deliveries = []
        for entry in due:
            entry.attempts += 1
            entry.run_at = now + timedelta(seconds=lease_seconds)
            entry.lease_token = next(_lease_tokens)
            deliveries.append(
                Delivery(
                    message=entry.message,
                    attempt=entry.attempts,
                    receipt=MemoryReceipt(id=entry.id, lease_token=entry.lease_token),
                )
            )
        return deliveries

    def _seconds_until_next_due(self, queues: Sequence[str]) -> float:
        now = self._clock.now()
        wanted = set(queues)
        waits = [
            (e.run_at - now).total_seconds()
            for e in self._entries.values()
            if e.message.queue in wanted and e.run_at > now
        ]
        return min(waits, default=self._poll_interval)

    def _held(self, delivery: Delivery) -> _Entry | None:
        """The message ``delivery`` still holds the lease of, or None for a stale receipt."""
        receipt = _receipt(delivery)
        entry = self._entries.get(receipt.id)
        if entry is None or entry.lease_token != receipt.lease_token:
            return None
        return entry

    async def ack(self, delivery: Delivery, *, tx: AsyncConnection[Any] | None = None) -> bool:
        if tx is not None:
            raise _refuse_tx("ack")
        entry = self._held(delivery)
        if entry is None:
            return False
        del self._entries[entry.id]
        return True

    async def extend(self, delivery: Delivery, *, lease_seconds: float) -> bool:
        entry = self._held(delivery)
        if entry is None:
            return False
        entry.run_at = self._clock.now() + timedelta(seconds=lease_seconds)
        return True

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        for delivery in deliveries:
            await self.ack(delivery)

    async def retry(self, delivery: Delivery, *, delay_seconds: float, error: str) -> bool:
        entry = self._held(delivery)
        if entry is None:
            return False
        entry.run_at = self._clock.now() + timedelta(seconds=max(delay_seconds, 0.0))
        entry.lease_token = None
        self._wakeup.set()
        return True

    async def release(self, delivery: Delivery) -> None:
        entry = self._held(delivery)
        if entry is not None:
            entry.run_at = self._clock.now()
            entry.lease_token = None
            entry.attempts = max(entry.attempts - 1, 0)
            self._wakeup.set()

    async def size(self, queues: Sequence[str]) -> QueueSize:
        now = self._clock.now()
        wanted = set(queues)
        held = [e for e in self._entries.values() if e.message.queue in wanted]
        return QueueSize(due=sum(1 for e in held if e.run_at <= now), total=len(held))

    async def backlog(self, queues: Sequence[str]) -> int:
        """Every message this queue holds, of every queue (``queues`` is not needed)."""
        return len(self._entries)

    async def close(self) -> None:
        """Wake any waiting receiver, which returns what is due (usually nothing)."""
        self._closed = True
        self._wakeup.set()
