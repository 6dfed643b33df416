"""The contrib tests' URLs: the admin, two views writing an event (one under
ATOMIC_REQUESTS' atomic block, one in autocommit) and one enqueuing a task."""

import uuid

from django.contrib import admin
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.urls import path

from outboxkit import Event
from outboxkit.contrib.django import outbox, tasks


def place_order(request: HttpRequest) -> HttpResponse:
    outbox.put(Event(topic="orders", event_type="order.placed", payload={"id": str(uuid.uuid4())}))
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after writing its event")
    return HttpResponse("ok")


def ask_report(request: HttpRequest) -> HttpResponse:
    import tests.integration.contrib.django_jobs  # noqa: F401 (registers the handlers)

    tasks.enqueue("report.write", {"file": "/nonexistent", "text": request.GET.get("text", "")})
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after enqueuing its task")
    return HttpResponse("ok")


@transaction.non_atomic_requests
def place_order_autocommit(request: HttpRequest) -> HttpResponse:
    return place_order(request)


urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders/", place_order),
    path("orders-autocommit/", place_order_autocommit),
    path("reports/", ask_report),
]
