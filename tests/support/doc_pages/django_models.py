"""The models docs/django.md's snippets write (``shop/models.py`` of the test's project)."""

from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100)
    total = models.IntegerField()


class Invoice(models.Model):
    order_id = models.BigIntegerField()
    total = models.IntegerField()
