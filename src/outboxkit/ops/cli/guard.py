"""Expected failures of a command as one readable line and an exit code, never a traceback."""

from __future__ import annotations

from typing import Any

from outboxkit._text import first_line
from outboxkit.errors import OutboxkitError
from outboxkit.ops.cli.output import fail


def run_guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Turn expected failures into one readable line and an exit code, never a traceback."""
    import psycopg

    try:
        return fn(*args, **kwargs)
    except OutboxkitError as exc:
        fail(str(exc), 2)
    except psycopg.OperationalError as exc:
        first = first_line(exc)
        fail(f"cannot reach the database: {first} — check --dsn and that PostgreSQL is up", 3)
    except ValueError as exc:
        fail(str(exc), 2)
