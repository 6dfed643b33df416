from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.urls import path

from outboxkit.contrib.django import tasks


def place_order(request: HttpRequest) -> HttpResponse:
    with transaction.atomic():
        tasks.enqueue("receipt.send", {"order": 7})
    return HttpResponse("ok")


urlpatterns = [path("orders/", place_order)]
