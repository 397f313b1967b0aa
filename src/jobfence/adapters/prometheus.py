"""Metrics through prometheus_client, on a registry the application injects."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OUTCOMES = ("succeeded", "duplicate", "retried", "dead_lettered", "poison", "lease_lost")

DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

# Blocks of the event loop (blocked_loop_seconds is 1 s by default, 0.1 s at the least).
LOOP_BLOCKED_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class PrometheusMetrics:
    """The harness's counters and histogram.

    ``jobfence_jobs_total{queue, consumer, outcome}`` counts every delivery's outcome
    (succeeded, duplicate, retried, dead_lettered, poison, lease_lost,
    internal_error);
    ``jobfence_handler_duration_seconds
    {queue, consumer}`` times handlers that ran; ``jobfence_retries_scheduled_total{queue,
    consumer}`` counts retries put on the queue (one per ``retried`` outcome);
    ``jobfence_job_groups_total{queue, consumer, result}`` counts the groups of a consumer with
    ``jobs_per_transaction`` > 1, ``committed`` or ``rolled_back``. With the worker's
    ``max_handler_seconds`` (it is also a :class:`~jobfence.ports.LeaseMetricsSink`),
    ``jobfence_lease_extensions_total{queue, consumer, result}`` counts lease extensions
    (``extended``, ``lost``, ``failed``) and ``jobfence_handlers_over_limit_total{queue,
    consumer}`` the handlers that ran past it. As the worker's
    :class:`~jobfence.ports.LoopMetricsSink`, ``jobfence_event_loop_blocked_total{queue,
    consumer}`` counts the blocks of its event loop past ``blocked_loop_seconds`` and
    ``jobfence_event_loop_blocked_seconds{queue, consumer}`` times them (the async handler that
    held the loop; both labels empty when none did). Successes are metrics, never rows (D10).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.jobs = Counter(
            "jobfence_jobs",
            "Deliveries handled, by outcome.",
            ("queue", "consumer", "outcome"),
            registry=self.registry,
        )
        self.duration = Histogram(
            "jobfence_handler_duration_seconds",
            "Time spent in the handler call (not the fence insert or the commit), in seconds.",
            ("queue", "consumer"),
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "jobfence_retries_scheduled",
            "Retries scheduled after a transient failure (the next delivery is on the queue).",
            ("queue", "consumer"),
            registry=self.registry,
        )
        self.groups = Counter(
            "jobfence_job_groups",
            "Groups of jobs run in one transaction (group commit), by result: committed, or"
            " rolled_back (its jobs then ran one transaction each).",
            ("queue", "consumer", "result"),
            registry=self.registry,
        )

        self.lease_extensions = Counter(
            "jobfence_lease_extensions",
            "Lease extensions of jobs held by the worker (max_handler_seconds), by result:"
            " extended, lost (the queue refused: the lease was gone), failed (an error).",
            ("queue", "consumer", "result"),
            registry=self.registry,
        )
        self.handlers_over_limit = Counter(
            "jobfence_handlers_over_limit",
            "Handlers that ran past max_handler_seconds (hung?): their lease was no longer"
            " extended and the job was left to be delivered again.",
            ("queue", "consumer"),
            registry=self.registry,
        )

        self.loop_blocked = Counter(
            "jobfence_event_loop_blocked",
            "Times the worker's event loop did not run for longer than blocked_loop_seconds"
            " (counted when noticed, once per block), by the async handler that held it (queue"
            " and consumer empty: none did).",
            ("queue", "consumer"),
            registry=self.registry,
        )
        self.loop_blocked_seconds = Histogram(
            "jobfence_event_loop_blocked_seconds",
            "How long each of those blocks of the event loop lasted in all, in seconds.",
            ("queue", "consumer"),
            buckets=LOOP_BLOCKED_BUCKETS,
            registry=self.registry,
        )

        # The labelled children, looked up once per label set: the job path calls both methods
        # for every job, and the labels are bounded (registered queues and consumers).
        self._job_children: dict[tuple[str, str, str], Counter] = {}
        self._duration_children: dict[tuple[str, str], Histogram] = {}

    def job_outcome(self, queue: str, consumer: str, outcome: str) -> None:
        key = (queue, consumer, outcome)
        child = self._job_children.get(key)
        if child is None:
            child = self._job_children[key] = self.jobs.labels(queue, consumer, outcome)
        child.inc()
        if outcome == "retried":
            self.retries.labels(queue, consumer).inc()

    def handler_duration(self, queue: str, consumer: str, seconds: float) -> None:
        key = (queue, consumer)
        child = self._duration_children.get(key)
        if child is None:
            child = self._duration_children[key] = self.duration.labels(queue, consumer)
        child.observe(seconds)

    def job_group(self, queue: str, consumer: str, result: str) -> None:
        self.groups.labels(queue, consumer, result).inc()

    def lease_extension(self, queue: str, consumer: str, result: str) -> None:
        self.lease_extensions.labels(queue, consumer, result).inc()

    def handler_over_limit(self, queue: str, consumer: str) -> None:
        self.handlers_over_limit.labels(queue, consumer).inc()

    def event_loop_blocked(self, queue: str, consumer: str) -> None:
        self.loop_blocked.labels(queue, consumer).inc()

    def event_loop_unblocked(self, queue: str, consumer: str, seconds: float) -> None:
        self.loop_blocked_seconds.labels(queue, consumer).observe(seconds)

    def count(self, outcome: str, *, consumer: str | None = None) -> float:
        """Sum of ``jobfence_jobs_total`` for ``outcome`` (over all consumers unless named)."""
        total = 0.0
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name != "jobfence_jobs_total":
                    continue
                if sample.labels.get("outcome") != outcome:
                    continue
                if consumer is not None and sample.labels.get("consumer") != consumer:
                    continue
                total += sample.value
        return total


