"""The Ops management HTTP API (``jobfence api``): dead letters over HTTP, behind D9 tokens."""

from jobfence.api.app import create_app
from jobfence.api.auth import (
    PERMISSION_DISCARD,
    PERMISSION_READ,
    PERMISSION_REPLAY,
    ApiSettings,
)

__all__ = [
    "ApiSettings",
    "PERMISSION_DISCARD",
    "PERMISSION_READ",
    "PERMISSION_REPLAY",
    "create_app",
]
