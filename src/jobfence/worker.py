"""The worker: fetches batches under a lease, runs them through the harness, shuts down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from psycopg_pool import AsyncConnectionPool, PoolTimeout

from jobfence.acks import AckBatcher
from jobfence.adapters.prometheus import PrometheusMetrics
from jobfence.app import App
from jobfence.blocked_loop import DEFAULT_BLOCKED_LOOP_SECONDS, checked_blocked_loop_seconds
from jobfence.blocked_loop import watch as watch_loop
from jobfence.db import (
    RECONNECT_MAX_DELAY_SECONDS,
    DatabaseReadOnly,
    check_writable,
    drop_read_only_connections,
    is_connection_loss,
    looks_broken,
    session_read_only,
)
from jobfence.errors import ConfigError
from jobfence.guard import retired
from jobfence.harness import (
    Harness,
    InfrastructureError,
    Lookahead,
    log_fields,
)
from jobfence.leases import LeaseKeeper
from jobfence.limits import MAX_LEASE_SECONDS
from jobfence.model import Delivery
from jobfence.outage_log import PSYCOPG_LOGGERS, OutageLog, reason
from jobfence.outbox import (
    OutboxMetricsSink,
    OutboxRelay,
    OutboxRelaySettings,
    OutboxRelayStats,
    outbox_counts,
)
from jobfence.ports import LeaseMetricsSink, LoopMetricsSink, MetricsSink, QueuePort
from jobfence.schema import autovacuum_warning, ensure_migrated
from jobfence.sync import PsycopgRunner, SyncExecutor, SyncTransactionRunner

log = logging.getLogger("jobfence.worker")

RunUntil = Literal["stopped", "idle", "empty"]


@dataclass
class WorkerStats:
    """Outcomes of the deliveries this worker handled, for summaries (metrics hold the rest)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    released: int = 0
    # Jobs taken and unfinished when shutdown cut them off (rolled back, given back): the
    # running ones, and the next job a sync handler's job took to begin with its COMMIT.
    cut_off: int = 0

    @property
    def handled(self) -> int:
        return sum(self.outcomes.values())


def _trace_child(trace_parent: str) -> bool:
    """``Worker(trace_parent=...)``: True for ``"child"``, False for ``"link"``."""
    if trace_parent not in ("link", "child"):
        raise ConfigError(f"trace_parent must be 'link' or 'child', got {trace_parent!r}")
    return trace_parent == "child"


