"""Events (and task mode's enqueues) written with Django's COMMIT (psycopg 3): no round trip
of their own.

Django has no hook before its COMMIT (``on_commit`` runs after it). The one place that sends
it is the connection wrapper's ``_commit()``, which ``transaction.atomic()`` reaches for the
outermost block and every backend subclass (PostGIS, pools, instrumentation) inherits. The
first deferred write on a connection wraps that method on that wrapper instance (the class is
never touched), with ``_rollback()``, ``_savepoint()`` and ``_savepoint_rollback()``:

* ``put`` checks the event at once (a bad event fails there, not at COMMIT) and queues it;
  each savepoint taken records how long the queue was;
* rolling back to a savepoint (a nested ``atomic()`` that raised, ``savepoint_rollback``)
  drops the events queued since it was taken, as the database drops the rows written
  since; a rollback drops them all;
* the COMMIT goes out as ``Outbox.transaction()`` sends it: the INSERTs and the COMMIT in
  one libpq pipeline. If an INSERT fails, the server skips the COMMIT, the transaction is
  rolled back (the business change with it) and the error is raised from ``atomic()``.

Inside the block the events are not in the table yet (``WRITE_WITH_COMMIT: False`` writes each
``put`` at once, one round trip each, for code that reads them back before committing).
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg

from outboxkit.errors import InvalidEventError
from outboxkit.events import Event
from outboxkit.write import Outbox
from outboxkit.write.deferred import Pending, Writer, checked, write_with_commit
from outboxkit.write.storage import Check

_ATTRIBUTE = "_outboxkit_pending"


def defers(wrapper: Any) -> bool:
    """Whether the events can go with this connection's COMMIT.

    Not on psycopg2; not inside Django's ``TestCase``, whose transaction is rolled back,
    never committed: there each ``put`` inserts at once, so a test sees its events.
    """
    if not isinstance(wrapper.connection, psycopg.Connection):
        return False
    return not any(getattr(b, "_from_testcase", False) for b in wrapper.atomic_blocks)


def _check(outbox: Outbox) -> Check:
    def check(event: object) -> Event:
        if not isinstance(event, Event):
            raise InvalidEventError(
                f"expected an outboxkit.Event, got {type(event).__module__}."
                f"{type(event).__qualname__}"
            )
        event.check_size(outbox.max_payload_bytes, outbox.max_key_bytes)
        return event

    return check


def queue(wrapper: Any, outbox: Outbox, events: list[Event] | tuple[Event, ...] | Any) -> None:
    """Check ``events`` and queue them for ``wrapper``'s COMMIT (inside its atomic block)."""
    found = checked(events, _check(outbox))
    if not found:
        return
    _install(wrapper).add(wrapper.connection, outbox, found)


def queue_calls(wrapper: Any, writer: Writer, calls: list[Any]) -> None:
    """Queue already checked writes of another kind (task mode's enqueues) for the COMMIT,
    in the same queue as the events: one savepoint and rollback bookkeeping for both."""
    _install(wrapper).add(wrapper.connection, writer, calls)


def _install(wrapper: Any) -> Pending[Writer]:
    pending: Pending[Writer] | None = wrapper.__dict__.get(_ATTRIBUTE)
    if pending is not None:
        return pending
    pending = Pending()
    commit, rollback = wrapper._commit, wrapper._rollback
    savepoint, savepoint_rollback = wrapper._savepoint, wrapper._savepoint_rollback

    def _commit() -> Any:
        queued = pending.take(wrapper.connection)
        if not queued:
            return commit()
        try:
            with wrapper.wrap_database_errors:
                write_with_commit(wrapper.connection, queued)
        except BaseException:
            # Nothing committed. A failed INSERT left the transaction rolled back; Django
            # rolls back on its own errors only, so the hooks of this transaction go too.
            with contextlib.suppress(Exception):
                rollback()
            wrapper.run_on_commit = []
            raise
        return None

    def _rollback() -> Any:
        pending.take(None)
        return rollback()

    def _savepoint(sid: str) -> Any:
        pending.mark(sid)
        return savepoint(sid)

    def _savepoint_rollback(sid: str) -> Any:
        pending.roll_back_to(sid)
        return savepoint_rollback(sid)

    wrapper._commit = _commit
    wrapper._rollback = _rollback
    wrapper._savepoint = _savepoint
    wrapper._savepoint_rollback = _savepoint_rollback
    wrapper.__dict__[_ATTRIBUTE] = pending
    return pending
