"""A broker test skips locally when its broker does not answer, and fails under CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def run_redis_capabilities_test(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "CI"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(TESTS / "test_queue_redis.py"),
            "-k",
            "test_declares_its_capabilities",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        env={**base, "JOBFENCE_TEST_REDIS_URL": "redis://127.0.0.1:1/0", **env},
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("ci", ["", "false"])
def test_a_broker_that_does_not_answer_skips_its_tests_locally(ci: str) -> None:
    result = run_redis_capabilities_test(CI=ci)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 skipped" in result.stdout
    assert "JOBFENCE_TEST_REDIS_URL (redis://127.0.0.1:1/0) does not answer" in result.stdout


def test_a_broker_that_does_not_answer_fails_its_tests_under_ci() -> None:
    result = run_redis_capabilities_test(CI="true")
    assert result.returncode != 0
    assert "1 error" in result.stdout
    assert "does not answer" in result.stdout and "CI runs every broker" in result.stdout
