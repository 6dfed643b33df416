"""Per-record and per-entry refusals, as Kinesis and EventBridge give them, through the relay.

moto never throttles nor refuses a single entry, so a scripted endpoint on loopback
(tests/support/aws_faults.py) answers boto3 as the services do under load: the verdicts
are read from real HTTP responses by the real clients.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest

from outboxkit import Event
from outboxkit.publishers.eventbridge import EventBridgePublisher
from outboxkit.publishers.kinesis import KinesisPublisher
from tests.support.aws_faults import ScriptedAws
from tests.support.relaying import count, rows, running_relay, wait_for, write_events


@pytest.fixture(autouse=True)
def credentials(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield


def _record_id(record: dict[str, Any]) -> str:
    return str(json.loads(base64.b64decode(record["Data"]))["id"])


async def test_a_throttled_kinesis_record_is_retried_without_an_attempt_and_its_key_waits(
    db_dsn: str,
) -> None:
    """The first PutRecords refuses a-1 (throttled): a-2 must not be sent before a-1 is in,
    b-1 goes through, and a-1's attempt is refunded (max_attempts=1 would dead-letter it)."""
    a1, a2, b1 = (
        Event(topic="orders", event_type="t", payload={"n": n}, key=k)
        for n, k in ((1, "a"), (2, "a"), (3, "b"))
    )
    accepted: list[str] = []
    throttled = {str(a1.event_id)}

    def answer(target: str, request: dict[str, Any]) -> dict[str, Any]:
        if target == "DescribeStreamSummary":
            return {"StreamDescriptionSummary": {"StreamStatus": "ACTIVE"}}
        replies = []
        for record in request["Records"]:
            event_id = _record_id(record)
            if event_id in throttled:
                throttled.discard(event_id)  # refused once
                replies.append(
                    {
                        "ErrorCode": "ProvisionedThroughputExceededException",
                        "ErrorMessage": "Rate exceeded for shard shardId-000000000000",
                    }
                )
            else:
                accepted.append(event_id)
                replies.append({"SequenceNumber": str(1000 + len(accepted)), "ShardId": "s-0"})
        return {"FailedRecordCount": sum("ErrorCode" in r for r in replies), "Records": replies}

    write_events(db_dsn, [a1, a2, b1])
    with ScriptedAws(answer) as aws:
        publisher = KinesisPublisher("orders", region="us-east-1", endpoint_url=aws.endpoint)
        async with running_relay(db_dsn, publisher, max_attempts=1) as relay:
            await wait_for(lambda: count(db_dsn) == 0, what="all three published")
        puts = [body for target, body in aws.requests if target == "PutRecords"]
    assert accepted == [str(b1.event_id), str(a1.event_id), str(a2.event_id)], accepted
    first_round = [_record_id(r) for r in puts[0]["Records"]]
    assert first_round == [str(a1.event_id), str(b1.event_id)], "a-2 waits for a-1"
    assert relay.stats.dead_lettered == 0, "throttling charged no attempt"
    assert relay.stats.released >= 2, "a-1 (throttled) and a-2 (held back) handed back"


async def test_eventbridge_retries_only_the_refused_entries_each_by_its_code(
    db_dsn: str,
) -> None:
    """One PutEvents: entry 1 in, 2 throttled, 3 an internal failure, 4 malformed. The retry
    carries 2 and 3 only; 4 is dead-lettered with its code; nothing is put twice."""
    events = [Event(topic="orders", event_type="t", payload={"n": n}) for n in range(4)]
    codes = {
        str(events[1].event_id): ("ThrottlingException", "Rate exceeded"),
        str(events[2].event_id): ("InternalFailure", "try again"),
        str(events[3].event_id): ("MalformedDetail", "Detail is malformed."),
    }
    refused_once: set[str] = set()

    def answer(target: str, request: dict[str, Any]) -> dict[str, Any]:
        if target == "DescribeEventBus":
            return {"Name": "orders", "Arn": "arn:aws:events:us-east-1:123456789012:event-bus/x"}
        replies = []
        for n, entry in enumerate(request["Entries"]):
            event_id = json.loads(entry["Detail"])["id"]
            code = codes.get(event_id)
            if code and (event_id not in refused_once or code[0] == "MalformedDetail"):
                refused_once.add(event_id)
                replies.append({"ErrorCode": code[0], "ErrorMessage": code[1]})
            else:
                replies.append({"EventId": f"eb-{len(aws.requests)}-{n}"})
        return {"FailedEntryCount": sum("ErrorCode" in r for r in replies), "Entries": replies}

    write_events(db_dsn, events)
    with ScriptedAws(answer) as aws:
        publisher = EventBridgePublisher("orders", region="us-east-1", endpoint_url=aws.endpoint)
        async with running_relay(db_dsn, publisher, max_attempts=3):
            await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="all settled")
        puts = [body for target, body in aws.requests if target == "PutEvents"]
    sent = [[json.loads(e["Detail"])["id"] for e in body["Entries"]] for body in puts]
    assert sent[0] == [str(e.event_id) for e in events]
    retried = {i for batch in sent[1:] for i in batch}
    assert retried == {str(events[1].event_id), str(events[2].event_id)}, sent
    [dead] = rows(db_dsn)
    assert dead["event_id"] == events[3].event_id and dead["status"] == 2
    assert dead["attempts"] == 1 and "MalformedDetail" in dead["last_error"]
