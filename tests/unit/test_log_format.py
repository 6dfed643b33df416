"""Log formatting: JSON fields, redaction of messages, extras and tracebacks; summary pacing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import uuid
from pathlib import Path

import pytest

from outboxkit.ops.logs import JsonFormatter, RedactingFormatter
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.sink.observer import SummaryLog
from outboxkit.sink.outage import OutageLog

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
    monkeypatch.setattr("outboxkit.sink.observer.time.monotonic", lambda: now[0])
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


FORGED = "orders\n2026-01-01 00:00:00,000 WARNING outboxkit.audit: admin login ok\r\x1b[2K\x85"


def test_text_lines_escape_control_characters_in_every_value() -> None:
    fmt = RedactingFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    text = fmt.format(_record("publish failed: topic=%s key=%r", FORGED, "k\u2028x"))
    assert "\n" not in text and "\r" not in text and "\x1b" not in text and "\x85" not in text
    assert "topic=orders\\n2026-01-01 00:00:00,000 WARNING outboxkit.audit:" in text
    assert "\\r\\x1b[2K\\x85" in text and "\\u2028" in text


def test_text_tracebacks_keep_their_lines_indented_so_none_reads_as_a_record() -> None:
    fmt = RedactingFormatter("%(levelname)s %(message)s")
    try:
        raise ValueError(f"bad topic {FORGED}")
    except ValueError:
        import sys

        record = _record("failed")
        record.exc_info = sys.exc_info()
    text = fmt.format(record)
    first, *rest = text.split("\n")
    assert first == "WARNING failed"
    assert rest and all(line.startswith("    ") for line in rest), text
    assert "\x1b" not in text and "\r" not in text


def test_json_lines_escape_every_control_character() -> None:
    line = JsonFormatter().format(_record("topic=%s", FORGED, topic=FORGED + "\u2029"))
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert "\x85" not in line and "\u2029" not in line
    entry = json.loads(line)
    assert entry["msg"] == f"topic={FORGED}", "escapes decode to the value logged"
    assert entry["topic"] == FORGED + "\u2029"


def test_library_lines_are_held_back_per_kind_and_librdkafka_errors_become_warnings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outboxkit.ops.logs import LIBRDKAFKA_LOGGER, LibraryLogLimiter

    now = [100.0]
    monkeypatch.setattr("outboxkit.ops.logs.time.monotonic", lambda: now[0])
    limiter = LibraryLogLimiter(interval=60.0)

    def rec(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, msg, args, None)

    fail = ("FAIL", "rdkafka#producer-1", "Connect to ipv4#127.0.0.1:9092 failed: refused")
    passed = []
    for _ in range(170):  # librdkafka's lines in 10 s with the broker down
        r = rec(LIBRDKAFKA_LOGGER, logging.ERROR, "%s [%s] %s", *fail)
        if limiter.filter(r):
            passed.append(r)
        now[0] += 10 / 170
    other = rec(LIBRDKAFKA_LOGGER, logging.ERROR, "%s [%s] %s", "ERROR", "rdkafka", "x")
    assert limiter.filter(other), "another facility is another kind"
    assert len(passed) == 1 and passed[0].levelname == "WARNING"
    nats_line = rec("nats.aio.client", logging.ERROR, "nats: encountered error")
    assert limiter.filter(nats_line) and not limiter.filter(nats_line)
    own = rec("outboxkit.relay", logging.WARNING, "x")
    assert all(limiter.filter(own) for _ in range(5)), "outboxkit's own lines are not limited"
    now[0] += 60
    r = rec(LIBRDKAFKA_LOGGER, logging.ERROR, "%s [%s] %s", *fail)
    assert limiter.filter(r)
    assert r.getMessage().endswith("(169 similar line(s) held back)")


def _messages(n: int, attempt: int = 1, topic: str = "orders") -> list[OutboundMessage]:
    now = dt.datetime.now(dt.UTC)
    return [
        OutboundMessage(uuid.uuid4(), topic, None, "x", None, None, b"{}", {}, now, attempt)
        for _ in range(n)
    ]


def test_an_outage_is_one_warning_a_reminder_per_interval_and_one_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    outage = OutageLog(max_attempts=10, remind_every=30.0, recover_after=5.0, clock=lambda: now[0])
    backlog = _messages(3000)
    down = PublishResult.retry("ConnectionError: not connected", "ConnectionError")
    handed_back = PublishResult.hand_back("nats: not connected (reconnecting)", "connection")
    with caplog.at_level(logging.DEBUG, logger="outboxkit.relay"):
        for step in range(500):  # 50 s down: batches of 1000 failing every 0.1 s
            batch = backlog[(step % 3) * 1000 : (step % 3 + 1) * 1000]
            outage.claimed(1000, 0.0)
            result = down if step % 2 else handed_back
            outage.processed(batch, [result] * 1000, 0.0)
            now[0] += 0.1
        assert outage.failing and outage.waiting == 3000
        for i in range(3):
            batch = backlog[i * 1000 : (i + 1) * 1000]
            outage.processed(batch, [PublishResult.success()] * 1000, 0.0)
            now[0] += 1
        assert outage.failing, "not over until nothing failed for recover_after"
        now[0] += 5
        outage.claimed(0, 0.0)
    assert not outage.failing and outage.waiting == 0
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [lvl for lvl, _ in lines] == ["WARNING", "WARNING", "INFO"], lines
    assert lines[0][1].startswith("publishing failing: connection: nats: not connected")
    assert "topic=orders" in lines[0][1]
    assert "still failing after 30s: 300000 failed publishes" in lines[1][1]
    assert "3000 events waiting" in lines[1][1]
    assert (
        "recovered after 50s: 500000 failed publishes, 0 dead-lettered, 3000 events delayed"
        in (lines[2][1])
    )


def test_dead_letters_leave_the_waiting_count_and_a_poison_event_flaps_no_more_than_its_retries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    outage = OutageLog(max_attempts=2, remind_every=30.0, recover_after=5.0, clock=lambda: now[0])
    healthy = PublishResult.success()
    poison = PublishResult.retry("no stream", "no_stream")
    with caplog.at_level(logging.INFO, logger="outboxkit.relay"):
        [first] = _messages(1)
        outage.processed([first, *_messages(9)], [poison] + [healthy] * 9, 0.0)
        assert outage.failing and outage.waiting == 1
        last = dataclasses.replace(first, attempt=2)
        outage.processed([last], [poison], 0.0)  # its last attempt: dead-lettered
        assert outage.waiting == 0
        for _ in range(100):  # healthy traffic afterwards, one batch a second
            now[0] += 1
            outage.processed(_messages(5), [healthy] * 5, 0.0)
    assert not outage.failing
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert "1 dead-lettered" in caplog.records[1].getMessage()


def test_a_database_outage_is_one_warning_reminders_and_one_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from outboxkit.queue.episode import FailureEpisode

    now = [0.0]
    episode = FailureEpisode("database", remind_every=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="outboxkit.relay"):
        episode.succeeded()  # nothing failed: nothing to say
        for _ in range(100):  # 50 s of reconnect attempts every 0.5 s
            episode.failed("database unavailable during %s (%s)", "claim", "refused")
            now[0] += 0.5
        now[0] -= 0.5
        episode.succeeded()  # too soon: another connection may still be failing
        assert episode.started_at is not None
        now[0] += 5
        episode.succeeded()
        episode.succeeded()
    by_level = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelname != "DEBUG"]
    assert by_level == [
        ("WARNING", "database unavailable during claim (refused)"),
        (
            "WARNING",
            "database still failing after 30s (61 failures): database unavailable during claim"
            " (refused)",
        ),
        ("INFO", "database back after 50s (100 failures)"),
    ]
    assert len([r for r in caplog.records if r.levelname == "DEBUG"]) == 98


def test_a_fleet_line_names_its_database_in_text_and_in_json() -> None:
    """outboxkit.fleet's DatabaseTag: a record logged inside a database's task says which."""
    from outboxkit.fleet.supervisor import DatabaseTag, current_database

    tag = DatabaseTag()
    token = current_database.set("acme")
    try:
        record = _record("relay %s starting", "r1")
        tag.filter(record)
    finally:
        current_database.reset(token)
    outside = _record("relay fleet starting")
    tag.filter(outside)
    text = RedactingFormatter("%(name)s: %(message)s")
    assert text.format(record) == "outboxkit.relay: [acme] relay r1 starting"
    assert text.format(outside) == "outboxkit.relay: relay fleet starting"
    assert json.loads(JsonFormatter().format(record))["database"] == "acme"
    assert "database" not in json.loads(JsonFormatter().format(outside))


def test_a_fleet_lease_round_failing_every_round_is_one_traceback_then_reminders(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A bug in the lease round is told once with its traceback, not once a round."""
    from outboxkit.fleet.supervisor import Fleet

    path = tmp_path / "dsns"
    path.write_text("")
    fleet = Fleet(path, lambda database: None, lease=0.03)  # type: ignore[arg-type,return-value]
    rounds = 0

    async def broken_round() -> None:
        nonlocal rounds
        rounds += 1
        raise KeyError("a bug")

    fleet._share_round = broken_round  # type: ignore[method-assign]

    async def main() -> None:
        task = asyncio.ensure_future(fleet._share())
        while rounds < 20:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="outboxkit.fleet"):
        asyncio.run(main())
    lines = [r for r in caplog.records if r.name == "outboxkit.fleet"]
    assert [r.getMessage() for r in lines] == [
        "the fleet's lease round failed: KeyError: 'a bug'; retrying every 0.0s"
    ]
    assert lines[0].exc_info is not None
