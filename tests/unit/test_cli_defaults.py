"""The CLI restates no library default: --help reads them, unset options are not passed."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

import outboxkit.publishers
import outboxkit.relay
import outboxkit.sink.observer
from outboxkit.errors import ConfigurationError
from outboxkit.ops import cli
from outboxkit.ops.cli import LibraryOption, main
from outboxkit.publishers.base import batch_shape
from outboxkit.relay import Relay

# --relay option -> Relay.__init__ parameter it falls through to.
RELAY_OPTIONS = {
    "poll_interval": "poll_interval",
    "lease": "lease",
    "max_attempts": "max_attempts",
    "retention": "retention",
    "retry_base": "retry_base",
    "retry_cap": "retry_cap",
    "shutdown_timeout": "shutdown_timeout",
    "synchronous_commit": "synchronous_commit",
}


def _help_of(command: click.Command, name: str) -> str:
    ctx = click.Context(command, info_name=command.name)
    (param,) = [p for p in command.params if p.name == name]
    record = param.get_help_record(ctx)
    assert record is not None
    return " ".join(record[1].split())


def _commands(group: click.Group) -> list[click.Command]:
    found: list[click.Command] = []
    for command in group.commands.values():
        found += _commands(command) if isinstance(command, click.Group) else [command]
    return found


@pytest.mark.parametrize(("option", "parameter"), sorted(RELAY_OPTIONS.items()))
def test_relay_help_shows_the_default_relay_declares(option: str, parameter: str) -> None:
    declared = inspect.signature(Relay).parameters[parameter].default
    assert f"default: {declared}]" in _help_of(main.commands["relay"], option)


def test_relay_help_follows_a_changed_library_default(monkeypatch: pytest.MonkeyPatch) -> None:
    signature = inspect.signature(Relay.__init__)
    changed = signature.replace(
        parameters=[
            p.replace(default=42.5) if p.name == "lease" else p
            for p in signature.parameters.values()
        ]
    )
    monkeypatch.setattr(Relay.__init__, "__signature__", changed, raising=False)
    out = CliRunner().invoke(main, ["relay", "--help"], terminal_width=200).output
    (lease_line,) = [line for line in out.splitlines() if line.strip().startswith("--lease ")]
    assert lease_line.endswith("[default: 42.5]")


def test_batch_shape_help_reads_each_publisher(monkeypatch: pytest.MonkeyPatch) -> None:
    from outboxkit.publishers.nats import NatsPublisher

    size, in_flight = batch_shape(NatsPublisher)
    assert f"{size} for " in _help_of(main.commands["relay"], "batch_size")
    assert f"{in_flight} for " in _help_of(main.commands["relay"], "max_in_flight")
    monkeypatch.setattr(NatsPublisher, "batch_shape", (777, 9))
    assert "777 for nats" in _help_of(main.commands["relay"], "batch_size")
    assert "9 for nats" in _help_of(main.commands["relay"], "max_in_flight")


def test_every_library_option_names_a_parameter_that_exists() -> None:
    checked = 0
    for command in _commands(main):
        for param in command.params:
            if isinstance(param, LibraryOption):
                try:
                    param.library_value()
                except ModuleNotFoundError:  # an extra not installed here
                    continue
                checked += 1
    assert checked >= 14


class _Recorded(Exception):
    pass


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Relay and SummaryLog replaced by recorders (the command stops right after building)."""
    calls: dict[str, dict[str, Any]] = {}

    def fake_relay(dsn: str, publisher: object, **kwargs: Any) -> None:
        calls["Relay"] = kwargs
        raise ConfigurationError("recorded")

    def fake_summary(**kwargs: Any) -> object:
        calls["SummaryLog"] = kwargs
        return outboxkit.sink.observer.RelayObserver()

    monkeypatch.setattr(outboxkit.relay, "Relay", fake_relay)
    monkeypatch.setattr(outboxkit.sink.observer, "SummaryLog", fake_summary)
    monkeypatch.setattr(outboxkit.publishers, "from_url", lambda url: object())
    return calls


def test_unset_relay_options_are_not_passed(recorded: dict[str, dict[str, Any]]) -> None:
    result = CliRunner().invoke(
        main, ["relay", "--dsn", "postgresql://x/y", "--broker", "nats://x"]
    )
    assert result.exit_code == 2, result.output
    assert set(recorded["Relay"]) == {"table", "observer"}
    assert recorded["Relay"]["table"] == inspect.signature(Relay).parameters["table"].default
    assert recorded["SummaryLog"] == {}


