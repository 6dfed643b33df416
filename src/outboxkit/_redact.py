"""Keep secrets out of logs and errors: passwords in DSNs and URLs are masked."""

from __future__ import annotations

import re

_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)(?P<pw>[^\s/]*)@")
_KV_PASSWORD = re.compile(
    r"(?P<head>\bpassword\s*=\s*)(?P<pw>'(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE
)


def redact(text: str) -> str:
    """Mask ``user:secret@`` in URLs and ``password=secret`` in key/value DSNs."""
    text = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}***@", text)
    return _KV_PASSWORD.sub(lambda m: f"{m.group('head')}***", text)
