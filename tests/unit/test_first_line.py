"""outboxkit._text.first_line: the one way an exception becomes a one-line log phrase."""

from __future__ import annotations

from outboxkit._redact import remember_secrets
from outboxkit._text import first_line


def test_a_server_error_keeps_only_its_first_line() -> None:
    exc = ConnectionError('  connection failed: FATAL: database "shop" does not exist\nDETAIL: x\n')
    assert first_line(exc) == 'connection failed: FATAL: database "shop" does not exist'
    assert first_line(exc, with_type=True).startswith("ConnectionError: connection failed")


def test_an_empty_message_is_the_type_name_never_blank_or_doubled() -> None:
    assert first_line(TimeoutError()) == "TimeoutError"
    assert first_line(TimeoutError("   "), with_type=True) == "TimeoutError"


def test_secrets_in_the_first_line_are_masked() -> None:
    remember_secrets("postgresql://app:s3cr3t-first-line@db/shop")
    line = first_line(OSError("cannot connect to postgresql://app:s3cr3t-first-line@db/shop\nmore"))
    assert "s3cr3t-first-line" not in line and "more" not in line
