"""``manage.py outboxkit_status [--json]``."""

from outboxkit.contrib.django.cli import OutboxkitCommand


class Command(OutboxkitCommand):
    help = (
        "Pending, in-flight, failed and published counts: `outboxkit status` on the"
        " connection of DATABASES[--database] (--help lists its options)."
    )
    command = "status"
