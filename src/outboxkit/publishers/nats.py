"""NATS JetStream publisher: subject = topic, ``Nats-Msg-Id`` = event id, success on PubAck.

The stream drops a message whose ``Nats-Msg-Id`` it has seen within its
duplicate window, so a batch re-published after a relay crash or a lost ack
is stored once. The PubAck is JetStream's durable confirmation: the message
is in the stream (replicated, for replicated streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import nats
import nats.errors
import nats.js.errors

from outboxkit._redact import redact
from outboxkit.errors import ConfigurationError
from outboxkit.publishers._util import ThrottledLog, too_large
from outboxkit.publishers.base import OutboundMessage, PublishResult, Reachability
from outboxkit.publishers.reserved import Guard
from outboxkit.wire.nats import encode_headers, oversize

log = logging.getLogger("outboxkit.nats")

# JetStream API error codes that no retry fixes for this message as it is.
_MESSAGE_TOO_LARGE = 10054
_STREAM_MISMATCH = 10060  # the subject is stored by another stream than ?stream= names
_PERMANENT_API_CODES = {_MESSAGE_TOO_LARGE, _STREAM_MISMATCH}
_DEFAULT_TIMEOUT = 10.0
_CONNECT_TIMEOUT = 5.0
# After the client gives up reconnecting, the publisher tries again this often (seconds).
_RECONNECT_EVERY = 1.0
# PubAcks awaited at once across the relay's in-flight batches (nats-py's default: 4000).
_MAX_PENDING_ACKS = 65536


_URL_OPTIONS = ("timeout", "stream", "subjects", "add_subjects", "duplicate_window")


def _number(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigurationError(f"nats URL option {key}={value!r} is not a number") from None


def _flag(key: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"nats URL option {key}={value!r} must be true or false")


class NatsPublisher:
    """Publishes events to JetStream subjects with broker-side deduplication by event id.

    ``stream`` (optional) is sent as the expected stream of every publish and,
    with ``subjects``, created at start if it does not exist yet. An existing
    stream's configuration belongs to its operator: if it lacks some of ``subjects``
    the start says so once, and adds them only with ``add_subjects=True``.
    """

    name = "nats"
    #: Whole batches confirmed in one round trip: large batches, four in flight.
    batch_shape = (1000, 4)

    def __init__(
        self,
        servers: list[str],
        *,
        timeout: float = _DEFAULT_TIMEOUT,
        stream: str | None = None,
        subjects: list[str] | None = None,
        duplicate_window: float = 120.0,
        add_subjects: bool = False,
    ) -> None:
        if not servers:
            raise ConfigurationError("nats publisher needs at least one server URL")
        if timeout <= 0:
            raise ConfigurationError("nats timeout must be positive")
        if subjects and not stream:
            raise ConfigurationError("nats subjects= needs stream= (the stream to create)")
        self._servers = servers
        self._timeout = timeout
        self._stream = stream
        self._subjects = subjects or []
        self._duplicate_window = duplicate_window
        self._add_subjects = add_subjects
        self._nc: Any = None
        self._js: Any = None
        self._stream_ready = not (stream and self._subjects)
        self._connect_lock = asyncio.Lock()
        self._warn = ThrottledLog(log)
        self._closing = False  # set while close() runs: that disconnect is ours, not an outage
        #: For the relay's /readyz: lost on the client's disconnected/closed callbacks or a
        #: failed connect, restored on reconnected or a connect.
        self.reachability = Reachability()
        self._reconnecting: asyncio.Task[None] | None = None
        #: Disconnects so far: a batch that saw one hands back what the server never acked.
        self._disconnects = 0
        self._lost_waiters: set[asyncio.Future[None]] = set()
        # Subjects and header names already judged: their verdict, None when publishable.
        self._seen: dict[str, str | None] = {}
        #: Event()'s rules and the system subjects ($JS., $SYS., _INBOX., ...), at publish.
        self.guard = Guard(self.name)

    @classmethod
    def from_url(cls, url: str) -> NatsPublisher:
        """``nats://[user:pass@]host:4222[,host2:4222][?timeout=10&stream=S&subjects=a.>,b.>]``."""
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("nats", "tls"):
            raise ConfigurationError(f"not a nats:// URL: {redact(url)}")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        if not hosts or any(not h.strip() for h in hosts.split(",")):
            raise ConfigurationError(
                f"nats URL needs host:port[,host:port]: {redact(url)} (e.g. nats://127.0.0.1:4222)"
            )
        prefix = f"{userinfo}@" if userinfo else ""
        servers = [urlunsplit((parts.scheme, prefix + h, "", "", "")) for h in hosts.split(",")]
        options: dict[str, Any] = {}
        for key, value in parse_qsl(parts.query):
            if key in ("timeout", "duplicate_window"):
                options[key] = _number(key, value)
            elif key == "stream":
                options["stream"] = value
            elif key == "subjects":
                options["subjects"] = [s for s in value.split(",") if s]
            elif key == "add_subjects":
                options["add_subjects"] = _flag(key, value)
            else:
                # Outside any `except ValueError`: ConfigurationError is a ValueError, and a
                # handler around the number parsing once turned this into "is not a number".
                raise ConfigurationError(
                    f"unknown nats URL option {key!r}: use {', '.join(_URL_OPTIONS)}"
                )
        return cls(servers, **options)

    def __repr__(self) -> str:
        return f"NatsPublisher(servers={[redact(s) for s in self._servers]!r})"

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        """Connect if the server is up; if it is down, the first batch retries the connect.

        A broker outage at start must not crash the relay: events simply wait in
        the table, as they do during any other outage.
        """
        try:
            await self._ensure_connected()
        except Exception as exc:
            log.warning("NATS not reachable at start (%s); will retry", redact(str(exc)))
            self._reconnect_in_background()

    async def _ensure_connected(self) -> Any:
        async with self._connect_lock:
            if self._nc is None or self._nc.is_closed:
                # A small reconnect budget: with -1, nats-py's first connect never
                # returns while the server is down, and a long budget makes every
                # batch of an outage wait it out. Once the client gives up and closes,
                # the next batch connects afresh; the relay's retry backoff paces it.
                try:
                    self._nc = await self._connect()
                except Exception as exc:
                    self.reachability.lost(type(exc).__name__)
                    raise
                self.reachability.restored()
                self._js = self._nc.jetstream(
                    timeout=self._timeout, publish_async_max_pending=_MAX_PENDING_ACKS
                )
            if not self._stream_ready:
                await self._ensure_stream()
            return self._js

    async def _connect(self) -> Any:
        return await asyncio.wait_for(
            nats.connect(
                self._servers,
                name="outboxkit-relay",
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=2,
                reconnect_time_wait=0.5,
                error_cb=self._on_error,
                disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected,
                closed_cb=self._on_closed,
            ),
            timeout=_CONNECT_TIMEOUT,
        )

    def _reconnect_in_background(self) -> None:
        """Connect again after the client gave up, so an idle relay sees the server come back."""
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while not self._closing and (self._nc is None or self._nc.is_closed):
            await asyncio.sleep(_RECONNECT_EVERY)
            try:
                await self._ensure_connected()
            except Exception as exc:
                log.debug("NATS reconnect failed: %s", redact(f"{type(exc).__name__}: {exc}"))

    async def _ensure_stream(self) -> None:
        assert self._stream is not None
        try:
            info = await self._js.stream_info(self._stream)
        except nats.js.errors.NotFoundError:
            from nats.js.api import StreamConfig

            try:
                await self._js.add_stream(
                    StreamConfig(
                        name=self._stream,
                        subjects=self._subjects,
                        duplicate_window=self._duplicate_window,
                    )
                )
            except nats.js.errors.BadRequestError as exc:
                await self._not_created(exc)
            else:
                log.info("created JetStream stream %s for %s", self._stream, self._subjects)
        else:
            await self._check_subjects(info.config)
        self._stream_ready = True

    async def _not_created(self, exc: nats.js.errors.BadRequestError) -> None:
        """The stream was not created: by another relay at the same moment, or a clash.

        A clash (its subjects overlap another stream's) was once silent, then logged as
        "created"; every publish then failed with the expected stream's mismatch.
        """
        try:
            info = await self._js.stream_info(self._stream)
        except nats.js.errors.NotFoundError:
            pass
        else:  # created concurrently
            await self._check_subjects(info.config)
            return
        holders = []
        for subject in self._subjects:
            with contextlib.suppress(nats.js.errors.Error):
                holders.append(await self._js.find_stream_name_by_subject(subject))
        hint = (
            f"give the relay ?stream={holders[0]} (it stores them already)"
            if holders
            else "choose other subjects or another stream"
        )
        log.warning(
            "cannot create JetStream stream %s for subjects %s: %s; %s",
            self._stream,
            ",".join(self._subjects),
            exc.description or exc,
            hint,
        )

    async def _check_subjects(self, config: Any) -> None:
        """An existing stream without some asked subjects: say so once, or add them if asked.

        Without this, every publish to such a subject failed with "no stream; create one
        (or give ?stream=&subjects=)", which is what the user had given.
        """
        have = list(config.subjects or [])
        missing = [s for s in self._subjects if s not in have]
        if not missing:
            return
        if self._add_subjects:
            config.subjects = have + missing
            try:
                await self._js.update_stream(config)
            except nats.js.errors.APIError as exc:
                log.warning(
                    "could not add subjects %s to JetStream stream %s: %s; add them with"
                    " `nats stream edit %s --subjects %s`",
                    ",".join(missing),
                    self._stream,
                    exc.description or exc,
                    self._stream,
                    ",".join(have + missing),
                )
            else:
                log.info("added subjects %s to JetStream stream %s", missing, self._stream)
            return
        log.warning(
            "JetStream stream %s exists without subjects %s (it has %s), so their events"
            " will not be stored: add them with `nats stream edit %s --subjects %s`, or give"
            " the relay ?add_subjects=1 to add them at start",
            self._stream,
            ",".join(missing),
            ",".join(have) or "none",
            self._stream,
            ",".join(have + missing),
        )

    async def _on_error(self, exc: Exception) -> None:
        self._warn.warning("NATS client error: %s", redact(str(exc) or type(exc).__name__))

    async def _on_disconnected(self) -> None:
        self._disconnects += 1
        for waiter in self._lost_waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self._closing:
            log.debug("disconnected from NATS (closed by the relay)")
            return
        self.reachability.lost("disconnected")
        self._warn.warning("disconnected from NATS; reconnecting")

    async def _on_reconnected(self) -> None:
        self.reachability.restored()
        log.info("reconnected to NATS")

    async def _on_closed(self) -> None:
        log.debug("NATS connection closed")
        if not self._closing:  # the client gave up reconnecting
            self.reachability.lost("closed")
            self._reconnect_in_background()

    async def close(self) -> None:
        if self._reconnecting is not None:
            self._reconnecting.cancel()
            self._reconnecting = None
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            self._closing = True
            try:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(nc.close(), 5.0)
            finally:
                self._closing = False

    # -- publishing ---------------------------------------------------------------

    def _problem(self, message: OutboundMessage) -> str | None:
        """Why ``message``'s subject must not reach the server, or None (``_subject_problem``).

        Only the subject: its headers are the guard's (``reserved.py``: names that are not
        tokens, control characters, ``Nats-*`` and the other reserved names), asked next.
        """
        # Subjects repeat: each is judged once (a bounded cache).
        subject = message.topic
        verdict = self._seen.get(subject, _UNSEEN)
        if verdict is _UNSEEN:
            verdict = self._remember(subject, _subject_problem(subject))
        return verdict

    def _remember(self, key: str, verdict: str | None) -> str | None:
        if len(key) > _SEEN_KEY_MAX:  # a row's oversized subject: judged, not kept
            return verdict
        if len(self._seen) >= _SEEN_MAX:
            self._seen.clear()
        self._seen[key] = verdict
        return verdict

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        try:
            js = await self._ensure_connected()
        except _UNREACHABLE as exc:  # the relay hands the batch back, attempts not counted
            raise ConnectionError(f"NATS unreachable: {type(exc).__name__}: {exc}") from exc
        if not self._nc.is_connected:
            # Fail fast instead of buffering into a dead socket and timing out per message.
            raise ConnectionError("not connected to NATS (reconnecting)")
        # publish_async sends every message at once with its reply subject under one
        # wildcard subscription; the PubAcks then resolve one future each. (A request
        # per message costs a subscription lookup, a timer and a task per event: about
        # a fifth of the throughput.) One deadline covers the whole batch.
        results: list[PublishResult | None] = [None] * len(messages)
        waiting: dict[asyncio.Future[Any], int] = {}
        disconnects = self._disconnects
        max_payload = self._nc.max_payload  # the server's, from its INFO
        for i, message in enumerate(messages):
            problem = self._problem(message)
            if problem is not None:
                # Never sent: a client that does not check would let the server act on it.
                results[i] = PublishResult.permanent(f"nats: {problem}", "invalid_message")
                continue
            if (refused := self.guard.refuse(message)) is not None:
                results[i] = refused
                continue
            headers = encode_headers(message)
            if self._stream is not None:
                headers[_EXPECTED_STREAM] = self._stream  # as publish_async adds it
            too_big = self._too_large(message, headers, max_payload)
            if too_big is not None:
                results[i] = too_big
                continue
            try:
                future = await js.publish_async(
                    message.topic, message.payload, stream=self._stream, headers=headers
                )
            except Exception as exc:
                results[i] = _classify(exc, message.topic, self._timeout)
            else:
                waiting[future] = i
        if waiting:
            await self._wait_for_acks(waiting, disconnects)
            lost = self._disconnects != disconnects
            for future, i in waiting.items():
                if not future.done():
                    future.cancel()  # frees its slot in nats-py's pending-ack table
                    results[i] = (
                        _LOST_BEFORE_ACK if lost else _classify(TimeoutError(), "", self._timeout)
                    )
                    continue
                error = (
                    ConnectionError("publish cancelled")
                    if future.cancelled()
                    else future.exception()
                )
                results[i] = (
                    _SUCCESS
                    if error is None
                    else _classify(error, messages[i].topic, self._timeout)
                )
        return [r if r is not None else PublishResult.retry("no PubAck", "nats") for r in results]

    async def _wait_for_acks(
        self, futures: dict[asyncio.Future[Any], int], disconnects: int
    ) -> None:
        """Until every PubAck is in, the timeout passes, or the connection drops.

        Once the connection dropped, the PubAcks of what was sent before are lost with it:
        the batch returns at once, and what is unacked is handed back instead of waiting
        out the timeout (Nats-Msg-Id dedups a message that was stored after all).
        """
        loop = asyncio.get_running_loop()
        all_in: asyncio.Future[None] = loop.create_future()
        remaining = len(futures)

        def one_done(_future: asyncio.Future[Any]) -> None:
            nonlocal remaining
            remaining -= 1
            if not remaining and not all_in.done():
                all_in.set_result(None)

        for future in futures:
            future.add_done_callback(one_done)
        lost: asyncio.Future[None] = loop.create_future()
        self._lost_waiters.add(lost)
        try:
            if self._disconnects == disconnects:
                await asyncio.wait(
                    (all_in, lost), timeout=self._timeout, return_when=asyncio.FIRST_COMPLETED
                )
        finally:
            self._lost_waiters.discard(lost)
            lost.cancel()
            all_in.cancel()
            for future in futures:
                future.remove_done_callback(one_done)

    @staticmethod
    def _too_large(
        message: OutboundMessage, headers: dict[str, str], max_payload: int
    ) -> PublishResult | None:
        """The dead letter of a message over the server's ``max_payload``, or None.

        The server answers such a message by closing the connection, which loses the
        PubAcks of every other message in flight on it: it must never be sent.
        """
        size = oversize(message.payload, headers, max_payload)
        if size is None:
            return None
        return too_large(
            "nats",
            size,
            "with headers",
            "the NATS server's max_payload",
            max_payload,
            "raise max_payload in the server's configuration, up to 64 MB, or send less",
        )


