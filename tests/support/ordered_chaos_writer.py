"""One writer process of the ordered chaos run: keyed events in transactions, some rolled back.

Writes through ``Outbox(ordered=True)`` (the key locks) with ``put_many``/``put`` inside
the transaction (on a ``mysql://`` DSN: ``Outbox(storage="mariadb", ordered=True)``, the
same ledger in MariaDB's SQL), then, in the same transaction, records each event's place
in its key's committed sequence, read from the database side: the transaction increments a per-key
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
import pymysql

from outboxkit import Event, Outbox
from outboxkit.backends.mariadb.sql import connect_args, is_mysql_url

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
    if is_mysql_url(dsn):
        _MariaDB.setup(dsn, keys)
        return
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute(
            "INSERT INTO ochaos_keys (key) SELECT unnest(%s::text[]) ON CONFLICT DO NOTHING",
            ([key_name(i) for i in range(keys)],),
        )


class _Rollback(Exception):
    pass


class _Postgres:
    """One writer's transactions on PostgreSQL (psycopg, one pipeline per transaction)."""

    lost: type[Exception] = psycopg.OperationalError

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.outbox = Outbox(ordered=True)
        self.conn: psycopg.Connection[Any] | None = None

    def commit(
        self, batch: list[Event], record: dict[str, Any], rollback: bool, single: bool
    ) -> None:
        if self.conn is None or self.conn.closed:
            # No WAL flush wait per commit: the run crashes no database, and the writers
            # must outpace a shared machine's fsync to load three relays.
            self.conn = psycopg.connect(
                self.dsn, autocommit=True, options="-c synchronous_commit=off"
            )
        conn = self.conn
        # One round trip: BEGIN, the events, the ledger and COMMIT in a pipeline.
        with conn.pipeline(), conn.transaction():
            if single:
                self.outbox.put(conn, batch[0])
            else:
                self.outbox.put_many(conn, batch)
            conn.execute(RECORD, record)
            if rollback:
                raise _Rollback

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None


class _MariaDB:
    """One writer's transactions on MariaDB (PyMySQL): the same ledger, in MariaDB's SQL."""

    lost: type[Exception] = pymysql.err.OperationalError

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.outbox = Outbox(storage="mariadb", ordered=True)
        self.conn: Any = None

    @staticmethod
    def setup(dsn: str, keys: int) -> None:
        conn = pymysql.connect(**connect_args(dsn), autocommit=True)
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "CREATE TABLE IF NOT EXISTS ochaos_keys"
                    " (k VARCHAR(32) PRIMARY KEY, n BIGINT NOT NULL DEFAULT 0)"
                )
                cur.execute(
                    "CREATE TABLE IF NOT EXISTS ochaos_ledger (event_id CHAR(36) PRIMARY KEY,"
                    " k VARCHAR(32) NOT NULL, n BIGINT NOT NULL, pos INT NOT NULL,"
                    " writer INT NOT NULL)"
                )
                cur.executemany(
                    "INSERT IGNORE INTO ochaos_keys (k) VALUES (%s)",
                    [(key_name(i),) for i in range(keys)],
                )
        finally:
            conn.close()

    def commit(
        self, batch: list[Event], record: dict[str, Any], rollback: bool, single: bool
    ) -> None:
        if self.conn is None or not self.conn.open:
            self.conn = pymysql.connect(**connect_args(self.dsn))
        conn = self.conn
        try:
            if single:
                self.outbox.put(conn, batch[0])
            else:
                self.outbox.put_many(conn, batch)
            keys = record["keys"]
            marks = ",".join(["%s"] * len(keys))
            with conn.cursor() as cur:
                # The key's commit counter, after the events took their ids (as RECORD).
                cur.execute(f"UPDATE ochaos_keys SET n = n + 1 WHERE k IN ({marks})", keys)
                cur.execute(f"SELECT k, n FROM ochaos_keys WHERE k IN ({marks})", keys)
                n = dict(cur.fetchall())
                cur.executemany(
                    "INSERT INTO ochaos_ledger (event_id, k, n, pos, writer)"
                    " VALUES (%s, %s, %s, %s, %s)",
                    [
                        (str(i), k, n[k], p, record["writer"])
                        for i, k, p in zip(
                            record["ids"], record["event_keys"], record["pos"], strict=True
                        )
                    ],
                )
            if rollback:
                raise _Rollback
            conn.commit()
        except BaseException:
            if conn.open:
                conn.rollback()
            raise

    def close(self) -> None:
        if self.conn is not None and self.conn.open:
            self.conn.close()
        self.conn = None


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
    db: _Postgres | _MariaDB = _MariaDB(dsn) if is_mysql_url(dsn) else _Postgres(dsn)
    counts = {"committed": 0, "events": 0, "rolled_back": 0, "unknown": 0}
    started = time.monotonic()
    serial = 0
    with rolled_back.open("a") as log:
        while counts["events"] < events:
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
            pos: dict[str, int] = {}
            places = []
            for e in batch:
                assert e.key is not None
                places.append(pos.setdefault(e.key, 0))
                pos[e.key] += 1
            record = {
                "keys": sorted(pos),
                "writer": seed,
                "ids": [e.event_id for e in batch],
                "event_keys": [e.key for e in batch],
                "pos": places,
            }
            try:
                db.commit(batch, record, rollback, len(batch) == 1 and rng.random() < 0.5)
                counts["committed"] += 1
                counts["events"] += len(batch)
            except _Rollback:
                counts["rolled_back"] += len(batch)
                log.write("".join(f"{e.event_id}\n" for e in batch))
                log.flush()
            except db.lost:
                counts["unknown"] += 1  # the ledger tells whether it committed
                db.close()
                time.sleep(0.2)
    db.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--events", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--keys", type=int, required=True)
    ap.add_argument("--rolled-back", type=Path, required=True)
    ap.add_argument("--rollback-rate", type=float, default=0.12)
    args = ap.parse_args()
    counts = run(
        args.dsn,
        events=args.events,
        seconds=args.seconds,
        seed=args.seed,
        keys=args.keys,
        rolled_back=args.rolled_back,
        rollback_rate=args.rollback_rate,
    )
    print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    main()
