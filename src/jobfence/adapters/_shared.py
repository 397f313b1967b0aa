"""Small pieces the queue adapters need, written once: the receipt check, and the refusals of a
transaction and of a delay an adapter cannot honour."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeVar

from jobfence.errors import ConfigError
from jobfence.model import Delivery, Outgoing

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


def refuse_delay(adapter: str, operation: Literal["publish", "retry"], why: str) -> ConfigError:
    """The error an adapter without native delay (``capabilities.delayed_publish`` or
    ``delayed_retry`` False) raises when asked to ``operation`` with a delay, before it changes
    anything. ``why`` says what the broker lacks."""
    capability = "delayed_publish" if operation == "publish" else "delayed_retry"
    if operation == "publish":
        instead = (
            "publish without a delay, or write the message to the PostgreSQL outbox with its"
            " delay (jobfence.outbox.write(conn, message, delay_seconds=...), committed; App."
            "enqueue does this on a broker) and the outbox relay publishes it when due"
        )
    else:
        instead = (
            "retry without a delay, or go through the PostgreSQL outbox as the worker does:"
            " commit jobfence.outbox.schedule(conn, delivery.message, delay,"
            " prior_attempts=delivery.attempt), then ack the delivery; the outbox relay"
            " publishes the retry when due"
        )
    return ConfigError(
        f"{adapter} has no delayed {operation} (capabilities.{capability} is False): {why};"
        f" {instead}"
    )


def check_prior_attempts(prior_attempts: int) -> int:
    """``prior_attempts`` of a publish, refused (``ValueError``) unless a count >= 0."""
    if isinstance(prior_attempts, bool) or not isinstance(prior_attempts, int):
        raise TypeError(f"prior_attempts must be an int, got {type(prior_attempts).__name__}")
    if prior_attempts < 0:
        raise ValueError(f"prior_attempts must be >= 0, got {prior_attempts}")
    return prior_attempts


async def publish_each(
    publish: Callable[[Outgoing], Awaitable[None]], outgoing: Sequence[Outgoing]
) -> list[Exception | None]:
    """``publish_many`` for an adapter whose publishes are cheap and local (the memory queue,
    the PostgreSQL queue): one after the other, each message's error in its place."""
    results: list[Exception | None] = []
    for item in outgoing:
        try:
            await publish(item)
        except Exception as exc:
            results.append(exc)
        else:
            results.append(None)
    return results
