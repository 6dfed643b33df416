"""One writer process of the chaos run: business transactions with events, some rolled back.

Every committed transaction inserts its event ids into ``chaos_ledger`` in the same
transaction as the events, so the ledger is exactly what committed, whatever else
fails. Transactions rolled back on purpose (and those refused at ``put``) append
their event ids to ``--rolled-back`` after the rollback: none may ever reach the
broker. A commit whose outcome is unknown (the connection broke during it) is in
the ledger or not, as the database decided; it is never counted as rolled back.

    python -m tests.support.chaos_writer --dsn DSN --seconds 60 --seed 1 --rolled-back F
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import psycopg

from outboxkit import Event, InvalidEventError, Outbox

LEDGER = """
CREATE TABLE IF NOT EXISTS chaos_ledger (
    event_id uuid PRIMARY KEY,
    kind     text NOT NULL,     -- ok | poison | oversized
    writer   int NOT NULL
)
"""
TOPIC = "chaos.orders"
POISON_TOPIC = "poison.orders"  # no stream stores it: retried, then dead-lettered
OUTBOX_MAX_PAYLOAD = 2 * 1024 * 1024  # over the broker's 1 MiB: rejected by NATS
BROKER_REJECTS = 1_200_000  # bytes: accepted by the outbox, refused by the broker
# The most Event() takes by default: over NATS's max_payload only with its headers, which
# the server answered by dropping the connection of its neighbours too (issue 26).
AT_THE_LIMIT = 1024 * 1024
OUTBOX_REFUSES = 3 * 1024 * 1024  # bytes: refused at put, the transaction rolls back


class _Rollback(Exception):
    pass


def _event(kind: str, writer: int, n: int, rng: random.Random) -> Event:
    topic = POISON_TOPIC if kind == "poison" else TOPIC
    if kind == "oversized":
        payload: Any = b"x" * (BROKER_REJECTS if n % 2 else AT_THE_LIMIT)
    elif kind == "refused":
        payload = b"x" * OUTBOX_REFUSES
    else:
        payload = {"writer": writer, "n": n, "pad": "p" * rng.randrange(0, 400)}
    return Event(
        topic=topic,
        event_type="order.placed",
        key=f"customer-{rng.randrange(50)}",
        payload=payload,
        headers={"writer": str(writer)},
    )


def run(dsn: str, seconds: float, seed: int, rolled_back: Path) -> dict[str, int]:
    rng = random.Random(seed)
    outbox = Outbox(max_payload_bytes=OUTBOX_MAX_PAYLOAD)
    counts = {"committed": 0, "rolled_back": 0, "refused": 0, "unknown": 0, "events": 0}
    deadline = time.monotonic() + seconds
    n = 0
    with rolled_back.open("a") as log:
        conn: psycopg.Connection[Any] | None = None
        while time.monotonic() < deadline:
            if conn is None or conn.closed:
                conn = psycopg.connect(dsn, autocommit=True)
            roll = rng.random()
            kind = "ok"
            if roll < 0.03:
                kind = "poison"
            elif roll < 0.045:
                kind = "oversized"
            elif roll < 0.06:
                kind = "refused"
            rollback = kind == "ok" and rng.random() < 0.15
            events = [_event(kind, seed, n + i, rng) for i in range(rng.randint(1, 4))]
            n += len(events)
            ids = [str(e.event_id) for e in events]
            try:
                if kind == "refused":
                    try:
                        with outbox.transaction(conn) as tx:
                            conn.execute(
                                "INSERT INTO chaos_ledger VALUES (%s, 'ok', %s)", (ids[0], seed)
                            )
                            tx.put_many(events)
                    except InvalidEventError:
                        counts["refused"] += 1
                        log.write("\n".join(ids) + "\n")
                        log.flush()
                        continue
                    raise AssertionError("an oversized event was accepted at put")
                with outbox.transaction(conn) as tx:
                    with conn.cursor() as cur:
                        cur.executemany(
                            "INSERT INTO chaos_ledger VALUES (%s, %s, %s)",
                            [(i, kind, seed) for i in ids],
                        )
                    if rng.random() < 0.5:
                        tx.put_many(events)
                    else:  # the other write path, in the same transaction
                        outbox.put_many(conn, events)
                    if rollback:
                        raise _Rollback
                counts["committed"] += 1
                counts["events"] += len(events)
            except _Rollback:
                counts["rolled_back"] += 1
                log.write("\n".join(ids) + "\n")
                log.flush()
            except psycopg.OperationalError:
                counts["unknown"] += 1  # the ledger tells whether it committed
                conn.close()
                time.sleep(0.2)
            time.sleep(rng.uniform(0.002, 0.02))
        if conn is not None:
            conn.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--rolled-back", type=Path, required=True)
    args = ap.parse_args()
    counts = run(args.dsn, args.seconds, args.seed, args.rolled_back)
    print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    main()
