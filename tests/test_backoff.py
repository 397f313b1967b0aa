"""D1 and D2: the retry count and the backoff, as properties over policies and random draws.

Every delay is drawn from an injected ``random.Random``. Besides seeded generators, the tests
inject a ``random.Random`` whose draws hypothesis chooses, including the extremes 0.0 and just
under 1.0, so "for any random draws" is tested rather than sampled.
"""

from __future__ import annotations

import logging
import random
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import DEFAULT_RETRY_POLICY, App, ConfigError, PgQueue, RetryPolicy, Worker

RATIONALE = "property test: exploring the whole space of policies"


class ScriptedRandom(random.Random):
    """A ``random.Random`` whose ``random()`` returns the given draws in turn (then repeats)."""

    def __init__(self, draws: list[float]) -> None:
        super().__init__(0)
        self._draws = draws
        self._next = 0

    def random(self) -> float:
        value = self._draws[self._next % len(self._draws)]
        self._next += 1
        return value


unit_draws = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)
extreme_draws = st.sampled_from([0.0, 0.5, 1.0 - 2**-53])


@st.composite
def policies(draw: st.DrawFn) -> RetryPolicy:
    base = draw(st.floats(min_value=0.001, max_value=600.0, allow_nan=False))
    cap = draw(
        st.one_of(
            st.just(base),
            st.floats(min_value=base, max_value=7200.0, allow_nan=False),
            st.just(base * 2 ** draw(st.integers(0, 8))),  # the cap exactly on a nominal delay
        )
    )
    assume(cap >= base)
    retries = draw(st.integers(min_value=0, max_value=12))
    return RetryPolicy(max_retries=retries, base_seconds=base, cap_seconds=cap, rationale=RATIONALE)


def rngs() -> st.SearchStrategy[random.Random]:
    return st.one_of(
        st.integers(min_value=0, max_value=2**32).map(random.Random),
        st.lists(unit_draws | extreme_draws, min_size=1, max_size=20).map(ScriptedRandom),
    )


@given(policy=policies() | st.just(DEFAULT_RETRY_POLICY), rng=rngs())
def test_d2_the_first_retry_never_waits_less_than_base(
    policy: RetryPolicy, rng: random.Random
) -> None:
    assert policy.delay(1, rng) >= policy.base_seconds


@given(policy=policies() | st.just(DEFAULT_RETRY_POLICY), rng=rngs())
def test_d2_no_retry_waits_more_than_the_cap_or_its_own_upper_bound(
    policy: RetryPolicy, rng: random.Random
) -> None:
    for n in range(1, policy.max_retries + 3):
        delay = policy.delay(n, rng)
        assert 0 < delay <= policy.cap_seconds
        assert delay <= policy.upper_bound(n)


@given(policy=policies() | st.just(DEFAULT_RETRY_POLICY), rng=rngs())
def test_d2_delays_grow_strictly_while_below_the_cap(
    policy: RetryPolicy, rng: random.Random
) -> None:
    delays = [policy.delay(n, rng) for n in range(1, policy.max_retries + 2)]
    for n in range(1, len(delays)):
        if policy.nominal_delay(n + 1) < policy.cap_seconds:
            assert delays[n] > delays[n - 1], (n, delays)


@given(policy=policies() | st.just(DEFAULT_RETRY_POLICY), seed=st.integers(0, 2**32))
def test_d2_delays_are_reproducible_with_the_same_seed(policy: RetryPolicy, seed: int) -> None:
    def schedule(rng: random.Random) -> list[float]:
        return [policy.delay(n, rng) for n in range(1, policy.max_retries + 1)]

    assert schedule(random.Random(seed)) == schedule(random.Random(seed))


def test_d2_jitter_is_always_on() -> None:
    # Two seeds give different schedules: the delay is not the bare nominal value.
    first = [DEFAULT_RETRY_POLICY.delay(n, random.Random(1)) for n in range(1, 6)]
    second = [DEFAULT_RETRY_POLICY.delay(n, random.Random(2)) for n in range(1, 6)]
    assert first != second
    nominal = [DEFAULT_RETRY_POLICY.nominal_delay(n) for n in range(1, 6)]
    assert nominal == [30, 60, 120, 240, 480]
    assert first != nominal


@given(policy=policies() | st.just(DEFAULT_RETRY_POLICY), rng=rngs())
def test_d2_the_retry_window_bounds_every_actual_schedule(
    policy: RetryPolicy, rng: random.Random
) -> None:
    uppers = [policy.upper_bound(n) for n in range(1, policy.max_retries + 1)]
    assert policy.retry_window_seconds == pytest.approx(sum(uppers))
    total = sum(policy.delay(n, rng) for n in range(1, policy.max_retries + 1))
    assert total <= policy.retry_window_seconds * (1 + 1e-12)


