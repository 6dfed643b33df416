"""Which WAL position the relay may confirm: only one all of whose events the broker confirmed.

The stream hands events over in commit order. Each event gets a sequence number; each
commit (and each keepalive seen between transactions) becomes a marker "once the first
``seq`` events are settled, ``lsn`` may be confirmed". Settling is in order, so the
confirmable position is the last marker whose events are all settled. Pure: no I/O.
"""

from __future__ import annotations

from collections import deque


class Progress:
    """Sequence numbers of streamed events and the WAL positions they unlock."""

    __slots__ = ("_markers", "confirmed", "in_transaction", "received", "settled")

    def __init__(self, confirmed: int = 0) -> None:
        #: Events handed over by the stream so far (the next event's sequence number).
        self.received = 0
        #: Events settled (published or dead-lettered), always a prefix of those received.
        self.settled = 0
        #: The last LSN confirmed (or known confirmed: the slot's position at start).
        self.confirmed = confirmed
        self.in_transaction = False
        # (events received when the position was reached, end LSN), both increasing.
        self._markers: deque[tuple[int, int]] = deque()

    def begin(self) -> None:
        self.in_transaction = True

    def event(self) -> int:
        """Number the next event of the stream."""
        seq = self.received
        self.received += 1
        return seq

    def commit(self, end_lsn: int) -> None:
        """A transaction ended at ``end_lsn``: confirmable once its events are settled."""
        self.in_transaction = False
        self._mark(end_lsn)

    def keepalive(self, wal_end: int) -> None:
        """The server has sent everything before ``wal_end``: between transactions that
        position is confirmable once the events received so far are settled (idle advance).
        Inside a transaction it is not: the rest of the transaction lies before it."""
        if not self.in_transaction:
            self._mark(wal_end)

    def _mark(self, lsn: int) -> None:
        markers = self._markers
        if markers and markers[-1][0] == self.received:
            # Nothing received since the last marker: move it forward instead of adding one.
            if lsn > markers[-1][1]:
                markers[-1] = (self.received, lsn)
            return
        if lsn > (markers[-1][1] if markers else self.confirmed):
            markers.append((self.received, lsn))

    def settle(self, upto: int) -> None:
        """The first ``upto`` events are published or dead-lettered."""
        if upto > self.received or upto < self.settled:
            raise ValueError(f"settle({upto}) outside {self.settled}..{self.received}")
        self.settled = upto

    def confirmable(self) -> int | None:
        """The highest marker whose events are all settled, if beyond ``confirmed``."""
        markers = self._markers
        best: int | None = None
        while markers and markers[0][0] <= self.settled:
            best = markers.popleft()[1]
        if best is None or best <= self.confirmed:
            return None
        self.confirmed = best
        return best

    @property
    def idle(self) -> bool:
        """Nothing received and unsettled, no transaction half-streamed."""
        return self.settled == self.received and not self.in_transaction
