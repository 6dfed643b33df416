"""One writer process of the ordered chaos run: keyed events in transactions, some rolled back.

Writes through ``Outbox(ordered=True)`` (the key locks) with ``put_many``/``put`` inside
the transaction, then, in the same transaction, records each event's place in its key's
committed sequence, read from the database side: the transaction increments a per-key
counter row (``ochaos_keys``, locked in key order, held until COMMIT) *after* its events
took their ids. Two transactions of one key therefore get their counter values in their
commit order, whatever order their ids came in: a write side that let ids and commit order
disagree shows as a reordering. ``ochaos_ledger`` holds (event_id, key, n, pos): the key's
committed sequence is its ledger rows by (n, pos). Rolled-back transactions leave no
ledger row; their event ids go to ``--rolled-back``: none may reach the broker.

(``Outbox.transaction()`` is not used here: it inserts at COMMIT, after the counter, so
the counter would no longer witness the order the ids were taken in.)

    python -m tests.support.ordered_chaos_writer --dsn DSN --events 5000 --seconds 30 \
        --seed 1 --keys 200 --rolled-back F
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import psycopg

from outboxkit import Event, Outbox

TOPIC = "ochaos.events"
SCHEMA = """
CREATE TABLE IF NOT EXISTS ochaos_keys (key text PRIMARY KEY, n bigint NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS ochaos_ledger (
    event_id uuid PRIMARY KEY,
    key      text NOT NULL,
    n        bigint NOT NULL,   -- the transaction's place among the key's commits
    pos      int NOT NULL,      -- the event's place among the key's events in it
    writer   int NOT NULL
);
"""
# The counter rows of the transaction's keys, locked in key order (no deadlock between two
# writers) and incremented: their values order the key's transactions by commit. The
# events' ledger rows take their key's value, in the same statement.
RECORD = """
WITH locked AS MATERIALIZED (
    SELECT key FROM ochaos_keys WHERE key = ANY(%(keys)s::text[]) ORDER BY key FOR UPDATE
), commit_no AS (
    UPDATE ochaos_keys AS k SET n = k.n + 1 FROM locked WHERE k.key = locked.key
    RETURNING k.key, k.n
)
INSERT INTO ochaos_ledger (event_id, key, n, pos, writer)
SELECT e.event_id, e.key, c.n, e.pos, %(writer)s
FROM unnest(%(ids)s::uuid[], %(event_keys)s::text[], %(pos)s::int[]) AS e(event_id, key, pos)
JOIN commit_no AS c ON c.key = e.key
"""


def key_name(i: int) -> str:
    return f"key-{i:03d}"


def setup(dsn: str, keys: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute(
            "INSERT INTO ochaos_keys (key) SELECT unnest(%s::text[]) ON CONFLICT DO NOTHING",
            ([key_name(i) for i in range(keys)],),
        )


class _Rollback(Exception):
    pass


def run(
    dsn: str,
    *,
    events: int,
    seconds: float,
    seed: int,
    keys: int,
    rolled_back: Path,
    rollback_rate: float = 0.12,
) -> dict[str, int]:
    """Commit at least ``events`` events, spread over about ``seconds``."""
    rng = random.Random(seed)
    outbox = Outbox(ordered=True)
    counts = {"committed": 0, "events": 0, "rolled_back": 0, "unknown": 0}
    started = time.monotonic()
    serial = 0
    conn: psycopg.Connection[Any] | None = None
    with rolled_back.open("a") as log:
        while counts["events"] < events:
            if conn is None or conn.closed:
                # No WAL flush wait per commit: the run crashes no database, and the writers
                # must outpace a shared machine's fsync to load three relays.
                conn = psycopg.connect(dsn, autocommit=True, options="-c synchronous_commit=off")
            # Pace: the events spread over the run, so faults land throughout the writing.
            ahead = counts["events"] / events * seconds - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
            hot = rng.random() < 0.2  # a few hot keys: long per-key sequences, contention
            batch = [
                Event(
                    topic=TOPIC,
                    event_type="ochaos.step",
                    key=key_name(rng.randrange(8) if hot else rng.randrange(keys)),
                    payload={"w": seed, "s": serial + i},
                )
                for i in range(rng.randint(1, 8))
            ]
            serial += len(batch)
            rollback = rng.random() < rollback_rate
            try:
                # One round trip: BEGIN, the events, the ledger and COMMIT in a pipeline.
                with conn.pipeline(), conn.transaction():
                    if len(batch) == 1 and rng.random() < 0.5:
                        outbox.put(conn, batch[0])
                    else:
                        outbox.put_many(conn, batch)
                    pos: dict[str, int] = {}
                    places = []
                    for e in batch:
                        assert e.key is not None
                        places.append(pos.setdefault(e.key, 0))
                        pos[e.key] += 1
                    conn.execute(
                        RECORD,
                        {
                            "keys": sorted(pos),
                            "writer": seed,
                            "ids": [e.event_id for e in batch],
                            "event_keys": [e.key for e in batch],
                            "pos": places,
                        },
                    )
                    if rollback:
                        raise _Rollback
                counts["committed"] += 1
                counts["events"] += len(batch)
            except _Rollback:
                counts["rolled_back"] += len(batch)
                log.write("".join(f"{e.event_id}\n" for e in batch))
                log.flush()
            except psycopg.OperationalError:
                counts["unknown"] += 1  # the ledger tells whether it committed
                conn.close()
                time.sleep(0.2)
    if conn is not None:
        conn.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--events", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--keys", type=int, required=True)
    ap.add_argument("--rolled-back", type=Path, required=True)
    args = ap.parse_args()
    counts = run(
        args.dsn,
        events=args.events,
        seconds=args.seconds,
        seed=args.seed,
        keys=args.keys,
        rolled_back=args.rolled_back,
    )
    print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    main()
