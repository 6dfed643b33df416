"""Kafka publisher: confluent-kafka idempotent producer, one delivery report per event.

``produce()`` only queues a message; the broker's verdict arrives later in a
delivery report, served by ``poll()``. A daemon thread polls, so reports
arrive while the event loop keeps producing, and each batch's future is
resolved once, when its last report is in (one cross-thread wake-up per batch,
not per message).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from confluent_kafka import KafkaError, KafkaException, Producer

from outboxkit._redact import redact
from outboxkit.errors import ConfigurationError
from outboxkit.publishers._util import ThrottledLog, too_large
from outboxkit.publishers.base import (
    OutboundMessage,
    PublishResult,
    Reachability,
)
from outboxkit.publishers.reserved import Guard
from outboxkit.wire.kafka import encode_record, encode_records, record_size, wire_time

log = logging.getLogger("outboxkit.kafka")
# librdkafka's own lines; `outboxkit relay` lowers their ERRORs and rate-limits them.
_librdkafka_log = logging.getLogger("outboxkit.kafka.librdkafka")

# Errors no retry can fix for this message as it is: dead-letter at once.
_PERMANENT = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.TOPIC_EXCEPTION,  # invalid topic name
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_RECORD,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError._INVALID_ARG,
}
# Unknown topic with auto-creation off: dead-lettered rather than retried for hours
# (docs/architecture.md, "Settle, fenced"); `outboxkit replay --topic` brings it back once created.
_UNKNOWN_TOPIC = {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC}
# Failures of the producer, not of the message (fenced, sequence lost, purged from its queue):
# the message is handed back untried, its attempt not counted.
_PRODUCER_FAILED = {
    KafkaError._FATAL,
    KafkaError._FENCED,
    KafkaError._PURGE_QUEUE,
    KafkaError._PURGE_INFLIGHT,
    KafkaError.UNKNOWN_PRODUCER_ID,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError.INVALID_PRODUCER_ID_MAPPING,
    KafkaError.PRODUCER_FENCED,
}

# URL query shortcuts → librdkafka names; dotted keys pass through unchanged.
_SHORTCUTS = {
    "delivery_timeout_ms": "delivery.timeout.ms",
    "linger_ms": "linger.ms",
    "batch_size": "batch.size",
    "compression": "compression.type",
    "client_id": "client.id",
}
_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,  # no duplicates or reordering from producer retries
    "acks": "all",  # confirmed only once every in-sync replica has it
    # The relay hands over whole batches: 5 ms lets librdkafka send a batch of 1 000 in
    # full requests, one per partition or few (against 1 ms: 15 % less CPU per event in
    # the relay, 13 % with the broker's and PostgreSQL's; 1 ms was 18 % less than 0).
    # Small batches do not wait for it (publish_batch flushes them at once), so latency
    # pays only while a backlog drains: at most 5 ms on a batch of 100 or more.
    "linger.ms": 5,
    "delivery.timeout.ms": 20_000,  # report a failure before the relay's lease runs out
    "client.id": "outboxkit",
    "socket.keepalive.enable": True,
}
_SUCCESS = PublishResult.success()
# The producer's message.max.bytes unless the URL sets it (librdkafka's default).
_LIBRDKAFKA_MAX_MESSAGE_BYTES = 1_000_000
# A delivery report's MSG_SIZE_TOO_LARGE: the broker refused the record batch.
_TOO_LARGE_NAME = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE).name()
_REFUSED_WITH_A_LARGER_ONE = PublishResult.hand_back(
    "kafka: the broker refused the record batch as too large because of a larger message"
    " of the same batch (dead-lettered); published again",
    "refused_with_neighbour",
)
_WARM_UP_TIMEOUT = 2.0
# Producer.produce()'s positional parameters (confluent-kafka's Producer.c kwlist):
# topic, value, key, partition, callback, on_delivery (its alias), timestamp, headers.
# The relay passes them by position on its hot path; the partition is librdkafka's
# RD_KAFKA_PARTITION_UA (the partitioner chooses), the delivery report goes in callback
# and on_delivery is None (a callback given as None would mean no report at all:
# tests/integration/test_kafka_produce_args.py reads every argument back).
_ANY_PARTITION = -1
# A message's Kafka headers and record timestamp (ms), as encode_record returns them.
_Record = tuple[list[tuple[str, bytes]], int]
_YIELD_EVERY = 128
_SMALL_BATCH = 100  # fewer messages than this are sent without lingering
_FLUSH_WAIT = 1.0  # seconds a small batch's flush may wait for its deliveries
# A producer that fails fatally again soon after being recreated waits before the next
# recreation, doubling from 1 s up to 30 s (a first fatal error recreates at once).
_RECREATE_BACKOFF = (1.0, 30.0)
_RECREATE_RECENT = 60.0
# While every broker is down, the poller asks for metadata this often (librdkafka reports
# all-brokers-down at once, but nothing when they come back, and an idle producer sends
# nothing whose delivery would say so).
_PROBE_EVERY = 1.0
_PROBE_TIMEOUT = 0.5


def _is_fatal(err: KafkaError) -> bool:
    """The producer must be replaced: librdkafka's fatal state, or a producer identity the
    broker no longer accepts (fenced, unknown id, sequence or epoch out of step). Seen after
    a broker restart or a long outage; until replaced, every message fails the same way."""
    return bool(err.fatal()) or err.code() in _PRODUCER_IDENTITY_LOST


_PRODUCER_IDENTITY_LOST = _PRODUCER_FAILED - {KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT}


def _classify(err: KafkaError) -> PublishResult:
    text = f"kafka {err.name()}: {err.str()}"
    code = err.code()
    if code in _PRODUCER_FAILED or err.fatal():
        return PublishResult.hand_back(text, err.name())
    if code in _PERMANENT or code in _UNKNOWN_TOPIC:
        return PublishResult.permanent(text, err.name())
    return PublishResult.retry(text, err.name())


class _BatchWaiter:
    """Collects the delivery reports of one batch; wakes the loop when the last one lands."""

    __slots__ = ("_lock", "future", "generation", "loop", "on_fatal", "remaining", "results")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        n: int,
        generation: int,
        on_fatal: Callable[[int, KafkaError], None],
    ) -> None:
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()
        self.results: list[PublishResult | None] = [None] * n
        self.remaining = n
        self.generation = generation  # of the producer the batch was produced with
        self.on_fatal = on_fatal
        self._lock = threading.Lock()

    def report(self, index: int, result: PublishResult) -> None:
        with self._lock:
            if self.results[index] is not None:
                return  # reported twice (a purge at close, then the close's own sweep)
            self.results[index] = result
            self.remaining -= 1
            if self.remaining:
                return
        self.loop.call_soon_threadsafe(_set_done, self.future)

    def on_delivery(self, index: int, err: KafkaError | None, _msg: Any) -> None:
        if err is None:
            self.report(index, _SUCCESS)
            return
        if _is_fatal(err):
            self.on_fatal(self.generation, err)
        self.report(index, _classify(err))

    def hand_back_rest(self, result: PublishResult) -> None:
        """Every message without a report yet gets `result` (its producer is gone)."""
        for i, current in enumerate(self.results):
            if current is None:
                self.report(i, result)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class KafkaPublisher:
    """Publishes to Kafka: key = event key, headers = idempotency key + CloudEvents ``ce_*``.

    Per the CloudEvents Kafka binding (binary mode) the attributes travel as
    ``ce_<name>`` headers and the data content type as ``content-type``; the
    event id is also sent as ``idempotency-key`` for consumers' inboxes.
    """

    name = "kafka"
    #: Whole batches confirmed in one round trip: large batches, four in flight.
    batch_shape = (1000, 4)

    def __init__(self, config: dict[str, Any], *, close_timeout: float = 5.0) -> None:
        if not config.get("bootstrap.servers"):
            raise ConfigurationError("kafka publisher needs bootstrap.servers (host:port)")
        self._config = {**_DEFAULTS, **config}
        self._close_timeout = close_timeout
        self._producer: Any = None
        self._poller: threading.Thread | None = None
        self._stop_polling = threading.Event()
        self._pending: set[_BatchWaiter] = set()
        self._error_log = ThrottledLog(log)
        # Fatal-error recovery: which producer is current, what failed it, when to replace it.
        self._generation = 0
        self._fatal: KafkaError | None = None
        self._fatal_lock = threading.Lock()
        self._handed_back = 0
        self._recreate_at = 0.0
        self._recreate_delay = 0.0
        self._recreated_at = -_RECREATE_RECENT
        #: Broker reachability for the relay's /readyz: lost on librdkafka's _ALL_BROKERS_DOWN,
        #: restored by a delivered message or an answered metadata probe.
        self.reachability = Reachability()
        #: Event()'s rules and the broker's system destinations, at publish (reserved.py).
        self.guard = Guard(self.name)

    @classmethod
    def from_url(cls, url: str) -> KafkaPublisher:
        """``kafka://host:9092[,host:9092][?linger_ms=5&delivery_timeout_ms=20000&k.e.y=v]``.

        ``user:password@`` sets SASL credentials (``sasl.username``/``sasl.password``);
        any dotted query key is passed to librdkafka as is.
        """
        parts = urlsplit(url)
        if parts.scheme.lower() != "kafka":
            raise ConfigurationError(f"not a kafka:// URL: {redact(url)}")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        if not hosts or any(not h.strip() for h in hosts.split(",")):
            raise ConfigurationError(
                f"kafka URL needs host:port[,host:port]: {redact(url)} (e.g. kafka://127.0.0.1:9092)"
            )
        config: dict[str, Any] = {"bootstrap.servers": hosts}
        if userinfo:
            user, _, password = userinfo.partition(":")
            config["sasl.username"] = unquote(user)
            config["sasl.password"] = unquote(password)
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            name = _SHORTCUTS.get(key, key)
            if "." not in name:
                known = ", ".join(sorted(_SHORTCUTS))
                raise ConfigurationError(
                    f"unknown kafka URL option {key!r}: use one of {known} or a librdkafka"
                    " property such as security.protocol"
                )
            config[name] = value
        return cls(config)

    def __repr__(self) -> str:
        return f"KafkaPublisher(bootstrap={self._config['bootstrap.servers']!r})"

    def bound_delivery_time(self, seconds: float) -> float:
        """Ordered mode: per-partition order on retries, and no delivery after ``seconds``.

        The ordered relay stops waiting for a batch at the end of its publish window, and
        the key's partition may pass to another relay after it; librdkafka would go on
        retrying a message until ``delivery.timeout.ms``. This lowers that timeout to
        ``seconds`` (never raises it) before :meth:`start`, refuses settings under which
        retries can reorder a partition, and returns the bound kept, in seconds.
        """
        config = self._config
        if str(config.get("enable.idempotence")).lower() not in ("true", "1"):
            raise ConfigurationError(
                "ordered mode needs the idempotent Kafka producer: remove"
                " enable.idempotence=false from the broker URL (without it a retried"
                " batch can land after the next one)"
            )
        in_flight = int(config.get("max.in.flight.requests.per.connection", 5))
        if in_flight > 5 or str(config.get("acks", "all")).lower() not in ("all", "-1"):
            raise ConfigurationError(
                "ordered mode needs acks=all and max.in.flight.requests.per.connection <= 5"
                " (the idempotent producer keeps a partition's order only then)"
            )
        current = float(config.get("delivery.timeout.ms", 300_000)) / 1000
        bound = max(0.001, min(current, seconds))
        config["delivery.timeout.ms"] = max(1, int(bound * 1000))
        return bound

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        producer = self._ensure_producer()
        # Connect and fetch metadata now: librdkafka otherwise does it on the first
        # produce, and an idempotent producer's first delivery then waits ~0.5 s
        # (its producer-id handshake runs on a timer). A broker that is down is not
        # an error here: publishing retries until it is back.
        try:
            await asyncio.to_thread(producer.list_topics, None, _WARM_UP_TIMEOUT)
        except KafkaException as exc:
            log.warning(
                "kafka not reachable at start (%s); publishing will retry", redact(str(exc))
            )

    def _ensure_producer(self) -> Any:
        if self._producer is None:
            generation = self._generation + 1
            try:
                self._producer = Producer(
                    {
                        **self._config,
                        "error_cb": functools.partial(self._on_error, generation),
                        "logger": _librdkafka_log,
                    }
                )
            except KafkaException as exc:
                raise ConfigurationError(f"invalid kafka configuration: {exc}") from None
            self._generation = generation
            self._stop_polling.clear()
            self._poller = threading.Thread(
                target=self._poll_forever,
                args=(self._producer, generation),
                name="outboxkit-kafka-poll",
                daemon=True,
            )
            self._poller.start()
        return self._producer

    def _poll_forever(self, producer: Any, generation: int) -> None:
        # Nothing may end this loop but close(): without it no delivery report is served
        # and every batch in flight waits for the relay's publish timeout.
        reach = self.reachability
        next_probe = 0.0
        while not self._stop_polling.is_set():
            try:
                producer.poll(0.1)
                if reach.unreachable_for() is not None and time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + _PROBE_EVERY
                    self._probe(producer)
            except Exception as exc:  # confluent-kafka raises fatal errors from poll()
                self._on_exception(generation, exc, "poll")

    def _probe(self, producer: Any) -> None:
        """Ask for metadata: an answer means a broker is reachable again."""
        try:
            producer.list_topics(None, _PROBE_TIMEOUT)
        except KafkaException:
            return
        self.reachability.restored()

    def _on_exception(self, generation: int, exc: Exception, where: str) -> None:
        """An exception from produce/poll/flush: a fatal one retires the producer."""
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is not None and _is_fatal(err):
            self._producer_failed(generation, err)
            return
        self._error_log.warning(
            "kafka %s failed: %s", where, redact(f"{type(exc).__name__}: {exc}")
        )
        if where == "poll":
            self._stop_polling.wait(0.1)  # not a busy loop if poll() keeps raising

    def _on_error(self, generation: int, err: KafkaError) -> None:
        """Client-level errors (broker unreachable, fatal producer state); runs in the poller."""
        if _is_fatal(err):
            self._producer_failed(generation, err)
            return
        if err.code() == KafkaError._ALL_BROKERS_DOWN and generation == self._generation:
            # (_TRANSPORT alone names one broker: others may still serve the topics)
            self.reachability.lost(err.name())
        self._error_log.warning("kafka client error: %s: %s", err.name(), redact(err.str()))

    def _producer_failed(self, generation: int, err: KafkaError) -> None:
        """Producer `generation` hit librdkafka's fatal state; any thread may report it.

        It will deliver nothing more (its idempotence state is gone: fenced, unknown producer
        id, sequence gap), so what it has not confirmed is handed back at once, attempts not
        counted, and the next batch recreates the producer (a new one gets a new producer id).
        """
        with self._fatal_lock:
            if generation != self._generation:
                return  # a late report from a producer already replaced
            if self._fatal is not None:
                if self._fatal.code() == KafkaError._FATAL:
                    self._fatal = err  # the underlying cause is more useful than "_FATAL"
                return
            self._fatal = err
            # Failing again soon after a recreation: wait longer before the next one.
            now = time.monotonic()
            low, high = _RECREATE_BACKOFF
            recent = now - self._recreated_at < _RECREATE_RECENT
            self._recreate_delay = min(max(2 * self._recreate_delay, low), high) if recent else 0.0
            self._recreate_at = now + self._recreate_delay
        result = PublishResult.hand_back(
            f"kafka producer failed fatally ({err.name()}: {err.str()}); published again by a"
            " new producer",
            "producer_fatal",
        )
        for waiter in list(self._pending):
            if waiter.generation == generation:
                self._handed_back += sum(r is None for r in waiter.results)
                waiter.hand_back_rest(result)

    def _recreate_after_fatal(self) -> float:
        """Replace a fatally failed producer; 0, or the seconds before it may be replaced."""
        fatal = self._fatal
        assert fatal is not None
        now = time.monotonic()
        if now < self._recreate_at:
            return self._recreate_at - now
        self._recreated_at = now
        handed_back, self._handed_back = self._handed_back, 0
        log.warning(
            "kafka producer failed fatally (%s: %s); recreating it with a new producer id."
            " %d event(s) it had not confirmed are handed back and published again,"
            " attempts not counted",
            fatal.name(),
            redact(fatal.str()),
            handed_back,
            extra={"error_class": fatal.name()},
        )
        self._shutdown_producer(flush=False)
        with self._fatal_lock:
            self._fatal = None
        return 0.0

    async def close(self) -> None:
        await asyncio.to_thread(self._shutdown_producer, flush=True)

    def _shutdown_producer(self, *, flush: bool) -> None:
        producer = self._producer
        if producer is None:
            return
        self._stop_polling.set()
        if self._poller is not None:
            self._poller.join()
            self._poller = None
        # A fatally failed producer raises from flush() and poll(); it has nothing to flush.
        if flush and self._fatal is None:
            with contextlib.suppress(KafkaException):
                producer.flush(self._close_timeout)
        # Whatever could not be delivered is reported as failed, so no batch waits forever.
        with contextlib.suppress(KafkaException):
            producer.purge()
        with contextlib.suppress(KafkaException):
            producer.poll(0)
        self._producer = None
        closed = PublishResult.hand_back("kafka producer closed before confirming", "closed")
        for waiter in list(self._pending):
            waiter.hand_back_rest(closed)

    # -- publishing ---------------------------------------------------------------

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        if self._fatal is not None:
            wait = self._recreate_after_fatal()
            if wait:
                # Failed fatally again soon after being recreated: rows wait, untried.
                error = f"kafka producer failed fatally again; recreated in {wait:.1f}s"
                result = PublishResult.hand_back(error, "producer_fatal", retry_after=wait)
                return [result] * len(messages)
        producer = self._ensure_producer()
        loop = asyncio.get_running_loop()
        waiter = _BatchWaiter(loop, len(messages), self._generation, self._producer_failed)
        self._pending.add(waiter)
        try:
            # Two plain loops, not a coroutine per message. The first checks and encodes
            # every record, letting the event loop in now and then; the second hands them
            # all to librdkafka at once, so a batch reaches it within linger.ms and goes out
            # in full requests (the broker's cost is per request: docs/benchmarks.md).
            # Encoded a chunk at a time (encode_records: one loop, not a call per event); the
            # guard's verdict, asked of each, comes first.
            staged: list[tuple[int, OutboundMessage, _Record]] = []
            refuse = self.guard.refuse
            for start in range(0, len(messages), _YIELD_EVERY):
                if start:
                    # The relay's next claim result is read and the one after it sent
                    # without waiting for the whole batch.
                    await asyncio.sleep(0)
                chunk = messages[start : start + _YIELD_EVERY]
                for i, message, record in zip(
                    itertools.count(start), chunk, encode_records(chunk), strict=False
                ):
                    if (refused := refuse(message)) is not None:
                        waiter.report(i, refused)
                    elif isinstance(record, str):
                        invalid = PublishResult.permanent(f"kafka: {record}", "invalid_message")
                        waiter.report(i, invalid)
                    else:
                        staged.append((i, message, record))
            produce = producer.produce
            on_delivery = waiter.on_delivery
            partial = functools.partial
            for i, message, record in staged:
                key = message.key  # librdkafka takes str keys as UTF-8
                callback = partial(on_delivery, i)
                headers, timestamp = record
                try:
                    # _produce()'s call, written out: no Python frame per event here.
                    produce(
                        message.topic,
                        message.payload,
                        key,
                        _ANY_PARTITION,
                        callback,
                        None,
                        timestamp,
                        headers,
                    )
                except BufferError:
                    # Local queue full: produce() only enqueues, so only now does it wait.
                    await self._produce_when_room(
                        producer, waiter, i, message, key, callback, record
                    )
                except KafkaException as exc:
                    self._produce_failed(waiter, i, exc, message)
                    if not waiter.remaining:
                        break  # the producer failed fatally: the rest is handed back
                except (TypeError, ValueError) as exc:
                    waiter.report(i, PublishResult.permanent(f"kafka: {exc}", "invalid_message"))
            if len(messages) < _SMALL_BATCH and self._config.get("linger.ms") not in (0, "0"):
                # A small batch means the relay has caught up: latency matters more than
                # fuller requests. librdkafka sends at once, ignoring linger.ms, while a
                # flush() is waiting; run one in a worker thread (it returns when these
                # are delivered) instead of letting the batch wait out the linger.
                loop.run_in_executor(None, self._flush, producer, waiter.generation)
            await asyncio.shield(waiter.future)
        finally:
            self._pending.discard(waiter)
        results = [r if r is not None else PublishResult.retry("no report") for r in waiter.results]
        if any(r.error_class == _TOO_LARGE_NAME for r in results):
            self._judge_refused_as_too_large(messages, results)
        if any(r.ok for r in results):  # a delivery: the broker is reachable
            self.reachability.restored()
        return results

    async def _produce_when_room(
        self,
        producer: Any,
        waiter: _BatchWaiter,
        index: int,
        message: OutboundMessage,
        key: str | None,
        callback: Any,
        record: _Record,
    ) -> None:
        """Local queue full: the poller is draining it; retry the produce shortly."""
        while True:
            await asyncio.sleep(0.005)
            try:
                _produce(producer.produce, message, key, callback, record)
                return
            except BufferError:
                continue
            except KafkaException as exc:
                self._produce_failed(waiter, index, exc, message)
                return
            except (TypeError, ValueError) as exc:
                waiter.report(index, PublishResult.permanent(f"kafka: {exc}", "invalid_message"))
                return

    def _produce_failed(
        self, waiter: _BatchWaiter, index: int, exc: KafkaException, message: OutboundMessage
    ) -> None:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is not None and err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            # librdkafka refused it before sending: over the producer's own limit.
            waiter.report(index, self._over_producer_limit(message))
            return
        if err is not None and _is_fatal(err):
            self._producer_failed(waiter.generation, err)
            result = PublishResult.hand_back(f"kafka {err.name()}: {err.str()}", "producer_fatal")
            waiter.hand_back_rest(result)
            return
        waiter.report(index, _classify(err) if err else PublishResult.retry(str(exc), "kafka"))

    @property
    def _max_message_bytes(self) -> int:
        return int(self._config.get("message.max.bytes", _LIBRDKAFKA_MAX_MESSAGE_BYTES))

    def _over_producer_limit(self, message: OutboundMessage) -> PublishResult:
        headers, _ = encode_record(message)
        return too_large(
            "kafka",
            record_size(message.key, message.payload, headers),
            "with its key and headers",
            "the producer's message.max.bytes",
            self._max_message_bytes,
            "raise message.max.bytes in the relay's broker URL, and the topic's"
            " max.message.bytes with it, or send less",
        )

    def _judge_refused_as_too_large(
        self, messages: Sequence[OutboundMessage], results: list[PublishResult]
    ) -> None:
        """Tell the message the broker refused as too large from its neighbours.

        Under the producer's limit, but over a smaller topic (``max.message.bytes``) or
        broker limit: the broker refuses the whole record batch, every message of the
        batch's partition with it. Per topic, the largest refused message is the cause and
        is dead-lettered; the others are handed back, their attempt not counted.
        """
        refused: dict[str, list[tuple[int, int]]] = {}
        for i, result in enumerate(results):
            if result.error_class == _TOO_LARGE_NAME:
                message = messages[i]
                headers, _ = encode_record(message)
                size = record_size(message.key, message.payload, headers)
                refused.setdefault(message.topic, []).append((size, i))
        for topic, sized in refused.items():
            size, culprit = max(sized)
            for _, i in sized:
                results[i] = _REFUSED_WITH_A_LARGER_ONE
            results[culprit] = too_large(
                "kafka",
                size,
                "with its key and headers, under the producer's message.max.bytes but refused"
                f" by the broker as too large for topic {topic!r}",
                "the producer's message.max.bytes",
                self._max_message_bytes,
                "the topic's max.message.bytes or the broker's message.max.bytes is smaller:"
                " raise it, or lower message.max.bytes in the relay's broker URL to match",
            )

    def _flush(self, producer: Any, generation: int) -> None:
        """Wait (in a worker thread) for the queued messages; their reports carry the outcome."""
        try:
            producer.flush(_FLUSH_WAIT)
        except Exception as exc:  # a fatal error surfaces here too, not only in poll()
            self._on_exception(generation, exc, "flush")


def _produce(
    produce: Callable[..., None],
    message: OutboundMessage,
    key: str | None,
    callback: Any,
    record: _Record,
) -> None:
    """``produce()`` one message as its CloudEvents ``record`` (``encode_record``'s headers
    and timestamp), the arguments by position.

    By position (see ``_ANY_PARTITION``): keywords cost a dict per call and their parsing,
    about a quarter of produce()'s own time with these headers (2.6 against 3.4 us per call,
    measured in one process, loaded machine).
    """
    headers, timestamp = record
    produce(message.topic, message.payload, key, _ANY_PARTITION, callback, None, timestamp, headers)


def _timestamp_ms(message: OutboundMessage) -> int:
    """The record's CreateTime: when the event occurred, as on every other broker.

    (Topics with ``message.timestamp.type=LogAppendTime`` replace it with the
    broker's append time.)
    """
    return wire_time(message.time)[1]
