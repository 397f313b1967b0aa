"""Turn a broker client's connection errors into :class:`~jobfence.errors.QueueUnavailable`."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from jobfence.errors import QueueUnavailable
from jobfence.redact import redact_text

P = ParamSpec("P")
T = TypeVar("T")


def unavailable_on(
    broker: str, errors: tuple[type[BaseException], ...]
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """Decorate a port method: ``errors`` (a dropped or refused connection, a timeout, and a
    ``RuntimeError`` saying the connection or channel is closed) become ``QueueUnavailable``
    with the original as ``__cause__``."""

    def decorate(method: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(method)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return await method(*args, **kwargs)
            except QueueUnavailable:
                raise
            except errors as exc:
                raise QueueUnavailable(f"{broker} unreachable: {_text(exc)}") from exc
            except RuntimeError as exc:
                if "closed" not in str(exc).lower():
                    raise
                raise QueueUnavailable(f"{broker} unreachable: {_text(exc)}") from exc

        return wrapper

    return decorate


def _text(exc: BaseException) -> str:
    text = str(exc).strip()
    first = redact_text(text.splitlines()[0]) if text else ""  # a client may quote its URL
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


__all__ = ["unavailable_on"]
