"""A decoder of PostgreSQL's `pgoutput` logical replication protocol, version 1 (pure, no I/O).

Written here rather than taken from PyPI (checked 2026-11): `pypgoutput` is a 2022 prototype
("not production tested") built on pydantic models; `pgoutput-decoder` is a young native
(Rust) build; the pure `pgoutput` package is not on the registry this project installs from.
The protocol subset the relay needs is small and documented ("Logical Replication Message
Formats" in the PostgreSQL manual), so owning ~200 lines beats a dependency.

`Decoder.decode(payload)` turns the bytes of one XLogData payload into one message. Insert,
Update and Delete carry their relation, taken from the Relation message the server sends
before a relation's first change in a session (kept in the decoder). Column values stay as the
server sent them: bytes in the column type's text format (`None` for NULL, `UNCHANGED` for an
unchanged TOASTed value). Malformed input raises `PgoutputError` naming the message and offset.
"""

from __future__ import annotations

import datetime as dt
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from outboxkit.errors import PgoutputError

#: PostgreSQL's epoch: timestamps on the wire are microseconds since this instant.
PG_EPOCH: Final = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


class _Unchanged:
    """An unchanged TOASTed column value of an UPDATE: the server did not send it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = _Unchanged()

Value = bytes | None | _Unchanged


def pg_timestamp(micros: int) -> dt.datetime:
    """A wire timestamp (microseconds since 2000-01-01 UTC) as an aware datetime."""
    return PG_EPOCH + dt.timedelta(microseconds=micros)


def format_lsn(lsn: int) -> str:
    """`X/Y`, the way PostgreSQL prints a WAL position."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """The integer of a WAL position printed as `X/Y`."""
    high, _, low = text.partition("/")
    try:
        return (int(high, 16) << 32) | int(low, 16)
    except ValueError:
        raise ValueError(f"not a WAL position: {text!r} (expected X/Y in hex)") from None


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_time: dt.datetime
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: dt.datetime


@dataclass(frozen=True, slots=True)
class Origin:
    commit_lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type_oid: int
    type_modifier: int
    key: bool  # part of the replica identity


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    namespace: str
    name: str
    replica_identity: str  # d default, n nothing, f full, i index
    columns: tuple[Column, ...]

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}"


@dataclass(frozen=True, slots=True)
class Type:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    relation: Relation
    values: dict[str, Value]


@dataclass(frozen=True, slots=True)
class Update:
    relation: Relation
    old: dict[str, Value] | None  # the old key ('K') or row ('O'), when the server sent one
    new: dict[str, Value]


@dataclass(frozen=True, slots=True)
class Delete:
    relation: Relation
    old: dict[str, Value]


@dataclass(frozen=True, slots=True)
class Truncate:
    relations: tuple[Relation, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class Message:
    """A logical decoding message (`pg_logical_emit_message`)."""

    transactional: bool
    lsn: int
    prefix: str
    content: bytes


PgoutputMessage = (
    Begin | Commit | Origin | Relation | Type | Insert | Update | Delete | Truncate | Message
)


class _Reader:
    """Reads big-endian fields of one message, failing with the message kind and offset."""

    __slots__ = ("_data", "_kind", "_pos")

    def __init__(self, data: bytes, kind: str) -> None:
        self._data = data
        self._kind = kind
        self._pos = 1  # after the type byte

    def fail(self, what: str) -> PgoutputError:
        return PgoutputError(
            f"malformed pgoutput {self._kind} message ({len(self._data)} bytes): {what} "
            f"at offset {self._pos}"
        )

    def _take(self, size: int) -> bytes:
        end = self._pos + size
        if size < 0 or end > len(self._data):
            raise self.fail(f"truncated, {size} more bytes expected")
        chunk = self._data[self._pos : end]
        self._pos = end
        return chunk

    def _unpack(self, fmt: struct.Struct) -> int:
        end = self._pos + fmt.size
        if end > len(self._data):
            raise self.fail(f"truncated, {fmt.size} more bytes expected")
        value: int = fmt.unpack_from(self._data, self._pos)[0]
        self._pos = end
        return value

    def int8(self) -> int:
        return self._unpack(_UINT8)

    def int16(self) -> int:
        return self._unpack(_INT16)

    def int32(self) -> int:
        return self._unpack(_INT32)

    def uint32(self) -> int:
        return self._unpack(_UINT32)

    def int64(self) -> int:
        return self._unpack(_INT64)

    def uint64(self) -> int:
        return self._unpack(_UINT64)

    def byte(self) -> str:
        return chr(self._take(1)[0])

    def string(self) -> str:
        end = self._data.find(b"\0", self._pos)
        if end < 0:
            raise self.fail("unterminated string")
        raw = self._data[self._pos : end]
        self._pos = end + 1
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise self.fail("string not in UTF-8") from None

    def bytes(self, size: int) -> bytes:
        return self._take(size)

    def end(self) -> None:
        if self._pos != len(self._data):
            raise self.fail(f"{len(self._data) - self._pos} trailing bytes")


class Decoder:
    """Decodes one session's messages; remembers the relations the server described."""

    def __init__(self) -> None:
        self.relations: dict[int, Relation] = {}

    def decode(self, payload: bytes) -> PgoutputMessage:
        if not payload:
            raise PgoutputError("malformed pgoutput message: empty payload")
        kind = chr(payload[0])
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise PgoutputError(
                f"unknown pgoutput message type {kind!r} (byte 0x{payload[0]:02x}); "
                "the stream was started with proto_version '1', which does not send it"
            )
        reader = _Reader(payload, _NAMES[kind])
        message = handler(self, reader)
        reader.end()
        return message

    # -- one method per message type ---------------------------------------------------------

    def _begin(self, r: _Reader) -> Begin:
        final_lsn = r.uint64()
        return Begin(final_lsn, pg_timestamp(r.int64()), r.uint32())

    def _commit(self, r: _Reader) -> Commit:
        flags = r.int8()
        commit_lsn = r.uint64()
        end_lsn = r.uint64()
        return Commit(flags, commit_lsn, end_lsn, pg_timestamp(r.int64()))

    def _origin(self, r: _Reader) -> Origin:
        return Origin(r.uint64(), r.string())

    def _relation(self, r: _Reader) -> Relation:
        oid = r.uint32()
        namespace = r.string()
        name = r.string()
        identity = r.byte()
        count = r.int16()
        if count < 0:
            raise r.fail(f"negative column count {count}")
        columns = []
        for _ in range(count):
            flags = r.int8()
            column = r.string()
            columns.append(Column(column, r.uint32(), r.int32(), bool(flags & 1)))
        relation = Relation(oid, namespace or "pg_catalog", name, identity, tuple(columns))
        self.relations[oid] = relation
        return relation

    def _type(self, r: _Reader) -> Type:
        return Type(r.uint32(), r.string(), r.string())

    def _insert(self, r: _Reader) -> Insert:
        relation = self._known(r, r.uint32())
        if (tag := r.byte()) != "N":
            raise r.fail(f"expected the new tuple 'N', got {tag!r}")
        return Insert(relation, _tuple(r, relation))

    def _update(self, r: _Reader) -> Update:
        relation = self._known(r, r.uint32())
        old = None
        tag = r.byte()
        if tag in ("K", "O"):
            old = _tuple(r, relation)
            tag = r.byte()
        if tag != "N":
            raise r.fail(f"expected the new tuple 'N', got {tag!r}")
        return Update(relation, old, _tuple(r, relation))

    def _delete(self, r: _Reader) -> Delete:
        relation = self._known(r, r.uint32())
        if (tag := r.byte()) not in ("K", "O"):
            raise r.fail(f"expected the old key 'K' or row 'O', got {tag!r}")
        return Delete(relation, _tuple(r, relation))

    def _truncate(self, r: _Reader) -> Truncate:
        count = r.int32()
        if count < 0:
            raise r.fail(f"negative relation count {count}")
        options = r.int8()
        relations = tuple(self._known(r, r.uint32()) for _ in range(count))
        return Truncate(relations, bool(options & 1), bool(options & 2))

    def _message(self, r: _Reader) -> Message:
        flags = r.int8()
        lsn = r.uint64()
        prefix = r.string()
        size = r.int32()
        if size < 0:
            raise r.fail(f"negative content length {size}")
        return Message(bool(flags & 1), lsn, prefix, r.bytes(size))

    def _known(self, r: _Reader, oid: int) -> Relation:
        relation = self.relations.get(oid)
        if relation is None:
            raise r.fail(
                f"change of relation {oid}, which no Relation message described first "
                "(decode a session's messages in order, from its start, with one Decoder)"
            )
        return relation


