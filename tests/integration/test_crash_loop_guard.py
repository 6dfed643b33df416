"""The crash-loop guard keeps the real cause, counts and logs what it dead-letters.

Before (issue 26, item 6): two relays with max_attempts 2 and 10 on one table and a
webhook answering 500: the lower relay's claim dead-lettered rows the higher one had
retried with "claimed N times and never settled ... an OOM?", overwriting "HTTP 500",
with no log line and no count (outboxkit_events_dead_lettered_total unchanged while the
failed gauge rose). Now its verdict says the row reached a lower max_attempts, keeps the
last error, and every dead letter is logged and counted.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest

from outboxkit.ops.metrics import RelayMetrics
from outboxkit.publishers.webhook import WebhookPublisher
from tests.support.relaying import count, make_events, rows, running_relay, wait_for, write_events
from tests.support.webhook_server import WebhookServer

EVENTS = 60


@pytest.fixture
def failing_server() -> Iterator[WebhookServer]:
    hooks = WebhookServer()
    hooks.answer(500, times=100_000, body=b"receiver broken")
    hooks.start()
    yield hooks
    hooks.stop()


async def test_a_lower_max_attempts_dead_letters_with_its_reason_and_the_real_cause(
    db_dsn: str, failing_server: WebhookServer, caplog: pytest.LogCaptureFixture
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:6]}"
    caplog.set_level(logging.ERROR, "outboxkit.relay")
    metrics = RelayMetrics(db_dsn, process_metrics=False)
    options = {"retry_base": 0.05, "retry_cap": 0.1, "batch_size": 10, "poll_interval": 0.05}
    url = f"{failing_server.url()}?timeout=2"
    async with (
        running_relay(
            db_dsn,
            WebhookPublisher.from_url(url),
            max_attempts=10,
            relay_id="high",
            **options,
        ) as high,
        running_relay(
            db_dsn,
            WebhookPublisher.from_url(url),
            max_attempts=2,
            relay_id="low",
            observer=metrics,
            **options,
        ) as low,
    ):
        write_events(db_dsn, make_events(topic, EVENTS))
        await wait_for(
            lambda: count(db_dsn, "status = 2") == EVENTS, timeout=60, what="every dead letter"
        )
    dead = rows(db_dsn, "status = 2")
    assert all("500" in (r["last_error"] or "") for r in dead), "the real cause survives"
    by_guard = [r for r in dead if r["last_error"].startswith("relay: tried")]
    assert by_guard, "the lower limit met rows the higher one had retried"
    for r in by_guard:
        assert "higher max_attempts" in r["last_error"]
        assert "never settled" not in r["last_error"], "nobody crashed"
    # Every dead letter counted (stats, metrics) and logged, the guard's included.
    assert low.stats.dead_lettered + high.stats.dead_lettered == EVENTS
    counted = sum(
        s.value
        for family in metrics.registry.collect()
        if family.name == "outboxkit_events_dead_lettered"
        for s in family.samples
        if s.name.endswith("_total")
    )
    assert counted == low.stats.dead_lettered
    logged = [r for r in caplog.records if "event dead-lettered" in r.getMessage()]
    assert len(logged) == EVENTS
    guard_lines = [r for r in logged if "error_class=max_attempts" in r.getMessage()]
    assert len(guard_lines) == len(by_guard)
