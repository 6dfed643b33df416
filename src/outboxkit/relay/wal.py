"""``Relay(source="cdc")``: the WAL relay (outboxkit.cdc.relay) behind the Relay's API.

It shares the Relay's options, stats, observers and outage log (metrics, /readyz and the
summary log see it as they see the polling relay). Its modules are imported when one is
built: ``import outboxkit`` does not load the WAL relay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outboxkit.backends.postgres._connection import check_database
from outboxkit.relay.status import CdcStatus, RelayStatus

if TYPE_CHECKING:
    from outboxkit.cdc.relay import CdcRelay
    from outboxkit.relay.engine import Relay


class WalSource:
    """Streams the outbox's replication slot (``slot``, default ``outboxkit_<table>``)."""

    def __init__(self, relay: Relay, slot: str | None) -> None:
        from outboxkit.cdc.relay import CdcRelay

        self.relay = relay
        self.cdc: CdcRelay = CdcRelay(
            relay.dsn,
            relay.publisher,
            table=relay.table,
            slot=slot,
            batch_size=relay.batch_size,
            max_attempts=relay.max_attempts,
            retry_base=relay.retry_base,
            retry_cap=relay.retry_cap,
            publish_timeout=relay.publish_timeout,
            relay_id=relay.relay_id,
            pooler=relay.pooler,
            observer=relay.observer,
            stats=relay.stats,
            outage=relay.outage,
        )

    def stop(self) -> None:
        self.cdc.stop()

    @property
    def stopping(self) -> bool:
        return self.cdc.stopping

    async def run(self) -> None:
        # A database that refuses us for good stops the start in one line; an unreachable
        # server is left to the stream's own reconnects.
        relay = self.relay
        await check_database(relay.dsn, application_name=f"{relay.relay_id}:check"[:63])
        await self.cdc.run()

    def status(self) -> RelayStatus:
        cdc = self.cdc
        return RelayStatus(
            stream_down=cdc.stream_down(),
            cdc=CdcStatus(
                cdc.slot, cdc.streaming, cdc.standby, cdc.confirmed_lsn, cdc.lag_seconds()
            ),
        )
