"""Ordered mode's pure parts: waves within a batch, the partition assignment, the SQL shape."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from outboxkit.backends.postgres.ordered_sql import OrderedStatements
from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.queue.partition_leases import assignment
from outboxkit.relay.ordered import waves


def _msg(key: str | None) -> OutboundMessage:
    return OutboundMessage(
        uuid.uuid4(), "t", key, "e", None, None, b"", {}, dt.datetime.now(dt.UTC)
    )


def test_waves_take_each_keys_events_one_per_wave_and_keyless_ones_first() -> None:
    keys = ["a", "b", "a", None, "a", "c", "b", None]
    assert waves([_msg(k) for k in keys]) == [[0, 1, 3, 5, 7], [2, 6], [4]]


def test_waves_of_distinct_keys_are_one_wave() -> None:
    assert waves([_msg(f"k{i}") for i in range(5)]) == [[0, 1, 2, 3, 4]]
    assert waves([]) == []


def test_every_partition_has_exactly_one_desired_owner_whoever_computes_it() -> None:
    members = ["r3", "r1", "r2"]
    shares = [assignment(members, me, 64) for me in members]
    assert sorted(p for share in shares for p in share) == list(range(64))
    assert sorted(len(s) for s in shares) == [21, 21, 22]
    # a relay not yet seen in the list counts itself in
    assert assignment([], "solo", 8) == frozenset(range(8))


def test_the_ordered_settles_are_fenced_by_token_and_partition_lease() -> None:
    sql = OrderedStatements("shop.outbox")
    for base, fenced in OrderedStatements.FENCED:
        text = getattr(sql, fenced)
        assert "claim_token = %s" in text and '"shop"."outbox_partitions"' in text, base
        assert "l.owner = o.claimed_by AND l.expires_at > now()" in text
        # same positional parameters as the statement it replaces
        assert text.count("%s") == getattr(sql, base).count("%s"), base
    assert "FOR UPDATE OF o SKIP LOCKED" in sql.ordered_claim
    assert "%(max_attempts)s" in sql.claim_batch and "%(max_attempts)s" in sql.ordered_claim


def test_kafka_in_ordered_mode_bounds_delivery_and_refuses_a_reordering_producer() -> None:
    publisher = KafkaPublisher.from_url("kafka://127.0.0.1:9092")
    assert publisher.bound_delivery_time(7.5) == 7.5
    assert publisher._config["delivery.timeout.ms"] == 7500
    assert publisher.bound_delivery_time(60.0) == 7.5  # never raised again
    loose = KafkaPublisher.from_url("kafka://127.0.0.1:9092?enable.idempotence=false")
    with pytest.raises(ConfigurationError, match="idempotent"):
        loose.bound_delivery_time(5.0)


def test_the_metrics_show_the_partitions_an_ordered_relay_holds() -> None:
    from types import SimpleNamespace

    from outboxkit.ops.metrics import RelayMetrics
    from outboxkit.relay.status import RelayStatus

    metrics = RelayMetrics("postgresql://unused", process_metrics=False)
    assert metrics.registry.get_sample_value("outboxkit_partitions_owned") is None
    status = RelayStatus(partitions_owned=5)
    metrics.attach(SimpleNamespace(relay_id="r1", publisher=None, status=lambda: status))
    assert metrics.registry.get_sample_value("outboxkit_partitions_owned") == 5
