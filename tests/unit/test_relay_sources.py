"""A Relay builds only what its source runs: the claim loop or the replication stream."""

from __future__ import annotations

from typing import Any

import pytest

from outboxkit import Relay, from_url
from outboxkit.relay.status import RelayStatus

DSN = "postgresql://app@127.0.0.1:1/shop"


def test_a_cdc_relay_builds_no_claim_loop_and_no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``source="cdc"`` built a queue store, a sink and a claim loop it never ran."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the WAL relay built a claim-side object")

    import outboxkit.relay.polling as polling
    from outboxkit.backends.postgres.backend import PostgresBackend

    monkeypatch.setattr(PostgresBackend, "queue_store", refuse)
    for name in ("ClaimLoop", "PublisherSink"):
        monkeypatch.setattr(polling, name, refuse)
    relay = Relay(DSN, from_url("nats://127.0.0.1:1"), source="cdc", slot="s1")
    assert relay.cdc is not None and relay.cdc.slot == "s1"
    assert relay.cdc.stats is relay.stats  # metrics and /readyz read the same counters
    status = relay.status()
    assert status.cdc is not None and status.cdc.slot == "s1" and status.denied is None
    assert relay.partitions_owned is None
    relay.stop()
    assert relay.stopping


def test_a_polling_relay_builds_no_wal_relay() -> None:
    relay = Relay(DSN, from_url("nats://127.0.0.1:1"))
    assert relay.cdc is None
    assert relay.status() == RelayStatus()
    relay.stop()
    assert relay.stopping
