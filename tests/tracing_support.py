"""An OpenTelemetry SDK with an in-memory exporter, for one test: jobfence's spans go to it (its
tracer replaced for the test only, so that no global provider leaks into other tests)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from jobfence import tracing


@dataclass
class Traces:
    tracer: Tracer  # the application's own tracer (a request span, a handler's span)
    exporter: InMemorySpanExporter

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        found = self.named(name)
        assert len(found) == 1, (name, [s.name for s in self.spans()])
        return found[0]


def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traces]:
    """For a fixture: jobfence's spans recorded in memory for one test."""
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    jobfence_tracer = provider.get_tracer("jobfence", tracing.SEMCONV_VERSION)
    monkeypatch.setattr(tracing, "_tracer", lambda: jobfence_tracer)
    yield Traces(tracer=provider.get_tracer("app"), exporter=exporter)
    provider.shutdown()


def hexid(span: ReadableSpan) -> tuple[str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def linked(span: ReadableSpan) -> Sequence[tuple[str, str]]:
    return [
        (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in span.links
    ]


def parent_of(span: ReadableSpan) -> tuple[str, str] | None:
    if span.parent is None:
        return None
    return f"{span.parent.trace_id:032x}", f"{span.parent.span_id:016x}"
