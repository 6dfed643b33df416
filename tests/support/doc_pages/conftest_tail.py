# What the reader's conftest.py holds besides the page's line: the tables of orders.py.
import pytest


@pytest.fixture(autouse=True)
def _order_tables(request):
    if "outboxkit_postgres" in request.fixturenames:
        import orders

        db = request.getfixturevalue("outboxkit_postgres")
        with db.connect() as conn, conn.transaction():
            conn.execute(orders.SCHEMA)
