"""outboxkit: the transactional outbox for Python.

Write events in the same transaction as your business change with
:class:`Outbox`; publish them with at-least-once delivery with :class:`Relay`.
"""

from outboxkit.commit import OutboxTransaction
from outboxkit.errors import (
    ConfigurationError,
    InvalidEventError,
    NotInTransactionError,
    OutboxkitError,
    SchemaError,
)
from outboxkit.events import Event
from outboxkit.inbox import Inbox
from outboxkit.publishers import OutboundMessage, Publisher, PublishResult, from_url
from outboxkit.relay import Relay, RelayStats
from outboxkit.store.inbox_sql import migrate_inbox
from outboxkit.store.migrate import migrate
from outboxkit.write import Outbox

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "Event",
    "Inbox",
    "InvalidEventError",
    "NotInTransactionError",
    "OutboundMessage",
    "Outbox",
    "OutboxTransaction",
    "OutboxkitError",
    "PublishResult",
    "Publisher",
    "Relay",
    "RelayStats",
    "SchemaError",
    "__version__",
    "from_url",
    "migrate",
    "migrate_inbox",
]
