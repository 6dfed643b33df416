"""Amazon EventBridge: ``Source``, ``DetailType`` and ``Time`` from the event, ``Detail`` the
event itself in CloudEvents JSON (``wire.cloudevents_json``).

``Source`` is the CloudEvents ``source`` (``/outboxkit/<aggregate type>``), ``DetailType``
the event type, ``Time`` when it occurred; ``Detail`` carries the id (EventBridge has no
deduplication: consumers dedup on ``detail.id``), the other attributes, the headers and the
payload as ``detail.data`` (JSON) or ``detail.data_base64`` (anything else), so rules
match on ``detail.data.<field>``. A rule's target (an SQS queue, a Lambda) receives
EventBridge's event with that object as its ``detail``.
"""

from __future__ import annotations

from typing import Any

import orjson

from outboxkit.wire import cloudevents_json
from outboxkit.wire.cloudevents import Outbound

#: What EventBridge counts for ``Time`` in an entry's size.
TIME_BYTES = 14


def encode(message: Outbound) -> tuple[dict[str, Any], int]:
    """A PutEvents entry (without ``EventBusName``) and its size as EventBridge counts it."""
    ce = message.cloudevents_attributes()
    detail = cloudevents_json.encode(message).decode("utf-8")
    entry: dict[str, Any] = {
        "Source": ce["source"],
        "DetailType": message.event_type,
        "Detail": detail,
        "Time": message.time,
    }
    size = (
        TIME_BYTES
        + len(ce["source"].encode())
        + len(message.event_type.encode())
        + len(detail.encode())
    )
    return entry, size


def unwrap_event(body: str) -> Any:
    """The ``detail`` of an EventBridge event (as a rule's target receives it) written by the
    EventBridge publisher, parsed; None if ``body`` is not such an event."""
    if '"detail-type"' not in body:
        return None
    try:
        document: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(document, dict):
        return None
    detail = document.get("detail")
    if "detail-type" not in document or not isinstance(detail, dict) or "specversion" not in detail:
        return None
    return detail
