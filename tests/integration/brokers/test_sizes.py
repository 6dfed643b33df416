"""An event too large for its broker is dead-lettered alone, before it is sent.

Each broker has a limit for a whole message (payload, key and headers as encoded on the
wire). Sent anyway, an oversized message fails on every try, and on some brokers takes its
connection with it (NATS closes it over ``max_payload``, failing the PubAcks of every
neighbour in flight): healthy events were retried and dead-lettered for a cause that was
never theirs (issue 26, item 1). Each neighbour must arrive, checked on the broker.
"""

from __future__ import annotations

from typing import Any

import pytest

from outboxkit import Event
from outboxkit.publishers import from_url
from outboxkit.publishers.base import Publisher, unreachable
from tests.integration.brokers.harness import BROKERS, IN_PROCESS, BrokerHarness
from tests.support.relaying import count, make_events, rows, running_relay, wait_for, write_events

ONE_MIB = 1024 * 1024


def _json_of(size: int) -> bytes:
    """A JSON document (one string) of exactly ``size`` bytes: the largest ``Event()`` takes."""
    return b'"' + b"x" * (size - 2) + b'"'


def _never_lost_its_broker(publisher: Publisher) -> bool:
    """The publisher's client never reported its link down (a dropped NATS connection would)."""
    reach: Any = getattr(publisher, "reachability", None)
    return reach is None or (reach.restored_at is None and unreachable(publisher) is None)


async def _publish_one_big_among_healthy(
    db_dsn: str, broker: BrokerHarness, big_payload: bytes, url: str
) -> tuple[Event, list[Event], Publisher, Any]:
    topic = await broker.destination()
    healthy = make_events(topic, 40)
    big = Event(topic=topic, event_type="file.stored", payload=big_payload, key="customer-1")
    events = [*healthy[:20], big, *healthy[20:]]
    write_events(db_dsn, events)
    publisher = from_url(url)
    async with running_relay(db_dsn, publisher) as relay:
        await wait_for(
            lambda: count(db_dsn, "status = 0") == 0, timeout=60, what="every event settled"
        )
    return big, healthy, publisher, relay


@pytest.mark.parametrize("broker", [*BROKERS, *IN_PROCESS], indirect=True)
async def test_a_1_mib_event_among_healthy_ones_hurts_only_itself(
    db_dsn: str, broker: BrokerHarness
) -> None:
    await broker.open(cuttable=False)
    big, healthy, publisher, relay = await _publish_one_big_among_healthy(
        db_dsn,
        broker,
        _json_of(ONE_MIB),
        broker.url,  # the broker's defaults
    )
    if broker.default_limit is None:  # it fits: it arrives whole
        assert count(db_dsn) == 0, "every event published"
        expected = [*healthy, big]
    else:
        [dead] = rows(db_dsn)
        assert dead["event_id"] == big.event_id, "only the big event is dead-lettered"
        assert (dead["status"], dead["attempts"]) == (2, 1), "dead-lettered at once"
        error = dead["last_error"]
        assert broker.default_limit in error, error
        assert "message is" in error and "bytes" in error, error
        expected = healthy
    assert relay.stats.released == 0, "nothing handed back: no connection was lost"
    assert _never_lost_its_broker(publisher), "the big event did not break the connection"
    topic = healthy[0].topic
    got = {r.event_id: r for r in await broker.received(topic, len(expected))}
    assert set(got) == {e.event_id for e in expected}, "every healthy event is on the broker"
    if big.event_id in got:
        assert got[big.event_id].payload == big.payload, "the big event arrived whole"


SMALL = [name for name, harness in BROKERS.items() if harness.small_limit]


@pytest.mark.parametrize("broker", SMALL, indirect=True)
async def test_an_event_over_a_lowered_limit_is_dead_lettered_alone_naming_it(
    db_dsn: str, broker: BrokerHarness
) -> None:
    await broker.open(cuttable=False)
    assert broker.small_limit is not None
    option, name = broker.small_limit
    url = broker.url + ("&" if "?" in broker.url else "?") + option
    big, healthy, _, relay = await _publish_one_big_among_healthy(
        db_dsn, broker, _json_of(8 * 1024), url
    )
    [dead] = rows(db_dsn)
    assert dead["event_id"] == big.event_id
    assert (dead["status"], dead["attempts"]) == (2, 1), "dead-lettered at once"
    assert name in dead["last_error"] and "4 096" in dead["last_error"], dead["last_error"]
    assert relay.stats.released == 0
    got = await broker.received(healthy[0].topic, len(healthy))
    assert sorted(str(r.event_id) for r in got) == sorted(str(e.event_id) for e in healthy)
