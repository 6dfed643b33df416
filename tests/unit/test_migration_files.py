"""The schema's .sql files: released ones never change, every placeholder is filled by quoting."""

from __future__ import annotations

import hashlib
import re

import pytest

from outboxkit.backends.postgres import partitions_sql
from outboxkit.backends.postgres.inbox_sql import InboxStatements
from outboxkit.backends.postgres.migrate import migration_statements
from outboxkit.backends.postgres.migrations import KINDS, Kind, migration_files, split_statements
from outboxkit.backends.postgres.ordered_sql import ORDERED_SCHEMA, OrderedStatements
from outboxkit.backends.postgres.postgres import MIGRATIONS, SCHEMA_VERSION, Statements
from outboxkit.errors import ConfigurationError

# Tables in the field were made by these files as released: a change to one would leave them
# behind what a fresh migrate creates, and nothing would upgrade them. Change the schema
# with a new file (and add its hash here); the header comments may change freely.
RELEASED = {
    "outbox/0001_outbox.sql": "a2c966cade5a38a4",
    "outbox/0002_occurred_at.sql": "ad8cbd6187527e40",
    "partitioned/0001_outbox.sql": "65d2a84e8a7ffe8a",
    "ordered/0001_partitions.sql": "2717badc6b177983",
    "inbox/0001_processed_events.sql": "e922081c90487d67",
    "tasks/0001_tasks.sql": "547b007e54742f37",
    "tasks/0002_lapses.sql": "e6ba0083b4ed2b90",
    "tasks/0003_queues.sql": "1aaf8dc40731e14f",
    "tasks/0004_results.sql": "e6e4f41ddece4484",
    "tasks/0005_dependencies.sql": "ebfd52a129a9f477",
    "tasks/0006_traces.sql": "320a9d990e44987c",
    "tasks/0007_limits.sql": "43752cb00078baf8",
    "tasks/0008_rates.sql": "8b4209d7240429f5",
    "tasks/0009_key_rates.sql": "55fad04f3649c501",
    "tasks/0010_parked.sql": "07913cd2d32aa7a1",
    "tasks/0011_fair.sql": "6331da39f15f03c3",
}
_STATUS_LITERAL = re.compile(
    r"status\s*(=|<>|!=|IN)\s*\(?\s*\d|status\s+smallint NOT NULL DEFAULT\s+\d", re.IGNORECASE
)


def _own_files() -> dict[str, str]:
    # a partitioned outbox lists the outbox's later files too: count each file once
    return {
        f"{f.kind}/{f.name}": f.template
        for kind in KINDS
        for f in migration_files(kind)
        if f.kind == kind
    }


def test_released_files_are_unchanged() -> None:
    found = {k: hashlib.sha256(t.encode()).hexdigest()[:16] for k, t in _own_files().items()}
    assert {k: found.get(k) for k in RELEASED} == RELEASED, "a released schema file changed"
    assert set(found) == set(RELEASED), "a new schema file: add its hash to RELEASED"


@pytest.mark.parametrize("kind", KINDS)
def test_versions_run_from_one_without_gaps_and_each_says_why(kind: Kind) -> None:
    files = migration_files(kind)
    assert [f.version for f in files] == list(range(1, len(files) + 1))
    assert all(len(f.description) > 40 for f in files), "a file without its header comment"


def test_the_outbox_schema_version_is_its_last_file() -> None:
    assert SCHEMA_VERSION == len(migration_files("outbox")) == max(MIGRATIONS)
    assert len(migration_files("partitioned")) == SCHEMA_VERSION
    assert migration_files("partitioned")[1:] == migration_files("outbox")[1:]


@pytest.mark.parametrize("kind", KINDS)
def test_every_placeholder_is_filled_and_every_statement_ends_its_line(kind: Kind) -> None:
    table = "app.processed_events" if kind == "inbox" else "app.events"
    for m in migration_statements(table, kind=kind, partitions=8):
        assert m.statements, m.name
        for statement in m.statements:
            assert statement.endswith(";") and statement.count(";") == 1, statement
            code = re.sub(r"'[^']*'", "''", statement)  # a JSON default is a literal '{}'
            assert "{" not in code and "}" not in code, f"unfilled in {m.name}: {statement}"
            assert '"app".' in statement or "INDEX" in statement, statement


def test_names_are_quoted_and_validated_like_every_table_name() -> None:
    (first, *_rest) = migration_statements("Odd_Name")
    assert 'CREATE TABLE IF NOT EXISTS "Odd_Name" (' in first.statements[0]
    assert 'CREATE INDEX IF NOT EXISTS "Odd_Name_pending_idx" ON "Odd_Name"' in "".join(
        first.statements
    )
    with pytest.raises(ConfigurationError, match="invalid"):
        next(migration_statements('x"; DROP TABLE users; --'))
    with pytest.raises(ValueError, match="unknown kind"):
        migration_files("queue")  # type: ignore[arg-type]


def test_no_file_spells_a_status_as_a_number() -> None:
    for name, template in _own_files().items():
        assert not _STATUS_LITERAL.search(template), (name, _STATUS_LITERAL.search(template))


def test_the_statements_of_a_version_are_its_script_cut_at_each_semicolon() -> None:
    s = Statements("app.events")
    for m in migration_statements("app.events"):
        assert "\n".join(m.statements) == s.migrations[m.version].strip()
    with pytest.raises(ValueError, match="after the last statement"):
        split_statements("SELECT 1;\nSELECT 2")


def test_the_named_schema_texts_are_the_files() -> None:
    assert {f.version: f.template for f in migration_files("outbox")} == MIGRATIONS
    assert ORDERED_SCHEMA.strip() == migration_files("ordered")[0].template.strip()
    (ordered,) = migration_statements("app.events", kind="ordered", partitions=8)
    assert OrderedStatements("app.events").ordered_ddl(8) == "\n".join(ordered.statements) + "\n"
    (inbox,) = migration_statements("app.inbox", kind="inbox")
    stmts = InboxStatements("app.inbox")
    assert stmts.ddl() == stmts.create + "\n" == "\n".join(inbox.statements) + "\n"


def test_partitions_get_the_plain_tables_autovacuum_settings() -> None:
    (first, *_rest) = migration_files("outbox")
    options = re.search(r"\) WITH \((?P<o>.*?)\n\);", first.template, re.DOTALL)
    assert options is not None
    plain = " ".join(re.sub(r"--[^\n]*", "", options["o"]).split())
    assert plain == partitions_sql.PARTITION_STORAGE


def test_the_partitioned_table_has_the_plain_tables_columns() -> None:
    def columns(template: str) -> list[str]:
        lines = template.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("CREATE TABLE"))
        end = next(i for i, line in enumerate(lines) if line.startswith(")"))
        return [line.strip().rstrip(",") for line in lines[start + 1 : end]]

    plain = columns(migration_files("outbox")[0].template)
    partitioned = columns(migration_files("partitioned")[0].template)
    assert plain[0] == "id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY"
    assert partitioned[0] == plain[0].removesuffix(" PRIMARY KEY")
    assert partitioned[1:-1] == plain[1:]
    assert partitioned[-1] == "PRIMARY KEY (id, created_at)"
