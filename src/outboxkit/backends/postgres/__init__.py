"""PostgreSQL, the reference backend: its SQL (postgres.py and one *_sql.py per feature),
migrations, queue and task stores, admin and migrator."""
