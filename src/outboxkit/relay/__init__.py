"""The relay: claim a batch, publish it, settle the outcome; repeat."""

from outboxkit.relay.engine import Relay, RelayStats

__all__ = ["Relay", "RelayStats"]
