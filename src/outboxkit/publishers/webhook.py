"""HTTP webhook publisher: one signed POST per event, Standard Webhooks + CloudEvents headers.

The receiver's 2xx is the confirmation. 408, 425, 429, 5xx, timeouts and
connection errors are retried; a ``Retry-After`` holds every request to that
origin back until it has passed. Any other status means the receiver will
never take the request as it is: dead-lettered with the status and the start
of the response body.

Signatures follow Standard Webhooks (``webhook-id``, ``webhook-timestamp``,
``webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``),
so receivers can verify with any Standard Webhooks library. The secret is read
from an environment variable named in the URL, never from the URL itself.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import email.utils
import hashlib
import hmac
import logging
import os
import re
import string
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import httpx

from outboxkit._redact import redact
from outboxkit._text import describe
from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import OutboundMessage, PublishResult, Reachability
from outboxkit.publishers.reserved import Guard
from outboxkit.wire import webhook as wire

log = logging.getLogger("outboxkit.webhook")

_PLACEHOLDERS = {"topic", "event_type", "key"}
_RETRY_STATUSES = {408, 425, 429}
_DEFAULT_TIMEOUT = 10.0
_DEFAULT_CONCURRENCY = 16
_EXCERPT_CHARS = 300
# A response body is read up to this many bytes, within the timeout: the verdict needs
# the status and an excerpt, and a receiver streaming forever must not fill the relay's memory.
_MAX_BODY = 64 * 1024
_DEFAULT_MAX_RETRY_AFTER = 3600.0  # the longest Retry-After honoured (seconds)
_MAX_RETRY_AFTER_LIMIT = 30 * 86400.0
_SECRET_PREFIX = "whsec_"  # noqa: S105 -- the Standard Webhooks prefix, not a secret
_BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}$")
# Headers outboxkit sets; a user header of the same name (any case) is dropped.
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class WebhookPublisher:
    """POSTs each event's payload to a URL that may be templated per event.

    ``{topic}``, ``{event_type}`` and ``{key}`` in the path or query are
    replaced by the event's values, URL-quoted.
    """

    name = "webhook"

    def __init__(
        self,
        url_template: str,
        *,
        secret: bytes | None = None,
        timeout: float = _DEFAULT_TIMEOUT,
        concurrency: int = _DEFAULT_CONCURRENCY,
        max_retry_after_wait: float | None = None,
        max_retry_after: float = _DEFAULT_MAX_RETRY_AFTER,
    ) -> None:
        _check_template(url_template)
        if timeout <= 0:
            raise ConfigurationError("webhook timeout must be positive (seconds)")
        if not 0 < max_retry_after <= _MAX_RETRY_AFTER_LIMIT:
            raise ConfigurationError(
                "webhook max_retry_after must be positive and at most 30 days (seconds)"
            )
        if concurrency < 1:
            raise ConfigurationError("webhook concurrency must be at least 1")
        if secret is not None and not secret:
            raise ConfigurationError("webhook secret is empty")
        self._template = url_template
        self._secret = secret
        self._timeout = timeout
        self._concurrency = concurrency
        # A short Retry-After is waited out within the batch; a longer one is
        # reported as a retry without sending, and the relay's backoff paces it.
        self._max_wait = max_retry_after_wait if max_retry_after_wait is not None else timeout
        # A receiver's Retry-After is honoured up to this; beyond it the relay tries again then.
        self._max_retry_after = max_retry_after
        self._slots = asyncio.Semaphore(concurrency)
        self._not_before: dict[str, float] = {}  # origin -> monotonic time
        self._client: httpx.AsyncClient | None = None
        #: For the relay's /readyz: unreachable once connects have failed (refused, timed
        #: out) for a few seconds with no response from any receiver in between.
        self.reachability = Reachability()
        #: Event()'s rules and the broker's system destinations, at publish (reserved.py).
        self.guard = Guard(self.name)

    @classmethod
    def from_url(cls, url: str) -> WebhookPublisher:
        """``https://host/hooks/{topic}?secret_env=NAME&timeout=10&concurrency=16``.

        ``secret_env`` names the environment variable that holds the signing
        secret (``whsec_<base64>`` as Standard Webhooks issues them, or plain
        base64). ``max_retry_after`` caps the wait a receiver's ``Retry-After`` can
        impose (seconds, default one hour). ``timeout``, ``concurrency``,
        ``max_retry_after_wait``, ``max_retry_after`` and ``secret_env`` are removed
        from the query; any other query parameter is sent to the receiver.
        """
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise ConfigurationError(f"not an http:// or https:// URL: {redact(url)}")
        if not parts.hostname:
            raise ConfigurationError(
                f"webhook URL needs a host: {redact(url)} (e.g. https://example.com/hooks/{{topic}})"
            )
        options: dict[str, Any] = {}
        kept: list[tuple[str, str]] = []
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key == "secret_env":
                options["secret"] = _read_secret(value)
            elif key in ("secret", "webhook_secret"):
                raise ConfigurationError(
                    "never put the webhook secret in the URL (it would show in `ps` and logs);"
                    " put it in an environment variable and pass ?secret_env=NAME"
                )
            elif key in ("timeout", "concurrency", "max_retry_after_wait", "max_retry_after"):
                try:
                    options[key] = int(value) if key == "concurrency" else float(value)
                except ValueError:
                    raise ConfigurationError(
                        f"webhook URL option {key}={value!r} is not a number"
                    ) from None
            else:
                kept.append((key, value))
        query = urlencode(kept, safe="{}")
        return cls(urlunsplit(parts._replace(query=query, fragment="")), **options)

    def __repr__(self) -> str:
        return (
            f"WebhookPublisher(url={redact(self._template)!r}, signed={self._secret is not None})"
        )

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        """Nothing to connect: connections open with the first POST and are kept alive."""
        self._ensure_client()

    def _ensure_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self._timeout),
                limits=httpx.Limits(
                    max_connections=self._concurrency,
                    max_keepalive_connections=self._concurrency,
                ),
                follow_redirects=False,
                # Raw bytes, never a compressed body: the read is capped before decoding.
                headers={"user-agent": "outboxkit-webhook", "accept-encoding": "identity"},
            )
        return self._client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # -- publishing ---------------------------------------------------------------

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        client = self._ensure_client()
        return list(await asyncio.gather(*(self._post(client, m) for m in messages)))

    async def _post(self, client: httpx.AsyncClient, message: OutboundMessage) -> PublishResult:
        if (refused := self.guard.refuse(message)) is not None:
            return refused
        try:
            url = self.url_for(message)
            headers = self._headers(message, message.payload)
        except ValueError as exc:  # no key for {key}, a header HTTP cannot carry
            return PublishResult.permanent(f"webhook: {exc}", "bad_request")
        origin = _origin(url)
        while True:
            # Nothing goes to an origin before its Retry-After; a short wait is served
            # here (outside a concurrency slot, so other origins keep flowing).
            wait = self._not_before.get(origin, 0.0) - time.monotonic()
            if wait > self._max_wait:
                return PublishResult.retry(
                    f"webhook: not sent: {redact(origin)} asked to wait (Retry-After) another"
                    f" {wait:.1f}s",
                    "retry_after",
                    retry_after=wait,
                )
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            async with self._slots:
                if self._not_before.get(origin, 0.0) > time.monotonic():
                    continue  # a Retry-After arrived while this request waited for a slot
                return await self._send(client, url, origin, message.payload, headers)

    async def _send(
        self,
        client: httpx.AsyncClient,
        url: str,
        origin: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> PublishResult:
        try:
            async with client.stream("POST", url, content=body, headers=headers) as response:
                self.reachability.succeeded()  # any answer, even an error status
                content = await self._read_body(response)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.reachability.failed(type(exc).__name__)
            # Never delivered (no connection): handed back, so an outage burns no attempts.
            return PublishResult.hand_back(
                f"webhook: cannot reach {redact(origin)}: {describe(exc)}", "unreachable"
            )
        except httpx.TimeoutException as exc:
            return PublishResult.retry(
                f"webhook: no response from {redact(origin)} within {self._timeout:g}s"
                f" ({type(exc).__name__})",
                "timeout",
            )
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            return PublishResult.permanent(f"webhook: {describe(exc)}", "bad_url")
        except httpx.TransportError as exc:
            return PublishResult.retry(
                f"webhook: cannot reach {redact(origin)}: {describe(exc)}", "connection"
            )
        return self._verdict(origin, response, content)

    async def _read_body(self, response: httpx.Response) -> bytes:
        """The body's first `_MAX_BODY` bytes, read within the timeout; the rest is dropped.

        Leaving the stream unread closes the connection instead of returning it to the pool.
        """
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self._timeout):
                async for chunk in response.aiter_raw():
                    chunks.append(chunk[: _MAX_BODY - size])
                    size += len(chunks[-1])
                    if size >= _MAX_BODY:
                        break
        except (TimeoutError, httpx.TransportError):
            pass  # the status is what counts; the body is only an excerpt for the error
        return b"".join(chunks)

    def _verdict(self, origin: str, response: httpx.Response, content: bytes) -> PublishResult:
        status = response.status_code
        if 200 <= status < 300:
            return PublishResult.success()
        excerpt = _excerpt(content)
        text = f"webhook: {redact(origin)} answered HTTP {status}" + (
            f": {excerpt}" if excerpt else ""
        )
        if status in _RETRY_STATUSES or status >= 500:
            delay = _retry_after(response.headers.get("retry-after"), self._max_retry_after)
            if delay is not None:
                self._not_before[origin] = max(
                    self._not_before.get(origin, 0.0), time.monotonic() + delay
                )
                text += f" (Retry-After {delay:g}s: nothing is sent to {redact(origin)} before)"
            return PublishResult.retry(text, f"http_{status}", retry_after=delay)
        if 300 <= status < 400:
            location = response.headers.get("location", "")
            text += f" (redirects are not followed; point the URL at {redact(location)})"
        return PublishResult.permanent(text, f"http_{status}")

    def url_for(self, message: OutboundMessage) -> str:
        """The destination of one event: the template with its placeholders filled in."""
        values: dict[str, str] = {"topic": message.topic, "event_type": message.event_type}
        if message.key is not None:
            values["key"] = message.key
        elif "{key}" in self._template:
            raise ValueError("the webhook URL uses {key} but the event has no key")
        for name, value in values.items():
            if "{" + name + "}" in self._template and _has_dot_segment(value):
                raise ValueError(
                    f"the event's {name} {value!r} is or contains a '.' or '..' path segment"
                    " (possibly percent-encoded): put in the webhook URL it would send the"
                    f" request to another path; refused (rename the {name})"
                )
        return self._template.format_map({k: quote(v, safe="") for k, v in values.items()})

    def _headers(self, message: OutboundMessage, body: bytes) -> list[tuple[bytes, bytes]]:
        headers = wire.encode_headers(message)
        event_id = str(message.event_id)
        timestamp = str(int(time.time()))
        headers["webhook-timestamp"] = timestamp
        if self._secret is not None:
            headers["webhook-signature"] = sign(self._secret, event_id, timestamp, body)
        for name, value in headers.items():
            if _HEADER_NAME.match(name) is None or _BAD_VALUE.search(value):
                raise ValueError(f"header {name!r} cannot be sent over HTTP (invalid characters)")
        # UTF-8 bytes: HTTP carries them as opaque octets; httpx would insist on ASCII.
        return [(k.encode("ascii"), v.encode("utf-8")) for k, v in headers.items()]


def sign(secret: bytes, msg_id: str, timestamp: str, body: bytes) -> str:
    """Standard Webhooks signature: ``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``."""
    mac = hmac.new(secret, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode("ascii")


def decode_secret(text: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: base64, optionally prefixed ``whsec_``."""
    raw = text.strip().removeprefix(_SECRET_PREFIX)
    if not raw or _BASE64.match(raw) is None:
        raise ConfigurationError(
            "webhook secret must be base64, optionally prefixed whsec_ (Standard Webhooks);"
            " generate one with: echo whsec_$(openssl rand -base64 32)"
        )
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4))
    except binascii.Error:
        raise ConfigurationError("webhook secret is not valid base64") from None
    if not key:
        raise ConfigurationError("webhook secret is empty")
    return key


