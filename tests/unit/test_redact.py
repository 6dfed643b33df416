"""The redactor: every userinfo, every secret-looking parameter, the configured secrets anywhere."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outboxkit._redact import forget_secrets, redact, remember_secrets

TOKEN = "s3cr3tT0ken-9f8e7d"


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    forget_secrets()
    yield
    forget_secrets()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # token-only userinfo, whatever the scheme
        (f"nats://{TOKEN}@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
        (f"https://{TOKEN}@hooks.example.com/x", "https://***@hooks.example.com/x"),
        (f"tls://{TOKEN}@h:4222", "tls://***@h:4222"),
        # user:password keeps the user name
        (f"postgresql://app:{TOKEN}@db:5432/shop", "postgresql://app:***@db:5432/shop"),
        (f"amqp://guest:{TOKEN}@mq/", "amqp://guest:***@mq/"),
        (f"redis://:{TOKEN}@r:6379/0", "redis://:***@r:6379/0"),
        # a password holding "@" or ":" is masked whole, the host stays
        ("nats://u:p@ss:w@h:4222", "nats://u:***@h:4222"),
        # in free text, among others
        (
            f"nats: error connecting to nats://{TOKEN}@127.0.0.1:4222 (refused); retrying",
            "nats: error connecting to nats://***@127.0.0.1:4222 (refused); retrying",
        ),
        (
            f"servers nats://a:{TOKEN}@h1:1,nats://{TOKEN}@h2:2",
            "servers nats://a:***@h1:1,nats://***@h2:2",
        ),
    ],
)
def test_every_userinfo_is_masked(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(
    "query",
    [
        "token",
        "api_key",
        "apikey",
        "api-key",
        "ssl_password",
        "sslpassword",
        "password",
        "passwd",
        "client_secret",
        "secret",
        "access_key",
        "aws_secret_access_key",
        "X-Amz-Signature",
        "X-Amz-Security-Token",
        "sig",
        "signature",
        "key",
        "auth",
        "jwt",
        "nkey",
    ],
)
def test_secret_query_parameters_are_masked(query: str) -> None:
    url = f"https://h.example.com/hook?topic=orders&{query}={TOKEN}&page=2#frag"
    out = redact(url)
    assert TOKEN not in out
    assert out == f"https://h.example.com/hook?topic=orders&{query}=***&page=2#frag"
    first = redact(f"nats://h:4222?{query}={TOKEN}")
    assert first == f"nats://h:4222?{query}=***"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # libpq key=value DSNs, quoted or not
        (
            f"host=db port=5432 user=app password={TOKEN} dbname=shop",
            "host=db port=5432 user=app password=*** dbname=shop",
        ),
        ("host=db password='pa ss\\'word' dbname=shop", "host=db password='***' dbname=shop"),
        (f"host=db sslpassword = {TOKEN} x=1", "host=db sslpassword = *** x=1"),
        # JSON and YAML-ish
        (f'{{"user": "a", "password": "{TOKEN}"}}', '{"user": "a", "password": "***"}'),
        (f"api_key: {TOKEN}", "api_key: ***"),
        # HTTP credentials
        (f"Authorization: Bearer {TOKEN}", "Authorization: Bearer ***"),
    ],
)
def test_dsn_json_and_header_secrets_are_masked(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "publish failed, will retry: topic=orders event_id=1 attempt=2 error_class=timeout",
        "nats://127.0.0.1:4222",
        "kafka://b1:9092,b2:9092",
        'FATAL:  password authentication failed for user "app"',
        "fe_sendauth: no password supplied",
        "https://example.com/hooks/{topic}?keyed=1&topic=a",
        "relay summary: 3 claims claimed=10 published=10",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact(text) == text


def test_redaction_is_idempotent() -> None:
    text = (
        f"nats://{TOKEN}@h nats://u:{TOKEN}@h ?token={TOKEN} password='{TOKEN}' "
        f'"secret": "{TOKEN}" Bearer {TOKEN}'
    )
    once = redact(text)
    assert TOKEN not in once
    assert redact(once) == once


def test_secrets_of_configured_urls_are_masked_anywhere_in_free_text() -> None:
    pw = "hunter2-Pa%40ss"  # percent-encoded in the URL, decoded by the client
    remember_secrets(f"nats://{TOKEN}@127.0.0.1:4222")
    remember_secrets(f"postgresql://app:{pw}@db/shop?sslpassword=keyfile-pass")
    remember_secrets("https://h/hook?api_key=abcdef123456")
    text = (
        f"nats: 'Authorization Violation' for {TOKEN}; "
        "auth failed with hunter2-Pa@ss; key abcdef123456 and keyfile-pass"
    )
    out = redact(text)
    for secret in (TOKEN, "hunter2-Pa@ss", "abcdef123456", "keyfile-pass"):
        assert secret not in out
    assert out.startswith("nats: 'Authorization Violation' for ***;")


def test_user_names_and_short_secrets_are_not_searched_in_free_text() -> None:
    remember_secrets("postgresql://postgres@db/shop")  # a user name, not a token
    remember_secrets("nats://abc@h:4222")  # too short to mask in prose
    assert redact("postgres says abc") == "postgres says abc"
    assert redact("nats://abc@h:4222") == "nats://***@h:4222", "still masked in its URL"


def test_redaction_time_is_linear_in_the_text() -> None:
    """A 50 MB key once reached a log line: the scan must not be quadratic.

    Measured as a ratio (4x the text must take well under 16x the time, the quadratic
    figure), best of three, so a busy machine slows both sides alike.
    """
    import time

    def best(text: str) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            redact(text + "!")  # not cached: a new string each call
            times.append(time.perf_counter() - started)
        return min(times)

    remember_secrets(f"nats://{TOKEN}@h:4222")
    units = (("x", 50_000), ("a1", 25_000), ("token", 10_000), ("k=v&", 12_500))
    headers = (("'x-auth': '", 5_000), ("Cookie: ", 6_000))
    for unit, n in (*units, *headers):
        small, large = best(unit * n), best(unit * n * 4)
        assert large < 8 * small + 0.01, (unit, small, large)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Slack-style: everything after /services/ is the credential
        (
            "relay to https://hooks.example/services/T000/B000/XXXX now",
            "relay to https://hooks.example/services/***/***/*** now",
        ),
        # Discord-style: /api/webhooks/ID/TOKEN
        (
            "https://discord.example/api/webhooks/123456789012345678/abcDEF_ghi-JKL0",
            "https://discord.example/api/webhooks/***/***",
        ),
        # a key as a path segment
        (
            "https://maker.example/trigger/ev/with/key/dK3j2kLmn0",
            "https://maker.example/trigger/ev/with/key/***",
        ),
        # a long token anywhere in a path, userinfo and query masked as well
        (
            "https://u:pw@h.example/in/0190c2a17e2b7c3d9a8b1234567890ab?token=abc&x=1",
            "https://u:***@h.example/in/***?token=***&x=1",
        ),
    ],
)
def test_secrets_in_url_paths_are_masked(text: str, expected: str) -> None:
    assert redact(text) == expected
    assert redact(expected) == expected


@pytest.mark.parametrize(
    "text",
    [
        "https://example.com/hooks/{topic}/{event_type}",
        "https://api.example.com/hooks/orders/eu",
        "https://sqs.us-east-1.amazonaws.com/123456789012/orders",
        "http://127.0.0.1:8080/dashboard/api/failed",
    ],
)
def test_url_paths_without_secrets_are_left_alone(text: str) -> None:
    assert redact(text) == text


def test_a_webhook_path_token_is_masked_anywhere_once_its_url_is_configured() -> None:
    token = "XXXXXXXXXXXXXXXXXXXXXXXX1"
    remember_secrets(f"https://hooks.example/services/T000/B000/{token}")
    assert redact(f"client error for token {token}") == "client error for token ***"
    remember_secrets("https://example.com/hooks/Orders")  # masked in its URL, not searched for
    assert redact("OrdersPlaced") == "OrdersPlaced"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a logged dict or JSON of headers: by the header's name, whatever the value
        (
            "headers={'authorization': 'Token abcdefghijkl', 'x-tenant': 'acme'}",
            "headers={'authorization': '***', 'x-tenant': 'acme'}",
        ),
        ('{"Authorization": "Bearer s3cr3t"}', '{"Authorization": "***"}'),
        ("{'Cookie': 'sid=1', 'X-Signing-Key': 'k1'}", "{'Cookie': '***', 'X-Signing-Key': '***'}"),
        # an HTTP header line quoted in a client's error
        (
            "401 for request with Authorization: Token abcdefghijkl",
            "401 for request with Authorization: Token ***",
        ),
        ("Set-Cookie: sid=abc123; Path=/", "Set-Cookie: ***"),
        # the names that carry no secret, and the event's own key, stay readable
        (
            "{'idempotency-key': 'order-77', 'key': 'acct-1', 'ordering_key': 'a'}",
            "{'idempotency-key': 'order-77', 'key': 'acct-1', 'ordering_key': 'a'}",
        ),
    ],
)
def test_header_values_are_masked_by_the_headers_name(text: str, expected: str) -> None:
    """Before: only Bearer/Basic values of 8+ characters were masked in free text, so a log
    line printing headers showed 'Token abcdefghijkl' and cookies (issue 32 item 5)."""
    assert redact(text) == expected


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_log_line_printing_headers_and_a_dsn_masks_them(fmt: str) -> None:
    import logging

    from outboxkit.ops.logs import JsonFormatter, RedactingFormatter

    record = logging.LogRecord(
        "outboxkit.relay", logging.WARNING, __file__, 1,
        "publish to %s failed; headers %s",
        ("postgresql://app:pa55word@db/shop", {"authorization": "Token abcdefghijkl",
                                                "cookie": "sid=1", "x-tenant": "acme"}),
        None,
    )  # fmt: skip
    formatter = JsonFormatter() if fmt == "json" else RedactingFormatter("%(message)s")
    line = formatter.format(record)
    for secret in ("pa55word", "abcdefghijkl", "sid=1"):
        assert secret not in line
    assert "acme" in line and "app:***@db" in line
