"""The write side: ``Outbox`` appends events inside the caller's own transaction.

``outbox``: the ``Outbox`` and its ``put``/``put_many``/``execute_with`` families;
``commit``: ``Outbox.transaction()``, the events sent with the COMMIT; ``wal`` and
``wal_envelope``: ``Outbox(storage="wal")``, each event a logical message, no row.
"""

from outboxkit.write.commit import AsyncOutboxTransaction, OutboxTransaction
from outboxkit.write.outbox import Outbox

__all__ = ["AsyncOutboxTransaction", "Outbox", "OutboxTransaction"]
