"""The Celery bridge's messages match what Celery itself sends, and bad calls fail at write time."""

from __future__ import annotations

import base64
import datetime as dt
import uuid

import orjson
import pytest

from outboxkit.contrib.celery import task_event
from outboxkit.errors import ConfigurationError, InvalidEventError
from outboxkit.publishers import from_url
from outboxkit.publishers.base import OutboundMessage
from outboxkit.wire import celery as wire
from tests.support.celery_worker import as_outbound

celery = pytest.importorskip("celery", reason="celery is not installed (pip install -e '.[dev]')")


def _outbound(
    name: str, args: tuple[object, ...], kwargs: dict[str, object] | None = None, **options: object
) -> OutboundMessage:
    return as_outbound(task_event(name, args, kwargs, **options))  # type: ignore[arg-type]


def _celerys_own(task_id: str, eta: dt.datetime | None) -> tuple[dict[str, object], list[object]]:
    """What ``apply_async`` would send for ``proj.add(2, 3, z=1)`` (protocol 2)."""
    app = celery.Celery("proj", set_as_current=False)
    message = app.amqp.as_task_v2(task_id, "proj.add", (2, 3), {"z": 1}, eta=eta)
    return message.headers, list(message.body)


def test_headers_and_body_are_celerys_protocol_2() -> None:
    eta = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    message = _outbound("proj.add", (2, 3), {"z": 1}, eta=eta, task_id="t-1")
    ours = wire.task_headers(message)
    theirs, body = _celerys_own("t-1", eta)
    assert set(ours) == set(theirs)
    for name in ("lang", "task", "id", "root_id", "parent_id", "group", "retries", "eta"):
        assert ours[name] == theirs[name], name
    assert ours["timelimit"] == list(theirs["timelimit"])  # type: ignore[call-overload]
    assert (ours["argsrepr"], ours["kwargsrepr"]) == (theirs["argsrepr"], theirs["kwargsrepr"])
    args, kwargs, embed = orjson.loads(message.payload)
    assert [args, kwargs] == [list(body[0]), body[1]]  # type: ignore[call-overload]
    assert embed == {k: body[2][k] for k in embed}  # type: ignore[index]


def test_redis_envelope_is_what_kombus_redis_channel_reads() -> None:
    message = _outbound("proj.add", (2, 3), queue="reports")
    raw = wire.redis_envelope(message, "reports", delivery_tag="tag-1")
    envelope = orjson.loads(raw)
    assert orjson.loads(base64.b64decode(envelope["body"]))[0] == [2, 3]
    assert envelope["content-type"] == "application/json"
    assert envelope["content-encoding"] == "utf-8"
    properties = envelope["properties"]
    assert properties["body_encoding"] == "base64"
    assert properties["delivery_info"] == {"exchange": "reports", "routing_key": "reports"}
    assert properties["delivery_tag"] == "tag-1"
    assert properties["priority"] == 0
    assert envelope["headers"]["task"] == "proj.add"
    assert envelope["headers"]["id"] == properties["correlation_id"] == str(message.event_id)
    # kombu's own decoder accepts it (the message a Redis worker builds from the list item)
    from kombu.transport.redis import Channel

    decoded = Channel.Message(envelope, channel=_FakeChannel())
    assert decoded.decode()[0] == [2, 3]
    assert decoded.headers["task"] == "proj.add"


class _FakeChannel:
    """Just enough of a channel for kombu's Message constructor (no connection)."""

    def __init__(self) -> None:
        from kombu.serialization import registry

        self.codecs = {"base64": _Base64()}
        self.registry = registry

    def decode_body(self, body: str, encoding: str) -> bytes:
        return self.codecs[encoding].decode(body)


class _Base64:
    def decode(self, body: str) -> bytes:
        return base64.b64decode(body)


def test_countdown_becomes_an_eta_computed_at_write_time() -> None:
    before = dt.datetime.now(dt.UTC)
    event = task_event("proj.add", (1,), countdown=30)
    eta = dt.datetime.fromisoformat(event.headers[wire.ETA])
    assert (
        before + dt.timedelta(seconds=30)
        <= eta
        <= dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)
    )


def test_task_id_defaults_to_the_event_id_and_a_uuid_task_id_is_the_event_id() -> None:
    plain = task_event("proj.add", ())
    assert plain.headers[wire.TASK_ID] == str(plain.event_id)
    chosen = str(uuid.uuid4())
    assert task_event("proj.add", (), task_id=chosen).event_id == uuid.UUID(chosen)
    assert task_event("proj.add", (), task_id="order-7").headers[wire.TASK_ID] == "order-7"


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: task_event("", ()), "registered name"),
        (lambda: task_event("proj.add", "ab"), "list or tuple"),  # type: ignore[arg-type]
        (lambda: task_event("proj.add", (), {1: 2}), "string keys"),  # type: ignore[dict-item]
        (lambda: task_event("proj.add", (), queue=""), "queue"),
        (
            lambda: task_event("proj.add", (), countdown=1, eta=dt.datetime.now(dt.UTC)),
            "not both",
        ),
        (lambda: task_event("proj.add", (), eta=dt.datetime(2030, 1, 1)), "aware datetime"),
        # (encoded when written: an Outbox(default=...) may know the type)
        (lambda: task_event("proj.add", (object(),)).payload, "not JSON-serialisable"),
    ],
)
def test_bad_calls_fail_before_anything_is_written(call: object, says: str) -> None:
    with pytest.raises(InvalidEventError, match=says):
        call()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("celery+amqp://guest:guest@127.0.0.1:5672//?exchange=x", "exchange= is not used"),
        ("celery+redis://127.0.0.1:6379/0?maxlen=5", "maxlen= is for Redis streams"),
        ("celery+redis://127.0.0.1:6379/0?stream_prefix=a:", "stream_prefix= is for Redis"),
    ],
)
def test_celery_urls_refuse_options_of_other_routes(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        from_url(url)


def test_celery_urls_pick_the_celery_publishers() -> None:
    assert from_url("celery+amqp://guest:guest@127.0.0.1:5672//").name == "celery-amqp"
    assert from_url("celery+redis://127.0.0.1:6379/0").name == "celery-redis"