def _read_secret(env_name: str) -> bytes:
    if not env_name:
        raise ConfigurationError("webhook secret_env= needs the name of an environment variable")
    value = os.environ.get(env_name)
    if value is None:
        raise ConfigurationError(
            f"environment variable {env_name} (named by secret_env) is not set;"
            " export the webhook signing secret in it"
        )
    try:
        return decode_secret(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{exc} (in environment variable {env_name})") from None


def _check_template(template: str) -> None:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ConfigurationError(
            f"webhook URL template is malformed ({exc}); write braces only as"
            " {topic}, {event_type} or {key}"
        ) from None
    unknown = sorted(set(fields) - _PLACEHOLDERS)
    if unknown:
        raise ConfigurationError(
            f"unknown placeholder(s) {', '.join('{' + f + '}' for f in unknown)} in the webhook"
            " URL; use {topic}, {event_type} or {key}"
        )
    host = urlsplit(template).netloc
    if "{" in host:
        raise ConfigurationError("placeholders are allowed in the webhook URL's path and query")


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _has_dot_segment(value: str) -> bool:
    """True if `value`, percent-decoded as often as a server might, has a `.` or `..` segment."""
    for _ in range(4):  # %252e%252e -> %2e%2e -> ..
        decoded = unquote(value)
        if decoded == value:
            break
        value = decoded
    return any(segment in (".", "..") for segment in re.split(r"[/\\]", value))


def _retry_after(value: str | None, cap: float = _DEFAULT_MAX_RETRY_AFTER) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), at most `cap`."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return min(float(value), cap)
    try:
        when = email.utils.parsedate_to_datetime(value)
        delay = when.timestamp() - time.time()
    except (TypeError, ValueError, OverflowError):
        return None
    return min(max(0.0, delay), cap)


def _excerpt(content: bytes) -> str:
    text = content[: _EXCERPT_CHARS * 4].decode("utf-8", "replace")
    text = " ".join(text.split())
    return redact(text[:_EXCERPT_CHARS])
