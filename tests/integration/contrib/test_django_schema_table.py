"""The app with its tables in a schema of their own (``TABLE: "shop.outbox"``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg

from outboxkit.backends.postgres.migrate import MigrationAction, migrate, migrate_inbox
from tests.support.relaying import rows


def test_schema_qualified_tables_are_migrated_written_and_read_by_the_model(
    empty_db_dsn: str,
) -> None:
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA shop")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.integration.contrib.django_settings",
        "OUTBOXKIT_TEST_DJANGO_DSN": empty_db_dsn,
        "OUTBOXKIT_TEST_DJANGO_TABLE": "shop.outbox",
        "OUTBOXKIT_TEST_DJANGO_INBOX_TABLE": "shop.processed_events",
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.contrib.django_schema_table"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"model_rows": 1, "fresh": True}
    assert [r["key"] for r in rows(empty_db_dsn, table="shop.outbox")] == ["s"]
    assert migrate(empty_db_dsn, table="shop.outbox").action is MigrationAction.UNCHANGED
    assert migrate_inbox(empty_db_dsn, table="shop.processed_events").action is (
        MigrationAction.UNCHANGED
    )
