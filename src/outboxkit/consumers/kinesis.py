"""Amazon Kinesis runner: each shard read in order, a checkpoint after the inbox commit.

Records of one partition key are on one shard in the order Kinesis accepted them, so
each shard is read by one task, record after record: a record is applied through the
inbox (one transaction with the handler's effect), and the shard's checkpoint (the last
applied sequence number, in a small table of the consumer's database,
``consumers.kinesis_sql``) is written after that commit, once per page of records. A
runner that dies between the two reads the record again and the inbox skips it.

Resharding: a shard closed by a split or a merge is read to its end and marked
finished; its children start only then (after both parents of a merge), so a key's
events stay in order across the reshard. A record that keeps failing holds its shard
(per-key order) for ``max_deliveries`` tries, then is logged and skipped
(``stats.dead_lettered``): Kinesis has no dead-letter queue of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from outboxkit.errors import EnvelopeError, missing_extra

try:
    import boto3
    import botocore.config
except ModuleNotFoundError as exc:  # one line naming the extra, not a traceback
    raise missing_extra(exc, "outboxkit.consumers.kinesis") from exc

from outboxkit._redact import redact
from outboxkit._text import describe
from outboxkit.consumers.base import ConsumerRunner, Handler, ReceivedEvent, unwrap
from outboxkit.consumers.kinesis_sql import DEFAULT_CHECKPOINT_TABLE, CheckpointStatements
from outboxkit.inbox import Inbox
from outboxkit.wire import kinesis as wire

log = logging.getLogger("outboxkit.consumer.kinesis")

_THROTTLED = {"ProvisionedThroughputExceededException", "LimitExceededException"}


def decode(stream: str, record: dict[str, Any]) -> ReceivedEvent:
    """The event in a Kinesis record as boto3's ``get_records`` returns it (``Data`` bytes)."""
    data = record.get("Data", b"")
    return unwrap(stream, lambda: wire.decode(bytes(data)))


