"""A connection lost mid-batch charges no attempt to the messages the broker never judged.

The batch is sent into a link that holds every byte, then the link is cut: no message of
it was confirmed or refused. With ``max_attempts=1`` any attempt charged for that would
dead-letter a healthy event; each must instead be handed back and published once the
broker is back (issue 26, item 1: "never charge attempts to other messages for a
connection that one message broke").
"""

from __future__ import annotations

import asyncio

import pytest

from outboxkit.publishers import from_url
from tests.integration.brokers.harness import BROKERS, BrokerHarness
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events

PAUSABLE = [name for name, harness in BROKERS.items() if harness.pausable]


@pytest.mark.parametrize("broker", PAUSABLE, indirect=True)
async def test_a_batch_in_flight_when_the_link_drops_is_handed_back_not_charged(
    db_dsn: str, broker: BrokerHarness
) -> None:
    await broker.open(cuttable=True)
    topic = await broker.destination()
    warm_up, events = make_events(topic, 1), make_events(topic, 30)
    write_events(db_dsn, warm_up)
    # The broker's own timeouts (10 s), under the relay's publish deadline (0.8 x lease):
    # the link is cut while every message waits for its confirmation.
    publisher = from_url(broker.url)
    async with running_relay(db_dsn, publisher, max_attempts=1, lease=30.0) as relay:
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="connected and publishing")
        await broker.pause()
        write_events(db_dsn, events)
        await wait_for(
            lambda: count(db_dsn, "attempts >= 1") == len(events), what="the batch claimed"
        )
        await asyncio.sleep(0.5)  # sent into the held link
        await broker.cut()
        await asyncio.sleep(0.5)
        await broker.restore()
        await wait_for(lambda: count(db_dsn) == 0, timeout=60, what="the batch published")
        assert relay.stats.dead_lettered == 0, "no attempt charged for the lost connection"
    got = {r.event_id for r in await broker.received(topic, len(events) + 1)}
    assert got >= {e.event_id for e in events}, "every event on the broker"
