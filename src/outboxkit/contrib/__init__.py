"""Integrations that import a framework (Django, Alembic); the core never imports them."""
