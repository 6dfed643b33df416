"""User-facing messages: what they name, that they stay on one line, that markup never eats them."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from rich.console import Console

from outboxkit.backends.postgres.migrate import MigrationAction, MigrationResult, _objects
from outboxkit.backends.postgres.postgres import MIGRATIONS, Statements
from outboxkit.errors import (
    MissingExtraError,
    OutboxkitError,
    TableNotFoundError,
    is_undefined_table,
    missing_extra,
    outbox_table_missing,
)
from outboxkit.ops.cli import output
from outboxkit.ops.demo.report import print_table

# -- missing extras --------------------------------------------------------------------


def _import_error(name: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {name!r}", name=name)


def test_a_missing_broker_library_names_the_extra_that_installs_it() -> None:
    error = missing_extra(_import_error("aio_pika"), "the amqp:// broker")
    assert str(error) == (
        "the amqp:// broker needs aio-pika, which is not installed:"
        " pip install 'outboxkit[rabbitmq]'"
    )
    # still an ImportError for code that guards an optional import, and ours to catch
    assert isinstance(error, ModuleNotFoundError) and isinstance(error, OutboxkitError)
    assert isinstance(error, MissingExtraError) and error.name == "aio_pika"


def test_a_submodule_counts_as_its_package() -> None:
    error = missing_extra(_import_error("botocore.session"), "the sqs:// broker")
    assert "pip install 'outboxkit[sqs]'" in str(error)


def test_a_library_no_extra_brings_is_named_for_pip() -> None:
    error = missing_extra(_import_error("frobnicate_lib"), "`outboxkit demo`")
    assert str(error).endswith(
        "needs frobnicate-lib, which is not installed: pip install 'frobnicate-lib'"
    )


# -- undefined tables -------------------------------------------------------------------


class _DriverError(Exception):
    """Stands in for a driver's exception: only the attributes the drivers really carry."""

    def __init__(self, message: str, **attrs: Any) -> None:
        super().__init__(message)
        for k, v in attrs.items():
            setattr(self, k, v)


def test_undefined_table_is_recognised_through_every_drivers_wrapping() -> None:
    psycopg_like = _DriverError('relation "outbox" does not exist', sqlstate="42P01")
    psycopg2_like = _DriverError('relation "outbox" does not exist', pgcode="42P01")
    wrapped = _DriverError("(ProgrammingError) ...", orig=psycopg2_like)  # SQLAlchemy
    chained = _DriverError("adapter error", sqlstate=None)  # SQLAlchemy's asyncpg adapter
    chained.__cause__ = psycopg_like
    for exc in (psycopg_like, psycopg2_like, wrapped, chained):
        assert is_undefined_table(exc)
    other = _DriverError("duplicate key", sqlstate="23505")
    assert not is_undefined_table(other)
    assert not is_undefined_table(ValueError("nope"))


def test_the_write_error_says_migrate_and_that_the_transaction_is_lost() -> None:
    cause = _DriverError('relation "events.outbox" does not exist', sqlstate="42P01")
    error = outbox_table_missing(cause, "events.outbox")
    assert isinstance(error, TableNotFoundError)
    message = str(error)
    assert "outbox table 'events.outbox' does not exist" in message
    assert "outboxkit migrate --dsn … --table events.outbox" in message
    assert "roll it back" in message


def test_execute_with_blames_the_outbox_only_when_the_server_names_it() -> None:
    theirs = _DriverError('relation "orders" does not exist', sqlstate="42P01")
    ours = _DriverError('relation "outbox" does not exist', sqlstate="42P01")
    assert outbox_table_missing(theirs, "outbox", with_callers_sql=True) is None
    assert outbox_table_missing(ours, "outbox", with_callers_sql=True) is not None
    # Outbox.put's own statement touches only the outbox table
    assert outbox_table_missing(theirs, "outbox") is not None


# -- migrate's account of itself -------------------------------------------------------------