class Worker:
    """Runs an :class:`App`'s consumers against a queue.

    ``concurrency`` jobs run at once, each on its own pooled connection; the worker fetches up to
    ``batch_size`` messages per round trip and keeps at most that many leased but not started.
    Finished jobs are acknowledged after their commit in batches of up to ``ack_batch_size``, at
    most ``ack_delay_seconds`` late (see :mod:`jobfence.acks`).
    ``run(until="idle")`` returns when nothing is due, ``until="empty"`` when the queues hold
    nothing at all (scheduled retries included), and the default runs until :meth:`stop`.
    On a queue that is not transactional (a broker), the worker also runs the outbox relay
    (:mod:`jobfence.outbox`; one active per database, the others stand by) unless
    ``outbox_relay=False``; ``until`` then also waits for the outbox to be published. On a
    broker without native delayed retry (RabbitMQ, Redis Streams) a retry with a delay waits in
    the outbox too, so it needs a relay running somewhere: without its own, the worker warns at
    start-up.

    Consumers with a plain ``def`` handler run their transactions in ``concurrency`` threads,
    through ``sync_runner`` (:class:`~jobfence.sync.SyncTransactionRunner`); without one, the
    worker opens a sync psycopg pool of ``2 * concurrency`` connections to the database of ``pool``
    for the length of :meth:`run`, only when its queues have such consumers (docs/sync.md).

    With ``max_handler_seconds``, the worker keeps the lease of every job it holds alive
    (:mod:`jobfence.leases`), extending it when about half of ``lease_seconds`` is left, until
    the job's handler has run that long: a short lease then covers long handlers, and a dead
    worker's jobs come back within one lease. Off (None) by default: a job is then held for
    ``lease_seconds`` from its fetch, however long its handler runs.

    With OpenTelemetry (``jobfence[otel]``, docs/observability.md) each job runs under a
    ``process`` span linked to its producer's context; ``trace_parent="child"`` makes it that
    context's child instead (one trace from the request to the job's effect).

    While it runs, the worker logs one WARNING each time its event loop does not run for longer
    than ``blocked_loop_seconds`` (1 s; 0: off), naming the job whose ``async def`` handler held
    it and where (:mod:`jobfence.blocked_loop`), and one INFO line when it runs again; counted
    through ``loop_metrics`` (``metrics`` when it is a :class:`PrometheusMetrics`).
    """

    def __init__(
        self,
        app: App,
        pool: AsyncConnectionPool[Any],
        queue: QueuePort,
        *,
        queues: Sequence[str] | None = None,
        concurrency: int = 4,
        batch_size: int | None = None,
        lease_seconds: float = 300.0,
        poll_seconds: float = 1.0,
        shutdown_grace_seconds: float = 30.0,
        ack_batch_size: int = 100,
        ack_delay_seconds: float = 0.1,
        metrics: MetricsSink | None = None,
        rng: random.Random | None = None,
        outbox_relay: bool = True,
        outbox_metrics: OutboxMetricsSink | None = None,
        outbox_settings: OutboxRelaySettings | None = None,
        sync_runner: SyncTransactionRunner | None = None,
        max_handler_seconds: float | None = None,
        lease_metrics: LeaseMetricsSink | None = None,
        trace_parent: str = "link",
        blocked_loop_seconds: float = DEFAULT_BLOCKED_LOOP_SECONDS,
        loop_metrics: LoopMetricsSink | None = None,
    ) -> None:
        if concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if ack_batch_size < 1:
            raise ConfigError(f"ack_batch_size must be >= 1, got {ack_batch_size}")
        for label, value in (
            ("lease_seconds", lease_seconds),
            ("poll_seconds", poll_seconds),
            ("shutdown_grace_seconds", shutdown_grace_seconds),
            ("ack_delay_seconds", ack_delay_seconds),
        ):
            if not (0 < value < float("inf")):
                raise ConfigError(f"{label} must be a positive number of seconds, got {value}")
        if lease_seconds > MAX_LEASE_SECONDS:
            raise ConfigError(
                f"lease_seconds must be at most {MAX_LEASE_SECONDS} (7 days), got {lease_seconds}"
            )
        self.app = app
        self.queue = queue
        self.queues = list(queues) if queues else app.queues
        unknown = sorted(set(self.queues) - set(app.queues))
        if unknown:
            raise ConfigError(f"no consumer is registered for queue(s) {', '.join(unknown)}")
        self.concurrency = concurrency
        self.batch_size = batch_size or max(4 * concurrency, 20)
        # The next fetch starts when the buffer runs this low, so it overlaps the jobs still
        # buffered instead of making the processors wait for it.
        self._low_water = max(concurrency, self.batch_size // 2)
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.shutdown_grace_seconds = shutdown_grace_seconds
        self.metrics: MetricsSink = metrics if metrics is not None else PrometheusMetrics()
        self.acks = AckBatcher(queue, max_batch=ack_batch_size, max_delay=ack_delay_seconds)
        self.harness = Harness(
            app,
            pool,
            queue,
            metrics=self.metrics,
            rng=rng,
            acks=self.acks,
            trace_child=_trace_child(trace_parent),
        )
        self.max_handler_seconds = max_handler_seconds
        # A PrometheusMetrics is also the lease and loop sinks, on the same registry.
        own = self.metrics if isinstance(self.metrics, PrometheusMetrics) else None
        self._leases = _lease_keeper(
            queue,
            lease_seconds,
            max_handler_seconds,
            lease_metrics if lease_metrics is not None else own,
        )
        self.blocked_loop_seconds = checked_blocked_loop_seconds(blocked_loop_seconds)
        self._loop_metrics = loop_metrics if loop_metrics is not None else own
        self.stats = WorkerStats()
        self._pool = pool
        self._sync_runner = sync_runner
        self.has_sync_consumers = any(
            c.sync for c in app.consumers.values() if c.queue in self.queues
        )
        self._stopping = asyncio.Event()
        self._stop_now = asyncio.Event()
        self._buffer: asyncio.Queue[Delivery] = asyncio.Queue()
        self._room = asyncio.Event()
        self._progress = asyncio.Event()
        self._busy = 0
        self._unreleased: list[Delivery] = []
        self._outage = asyncio.Event()
        self._outage_log = OutageLog(log)
        self._fetch_failures = 0
        # On a queue outside the database, producers write the outbox: the worker runs its
        # relay too (one active per database, the others stand by).
        self.outbox_relay: OutboxRelay | None = None
        if outbox_relay and not queue.capabilities.transactional:
            if not isinstance(pool.conninfo, str):
                raise ConfigError(
                    "the outbox relay needs a pool whose conninfo is a string; pass"
                    " outbox_relay=False and run jobfence outbox-relay instead"
                )
            self.outbox_relay = OutboxRelay(
                pool.conninfo, queue, settings=outbox_settings, metrics=outbox_metrics
            )
        self._relay_task: asyncio.Task[OutboxRelayStats] | None = None

    def stop(self, *, now: bool = False) -> None:
        """Ask the worker to finish in-flight jobs (for up to ``shutdown_grace_seconds``), give
        back the rest and return. ``now``: cut the running jobs off at once instead (their
        transactions roll back) and give them back too; nothing is lost, and the fence makes
        their next run safe."""
        self._stopping.set()
        if now:
            self._stop_now.set()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stopping.is_set()

    @property
    def running(self) -> int:
        """How many jobs are running now (taken from the buffer, not finished)."""
        return self._busy

    def check(self) -> None:
        """Start-up checks: D3 fence TTLs; the retry overrides' rationales, the consumers that
        commit jobs in groups and those with a sync handler, in the log; a warning when the
        pool is smaller than the worker needs, and when delayed retries need a relay this
        worker does not run."""
        self.app.check_fence_ttls(
            lease_seconds=self.lease_seconds, max_handler_seconds=self.max_handler_seconds
        )
        max_size = getattr(self._pool, "max_size", None)
        if isinstance(max_size, int) and max_size < self.concurrency + 2:
            log.warning(
                "the connection pool holds at most %d connections for concurrency %d: jobs"
                " wait for a connection, and so do fetches, acks and lease extensions behind"
                " them; size the pool concurrency + 2 (%d)",
                max_size,
                self.concurrency,
                self.concurrency + 2,
            )
        if not self.queue.capabilities.delayed_retry and self.outbox_relay is None:
            log.warning(
                "this worker runs without the outbox relay (outbox_relay=False,"
                " --no-outbox-relay) and its queue cannot hold a retry back: retries with a"
                " delay wait in the outbox until a running jobfence outbox-relay (or a worker"
                " with its relay) publishes them; make sure one runs"
            )
        for consumer in self.app.consumers.values():
            if consumer.queue not in self.queues:
                continue
            if consumer.sync:
                log.info(
                    "consumer %s on queue %s has a sync handler: its transactions run in %d"
                    " threads on a sync connection pool",
                    consumer.name,
                    consumer.queue,
                    self.concurrency,
                )
            if consumer.jobs_per_transaction > 1:
                log.info(
                    "consumer %s on queue %s commits up to %d waiting jobs per transaction"
                    " (group commit)",
                    consumer.name,
                    consumer.queue,
                    consumer.jobs_per_transaction,
                )
            if consumer.retry.overrides_default:
                log.info(
                    "consumer %s on queue %s overrides the retry policy: %s",
                    consumer.name,
                    consumer.queue,
                    consumer.retry.describe(),
                )

    async def run(self, *, until: RunUntil = "stopped") -> WorkerStats:
        self.check()
        # A WARNING when an async handler (or anything else) blocks the event loop.
        watching = watch_loop(self.blocked_loop_seconds, self._loop_metrics)
        try:
            return await self._run(until)
        finally:
            if watching is not None:
                watching.close()

    async def _run(self, until: RunUntil) -> WorkerStats:
        async with self._pool.connection() as conn:  # unmigrated: refuse now, not spin on errors
            await ensure_migrated(conn)
            if (warning := await autovacuum_warning(conn)) is not None:
                log.warning(warning)
        own_runner = await self._open_sync()
        psycopg_logs = [logging.getLogger(name) for name in PSYCOPG_LOGGERS]
        for logger in psycopg_logs:  # their per-connection warnings: see OutageLog
            logger.addFilter(self._outage_log)
        try:
            processors = [
                asyncio.create_task(self._process_loop(), name=f"jobfence-processor-{i}")
                for i in range(self.concurrency)
            ]
            if self.outbox_relay is not None:
                self._relay_task = asyncio.create_task(
                    self.outbox_relay.run(), name="jobfence-outbox-relay"
                )
            leases = None
            if self._leases is not None:
                leases = asyncio.create_task(self._leases.run(), name="jobfence-leases")
            try:
                await self._fetch_loop(until)
            finally:
                try:
                    await self._shutdown(processors)
                finally:
                    await self._stop_leases(leases)
                    await self._stop_relay()
        finally:
            for logger in psycopg_logs:
                logger.removeFilter(self._outage_log)
            await self._close_sync(own_runner)
        return self.stats

    async def _stop_leases(self, task: asyncio.Task[None] | None) -> None:
        if self._leases is None or task is None:
            return
        self._leases.stop()
        task.cancel()  # it may be waiting on an extension
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _stop_relay(self) -> None:
        if self.outbox_relay is None or self._relay_task is None:
            return
        self.outbox_relay.stop()
        try:
            await self._relay_task
        except Exception:
            log.exception("the outbox relay stopped with an error")
        self._relay_task = None

    async def _outbox_holds(self, until: RunUntil) -> bool:
        """Whether this worker's outbox relay still has rows to publish (any for ``empty``,
        due ones for ``idle``): a worker on an external queue is not done before them."""
        if self.outbox_relay is None:
            return False
        async with self._pool.connection() as conn:
            counts = await outbox_counts(conn)
        return (counts.waiting if until == "empty" else counts.due) > 0

    async def _open_sync(self) -> PsycopgRunner | None:
        """The sync executor for consumers with a ``def`` handler, when the queues have any;
        the runner the worker opened itself for it, to close after the run."""
        if not self.has_sync_consumers:
            return None
        runner = self._sync_runner
        own: PsycopgRunner | None = None
        if runner is None:
            conninfo, kwargs = self._pool.conninfo, self._pool.kwargs
            if not isinstance(conninfo, str) or not isinstance(kwargs, dict | None):
                raise ConfigError(
                    "consumers with a sync handler need a pool opened with a connection string"
                    " and fixed kwargs, or a sync_runner given to the Worker"
                )
            kwargs = {k: v for k, v in (kwargs or {}).items() if k != "autocommit"}
            own = PsycopgRunner(conninfo, size=2 * self.concurrency, kwargs=kwargs)
            await asyncio.to_thread(own.open)
            runner = own
        self.harness.sync = SyncExecutor(runner, threads=self.concurrency)
        return own

    async def _close_sync(self, own: PsycopgRunner | None) -> None:
        if self.harness.sync is not None:
            self.harness.sync.shutdown()
            self.harness.sync = None
        if own is not None:
            await asyncio.to_thread(own.close)

    async def _fetch_loop(self, until: RunUntil) -> None:
        # Waiting is bounded by the poll interval, so stop() is noticed within it.
        wait = self.poll_seconds
        while not self._stopping.is_set():
            if self._outage.is_set():
                await self._recover()
                continue
            room = self.batch_size - self._buffer.qsize()
            if self._buffer.qsize() >= self._low_water or room <= 0:
                self._room.clear()
                await self._wait_or_stop(self._room.wait(), None)
                continue
            self._progress.clear()
            asked = self._leases.now() if self._leases is not None else 0.0
            try:
                deliveries = await self.queue.receive(
                    self.queues,
                    max_messages=room,
                    lease_seconds=self.lease_seconds,
                    wait_seconds=0.0 if self._busy or self._buffer.qsize() else wait,
                )
            except Exception as exc:
                await self._queue_failed("fetch jobs", exc)
                continue
            self._fetch_failures = 0
            if self._leases is not None:
                self._leases.hold(deliveries, since=asked)
            for delivery in deliveries:
                self._buffer.put_nowait(delivery)
            if deliveries:
                continue
            if not self._busy and not self._buffer.qsize():
                await self.acks.flush()  # idle: no reason to hold acks back
            if until != "stopped" and await self._finished(until):
                return
            if self._busy or self._buffer.qsize():
                await self._wait_or_stop(self._progress.wait(), self.poll_seconds)

    async def _finished(self, until: RunUntil) -> bool:
        if self._busy or self._buffer.qsize():
            return False
        if self._relay_task is not None and self._relay_task.done():
            self._relay_task.result()  # the relay stopped for good (an unmigrated database)
        # The outbox first, then the queue: a row leaves the outbox only once its message is on
        # the queue, so a job is in one or the other at every moment. Counted the other way
        # round, a message the relay published between the two counts was in neither.
        try:
            if await self._outbox_holds(until):
                return False
        except Exception as exc:
            await self._queue_failed("count the outbox", exc)
            return False
        try:
            size = await self.queue.size(self.queues)
        except Exception as exc:
            await self._queue_failed("count queued jobs", exc)
            return False
        self._fetch_failures = 0
        if self._busy or self._buffer.qsize():
            return False
        return size.due == 0 if until == "idle" else size.total == 0

    async def _queue_failed(self, doing: str, exc: Exception) -> None:
        """Back off on every queue failure, so a lasting error (a permission revoked, a table
        dropped) slows the worker down instead of spinning; a lost connection also goes through
        recovery, which gives back what this worker held."""
        self._fetch_failures += 1
        delay = min(0.5 * 2 ** (self._fetch_failures - 1), 30.0)
        if is_connection_loss(exc, None):
            self._outage_log.went_away(exc)
            self._outage.set()
        else:
            text = str(exc).strip()
            log.warning(
                "cannot %s (%s: %s); retrying in %.1fs",
                doing,
                type(exc).__name__,
                text.splitlines()[0] if text else "",
                delay,
            )
        await self._wait_or_stop(asyncio.sleep(delay), None)

    async def _wait_or_stop(self, aw: Any, max_seconds: float | None) -> None:
        await _until_set(self._stopping, aw, max_seconds)

    async def _process_loop(self) -> None:
        """Take deliveries from the buffer and run them. A processor holds one pooled connection
        while deliveries are waiting in the buffer and gives it back when it would wait, so a
        run of jobs costs one pool checkout and the fetch never starves. While it holds the
        connection, the harness may start the next waiting job together with one's commit
        (:class:`~jobfence.harness.Lookahead`)."""
        carried: Delivery | None = None  # held for the next connection: the last was retired
        while True:
            waiting: Delivery | None = (
                carried if carried is not None else self._take(await self._buffer.get())
            )
            carried = None
            ahead = Lookahead(self._take_waiting, self._take_spare)
            try:
                async with self._pool.connection() as conn:
                    while waiting is not None:
                        delivery, waiting = waiting, None
                        group = self._gather(delivery, ahead)
                        if group is not None:
                            if not await self._process_group(group, conn):
                                break
                        elif not await self._process(delivery, conn, ahead):
                            break
                        if self._stopping.is_set():
                            break  # a job held ahead has not started: given back below
                        waiting = ahead.next() or self._take_waiting()
                    if (left := await ahead.abandon()) is not None:
                        if self._stopping.is_set():  # released with the rest at shutdown
                            self._give_back([left], asyncio.CancelledError())
                        elif retired(conn):  # a handler changed its session: on another one
                            carried = left
                        else:  # the connection broke
                            self._give_back([left], ConnectionError("the connection was lost"))
                    # Idle while a sync handler's job ran on the sync pool, it may have been
                    # cut with the others; given back as it is, the next fetch would fail on
                    # it after the database is back, as a second outage.
                    await _close_if_cut(conn)
            except BaseException as exc:
                left = await ahead.abandon()
                stranded = [held for held in (waiting, left, carried) if held is not None]
                carried = None
                self._give_back(stranded, exc)
                if not isinstance(exc, Exception):
                    raise
                if not stranded:
                    # not about a delivery: returning the connection failed
                    log.warning("could not return a connection to the pool: %s", reason(exc))

    def _take_waiting(self) -> Delivery | None:
        """The next delivery in the buffer, if one is there now, counted as busy."""
        try:
            return self._take(self._buffer.get_nowait())
        except asyncio.QueueEmpty:
            return None

    def _take_spare(self) -> Delivery | None:
        """:meth:`_take_waiting`, only when the buffer holds a delivery for every processor:
        a sync handler's job takes the next one before its handler runs (to begin it with its
        COMMIT), and must not keep it from a processor that would otherwise wait idle."""
        if self._buffer.qsize() < self.concurrency:
            return None
        try:
            # Not started: its job waits for this one's handler (see _process).
            return self._take(self._buffer.get_nowait(), started=False)
        except asyncio.QueueEmpty:
            return None

    def _done(self, delivery: Delivery) -> None:
        """``delivery`` taken with :meth:`_take` is no longer this processor's."""
        self._busy -= 1
        self._buffer.task_done()
        self._progress.set()
        if self._leases is not None:
            self._leases.forget(delivery)

    async def _process(self, delivery: Delivery, conn: Any, ahead: Lookahead | None) -> bool:
        """Run one delivery on ``conn`` (None: on a connection of the pool); False when
        ``conn`` should go back to the pool (the database went away, or a handler changed its
        session: :func:`jobfence.guard.retire`)."""
        if self._leases is not None:
            self._leases.started(delivery)  # taken early, it starts now (else: a no-op)
        try:
            outcome = await self.harness.handle(delivery, conn, ahead)
            self.stats.outcomes[outcome] += 1
        except InfrastructureError as exc:
            self._lost(delivery, exc)
            if conn is not None:
                await _close_if_cut(conn)
            return False
        except asyncio.CancelledError:
            self._unreleased.append(delivery)
            raise
        except Exception:
            log.exception(
                "internal error handling job %s; it stays leased and comes back when its "
                "lease runs out",
                delivery.message.job_id,
                extra=log_fields(delivery),
            )
        finally:
            self._done(delivery)
        return conn is None or not (conn.broken or retired(conn))

    def _gather(self, delivery: Delivery, ahead: Lookahead) -> list[Delivery] | None:
        """``delivery`` and the deliveries waiting right after it for the same consumer, when
        that consumer commits jobs in groups (``jobs_per_transaction``) and more than one is
        there; else None. A waiting delivery of another consumer is held in ``ahead``, next."""
        consumer = self.app.get(delivery.message.consumer)
        if consumer is None or consumer.jobs_per_transaction == 1:
            return None
        # Held there unstarted (the harness starts no grouped job ahead): take it back.
        ahead.resume(delivery)
        group = [delivery]
        while len(group) < consumer.jobs_per_transaction:
            more = self._take_waiting()
            if more is None:
                break
            if more.message.consumer != consumer.name:
                ahead.hold(more)
                break
            group.append(more)
        return group if len(group) > 1 else None

    async def _process_group(self, group: list[Delivery], conn: Any) -> bool:
        """Run ``group`` in one transaction, or one by one if the group rolled back; False
        when ``conn`` should go back to the pool (the database went away)."""
        try:
            outcomes = await self.harness.handle_group(group, conn)
        except InfrastructureError as exc:
            self._give_back(group, exc)
            await _close_if_cut(conn)
            return False
        except asyncio.CancelledError as exc:
            self._give_back(group, exc)
            raise
        except Exception:
            # Each then runs alone, where an internal failure has its bounded rule (a fallback
            # dead letter at the latest at delivery INTERNAL_FAILURE_DELIVERIES); a job whose
            # group did commit is a duplicate there.
            log.exception(
                "internal error handling a group of %d jobs; running them one transaction each",
                len(group),
            )
            outcomes = None
        if outcomes is None:
            return await self._process_each(group, conn)
        self.stats.outcomes.update(outcomes)
        for delivery in group:
            self._done(delivery)
        return not (conn.broken or retired(conn))

    async def _process_each(self, group: list[Delivery], conn: Any) -> bool:
        """A group that rolled back: each delivery in its own transaction, under the failure
        policy of a single job."""
        alone = Lookahead(lambda: None)  # nothing starts ahead of these
        on = conn
        for index, delivery in enumerate(group):
            try:
                ok = await self._process(delivery, on, alone if on is not None else None)
            except BaseException as exc:
                self._give_back(group[index + 1 :], exc)
                raise
            if not ok:
                if retired(on) and not on.broken:  # a handler changed its session
                    on = None  # the rest each on a connection of the pool
                    continue
                self._give_back(group[index + 1 :], ConnectionError("the connection was lost"))
                return False
        return on is conn

    def _give_back(self, deliveries: list[Delivery], exc: BaseException) -> None:
        """Deliveries taken with :meth:`_take` that will not run here: lost with the database
        (``exc`` an error: kept to release after recovery, D7), or cut off by shutdown
        (cancelled: released at the end)."""
        for delivery in deliveries:
            self._done(delivery)
            if isinstance(exc, Exception):
                self._lost(delivery, exc)
            else:
                self._unreleased.append(delivery)

    def _take(self, delivery: Delivery, *, started: bool = True) -> Delivery:
        """Count a delivery taken from the buffer as busy (until :meth:`_process` is done);
        ``started``: its job starts now (the lease keeper's handler clock starts)."""
        self._busy += 1
        if self._buffer.qsize() < self._low_water:
            self._room.set()
        if started and self._leases is not None:
            self._leases.started(delivery)
        return delivery

    def _lost(self, delivery: Delivery, exc: Exception) -> None:
        """The database went away while ``delivery`` was ours: keep it to give back, and let
        the fetch loop recover (D7)."""
        log.debug(
            "database unreachable while handling job %s: %s",
            delivery.message.job_id,
            reason(exc),
            extra=log_fields(delivery),
        )
        self._outage_log.went_away(exc)
        self._unreleased.append(delivery)
        self._outage.set()
        self._room.set()

    async def _recover(self) -> None:
        """D7: the database or the queue is unreachable. Pause, probe both (backing off), then
        give back what we held.

        A processor may still lose its job while the held ones are given back (its connection
        was cut with the others, and it finds out only now): that job is held again and the
        outage flag set again, so recovery goes round once more and gives it back too, instead
        of leaving it leased until its lease runs out."""
        backoff = 0.5
        released = self.stats.released
        while not self._stopping.is_set():
            self._drain_buffer_to_unreleased()
            if self._outage_log.read_only and not self.queue.capabilities.transactional:
                # The database refuses writes but the broker answers: what this worker holds
                # goes back now, not when its lease runs out (which would count a delivery).
                await self._release_held()
            try:
                async with self._pool.connection(timeout=5.0) as conn:
                    # Not only reachable: accepting writes (a standby or a read-only window
                    # answers SELECT 1 and refuses every job's fence).
                    await check_writable(conn)
                # The outage may be the broker's: probe it too, with a cheap call.
                await self.queue.size(self.queues)
            except Exception as exc:
                self._outage_log.still_down(exc)
                if isinstance(exc, DatabaseReadOnly):
                    # Its other idle sessions were opened alike: new ones for the next probe.
                    with contextlib.suppress(Exception):
                        await drop_read_only_connections(self._pool)
                await self._wait_or_stop(asyncio.sleep(backoff), None)
                # Not further apart: once the database is back, jobs resume within seconds.
                backoff = min(backoff * 2, RECONNECT_MAX_DELAY_SECONDS)
                continue
            # The pool's idle connections the outage cut: found now (a round trip each), not
            # by the next fetch, which would fail on one as a second outage.
            with contextlib.suppress(Exception):
                await self._pool.check()
            if self._outage_log.read_only:
                # The sessions opened while it refused writes stay read-only (and after a
                # failover talk to the old primary): new ones, which resolve the host again.
                with contextlib.suppress(Exception):
                    await drop_read_only_connections(self._pool)
            # Cleared before giving back, not after: a job lost from now on sets it again.
            self._outage.clear()
            await self._release_held()
            if not self._outage.is_set():
                self._outage_log.back(self.stats.released - released)
                return
        self._outage.set()  # stopping: shutdown releases what is held, as far as it can

    def _drain_buffer_to_unreleased(self) -> None:
        while True:
            try:
                delivery = self._buffer.get_nowait()
            except asyncio.QueueEmpty:
                return
            self._buffer.task_done()
            self._unreleased.append(delivery)
            if self._leases is not None:
                self._leases.forget(delivery)

    async def _release_held(self) -> None:
        """Give back every held delivery. A release that fails on a connection the outage cut
        and the pool still held idle is tried again (the pool has dropped that connection),
        at most the pool's ``max_size`` times in all: one stale connection does not leave a job
        leased until its lease runs out."""
        held, self._unreleased = self._unreleased, []
        failed, error = 0, None
        stale_tries = self._pool.max_size
        for delivery in held:
            while True:
                try:
                    await self.queue.release(delivery)
                except Exception as exc:
                    if stale_tries > 0 and _on_a_cut_connection(exc):
                        stale_tries -= 1
                        continue
                    failed, error = failed + 1, exc
                    log.debug(
                        "could not release job %s (%s)",
                        delivery.message.job_id,
                        reason(exc),
                        extra=log_fields(delivery),
                    )
                else:
                    self.stats.released += 1
                break
        if error is not None:  # one line, not one per job
            log.warning(
                "could not release %d job(s) (%s); they return when their lease runs out",
                failed,
                reason(error),
            )

    async def _shutdown(self, processors: list[asyncio.Task[None]]) -> None:
        """Give back at once what has not started, so other workers can take it; let running
        jobs finish within the grace period; give back whatever was cut off."""
        self._drain_buffer_to_unreleased()
        if not self._outage.is_set():
            await self._release_held()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_grace_seconds
        while self._busy and not self._stop_now.is_set():
            if (remaining := deadline - loop.time()) <= 0:
                break
            self._progress.clear()
            await _until_set(self._stop_now, self._progress.wait(), remaining)
        self.stats.cut_off = self._busy
        for task in processors:
            task.cancel()
        for task in processors:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.acks.close()
        await self._release_held()


def _lease_keeper(
    queue: QueuePort,
    lease_seconds: float,
    max_handler_seconds: float | None,
    metrics: LeaseMetricsSink | None,
) -> LeaseKeeper | None:
    """The worker's :class:`LeaseKeeper` with ``max_handler_seconds``, checked; None without."""
    if max_handler_seconds is None:
        return None
    if not (lease_seconds < max_handler_seconds < float("inf")):
        raise ConfigError(
            f"max_handler_seconds must be a number of seconds above lease_seconds"
            f" ({lease_seconds:g}), got {max_handler_seconds}: a lease is extended only while"
            " the handler has run less than it"
        )
    if not callable(getattr(queue, "extend", None)):
        raise ConfigError(
            f"max_handler_seconds needs a queue adapter with extend(); {type(queue).__name__}"
            " has none"
        )
    return LeaseKeeper(
        queue,
        lease_seconds=lease_seconds,
        max_handler_seconds=max_handler_seconds,
        metrics=metrics,
    )


def _on_a_cut_connection(exc: Exception) -> bool:
    """Whether ``exc`` is a lost connection met on a connection the pool lent (not a pool
    timeout: then the pool had none to lend, and trying again only waits again)."""
    return is_connection_loss(exc, None) and not isinstance(exc, PoolTimeout)


async def _close_if_cut(conn: Any) -> None:
    """After the database went away during a job, close the connection the processor held if
    it looks broken (:func:`~jobfence.db.looks_broken`, no round trip), so that the pool it
    goes back to replaces it instead of lending it again after the recovery; the same for a
    session the server made read-only (:func:`~jobfence.db.session_read_only`). A sync handler's
    job ran on the sync pool, leaving this one idle: cut with the others, it is not yet known
    to be broken."""
    if not conn.closed and (looks_broken(conn) or session_read_only(conn)):
        with contextlib.suppress(Exception):
            await conn.close()


async def _until_set(event: asyncio.Event, aw: Any, max_seconds: float | None) -> None:
    """Wait for ``aw``, at most until ``event`` is set or ``max_seconds`` have passed."""
    setting = asyncio.ensure_future(event.wait())
    other = asyncio.ensure_future(aw)
    try:
        await asyncio.wait(
            {setting, other}, timeout=max_seconds, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for task in (setting, other):
            task.cancel()
