"""Queue backends other than PostgreSQL (the reference, in outboxkit.store): one package each."""
