"""Publish failures as an outage: it lives in outboxkit.sink.outage (both relays use it)."""

from outboxkit.sink.outage import FailureEpisode, OutageLog

__all__ = ["FailureEpisode", "OutageLog"]
