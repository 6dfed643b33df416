"""Amazon SNS: the SQS binding's message (``wire.sqs``), and the JSON envelope SNS wraps it in.

A queue subscribed without raw message delivery receives SNS's notification document,
``{"Type": "Notification", "TopicArn": …, "Message": BODY, "MessageAttributes":
{NAME: {"Type": "String", "Value": …}}}``; with raw delivery it receives BODY with the
attributes as SQS message attributes, exactly as the SQS publisher sends them.
"""

from __future__ import annotations

from typing import Any

import orjson


def unwrap_notification(body: str) -> tuple[str, dict[str, str]] | None:
    """BODY and the attributes of an SNS notification envelope; None if ``body`` is not one."""
    if not body.startswith("{") or '"TopicArn"' not in body:
        return None
    try:
        document: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if (
        not isinstance(document, dict)
        or document.get("Type") != "Notification"
        or not isinstance(document.get("Message"), str)
    ):
        return None
    attributes: dict[str, str] = {}
    for name, value in (document.get("MessageAttributes") or {}).items():
        if isinstance(value, dict) and isinstance(value.get("Value"), str):
            attributes[str(name)] = value["Value"]
    return document["Message"], attributes
