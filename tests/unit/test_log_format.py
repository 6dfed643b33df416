"""Log formatting: JSON fields, redaction of messages, extras and tracebacks; summary pacing."""

from __future__ import annotations

import json
import logging

import pytest

from outboxkit.ops.logs import JsonFormatter, RedactingFormatter
from outboxkit.relay.observer import SummaryLog

DSN = "postgresql://app:hunter2@db:5432/shop"


def _record(msg: str, *args: object, exc: bool = False, **extra: object) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ConnectionError(f"cannot reach {DSN}")
        except ConnectionError:
            import sys

            exc_info = sys.exc_info()
    record = logging.LogRecord("outboxkit.relay", logging.WARNING, __file__, 1, msg, args, exc_info)
    for k, v in extra.items():
        setattr(record, k, v)
    return record


def test_json_lines_carry_fields_and_mask_passwords_everywhere() -> None:
    line = JsonFormatter().format(
        _record("connecting to %s", DSN, exc=True, target=DSN, published=3)
    )
    entry = json.loads(line)
    assert entry["level"] == "warning" and entry["logger"] == "outboxkit.relay"
    assert entry["msg"] == "connecting to postgresql://app:***@db:5432/shop"
    assert entry["published"] == 3
    assert entry["target"] == "postgresql://app:***@db:5432/shop"
    assert "ConnectionError" in entry["exc"]
    assert "hunter2" not in line


def test_text_lines_mask_passwords_in_messages_and_tracebacks() -> None:
    text = RedactingFormatter("%(levelname)s %(message)s").format(
        _record("dsn=%s password=%s", DSN, "x", exc=True)
    )
    assert "hunter2" not in text
    assert "password=***" in text


def test_summary_is_logged_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr("outboxkit.relay.observer.time.monotonic", lambda: now[0])
    summary = SummaryLog(interval=10.0)
    with caplog.at_level(logging.INFO, logger="outboxkit.relay"):
        for _ in range(50):
            summary.claimed(100, 0.001)
            summary.settled([object()] * 100, [], [])  # type: ignore[list-item]
            now[0] += 0.5  # 50 batches in 25 s
        summary.claimed(0, 0.001)
    lines = [r for r in caplog.records if r.getMessage().startswith("relay summary")]
    assert len(lines) == 2, [r.getMessage() for r in lines]

    def count() -> int:
        return len([r for r in caplog.records if r.getMessage().startswith("relay summary")])

    with caplog.at_level(logging.INFO, logger="outboxkit.relay"):
        now[0] += 60
        summary.claimed(0, 0.001)  # the rest of the last window is reported
        assert count() == 3
        assert sum(r.published for r in caplog.records if hasattr(r, "published")) == 5000
        now[0] += 60
        summary.claimed(0, 0.001)  # idle for a whole interval: no line
        assert count() == 3
