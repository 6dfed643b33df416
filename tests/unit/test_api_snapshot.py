"""A public name cannot disappear or change its signature without a CHANGELOG entry.

tests/unit/data/public_api.txt is the API as last released (tests/support/public_api.py
says what counts as public and how a line is written); `make api-snapshot` rewrites it
at a release."""

from __future__ import annotations

import sys

import pytest

from tests.support import public_api

SNAPSHOT_PYTHON = (3, 11)


@pytest.mark.skipif(
    sys.version_info[:2] != SNAPSHOT_PYTHON,
    reason="the snapshot is written with Python 3.11, whose inspect renders signatures "
    "as recorded (3.12+ may render a default or an annotation differently)",
)
def test_no_public_name_is_removed_or_changed_without_a_changelog_entry() -> None:
    snapshot = public_api.read_snapshot()
    current = public_api.collect()
    notes = public_api.unreleased_notes(public_api.CHANGELOG.read_text())
    removed, changed = public_api.differences(snapshot, current, notes)
    lines = [f"removed: {k}  (was: {snapshot[k]})" for k in removed] + [
        f"changed: {k}\n    was: {snapshot[k]}\n    now: {current[k]}" for k in changed
    ]
    assert not lines, (
        "public API changed without a CHANGELOG entry. Either restore it, deprecate it "
        "first (docs/reference/api-policy.md), or record it in CHANGELOG.md under "
        "[Unreleased] in a '### Removed' / '### Changed' section naming it in a code span "
        "(e.g. `Outbox.put`):\n" + "\n".join(lines)
    )


def test_every_public_module_imports_and_exports_something() -> None:
    current = public_api.collect()
    for module in public_api.PUBLIC_MODULES:
        assert any(key.startswith(f"{module}:") for key in current), module


CHANGELOG = """# Changelog
## [Unreleased]
### Added
- `Outbox.put_later(...)`: new.
### Changed
- `Relay(batch_size=...)` defaults to 500.
- **Removed:** `outboxkit.old_helper`, use `new_helper`.
## [0.1.0]
### Removed
- `Outbox.gone` (released long ago; not in Unreleased)
"""


def test_the_notes_are_the_unreleased_removed_and_changed_entries() -> None:
    notes = public_api.unreleased_notes(CHANGELOG)
    assert "Relay(batch_size" in notes and "old_helper" in notes
    assert "put_later" not in notes  # Added: not a removal nor a change
    assert "Outbox.gone" not in notes  # an older release's section


def test_a_removal_or_change_is_caught_unless_the_changelog_names_it() -> None:
    snapshot = {
        "outboxkit:Relay": "Relay(batch_size: 'int' = 100)",
        "outboxkit:old_helper": "old_helper()",
        "outboxkit:Outbox.gone": "Outbox.gone(self)",
        "outboxkit:Outbox.put": "Outbox.put(self, conn)",
    }
    current = {
        "outboxkit:Relay": "Relay(batch_size: 'int' = 500)",
        "outboxkit:Outbox.put": "Outbox.put(self, conn, *, notify)",
    }
    notes = public_api.unreleased_notes(CHANGELOG)
    removed, changed = public_api.differences(snapshot, current, notes)
    # Relay's change and old_helper's removal are recorded; the other two are not.
    assert removed == ["outboxkit:Outbox.gone"]
    assert changed == ["outboxkit:Outbox.put"]
    # With no notes at all, every difference is reported.
    assert public_api.differences(snapshot, current, "") == (
        ["outboxkit:old_helper", "outboxkit:Outbox.gone"],
        ["outboxkit:Relay", "outboxkit:Outbox.put"],
    )


def test_a_line_s_key_is_its_dotted_name() -> None:
    assert public_api._key("async Relay.run(self) -> 'None'") == "Relay.run"
    assert public_api._key("class Relay(RelayBase)") == "Relay"
    assert public_api._key("Relay.stopping: property") == "Relay.stopping"
    assert public_api._key("Status.DONE = 3") == "Status.DONE"
