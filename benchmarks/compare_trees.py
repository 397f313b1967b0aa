"""``benchmarks/throughput.py`` on two trees of jobfence, alternating, and the ratios now/before.

Each run is the tree's own ``benchmarks/throughput.py`` with its own ``src`` first on
``PYTHONPATH`` (so its ``jobfence`` and its migrations), on this tree's interpreter. The runs
alternate, each tree going first in turn (``before``, ``now``, ``now``, ``before``...), so
that drift on a shared machine hits both alike. The table gives, per system and worker count,
the median over the runs of jobs/s and of the worker processes' CPU per job, and their ratios
now/before.

    git worktree add /tmp/before 88a0dde
    .venv/bin/python benchmarks/compare_trees.py --before /tmp/before \\
        --systems jobfence,jobfence-rabbitmq,jobfence-nats,jobfence-redis
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_tree(tree: Path, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    command = [
        sys.executable,
        "benchmarks/throughput.py",
        "--jobs",
        str(args.jobs),
        "--rounds",
        str(args.rounds),
        "--no-extra",
        "--systems",
        args.systems,
        "--json",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    done = subprocess.run(
        command, cwd=tree, env=env, capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{tree}: throughput.py failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    runs: list[dict[str, Any]] = json.loads(out.read_text())["runs"]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the other tree (a git worktree)")
    parser.add_argument("--systems", default="jobfence", help="throughput.py --systems")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2, help="rounds inside each run")
    parser.add_argument("--runs", type=int, default=4, help="runs of each tree, alternating")
    args = parser.parse_args()
    trees = {"before": Path(args.before).resolve(), "now": ROOT}
    found: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            # Each tree goes first in turn, so that neither always meets the busier minute.
            order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
            for side, tree in order:
                print(f"run {r + 1}/{args.runs}: {side} ({tree})", flush=True)
                for run in run_tree(tree, args, Path(tmp) / f"{side}-{r}.json"):
                    key = (run["system"], run["procs"])
                    found.setdefault(key, {}).setdefault(side, []).append(run)
    print()
    print(
        "| system | workers | jobs/s before | jobs/s now | now/before"
        " | worker CPU ms/job before | now | now/before |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (system, procs), sides in sorted(found.items()):
        if "before" not in sides or "now" not in sides:
            continue
        rate = {s: statistics.median(x["rate"] for x in sides[s]) for s in trees}
        cpu = {s: statistics.median(x["client_cpu_ms_per_job"] for x in sides[s]) for s in trees}
        print(
            f"| {system} | {procs} | {rate['before']:,.0f} | {rate['now']:,.0f}"
            f" | {rate['now'] / rate['before']:.2f} | {cpu['before']:.3f} | {cpu['now']:.3f}"
            f" | {cpu['now'] / cpu['before']:.2f} |"
        )
    print(f"\ncommand: {' '.join([Path(sys.executable).name, *sys.argv])}")


if __name__ == "__main__":
    main()
