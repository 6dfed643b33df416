"""The relay's observer hooks: they live in outboxkit.sink.observer (both relays use them)."""

from outboxkit.sink.observer import (
    BatchTracing,
    Failure,
    Observers,
    RelayObserver,
    RelayStats,
    StatsObserver,
    SummaryLog,
    default_observer,
)

__all__ = [
    "BatchTracing",
    "Failure",
    "Observers",
    "RelayObserver",
    "RelayStats",
    "StatsObserver",
    "SummaryLog",
    "default_observer",
]