_SUCCESS = PublishResult.success()
_EXPECTED_STREAM = "Nats-Expected-Stream"
# Sent, but the connection dropped before its PubAck: the server may or may not have
# stored it; published again (Nats-Msg-Id dedups), the attempt not counted.
_LOST_BEFORE_ACK = PublishResult.hand_back(
    "nats: the connection was lost before the PubAck; published again", "connection_lost"
)
_UNSEEN = "unseen"
_SEEN_MAX = 10_000
_SEEN_KEY_MAX = 256  # longer subjects are refused anyway (outboxkit.limits)
# Whitespace and control characters end or split a protocol line; never in a subject.
_SUBJECT_BAD = re.compile(r"[\x00-\x20\x7f]")


def _subject_problem(subject: str) -> str | None:
    """Why ``subject`` is not a NATS publish subject, or None.

    No whitespace or control characters (a CR LF would end the PUB line and start a
    command of the event's choosing), no empty tokens (``a..b``, a leading or
    trailing dot) and no wildcards: ``*`` and ``>`` only make sense when subscribing.
    """
    if not subject:
        return "empty subject"
    if _SUBJECT_BAD.search(subject):
        return f"subject {subject[:80]!r} contains whitespace or a control character"
    tokens = subject.split(".")
    if "" in tokens:
        return f"subject {subject[:80]!r} has an empty token (leading, trailing or double dot)"
    if "*" in subject or ">" in subject:
        return f"subject {subject[:80]!r} contains a wildcard (* or >): publish to a concrete one"
    return None


