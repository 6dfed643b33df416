"""`outboxkit tasks list | failed | show | replay | cancel | discard` on real PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator

import psycopg
import pytest
from click.testing import CliRunner

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.ops.cli.app import main
from outboxkit.queue.tasks import TaskStatus
from outboxkit.tasks import Tasks

TABLE = "outboxkit_tasks"


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    yield db_dsn


def cli(*args: str) -> list[dict[str, object]]:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]


def states(dsn: str) -> list[tuple[int, int, int]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT id, status, attempts FROM {TABLE} ORDER BY id").fetchall()


def test_failed_tasks_are_listed_shown_replayed_cancelled_and_discarded(tasks_dsn: str) -> None:
    tasks = Tasks()
    tasks.handler("job")(lambda payload: None)
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for n in range(3):
            tasks.enqueue(conn, "job", {"n": n})
        conn.execute(
            f"UPDATE {TABLE} SET status = %s, attempts = 3, last_error = 'boom',"
            " error_type = 'ValueError', traceback_excerpt = 'Traceback ...' WHERE id IN (1, 2)",
            (TaskStatus.FAILED,),
        )
    dsn = ["--dsn", tasks_dsn]
    failed = cli("tasks", "failed", *dsn, "--json")
    assert [(r["id"], r["status"], r["last_error"]) for r in failed] == [
        (1, "failed", "boom"),
        (2, "failed", "boom"),
    ]
    assert len(cli("tasks", "list", *dsn, "--json")) == 3
    assert cli("tasks", "list", *dsn, "--queue", "elsewhere", "--json") == []
    assert len(cli("tasks", "list", *dsn, "--queue", "default", "--json")) == 3
    shown = CliRunner().invoke(main, ["tasks", "show", *dsn, "1", "--json"])
    assert '"traceback_excerpt": "Traceback ..."' in shown.output
    assert '"payload_json": "{\\"n\\": 0}"' in shown.output
    assert '"status": "failed"' in shown.output  # by name, not 3
    # For a person: a field a line, the status by name, the traceback as its lines.
    conn_tb = "Traceback (most recent call last):\n  File x, line 1\nValueError: boom"
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {TABLE} SET traceback_excerpt = %s WHERE id = 1", (conn_tb,))
    person = CliRunner().invoke(main, ["tasks", "show", *dsn, "1"]).output
    assert "status:" in person and "failed" in person and '"status": 3' not in person
    assert "\\n" not in person
    assert "traceback:\n  Traceback (most recent call last):\n    File x, line 1\n" in person
    # tasks failed names the error type once when the message already starts with it
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {TABLE} SET last_error = 'ValueError: boom' WHERE id = 2")
    table = CliRunner().invoke(main, ["tasks", "failed", *dsn]).output
    assert "ValueError: boom" in table and "ValueError: ValueError" not in table
    assert "replayed 1 task(s)" in CliRunner().invoke(main, ["tasks", "replay", *dsn, "1"]).output
    assert "cancelled 1 task(s)" in CliRunner().invoke(main, ["tasks", "cancel", *dsn, "3"]).output
    out = CliRunner().invoke(main, ["tasks", "discard", *dsn, "2", "3"]).output
    assert "discarded 2 task(s)" in out
    assert states(tasks_dsn) == [(1, TaskStatus.PENDING, 0)]
    missing = CliRunner().invoke(
        main, ["tasks", "list", "--dsn", tasks_dsn, "--tasks-table", "nope"]
    )
    assert missing.exit_code == 2 and "outboxkit migrate --tasks" in missing.output


def test_the_worker_command_says_what_to_do_about_a_missing_table_or_a_bad_app(
    db_dsn: str,
) -> None:
    missing = CliRunner().invoke(
        main, ["worker", "--dsn", db_dsn, "--app", "tests.support.tasks_app:tasks"]
    )
    assert missing.exit_code == 2 and "outboxkit migrate --tasks" in missing.output
    bad = CliRunner().invoke(main, ["worker", "--dsn", db_dsn, "--app", "tests.support.tasks_app"])
    assert bad.exit_code == 2 and "module:attribute" in bad.output
    wrong = CliRunner().invoke(
        main, ["worker", "--dsn", db_dsn, "--app", "tests.support.tasks_app:RUNS_DDL"]
    )
    assert wrong.exit_code == 2 and "is not an outboxkit.tasks.Tasks" in wrong.output


def test_replay_all_replays_the_rest_and_reports_unique_key_collisions(tasks_dsn: str) -> None:
    """51 failed tasks; one's unique_key is held by a newer live task. `replay --all` raised
    UniqueViolation and replayed none (0 of 51); it replays 50 and names the one skipped."""
    tasks = Tasks()
    tasks.handler("job")(lambda payload: None)
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for n in range(50):
            tasks.enqueue(conn, "job", {"n": n})
        tasks.enqueue(conn, "job", {"n": 50}, unique_key="invoice-7")
        conn.execute(f"UPDATE {TABLE} SET status = %s", (TaskStatus.FAILED,))
        tasks.enqueue(conn, "job", {"n": 51}, unique_key="invoice-7")  # live, newer
    out = CliRunner().invoke(main, ["tasks", "replay", "--dsn", tasks_dsn, "--all"])
    assert out.exit_code == 0, out.output
    assert "replayed 50 task(s)" in out.output
    assert "skipped task 51: its unique_key 'invoice-7' is held by a live task" in out.output
    by_status: dict[int, int] = {}
    for _id, status, _attempts in states(tasks_dsn):
        by_status[status] = by_status.get(status, 0) + 1
    assert by_status == {TaskStatus.PENDING: 51, TaskStatus.FAILED: 1}


def test_the_workers_migrate_hint_works_and_migrate_refuses_flags_it_would_ignore(
    db_dsn: str,
) -> None:
    """`Tasks(table="jobs")`'s worker said `migrate --tasks ... --table jobs`, which created
    outboxkit_tasks (--table ignored with --tasks) and the worker still failed."""
    jobs = Tasks(table="jobs")
    jobs.handler("job")(lambda payload: None)
    from outboxkit.tasks import Worker

    with pytest.raises(Exception, match=r"--tasks-table jobs") as missing:
        import asyncio

        asyncio.run(Worker(jobs, db_dsn).run())
    hint = str(missing.value).split("run `", 1)[1].split("`", 1)[0]
    args = hint.split()[1:]  # outboxkit migrate --tasks --dsn ... --tasks-table jobs
    args[args.index("--dsn") + 1] = db_dsn
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0 and "'jobs'" in done.output, done.output
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute("SELECT to_regclass('jobs') IS NOT NULL").fetchone() == (True,)
    for wrong, says in (
        (["--tasks", "--table", "jobs"], "--table does not apply to the tasks table (name"),
        (["--tasks", "--ordered"], "--ordered does not apply to the tasks table"),
        (["--inbox", "--tasks-table", "x"], "--tasks-table does not apply to the inbox table"),
        (["--tasks-table", "x"], "--tasks-table does not apply to the outbox table"),
        (["--tasks", "--inbox"], "not both"),
    ):
        refused = CliRunner().invoke(main, ["migrate", "--dsn", db_dsn, *wrong])
        assert refused.exit_code == 2 and says in refused.output, (wrong, refused.output)
