"""A relay killed after publishing a batch, before settling it, duplicates at most that batch.

The batch is re-published by the next relay: brokers that deduplicate by event id
(JetStream, Redis's dedup script, SQS FIFO) absorb it; every other broker shows at most
that batch twice. Nothing is lost either way.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from outboxkit.publishers import from_url
from outboxkit.testing import spawn_relay
from tests.integration.brokers.harness import BROKERS, DEDUP_VARIANTS, BrokerHarness
from tests.support.relay_crash import settles_stalled
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events

pytestmark = [
    pytest.mark.slow,
    pytest.mark.parametrize("broker", [*BROKERS, *DEDUP_VARIANTS], indirect=True),
]


async def test_relay_killed_after_publishing_a_batch_duplicates_at_most_that_batch(
    db_dsn: str, broker: BrokerHarness, tmp_path: Path
) -> None:
    await broker.open(cuttable=False)
    topic = await broker.destination()
    killed_batch = make_events(topic, 40)
    write_events(db_dsn, killed_batch)

    async def whole_batch_at_broker() -> bool:
        return await broker.published(topic) >= 40

    with settles_stalled(db_dsn):
        doomed = spawn_relay(
            db_dsn,
            broker.url,
            tmp_path / "relay-a.log",
            *("--relay-id", "relay-a", "--lease", "3", "--batch-size", "40"),
        )
        try:
            await wait_for(whole_batch_at_broker, timeout=30, what="relay-a publishes its batch")
            doomed.send_signal(signal.SIGKILL)
            assert doomed.wait(10) == -signal.SIGKILL
        finally:
            if doomed.poll() is None:
                doomed.kill()
    assert count(db_dsn, "claimed_by = 'relay-a'") == 40, "published, never settled"
    later = make_events(topic, 20)
    write_events(db_dsn, later)
    async with running_relay(db_dsn, from_url(broker.url)) as relay_b:
        await wait_for(lambda: count(db_dsn) == 0, timeout=40, what="relay-b drains")
    assert relay_b.stats.published == 60, "relay-b re-published the killed batch"
    ids = [str(r.event_id) for r in await broker.received(topic, 60)]
    assert set(ids) == {str(e.event_id) for e in killed_batch + later}, "nothing lost"
    duplicates = len(ids) - len(set(ids))
    if broker.dedups:
        assert duplicates == 0, f"{broker.name} absorbed every re-published duplicate"
    else:
        assert 0 < duplicates <= 40, "only the killed batch is published twice"
