"""jobfence: queue consumers that apply each job's effect once, and lose no failure.

The public API is what ``__all__`` lists; everything else is private.
"""

from jobfence.adapters.memory import MemoryQueue
from jobfence.adapters.pg_queue import PgQueue
from jobfence.adapters.prometheus import PrometheusMetrics
from jobfence.alerts import AlertRelay
from jobfence.app import App, Consumer
from jobfence.cleanup import CleanupResult, cleanup_expired
from jobfence.db import open_pool, resolve_database_url
from jobfence.dead_letters import (
    DeadLetter,
    ReplayResult,
    discard_dead_letter,
    get_dead_letter,
    replay_dead_letter,
)
from jobfence.errors import (
    ConfigError,
    DatabaseUnavailable,
    DeadLetterConflict,
    DeadLetterNotFound,
    DeadLetterNotReplayable,
    HandlerExited,
    HardFailure,
    JobfenceError,
    JobRefused,
    PoisonMessage,
    PublishRefused,
    QueueMoved,
    QueueUnavailable,
    TransactionAborted,
    TransactionMisuse,
)
from jobfence.harness import Outcome
from jobfence.model import Delivery, JobMeta, Message
from jobfence.observability import configure_logging, metrics_registry
from jobfence.ops import BulkReplayNotFound, BulkTooLarge, InvalidRequest
from jobfence.ports import Clock, MetricsSink, QueueCapabilities, QueuePort, QueueSize
from jobfence.producer import Producer
from jobfence.retry import DEFAULT_RETRY_POLICY, RetryPolicy
from jobfence.schema import migrate
from jobfence.worker import Worker, WorkerStats

__all__ = [
    "AlertRelay",
    "App",
    "BulkReplayNotFound",
    "BulkTooLarge",
    "CleanupResult",
    "Clock",
    "ConfigError",
    "QueueMoved",
    "Consumer",
    "DEFAULT_RETRY_POLICY",
    "DatabaseUnavailable",
    "QueueUnavailable",
    "DeadLetter",
    "DeadLetterConflict",
    "DeadLetterNotFound",
    "DeadLetterNotReplayable",
    "Delivery",
    "HandlerExited",
    "HardFailure",
    "InvalidRequest",
    "JobMeta",
    "JobRefused",
    "JobfenceError",
    "MemoryQueue",
    "Message",
    "MetricsSink",
    "Outcome",
    "PgQueue",
    "PoisonMessage",
    "Producer",
    "PublishRefused",
    "PrometheusMetrics",
    "QueueCapabilities",
    "QueuePort",
    "QueueSize",
    "ReplayResult",
    "RetryPolicy",
    "TransactionAborted",
    "TransactionMisuse",
    "Worker",
    "WorkerStats",
    "cleanup_expired",
    "configure_logging",
    "discard_dead_letter",
    "get_dead_letter",
    "metrics_registry",
    "migrate",
    "open_pool",
    "replay_dead_letter",
    "resolve_database_url",
]
