"""Enables outboxkit's testing kit for these tests (its fixtures: docs/testing-your-code.md)."""

pytest_plugins = ["outboxkit.pytest"]
