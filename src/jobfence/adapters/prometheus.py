"""Metrics through prometheus_client, on a registry the application injects."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

OUTCOMES = ("succeeded", "duplicate", "retried", "dead_lettered", "poison")

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


class PrometheusMetrics:
    """The harness's counters and histogram.

    ``jobfence_jobs_total{queue, consumer, outcome}`` counts every delivery's outcome
    (succeeded, duplicate, retried, dead_lettered, poison); ``jobfence_handler_duration_seconds
    {queue, consumer}`` times handlers that ran. Successes are metrics, never rows (D10).
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

    def job_outcome(self, queue: str, consumer: str, outcome: str) -> None:
        self.jobs.labels(queue, consumer, outcome).inc()

    def handler_duration(self, queue: str, consumer: str, seconds: float) -> None:
        self.duration.labels(queue, consumer).observe(seconds)

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
