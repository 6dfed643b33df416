"""``outbox`` and ``inbox``: the library's Outbox and Inbox on Django's connections.

On Django's psycopg 3 backend the events ride with the COMMIT of the outermost
``transaction.atomic()`` block, as ``Outbox.transaction()`` sends them: no round trip of
their own (``deferred.py`` says how). Elsewhere (psycopg2, i.e. Django < 4.2, or
``WRITE_WITH_COMMIT: False``) each write is one INSERT in the block, on the driver
connection underneath Django's. docs/django.md gives the measured cost of both.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from outboxkit.contrib.django import conf, deferred
from outboxkit.contrib.django.db import atomic_connection
from outboxkit.events import Event
from outboxkit.inbox import Inbox
from outboxkit.write import Outbox


class DjangoOutbox:
    """The outbox ``settings.OUTBOXKIT`` describes, written through Django's connections::

    with transaction.atomic():
        order = Order.objects.create(...)
        outbox.put(Event(topic="orders", event_type="order.placed", payload=...))
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outbox: Outbox | None = None
        self._with_commit = True
        conf._on_reset.append(self._forget)

    def _forget(self) -> None:
        self._outbox = None

    @property
    def outbox(self) -> Outbox:
        """The library's :class:`~outboxkit.Outbox`, built from the settings on first use."""
        found = self._outbox
        if found is None:
            with self._lock:
                if self._outbox is None:
                    c = conf.get()
                    self._with_commit = c.WRITE_WITH_COMMIT
                    self._outbox = Outbox(
                        c.TABLE,
                        notify=c.NOTIFY,
                        ordered=c.ORDERED,
                        storage=c.STORAGE,
                        max_payload_bytes=c.MAX_PAYLOAD_BYTES,
                        max_key_bytes=c.MAX_KEY_BYTES,
                    )
                found = self._outbox
        return found

    def put(self, event: Event, *, using: str | None = None) -> None:
        """Append ``event`` in the open ``transaction.atomic()`` block of database ``using``.

        Checked now; on psycopg 3 written with the block's COMMIT (not visible before it).
        """
        ob = self.outbox
        conn = atomic_connection(using, "write an outbox event")
        if self._with_commit and deferred.defers(conn):
            deferred.queue(conn, ob, (event,))
            return
        with conn.wrap_database_errors:
            ob.put(conn.connection, event)

    def put_many(self, events: Iterable[Event], *, using: str | None = None) -> None:
        """Append ``events`` (at most 10 000) in one statement, in the open atomic block."""
        ob = self.outbox
        conn = atomic_connection(using, "write outbox events")
        if self._with_commit and deferred.defers(conn):
            deferred.queue(conn, ob, events)
            return
        with conn.wrap_database_errors:
            ob.put_many(conn.connection, events)

    def __repr__(self) -> str:
        return f"<outboxkit.contrib.django outbox {conf.get().TABLE!r}>"


class DjangoInbox:
    """The inbox (``settings.OUTBOXKIT['INBOX_TABLE']``) in a Django consumer's transaction::

        with transaction.atomic(), inbox.handle("billing", event.event_id) as fresh:
            if fresh:
                Invoice.objects.create(...)  # once per event, committed with the record

    An exception in the block leaves ``atomic()`` and rolls the record back with the effect,
    so the redelivered event is applied.
    """

    def __init__(self) -> None:
        self._inbox: Inbox | None = None
        conf._on_reset.append(self._forget)

    def _forget(self) -> None:
        self._inbox = None

    @property
    def inbox(self) -> Inbox:
        found = self._inbox
        if found is None:
            table = conf.get().INBOX_TABLE
            if table is None:
                from outboxkit.errors import ConfigurationError

                raise ConfigurationError(
                    "settings.OUTBOXKIT['INBOX_TABLE'] is None: set it to the inbox table"
                    " (the app's migrations create it) to use the inbox"
                )
            found = self._inbox = Inbox(table)
        return found

    @contextmanager
    def handle(
        self, consumer: str, event_id: uuid.UUID | str, *, using: str | None = None
    ) -> Iterator[bool]:
        """Record the event for ``consumer``; yields True if it is new (apply it), else False."""
        yield self.mark(consumer, event_id, using=using)

    def mark(self, consumer: str, event_id: uuid.UUID | str, *, using: str | None = None) -> bool:
        """Insert the record in the open atomic block; True if it was not there yet."""
        ib = self.inbox
        conn = atomic_connection(using, "use the inbox")
        with conn.wrap_database_errors:
            return ib.mark(conn.connection, consumer, event_id)

    def seen(self, consumer: str, event_id: uuid.UUID | str, *, using: str | None = None) -> bool:
        """Whether ``consumer`` already processed the event (committed, or in this block)."""
        ib = self.inbox
        conn = atomic_connection(using, "use the inbox")
        with conn.wrap_database_errors:
            return ib.seen(conn.connection, consumer, event_id)
