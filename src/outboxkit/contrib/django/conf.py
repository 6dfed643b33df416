"""The app's settings: ``settings.OUTBOXKIT``, read and checked once.

Every key is optional; an unknown key is an error (a typo would otherwise be ignored and
the default used silently). ``override_settings(OUTBOXKIT=...)`` in tests is honoured for
the writes (the cache is cleared), not for the model's table, fixed when models load.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from outboxkit.backends.postgres.inbox_sql import DEFAULT_INBOX_TABLE
from outboxkit.backends.postgres.postgres import DEFAULT_TABLE, parse_table
from outboxkit.errors import ConfigurationError
from outboxkit.events import DEFAULT_MAX_PAYLOAD_BYTES
from outboxkit.limits import DEFAULT_MAX_KEY_BYTES
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE

SETTING = "OUTBOXKIT"


@dataclass(frozen=True, slots=True)
class Config:
    """``settings.OUTBOXKIT`` with its defaults filled in."""

    #: The outbox table (``schema.table`` allowed); the migrations create it.
    TABLE: str = DEFAULT_TABLE
    #: The inbox table the migrations create and ``inbox`` writes; None: no inbox.
    INBOX_TABLE: str | None = DEFAULT_INBOX_TABLE
    #: Task mode's table (and its schedules table) the migrations create and ``tasks``
    #: enqueues into; None: no task table.
    TASKS_TABLE: str | None = DEFAULT_TASKS_TABLE
    #: ``Outbox(notify=...)``: one NOTIFY per transaction wakes an idle relay at once.
    NOTIFY: bool | None = None
    #: ``Outbox(ordered=...)``: per-key commit order for an ordered relay.
    ORDERED: bool = False
    #: ``Outbox(storage=...)``: "table" or "wal" (logical messages for the WAL relay).
    STORAGE: str = "table"
    MAX_PAYLOAD_BYTES: int = DEFAULT_MAX_PAYLOAD_BYTES
    MAX_KEY_BYTES: int = DEFAULT_MAX_KEY_BYTES
    #: psycopg 3: the events go with the atomic block's COMMIT (no round trip of their own);
    #: False: an INSERT at each put (for code that reads its events back before COMMIT).
    WRITE_WITH_COMMIT: bool = True


_KEYS = tuple(Config.__dataclass_fields__)
_TYPES: dict[str, tuple[type, ...]] = {
    "TABLE": (str,),
    "INBOX_TABLE": (str, type(None)),
    "TASKS_TABLE": (str, type(None)),
    "NOTIFY": (bool, type(None)),
    "ORDERED": (bool,),
    "STORAGE": (str,),
    "MAX_PAYLOAD_BYTES": (int,),
    "MAX_KEY_BYTES": (int,),
    "WRITE_WITH_COMMIT": (bool,),
}


def read(raw: Any, engine: str = "") -> Config:
    """Check ``raw`` (the ``OUTBOXKIT`` setting) and fill in the defaults; ``engine``: the
    default database's ``ENGINE`` (what it cannot do is refused at start-up)."""
    if raw is None:
        return Config()
    if not isinstance(raw, dict):
        raise ImproperlyConfigured(
            f"settings.{SETTING} must be a dict such as {{'TABLE': 'outbox'}},"
            f" got {type(raw).__name__}"
        )
    unknown = sorted(set(raw) - set(_KEYS), key=str)
    if unknown:
        raise ImproperlyConfigured(
            f"settings.{SETTING} has unknown key(s) {', '.join(map(repr, unknown))};"
            f" the keys are {', '.join(_KEYS)}"
        )
    for key, value in raw.items():
        if not isinstance(value, _TYPES[key]) or (isinstance(value, bool) and int in _TYPES[key]):
            wanted = " or ".join("None" if t is type(None) else t.__name__ for t in _TYPES[key])
            raise ImproperlyConfigured(
                f"settings.{SETTING}[{key!r}] must be {wanted}, got {type(value).__name__}"
            )
    config = Config(**raw)
    try:
        parse_table(config.TABLE)
        for table in (config.INBOX_TABLE, config.TASKS_TABLE):
            if table is not None:
                parse_table(table)
    except ConfigurationError as exc:
        raise ImproperlyConfigured(f"settings.{SETTING}: {exc}") from None
    if config.STORAGE not in ("table", "wal"):
        raise ImproperlyConfigured(
            f"settings.{SETTING}['STORAGE'] must be 'table' or 'wal', got {config.STORAGE!r}"
        )
    if config.STORAGE == "wal" and "mysql" in engine.lower():
        raise ImproperlyConfigured(
            f"settings.{SETTING}['STORAGE'] = 'wal' writes PostgreSQL's logical replication"
            f" messages, which the default database ({engine}: MariaDB/MySQL) has not:"
            " the WAL relay needs PostgreSQL"
        )
    return config


@functools.cache
def get() -> Config:
    """The settings, read once (and again after ``override_settings``)."""
    engine = str(getattr(settings, "DATABASES", {}).get("default", {}).get("ENGINE", ""))
    return read(getattr(settings, SETTING, None), engine)


def _reset(*, setting: str, **_kwargs: Any) -> None:
    if setting == SETTING:
        get.cache_clear()
        for callback in _on_reset:
            callback()


_on_reset: list[Any] = []
setting_changed.connect(_reset, dispatch_uid="outboxkit.contrib.django.conf")
