"""Statements come from one named-template table; row states come from one enum."""

from __future__ import annotations

import re
from enum import IntEnum

import pytest

from outboxkit.backends.postgres import postgres
from outboxkit.backends.postgres.inbox_sql import InboxStatements
from outboxkit.backends.postgres.postgres import MIGRATIONS, NamedStatements, Statements, Status

_SLOT = re.compile(r"(?<!')\{[A-Za-z_]*\}(?!')")  # not the SQL literal '{}' (empty jsonb)
_STATUS_LITERAL = re.compile(
    r"status\s*(=|<>|!=|IN)\s*\(?\s*\d|status\s+smallint NOT NULL DEFAULT\s+\d", re.IGNORECASE
)


@pytest.mark.parametrize("kind", [Statements, InboxStatements])
def test_every_template_is_rendered_as_an_instance_attribute(
    kind: type[NamedStatements],
) -> None:
    s = kind("app.events")  # type: ignore[call-arg]
    names = set(kind.templates())
    assert len(names) >= (30 if kind is Statements else 5)
    assert names <= set(vars(s)), "a template was not rendered"
    for name in names:
        text = getattr(s, name)
        assert isinstance(text, str) and text.strip() == text and text, name
        assert not _SLOT.search(text), f"{name} has an unfilled slot: {_SLOT.search(text)}"
        # quoted names only (the wake-up gate's lock statements name a key, not a table)
        assert '"app".' in text or name in ("last_event_id", "try_wake_lock", "wake_unlock"), name


def test_templates_stay_on_the_class_and_tables_do_not_share_text() -> None:
    a, b = Statements("a"), Statements("b")
    assert a.claim_batch != b.claim_batch
    assert '"a"' in a.claim_batch and '"b"' in b.claim_batch
    assert isinstance(Statements.claim_batch, postgres.SqlTemplate)


def test_no_statement_spells_a_status_as_a_number() -> None:
    templates = [t.template for t in Statements.templates().values()]
    for text in [*templates, *MIGRATIONS.values()]:
        assert not _STATUS_LITERAL.search(text), _STATUS_LITERAL.search(text)


@pytest.mark.parametrize("state", list(Status))
def test_every_state_is_used_and_rendered_as_its_value(state: Status) -> None:
    slot = "{" + state.name.lower() + "}"
    users = [n for n, t in Statements.templates().items() if f"status = {slot}" in t.template]
    assert users, f"no statement uses {state.name}"
    s = Statements()
    for name in users:
        assert f"status = {int(state)}" in getattr(s, name), name


def test_changing_an_enum_value_changes_every_statement_that_uses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shifted = IntEnum("shifted", {"PENDING": 10, "PUBLISHED": 11, "FAILED": 12})
    monkeypatch.setattr(postgres, "Status", shifted)
    s = Statements()
    assert "WHERE status = 10 AND available_at <= now()" in s.claim_batch
    assert "SET status = 12," in s.dead_letter and "d.status = 10 AND" in s.dead_letter
    assert "SET status = 11, published_at" in s.settle_published_keep
    assert "DEFAULT 10" in s.migrations[1] and "WHERE status = 12;" in s.migrations[1]
    assert not re.search(r"status = [012]\b", s.status_by_topic + s.replay_all_failed)


def test_show_event_by_row_id_and_by_event_id_read_the_same_columns() -> None:
    s = Statements()
    by_id = s.show_event.split(" FROM ")[0]
    by_event_id = s.show_event_by_event_id.split(" FROM ")[0]
    assert by_id == by_event_id
    assert s.show_event.endswith("WHERE id = %s")
    assert s.show_event_by_event_id.endswith("WHERE event_id = %s")


def test_status_is_an_int_for_drivers() -> None:
    assert isinstance(Status.FAILED, int) and int(Status.FAILED) == 2
    assert [int(s) for s in Status] == [0, 1, 2]
