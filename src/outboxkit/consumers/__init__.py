"""Consumer runners: receive from a broker, apply once through the inbox, acknowledge after commit.

One module per broker (``kafka``, ``nats``, ``rabbitmq``, ``redis``, ``sqs``),
imported on demand so a service needs only its own broker's client library.
"""

from outboxkit.consumers.base import ConsumerRunner, ConsumerStats, Handler, ReceivedEvent
from outboxkit.errors import EnvelopeError

__all__ = ["ConsumerRunner", "ConsumerStats", "EnvelopeError", "Handler", "ReceivedEvent"]
