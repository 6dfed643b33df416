"""Celery's message protocol 2: an outbox event written by ``contrib.celery`` as a task message.

``send_task`` writes the body (``[args, kwargs, embed]``, JSON) as the event's payload
and the few values only known at write time as ``celery-*`` event headers; this module
turns them into the headers and properties a Celery 5 worker reads (celery/app/amqp.py
``as_task_v2``), and, for kombu's Redis transport, into the JSON envelope its virtual
channel pushes onto the queue's list.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from outboxkit.wire.cloudevents import Outbound

#: The event headers ``send_task`` writes (values are strings, as every event header).
TASK_ID = "celery-id"
ETA = "celery-eta"
ARGSREPR = "celery-argsrepr"
KWARGSREPR = "celery-kwargsrepr"
ORIGIN = "celery-origin"

CONTENT_TYPE = "application/json"
CONTENT_ENCODING = "utf-8"
#: AMQP delivery mode 2: the broker keeps the message on disk, as Celery's default.
PERSISTENT = 2


def is_task(message: Outbound) -> bool:
    """Whether the event was written by ``send_task`` (it carries a Celery task id)."""
    return TASK_ID in message.headers


def task_headers(message: Outbound) -> dict[str, Any]:
    """Protocol 2's headers: the task name is the event type, the id a header of its own."""
    headers = message.headers
    task_id = headers[TASK_ID]
    return {
        "lang": "py",
        "task": message.event_type,
        "id": task_id,
        "shadow": None,
        "eta": headers.get(ETA),
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": headers.get(ARGSREPR, ""),
        "kwargsrepr": headers.get(KWARGSREPR, ""),
        "origin": headers.get(ORIGIN, "outboxkit"),
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }


def redis_envelope(message: Outbound, queue: str, *, delivery_tag: str) -> bytes:
    """The JSON kombu's Redis transport LPUSHes onto ``queue`` (its ``_put`` after routing).

    The body goes base64-encoded, as kombu's virtual channel sends it
    (``body_encoding: base64``); the exchange and routing key are Celery's default
    routing for the queue (a direct exchange named after it, routing key = queue).
    """
    task_id = message.headers[TASK_ID]
    envelope = {
        "body": base64.b64encode(message.payload).decode("ascii"),
        "content-encoding": CONTENT_ENCODING,
        "content-type": CONTENT_TYPE,
        "headers": task_headers(message),
        "properties": {
            "correlation_id": task_id,
            "reply_to": "",
            "delivery_mode": PERSISTENT,
            "delivery_info": {"exchange": queue, "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": delivery_tag,
        },
    }
    return orjson.dumps(envelope)