def _tuple(r: _Reader, relation: Relation) -> dict[str, Value]:
    # The hot loop of the WAL relay (every column of every outbox row): it reads the
    # buffer directly rather than through _Reader's methods, with the same checks.
    count = r.int16()
    columns = relation.columns
    if count != len(columns):
        raise r.fail(
            f"{count} columns for {relation.qualified_name}, whose Relation message has "
            f"{len(columns)}"
        )
    data, pos, limit = r._data, r._pos, len(r._data)
    unpack_size = _INT32.unpack_from
    values: dict[str, Value] = {}
    try:
        for column in columns:
            if pos >= limit:
                raise r.fail("truncated, 1 more bytes expected")
            kind = data[pos]
            pos += 1
            if kind in (_TEXT, _BINARY):
                if pos + 4 > limit:
                    raise r.fail("truncated, 4 more bytes expected")
                size = unpack_size(data, pos)[0]
                pos += 4
                if size < 0:
                    raise r.fail(f"negative length {size} of column {column.name!r}")
                end = pos + size
                if end > limit:
                    raise r.fail(f"truncated, {size} more bytes expected")
                values[column.name] = data[pos:end]
                pos = end
            elif kind == _NULL:
                values[column.name] = None
            elif kind == _UNCHANGED_TOAST:
                values[column.name] = UNCHANGED
            else:
                raise r.fail(f"unknown column value kind {chr(kind)!r} of column {column.name!r}")
    finally:
        r._pos = pos
    return values


_UINT8 = struct.Struct(">B")
_INT16 = struct.Struct(">h")
_INT32 = struct.Struct(">i")
_UINT32 = struct.Struct(">I")
_INT64 = struct.Struct(">q")
_UINT64 = struct.Struct(">Q")
_TEXT, _BINARY, _NULL, _UNCHANGED_TOAST = b"t"[0], b"b"[0], b"n"[0], b"u"[0]

_NAMES = {
    "B": "Begin",
    "C": "Commit",
    "O": "Origin",
    "R": "Relation",
    "Y": "Type",
    "I": "Insert",
    "U": "Update",
    "D": "Delete",
    "T": "Truncate",
    "M": "Message",
}
_HANDLERS: dict[str, Callable[[Decoder, _Reader], PgoutputMessage]] = {
    "B": Decoder._begin,
    "C": Decoder._commit,
    "O": Decoder._origin,
    "R": Decoder._relation,
    "Y": Decoder._type,
    "I": Decoder._insert,
    "U": Decoder._update,
    "D": Decoder._delete,
    "T": Decoder._truncate,
    "M": Decoder._message,
}
