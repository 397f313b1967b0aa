"""Better Stack alerting on dead letters: recorded with the dead letter, grouped, delivered
once by the relay, escalated per D4. See :mod:`jobfence.alerts.relay` for the flow."""

from jobfence.alerts.model import (
    DEDUP_METADATA_KEY,
    DeliveryError,
    Heartbeat,
    IncidentRequest,
    IncidentSink,
    IncidentState,
)
from jobfence.alerts.outbox import AlertCounts, alert_counts, record_dead_letter_alerts
from jobfence.alerts.relay import AlertRelay, RelaySettings, RelayStats, retry_failed_alerts

__all__ = [
    "DEDUP_METADATA_KEY",
    "AlertCounts",
    "AlertRelay",
    "DeliveryError",
    "Heartbeat",
    "IncidentRequest",
    "IncidentSink",
    "IncidentState",
    "RelaySettings",
    "RelayStats",
    "alert_counts",
    "record_dead_letter_alerts",
    "retry_failed_alerts",
]