def _no_repeated_words(text: str) -> bool:
    words = text.split()
    return all(a != b for a, b in itertools.pairwise(words))


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (
            MigrationResult("outbox", MigrationAction.CREATED, 2),
            "created outbox table 'outbox' at schema version 2",
        ),
        (
            MigrationResult("outbox", MigrationAction.UPGRADED, 2, 1),
            "upgraded outbox table 'outbox' to schema version 2 (from 1)",
        ),
        (
            MigrationResult(
                "outbox",
                MigrationAction.REPAIRED,
                1,
                1,
                ("table outbox", "index outbox_pending_idx"),
            ),
            "repaired outbox table 'outbox' at schema version 1: recreated the missing"
            " table outbox, index outbox_pending_idx",
        ),
        (
            MigrationResult("outbox", MigrationAction.UNCHANGED, 1, 1),
            "outbox table 'outbox' is in place at schema version 1: nothing to do",
        ),
        (
            MigrationResult("processed_events", MigrationAction.UNCHANGED, None, kind="inbox"),
            "inbox table 'processed_events' is in place: nothing to do",
        ),
    ],
)
def test_migrate_says_what_it_did(result: MigrationResult, expected: str) -> None:
    assert result.describe() == expected
    assert _no_repeated_words(expected)


def test_every_migration_creates_objects_migrate_can_check() -> None:
    # Repair relies on it: each version's DDL is CREATE ... IF NOT EXISTS or ADD COLUMN IF
    # NOT EXISTS, so migrate can see what is missing and re-run it safely.
    stmts = Statements("events.outbox")
    for version in MIGRATIONS:
        assert _objects(stmts.migrations[version], "events"), f"version {version}"
    first = _objects(stmts.migrations[1], "events")
    assert first[0].name == '"events"."outbox"' and first[0].kind == "table"
    assert all(o.name.startswith('"events".') for o in first if o.kind == "index")


def test_added_columns_and_unique_indexes_are_found() -> None:
    ddl = """
    -- CREATE INDEX IF NOT EXISTS in_a_comment ON x (y);
    ALTER TABLE "outbox" ADD COLUMN IF NOT EXISTS occurred_at timestamptz,
                         ADD COLUMN IF NOT EXISTS "schema_version" text;
    CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS "outbox_x_idx" ON "outbox" (x);
    """
    found = [(o.kind, o.name) for o in _objects(ddl, None)]
    assert found == [
        ("column", "occurred_at"),
        ("column", "schema_version"),
        ("index", '"outbox_x_idx"'),
    ]


# -- markup never eats a message -----------------------------------------------------------


def test_cli_errors_keep_square_brackets_and_stay_on_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = (
        "the embedded servers are missing: install it with `pip install 'outboxkit[embedded]'`"
    )
    with pytest.raises(SystemExit) as exit_info:
        output.fail(message + " " + "x" * 200, 2)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pip install 'outboxkit[embedded]'" in err
    assert err.count("\n") == 1  # one line however long


def test_cli_success_lines_keep_square_brackets(capsys: pytest.CaptureFixture[str]) -> None:
    output.ok("deleted 3 [bold]rows[/bold]")
    assert "[bold]rows[/bold]" in capsys.readouterr().out


def test_demo_summary_prints_paths_with_brackets_as_written() -> None:
    path = {"committed": 10, "delivered": 10, "lost": 0, "duplicates_absorbed": 0}
    path |= {"latency_p50_ms": 1.0, "latency_p99_ms": 2.0, "dead_lettered": 0}
    path |= {"duplicates_dropped_by_broker": 0, "duplicates_dropped_by_consumer": 0}
    report = {
        "naive": path,
        "outbox": path,
        "ok": True,
        "relay_exit_codes": {},
        "runtime_s": 1.0,
        "server_start_s": 0.5,
        "relay_logs": "/srv/run[embedded]/logs",
    }
    console = Console(record=True, width=200)
    print_table(console, report)
    assert "/srv/run[embedded]/logs" in console.export_text()