class KinesisConsumer(ConsumerRunner):
    """Consumes every shard of one Kinesis stream, from the checkpoints (or the stream's start).

    ``start_at="TRIM_HORIZON"`` (default) reads a shard without a checkpoint from its
    oldest record, ``"LATEST"`` from now on. ``poll_interval`` paces reads of an idle
    shard (Kinesis allows five reads a second per shard); ``refresh_interval`` how
    often the shard list is read again (new shards after a reshard).
    """

    broker = "kinesis"

    def __init__(
        self,
        dsn: str,
        handler: Handler,
        *,
        consumer: str,
        stream: str,
        region: str | None = None,
        endpoint_url: str | None = None,
        inbox: Inbox | None = None,
        checkpoint_table: str = DEFAULT_CHECKPOINT_TABLE,
        start_at: str = "TRIM_HORIZON",
        max_deliveries: int = 5,
        retry_delay: float = 1.0,
        batch: int = 500,
        poll_interval: float = 1.0,
        refresh_interval: float = 10.0,
    ) -> None:
        super().__init__(
            dsn,
            handler,
            consumer=consumer,
            inbox=inbox,
            max_deliveries=max_deliveries,
            retry_delay=retry_delay,
        )
        if start_at not in ("TRIM_HORIZON", "LATEST"):
            raise ValueError("start_at must be 'TRIM_HORIZON' or 'LATEST'")
        self.stream = stream
        self.region = region
        self.endpoint_url = endpoint_url
        self.start_at = start_at
        self.batch = max(1, min(batch, 10_000))
        self.poll_interval = poll_interval
        self.refresh_interval = refresh_interval
        self._sql = CheckpointStatements(checkpoint_table)
        self._client: Any = None
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._finished: set[str] = set()

    async def run(self) -> None:
        """Read every shard until :meth:`stop`; a reader per open shard whose parents are done."""
        config = botocore.config.Config(
            connect_timeout=5, read_timeout=15, retries={"mode": "standard"}
        )
        self._client = boto3.session.Session().client(
            "kinesis", region_name=self.region, endpoint_url=self.endpoint_url, config=config
        )
        try:
            await self._execute(self._sql.create, ())
            while not self.stopping:
                try:
                    await self._start_readers()
                except Exception as exc:
                    log.warning(
                        "kinesis consumer %r: listing shards failed: %s",
                        self.consumer,
                        describe(exc),
                    )
                for task in [t for t in self._readers.values() if t.done()]:
                    if not task.cancelled() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                await self._sleep_or_stop(self.refresh_interval)
        finally:
            for task in self._readers.values():
                task.cancel()
            await asyncio.gather(*self._readers.values(), return_exceptions=True)
            client, self._client = self._client, None
            with contextlib.suppress(Exception):
                await asyncio.to_thread(client.close)
            await self._close_db()

    async def _start_readers(self) -> None:
        shards = await self._shards()
        known = {s["ShardId"] for s in shards}
        checkpoints = {
            row[0]: (row[1], bool(row[2]))
            for row in await self._fetch(self._sql.load, (self.consumer, self.stream))
        }
        self._finished |= {shard for shard, (_, done) in checkpoints.items() if done}
        for shard in shards:
            shard_id = shard["ShardId"]
            if shard_id in self._readers or shard_id in self._finished:
                continue
            parents = [shard.get("ParentShardId"), shard.get("AdjacentParentShardId")]
            # A parent still listed and not read to its end holds its child back
            # (a parent no longer listed has expired: nothing of it is left to read).
            if any(p and p in known and p not in self._finished for p in parents):
                continue
            sequence = checkpoints.get(shard_id, (None, False))[0]
            closed = "EndingSequenceNumber" in (shard.get("SequenceNumberRange") or {})
            self._readers[shard_id] = asyncio.create_task(
                self._read(shard_id, sequence, closed), name=f"kinesis-{shard_id}"
            )

    async def _shards(self) -> list[dict[str, Any]]:
        shards: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"StreamName": self.stream}
        while True:
            reply = await asyncio.to_thread(self._client.list_shards, **kwargs)
            shards += reply.get("Shards", [])
            token = reply.get("NextToken")
            if not token:
                return shards
            kwargs = {"NextToken": token}

    async def _iterator(self, shard_id: str, sequence: str | None) -> str:
        if sequence is None:
            kwargs: dict[str, Any] = {"ShardIteratorType": self.start_at}
        else:
            kwargs = {
                "ShardIteratorType": "AFTER_SEQUENCE_NUMBER",
                "StartingSequenceNumber": sequence,
            }
        reply = await asyncio.to_thread(
            self._client.get_shard_iterator, StreamName=self.stream, ShardId=shard_id, **kwargs
        )
        return str(reply["ShardIterator"])

    async def _read(self, shard_id: str, sequence: str | None, closed: bool) -> None:
        """One shard, record after record, until it is closed and read to its end.

        The end: no next iterator (Kinesis's word for it), or a shard listed as closed
        that answers an empty page with nothing behind it (a closed shard gets no more).
        """
        iterator: str | None = None
        next_check = time.monotonic() + self.refresh_interval
        while not self.stopping:
            try:
                if iterator is None:
                    iterator = await self._iterator(shard_id, sequence)
                reply = await asyncio.to_thread(
                    self._client.get_records, ShardIterator=iterator, Limit=self.batch
                )
            except Exception as exc:
                code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
                if code == "ExpiredIteratorException":
                    iterator = None
                    continue
                log.warning(
                    "kinesis consumer %r: reading shard %s failed: %s",
                    self.consumer,
                    shard_id,
                    describe(exc),
                )
                iterator = None
                await self._sleep_or_stop(self.poll_interval * (2 if code in _THROTTLED else 1))
                continue
            records = reply.get("Records", [])
            applied, complete = sequence, True
            for record in records:
                if not await self._handle(shard_id, record):
                    complete = False  # stopping: the rest is read again from the checkpoint
                    break
                applied = str(record["SequenceNumber"])
            if applied != sequence:
                sequence = applied
                await self._checkpoint(shard_id, sequence, finished=False)
            if not complete:
                return
            iterator = reply.get("NextShardIterator")
            at_end = closed and not records and reply.get("MillisBehindLatest", 0) == 0
            if iterator is None or at_end:
                # Closed by a reshard and read to its end: its children may start.
                if await self._checkpoint(shard_id, sequence, finished=True):
                    self._finished.add(shard_id)
                    return
                await self._sleep_or_stop(self.poll_interval)  # say so again
            if not records:
                await self._sleep_or_stop(self.poll_interval)
                if not closed and time.monotonic() >= next_check:
                    # It may have been closed by a reshard meanwhile (ListShards is rationed).
                    closed = await self._is_closed(shard_id)
                    next_check = time.monotonic() + self.refresh_interval

    async def _is_closed(self, shard_id: str) -> bool:
        with contextlib.suppress(Exception):
            for shard in await self._shards():
                if shard["ShardId"] == shard_id:
                    return "EndingSequenceNumber" in (shard.get("SequenceNumberRange") or {})
        return False

    async def _handle(self, shard_id: str, record: dict[str, Any]) -> bool:
        """Apply one record, retrying in place (its shard waits: per-key order); False if the
        runner is stopping before it was applied or given up."""
        try:
            event = decode(self.stream, record)
        except EnvelopeError as exc:
            self.stats.dead_lettered += 1
            log.error(
                "kinesis consumer %r: shard %s record %s skipped: %s",
                self.consumer,
                shard_id,
                record.get("SequenceNumber"),
                redact(str(exc)),
            )
            return True
        delivery = 1
        while True:
            if await self._apply(event):
                return True
            if not await self._database_answers():
                # The database, not the event, failed: wait for it without counting.
                await self._sleep_or_stop(self._backoff(delivery))
                if self.stopping:
                    return False
                continue
            if delivery >= self.max_deliveries:
                self.stats.dead_lettered += 1
                log.error(
                    "kinesis consumer %r: event %s (%s) failed %d deliveries; skipped",
                    self.consumer,
                    event.event_id,
                    event.event_type,
                    delivery,
                )
                return True
            await self._sleep_or_stop(self._backoff(delivery))
            if self.stopping:
                return False
            delivery += 1
            event = _redelivered(event, delivery)

    async def _checkpoint(self, shard_id: str, sequence: str | None, *, finished: bool) -> bool:
        """Record the shard's progress; a failure is logged (the records are read again, and
        the inbox skips them) and the next page tries again."""
        try:
            params = (self.consumer, self.stream, shard_id, sequence, finished)
            await self._execute(self._sql.save, params)
        except Exception as exc:
            log.warning(
                "kinesis consumer %r: checkpoint of shard %s failed: %s",
                self.consumer,
                shard_id,
                describe(exc),
            )
            return False
        return True

    async def _database_answers(self) -> bool:
        try:
            await self._fetch("SELECT 1", ())
        except Exception:
            return False
        return True

    async def _execute(self, statement: str, params: tuple[Any, ...]) -> None:
        async with self._db_lock:
            conn = await self._db.connection()
            async with conn.transaction():
                await conn.execute(statement, params)

    async def _fetch(self, statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        async with self._db_lock:
            conn = await self._db.connection()
            async with conn.transaction():
                cursor = await conn.execute(statement, params)
                return list(await cursor.fetchall())


def _redelivered(event: ReceivedEvent, delivery: int) -> ReceivedEvent:
    return dataclasses.replace(event, delivery_count=delivery)
