"""After a broker outage the backlog drains at once, not after the outage's growing backoff.

Before (issue 26, item 7): events handed back while NATS was down kept the delay that paced
their retries (up to ``retry_cap``, 300 s by default), so after a 20 s outage a 3 000-event
backlog took 44 to 124 s to drain. Now the relay makes what it handed back due as soon as
the publisher reports the broker back.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from outboxkit.publishers.nats import NatsPublisher
from outboxkit.testing import EmbeddedNats
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events
from tests.support.servers import consume_nats, ensure_stream

BACKLOG = 3000
OUTAGE = 15.0  # long enough for the outage backoff to reach tens of seconds


async def test_a_backlog_handed_back_during_a_nats_outage_drains_within_seconds_of_its_return(
    db_dsn: str, fresh_nats: EmbeddedNats
) -> None:
    suffix = uuid.uuid4().hex[:8]
    stream, subject = f"RECOVER{suffix.upper()}", f"recover{suffix}.orders"
    await ensure_stream(fresh_nats.url, stream, [f"recover{suffix}.>"])
    publisher = NatsPublisher.from_url(f"{fresh_nats.url}?stream={stream}&timeout=1")
    # The relay's defaults for the retry schedule: the outage's pacing grows towards 300 s.
    async with running_relay(db_dsn, publisher, retry_base=1.0, retry_cap=300.0):
        write_events(db_dsn, make_events(subject, 10))
        await wait_for(lambda: count(db_dsn) == 0, what="the first events to be published")
        fresh_nats.stop()
        write_events(db_dsn, make_events(subject, BACKLOG))
        await asyncio.sleep(OUTAGE)
        assert count(db_dsn, "status = 2") == 0, "an outage dead-letters nothing"
        fresh_nats.start()
        back = time.monotonic()
        await wait_for(lambda: count(db_dsn) == 0, timeout=60, what="the backlog to drain")
        drained = time.monotonic() - back
    messages = await consume_nats(fresh_nats.url, stream, subject, BACKLOG + 10)
    assert len({m.headers["Nats-Msg-Id"] for m in messages}) == BACKLOG + 10
    # The client reconnects within its reconnect wait (2 s), then the relay hastens the
    # handed-back rows at its next look (a poll interval at most) and drains them.
    assert drained < 8.0, f"the backlog took {drained:.1f}s to drain after the broker returned"
