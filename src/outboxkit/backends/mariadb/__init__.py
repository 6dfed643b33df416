"""MariaDB (10.6+) and MySQL (8) as a backend: named SQL, versioned migrations, a queue store.

No LISTEN/NOTIFY there: a relay on MariaDB finds events by polling its pending index.
"""
