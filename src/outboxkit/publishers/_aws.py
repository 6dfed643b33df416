"""What the SNS, Kinesis and EventBridge publishers share: URL options, the client, verdicts.

Credentials always come from boto3's own chain (environment, profile, container or
instance role); a URL with credentials in it is refused, and no message here ever
carries more than an AWS error code and its text, passed through ``redact``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import boto3
import botocore.config
import botocore.exceptions

from outboxkit._backoff import full_jitter
from outboxkit._redact import redact
from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import PublishResult, Reachability

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
