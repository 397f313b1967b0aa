"""The CPU one job's ``process`` span costs the worker, alone, in three set-ups (no database):

absent   ``jobfence.tracing`` as without the ``otel`` extra (``opentelemetry`` not imported)
api      ``opentelemetry-api`` installed, no SDK configured: the API's no-op tracer
sdk      the SDK recording the span, a ``BatchSpanProcessor`` to an exporter that drops it

Each set-up runs in a process of its own (an SDK provider cannot be unset), best of 5 rounds::

    .venv/bin/python benchmarks/tracing_span.py            # 100,000 spans per round
    .venv/bin/python benchmarks/tracing_span.py --spans 20000

Compare with the worker's CPU per job in ``throughput.py --systems tracing`` (about 600 us).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

MODES = ("absent", "api", "sdk")


def measure(mode: str, spans: int) -> float:
    """Microseconds of CPU per span, best of 5 rounds, in this process."""
    from jobfence import tracing
    from jobfence.model import Delivery, Message

    if mode == "absent":
        tracing._trace, tracing.ENABLED = None, False  # type: ignore[assignment]
    elif mode == "sdk":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        class Dropped(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(Dropped()))
        sdk_tracer = provider.get_tracer("jobfence")
        tracing._tracer = lambda: sdk_tracer  # type: ignore[assignment]
    message = Message(
        queue="loyalty",
        consumer="award_points",
        job_id="order-20:points",
        body=b"{}",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    delivery = Delivery(message=message, attempt=1, receipt=None)
    rounds = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(spans):
            with tracing.process(delivery, child=False) as span:
                if span is not None:
                    tracing.finish(span, "succeeded")
        rounds.append((time.process_time() - start) / spans * 1e6)
    return min(rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=100_000, help="spans per round (100000)")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child process
    args = parser.parse_args()
    if args.mode:
        print(f"{measure(args.mode, args.spans):.2f}")
        return 0
    for mode in MODES:
        done = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--spans", str(args.spans)],
            capture_output=True,
            text=True,
            check=True,
        )
        print(f"{mode:<7} {done.stdout.strip():>7} us CPU per job's process span")
    return 0


if __name__ == "__main__":
    sys.exit(main())
