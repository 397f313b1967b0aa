"""Turn a broker client's connection errors into :class:`~jobfence.errors.QueueUnavailable`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from jobfence.errors import QueueUnavailable
from jobfence.redact import redact_text

P = ParamSpec("P")
T = TypeVar("T")


def unavailable_on(
    broker: str,
    errors: tuple[type[BaseException], ...],
    *,
    also: Callable[[Exception], bool] | None = None,
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """Decorate a port method: ``errors`` (a dropped or refused connection, a timeout, and a
    ``RuntimeError`` saying the connection or channel is closed), and any other error ``also``
    says yes to, become ``QueueUnavailable`` with the original as ``__cause__``."""

    def decorate(method: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(method)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return await method(*args, **kwargs)
            except Exception as exc:
                raised = as_unavailable(broker, errors, exc, also=also)
                if raised is exc:
                    raise
                raise raised from exc

        return wrapper

    return decorate


def as_unavailable(
    broker: str,
    errors: tuple[type[BaseException], ...],
    exc: Exception,
    *,
    also: Callable[[Exception], bool] | None = None,
) -> Exception:
    """``exc`` as :func:`unavailable_on` raises it: a ``QueueUnavailable`` (with ``exc`` as its
    ``__cause__``) for a lost connection, else ``exc`` itself; for an error that is not raised
    but reported (one message's result among others)."""
    if isinstance(exc, QueueUnavailable):
        return exc
    if (
        isinstance(exc, errors)
        or (isinstance(exc, RuntimeError) and "closed" in str(exc).lower())
        or (also is not None and also(exc))
    ):
        unavailable = QueueUnavailable(f"{broker} unreachable: {_text(exc)}")
        unavailable.__cause__ = exc
        return unavailable
    return exc


class _HeldBack(logging.Filter):
    """Drops a client's log records that start with one of ``prefixes`` (each repeats an error
    the adapter raises itself), unless that logger is at DEBUG."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return True
        return not str(record.msg).startswith(self.prefixes)


def hold_back(logger: str, prefixes: tuple[str, ...]) -> None:
    """Hold back the records of the client logger ``logger`` that start with one of
    ``prefixes``: errors the adapter raises as its own exception (one line at start-up, or the
    worker's outage lines), which the client would log a second time. Once per logger."""
    target = logging.getLogger(logger)
    if not any(isinstance(f, _HeldBack) for f in target.filters):
        target.addFilter(_HeldBack(prefixes))


def _text(exc: BaseException) -> str:
    text = str(exc).strip()
    first = redact_text(text.splitlines()[0]) if text else ""  # a client may quote its URL
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


__all__ = ["as_unavailable", "hold_back", "unavailable_on"]
