"""Expected failures of a command as one readable line and an exit code, never a traceback."""

from __future__ import annotations

from typing import Any

import click

from outboxkit._text import first_line
from outboxkit.errors import OutboxkitError, StoreUnavailable, missing_column, not_an_outbox
from outboxkit.ops.cli.output import fail


def run_guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Turn expected failures into one readable line and an exit code, never a traceback."""
    import psycopg

    try:
        return fn(*args, **kwargs)
    except StoreUnavailable as exc:  # (MariaDB's admin: its server is not reachable)
        fail(str(exc), 3)
    except OutboxkitError as exc:
        fail(str(exc), 2)
    except psycopg.OperationalError as exc:
        first = first_line(exc)
        fail(f"cannot reach the database: {first} — check --dsn and that PostgreSQL is up", 3)
    except psycopg.errors.UndefinedColumn as exc:
        table, what, option = _table_in_use()
        if (other := not_an_outbox(exc, table, what=what, option=option)) is not None:
            fail(str(other), 2)
        fail(
            f"{what} table {table!r} has no column {missing_column(exc)!r}, which this command"
            f" needs: upgrade it with `outboxkit migrate --dsn … {option} {table}` (with the"
            " options it was created with, e.g. --ordered)",
            2,
        )
    except psycopg.DataError as exc:  # a value out of the column's range, e.g. a huge number
        fail(f"the database refused a value: {first_line(exc)} — check the options given", 2)
    except ValueError as exc:
        fail(str(exc), 2)


def _table_in_use() -> tuple[str, str, str]:
    """The table the running command acts on, what kind it is, and the option naming it."""
    ctx = click.get_current_context(silent=True)
    params = ctx.params if ctx is not None else {}
    if params.get("inbox") and params.get("inbox_table"):
        return str(params["inbox_table"]), "inbox", "--inbox-table"
    return str(params.get("table") or "?"), "outbox", "--table"
