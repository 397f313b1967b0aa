"""Every WARNING and ERROR a worker can log is in the log table of docs/operations.md: each
``log.warning``/``log.error``/``log.exception`` (and ``log.log``) format string in the worker's
modules, matched on its longest literal phrase (the text between two ``%`` placeholders)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
WORKER_MODULES = [
    "src/jobfence/worker.py",
    "src/jobfence/acks.py",
    "src/jobfence/leases.py",
    "src/jobfence/blocked_loop.py",
    "src/jobfence/harness.py",
    "src/jobfence/outage_log.py",
    "src/jobfence/outbox.py",  # the relay every worker on a broker runs
    "src/jobfence/adapters/pg_queue.py",
    "src/jobfence/adapters/nats.py",
    "src/jobfence/ops/bulk.py",  # the API's and the CLI's bulk replays
]
LEVELS = {"warning", "error", "exception", "critical", "log"}  # log: a level chosen at run time
PLACEHOLDER = re.compile(r"%(?:\.\d+)?[sdrf]")


def log_table() -> str:
    """The rows of the table under ``## Logs``, whitespace collapsed."""
    text = (ROOT / "docs/operations.md").read_text()
    section = text.split("\n## Logs\n", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return " ".join(" ".join(rows).split())


def formats(path: str) -> list[tuple[int, str]]:
    """(line, format string) of each warning-or-worse log call in ``path``."""
    found = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in LEVELS or not node.args:
            continue
        args = node.args[1:] if node.func.attr == "log" else node.args
        if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
            found.append((node.lineno, args[0].value))
    return found


def phrase(fmt: str) -> str:
    """The longest literal part of ``fmt``: stable when a placeholder is added or moved."""
    parts = [part.strip(" :;,.()") for part in PLACEHOLDER.split(fmt)]
    return max(parts, key=len)


def test_every_warning_and_error_a_worker_logs_is_in_the_log_table() -> None:
    table = log_table()
    calls = [(path, line, fmt) for path in WORKER_MODULES for line, fmt in formats(path)]
    assert len(calls) >= 10  # the scan finds the calls at all
    missing = [f"{path}:{line}: {fmt!r}" for path, line, fmt in calls if phrase(fmt) not in table]
    assert not missing, "not in docs/operations.md's log table:\n" + "\n".join(missing)


def test_the_phrase_is_the_longest_literal_part_of_a_format() -> None:
    assert phrase("job %s for %s dead-lettered after %d attempt(s): %s") == "dead-lettered after"
    assert phrase("database still unreachable after %.0fs (%s); retrying") == (
        "database still unreachable after"
    )
