"""What an outbox table's operator functions report, the same from every backend.

The PostgreSQL admin (backends/postgres/admin.py) and MariaDB's (backends/mariadb/admin.py) both
return these shapes, so the CLI, the dashboard and the metrics print one format whichever database
they read."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TopicStatus:
    topic: str
    pending: int
    in_flight: int
    failed: int
    published: int
    oldest_pending_age_s: float | None

    def add(self, other: TopicStatus) -> None:
        """Fold ``other``'s counts in (the oldest pending age is the older of the two)."""
        add_counts(self, other)


@dataclass
class OutboxStatus:
    table: str
    pending: int = 0
    in_flight: int = 0
    failed: int = 0
    published: int = 0
    oldest_pending_age_s: float | None = None
    topics: list[TopicStatus] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LiveStatus:
    """A cheap reading for live views: bounded counts (published rows are not read)."""

    status: OutboxStatus
    last_id: int
    truncated: bool


def add_counts(into: TopicStatus | OutboxStatus, t: TopicStatus) -> None:
    """Add ``t``'s counts to ``into``; the oldest pending age is the older of the two."""
    into.pending += t.pending
    into.in_flight += t.in_flight
    into.failed += t.failed
    into.published += t.published
    if t.oldest_pending_age_s is not None:
        into.oldest_pending_age_s = max(into.oldest_pending_age_s or 0.0, t.oldest_pending_age_s)


def live_report(
    table: str,
    pending: list[tuple[str, int, int, float | None]],
    failed: list[tuple[str, int]],
    last_id: int,
    cap: int,
) -> LiveStatus:
    """A live status from the two capped readings: (topic, pending, in flight, oldest age)
    and (topic, failed) rows."""
    report = OutboxStatus(table=table)
    topics: dict[str, TopicStatus] = {}
    for topic, n_pending, n_in_flight, oldest in pending:
        topics[topic] = TopicStatus(topic, n_pending, n_in_flight, 0, 0, oldest)
    for topic, n_failed in failed:
        topics.setdefault(topic, TopicStatus(topic, 0, 0, 0, 0, None)).failed = n_failed
    for t in sorted(topics.values(), key=lambda t: t.topic):
        report.topics.append(t)
        add_counts(report, t)
    truncated = report.pending + report.in_flight >= cap or report.failed >= cap
    return LiveStatus(report, last_id, truncated)


#: An event named by its row id or by its event id (the UUID consumers see).
EventRef = int | uuid.UUID


def parse_event_ref(text: str) -> EventRef:
    """``"42"`` → row id 42, a UUID → that event id; anything else is refused by name."""
    if text.strip().isdigit():
        return int(text)
    try:
        return uuid.UUID(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is neither a row id nor an event id (UUID)") from None


#: The names of a row's status, as `outboxkit failed show` prints them.
STATUS_NAMES = {0: "pending", 1: "published", 2: "failed"}


def status_name(value: int) -> str:
    """``failed`` for 2; a value written by hand or by a newer release as its number."""
    return STATUS_NAMES.get(value, str(value))
