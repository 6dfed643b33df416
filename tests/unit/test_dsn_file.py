"""The fleet's DSN file: one database a line, bad lines reported by number and skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from outboxkit.errors import ConfigurationError
from outboxkit.fleet.dsn_file import derived_name, parse_dsn_file, read_dsn_file


def test_names_dsns_comments_and_blank_lines() -> None:
    listed = parse_dsn_file(
        "# tenants\n"
        "\n"
        "shop postgresql://app@db1:5432/shop\n"
        "   billing\tpostgresql://app@db2/billing   \n"
        "postgresql://app@db3:6432/crm\n"
        "host=db4 port=5433 dbname=hr user=app\n"
        "kv host=db5 dbname=ops\n"
        "  # indented comment\n"
        "maria mysql://app@db6:3306/app\n"
    )
    assert [(d.name, d.line) for d in listed.databases] == [
        ("shop", 3),
        ("billing", 4),
        ("db3:6432/crm", 5),
        ("db4:5433/hr", 6),
        ("kv", 7),
        ("maria", 9),
    ]
    assert listed.databases[1].dsn == "postgresql://app@db2/billing"
    assert listed.databases[4].dsn == "host=db5 dbname=ops"
    assert listed.bad_lines == ()


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("bad!name postgresql://db/x", "a name is letters, digits"),
        ("postgres//app:S3cretpass@db/x", "not DSN or NAME DSN"),
        ("lonely", "no DSN after the name 'lonely'"),
        ("shop not-a-dsn", "is followed by no DSN"),
        ("shop postgresql://app:S3cret%ZZpass@db/x", "not a valid PostgreSQL connection string"),
        ("shop host=db dbname='x", "not a valid PostgreSQL connection string"),
    ],
)
def test_a_bad_line_is_reported_with_its_number_and_the_others_still_count(
    line: str, reason: str
) -> None:
    listed = parse_dsn_file(f"first postgresql://db/a\n{line}\nlast postgresql://db/b\n")
    assert [d.name for d in listed.databases] == ["first", "last"]
    (bad,) = listed.bad_lines
    assert bad.line == 2
    assert reason in bad.reason, bad.reason
    assert str(bad).startswith("line 2: ")
    assert "S3cret" not in str(bad), "a bad line's report never quotes its password"


def test_a_repeated_name_is_a_bad_line_and_the_first_one_stays() -> None:
    listed = parse_dsn_file(
        "shop postgresql://db1/shop\n"
        "shop postgresql://db2/shop\n"
        "postgresql://db3:5432/x\n"
        "postgresql://db3:5432/x?sslmode=require\n"
    )
    assert [(d.name, d.dsn) for d in listed.databases] == [
        ("shop", "postgresql://db1/shop"),
        ("db3:5432/x", "postgresql://db3:5432/x"),
    ]
    assert [str(b) for b in listed.bad_lines] == [
        "line 2: the name 'shop' is already used on line 1",
        "line 4: the name 'db3:5432/x' is already used on line 3",
    ]


def test_a_name_whose_dsn_does_not_parse_is_still_known() -> None:
    """The fleet keeps a running database whose line is being edited (supervisor.py)."""
    (bad,) = parse_dsn_file("shop postgresql://a:b%ZZ@db/x\n").bad_lines
    assert bad.name == "shop"


@pytest.mark.parametrize(
    ("dsn", "name"),
    [
        ("postgresql://app:pw@db.example:5432/shop", "db.example:5432/shop"),
        ("postgresql://db.example/shop", "db.example/shop"),
        ("postgresql:///shop", "localhost/shop"),
        ("postgresql://h1:5432,h2:5432/shop", "h1:5432/shop"),
        ("postgresql://[::1]:5433/shop", "::1:5433/shop"),
        ("postgresql:///shop?host=/run/postgresql&port=5433", "/run/postgresql:5433/shop"),
        ("host=db port=5433 dbname=shop", "db:5433/shop"),
        ("dbname='my shop' user=app", "localhost/my shop"),
    ],
)
def test_the_default_name_is_host_port_and_database(dsn: str, name: str) -> None:
    assert derived_name(dsn) == name


def test_the_repr_of_a_database_never_shows_its_dsn() -> None:
    (database,) = parse_dsn_file("shop postgresql://app:S3cretpass@db/shop\n").databases
    assert "S3cret" not in repr(database)


def test_a_file_that_cannot_be_read_is_one_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read the DSN file"):
        read_dsn_file(tmp_path / "missing.txt")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigurationError, match="cannot read the DSN file"):
        read_dsn_file(tmp_path / "binary.txt")
