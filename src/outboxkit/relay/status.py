"""What readiness and metrics read of a relay (ops/metrics.py), whichever its source."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CdcStatus:
    """The WAL relay's state for metrics: its stream, its slot and its confirmed position."""

    slot: str
    streaming: bool
    standby: bool
    confirmed_lsn: int
    lag_seconds: float


@dataclass(frozen=True, slots=True)
class RelayStatus:
    """What readiness and metrics read of a relay, typed (ops/metrics.py), read without I/O.

    ``denied``: why the database refuses the relay's writes (claiming stopped), or None.
    ``partitions_owned``: ordered mode's partitions held now (None when not ordered).
    ``stream_down``: ``--source cdc``, seconds the replication stream has been failing
    and the last error's class (None while it streams or waits as a standby).
    ``cdc``: the WAL relay's position and state, or None for the polling relay.
    """

    denied: str | None = None
    partitions_owned: int | None = None
    stream_down: tuple[float, str] | None = None
    cdc: CdcStatus | None = None
