"""The deferred write's queue: what a rollback, a savepoint rollback or a release keeps."""

from __future__ import annotations

from typing import Any

from outboxkit import Event
from outboxkit.write.deferred import Pending


def _e(i: int) -> Event:
    return Event(topic="t", event_type="e", payload={"i": i})


def _ids(pending: Pending, raw: Any) -> list[int]:
    return [
        int(e.payload.decode().split(":")[1].rstrip("}"))
        for q in pending.take(raw)
        for e in q.events
    ]


RAW, OUTBOX = object(), object()


def _queue(pending: Pending, *ids: int) -> None:
    for i in ids:
        pending.add(RAW, OUTBOX, [_e(i)])  # type: ignore[arg-type]


def test_rolling_back_to_a_savepoint_drops_what_came_after_it_and_keeps_it() -> None:
    p = Pending()
    _queue(p, 1)
    p.mark("a")
    _queue(p, 2)
    p.mark("b")
    _queue(p, 3)
    p.roll_back_to("a")  # b is gone with it on the server
    _queue(p, 4)
    p.roll_back_to("a")  # a stays: rolling back to it again drops 4
    _queue(p, 5)
    assert _ids(p, RAW) == [1, 5]


def test_a_release_keeps_the_events_and_forgets_the_savepoints_inside() -> None:
    p = Pending()
    _queue(p, 1)
    p.mark("a")
    _queue(p, 2)
    p.mark("b")
    _queue(p, 3)
    p.release("a")
    assert p.marks == []
    p.roll_back_to("b")  # released with a: unknown now, as one taken before the queue
    _queue(p, 4)
    assert _ids(p, RAW) == [4]


def test_a_savepoint_taken_before_the_queue_existed_drops_everything() -> None:
    p = Pending()
    _queue(p, 1)
    p.mark("b")
    _queue(p, 2)
    p.roll_back_to("unmarked")
    _queue(p, 3)
    assert _ids(p, RAW) == [3]


def test_an_unnamed_savepoint_is_the_innermost_one_released_or_rolled_back() -> None:
    p = Pending()
    _queue(p, 1)
    p.mark(None)
    _queue(p, 2)
    p.mark(None)
    _queue(p, 3)
    p.roll_back_to("inner")
    p.roll_back_to("outer")
    _queue(p, 4)
    assert _ids(p, RAW) == [1, 4]


def test_a_reconnect_drops_what_the_old_connection_had() -> None:
    p = Pending()
    _queue(p, 1)
    other = object()
    p.add(other, OUTBOX, [_e(2)])  # type: ignore[arg-type]
    assert _ids(p, RAW) == []  # taken for another connection: nothing
    p.add(other, OUTBOX, [_e(3)])  # type: ignore[arg-type]
    assert _ids(p, other) == [3]
