"""Acknowledgements after commit, sent in batches.

A job's work, fence and commit come first; the ack only tells the queue to stop redelivering
it. So the worker need not wait for it, nor pay a round trip per job: finished deliveries are
collected and acknowledged together, when ``max_batch`` of them are waiting or ``max_delay``
seconds after the first one, whichever comes first, and at once when the worker goes idle or
stops. If the process dies before a batch is sent, those messages come back when their lease runs
out, and the fence turns each into a duplicate: acked and skipped, counted, no second effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging

from jobfence.model import Delivery
from jobfence.ports import QueuePort

log = logging.getLogger("jobfence.acks")


class AckBatcher:
    """Collects finished deliveries and acks them with :meth:`QueuePort.ack_many`."""

    def __init__(self, queue: QueuePort, *, max_batch: int = 100, max_delay: float = 0.1) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not max_delay > 0:
            raise ValueError(f"max_delay must be > 0, got {max_delay}")
        self._queue = queue
        self._max_batch = max_batch
        self._max_delay = max_delay
        self._pending: list[Delivery] = []
        self._due = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()
        self._failures = 0
        # The context the batcher is made in (the worker's), not that of the job whose ack
        # starts the task: a job's trace context (its process span) ends with the job, and
        # the acks the task sends later are not part of it.
        self._context = contextvars.copy_context()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, delivery: Delivery) -> None:
        self._pending.append(delivery)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(
                self._run(), name="jobfence-acks", context=self._context.copy()
            )
        if len(self._pending) >= self._max_batch:
            self._due.set()

    async def _run(self) -> None:
        while self._pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._due.wait(), self._max_delay)
            self._due.clear()
            if not await self.flush():
                # The queue is unreachable: wait before the next try (the worker's own outage
                # handling decides what else to do).
                await asyncio.sleep(min(0.5 * 2 ** min(self._failures, 6), 30.0))

    async def flush(self) -> bool:
        """Ack everything collected so far; False (and keep them) if the queue refused."""
        async with self._flushing:
            batch, self._pending = self._pending, []
            if not batch:
                return True
            try:
                await self._queue.ack_many(batch)
            except BaseException as exc:
                self._pending[:0] = batch  # cancelled or failed: nothing is lost
                if not isinstance(exc, Exception):
                    raise
                self._failures += 1
                # One WARNING per run of failures (an outage would repeat it at every retry);
                # the rest at DEBUG, and one INFO line once acks go through again.
                log.log(
                    logging.WARNING if self._failures == 1 else logging.DEBUG,
                    "cannot acknowledge %d finished job(s) yet (%s: %s); will retry. Until then "
                    "their lease may run out and they come back as duplicates, skipped by the "
                    "fence",
                    len(batch),
                    type(exc).__name__,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                )
                return False
            if self._failures:
                log.info(
                    "acknowledging again after %d failed tries (%d job(s) now)",
                    self._failures,
                    len(batch),
                )
            self._failures = 0
            return True

    async def close(self) -> None:
        """Send what is left (one try) and stop the background task."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pending and not await self.flush():
            log.warning(
                "%d finished job(s) were not acknowledged; they come back after their lease "
                "and are skipped as duplicates",
                len(self._pending),
            )
