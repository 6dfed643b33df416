"""Event(deliver_at=..., delay=...): checked at construction, stored as available_at."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from outboxkit import Event, InvalidEventError, Outbox
from outboxkit.write.table import _KEY, _first_due, _params, _text_array, any_due, lock_param


def _event(**kwargs: Any) -> Event:
    return Event(topic="orders", event_type="order.placed", payload={}, **kwargs)


def test_an_unscheduled_event_has_no_available_at() -> None:
    assert _event().available_at is None
    assert _event(delay=dt.timedelta(0)).available_at is None  # no delay: at once


def test_deliver_at_is_kept_as_given() -> None:
    at = dt.datetime(2031, 5, 6, 7, 8, 9, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    event = _event(deliver_at=at)
    assert event.available_at == at
    assert "deliver_at=2031-05-06T07:08:09+02:00" in repr(event)


def test_delay_counts_from_construction() -> None:
    before = dt.datetime.now(dt.UTC)
    event = _event(delay=dt.timedelta(minutes=5))
    after = dt.datetime.now(dt.UTC)
    assert event.available_at is not None
    assert before + dt.timedelta(minutes=5) <= event.available_at <= after + dt.timedelta(minutes=5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"deliver_at": dt.datetime(2031, 1, 1)}, "deliver_at must be timezone-aware"),
        ({"deliver_at": "2031-01-01T00:00:00Z"}, "deliver_at must be a datetime, got str"),
        ({"deliver_at": dt.date(2031, 1, 1)}, "deliver_at must be a datetime, got date"),
        ({"delay": 5}, "delay must be a datetime.timedelta, got int"),
        ({"delay": dt.timedelta(seconds=-1)}, "delay must not be negative"),
        ({"delay": dt.timedelta.max}, "runs past the year 9999"),
        (
            {"delay": dt.timedelta(1), "deliver_at": dt.datetime.now(dt.UTC)},
            "deliver_at or delay, not both",
        ),
    ],
)
def test_bad_schedules_are_refused_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidEventError, match=message):
        _event(**kwargs)


def test_only_events_due_now_are_worth_a_notify() -> None:
    now = dt.datetime.now(dt.UTC)
    future, past = now + dt.timedelta(hours=1), now - dt.timedelta(seconds=1)
    assert any_due([None])
    assert any_due([future, past])
    assert not any_due([future, future])
    assert not any_due([])
    rows = [_params(_event(deliver_at=future)), _params(_event(deliver_at=past)), _params(_event())]
    assert _first_due(rows) == 1
    assert _first_due(rows[:1]) == -1
    assert _first_due(rows[2:]) == 0


def test_an_ordered_write_locks_each_distinct_key_once_and_keyless_ones_not_at_all() -> None:
    assert lock_param([None, None], one_row=False) is None
    assert lock_param([None], one_row=True) is None
    several = lock_param(["b", None, "a", "b"], one_row=False)
    assert several is not None and several[0] and sorted(several[1]) == ["a", "b"]
    # a statement of many rows takes even one key as an array (KEY_LOCKS)...
    assert lock_param(["b", "b"], one_row=False) == (True, ["b"])
    assert lock_param(["b"], one_row=False) == (True, ["b"])
    # ...a one-row statement takes it as a text (KEY_LOCK)
    assert lock_param(["b"], one_row=True) == (False, "b")

    def commit_lock(*keys: str | None) -> object:  # transaction()'s first INSERT, in binary
        rows = [_params(_event(key=key)) for key in keys]
        return lock_param([row[_KEY] for row in rows], one_row=True, array=_text_array)

    assert commit_lock(None) is None
    assert commit_lock("b", "b") == (False, b"b")  # one key: a text parameter
    assert commit_lock("b") == (False, b"b")
    assert commit_lock(None, "b") == (False, b"b")
    binary = commit_lock("b", "a")
    assert isinstance(binary, tuple) and binary[0]
    # a one-dimensional text[] of two elements: ndim 1, no NULL, oid 25, length 2, lbound 1
    header = bytes.fromhex("00000001 00000000 00000019 00000002 00000001")
    assert binary[1] in (
        header + b"\x00\x00\x00\x01a\x00\x00\x00\x01b",
        header + b"\x00\x00\x00\x01b\x00\x00\x00\x01a",
    )


def test_the_outbox_says_it_is_ordered() -> None:
    assert repr(Outbox(ordered=True)) == "Outbox(table='outbox', notify=True, ordered=True)"
    assert repr(Outbox()) == "Outbox(table='outbox', notify=True)"
