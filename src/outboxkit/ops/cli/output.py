"""What the commands print: one-line results and errors, JSON values, rich consoles."""

from __future__ import annotations

import datetime as dt
import json
import sys
from typing import Any, NoReturn

from rich.console import Console, JustifyMethod
from rich.table import Table
from rich.text import Text

from outboxkit._redact import redact

#: The width of output that goes to a pipe or a file: no terminal to fit, so no wrapping
#: (rich's default there is 80 columns: ids split over lines, errors cut).
UNLIMITED_WIDTH = 100_000


def _width() -> int | None:
    """None on a terminal (rich reads its width, or COLUMNS); unlimited otherwise."""
    return None if sys.stdout.isatty() else UNLIMITED_WIDTH


# Messages, table names, topics and errors are data, never markup: "outboxkit[embedded]"
# must print as written. Styled output is built from Text objects instead.
console = Console(markup=False, highlight=False, width=_width())
err_console = Console(stderr=True, markup=False, highlight=False)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` (redacted) on stderr and exit with ``code``."""
    # soft_wrap: one line whatever the terminal width, so it greps and pastes whole.
    err_console.print(Text.assemble(("error:", "bold red"), " ", redact(message)), soft_wrap=True)
    sys.exit(code)


def ok(message: str) -> None:
    """Print a one-line success on stdout."""
    console.print(Text.assemble(("✓", "green"), " ", message), soft_wrap=True)


def id_column(table: Table, header: str, *, justify: JustifyMethod = "left") -> None:
    """A column of ids (row ids, event ids, keys): never wrapped or cut, whatever the width.

    A narrow terminal squeezes the other columns instead; a split UUID cannot be pasted.
    """
    table.add_column(header, justify=justify, no_wrap=True, overflow="ignore")


def jsonable(value: Any) -> Any:
    """A column value for --json: payloads as JSON (or text), times and UUIDs as strings."""
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode("utf-8", "replace")
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if hasattr(value, "hex") and type(value).__name__ == "UUID":
        return str(value)
    return value
