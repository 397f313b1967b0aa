"""Small pieces every non-transactional queue adapter needs, written once."""

from __future__ import annotations

from typing import TypeVar

from jobfence.errors import ConfigError
from jobfence.model import Delivery

R = TypeVar("R")


def receipt_of(delivery: Delivery, kind: type[R], adapter: str) -> R:
    """``delivery``'s receipt as ``kind``, or a ``TypeError`` naming ``adapter`` when the
    delivery came from another adapter."""
    receipt = delivery.receipt
    if not isinstance(receipt, kind):
        raise TypeError(f"this delivery did not come from {adapter}")
    return receipt


def refuse_tx(adapter: str, operation: str, *, instead: str = "") -> ConfigError:
    """The error a non-transactional adapter raises when asked to ``operation`` inside a
    database transaction (``tx=``)."""
    return ConfigError(
        f"{adapter} is not transactional (capabilities.transactional is False): it cannot "
        f"{operation} inside a database transaction; call it without tx= after the transaction "
        f"commits{instead}"
    )
