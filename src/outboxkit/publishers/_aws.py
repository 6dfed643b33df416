"""What the SNS, Kinesis and EventBridge publishers share: :class:`AwsPublisher`, and the
URL options, client, verdicts and per-key rounds it is made of.

Credentials always come from boto3's own chain (environment, profile, container or
instance role); a URL with credentials in it is refused, and no message here ever
carries more than an AWS error code and its text, passed through ``redact``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar
from urllib.parse import parse_qsl, unquote, urlsplit

import boto3
import botocore.config
import botocore.exceptions

from outboxkit._backoff import full_jitter
from outboxkit._redact import redact
from outboxkit._text import describe
from outboxkit.errors import ConfigurationError
from outboxkit.publishers._util import too_large
from outboxkit.publishers.base import OutboundMessage, PublishResult, Reachability
from outboxkit.publishers.reserved import Guard

log = logging.getLogger("outboxkit.aws")

DEFAULT_TIMEOUT = 10.0
DEFAULT_CONCURRENCY = 4
PLACEHOLDER = "{topic}"
_NUMBERS = ("timeout", "concurrency", "max_message_bytes")
#: Error codes of a service saying "too fast": handed back, the attempt refunded.
THROTTLED = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "ProvisionedThroughputExceededException",
        "LimitExceededException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
    }
)


def parse_url(url: str, scheme: str, example: str) -> tuple[str, dict[str, Any]]:
    """``SCHEME://NAME?region=…&endpoint_url=…&timeout=…&concurrency=…&max_message_bytes=…``.

    Returns the destination (a name, an ARN or a ``{topic}`` template) and the options.
    """
    parts = urlsplit(url)
    if parts.scheme.lower() != scheme:
        raise ConfigurationError(f"not a {scheme}:// URL: {redact(url)}")
    if "@" in parts.netloc:
        raise ConfigurationError(
            f"do not put credentials in the {scheme}:// URL; use the AWS environment"
            " variables, a profile or an instance role"
        )
    name = unquote(parts.netloc + parts.path).strip("/")
    if not name:
        raise ConfigurationError(f"{scheme} URL needs a name: {example}")
    options: dict[str, Any] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in ("region", "endpoint_url"):
            if not value:
                raise ConfigurationError(f"{scheme} URL option {key}= is empty")
            options[key] = value
        elif key in _NUMBERS:
            try:
                options[key] = float(value) if key == "timeout" else int(value)
            except ValueError:
                raise ConfigurationError(
                    f"{scheme} URL option {key}={value!r} is not a number"
                ) from None
        else:
            raise ConfigurationError(
                f"unknown {scheme} URL option {key!r}: use region, endpoint_url, "
                + ", ".join(_NUMBERS)
            )
    if "region" not in options and name.startswith("arn:") and name.count(":") >= 5:
        options["region"] = name.split(":")[3]  # arn:aws:SERVICE:REGION:ACCOUNT:NAME
    if "region" not in options and boto3.session.Session().region_name is None:
        raise ConfigurationError(
            f"no AWS region for {scheme}: add ?region=us-east-1 (for example) to the URL"
            " or set AWS_REGION"
        )
    return name, options


def check_options(service: str, timeout: float, concurrency: int, max_bytes: int | None) -> None:
    if timeout <= 0:
        raise ConfigurationError(f"{service} timeout must be positive (seconds)")
    if concurrency < 1:
        raise ConfigurationError(f"{service} concurrency must be at least 1")
    if max_bytes is not None and max_bytes < 1:
        raise ConfigurationError(f"{service} max_message_bytes must be at least 1")


def make_client(
    service: str, region: str | None, endpoint_url: str | None, timeout: float, concurrency: int
) -> Any:
    """A boto3 client with short timeouts and one retry of its own (the relay retries)."""
    config = botocore.config.Config(
        connect_timeout=min(timeout, 5.0),
        read_timeout=timeout,
        retries={"mode": "standard", "total_max_attempts": 2},
        max_pool_connections=max(10, concurrency * 2),
    )
    try:
        return boto3.session.Session().client(
            service, region_name=region, endpoint_url=endpoint_url, config=config
        )
    except botocore.exceptions.NoRegionError:
        raise ConfigurationError(
            f"no AWS region for {service}: add ?region=... to the URL or set AWS_REGION"
        ) from None


def error_code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def client_error(exc: botocore.exceptions.ClientError) -> str:
    """``Code: message`` of an AWS error, secrets masked."""
    error = exc.response.get("Error", {})
    return redact(f"{error.get('Code', 'error')}: {error.get('Message', str(exc))}")


def request_failed(reach: Reachability, exc: BaseException, text: str) -> PublishResult:
    """The verdict on a request that raised without an AWS answer.

    Handed back untried when the endpoint was never reached (refused, timed out, dropped
    before answering), so an outage cannot burn attempts.
    """
    if isinstance(exc, botocore.exceptions.EndpointConnectionError):
        reach.failed(type(exc).__name__)
        return PublishResult.hand_back(text, "unreachable")
    if isinstance(exc, botocore.exceptions.ConnectionClosedError):
        return PublishResult.hand_back(text, "connection_lost")
    if isinstance(
        exc, botocore.exceptions.ReadTimeoutError | botocore.exceptions.ConnectTimeoutError
    ):
        reach.failed(type(exc).__name__)
        return PublishResult.hand_back(text, "timeout")
    return PublishResult.retry(text, type(exc).__name__)


class Throttle:
    """How long to wait after the service said "too fast": doubles per throttled request.

    A throttled message is handed back (attempt refunded) with this as its
    ``retry_after``; a request that goes through resets it.
    """

    def __init__(self, *, base: float = 0.2, cap: float = 10.0) -> None:
        self.base, self.cap, self.streak = base, cap, 0

    def throttled(self, service: str, text: str) -> PublishResult:
        self.streak += 1
        delay = max(self.base / 2, full_jitter(self.streak, base=self.base, cap=self.cap))
        return PublishResult.hand_back(
            f"{service}: throttled: {text}", "throttled", retry_after=delay
        )

    def passed(self) -> None:
        self.streak = 0


def waves(indexes: Sequence[int], key_of: Callable[[int], str]) -> list[list[int]]:
    """``indexes`` in rounds: the n-th message of each key in round n, outbox order kept.

    A batch request may accept a key's later message and refuse its earlier one; sent
    one round after another, a key's next message goes out only once the one before it
    was accepted, so a partial failure never lets a later event of a key overtake it.
    """
    rounds: list[list[int]] = []
    seen: dict[str, int] = {}
    for i in indexes:
        key = key_of(i)
        n = seen.get(key, 0)
        seen[key] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(i)
    return rounds


def blocked(service: str, key: str, after: PublishResult | None) -> PublishResult:
    """A message not sent because an earlier one of its key (``after``'s) failed in this batch.

    Handed back (never tried) a little later than that one asked to wait, so under
    throttling it is claimed again after it, not before. Strict per-key order through
    every kind of retry is ordered mode's (``--ordered``: only a key's head is in flight).
    """
    wait = (after.retry_after or 0.0) + 0.05 if after is not None else 0.05
    return PublishResult.hand_back(
        f"{service}: not sent: an earlier event of key {key[:80]!r} failed in this batch",
        "blocked_by_key",
        retry_after=wait,
    )


def digest_if(value: str, fits: Callable[[str], bool]) -> str:
    """``value`` if the service accepts it as it is, else ``sha256:<hex>`` of it (same key, same
    digest: the order and grouping it stands for are kept)."""
    return value if fits(value) else "sha256:" + hashlib.sha256(value.encode()).hexdigest()


async def call(client: Any, method: str, **kwargs: Any) -> Any:
    """One boto3 call in a worker thread (boto3 is synchronous)."""
    return await asyncio.to_thread(getattr(client, method), **kwargs)


def chunks(
    indexes: Sequence[int], sizes: dict[int, int], max_entries: int, max_bytes: int
) -> list[list[int]]:
    """``indexes`` cut into requests of at most ``max_entries`` and ``max_bytes``, in order."""
    out: list[list[int]] = []
    chunk: list[int] = []
    total = 0
    for i in indexes:
        if chunk and (len(chunk) == max_entries or total + sizes[i] > max_bytes):
            out.append(chunk)
            chunk, total = [], 0
        chunk.append(i)
        total += sizes[i]
    if chunk:
        out.append(chunk)
    return out


def ok(result: PublishResult | None) -> bool:
    return result is not None and result.ok


Results = list[PublishResult | None]


class AwsPublisher:
    """The half every AWS publisher shares: options, client, destinations, verdicts.

    A subclass names its service and destination kind, says which names are valid and
    which error codes mean "no such destination" or "never valid", and implements
    :meth:`_publish_to` for the messages of one destination.
    """

    name: ClassVar[str]
    service: ClassVar[str]  # boto3's name for the client
    kind: ClassVar[str]  # "topic", "stream", "bus": in messages and error classes
    example: ClassVar[str]
    max_bytes: ClassVar[int]  # the service's limit for one message
    limit_name: ClassVar[str]  # how a dead letter names that limit
    counted: ClassVar[str]  # what the size of a message includes
    no_destination: ClassVar[frozenset[str]] = frozenset({"ResourceNotFoundException"})
    never_valid: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        destination: str,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        concurrency: int = DEFAULT_CONCURRENCY,
        max_message_bytes: int | None = None,
    ) -> None:
        if not self._valid(destination.replace(PLACEHOLDER, "x")):
            raise ConfigurationError(
                f"invalid {self.name} {self.kind} {destination!r}: {self._rule()}, an ARN,"
                f" or {PLACEHOLDER} for one {self.kind} per event topic"
            )
        check_options(self.name, timeout, concurrency, max_message_bytes)
        self._destination = destination
        self._region = region
        self._endpoint_url = endpoint_url
        self._timeout = timeout
        self._concurrency = concurrency
        self._limit = min(max_message_bytes or self.max_bytes, self.max_bytes)
        self._lowered = max_message_bytes is not None
        self._slots = asyncio.Semaphore(concurrency)
        self._client: Any = None
        self._throttle = Throttle()
        #: For /readyz: unreachable once requests have failed to connect for a few seconds.
        self.reachability = Reachability()
        #: Event()'s rules and the broker's system destinations, at publish (reserved.py).
        self.guard = Guard(self.name)

    @classmethod
    def _from_url(cls, url: str) -> Any:
        destination, options = parse_url(url, cls.name, cls.example)
        return cls(destination, **options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}={self._destination!r}, region={self._region!r})"

    @staticmethod
    def _valid(name: str) -> bool:
        raise NotImplementedError

    @staticmethod
    def _rule() -> str:
        raise NotImplementedError

    def _ensure_client(self) -> Any:
        if self._client is None:
            self._client = make_client(
                self.service, self._region, self._endpoint_url, self._timeout, self._concurrency
            )
        return self._client

    async def _check_at_start(self, method: str, **kwargs: Any) -> None:
        """One call naming the destination: a missing one is logged, an unreachable service
        leaves the first batch to retry."""
        try:
            client = self._ensure_client()
            if PLACEHOLDER not in self._destination:
                await call(client, method, **kwargs)
        except botocore.exceptions.ClientError as exc:
            log.error(
                "%s %s %r not usable at start: %s",
                self.name,
                self.kind,
                self._destination,
                client_error(exc),
            )
        except ConfigurationError:
            raise
        except Exception as exc:
            log.warning("%s not reachable at start (%s); will retry", self.name, describe(exc))

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close)

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        self._ensure_client()
        results: Results = [None] * len(messages)
        by_destination: dict[str, list[int]] = {}
        for i, message in enumerate(messages):
            if (refused := self.guard.refuse(message)) is not None:
                results[i] = refused
                continue
            destination = self._destination.replace(PLACEHOLDER, message.topic)
            if not self._valid(destination):
                results[i] = PublishResult.permanent(
                    f"{self.name}: {destination[:300]!r} is not a valid {self.kind} name (from"
                    f" topic {message.topic[:80]!r})",
                    f"invalid_{self.kind}",
                )
                continue
            by_destination.setdefault(destination, []).append(i)
        await asyncio.gather(
            *(self._publish_to(d, idx, messages, results) for d, idx in by_destination.items())
        )
        no_outcome = f"{self.name}: no outcome"
        return [r if r is not None else PublishResult.retry(no_outcome) for r in results]

    async def _publish_to(
        self,
        destination: str,
        indexes: list[int],
        messages: Sequence[OutboundMessage],
        results: Results,
    ) -> None:
        raise NotImplementedError

    def _too_large(self, size: int) -> PublishResult:
        if self._lowered:
            named = f"max_message_bytes={self._limit} in the relay's broker URL"
            fix = f"raise it (up to {self.max_bytes}), or send less"
        else:
            named = self.limit_name
            fix = "send less, or a reference to the payload (e.g. an S3 key)"
        return too_large(self.name, size, self.counted, named, self._limit, fix)

    async def _request(
        self, destination: str, chunk: list[int], results: Results, method: str, **kwargs: Any
    ) -> Any:
        """One request for the messages ``chunk``; its reply, or None with their verdicts set."""
        async with self._slots:
            try:
                reply = await call(self._client, method, **kwargs)
            except botocore.exceptions.ClientError as exc:
                self.reachability.succeeded()  # the service answered, with an error
                result = self._answered_with_error(destination, exc)
            except Exception as exc:
                text = f"{self.name}: request failed: {describe(exc)}"
                result = request_failed(self.reachability, exc, text)
            else:
                self.reachability.succeeded()
                return reply
        for i in chunk:
            results[i] = result
        return None

    def _answered_with_error(
        self, destination: str, exc: botocore.exceptions.ClientError
    ) -> PublishResult:
        code = error_code(exc)
        text = client_error(exc)
        if code in self.no_destination:
            return PublishResult.permanent(
                f"{self.name}: {self.kind} {destination!r} does not exist ({text}); create it,"
                " then `outboxkit replay --all-failed`",
                f"no_{self.kind}",
            )
        return self._verdict(code, f"{self.name}: {text}", sender_fault=False)

    def _verdict(self, code: str, text: str, *, sender_fault: bool) -> PublishResult:
        """A refusal by its code: throttled (handed back), never valid (dead), or retried."""
        if code in THROTTLED:
            return self._throttle.throttled(self.name, text)
        if sender_fault or code in self.never_valid:
            return PublishResult.permanent(text, code)
        return PublishResult.retry(text, code or "client_error")

    async def _in_rounds(
        self,
        indexes: list[int],
        key_of: Callable[[int], str],
        results: Results,
        send: Callable[[list[int]], Awaitable[None]],
    ) -> None:
        """Send ``indexes`` round after round (:func:`waves`); a key refused in one round sends
        nothing more of this batch (:func:`blocked`)."""
        failed: dict[str, PublishResult | None] = {}  # key -> its refused message's verdict
        for wave in waves(indexes, key_of):
            ready = []
            for i in wave:
                key = key_of(i)
                if key in failed:
                    results[i] = blocked(self.name, key, failed[key])
                else:
                    ready.append(i)
            await send(ready)
            for i in ready:
                if not ok(results[i]):
                    failed[key_of(i)] = results[i]
