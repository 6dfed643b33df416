"""The AWS publishers' pure parts: URLs, per-key rounds, and the wire formats both ways."""

from __future__ import annotations

import base64

import orjson
import pytest

from outboxkit.consumers.base import from_envelope
from outboxkit.errors import ConfigurationError
from outboxkit.publishers import _aws as aws
from outboxkit.publishers import from_url
from outboxkit.publishers.eventbridge import EventBridgePublisher
from outboxkit.publishers.kinesis import KinesisPublisher
from outboxkit.publishers.sns import SnsPublisher
from outboxkit.wire import cloudevents_json, eventbridge, kinesis, sns
from tests.support.aws_sizes import outbound


@pytest.fixture(autouse=True)
def no_region(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")


@pytest.mark.parametrize(
    ("url", "cls"),
    [
        ("sns://orders.fifo?region=eu-west-1", SnsPublisher),
        ("sns://arn:aws:sns:eu-west-1:123456789012:orders", SnsPublisher),
        ("kinesis://orders?region=eu-west-1&timeout=3&concurrency=2", KinesisPublisher),
        ("kinesis://arn:aws:kinesis:eu-west-1:123456789012:stream/orders", KinesisPublisher),
        ("eventbridge://default?region=eu-west-1&max_message_bytes=4096", EventBridgePublisher),
        ("eventbridge://shop-{topic}?region=eu-west-1", EventBridgePublisher),
    ],
)
def test_urls_pick_the_publisher_and_an_arn_supplies_its_region(url: str, cls: type) -> None:
    publisher = from_url(url)
    assert isinstance(publisher, cls)
    assert "eu-west-1" in repr(publisher)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sns://key:secret@orders?region=eu-west-1", "do not put credentials"),
        ("kinesis://orders?region=eu-west-1&shards=2", "unknown kinesis URL option 'shards'"),
        ("eventbridge://orders", "no AWS region for eventbridge"),
        ("sns://orders?region=eu-west-1&timeout=soon", "timeout='soon' is not a number"),
        ("kinesis://bad name?region=eu-west-1", "invalid kinesis stream .bad name.: a name"),
        ("sns://?region=eu-west-1", "sns URL needs a name"),
        ("eventbridge://orders?region=", "option region= is empty"),
    ],
)
def test_bad_urls_say_what_to_fix_without_echoing_secrets(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says) as caught:
        from_url(url)
    assert "secret" not in str(caught.value)


def test_rounds_put_the_nth_event_of_each_key_in_round_n_in_outbox_order() -> None:
    keys = ["a", "b", "a", "c", "a", "b"]
    assert aws.waves(range(6), lambda i: keys[i]) == [[0, 1, 3], [2, 5], [4]]


def test_requests_are_cut_at_the_entry_count_and_the_byte_limit() -> None:
    sizes = {0: 4, 1: 4, 2: 4, 3: 9, 4: 1}
    assert aws.chunks([0, 1, 2, 3, 4], sizes, max_entries=2, max_bytes=10) == [
        [0, 1],
        [2],
        [3, 4],
    ]


def test_cloudevents_json_embeds_a_json_payload_unchanged_and_wraps_the_rest() -> None:
    json_message = outbound(b'{"order":7,"note":"\xc3\xa9"}')
    document = orjson.loads(cloudevents_json.encode(json_message))
    assert document["data"] == {"order": 7, "note": "é"}
    assert document["id"] == str(json_message.event_id)
    assert document["headers"] == {"tenant": "acme"}
    for payload in (b"\x00\xff binary", b"not json {"):  # JSON content type, not JSON
        message = outbound(payload)
        document = orjson.loads(cloudevents_json.encode(message))
        assert base64.b64decode(document["data_base64"]) == payload
        received = from_envelope(
            "orders", cloudevents_json.decode(cloudevents_json.encode(message))
        )
        assert received.payload == payload and received.event_id == message.event_id
    got = from_envelope("orders", kinesis.decode(kinesis.encode(json_message)[0]))
    assert got.payload == json_message.payload, "compact JSON comes back byte for byte"
    assert (got.key, got.event_type, got.aggregate_id) == ("customer-1", "file.stored", "1")


def test_kinesis_partition_key_is_the_key_the_id_without_one_and_a_digest_past_256() -> None:
    assert kinesis.partition_key(outbound(b"{}")) == "customer-1"
    keyless = outbound(b"{}", key=None)
    assert kinesis.partition_key(keyless) == str(keyless.event_id)
    long = kinesis.partition_key(outbound(b"{}", key="k" * 257))
    assert long.startswith("sha256:") and len(long) == 71
    assert long == kinesis.partition_key(outbound(b"{}", key="k" * 257)), "one key, one shard"


def test_eventbridge_entry_maps_source_type_time_and_counts_its_size_as_aws_does() -> None:
    message = outbound(b'{"n": 1}')
    entry, size = eventbridge.encode(message)
    assert entry["Source"] == "/outboxkit/file" and entry["DetailType"] == "file.stored"
    assert entry["Time"] == message.time
    assert size == 14 + len(b"/outboxkit/file") + len(b"file.stored") + len(entry["Detail"])
    event = {
        "detail-type": "file.stored",
        "source": "/outboxkit/file",
        "detail": orjson.loads(entry["Detail"]),
    }
    detail = eventbridge.unwrap_event(orjson.dumps(event).decode())
    assert from_envelope("q", cloudevents_json.from_document(detail)).event_id == message.event_id
    assert eventbridge.unwrap_event('{"detail-type": "x", "detail": {"a": 1}}') is None


def test_sns_envelope_gives_back_the_body_and_attributes_and_nothing_else_passes() -> None:
    body = orjson.dumps(
        {
            "Type": "Notification",
            "TopicArn": "arn:aws:sns:us-east-1:123456789012:orders",
            "Message": '{"n": 1}',
            "MessageAttributes": {"ce_id": {"Type": "String", "Value": "x"}},
        }
    ).decode()
    assert sns.unwrap_notification(body) == ('{"n": 1}', {"ce_id": "x"})
    assert sns.unwrap_notification('{"TopicArn": "a", "Type": "SubscriptionConfirmation"}') is None
    assert sns.unwrap_notification('{"order": 1}') is None
