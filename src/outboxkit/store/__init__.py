"""Storage backends. PostgreSQL is the reference backend (``store.postgres``)."""
