"""The CLI's shared option checks: DSNs that do not parse, numbers and durations out of range."""

from __future__ import annotations

import datetime as dt
import math

import click
import pytest

from outboxkit.errors import ConfigurationError
from outboxkit.ops.cli.options import MAX_SECONDS, check_dsn, in_range, parse_duration


@pytest.mark.parametrize(
    ("dsn", "shown", "hidden"),
    [
        ("postgresql://u:S3cret%ZZpass@db/shop", 'token: "***"', "S3cret"),
        ("host=db password=abc defgh", 'after "***"', "defgh"),
        ("host=db sslmodex=1", '"sslmodex"', None),  # an option name says what is wrong
        ("postgresql://u@db/shop?fooparam=1", '"fooparam"', None),
    ],
)
def test_a_dsn_that_does_not_parse_says_why_without_quoting_its_secrets(
    dsn: str, shown: str, hidden: str | None
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        check_dsn(dsn)
    message = str(raised.value)
    assert message.startswith("--dsn (or OUTBOXKIT_DSN) is not a valid PostgreSQL"), message
    assert shown in message, message
    assert hidden is None or hidden not in message, message


def test_a_dsn_that_parses_passes() -> None:
    check_dsn("postgresql://app:p%25ss@127.0.0.1:5432/shop?sslmode=disable")
    check_dsn("host=127.0.0.1 port=5432 dbname=shop user=app")


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0, MAX_SECONDS + 1])
def test_seconds_out_of_range_are_refused(value: float) -> None:
    check = in_range(0, MAX_SECONDS)
    with pytest.raises(click.BadParameter, match="out of range"):
        check(click.Context(click.Command("x")), click.Option(["--x"]), value)


def test_numbers_in_range_and_unset_pass_through() -> None:
    check = in_range(1, 10)
    ctx, param = click.Context(click.Command("x")), click.Option(["--x"])
    assert check(ctx, param, None) is None
    assert check(ctx, param, (1, 10)) == (1, 10)
    with pytest.raises(click.BadParameter, match="from 1 to 10"):
        check(ctx, param, (1, 11))


def test_durations_are_bounded() -> None:
    assert parse_duration("36500d") == dt.timedelta(days=36500)
    with pytest.raises(click.BadParameter, match="out of range"):
        parse_duration("999999999999999999d")


def test_the_cli_and_the_relay_read_a_dsn_through_one_check_of_its_backend() -> None:
    """One check, the URL's backend's: a MariaDB URL is MariaDB's to read (no scheme test in
    the CLI), and the relay names an unknown option as the CLI does (before, it masked every
    quoted word, the option's name too)."""
    from outboxkit import Relay, from_url

    check_dsn("mysql://root@127.0.0.1:3306/shop")
    with pytest.raises(ConfigurationError) as raised:
        Relay("host=db sslmodex=1", from_url("nats://127.0.0.1:1"))
    message = str(raised.value)
    assert message.startswith("the relay's dsn is not a valid PostgreSQL"), message
    assert '"sslmodex"' in message, message
