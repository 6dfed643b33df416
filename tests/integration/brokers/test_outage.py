"""The broker goes away mid-stream and comes back: nothing is lost, no attempt is burnt.

Events committed during the outage wait in the table; the relay hands the unsent ones
back without counting an attempt (so an outage dead-letters nothing) and drains the
backlog once the broker is back.
"""

from __future__ import annotations

import asyncio

import pytest

from outboxkit import Event
from outboxkit.publishers import from_url
from tests.integration.brokers.harness import BROKERS, IN_PROCESS, BrokerHarness
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events

# Outages judged by timeouts: run alone under xdist, so another test's load cannot trip them.
pytestmark = [
    pytest.mark.parametrize("broker", [*BROKERS, *IN_PROCESS], indirect=True),
    pytest.mark.exclusive,
]


async def test_broker_cut_mid_stream_and_restored_loses_nothing(
    db_dsn: str, broker: BrokerHarness
) -> None:
    await broker.open(cuttable=True)
    topic = await broker.destination()
    publisher = from_url(broker.publisher_url)
    events: list[Event] = []
    async with running_relay(
        db_dsn, publisher, batch_size=20, retry_base=0.2, retry_cap=1.0
    ) as relay:
        for wave in range(6):
            batch = make_events(topic, 25)
            write_events(db_dsn, batch)
            events += batch
            if wave == 2:
                await broker.cut()
            if wave == 3:  # written during the outage
                await wait_for(
                    lambda: count(db_dsn, "last_error IS NOT NULL") > 0,
                    timeout=30,
                    what=f"publishes failing while {broker.name} is cut",
                )
            await asyncio.sleep(0.1)
        assert count(db_dsn) > 0, "the backlog waits in the table"
        await broker.restore()
        await wait_for(lambda: count(db_dsn) == 0, timeout=60, what="backlog drained")
        assert relay.stats.released > 0, "handed back untried: the outage burns no attempt"
        assert relay.stats.dead_lettered == 0
    ids = [str(r.event_id) for r in await broker.received(topic, len(events))]
    assert set(ids) == {str(e.event_id) for e in events}, "nothing lost"
    if broker.dedups:
        assert len(ids) == len(events), f"{broker.name} absorbed every re-publish"
