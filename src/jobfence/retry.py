"""The retry policy: how many retries, how long between them, which errors never retry (D1, D2).

Delays are a pure function of the retry number and an injected random source:

    d(n)      = base * 2 ** (n - 1)                  nominal delay before retry n (1-based)
    delay(n)  = min(d(n) * U(1.0, 1.25), cap)        while d(n) < cap
    delay(n)  = max(U(0.9, 1.0) * cap, base)         once d(n) >= cap

So the first retry never waits less than ``base``, no retry waits more than ``cap``, and while
below the cap each retry waits strictly longer than the one before (d(n+1) = 2 d(n) > 1.25 d(n)).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from jobfence.errors import ConfigError
from jobfence.limits import MAX_DELAY_DAYS, MAX_DELAY_SECONDS

DEFAULT_MAX_RETRIES = 5
DEFAULT_BASE_SECONDS = 30.0
DEFAULT_CAP_SECONDS = 3600.0
JITTER_HIGH = 1.25
CAPPED_JITTER_LOW = 0.9
# More retries than a policy can mean (hourly for over a year); keeps the D3 check's sum short.
MAX_RETRIES = 10_000


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries with exponential backoff and jitter.

    ``max_retries`` counts retries after the first delivery: with the default 5, a job that
    always fails transiently is delivered 6 times and its dead letter says ``attempts = 6``.
    ``permanent`` lists exception types that dead-letter at once, like :class:`HardFailure`.
    A policy whose numbers differ from the default must carry a ``rationale`` (spec, D2).
    """

    max_retries: int = DEFAULT_MAX_RETRIES
    base_seconds: float = DEFAULT_BASE_SECONDS
    cap_seconds: float = DEFAULT_CAP_SECONDS
    permanent: tuple[type[BaseException], ...] = field(default=())
    rationale: str | None = None

    def __post_init__(self) -> None:
        retries = self.max_retries
        if isinstance(retries, bool) or not isinstance(retries, int):
            raise ConfigError(f"max_retries must be a whole number, got {retries!r}")
        if not 0 <= retries <= MAX_RETRIES:
            raise ConfigError(f"max_retries must be from 0 to {MAX_RETRIES:,}, got {retries}")
        for name in ("base_seconds", "cap_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
            if not 0 < value <= MAX_DELAY_SECONDS:  # NaN and infinity fail here too
                raise ConfigError(
                    f"{name} must be more than 0 and at most {MAX_DELAY_SECONDS:,} seconds"
                    f" ({MAX_DELAY_DAYS:,} days, the longest delay), got {value}"
                )
        if self.cap_seconds < self.base_seconds:
            raise ConfigError(
                f"cap_seconds ({self.cap_seconds}) must be >= base_seconds ({self.base_seconds})"
            )
        # Checked here: an exception's isinstance() against a name would raise TypeError at
        # the first failure of every job, each then failing inside jobfence.
        permanent = self.permanent
        if not isinstance(permanent, tuple | list):
            raise ConfigError(
                "permanent must be a tuple of exception classes, such as (ValueError,); got"
                f" {permanent!r}"
            )
        for kind in permanent:
            if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                raise ConfigError(
                    f"permanent must be exception classes, such as (ValueError,); got {kind!r}"
                )
        object.__setattr__(self, "permanent", tuple(permanent))
        if self.overrides_default and not (self.rationale and self.rationale.strip()):
            raise ConfigError(
                "a retry policy that overrides the default (5 retries, base 30 s, cap 1 h) needs "
                "a non-empty rationale: RetryPolicy(..., rationale='why this queue differs')"
            )

    @property
    def overrides_default(self) -> bool:
        return (self.max_retries, self.base_seconds, self.cap_seconds) != (
            DEFAULT_MAX_RETRIES,
            DEFAULT_BASE_SECONDS,
            DEFAULT_CAP_SECONDS,
        )

    @property
    def max_deliveries(self) -> int:
        """Deliveries before a transiently failing job is dead-lettered (first one included)."""
        return self.max_retries + 1

    def nominal_delay(self, retry_number: int) -> float:
        """d(n): the delay before retry ``retry_number`` (1-based) without jitter or cap."""
        if retry_number < 1:
            raise ValueError("retry numbers start at 1")
        try:
            return float(self.base_seconds * 2.0 ** (retry_number - 1))
        except OverflowError:  # far past any cap
            return math.inf

    def delay(self, retry_number: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry ``retry_number``, jitter included."""
        source = rng if rng is not None else random
        nominal = self.nominal_delay(retry_number)
        if nominal >= self.cap_seconds:  # max(): with cap < base / 0.9, 0.9 * cap < base
            return max(source.uniform(CAPPED_JITTER_LOW, 1.0) * self.cap_seconds, self.base_seconds)
        return min(nominal * source.uniform(1.0, JITTER_HIGH), self.cap_seconds)

    def upper_bound(self, retry_number: int) -> float:
        """The longest :meth:`delay` can return for ``retry_number``."""
        nominal = self.nominal_delay(retry_number)
        if nominal >= self.cap_seconds:
            return self.cap_seconds
        return min(nominal * JITTER_HIGH, self.cap_seconds)

    @property
    def retry_window_seconds(self) -> float:
        """Worst case from the first failure to the last retry: the sum of the upper bounds."""
        return sum(self.upper_bound(n) for n in range(1, self.max_retries + 1))

    def describe(self) -> str:
        text = (
            f"{self.max_retries} retries, base {self.base_seconds:g}s, cap {self.cap_seconds:g}s, "
            f"window {self.retry_window_seconds:g}s"
        )
        if self.rationale:
            text += f" (rationale: {self.rationale})"
        return text


DEFAULT_RETRY_POLICY = RetryPolicy()