def test_d2_the_default_retry_window_is_1162_5_seconds() -> None:
    # 30, 60, 120, 240, 480 s, each at most 1.25 x: 37.5 + 75 + 150 + 300 + 600.
    assert [DEFAULT_RETRY_POLICY.upper_bound(n) for n in range(1, 6)] == [
        37.5,
        75.0,
        150.0,
        300.0,
        600.0,
    ]
    assert DEFAULT_RETRY_POLICY.retry_window_seconds == 1162.5
    assert round(DEFAULT_RETRY_POLICY.retry_window_seconds / 60, 1) == 19.4


def test_d1_a_job_is_delivered_six_times_by_default() -> None:
    assert DEFAULT_RETRY_POLICY.max_retries == 5
    assert DEFAULT_RETRY_POLICY.max_deliveries == 6
    assert (DEFAULT_RETRY_POLICY.base_seconds, DEFAULT_RETRY_POLICY.cap_seconds) == (30, 3600)


@pytest.mark.parametrize(
    "override",
    [{"max_retries": 3}, {"base_seconds": 1.0}, {"cap_seconds": 60.0}],
    ids=["max_retries", "base", "cap"],
)
@pytest.mark.parametrize("rationale", [None, "", "   "], ids=["none", "empty", "blank"])
def test_d2_an_override_without_a_rationale_is_refused(
    override: dict[str, Any], rationale: str | None
) -> None:
    with pytest.raises(ConfigError) as refused:
        RetryPolicy(**override, rationale=rationale)
    assert "needs a non-empty rationale" in str(refused.value)
    assert "RetryPolicy(..., rationale=" in str(refused.value)  # says how to fix it


def test_d2_an_override_with_a_rationale_works() -> None:
    policy = RetryPolicy(max_retries=2, base_seconds=1.0, cap_seconds=10.0, rationale="SMS rail")
    assert policy.overrides_default
    assert policy.max_deliveries == 3
    assert "rationale: SMS rail" in policy.describe()
    # The default numbers restated need no rationale.
    assert not RetryPolicy(max_retries=5, base_seconds=30.0, cap_seconds=3600.0).overrides_default


async def test_d2_the_rationale_is_logged_when_a_worker_starts(
    pool: AsyncConnectionPool[Any], caplog: pytest.LogCaptureFixture
) -> None:
    policy = RetryPolicy(max_retries=2, rationale="the partner API rate-limits retries")
    app = pointsapp.build_app(retry=policy)
    worker = Worker(app, pool, PgQueue(pool))
    with caplog.at_level(logging.INFO, logger="jobfence"):
        worker.check()
    assert any(
        "award_points" in r.getMessage() and "the partner API rate-limits retries" in r.getMessage()
        for r in caplog.records
    ), caplog.text


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"max_retries": 2.5}, "max_retries must be a whole number"),
        ({"max_retries": 10_001}, "max_retries must be from 0 to 10,000"),
        ({"base_seconds": float("inf"), "cap_seconds": float("inf")}, "base_seconds must be"),
        ({"base_seconds": float("nan")}, "base_seconds must be"),
        ({"cap_seconds": 1e15}, "cap_seconds must be more than 0 and at most 315,360,000"),
        (
            {"permanent": ("ValueError",)},
            r"permanent must be exception classes, such as \(ValueError,\); got 'ValueError'",
        ),
        ({"permanent": (ValueError, 3)}, r"permanent must be exception classes.*; got 3"),
        ({"permanent": ValueError}, r"permanent must be a tuple of exception classes"),
    ],
    ids=[
        "not-whole",
        "too-many",
        "infinite",
        "nan",
        "cap-past-the-longest-delay",
        "permanent-a-name",
        "permanent-not-a-class",
        "permanent-not-a-tuple",
    ],
)
def test_a_retry_policy_that_cannot_work_is_refused_naming_the_bound(
    values: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        RetryPolicy(rationale="a test of the bounds", **values)


def test_a_policy_of_over_a_thousand_retries_has_a_finite_window_and_passes_the_d3_check() -> None:
    """Hourly retries for about 46 days: the nominal delay of retry 1,025 and later is past
    any float, and counts as capped (it raised OverflowError, and the worker died at start)."""
    policy = RetryPolicy(max_retries=1100, rationale="the partner is down for weeks at a time")
    assert policy.upper_bound(1100) == policy.cap_seconds
    assert policy.delay(1100, random.Random(1)) <= policy.cap_seconds
    assert policy.retry_window_seconds < 1100 * policy.cap_seconds
    app = App()
    app.consumer(
        "partner_sync",
        queue=pointsapp.QUEUE,
        schema=pointsapp.Award,
        retry=policy,
        fence_ttl=timedelta(days=365),
    )(pointsapp.apply_award)
    app.check_fence_ttls()
