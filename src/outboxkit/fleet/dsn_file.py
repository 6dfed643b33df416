"""The DSN file of a fleet: one database a line, ``DSN`` or ``NAME DSN``.

Blank lines and lines starting with ``#`` are skipped. A name is identifier-like (letters,
digits, ``_``, ``-`` and ``.``, a letter or ``_`` first); without one the database is named
``host:port/dbname`` from its DSN, which no given name can equal. A line that cannot be read
(a DSN its driver cannot parse, a bad or repeated name) is reported with its number and
skipped: the other lines still count. Passwords may stay out of the file: libpq reads
``PGPASSWORD`` and the passfile (``PGPASSFILE``, ``~/.pgpass``) for every line without one.
No message here quotes a DSN: they name the line and the database only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from outboxkit._redact import remember_secrets
from outboxkit.backends import backend_for
from outboxkit.errors import ConfigurationError

#: A name given in the file: what logs, metrics (the ``database`` label) and status show.
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,62}")
# key=value pairs of a libpq DSN (values quoted with '...' may hold spaces).
_PAIR = re.compile(r"(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S*)")


@dataclass(frozen=True, slots=True)
class Database:
    """One database of the file: its name, its DSN and the line that lists it."""

    name: str
    dsn: str
    line: int

    def __repr__(self) -> str:  # never the DSN: it may hold a password
        return f"Database(name={self.name!r}, line={self.line})"


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that was skipped, and why (``name``: the name it gave, if that much was read)."""

    line: int
    reason: str
    name: str | None = None

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclass(frozen=True, slots=True)
class DsnFile:
    """What a DSN file lists: its databases in file order, and the lines skipped."""

    databases: tuple[Database, ...]
    bad_lines: tuple[BadLine, ...]


def read_dsn_file(path: str | Path) -> DsnFile:
    """Read and parse ``path``; ConfigurationError if it cannot be read at all."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(
            f"cannot read the DSN file {str(path)!r}: {exc.__class__.__name__}:"
            f" {getattr(exc, 'strerror', None) or exc}"
        ) from None
    return parse_dsn_file(text)


def parse_dsn_file(text: str) -> DsnFile:
    """The databases ``text`` lists (see the module's docstring) and the lines it skips."""
    databases: dict[str, Database] = {}
    bad: list[BadLine] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            database = _parse_line(line, number)
        except _Bad as exc:
            bad.append(BadLine(number, str(exc), exc.name))
            continue
        first = databases.get(database.name)
        if first is not None:
            bad.append(
                BadLine(
                    number,
                    f"the name {database.name!r} is already used on line {first.line}",
                )
            )
            continue
        remember_secrets(database.dsn)  # masked in any later log line that quotes it
        databases[database.name] = database
    return DsnFile(tuple(databases.values()), tuple(bad))


class _Bad(Exception):
    def __init__(self, reason: str, name: str | None = None) -> None:
        super().__init__(reason)
        self.name = name


def _parse_line(line: str, number: int) -> Database:
    head, _, rest = line.partition(" ")
    if "\t" in head:  # (a tab between the name and the DSN)
        head, _, more = head.partition("\t")
        rest = f"{more} {rest}"
    if _looks_like_dsn(head):
        name, dsn = None, line
    else:
        if not NAME.fullmatch(head):
            raise _Bad(
                "not DSN or NAME DSN: a DSN is a URL (postgresql://...) or key=value pairs, a"
                " name is letters, digits, _ - . (a letter or _ first, at most 63)"
            )
        if not rest.strip():
            raise _Bad(f"no DSN after the name {head!r}", head)
        name, dsn = head, rest.strip()
        if not _looks_like_dsn(dsn):
            raise _Bad(
                f"{name!r} is followed by no DSN (a URL such as postgresql://host/db, or"
                " key=value pairs)",
                name,
            )
    try:
        backend_for(dsn).check_dsn(dsn)
    except ConfigurationError as exc:
        raise _Bad(str(exc), name) from None  # (the check masks what it quotes)
    return Database(name or derived_name(dsn), dsn, number)


def _looks_like_dsn(text: str) -> bool:
    return "://" in text or "=" in text


def derived_name(dsn: str) -> str:
    """``host:port/dbname`` of a DSN that gives no name (``localhost`` and the driver's
    default port when it says none)."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        first = parts.netloc.rpartition("@")[2].split(",")[0]
        if first.startswith("["):  # [IPv6]:port
            host_part, _, port_part = first[1:].partition("]")
            port_part = port_part.lstrip(":")
        else:
            host_part, _, port_part = first.partition(":")
        host = query.get("host") or unquote(host_part) or "localhost"
        port = query.get("port") or port_part
        dbname = query.get("dbname") or unquote(parts.path.lstrip("/"))
    else:
        pairs = {k: v.strip("'") for k, v in _PAIR.findall(dsn)}
        host = pairs.get("host") or pairs.get("hostaddr") or "localhost"
        port = pairs.get("port", "")
        dbname = pairs.get("dbname", "")
    where = f"{host.split(',')[0]}:{port.split(',')[0]}" if port else host.split(",")[0]
    return f"{where}/{dbname}"
