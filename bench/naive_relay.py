"""A hand-written polling relay, the kind a team writes instead of using a library.

A Python port of the seed's Go relay: in one transaction, select a batch with
``FOR UPDATE SKIP LOCKED``, publish each row to Kafka and wait for the acks,
set ``sent_at``, commit. Its own table, no leases, no retries, no dead
letters: the baseline outboxkit has to beat to be worth a dependency.

    python bench/naive_relay.py --dsn ... --kafka 127.0.0.1:9092 --topic t
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import psycopg
from confluent_kafka import Producer

SCHEMA = """
CREATE TABLE IF NOT EXISTS naive_outbox (
    id         bigserial PRIMARY KEY,
    topic      text NOT NULL,
    key        text,
    payload    bytea NOT NULL,
    headers    jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at    timestamptz
);
CREATE INDEX IF NOT EXISTS naive_outbox_unsent ON naive_outbox (id) WHERE sent_at IS NULL;
"""
LOAD_FROM_SEED = """
INSERT INTO naive_outbox (topic, key, payload, headers)
SELECT %s, key, payload, headers || jsonb_build_object('event_id', event_id::text)
FROM bench_seed ORDER BY event_id LIMIT %s
"""
SELECT_BATCH = """
SELECT id, topic, key, payload, headers FROM naive_outbox
WHERE sent_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED
"""
MARK_SENT = "UPDATE naive_outbox SET sent_at = now() WHERE id = ANY(%s)"


def load(dsn: str, topic: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("TRUNCATE naive_outbox")
        conn.execute(LOAD_FROM_SEED, (topic, n))
        conn.execute("VACUUM ANALYZE naive_outbox")
        conn.execute("CHECKPOINT")  # as before every contender's run


class Relay:
    """select batch → produce each → wait for every ack → mark sent → commit."""

    def __init__(self, dsn: str, bootstrap: str, *, batch_size: int = 100) -> None:
        self.dsn = dsn
        self.batch_size = batch_size
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
            }
        )
        self.sent = 0
        self.failed = 0

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.failed += 1

    def run_once(self, conn: psycopg.Connection[Any]) -> int:
        with conn.transaction():
            rows = conn.execute(SELECT_BATCH, (self.batch_size,)).fetchall()
            if not rows:
                return 0
            failed_before = self.failed
            for _id, topic, key, payload, headers in rows:
                self.producer.produce(
                    topic,
                    value=payload,
                    key=key.encode() if key else None,
                    headers={k: str(v) for k, v in headers.items()},
                    on_delivery=self._on_delivery,
                )
            if self.producer.flush(30) or self.failed != failed_before:
                raise RuntimeError("kafka did not confirm the batch; rolling back")
            conn.execute(MARK_SENT, ([r[0] for r in rows],))
        self.sent += len(rows)
        return len(rows)

    def drain(self, *, idle_exit: bool = True, poll_interval: float = 0.1) -> None:
        with psycopg.connect(self.dsn) as conn:
            while True:
                if self.run_once(conn) == 0:
                    if idle_exit:
                        return
                    time.sleep(poll_interval)


def bench(dsn: str, bootstrap: str, topic: str, n: int, batch_size: int) -> dict[str, Any]:
    load(dsn, topic, n)
    relay = Relay(dsn, bootstrap, batch_size=batch_size)
    t0 = time.perf_counter()
    relay.drain()
    elapsed = time.perf_counter() - t0
    return {
        "events": relay.sent,
        "seconds": elapsed,
        "rate": relay.sent / elapsed,
        "batch_size": batch_size,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--kafka", required=True, help="bootstrap host:port")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--batch-size", type=int, default=100)
    args = ap.parse_args()
    print(bench(args.dsn, args.kafka, args.topic, args.events, args.batch_size))


if __name__ == "__main__":
    main()