class PrometheusCleanupMetrics:
    """The fence cleanup's metrics (a :class:`~jobfence.ports.CleanupMetricsSink`).

    ``jobfence_cleanup_rows_removed_total`` counts expired fence rows deleted (per committed
    batch); ``jobfence_cleanup_last_success_timestamp_seconds`` is the Unix time the last
    cleanup round finished without error (0 until one has): alert when it is too old;
    ``jobfence_cleanup_failures_total`` counts rounds that failed.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rows_removed = Counter(
            "jobfence_cleanup_rows_removed",
            "Expired fence rows deleted by the TTL cleanup.",
            registry=self.registry,
        )
        self.last_success = Gauge(
            "jobfence_cleanup_last_success_timestamp_seconds",
            "Unix time at which the last cleanup round finished without error (0: never).",
            registry=self.registry,
        )
        self.failures = Counter(
            "jobfence_cleanup_failures",
            "Cleanup rounds that failed (database error).",
            registry=self.registry,
        )

    def cleanup_rows_removed(self, count: int) -> None:
        self.rows_removed.inc(count)

    def cleanup_succeeded(self) -> None:
        self.last_success.set_to_current_time()

    def cleanup_failed(self) -> None:
        self.failures.inc()


ALERT_KINDS = ("dead_letters", "escalation")
ALERT_FAILURE_REASONS = ("network", "rate_limited", "server_error", "rejected")
INCIDENT_ACTIONS = (
    "opened",
    "merged",
    "updated",
    "resolved",
    "resolved_by_person",
    "escalated",
    "storm",
)


class PrometheusAlertMetrics:
    """The Better Stack relay's metrics (a :class:`~jobfence.ports.AlertMetricsSink`).

    ``jobfence_alerts_sent_total{kind}`` counts alerts handled (kind: dead_letters or
    escalation: an incident opened, a group counted on the open one, or that one escalated);
    ``jobfence_alerts_failed_total{kind, reason}`` counts failed attempts (reason: network,
    rate_limited, server_error, or rejected for a 4xx that is not retried);
    ``jobfence_alerts_pending`` is how many alerts wait to be delivered, as the relay last saw.
    ``jobfence_alert_incidents_total{action}`` counts incident lifecycle steps (opened, merged,
    updated, resolved, resolved_by_person, escalated, and storm: an alert storm incident opened,
    also counted as opened); ``jobfence_alerts_refused`` is how many
    alerts and resolves Better Stack refused for good (waiting for ``--retry-failed``);
    ``jobfence_alert_relay_heartbeat_ok`` is 1 while the relay's heartbeat reports success, 0
    while it reports failure.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.sent = Counter(
            "jobfence_alerts_sent",
            "Alerts handled at Better Stack (incident opened, counted on the open one, or "
            "escalated), by kind.",
            ("kind",),
            registry=self.registry,
        )
        self.failed = Counter(
            "jobfence_alerts_failed",
            "Failed attempts to deliver an alert, by kind and reason.",
            ("kind", "reason"),
            registry=self.registry,
        )
        self.pending = Gauge(
            "jobfence_alerts_pending",
            "Alerts waiting to be delivered to Better Stack.",
            registry=self.registry,
        )

        self.incidents = Counter(
            "jobfence_alert_incidents",
            "Incident lifecycle steps at Better Stack, by action.",
            ("action",),
            registry=self.registry,
        )
        for action in INCIDENT_ACTIONS:
            self.incidents.labels(action)
        self.refused = Gauge(
            "jobfence_alerts_refused",
            "Alerts and resolves refused for good by Better Stack (until --retry-failed).",
            registry=self.registry,
        )
        self.heartbeat_ok = Gauge(
            "jobfence_alert_relay_heartbeat_ok",
            "1 while the alert relay's heartbeat reports success, 0 while it reports failure.",
            registry=self.registry,
        )
        self.heartbeat_ok.set(1)

    def alert_sent(self, kind: str) -> None:
        self.sent.labels(kind).inc()

    def incident_action(self, action: str) -> None:
        self.incidents.labels(action).inc()

    def alerts_refused(self, count: int) -> None:
        self.refused.set(count)

    def heartbeat_state(self, ok: bool) -> None:
        self.heartbeat_ok.set(1 if ok else 0)

    def alert_failed(self, kind: str, reason: str) -> None:
        self.failed.labels(kind, reason).inc()

    def alerts_pending(self, count: int) -> None:
        self.pending.set(count)


