"""``manage.py outboxkit_relay --broker URL [options of outboxkit relay]``."""

from outboxkit.contrib.django.cli import OutboxkitCommand


class Command(OutboxkitCommand):
    help = (
        "Publish the outbox's events to a broker until stopped: `outboxkit relay` on the"
        " connection of DATABASES[--database] (--help lists its options)."
    )
    command = "relay"
