"""The publisher as the queue core's sink, and the relay's per-event failure log lines.

:func:`publish` is the one way both relays (the polling one and the WAL one) hand a batch
to a publisher: bounded by a timeout, every exception turned into a result per message.
:class:`FailureLog` writes the one dead-letter line (and the DEBUG line of a retry);
:func:`close_publisher` and :func:`log_stopped` are both relays' stop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

from outboxkit._redact import redact
from outboxkit.publishers.base import (
    OutboundMessage,
    Publisher,
    PublishResult,
    restored_since,
    unreachable,
)
from outboxkit.sink.observer import Failure, RelayObserver, RelayStats

log = logging.getLogger("outboxkit.relay")


async def publish(
    publisher: Publisher, messages: Sequence[OutboundMessage], within: float
) -> Sequence[PublishResult]:
    """Publish ``messages`` within ``within`` seconds: one result each, never an exception."""
    try:
        results = await asyncio.wait_for(publisher.publish_batch(messages), timeout=within)
    except TimeoutError:
        error = f"publish not confirmed within {within:.1f}s"
        return [PublishResult.retry(error, "publish_timeout")] * len(messages)
    except (ConnectionError, OSError) as exc:  # TimeoutError was caught above
        # The broker was never reached: nothing about these messages was judged.
        error = redact(f"{type(exc).__name__}: {exc}")
        return [PublishResult.hand_back(error, type(exc).__name__)] * len(messages)
    except Exception as exc:
        error = redact(f"{type(exc).__name__}: {exc}")
        return [PublishResult.retry(error, type(exc).__name__)] * len(messages)
    if len(results) != len(messages):
        error = f"publisher returned {len(results)} results for {len(messages)} messages"
        return [PublishResult.retry(error, "publisher_bug")] * len(messages)
    return results


async def close_publisher(publisher: Publisher) -> None:
    """Close ``publisher`` at a relay's stop; a failure is one WARNING, never raised (the
    relay's own outcome is what its caller needs to see)."""
    try:
        await publisher.close()
    except Exception as exc:
        log.warning(
            "publisher %s did not close cleanly: %s",
            publisher.name,
            redact(f"{type(exc).__name__}: {exc}"),
        )


def log_stopped(who: str, stats: RelayStats, *, released: bool) -> None:
    """The relay's last line: what it did since its start (``released``: leases it handed
    back are counted too; the WAL relay holds none)."""
    line = "%s stopped: published=%d retried=%d dead_lettered=%d"
    counts = [stats.published, stats.retried, stats.dead_lettered]
    if released:
        line += " released=%d"
        counts.append(stats.released)
    log.info(line, who, *counts)


class PublisherSink:
    """A :class:`Publisher` as the claim loop's sink (outboxkit.queue.loop.Sink)."""

    def __init__(self, publisher: Publisher, timeout: float) -> None:
        self.publisher = publisher
        self.timeout = timeout

    @property
    def name(self) -> str:
        return self.publisher.name

    async def publish(self, messages: Sequence[OutboundMessage]) -> Sequence[PublishResult]:
        return await publish(self.publisher, messages, self.timeout)

    async def process(
        self, token: uuid.UUID, items: Sequence[OutboundMessage]
    ) -> Sequence[PublishResult]:
        return await publish(self.publisher, items, self.timeout)

    def target_down(self) -> bool:
        # A retryable failure while the publisher's client reports the broker unreachable
        # (librdkafka's all-brokers-down, a lost NATS connection) is the outage's, not the
        # message's: handed back like a publish that was never tried.
        return unreachable(self.publisher) is not None

    def restored_since(self, when: float) -> bool:
        return restored_since(self.publisher, when)

    def dead_outcome(self, error: str, error_class: str) -> PublishResult:
        return PublishResult.permanent(error, error_class)


class FailureLog(RelayObserver):
    """Every dead letter one ERROR line (and each retry a DEBUG line): ids are greppable.

    The outage itself is a WARNING of sink/outage.py, not a line per event.
    """

    def settled(
        self,
        published: Sequence[OutboundMessage],
        retried: Sequence[Failure],
        dead: Sequence[Failure],
    ) -> None:
        for message, res in retried if log.isEnabledFor(logging.DEBUG) else ():
            log.debug(
                "publish failed, will retry: topic=%s event_id=%s attempt=%d"
                " error_class=%s error=%s",
                message.topic,
                message.event_id,
                message.attempt,
                res.error_class,
                redact(res.error or ""),
                extra=_fields(message, res),
            )
        for message, res in dead:
            dead_letter_line(message, res.error_class, res.error)


def dead_letter_line(message: OutboundMessage, error_class: str, error: str | None) -> None:
    """The one log line of a dead letter (the relay's settles, the claim's guard, the WAL relay)."""
    log.error(
        "event dead-lettered after %d attempt(s): topic=%s event_id=%s error_class=%s error=%s",
        message.attempt,
        message.topic,
        message.event_id,
        error_class,
        redact(error or ""),
        extra={
            "topic": message.topic,
            "event_id": str(message.event_id),
            "attempt": message.attempt,
            "error_class": error_class,
        },
    )


def _fields(message: OutboundMessage, res: PublishResult) -> dict[str, object]:
    return {
        "topic": message.topic,
        "event_id": str(message.event_id),
        "attempt": message.attempt,
        "error_class": res.error_class,
    }
