"""OpenTelemetry: write-time trace context, broker headers, batch spans, and life without it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import timeit
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from outboxkit import Event, tracing
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.publishers.nats import NatsPublisher
from tests.support.relaying import count, running_relay, wait_for, write_events
from tests.support.servers import consume_kafka, consume_nats, ensure_stream

_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Finished spans of this test (one SDK provider per process, shared with other modules)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not getattr(provider, "_outboxkit_test_exporter", False):
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        provider._outboxkit_test_exporter = True  # type: ignore[attr-defined]
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def _traceparent(span: Any) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def test_events_written_inside_a_span_carry_its_w3c_trace_context(spans: Any) -> None:
    tracer = trace.get_tracer("shop")
    outside = Event(topic="t", event_type="x", payload={})
    with tracer.start_as_current_span("place order") as span:
        inside = Event(topic="t", event_type="x", payload={}, headers={"tenant": "acme"})
        own = Event(topic="t", event_type="x", payload={}, headers={"traceparent": "00-1-2-01"})
    assert "traceparent" not in outside.headers
    assert inside.headers["traceparent"] == _traceparent(span)
    assert inside.headers["tenant"] == "acme"
    assert own.headers["traceparent"] == "00-1-2-01", "an explicit traceparent wins"


async def test_trace_context_reaches_nats_headers_and_the_batch_span_links_the_writes(
    db_dsn: str, nats_server: Any, spans: Any
) -> None:
    root = f"tr{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    tracer = trace.get_tracer("shop")
    writes = []
    events = []
    for i in range(3):
        with tracer.start_as_current_span(f"place order {i}") as span:
            writes.append(span)
            events.append(Event(topic=f"{root}.orders", event_type="order.placed", payload={}))
    write_events(db_dsn, events)
    async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url)):
        await wait_for(lambda: count(db_dsn) == 0, what="published")
    msgs = await consume_nats(nats_server.url, root.upper(), f"{root}.>", 3, 10.0)
    assert len(msgs) == 3
    for m, span in zip(msgs, writes, strict=True):
        assert m.headers["traceparent"] == _traceparent(span)
        assert m.headers["ce-traceparent"] == _traceparent(span), "CloudEvents extension"

    [batch] = [s for s in spans.get_finished_spans() if s.name == "outboxkit publish"]
    assert batch.kind == trace.SpanKind.PRODUCER
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert batch.attributes["messaging.destination.name"] == f"{root}.orders"
    assert batch.attributes["outboxkit.published"] == 3
    linked = {(link.context.trace_id, link.context.span_id) for link in batch.links}
    assert linked == {(s.get_span_context().trace_id, s.get_span_context().span_id) for s in writes}


async def test_kafka_messages_carry_traceparent_and_the_ce_traceparent_extension(
    db_dsn: str, kafka_broker: Any, spans: Any
) -> None:
    topic = f"tr-{uuid.uuid4().hex[:8]}"
    with trace.get_tracer("shop").start_as_current_span("write") as span:
        event = Event(topic=topic, event_type="x", payload={"a": 1})
    write_events(db_dsn, [event])
    async with running_relay(db_dsn, KafkaPublisher.from_url(kafka_broker.url)):
        await wait_for(lambda: count(db_dsn) == 0, what="published")
    [message] = consume_kafka(kafka_broker.bootstrap, topic, 1, 20.0)
    headers = {k: v.decode() for k, v in message.headers()}
    assert headers["traceparent"] == _traceparent(span)
    assert headers["ce_traceparent"] == _traceparent(span)


def test_a_failed_batch_marks_its_span_as_an_error(spans: Any) -> None:
    from outboxkit.publishers.base import OutboundMessage, PublishResult
    from outboxkit.sink.observer import BatchTracing

    with trace.get_tracer("shop").start_as_current_span("write"):
        event = Event(topic="t", event_type="x", payload={})
    message = OutboundMessage(
        event.event_id, "t", None, "x", None, None, b"{}", event.headers, _now()
    )
    observer = BatchTracing()
    with observer.processing([message]):
        observer.processed([message], [PublishResult.retry("broker down", "ConnErr")], 0.01)
    [batch] = [s for s in spans.get_finished_spans() if s.name == "outboxkit publish"]
    assert batch.status.status_code == trace.StatusCode.ERROR
    assert "ConnErr" in (batch.status.description or "")


def test_consumer_span_continues_the_trace_from_message_headers(spans: Any) -> None:
    with trace.get_tracer("shop").start_as_current_span("write") as write:
        event = Event(topic="t", event_type="x", payload={})
    headers = {"ce-traceparent": event.headers["traceparent"]}
    with tracing.consumer_span("handle t", headers) as span:
        assert span is not None
    ctx = span.get_span_context()
    assert ctx.trace_id == write.get_span_context().trace_id
    [done] = [s for s in spans.get_finished_spans() if s.name == "handle t"]
    assert done.parent is not None and done.parent.span_id == write.get_span_context().span_id
    assert done.kind == trace.SpanKind.CONSUMER


_WITHOUT_OTEL = textwrap.dedent(
    """
    import asyncio, sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ImportError("opentelemetry blocked for this test")
            return None

    sys.meta_path.insert(0, Block())
    from outboxkit import Event, tracing
    from outboxkit.publishers.base import OutboundMessage
    from outboxkit.sink.observer import BatchTracing, default_observer, SummaryLog

    e = Event(topic="t", event_type="x", payload={}, headers={"tenant": "a"})
    assert e.headers == {"tenant": "a"}, e.headers
    assert not tracing.available()
    assert isinstance(default_observer(), SummaryLog)
    m = OutboundMessage(e.event_id, "t", None, "x", None, None, b"{}", e.headers, None)
    with BatchTracing().processing([m]):
        pass
    with tracing.consumer_span("c", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}):
        pass
    assert not [n for n in sys.modules if n.startswith("opentelemetry")]
    print("ok")
    """
)


def test_without_opentelemetry_nothing_breaks_and_nothing_is_imported() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_OTEL], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_write_path_does_not_import_opentelemetry_when_the_app_does_not() -> None:
    code = (
        "import sys\nfrom outboxkit import Event\n"
        "Event(topic='t', event_type='x', payload={})\n"
        "print(sorted(n for n in sys.modules if n.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_write_time_hook_costs_well_under_a_microsecond_without_a_span(spans: Any) -> None:
    headers: dict[str, str] = {"tenant": "acme"}
    # opentelemetry is imported in this process and an SDK provider is set: the slower case.
    per_call = min(timeit.repeat(lambda: tracing.capture(headers), number=20_000, repeat=5))
    per_call /= 20_000
    assert "traceparent" not in headers
    assert per_call < 2e-6, f"{per_call * 1e9:.0f} ns per event"


def _now() -> Any:
    import datetime as dt

    return dt.datetime.now(dt.UTC)


async def test_a_consumer_runner_continues_the_write_time_trace(
    db_dsn: str, nats_server: Any, spans: Any
) -> None:
    from outboxkit.backends.postgres.migrate import migrate_inbox
    from outboxkit.consumers.base import ReceivedEvent
    from outboxkit.consumers.nats import NatsConsumer

    migrate_inbox(db_dsn)
    root = f"tc{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    with trace.get_tracer("shop").start_as_current_span("place order") as write:
        event = Event(topic=f"{root}.orders", event_type="order.placed", payload={"id": 1})
    write_events(db_dsn, [event])
    seen: list[tuple[int, int]] = []

    async def handler(_tx: Any, received: ReceivedEvent) -> None:
        ctx = trace.get_current_span().get_span_context()
        seen.append((ctx.trace_id, ctx.span_id))

    runner = NatsConsumer(
        db_dsn,
        handler,
        consumer="billing",
        servers=nats_server.url,
        stream=root.upper(),
        subject=f"{root}.>",
        fetch_timeout=0.2,
    )
    consuming = asyncio.create_task(runner.run())
    try:
        async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url)):
            await wait_for(lambda: len(seen) == 1, what="the event handled")
    finally:
        runner.stop()
        await asyncio.wait_for(consuming, 30)
    write_ctx = write.get_span_context()
    assert seen[0][0] == write_ctx.trace_id, "the handler runs in the write's trace"
    [consumed] = [s for s in spans.get_finished_spans() if s.kind == trace.SpanKind.CONSUMER]
    assert consumed.parent is not None and consumed.parent.span_id == write_ctx.span_id
    assert consumed.context.span_id == seen[0][1]
    assert consumed.attributes["messaging.destination.name"] == f"{root}.orders"
    assert consumed.attributes["messaging.message.id"] == str(event.event_id)


def test_a_tasks_run_is_a_span_linked_to_its_enqueue_and_parent_of_the_handlers_spans(
    db_dsn: str, spans: InMemorySpanExporter
) -> None:
    import psycopg

    from outboxkit.tasks import Fail, Tasks, migrate_tasks
    from tests.integration.test_tasks_worker import run_worker

    migrate_tasks(db_dsn)
    tasks = Tasks()
    ran: list[str] = []
    tracer = trace.get_tracer("test")

    @tasks.handler("report")
    def report(payload: None) -> None:  # sync: runs in a thread, the span still current
        with tracer.start_as_current_span("inside the handler"):
            ran.append("report")

    @tasks.handler("broken", max_attempts=1)
    async def broken(payload: None) -> None:
        ran.append("broken")
        raise Fail("no such report")

    with tracer.start_as_current_span("the request") as request, psycopg.connect(db_dsn) as conn:
        with conn.transaction():
            tasks.enqueue(conn, "report")
            tasks.enqueue(conn, "broken")
    run_worker(tasks, db_dsn, lambda: len(ran) == 2)
    by_name = {s.name: s for s in spans.get_finished_spans()}
    task = by_name["outboxkit task report"]
    assert task.kind is trace.SpanKind.CONSUMER
    assert [link.context.span_id for link in task.links] == [request.get_span_context().span_id]
    assert task.attributes is not None and task.attributes["outboxkit.task.attempt"] == 1
    inside = by_name["inside the handler"]
    assert inside.parent is not None and inside.parent.span_id == task.context.span_id
    failed = by_name["outboxkit task broken"]
    assert failed.status.status_code is trace.StatusCode.ERROR
    assert "no such report" in (failed.status.description or "")
