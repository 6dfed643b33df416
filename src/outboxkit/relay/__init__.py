"""The relay: claim a batch, publish it, settle the outcome; repeat."""

from outboxkit.relay.engine import Relay
from outboxkit.sink.observer import RelayObserver, RelayStats

__all__ = ["Relay", "RelayObserver", "RelayStats"]
