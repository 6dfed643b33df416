"""Log setup for the commands: readable text by default, one JSON object per line on request.

Every line passes through :func:`redact`, exceptions included, so a DSN or broker
URL with a password never reaches a log, whatever code logged it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import Any

from outboxkit._redact import redact

# Attributes every LogRecord has; anything else came from ``extra=`` and is a field.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_NOISY = ("nats", "psycopg", "asyncio", "httpx", "aiormq", "aio_pika", "botocore", "aiohttp")


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
        return json.dumps(entry, ensure_ascii=False)


class RedactingFormatter(logging.Formatter):
    """The text format, with secrets masked."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def setup_logging(level: str, fmt: str) -> None:
    """Route every logger to stderr in ``fmt`` ("text" or "json") at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            RedactingFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Client libraries are chatty at INFO about reconnects we already report.
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
