"""Log setup for the commands: readable text by default, one JSON object per line on request.

Every line passes through :func:`redact`, exceptions included, so a DSN or broker
URL with a password never reaches a log, whatever code logged it. Control characters
in logged values are escaped, so a topic holding a newline cannot forge a log line,
and client libraries' lines are rate-limited, so an outage stays a few lines.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
import time
from typing import Any

from outboxkit._redact import redact

# Attributes every LogRecord has; anything else came from ``extra=`` and is a field.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
#: librdkafka's own lines (the Kafka publisher hands it this logger).
LIBRDKAFKA_LOGGER = "outboxkit.kafka.librdkafka"
_NOISY = (
    *("nats", "psycopg", "asyncio", "httpx", "aiormq", "aio_pika", "botocore", "aiohttp"),
    LIBRDKAFKA_LOGGER,
)

# C0 controls, DEL, C1 controls (ESC and CSI start terminal escapes), Unicode line breaks.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# The same minus the line feed: a traceback keeps its lines, each indented.
_CONTROL_BUT_LF = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(text: str) -> str:
    r"""``text`` on one line: ``\n``, ``\r``, ``\t`` and other control characters as escapes."""
    return _CONTROL.sub(_escape_one, text)


def _escape_one(m: re.Match[str]) -> str:
    char = m.group()
    return _SHORT.get(char) or (
        f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"
    )


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra fields, "exc"}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value if isinstance(value, int | float | bool) else redact(str(value))
        if record.exc_info:
            entry["exc"] = redact(self.formatException(record.exc_info))
        # json.dumps escapes C0 controls (newlines included); C1 controls and U+2028/9 pass
        # through with ensure_ascii=False, and some terminals and viewers act on them.
        return _CONTROL.sub(_json_escape, json.dumps(entry, ensure_ascii=False))


def _json_escape(m: re.Match[str]) -> str:
    return f"\\u{ord(m.group()):04x}"


class RedactingFormatter(logging.Formatter):
    """The text format: secrets masked, one line per record, tracebacks indented.

    A fleet's record names its database first (``[name] message``). The message (values
    included) is escaped onto one line; a traceback's lines follow it,
    each indented, so no value can start a line that reads like a record of its own.
    """

    def format(self, record: logging.LogRecord) -> str:
        msg, args, exc_text = record.msg, record.args, record.exc_text
        message = record.getMessage()
        database = getattr(record, "database", None)  # (a fleet's: outboxkit.fleet)
        if database is not None:
            message = f"[{database}] {message}"
        record.msg, record.args = escape_controls(redact(message)), None
        try:
            text = super().format(record)
        finally:
            record.msg, record.args, record.exc_text = msg, args, exc_text
        head, newline, tail = text.partition("\n")
        if not newline:
            return head
        tail = _CONTROL_BUT_LF.sub(_escape_one, redact(tail))
        return head + "".join(f"\n    {line}" for line in tail.split("\n"))


class LibraryLogLimiter(logging.Filter):
    """At most one line per ``interval`` for each kind of client-library line.

    Client libraries (nats-py, aio-pika, aiohttp, librdkafka) log every reconnect attempt;
    the relay reports the outage itself (sink/outage.py). A kind is the logger, level and
    message template (and librdkafka's facility); the next line let through says how many
    were held back. librdkafka's ERRORs are connection trouble the relay retries: WARNING.
    """

    def __init__(self, interval: float = 60.0) -> None:
        super().__init__()
        self.interval = interval
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if name.startswith("outboxkit") and not name.startswith(LIBRDKAFKA_LOGGER):
            return True
        if name.startswith(LIBRDKAFKA_LOGGER) and record.levelno == logging.ERROR:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            if not logging.getLogger(name).isEnabledFor(logging.WARNING):
                return False
        template = str(record.msg)
        if isinstance(record.args, tuple) and record.args and template.startswith("%s"):
            template += str(record.args[0])[:40]  # librdkafka: "%s [%s] %s" % (facility, …)
        key = (name, record.levelno, template[:200])
        now = time.monotonic()
        last, held = self._seen.get(key, (-self.interval, 0))
        if now - last < self.interval:
            self._seen[key] = (last, held + 1)
            return False
        if len(self._seen) > 1000:  # bound the table: forget kinds not seen for an interval
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.interval}
        self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.getMessage()} ({held} similar line(s) held back)"
            record.args = None
        return True


def setup_logging(level: str, fmt: str) -> None:
    """Route every logger to stderr in ``fmt`` ("text" or "json") at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            RedactingFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
        )
    handler.addFilter(LibraryLogLimiter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Client libraries are chatty at INFO about reconnects we already report.
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