# The connection failed, not the message: such a publish is handed back untried, so a
# broker outage cannot burn attempts and dead-letter healthy events.
_UNREACHABLE = (
    nats.errors.NoServersError,
    nats.errors.ConnectionClosedError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    ConnectionError,
    OSError,
)


def _classify(exc: BaseException, topic: str, timeout: float) -> PublishResult:
    """The verdict on one message from the exception its publish or PubAck raised."""
    if isinstance(exc, _UNREACHABLE) and not isinstance(exc, TimeoutError):
        # (TimeoutError is an OSError: a missing PubAck is judged below, and counts.)
        return PublishResult.hand_back(
            f"nats: not connected ({type(exc).__name__}: {redact(str(exc))})", "unreachable"
        )
    if isinstance(exc, nats.errors.BadSubjectError | nats.errors.MaxPayloadError):
        return PublishResult.permanent(f"nats: {exc} (subject {topic!r})", "rejected")
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return PublishResult.retry(
            f"nats: no JetStream stream stores subject {topic!r}; create one"
            " (or give the relay ?stream=NAME&subjects=...; if that stream exists, add the"
            " subject to it, or add &add_subjects=1)",
            "no_stream",
        )
    if isinstance(exc, nats.js.errors.APIError):
        text = f"nats: {exc.description or exc} (err_code {exc.err_code})"
        if exc.err_code in _PERMANENT_API_CODES:
            return PublishResult.permanent(text, f"api_{exc.err_code}")
        return PublishResult.retry(text, f"api_{exc.err_code}")
    if isinstance(exc, nats.errors.TimeoutError | TimeoutError):
        return PublishResult.retry(f"nats: no PubAck within {timeout:g}s", "publish_timeout")
    return PublishResult.retry(
        f"nats: {type(exc).__name__}: {redact(str(exc))}", type(exc).__name__
    )
