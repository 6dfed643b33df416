"""An Outbox picks its storage once (write/table.py or write/wal.py) and every write
path asks it: no path of a WAL outbox writes a row, none of a table outbox emits a
message. And transaction()'s pipeline as each storage lays it out."""

from __future__ import annotations

import datetime as dt
from typing import Any

from outboxkit import Event, Outbox
from outboxkit.backends import backend_for
from outboxkit.write.storage import OIDS, BinaryRow, CommitStatement
from outboxkit.write.table import TableStorage
from outboxkit.write.wal import WalStorage

_LATER = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)


def _event(key: str | None = None, **kwargs: Any) -> Event:
    return Event(topic="orders", event_type="order.placed", payload={}, key=key, **kwargs)


def _storage(outbox: Outbox) -> Any:
    """The storage ``outbox`` writes PostgreSQL's connections with."""
    return outbox._writer_for(backend_for("postgresql://")).storage


def _pipeline(outbox: Outbox, events: list[Event]) -> list[tuple[CommitStatement, BinaryRow]]:
    """What transaction()'s COMMIT would carry for ``events``, before the COMMIT."""
    storage = _storage(outbox)
    sent: list[tuple[CommitStatement, BinaryRow]] = []
    storage.commit_inserts([storage.encode(e) for e in events], lambda s, p: sent.append((s, p)))
    return sent


def _statements(outbox: Outbox) -> list[str]:
    """The SQL of every write path for two events (put, put_many, execute_with, commit)."""
    events = [_event("a"), _event("b")]
    return [
        _storage(outbox).one(events[0])[0].text,
        *(
            prepared[0].text
            for prepared in [_storage(outbox).many(events, outbox._check)]
            if prepared
        ),
        outbox._attached("SELECT 1", (), events)[0],
        *(statement.key[0].decode() for statement, _ in _pipeline(outbox, events)),
    ]


def test_every_path_of_a_wal_outbox_emits_messages_and_writes_no_row() -> None:
    outbox = Outbox(storage="wal", notify=True)
    assert isinstance(_storage(outbox), WalStorage)
    statements = _statements(outbox)
    assert len(statements) == 5
    for sql in statements:
        assert "pg_logical_emit_message" in sql
        assert "event_id" not in sql  # the outbox's columns: a row


def test_every_path_of_a_table_outbox_writes_rows_and_emits_no_message() -> None:
    for outbox in (Outbox(), Outbox(ordered=True)):
        assert isinstance(_storage(outbox), TableStorage)
        statements = _statements(outbox)
        assert len(statements) == 5
        for sql in statements:
            assert "event_id" in sql
            assert "pg_logical_emit_message" not in sql


def test_an_ordered_commit_locks_every_key_on_its_first_insert_and_notifies_on_the_first_due() -> (
    None
):
    sent = _pipeline(Outbox(ordered=True), [_event("a", deliver_at=_LATER), _event("b"), _event()])
    (first, first_params), (second, second_params), (third, third_params) = sent
    # the first INSERT takes both keys' locks (a text[]), and carries no NOTIFY: it is scheduled
    assert first.types[-1] == OIDS["text[]"]
    assert "pg_advisory_xact_lock" in first.key[0].decode()
    assert "pg_notify" not in first.key[0].decode()
    assert len(first_params) == len(first.types)
    # the first row due now carries the NOTIFY (its channel the last parameter), once
    assert "pg_notify" in second.key[0].decode() and second_params[-1] == b"outboxkit_outbox"
    assert "pg_notify" not in third.key[0].decode() and len(third_params) == len(third.types)
    for statement, _ in sent[1:]:
        assert "pg_advisory_xact_lock" not in statement.key[0].decode()


def test_an_ordered_commit_of_one_key_locks_it_as_a_text() -> None:
    (first, params), _ = _pipeline(Outbox(ordered=True), [_event("a"), _event("a")])
    assert first.types[-2:] == [OIDS["text"], OIDS["text"]]  # the key, then the channel
    assert params[-2:] == [b"a", b"outboxkit_outbox"]


def test_an_unordered_or_keyless_commit_takes_no_lock() -> None:
    for outbox, key in ((Outbox(), "a"), (Outbox(ordered=True), None)):
        for statement, _ in _pipeline(outbox, [_event(key), _event(key)]):
            assert "pg_advisory_xact_lock" not in statement.key[0].decode()


def test_a_wal_commit_notifies_on_its_first_message_only_when_asked() -> None:
    sent = _pipeline(Outbox(storage="wal", notify=True), [_event(), _event()])
    assert [len(params) for _, params in sent] == [2, 1]
    assert sent[0][1][-1] == b"outboxkit_outbox"
    quiet = _pipeline(Outbox(storage="wal"), [_event(), _event()])  # notify: off by default
    assert [len(params) for _, params in quiet] == [1, 1]
    assert all("pg_notify" not in s.key[0].decode() for s, _ in quiet)
