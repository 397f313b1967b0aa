"""What the alert relay hands to an incident service, and the ports it talks through.

The relay (core) builds an :class:`IncidentRequest` and gives it to an :class:`IncidentSink`;
the Better Stack adapter (``jobfence.adapters.betterstack``) is the production sink. A sink
reports a failed request as a :class:`DeliveryError` that says whether trying again can help.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

#: The metadata key that carries an alert's dedup key on its incident.
DEDUP_METADATA_KEY = "jobfence_dedup_key"


@dataclass(frozen=True, slots=True)
class IncidentRequest:
    """One incident to open. ``dedup_key`` is unique per alert and travels in the metadata;
    ``metadata`` holds it (under :data:`DEDUP_METADATA_KEY`) and a few routing fields."""

    dedup_key: str
    name: str
    summary: str
    description: str
    metadata: Mapping[str, str] = field(default_factory=dict)


class DeliveryError(Exception):
    """A request to the incident service failed.

    ``retryable``: a network error, a timeout, 429 or 5xx, worth trying again later (after
    ``retry_after`` seconds when the service said so). Anything else (401, 403, 422...) is not:
    the same request would fail the same way. ``status`` is the HTTP status, if there was one.
    The message never contains credentials.
    """

    __module__ = "jobfence"

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after

    @property
    def reason(self) -> str:
        """A bounded label: network, rate_limited, server_error or rejected."""
        if self.status is None:
            return "network"
        if self.status == 429:
            return "rate_limited"
        if self.retryable:
            return "server_error"
        return "rejected"


@dataclass(frozen=True, slots=True)
class IncidentState:
    """What the incident service says of one incident: resolved (when, by whom) or not, and
    acknowledged (when, by whom) or not."""

    incident_id: str
    resolved_at: str | None = None
    resolved_by: str | None = None
    acknowledged_at: str | None = None
    acknowledged_by: str | None = None

    @property
    def resolved(self) -> bool:
        return self.resolved_at is not None


class IncidentSink(Protocol):
    """Where alerts become incidents (Better Stack in production). Every method raises
    :class:`DeliveryError` on failure."""

    async def find_incident(self, dedup_key: str) -> str | None:
        """The id of an incident, open or resolved, whose metadata carries ``dedup_key``."""

    async def create_incident(self, request: IncidentRequest) -> str:
        """Open an incident and return its id."""

    async def get_incident(self, incident_id: str) -> IncidentState:
        """The incident's current state (a 404 raises with ``status=404``)."""

    async def resolve_incident(self, incident_id: str, resolved_by: str) -> IncidentState:
        """Resolve it; an incident already resolved (409) is not an error: its state is
        returned, ``resolved_by`` saying who resolved it."""

    async def escalate_incident(self, incident_id: str) -> None:
        """Escalate the (unresolved) incident as configured."""

    async def comment_incident(self, incident_id: str, content: str) -> None:
        """Add a comment (Markdown) to the incident's timeline."""


class Heartbeat(Protocol):
    """A liveness ping (a Better Stack heartbeat URL): success, or failure (``ok=False``)."""

    async def beat(self, ok: bool = True) -> bool:
        """Send one heartbeat; True when it was accepted. Never raises."""
