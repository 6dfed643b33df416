"""Keep secrets out of logs, stored errors and HTTP answers: every text goes through :func:`redact`.

Four nets, widest last:

* URL userinfo — ``nats://TOKEN@host`` and ``amqp://user:pw@host`` — is masked whatever the scheme;
* URL path segments that carry a secret — what follows ``/services/``, ``/hooks/``, ``/webhooks/``
  or ``/key/`` (Slack's ``/services/T…/B…/TOKEN``, Discord's ``/api/webhooks/ID/TOKEN``) unless it
  is a lowercase word or a ``{template}``, and anywhere a long run of letters and digits;
* secret-looking parameters — ``?token=``, ``api_key=``, ``sslpassword=`` in a query string or a
  libpq ``key=value`` DSN, ``"password": "…"`` in JSON, ``Bearer …`` — have their value masked;
* the secrets of the configured URLs (:func:`remember_secrets`) are masked anywhere in free text,
  since a client library's error may quote a token without the URL around it.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

MASK = "***"

_SCHEME = r"[a-zA-Z][a-zA-Z0-9+.-]*://"
# Everything between "scheme://" and the last "@" of the authority is userinfo.
_USERINFO = re.compile(
    rf"(?<![a-zA-Z0-9+.-])(?P<scheme>{_SCHEME})(?P<info>[^\s/?#@]*(?:@[^\s/?#@]*)*)@"
)
# Names whose value is a secret wherever they appear (query string, DSN, JSON, free text).
_SECRET_WORDS = "|".join(  # names of secrets, not secrets
    (
        r"passw(?:or)?d|passphrase|pwd|secret|token|api[_-]?key|apikey|access[_-]?key",
        r"private[_-]?key|signature|credentials?|session[_-]?key|auth[_-]?key",
    )
)
# Short names that are secrets only as URL query parameters (after ? or &).
_QUERY_NAME = r"[?&](?:sig|key|auth|pass|pw|jwt|nkey|seed|sas|code)"
_VALUE = r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[^\s&#;\"']+"
# The match starts at the secret word, not at the name's start ("ssl_password" matches at
# "password") and the rest of a name is bounded: the scan stays linear; only the value is
# replaced.
_NAMED = re.compile(
    rf"(?P<head>(?:(?:{_SECRET_WORDS})[\w.-]{{0,40}}|{_QUERY_NAME})"
    rf"(?:\s*=\s*|[\"']?\s*:\s+|[\"']\s*:\s*))(?P<value>{_VALUE})",
    re.IGNORECASE,
)
# Every name _NAMED can match contains one of these (lowercase).
_HINTS = (
    *("pass", "pw", "secret", "token", "key", "signature", "credential", "auth", "sig"),
    *("jwt", "seed", "sas", "code", "cookie"),
)
_MAX_CACHED_CHARS = 4096
# A URL's path: after "scheme://authority", up to a query, a fragment, a space or a quote.
_URL_PATH = re.compile(
    rf"(?<![a-zA-Z0-9+.-])(?P<base>{_SCHEME}[^\s/?#\"'<>]*)(?P<path>/[^\s?#\"'<>()\[\]]*)"
)
# Path segments after which the rest of a path is a credential (webhook services, key paths).
_SECRET_PATH_NAMES = frozenset(
    {"services", "hooks", "hook", "webhooks", "webhook", "key", "keys", "token", "tokens"}
    | {"secret", "secrets", "apikey", "api_key", "api-key", "password", "sig", "signature"}
)
_WORD = re.compile(r"[a-z][a-z._-]*")  # "orders", "catch", "incoming": names, not secrets
_TEMPLATE = re.compile(r"\{[^{}/]*\}")  # "{topic}", filled in per event
#: A path segment at least this long made of letters and digits is a token wherever it is.
MIN_PATH_TOKEN = 20
# The header net, for text that prints headers (a logged dict or JSON of them, an HTTP
# header line in a client's error): the value of a credential-named header, by its name
# (secret_header), whatever the value looks like (a header line keeps its scheme word).
_QUOTED_PAIR = re.compile(
    r"(?P<head>(?P<q>[\"'])(?P<name>[\w.-]{1,60})(?P=q)\s*:\s*)"
    r"(?P<value>\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*')"
)
_HEADER_LINE = re.compile(
    r"(?P<head>\b(?:proxy-)?(?:authorization|set-cookie|cookie)\s*:\s*"
    r"(?:(?:Bearer|Basic|Token|Digest)\s+)?)"
    r"(?P<value>[^\s\"',}][^\r\n\"',}]*)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"\b(?P<head>(?:Bearer|Basic)\s+)(?P<value>[A-Za-z0-9._~+/=-]{8,})")
# A lone name before "@" is a user name, not a token, for these schemes.
_USER_SCHEMES = frozenset(
    {"postgres", "postgresql", "amqp", "amqps", "redis", "rediss", "mysql", "sqs"}
)
#: Shorter secrets are masked in their URL or parameter, never searched for in free text.
MIN_KNOWN_SECRET = 6
_MAX_KNOWN = 64

_known: dict[str, None] = {}  # ordered set: oldest first
_known_re: re.Pattern[str] | None = None
_lock = threading.Lock()


def redact(text: str) -> str:
    """``text`` with every URL userinfo, secret-looking parameter and known secret masked."""
    if len(text) > _MAX_CACHED_CHARS:
        return _redact(text)
    return _redact_cached(text)


def _redact(text: str) -> str:
    pattern = _known_re
    if pattern is not None:
        text = pattern.sub(MASK, text)
    if "://" in text:
        text = _USERINFO.sub(_mask_userinfo, text)
        text = _URL_PATH.sub(_mask_path, text)
    lower = text.lower()
    # Substring tests are ~50x cheaper than the regex on text that names no secret.
    if any(hint in lower for hint in _HINTS):
        text = _NAMED.sub(_mask_value, text)
        if ":" in text:
            text = _QUOTED_PAIR.sub(_mask_quoted_header, text)
            text = _HEADER_LINE.sub(_mask_value, text)
    if "Bearer" in text or "Basic" in text:
        text = _BEARER.sub(_mask_value, text)
    return text


# During an outage every failed event carries the same error: one redaction for all.
_redact_cached = functools.lru_cache(maxsize=512)(_redact)


def remember_secrets(url_or_dsn: str) -> None:
    """Mask the secrets of this URL or DSN wherever they later appear, even without the URL.

    Called for the configured database and broker URLs; cheap and idempotent.
    """
    found = [s for s in _secrets_of(url_or_dsn) if len(s) >= MIN_KNOWN_SECRET]
    if not found:
        return
    global _known_re
    with _lock:
        for secret in found:
            _known.pop(secret, None)
            _known[secret] = None
        while len(_known) > _MAX_KNOWN:
            del _known[next(iter(_known))]
        # Longest first, so a secret that contains another is masked whole.
        ordered = sorted(_known, key=len, reverse=True)
        _known_re = re.compile("|".join(re.escape(s) for s in ordered))
        _redact_cached.cache_clear()


def forget_secrets() -> None:
    """Drop every remembered secret (tests)."""
    global _known_re
    with _lock:
        _known.clear()
        _known_re = None
        _redact_cached.cache_clear()


def _secrets_of(text: str) -> set[str]:
    found: set[str] = set()
    for m in _USERINFO.finditer(text):
        user, colon, password = m.group("info").partition(":")
        scheme = m.group("scheme")[:-3].lower()
        if colon:
            found.add(password)
        elif scheme not in _USER_SCHEMES:
            found.add(user)  # token-only userinfo: nats://TOKEN@host
    for m in _URL_PATH.finditer(text):
        # Only the distinctive ones are searched for in free text: "Orders" after /hooks/ is
        # masked in its URL, but would mask every "OrdersPlaced" elsewhere.
        for segment in _secret_segments(m.group("path")):
            if len(segment) >= 12 or _has_letter_and_digit(segment):
                found.add(segment)
    for m in _NAMED.finditer(text):
        found.add(_unquote_value(m.group("value")))
    found |= {unquote(s) for s in found}
    found.discard("")
    return found


def _unquote_value(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _mask_userinfo(m: re.Match[str]) -> str:
    info = m.group("info")
    if not info or info == MASK:
        return m.group(0)
    user, colon, _password = info.partition(":")
    if colon and user != MASK:
        return f"{m.group('scheme')}{user}:{MASK}@"
    return f"{m.group('scheme')}{MASK}@"


def _mask_value(m: re.Match[str]) -> str:
    value = m.group("value")
    if value in (MASK, f'"{MASK}"', f"'{MASK}'"):
        return m.group(0)
    quote = value[0] if value[:1] in ("'", '"') and len(value) >= 2 else ""
    return f"{m.group('head')}{quote}{MASK}{quote}"


def _secret_segments(path: str) -> list[str]:
    """The segments of a URL path that carry a secret (see the module's docstring)."""
    found: list[str] = []
    after_name = False
    for segment in path.split("/"):
        if not segment or segment == MASK or _TEMPLATE.fullmatch(segment):
            continue
        if after_name:
            if not _WORD.fullmatch(segment):
                found.append(segment)
        elif len(segment) >= MIN_PATH_TOKEN and _has_letter_and_digit(segment):
            found.append(segment)
        if segment.lower() in _SECRET_PATH_NAMES:
            after_name = True
    return found


def _has_letter_and_digit(text: str) -> bool:
    return any(c.isdigit() for c in text) and any(c.isalpha() for c in text)


def _mask_path(m: re.Match[str]) -> str:
    path = m.group("path")
    secrets = set(_secret_segments(path))
    if not secrets:
        return m.group(0)
    masked = "/".join(MASK if s in secrets else s for s in path.split("/"))
    return m.group("base") + masked


# Header names whose value is a credential whatever it looks like ("Bearer s3cr3t" is too
# short for the Bearer net, "Token abc..." has no prefix it knows).
_SECRET_HEADER = re.compile(r"authorization|cookie|token|secret|key|passw(?:or)?d|auth", re.I)
#: Names that contain one of those words but carry no secret (shown as they are; so is any
#: name ending in "idempotency-key", as the reserved name's suggested rename does).
PUBLIC_HEADERS = frozenset({"idempotency-key", "partition-key", "ordering-key", "ce-partitionkey"})


def secret_header(name: str) -> bool:
    """Whether a header of this name carries a credential (see :func:`mask_headers`)."""
    lowered = name.lower().replace("_", "-")
    public = lowered in PUBLIC_HEADERS or lowered.endswith("idempotency-key")
    return not public and _SECRET_HEADER.search(lowered) is not None


def mask_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """``headers`` with the value of every credential-named header masked (authorization,
    cookie, and names containing token, secret, key, password or auth), the rest redacted."""
    shown: dict[str, Any] = {}
    for name, value in (headers or {}).items():
        if secret_header(str(name)):
            shown[name] = MASK
        else:
            shown[name] = redact(value) if isinstance(value, str) else value
    return shown


def _mask_quoted_header(m: re.Match[str]) -> str:
    # "key" alone is the event's ordering key in a logged event, not a header's credential.
    if m.group("name").lower() == "key" or not secret_header(m.group("name")):
        return m.group(0)
    return _mask_value(m)