def test_given_relay_options_are_passed(recorded: dict[str, dict[str, Any]]) -> None:
    args = ["relay", "--dsn", "postgresql://x/y", "--broker", "nats://x", "--lease", "5"]
    args += ["--no-listen", "--synchronous-commit", "--batch-size", "7", "--retention", "keep"]
    args += ["--log-interval", "3", "--linger", "0"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    passed = {k: v for k, v in recorded["Relay"].items() if k not in ("table", "observer")}
    assert passed == {
        "lease": 5.0,
        "linger": 0.0,
        "listen": False,
        "synchronous_commit": True,
        "batch_size": 7,
        "retention": "keep",
    }
    assert recorded["SummaryLog"] == {"interval": 3.0}


def test_unset_purge_batch_size_falls_through(monkeypatch: pytest.MonkeyPatch) -> None:
    from outboxkit.backends.postgres import admin

    declared = inspect.signature(admin.purge).parameters["batch_size"].default
    assert f"default: {declared};" in _help_of(main.commands["purge"], "batch_size")
    calls: list[dict[str, Any]] = []

    def fake_purge(*args: Any, **kwargs: Any) -> int:
        calls.append(kwargs)
        return 0

    monkeypatch.setattr(admin, "purge", fake_purge)
    base = ["purge", "--dsn", "postgresql://x/y", "--older-than", "1d", "--json"]
    assert CliRunner().invoke(main, base).exit_code == 0
    assert CliRunner().invoke(main, [*base, "--batch-size", "9"]).exit_code == 0
    assert "batch_size" not in calls[0]
    assert calls[1]["batch_size"] == 9


def test_table_defaults_come_from_the_statements() -> None:
    from outboxkit.backends.postgres.inbox_sql import InboxStatements
    from outboxkit.backends.postgres.postgres import Statements

    outbox = inspect.signature(Statements).parameters["table"].default
    inbox = inspect.signature(InboxStatements).parameters["table"].default
    assert f"default: {outbox}]" in _help_of(main.commands["status"], "table")
    assert f"default: {inbox}]" in _help_of(main.commands["migrate"], "inbox_table")
    assert cli.library_default("outboxkit.backends.postgres.postgres:Statements", "table") == outbox


def test_every_public_api_defaults_to_the_same_outbox_table() -> None:
    """The CLI reads Statements' default; every other entry point must agree with it."""
    from outboxkit import Outbox, migrate
    from outboxkit.backends.postgres import admin
    from outboxkit.backends.postgres.postgres import DEFAULT_TABLE, Statements
    from outboxkit.ops.dashboard import Dashboard
    from outboxkit.ops.metrics import RelayMetrics

    entry_points: list[Any] = [Relay, Outbox, RelayMetrics, Dashboard, Statements, migrate]
    entry_points += [admin.status, admin.list_failed, admin.replay, admin.purge, admin.discard]
    defaults = {
        getattr(f, "__qualname__", repr(f)): inspect.signature(f).parameters["table"].default
        for f in entry_points
    }
    assert defaults == dict.fromkeys(defaults, DEFAULT_TABLE)


def test_failed_show_names_states_from_the_enum() -> None:
    from outboxkit.backends.postgres.admin import _status_name
    from outboxkit.backends.postgres.postgres import Status

    assert [_status_name(s) for s in Status] == ["pending", "published", "failed"]
    assert _status_name(7) == "7"


README = Path(__file__).parents[2] / "docs" / "relaying.md"  # the relay option table
# README's relay option table -> the Relay parameters its default column states.
README_ROWS = {
    "--synchronous-commit": ["synchronous_commit"],
    "--poll-interval": ["poll_interval"],
    "--linger": ["linger"],
    "--lease": ["lease"],
    "--max-attempts": ["max_attempts"],
    "--retry-base` / `--retry-cap": ["retry_base", "retry_cap"],
    "--retention": ["retention"],
    "--shutdown-timeout": ["shutdown_timeout"],
}


def _readme_value(text: str) -> object:
    text = text.strip().removesuffix(" s")
    if text in ("off", "on"):
        return text == "on"
    try:
        return float(text)
    except ValueError:
        return text


@pytest.mark.parametrize(("option", "parameters"), sorted(README_ROWS.items()))
def test_readme_states_the_relay_defaults_the_library_has(
    option: str, parameters: list[str]
) -> None:
    stated = [_readme_value(v) for v in _readme_row(option).split(" / ")]
    declared = [inspect.signature(Relay).parameters[p].default for p in parameters]
    assert stated == declared


def _readme_row(option: str) -> str:
    rows = [line for line in README.read_text().splitlines() if line.startswith(f"| `{option}` |")]
    assert len(rows) == 1, f"docs/relaying.md has no row for {option}"
    return rows[0].split("|")[2].strip()


@pytest.mark.parametrize(("option", "index"), [("--batch-size", 0), ("--max-in-flight", 1)])
def test_readme_states_the_batch_shapes_the_publishers_have(option: str, index: int) -> None:
    from outboxkit.publishers import batch_shapes

    # e.g. "1000 for Kafka, NATS, Redis; 1 for Kinesis; 500 otherwise"
    *named_parts, otherwise = _readme_row(option).split("; ")
    stated: dict[str, str] = {}
    for part in named_parts:
        value, _, brokers = part.partition(" for ")
        stated |= {b.lower(): value for b in brokers.split(", ")}
    for scheme, shape in batch_shapes().items():
        if shape is None:
            continue  # client not installed here
        name = scheme if scheme in stated else scheme.removesuffix("s")
        expected = stated.get(name, otherwise.split()[0])
        assert shape[index] == int(expected), scheme
