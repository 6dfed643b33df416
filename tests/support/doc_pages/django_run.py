"""docs/django.md's snippets in a Django project of their own (tests/integration/test_doc_pages.py).

``python django_run.py write BLOCKS.json``: runs the page's project-side blocks top to bottom
in one process (the inbox's twice: a redelivery) with the names their prose assumes
(``Order``, ``Invoice``, ``customer``, ``total``, the received ``event``), and prints the
framework task's result id. ``python django_run.py result ID``: that result, refreshed.
"""

import json
import sys

import django

django.setup()

from shop.models import Invoice, Order  # noqa: E402

from outboxkit.pytest import received_event  # noqa: E402

if sys.argv[1] == "write":
    names = {
        "Order": Order,
        "Invoice": Invoice,
        "customer": "alice",
        "total": 4200,
        "event": received_event(
            topic="orders", event_type="order.placed", payload={"order_id": 1, "total": 4200}
        ),
    }
    with open(sys.argv[2]) as blocks:
        for where, code in json.load(blocks):
            runs = 2 if "inbox.handle(" in code else 1
            for _ in range(runs):
                exec(compile(code, where, "exec"), names)  # noqa: S102
    result = names["result"]
    print(json.dumps({"id": str(result.id), "status": result.status.name}))
else:
    from reports.tasks import add

    result = add.get_result(sys.argv[2])
    result.refresh()
    print(json.dumps({"status": result.status.name, "value": result.return_value}))
