"""settings.OUTBOXKIT: checked once, with errors that name the key and what it takes."""

from __future__ import annotations

from typing import Any

import pytest

from outboxkit.errors import TableNotFoundError


def test_the_defaults_fill_what_is_not_given() -> None:
    from outboxkit.contrib.django.conf import read

    config = read({"TABLE": "shop.outbox"})
    assert (config.TABLE, config.INBOX_TABLE, config.ORDERED) == (
        "shop.outbox",
        "processed_events",
        False,
    )
    assert read(None) == read({})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"TABEL": "x"}, r"unknown key\(s\) 'TABEL'; the keys are TABLE, INBOX_TABLE"),
        ({"NOTIFY": "yes"}, r"\['NOTIFY'\] must be bool or None, got str"),
        ({"MAX_PAYLOAD_BYTES": True}, r"\['MAX_PAYLOAD_BYTES'\] must be int, got bool"),
        ({"TABLE": "drop table; --"}, "invalid outbox table name"),
        ({"TASKS_TABLE": "jobs; --"}, "invalid outbox table name 'jobs; --'"),
        ({"TASKS_TABLE": 3}, r"\['TASKS_TABLE'\] must be str or None, got int"),
        ({"STORAGE": "disk"}, "'table' or 'wal'"),
        (["TABLE"], "must be a dict"),
    ],
)
def test_a_wrong_setting_is_refused_with_what_to_write(raw: Any, message: str) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from outboxkit.contrib.django.conf import read

    with pytest.raises(ImproperlyConfigured, match=message):
        read(raw)


def test_override_settings_points_the_outbox_at_another_table(django_dsn: str) -> None:
    from django.db import transaction
    from django.test import override_settings

    from outboxkit import Event
    from outboxkit.contrib.django import outbox

    event = Event(topic="orders", event_type="order.placed", payload={})
    with override_settings(OUTBOXKIT={"TABLE": "elsewhere"}):
        assert outbox.outbox.table == "elsewhere"
        with pytest.raises(TableNotFoundError, match="elsewhere"), transaction.atomic():
            outbox.put(event)
    assert outbox.outbox.table == "outbox"


def test_without_a_task_table_enqueue_says_which_setting_to_set(django_dsn: str) -> None:
    from django.db import transaction
    from django.test import override_settings

    from outboxkit.contrib.django import DjangoTasks
    from outboxkit.errors import ConfigurationError

    with override_settings(OUTBOXKIT={"TASKS_TABLE": None}), transaction.atomic():
        with pytest.raises(ConfigurationError, match=r"OUTBOXKIT\['TASKS_TABLE'\] is None"):
            DjangoTasks().enqueue("report.write", {})
