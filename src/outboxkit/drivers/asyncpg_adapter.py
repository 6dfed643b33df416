"""asyncpg ``Connection``: ``$n`` parameters, a transaction only inside ``conn.transaction()``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outboxkit.drivers.base import AsyncAdapter, CursorCache, Statement
from outboxkit.errors import NotInTransactionError


def check_in_transaction(conn: Any) -> None:
    if conn.is_closed() or not conn.is_in_transaction():
        raise NotInTransactionError(
            "asyncpg connection has no open transaction; write inside"
            " `async with conn.transaction():` so the event commits with your change"
        )


class Asyncpg(AsyncAdapter):
    label = "asyncpg.Connection"
    modules = ("asyncpg",)

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        # By shape, not isinstance: asyncpg is optional, and pools proxy connections.
        return conn_type.__module__.startswith("asyncpg") and hasattr(
            conn_type, "is_in_transaction"
        )

    @classmethod
    def refusal(cls, conn_type: type) -> str | None:
        if (
            conn_type.__module__.startswith("asyncpg")
            and hasattr(conn_type, "acquire")
            and not hasattr(conn_type, "is_in_transaction")
        ):
            return (
                "got an asyncpg pool; acquire a connection and write inside"
                " `async with conn.transaction():`"
            )
        return None

    def check(self, conn: Any) -> None:
        check_in_transaction(conn)

    async def execute(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        check_in_transaction(conn)
        await conn.execute(stmt.dollar, *params)

    async def fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        check_in_transaction(conn)
        return await conn.fetchval(stmt.dollar, *params)

    def joins(self, conn: Any) -> bool:
        # SQLAlchemy's asyncpg dialect begins lazily, on its first statement; once it
        # has, the raw connection's transaction is the session's.
        return bool(conn.is_in_transaction())

    async def run(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        await conn.execute(stmt.dollar, *params)

    async def run_fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        return await conn.fetchval(stmt.dollar, *params)
