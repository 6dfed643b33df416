"""The app on Django's psycopg2 backend (drivers/psycopg2_adapter.py), in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg

from tests.support.relaying import rows


def test_put_inbox_and_enqueue_work_on_djangos_psycopg2_backend(django_dsn: str) -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.integration.contrib.django_settings",
        "OUTBOXKIT_TEST_DJANGO_DSN": django_dsn,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.contrib.django_psycopg2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["driver"].startswith("psycopg2")
    assert (seen["inbox_first"], seen["inbox_again"]) == (True, False)
    assert "transaction.atomic()" in seen["refused"]
    assert [r["key"] for r in rows(django_dsn)] == ["o1", "o2", "o3"]
    assert isinstance(seen["enqueued"], int) and seen["enqueued_again"] is None  # id; skipped
    assert "transaction.atomic()" in seen["task_refused"]
    with psycopg.connect(django_dsn) as conn:
        payloads = conn.execute("SELECT payload FROM outboxkit_tasks ORDER BY id").fetchall()
    assert payloads == [({"n": 1},)]  # the rolled-back and the refused ones are not there
