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


class IncidentSink(Protocol):
    """Where alerts become incidents (Better Stack in production)."""

    async def find_incident(self, dedup_key: str) -> str | None:
        """The id of an incident, open or resolved, whose metadata carries ``dedup_key``."""

    async def create_incident(self, request: IncidentRequest) -> str:
        """Open an incident and return its id; raise :class:`DeliveryError` on failure."""


class Heartbeat(Protocol):
    """A liveness ping sent after a successful round (a Better Stack heartbeat URL)."""

    async def beat(self) -> bool:
        """Send one heartbeat; True when it was accepted. Never raises."""
