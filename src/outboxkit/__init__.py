"""outboxkit: the transactional outbox for Python.

Write events in the same transaction as your business change with
:class:`Outbox`; publish them with at-least-once delivery with :class:`Relay`.
"""

from outboxkit._version import __version__
from outboxkit.consumers import ConsumerRunner, ConsumerStats, Handler, ReceivedEvent
from outboxkit.errors import (
    CdcError,
    CdcSetupError,
    ConfigurationError,
    EnvelopeError,
    InvalidEventError,
    InvalidTaskError,
    LeaseLost,
    MissingExtraError,
    NotInTransactionError,
    OutboxkitError,
    PgoutputError,
    ReplicationConnectionLost,
    ReplicationError,
    ResultError,
    SchemaError,
    SlotInUse,
    SlotInvalidated,
    SlotNotFound,
    StoreDenied,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    TableNotFoundError,
    TaskNotFound,
    TransactionConflictError,
    UndecodableRow,
    WalEnvelopeError,
)
from outboxkit.events import Event
from outboxkit.inbox import Inbox
from outboxkit.migrations import migrate, migrate_inbox
from outboxkit.publishers import OutboundMessage, Publisher, PublishResult, from_url
from outboxkit.publishers.base import Reachability
from outboxkit.publishers.routing import Destinations, Route, RoutingPublisher, with_routes
from outboxkit.relay import Relay, RelayObserver, RelayStats
from outboxkit.write import AsyncOutboxTransaction, Outbox, OutboxTransaction

# What applications import. Broker publishers and consumer runners live in their own
# modules (outboxkit.publishers.kafka, outboxkit.consumers.nats ...): importing the
# package never imports a broker client.
__all__ = [
    "AsyncOutboxTransaction",
    "CdcError",
    "CdcSetupError",
    "ConfigurationError",
    "ConsumerRunner",
    "ConsumerStats",
    "Destinations",
    "EnvelopeError",
    "Event",
    "Handler",
    "Inbox",
    "InvalidEventError",
    "InvalidTaskError",
    "LeaseLost",
    "MissingExtraError",
    "NotInTransactionError",
    "OutboundMessage",
    "Outbox",
    "OutboxTransaction",
    "OutboxkitError",
    "PgoutputError",
    "PublishResult",
    "Publisher",
    "Reachability",
    "ReceivedEvent",
    "Relay",
    "RelayObserver",
    "RelayStats",
    "ReplicationConnectionLost",
    "ReplicationError",
    "ResultError",
    "Route",
    "RoutingPublisher",
    "SchemaError",
    "SlotInUse",
    "SlotInvalidated",
    "SlotNotFound",
    "StoreDenied",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "TableNotFoundError",
    "TaskNotFound",
    "TransactionConflictError",
    "UndecodableRow",
    "WalEnvelopeError",
    "__version__",
    "from_url",
    "migrate",
    "migrate_inbox",
    "with_routes",
]
