"""WAL written per event: a table outbox row vs a WAL-only logical message (storage="wal").

Sizes the replication slot's retention (docs/operations.md, "Sizing max_slot_wal_keep_size"):
the same events (10 per transaction, a ~100-byte JSON payload) are written through
`Outbox.put_many` and through `Outbox(storage="wal")`, and the WAL insert position is read
before and after, with full_page_writes off and on (on: a CHECKPOINT first, so every page
touched is written whole once: the worst case after each checkpoint). Embedded PostgreSQL
with wal_level=logical.

    python bench/cdc_wal_bytes.py [--quick]
"""

from __future__ import annotations

import sys
from typing import Any

import psycopg
from _common import save

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.testing import EmbeddedPostgres

PAYLOAD = {"order_id": 12345, "customer": "c-0001", "items": [{"sku": "A1", "qty": 2}]}


def measure(dsn: str, storage: str, events: int) -> float:
    outbox = Outbox(storage=storage)
    with psycopg.connect(dsn, autocommit=True) as admin, psycopg.connect(dsn) as conn:
        admin.execute("CHECKPOINT")
        before = admin.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
        for t in range(events // 10):
            with conn.transaction():
                batch = [
                    Event(topic="orders", event_type="order.placed", key=f"k{t}", payload=PAYLOAD)
                    for _ in range(10)
                ]
                outbox.put_many(conn, batch)
        row = admin.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (before[0],)
        ).fetchone()
    assert row is not None
    return float(row[0]) / events


def main() -> None:
    events = 2_000 if "--quick" in sys.argv else 20_000
    results: dict[str, Any] = {"events": events, "per_transaction": 10, "bytes_per_event": {}}
    for fpw in ("off", "on"):
        with EmbeddedPostgres(fsync=False, logical=True, settings={"full_page_writes": fpw}) as pg:
            migrate(pg.dsn, table="outbox")
            for storage in ("table", "wal"):
                per_event = measure(pg.dsn, storage, events)
                results["bytes_per_event"][f"{storage}, full_page_writes={fpw}"] = round(per_event)
                print(f"{storage:5} full_page_writes={fpw:3}: {per_event:7.0f} WAL bytes/event")
    save("cdc_wal_bytes", results)


if __name__ == "__main__":
    main()
