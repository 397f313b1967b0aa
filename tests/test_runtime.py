"""The event loop the CLI runs on: uvloop by default where installed, asyncio when asked."""

from __future__ import annotations

import asyncio

import pytest

from jobfence import runtime
from support import print_sql_with_env


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.parametrize(
    ("choice", "module"), [("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]
)
def test_jobfence_event_loop_chooses_the_loop(
    choice: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOBFENCE_EVENT_LOOP", choice)
    assert runtime.run(loop_module).startswith(module)


def test_the_default_is_uvloop_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOBFENCE_EVENT_LOOP", raising=False)
    assert runtime.run(loop_module).startswith("uvloop")


def test_a_bad_jobfence_event_loop_is_one_clear_error_line() -> None:
    done = print_sql_with_env(JOBFENCE_EVENT_LOOP="tokio")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jobfence: error: JOBFENCE_EVENT_LOOP must be one of auto, uvloop, asyncio, got 'tokio'"
    ]
    assert done.stdout == ""
