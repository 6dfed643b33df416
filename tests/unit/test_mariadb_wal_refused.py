"""What MariaDB/MySQL cannot do, the WAL relay, is refused where the database is known:
at construction, in one line, before any connection (no server needed)."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from outboxkit.errors import ConfigurationError
from outboxkit.publishers.webhook import WebhookPublisher

URL = "mysql://app:S3cret@127.0.0.1:1/shop"


def _publisher() -> Any:
    return WebhookPublisher.from_url("http://127.0.0.1:1/hook")


@pytest.mark.parametrize("url", [URL, URL.replace("mysql://", "mariadb://")])
def test_the_wal_relay_on_a_mysql_url_is_refused_at_construction(url: str) -> None:
    from outboxkit.cdc.relay import CdcRelay

    with pytest.raises(ConfigurationError, match="MariaDB/MySQL has not") as caught:
        CdcRelay(url, _publisher())
    assert "\n" not in str(caught.value) and "S3cret" not in str(caught.value)


def test_relay_source_cdc_on_a_mysql_url_is_refused_at_construction() -> None:
    from outboxkit import Relay

    with pytest.raises(ConfigurationError, match="WAL source"):
        Relay(URL, _publisher(), source="cdc")


@pytest.mark.parametrize("command", ["setup", "status", "drop"])
def test_outboxkit_cdc_on_a_mysql_url_says_so_in_one_line(command: str) -> None:
    from outboxkit.ops.cli.app import main

    result = CliRunner().invoke(main, ["cdc", command, "--dsn", URL])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "MariaDB/MySQL has not" in lines[0], result.output
    assert "Traceback" not in result.output and "S3cret" not in result.output


def test_django_storage_wal_on_a_mysql_default_database_is_refused_at_start_up() -> None:
    pytest.importorskip("django")
    from django.core.exceptions import ImproperlyConfigured

    from outboxkit.contrib.django.conf import read

    with pytest.raises(ImproperlyConfigured, match="'wal' writes PostgreSQL's logical"):
        read({"STORAGE": "wal"}, "django.db.backends.mysql")
    assert read({"STORAGE": "wal"}, "django.db.backends.postgresql").STORAGE == "wal"
    assert read({"STORAGE": "table"}, "django.db.backends.mysql").STORAGE == "table"
