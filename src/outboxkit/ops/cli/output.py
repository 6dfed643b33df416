"""What the commands print: one-line results and errors, JSON values, rich consoles."""

from __future__ import annotations

import datetime as dt
import json
import sys
from typing import Any, NoReturn

from rich.console import Console
from rich.text import Text

from outboxkit._redact import redact

# Messages, table names, topics and errors are data, never markup: "outboxkit[embedded]"
# must print as written. Styled output is built from Text objects instead.
console = Console(markup=False, highlight=False)
err_console = Console(stderr=True, markup=False, highlight=False)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` (redacted) on stderr and exit with ``code``."""
    # soft_wrap: one line whatever the terminal width, so it greps and pastes whole.
    err_console.print(Text.assemble(("error:", "bold red"), " ", redact(message)), soft_wrap=True)
    sys.exit(code)


def ok(message: str) -> None:
    """Print a one-line success on stdout."""
    console.print(Text.assemble(("✓", "green"), " ", message), soft_wrap=True)


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
