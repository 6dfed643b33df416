"""The sizes ``Outbox.transaction()`` counts against MariaDB's ``max_allowed_packet`` and how
it splits rows: never shorter than what PyMySQL sends, the split in order, a row too large
for any INSERT named by its position."""

from __future__ import annotations

import datetime as dt

import pytest
from pymysql.converters import escape_item

from outboxkit import Event
from outboxkit.write import mariadb_packet as packet
from outboxkit.write.mariadb_table import MariaDBTableStorage

ODD = 'it\'s "quoted" \\ é€😀'


def _rows() -> list[tuple[object, ...]]:
    storage = MariaDBTableStorage("outbox")
    return [
        storage.row(Event(topic="t", event_type="x", payload=b"")),
        storage.row(
            Event(
                topic="orders",
                key=ODD,
                event_type="order.placed",
                aggregate_id=ODD,
                payload=bytes(range(256)) * 3,
                schema_version=3,
                headers={"h": ODD},
                deliver_at=dt.datetime(2026, 12, 5, 17, 3, 16, 123456, tzinfo=dt.UTC),
            )
        ),
    ]


@pytest.mark.parametrize("row", _rows())
def test_the_sizes_counted_are_what_pymysql_sends_and_the_quick_bound_is_above(
    row: tuple[object, ...],
) -> None:
    sent = sum(len(escape_item(v, "utf8mb4").encode()) for v in row)
    assert packet.exact_size(row) >= sent
    assert packet.exact_size(row) - sent <= 2 * 7  # (a datetime without microseconds: 7)
    assert packet.quick_size(row) >= packet.exact_size(row)


def test_the_insert_text_besides_its_values_is_bounded_from_above() -> None:
    for ordered in (False, True):
        storage = MariaDBTableStorage("outbox", ordered=ordered)
        rows = _rows() * 5
        stmt, _params = storage.insert(rows)
        fixed, per_row = storage.shape(len(storage.slots(rows)))
        text = len(stmt.text) - 2 * stmt.text.count("%s")
        slots = len(storage.slots(rows))
        assert fixed + per_row * len(rows) >= text + 5 * slots  # (slots: at most 5 digits)


def test_rows_are_split_greedily_in_order_within_the_limit() -> None:
    budget = 1000 + packet.SLACK
    # 100 + 2 * (50 + 300) = 800 fits 1000; a third row would not
    assert packet.chunks([300, 300, 300, 300, 10], 100, 50, budget, 10_000) == [(0, 2), (2, 5)]
    assert packet.chunks([1] * 5, 0, 1, budget, 2) == [(0, 2), (2, 4), (4, 5)]
    assert packet.chunks([], 100, 50, budget, 10) == []


def test_a_row_no_insert_can_carry_is_named_by_its_position_and_size() -> None:
    with pytest.raises(packet._RowTooLarge) as big:
        packet.chunks([10, 900, 10], 100, 50, 1000, 10_000)
    assert (big.value.position, big.value.size) == (1, 1050)
