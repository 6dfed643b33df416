"""The databases outboxkit stores its queues in: one package each (postgres/, mariadb/).

Each package holds its database's SQL, migrations, queue store, admin and migrator; the
layers above reach them through the functions that pick a package from a URL or a
connection, so a third database is one new package plus its contract-suite line.
"""
