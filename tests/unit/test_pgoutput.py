"""The pgoutput v1 decoder on messages recorded from a real PostgreSQL 18 (data/pgoutput_v1.json).

The recording (tests/unit/data/record_pgoutput_v1.py) holds, in stream order: an insert
transaction with a TOASTed value, an enum column (Type message), NULLs and a transactional
logical message; a non-transactional message; an UPDATE leaving the TOASTed column unchanged;
a DELETE; a TRUNCATE; and a transaction replayed from a replication origin.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from outboxkit.cdc import pgoutput
from outboxkit.cdc.pgoutput import (
    UNCHANGED,
    Begin,
    Commit,
    Decoder,
    Delete,
    Insert,
    Message,
    Origin,
    PgoutputError,
    Relation,
    Truncate,
    Type,
    Update,
)

RECORDING = json.loads((Path(__file__).parent / "data" / "pgoutput_v1.json").read_text())
PAYLOADS = [bytes.fromhex(m["hex"]) for m in RECORDING["messages"]]


def decode_all() -> list[pgoutput.PgoutputMessage]:
    decoder = Decoder()
    return [decoder.decode(payload) for payload in PAYLOADS]


def test_the_recording_decodes_in_order_to_the_expected_kinds() -> None:
    kinds = [type(m).__name__ for m in decode_all()]
    assert kinds == [
        "Begin", "Type", "Relation", "Insert", "Insert", "Message", "Commit",
        "Message",
        "Begin", "Update", "Commit",
        "Begin", "Delete", "Commit",
        "Begin", "Type", "Relation", "Truncate", "Commit",
        "Begin", "Origin", "Type", "Relation", "Insert", "Commit",
    ]  # fmt: skip


def test_insert_values_stay_in_text_format_with_nulls_and_toasted_values() -> None:
    messages = decode_all()
    begin, mood, relation, first, second = messages[:5]
    assert isinstance(begin, Begin) and isinstance(relation, Relation)
    assert isinstance(mood, Type) and (mood.namespace, mood.name) == ("public", "mood")
    assert relation.qualified_name == "public.outbox"
    assert [c.name for c in relation.columns] == ["id", "key", "payload", "m", "big"]
    assert [c.key for c in relation.columns] == [True, False, False, False, False]
    assert relation.columns[3].type_oid == mood.oid
    assert isinstance(first, Insert) and first.relation is relation
    assert first.values == {
        "id": b"1",
        "key": b"a",
        "payload": b"\\x00ff",
        "m": b"ok",
        "big": b"x" * 5000,
    }
    assert isinstance(second, Insert)
    assert second.values == {"id": b"2", "key": None, "payload": None, "m": None, "big": None}


def test_begin_commit_and_messages_carry_positions_and_commit_time() -> None:
    messages = decode_all()
    begin, message, commit, loose = messages[0], messages[5], messages[6], messages[7]
    assert isinstance(begin, Begin) and isinstance(commit, Commit)
    assert begin.final_lsn == commit.commit_lsn < commit.end_lsn
    assert begin.commit_time == commit.commit_time
    assert abs(begin.commit_time - dt.datetime.now(dt.UTC)) < dt.timedelta(days=3650)
    assert begin.xid > 0
    assert message == Message(True, message.lsn, "outboxkit:outbox", b"\xde\xad\xbe\xef")
    assert isinstance(loose, Message) and not loose.transactional and loose.content == b"hi"
    assert loose.lsn > commit.end_lsn


def test_update_delete_truncate_and_origin_are_decoded() -> None:
    messages = decode_all()
    update, delete, truncate, origin = messages[9], messages[12], messages[17], messages[20]
    assert isinstance(update, Update) and update.old is None
    assert update.new["key"] == b"b" and update.new["big"] is UNCHANGED
    assert isinstance(delete, Delete) and delete.old["id"] == b"2"
    assert delete.old["key"] is None  # only the replica identity (the primary key) is sent
    assert isinstance(truncate, Truncate)
    assert [r.name for r in truncate.relations] == ["outbox"]
    assert not truncate.cascade and not truncate.restart_identity
    assert isinstance(origin, Origin) and origin.name == "upstream"


def test_lsn_text_round_trips() -> None:
    assert pgoutput.format_lsn(0x16_B3748A8) == "1/6B3748A8"
    assert pgoutput.parse_lsn("1/6B3748A8") == 0x16_B3748A8
    with pytest.raises(ValueError, match="not a WAL position"):
        pgoutput.parse_lsn("nope")


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"", "empty payload"),
        (b"Z\x00", "unknown pgoutput message type 'Z'"),
        (PAYLOADS[0][:-2], "malformed pgoutput Begin message .* truncated"),
        (PAYLOADS[0] + b"\x00", "Begin message .* 1 trailing bytes"),
        (b"M\x01" + b"\x00" * 8 + b"no terminator", "Message message .* unterminated string"),
        (b"M\x01" + b"\x00" * 8 + b"p\x00\xff\xff\xff\xff", "negative content length -1"),
        (b"I\x00\x00\x00\x07N\x00\x00", "change of relation 7, which no Relation message"),
    ],
)
def test_malformed_messages_raise_a_clear_error(payload: bytes, error: str) -> None:
    with pytest.raises(PgoutputError, match=error):
        Decoder().decode(payload)


def test_a_tuple_with_the_wrong_column_count_or_kind_is_refused() -> None:
    decoder = Decoder()
    for payload in PAYLOADS[:3]:
        decoder.decode(payload)
    insert = bytearray(PAYLOADS[3])
    wrong_count = bytes(insert[:6]) + b"\x00\x02" + bytes(insert[8:])
    with pytest.raises(PgoutputError, match="2 columns for public.outbox, whose Relation"):
        decoder.decode(wrong_count)
    insert[8] = ord("x")
    with pytest.raises(PgoutputError, match="unknown column value kind 'x' of column 'id'"):
        decoder.decode(bytes(insert))


def test_a_pgoutput_error_is_a_value_error_and_an_outboxkit_error() -> None:
    from outboxkit.errors import OutboxkitError

    assert issubclass(PgoutputError, ValueError) and issubclass(PgoutputError, OutboxkitError)
