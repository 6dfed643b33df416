"""The dashboard's recent activity per topic, from its own samples (no database read)."""

from __future__ import annotations

from outboxkit.maintenance.report import TopicStatus
from outboxkit.ops.dashboard import HISTORY_SECONDS, Dashboard


def _sample(board: Dashboard, now: float, *topics: TopicStatus) -> dict[str, TopicStatus]:
    return {t.topic: t for t in board._bounded_topics(list(topics), now)}


def test_rows_that_left_count_as_published_and_rows_that_failed_do_not() -> None:
    board = Dashboard("postgresql://u@127.0.0.1:1/db", max_topics=10)
    _sample(board, 0.0, TopicStatus("a", 10, 0, 0, 0, 1.0))
    # 4 left the table, 2 failed: 6 fewer pending, only 4 published
    assert _sample(board, 2.0, TopicStatus("a", 4, 0, 2, 0, 1.0))["a"].published == 4
    drained = _sample(board, 4.0, TopicStatus("other-topic", 1, 0, 0, 0, None))["a"]
    assert (drained.pending, drained.failed, drained.published) == (0, 0, 8)
    # a replay (failed back to pending) is not published
    assert _sample(board, 6.0, TopicStatus("a", 2, 0, 0, 0, None))["a"].published == 8
    # it had rows at 6.0: listed until the window has passed, counting only what left in it
    late = _sample(board, 5.0 + HISTORY_SECONDS, TopicStatus("other-topic", 1, 0, 0, 0, None))
    assert late["a"].published == 2
    gone = _sample(board, 7.0 + HISTORY_SECONDS, TopicStatus("other-topic", 1, 0, 0, 0, None))
    assert "a" not in gone


def test_a_full_list_crowds_out_drained_topics() -> None:
    board = Dashboard("postgresql://u@127.0.0.1:1/db", max_topics=2)
    _sample(board, 0.0, TopicStatus("a", 3, 0, 0, 0, None))
    busy = _sample(
        board, 1.0, TopicStatus("b", 5, 0, 0, 0, None), TopicStatus("c", 4, 0, 0, 0, None)
    )
    assert sorted(busy) == ["b", "c"]
