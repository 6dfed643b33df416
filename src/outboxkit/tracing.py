"""OpenTelemetry glue, optional: write-time trace capture, the relay's batch span, consumer spans.

``opentelemetry`` is never a requirement. The write path does not even import it:
a span can only be active if the application imported ``opentelemetry.trace``
already, so :func:`capture` first checks ``sys.modules`` (a dict lookup) and
returns. The relay side imports it when it is installed and does nothing when
it is not.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Protocol

#: W3C Trace Context header names, also the CloudEvents distributed-tracing extension names.
TRACE_HEADERS = ("traceparent", "tracestate")
#: A batch span links at most this many write contexts (SDKs cap links at 128 by default).
MAX_LINKS = 128
_TRACER = "outboxkit"


class _HasHeaders(Protocol):
    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def topic(self) -> str: ...


class _Otel:
    """The few opentelemetry objects we use, resolved once."""

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.propagator = TraceContextTextMapPropagator()
        # What get_tracer_provider() returns until an SDK's provider is set.
        self.no_sdk = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)


# None: not looked up yet; False: not installed.
_otel: _Otel | bool | None = None


def _load() -> _Otel | None:
    global _otel
    if _otel is None:
        try:
            _otel = _Otel()
        except ImportError:
            _otel = False
    return _otel if isinstance(_otel, _Otel) else None


def available() -> bool:
    """True when opentelemetry-api is installed."""
    return _load() is not None


def capture(headers: MutableMapping[str, str]) -> None:
    """Add the active span's ``traceparent``/``tracestate`` to ``headers`` (write time).

    A ``traceparent`` the application set itself is kept. Costs one dict lookup
    when opentelemetry was never imported.
    """
    otel = _otel
    if otel is None:
        if "opentelemetry.trace" not in sys.modules:
            return
        otel = _load()
    if not isinstance(otel, _Otel) or "traceparent" in headers:
        return
    if otel.trace.get_current_span().get_span_context().is_valid:
        otel.propagator.inject(headers)


def _context_from(headers: Mapping[str, str]) -> Any:
    """The remote span context carried by headers (plain, ``ce-`` or ``ce_`` names), or None."""
    otel = _load()
    if otel is None:
        return None
    carrier: dict[str, str] = {}
    for name in TRACE_HEADERS:
        for key in (name, f"ce-{name}", f"ce_{name}"):
            value = headers.get(key)
            if value:
                carrier[name] = value
                break
    if "traceparent" not in carrier:
        return None
    return otel.propagator.extract(carrier)


@contextlib.contextmanager
def batch_span(messages: Sequence[_HasHeaders], system: str = "") -> Iterator[Any]:
    """A PRODUCER span around one published batch, linked to each event's write-time trace.

    Yields the span (or None without opentelemetry). Links are added only when
    the span is recording, so an unconfigured SDK costs next to nothing.
    """
    otel = _load()
    if otel is None or isinstance(otel.trace.get_tracer_provider(), otel.no_sdk):
        # No SDK configured: the span would be a non-recording no-op, yet creating it
        # and making it current cost 4 % of a relay's event-loop time at 2 events a batch.
        yield None
        return
    topics = {m.topic for m in messages}
    attributes: dict[str, Any] = {
        "messaging.operation.type": "send",
        "messaging.batch.message_count": len(messages),
    }
    if system:
        attributes["messaging.system"] = system
    if len(topics) == 1:
        attributes["messaging.destination.name"] = next(iter(topics))
    tracer = otel.trace.get_tracer(_TRACER)
    with tracer.start_as_current_span(
        "outboxkit publish", kind=otel.trace.SpanKind.PRODUCER, attributes=attributes
    ) as span:
        if span.is_recording():
            for m in messages[:MAX_LINKS]:
                ctx = _context_from(m.headers)
                if ctx is None:
                    continue
                linked = otel.trace.get_current_span(ctx).get_span_context()
                if linked.is_valid:
                    span.add_link(linked)
        yield span


def record_batch_outcome(published: int, failed: int, error: str | None) -> None:
    """Mark the current (batch) span with how many messages the broker confirmed."""
    otel = _load()
    if otel is None:
        return
    span = otel.trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("outboxkit.published", published)
    span.set_attribute("outboxkit.failed", failed)
    if failed:
        span.set_status(otel.trace.Status(otel.trace.StatusCode.ERROR, error or "publish failed"))


@contextlib.contextmanager
def consumer_span(
    name: str, headers: Mapping[str, str], attributes: Mapping[str, Any] | None = None
) -> Iterator[Any]:
    """A CONSUMER span continuing the trace whose context the message headers carry."""
    otel = _load()
    if otel is None:
        yield None
        return
    parent = _context_from(headers)
    tracer = otel.trace.get_tracer(_TRACER)
    with tracer.start_as_current_span(
        name, context=parent, kind=otel.trace.SpanKind.CONSUMER, attributes=dict(attributes or {})
    ) as span:
        yield span


def task_span_wanted() -> bool:
    """Whether a task's run gets a span: opentelemetry installed and an SDK configured (a
    non-recording span per task would cost the worker for nothing)."""
    otel = _load()
    return otel is not None and not isinstance(otel.trace.get_tracer_provider(), otel.no_sdk)


@contextlib.contextmanager
def task_span(name: str, traceparent: str | None, attributes: Mapping[str, Any]) -> Iterator[Any]:
    """A CONSUMER span around one task's run, linked to the trace active at its enqueue
    (``traceparent``); current while the handler runs, so its own spans are children."""
    otel = _load()
    if otel is None:
        yield None
        return
    links = []
    if traceparent:
        linked = otel.trace.get_current_span(
            otel.propagator.extract({"traceparent": traceparent})
        ).get_span_context()
        if linked.is_valid:
            links.append(otel.trace.Link(linked))
    tracer = otel.trace.get_tracer(_TRACER)
    with tracer.start_as_current_span(
        f"outboxkit task {name}",
        kind=otel.trace.SpanKind.CONSUMER,
        attributes=dict(attributes),
        links=links,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span


def task_outcome(span: Any, ok: bool, error: str | None) -> None:
    """Mark a task span with the run's outcome."""
    otel = _load()
    if otel is None or span is None or not span.is_recording():
        return
    span.set_attribute("outboxkit.task.ok", ok)
    if not ok and error is not None:  # (a snooze is not ok, and no error)
        span.set_status(otel.trace.Status(otel.trace.StatusCode.ERROR, error or "task failed"))
