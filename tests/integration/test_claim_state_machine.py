"""The claim / publish / settle / lease-expiry state machine against a model (hypothesis).

Several relays run the real statements of ``backends/postgres/postgres.py`` against a real
PostgreSQL in any interleaving hypothesis finds: claims, publishes, settles
(published, failed, handed back), crashes (a relay forgets its claim), and lease
expiries (time passing beyond a claim's lease, by moving its ``available_at``
into the past). After every step, and after a final drain:

* a fenced settle never overwrites a newer claim: a relay's settle changes only
  rows its own claim still holds, and exactly those;
* a row is held by at most one unexpired lease;
* every committed event is eventually published at least once, and nothing
  rolled back ever is.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.postgres import Statements, Status

# Drives the CPUs itself (many processes, real faults): run alone under xdist.
pytestmark = pytest.mark.exclusive

RELAYS = 3
LEASE = 60.0  # seconds: only the test's expire() ends a lease, never the clock


@dataclass
class _Claim:
    token: uuid.UUID
    rows: dict[int, str]  # row id -> event id
    published: bool = False


@dataclass
class _Model:
    committed: set[str] = field(default_factory=set)
    rolled_back: set[str] = field(default_factory=set)
    broker: list[str] = field(default_factory=list)
    owner: dict[int, uuid.UUID] = field(default_factory=dict)  # row id -> latest claim token
    expired: set[uuid.UUID] = field(default_factory=set)


def _machine(dsn: str) -> type[RuleBasedStateMachine]:
    sql = Statements("outbox")
    conn = psycopg.connect(dsn, autocommit=True)
    outbox = Outbox(notify=False)

    class ClaimMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            conn.execute("TRUNCATE outbox")
            self.model = _Model()
            self.tokens = 0  # claim tokens from a counter: a rerun draws the same way
            self.claims: list[_Claim | None] = [None] * RELAYS

        # -- the application -------------------------------------------------------

        @initialize()
        def backlog(self) -> None:
            self.write(8, rollback=False)

        @rule(n=st.integers(1, 4), rollback=st.booleans())
        def write(self, n: int, rollback: bool) -> None:
            events = [Event(topic="t", event_type="e", payload=b"x") for _ in range(n)]
            ids = {str(e.event_id) for e in events}
            try:
                with conn.transaction():
                    outbox.put_many(conn, events)
                    if rollback:
                        raise _RolledBack
            except _RolledBack:
                self.model.rolled_back |= ids
            else:
                self.model.committed |= ids

        # -- relays ----------------------------------------------------------------

        def _idle(self) -> list[int]:
            return [i for i, c in enumerate(self.claims) if c is None]

        def _busy(self) -> list[int]:
            return [i for i, c in enumerate(self.claims) if c is not None]

        @precondition(lambda self: self._idle())
        @rule(data=st.data(), limit=st.integers(1, 5))
        def claim(self, data: st.DataObject, limit: int) -> None:
            relay = data.draw(st.sampled_from(self._idle()))
            self.tokens += 1
            token = uuid.UUID(int=self.tokens)
            params = {
                "lease": LEASE,
                "token": token,
                "relay_id": f"r{relay}",
                "limit": limit,
                "max_attempts": 1_000_000,  # attempts are not what this models
                "commit": None,
            }
            rows = conn.execute(sql.claim_batch, params).fetchall()
            claim = _Claim(token, {r[0]: str(r[1]) for r in rows})
            for row_id in claim.rows:
                previous = self.model.owner.get(row_id)
                # Only a row whose lease ended (or that was never or no longer held) is claimable.
                assert previous is None or previous in self.model.expired, (row_id, previous)
                self.model.owner[row_id] = token
            self.claims[relay] = claim

        @precondition(lambda self: self._busy())
        @rule(data=st.data())
        def publish(self, data: st.DataObject) -> None:
            claim = self.claims[data.draw(st.sampled_from(self._busy()))]
            assert claim is not None
            if not claim.published:
                self.model.broker.extend(claim.rows.values())
                claim.published = True

        @precondition(lambda self: self._busy())
        @rule(data=st.data(), outcome=st.sampled_from(["ok", "retry", "back"]))
        def settle(self, data: st.DataObject, outcome: str) -> None:
            relay = data.draw(st.sampled_from(self._busy()))
            claim = self.claims[relay]
            assert claim is not None
            if outcome == "ok" and not claim.published:
                return
            ids = list(claim.rows)
            if outcome == "ok":
                cur = conn.execute(sql.settle_published_delete, (ids, claim.token, None))
            else:
                n = len(ids)
                cur = conn.execute(
                    sql.settle_failures,
                    (
                        ids,
                        [Status.PENDING] * n,
                        [0.0] * n,
                        ["boom"] * n,
                        [1 if outcome == "back" else 0] * n,
                        claim.token,
                        None,
                    ),
                )
            still_mine = [i for i in ids if self.model.owner.get(i) == claim.token]
            # The fence: exactly the rows this claim still holds, never a newer claim's.
            assert cur.rowcount == len(still_mine), (cur.rowcount, still_mine)
            for row_id in still_mine:
                del self.model.owner[row_id]
            self.claims[relay] = None

        @precondition(lambda self: self._busy())
        @rule(data=st.data())
        def crash(self, data: st.DataObject) -> None:
            # Its rows stay leased until the lease runs out.
            self.claims[data.draw(st.sampled_from(self._busy()))] = None

        @precondition(lambda self: self._busy())
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            relay = data.draw(st.sampled_from(self._busy()))
            claim = self.claims[relay]
            assert claim is not None
            cur = conn.execute(sql.release_leases, (list(claim.rows), claim.token, None))
            still_mine = [i for i in claim.rows if self.model.owner.get(i) == claim.token]
            assert cur.rowcount == len(still_mine)
            for row_id in still_mine:
                del self.model.owner[row_id]
            self.claims[relay] = None

        def _live_leases(self) -> list[uuid.UUID]:
            return sorted(set(self.model.owner.values()) - self.model.expired, key=lambda t: t.int)

        @precondition(lambda self: self._live_leases())
        @rule(data=st.data())
        def lease_expires(self, data: st.DataObject) -> None:
            token = data.draw(st.sampled_from(self._live_leases()))
            # '-infinity', not now() minus something: which rows a later claim takes
            # must not depend on how long the steps took (hypothesis replays examples).
            conn.execute(
                "UPDATE outbox SET available_at = '-infinity' WHERE claim_token = %s", (token,)
            )
            self.model.expired.add(token)

        # -- invariants ------------------------------------------------------------

        @invariant()
        def leases_match_the_model(self) -> None:
            held = dict(
                conn.execute(
                    "SELECT id, claim_token FROM outbox"
                    " WHERE claim_token IS NOT NULL AND status = %s",
                    (Status.PENDING,),
                ).fetchall()
            )
            assert held == self.model.owner
            assert conn.execute(
                "SELECT count(*) FROM outbox WHERE status = %s", (Status.FAILED,)
            ).fetchone() == (0,)

        def teardown(self) -> None:
            # Every lease ends, one relay drains what is left: all committed, nothing else.
            conn.execute("UPDATE outbox SET available_at = now() - interval '1 second'")
            self.model.expired |= set(self.model.owner.values())
            for _ in range(1000):
                token = uuid.uuid4()
                params = {
                    "lease": LEASE,
                    "token": token,
                    "relay_id": "drain",
                    "limit": 50,
                    "max_attempts": 1_000_000,  # attempts are not what this models
                    "commit": None,
                }
                rows = conn.execute(sql.claim_batch, params).fetchall()
                if not rows:
                    break
                self.model.broker.extend(str(r[1]) for r in rows)
                conn.execute(sql.settle_published_delete, ([r[0] for r in rows], token, None))
            published = set(self.model.broker)
            assert self.model.committed <= published, "a committed event was never published"
            assert not (published & self.model.rolled_back), "a rolled-back event was published"
            assert published <= self.model.committed
            assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)

    return ClaimMachine


class _RolledBack(Exception):
    pass


def test_any_interleaving_of_relays_crashes_and_lease_expiries_keeps_the_guarantees(
    db_dsn: str,
) -> None:
    machine = _machine(db_dsn)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=100,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            database=None,
        ),
    )
