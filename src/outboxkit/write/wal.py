"""``Outbox(storage="wal")``: each event is a transactional logical message, not a row.

The outbox chooses this object in ``__init__``; its ``put``/``aput`` families send the
statement and parameters built here through the same driver adapters (so the same
refusals outside a transaction), and ``transaction()`` emits the messages in its COMMIT's
pipeline (``outboxkit.write.commit``). The statements live in ``store.wal_sql``, the envelope
format in ``outboxkit.write.wal_envelope``.

``execute_with`` rides in the caller's statement as a data-modifying CTE, as in the
table mode: a ``SELECT pg_logical_emit_message(...)`` CTE that nothing references would
never run, so the messages are emitted by the filter of an INSERT that inserts nothing
(``store.wal_sql``, ``ATTACHED_ONE``): exactly once, with no round trip of its own. It
names the outbox table, which must exist (migrated; nothing is written to it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

from outboxkit.drivers import Statement
from outboxkit.events import Event
from outboxkit.limits import MAX_BATCH_EVENTS, too_many_events
from outboxkit.store.postgres import numbered
from outboxkit.store.wal_sql import WalStatements
from outboxkit.write.wal_envelope import encode_envelope

_Check = Callable[[object], Event]
_Prepared = tuple[Statement, list[Any]]


def _statement(text: str) -> Statement:
    return Statement(text, numbered(text))


class WalWrite:
    """The statements and parameters of one WAL outbox's writes."""

    __slots__ = ("_many", "_one", "channel", "notify", "sql")

    def __init__(self, table: str, *, notify: bool) -> None:
        self.sql = sql = WalStatements(table)
        self.notify = notify
        self.channel = sql.channel
        if notify:
            self._one = _statement(sql.emit_one_notify)
            self._many = _statement(sql.emit_many_notify)
        else:
            self._one = _statement(sql.emit_one)
            self._many = _statement(sql.emit_many)

    @property
    def prefix(self) -> str:
        return self.sql.prefix

    def one(self, event: Event) -> _Prepared:
        """The statement and parameters that emit the checked ``event``."""
        if self.notify:
            return self._one, [encode_envelope(event), self.channel]
        return self._one, [encode_envelope(event)]

    def many(self, events: Iterable[Event], check: _Check) -> _Prepared | None:
        """One statement for ``events`` (each checked; at most a batch), None for none."""
        envelopes = self._envelopes(events, check)
        if not envelopes:
            return None
        if len(envelopes) == 1:  # the cheaper statement: no array to build and unnest
            return self._one, [envelopes[0], self.channel] if self.notify else envelopes
        if self.notify:
            return self._many, [self.channel, envelopes]  # NOTIFY_MANY's order
        return self._many, [envelopes]

    def _envelopes(self, events: Iterable[Event], check: _Check) -> list[bytes]:
        envelopes = [encode_envelope(check(e)) for e in islice(events, MAX_BATCH_EVENTS + 1)]
        if len(envelopes) > MAX_BATCH_EVENTS:
            raise too_many_events()
        return envelopes

    def attached(self, events: Iterable[Event], check: _Check) -> tuple[str, list[Any]] | None:
        """The CTE (``%s`` style) and parameters that emit ``events`` in the caller's statement."""
        envelopes = self._envelopes(events, check)
        if not envelopes:
            return None
        sql = self.sql
        event_params: list[Any] = envelopes if len(envelopes) == 1 else [envelopes]
        if self.notify:
            event_params.append(self.channel)
            cte = sql.attached_one_notify if len(envelopes) == 1 else sql.attached_many_notify
        else:
            cte = sql.attached_one if len(envelopes) == 1 else sql.attached_many
        return cte, event_params
