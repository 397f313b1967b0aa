"""Keeping the leases of the jobs a worker holds, so a short lease can cover a long handler.

With ``Worker(max_handler_seconds=...)`` the worker holds each delivery under a short lease and
extends it (:meth:`QueuePort.extend`) when about half of it is left, from the fetch until the
job is finished: while it waits in the worker's buffer and while its handler runs. A worker
that dies stops extending, so its jobs come back within one lease; a live worker's long handler
keeps its job.

The extension stops, and the lease is left to run out, when:

- the handler has run for ``max_handler_seconds`` (a hung handler): one WARNING names the job
  and how long it has run; the job is delivered again when the lease runs out, and the fence
  keeps its effect single. The handler itself is not cancelled;
- the job has waited ``max_handler_seconds`` in the buffer without starting (every processor is
  busy): one WARNING, and the job goes to whichever worker takes it next;
- the queue refuses the extension (the lease was already lost): one WARNING. A refusal for a
  job that finished while its extension was under way (its ack got there first) is not one;
- an extension keeps failing (an error: the queue or the database unreachable) until the lease
  has run out by this worker's clock. Each failure is tried again a moment later while the
  lease lasts; one WARNING per run of failures, INFO when extensions go through again.

One task does this for every job the worker holds, extending them one after the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from jobfence.harness import log_fields
from jobfence.model import Delivery
from jobfence.outage_log import reason
from jobfence.ports import LeaseMetricsSink, QueuePort

log = logging.getLogger("jobfence.leases")

# After a failed extension, the next try comes this long later (at most a tenth of the lease).
RETRY_SECONDS = 1.0


@dataclass(eq=False, slots=True)
class _Held:
    delivery: Delivery
    leased_until: float  # by this worker's clock, the lease lasts until then
    since: float  # when it was fetched, or when its handler started
    running: bool = False
    next_try: float | None = None  # set after a failed extension


class LeaseKeeper:
    """Extends the leases of the deliveries a worker holds (see the module's docstring).

    The worker calls :meth:`hold` for the deliveries a fetch returned (with the time it asked
    for them: their lease started no earlier), :meth:`started` when a delivery's job starts,
    :meth:`forget` when the worker no longer holds it, and runs :meth:`run` until :meth:`stop`.
    """

    def __init__(
        self,
        queue: QueuePort,
        *,
        lease_seconds: float,
        max_handler_seconds: float,
        metrics: LeaseMetricsSink | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._queue = queue
        self._lease = lease_seconds
        self._limit = max_handler_seconds
        self._metrics = metrics
        self._clock = clock if clock is not None else time.monotonic
        self._held: dict[int, _Held] = {}
        self._wake = asyncio.Event()
        self._stopped = False
        self._failures = 0

    def now(self) -> float:
        """This keeper's clock (``time.monotonic`` unless given): pass its time to :meth:`hold`."""
        return self._clock()

    @property
    def holding(self) -> int:
        """How many deliveries have their lease kept now."""
        return len(self._held)

    def hold(self, deliveries: Iterable[Delivery], *, since: float) -> None:
        until = since + self._lease
        for delivery in deliveries:
            self._held[id(delivery)] = _Held(delivery, leased_until=until, since=since)
        self._wake.set()

    def started(self, delivery: Delivery) -> None:
        held = self._held.get(id(delivery))
        if held is not None and not held.running:
            held.running = True
            held.since = self._clock()

    def forget(self, delivery: Delivery) -> None:
        self._held.pop(id(delivery), None)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def run(self) -> None:
        while not self._stopped:
            now = self._clock()
            for held in [h for h in self._held.values() if self._due_at(h) <= now]:
                if self._stopped:
                    return
                if self._held.get(id(held.delivery)) is not held:
                    continue  # forgotten meanwhile
                try:
                    await self._keep(held)
                except Exception:
                    self.forget(held.delivery)
                    log.exception(
                        "internal error keeping the lease of job %s; it is no longer extended",
                        held.delivery.message.job_id,
                        extra=log_fields(held.delivery),
                    )
            self._wake.clear()
            next_due = min((self._due_at(h) for h in self._held.values()), default=None)
            timeout = None if next_due is None else max(next_due - self._clock(), 0.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _due_at(self, held: _Held) -> float:
        if held.next_try is not None:
            return held.next_try
        return held.leased_until - self._lease / 2

    async def _keep(self, held: _Held) -> None:
        delivery = held.delivery
        now = self._clock()
        if now - held.since >= self._limit:
            self.forget(delivery)
            self._over_limit(held, now)
            return
        try:
            extended = await asyncio.wait_for(
                self._queue.extend(delivery, lease_seconds=self._lease),
                timeout=max(held.leased_until - now, 0.1),
            )
        except Exception as exc:
            self._failed(held, now, exc)
            return
        if self._held.get(id(delivery)) is not held:
            # The job finished while the extension was under way (its ack may even have
            # reached the queue first): nothing was lost, and nothing is left to extend.
            return
        if self._failures:
            log.info("extending leases again after %d failed tries", self._failures)
            self._failures = 0
        self._count(delivery, "extended" if extended else "lost")
        if not extended:
            self.forget(delivery)
            log.warning(
                "job %s for %s lost its lease before it was extended: the queue refused (the"
                " lease had run out, or the job was settled); it is delivered again",
                delivery.message.job_id,
                delivery.message.consumer,
                extra=log_fields(delivery),
            )
            return
        held.leased_until = now + self._lease
        held.next_try = None

    def _failed(self, held: _Held, now: float, exc: Exception) -> None:
        delivery = held.delivery
        self._failures += 1
        self._count(delivery, "failed")
        # One WARNING per run of failures (an outage would repeat it for every job), then DEBUG.
        log.log(
            logging.WARNING if self._failures == 1 else logging.DEBUG,
            "cannot extend the lease of job %s (%s); trying again while it lasts",
            delivery.message.job_id,
            reason(exc),
            extra=log_fields(delivery),
        )
        next_try = now + min(RETRY_SECONDS, self._lease / 10)
        if next_try >= held.leased_until:
            self.forget(delivery)  # gone by this worker's clock: nothing left to extend
            log.debug("job %s: lease ran out while extensions failed", delivery.message.job_id)
            return
        held.next_try = next_try

    def _over_limit(self, held: _Held, now: float) -> None:
        delivery = held.delivery
        if held.running:
            if self._metrics is not None:
                self._metrics.handler_over_limit(delivery.message.queue, delivery.message.consumer)
            log.warning(
                "job %s for %s has run for %.0fs, past max_handler_seconds (%.0fs): its lease is no"
                " longer extended, so it is delivered again when the lease runs out (in %.1fs);"
                " is the handler hung?",
                delivery.message.job_id,
                delivery.message.consumer,
                now - held.since,
                self._limit,
                max(held.leased_until - now, 0.0),
                extra=log_fields(delivery),
            )
        else:
            log.warning(
                "job %s for %s has waited %.0fs in this worker's buffer without starting, past"
                " max_handler_seconds (%.0fs): its lease is no longer extended (every processor is"
                " busy: lower --batch-size, raise --concurrency, or look for hung handlers)",
                delivery.message.job_id,
                delivery.message.consumer,
                now - held.since,
                self._limit,
                extra=log_fields(delivery),
            )

    def _count(self, delivery: Delivery, result: str) -> None:
        if self._metrics is not None:
            self._metrics.lease_extension(delivery.message.queue, delivery.message.consumer, result)
