"""Plain data that flows through the harness: messages, deliveries and job metadata."""

from __future__ import annotations

from dataclasses import dataclass

from jobfence.limits import shown_value


@dataclass(frozen=True, slots=True)
class Message:
    """A job to publish: addressed to one consumer on one queue, identified by ``job_id``.

    ``body`` is the payload's bytes, normally UTF-8 JSON. The same ``job_id`` published twice
    to the same consumer produces one effect.
    """

    queue: str
    consumer: str
    job_id: str
    body: bytes
    tenant_id: str | None = None
    correlation_id: str | None = None
    # The W3C trace context of the span that produced it (jobfence.tracing), validated where it
    # enters jobfence: None when there was none or it did not parse.
    traceparent: str | None = None
    tracestate: str | None = None


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message of a :meth:`~jobfence.ports.QueuePort.publish_many`, with the deliveries its
    job already had elsewhere (``prior_attempts``: its first delivery has attempt
    ``prior_attempts + 1``).

    ``publish_id`` names this publish: a broker that drops a second publish of the same id
    (JetStream's ``Nats-Msg-Id``, within the stream's duplicate window) stores the message once
    however many times a lost or late confirm makes the publisher send it. The outbox relay gives
    each row its own (letters and digits); an adapter whose broker keeps no such ids ignores it.
    """

    message: Message
    prior_attempts: int = 0
    publish_id: str | None = None


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery of a message to a worker, held under a lease until acked or given back.

    ``attempt`` counts deliveries of this message, the first included (D1). ``receipt`` is the
    adapter's own handle for ack, retry and release; the core never looks inside it.

    ``unreadable`` says why the adapter could not read the message as it was published (a
    header or field that does not parse, or is out of bounds): ``message`` then holds what
    could be read, and the harness dead-letters it at once as ``UnfenceableMessage``, whole.
    """

    message: Message
    attempt: int
    receipt: object
    unreadable: str | None = None


@dataclass(frozen=True, slots=True)
class JobMeta:
    """What a handler knows about the job it is running."""

    job_id: str
    consumer: str
    queue: str
    tenant_id: str | None
    correlation_id: str | None
    attempt: int


def job_log_fields(job: JobMeta) -> dict[str, object]:
    """The structured fields of a log line about ``job`` (pass as ``extra=``): job_id,
    consumer, queue, tenant_id, correlation_id (each as :func:`shown_value`) and attempt."""
    return {
        "job_id": shown_value(job.job_id),
        "consumer": shown_value(job.consumer),
        "queue": shown_value(job.queue),
        "tenant_id": shown_value(job.tenant_id),
        "correlation_id": shown_value(job.correlation_id),
        "attempt": job.attempt,
    }
