"""The app's task handlers: imported by the app registry at start-up (the worker and the
web process alike), never by the view that enqueues."""

from outboxkit.contrib.django import tasks


@tasks.handler("receipt.send")
def send_receipt(payload: dict[str, int]) -> None:
    pass