class PrometheusOutboxMetrics:
    """The outbox relay's metrics (a :class:`~jobfence.outbox.OutboxMetricsSink`).

    ``jobfence_outbox_published_total`` counts messages the broker confirmed;
    ``jobfence_outbox_failed_total`` counts failed publishes (each is retried: the row stays);
    ``jobfence_outbox_waiting`` is how many rows wait in the outbox (scheduled ones included)
    and ``jobfence_outbox_oldest_age_seconds`` how long the longest-waiting publishable row has
    waited since it fell due (0 when none is due), as the active relay last saw them.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.published = Counter(
            "jobfence_outbox_published",
            "Outbox messages published to the queue and confirmed by it.",
            registry=self.registry,
        )
        self.failed = Counter(
            "jobfence_outbox_failed",
            "Failed publishes of outbox messages (each stays in the outbox and is retried).",
            registry=self.registry,
        )
        self.waiting = Gauge(
            "jobfence_outbox_waiting",
            "Messages waiting in the outbox, scheduled ones included.",
            registry=self.registry,
        )
        self.oldest_age = Gauge(
            "jobfence_outbox_oldest_age_seconds",
            "Seconds the longest-waiting publishable outbox message has waited since it fell"
            " due (0 when none is due; a message still waiting out its delay does not count).",
            registry=self.registry,
        )

    def outbox_published(self, count: int) -> None:
        self.published.inc(count)

    def outbox_failed(self) -> None:
        self.failed.inc()

    def outbox_waiting(self, count: int, oldest_age_seconds: float) -> None:
        self.waiting.set(count)
        self.oldest_age.set(oldest_age_seconds)
