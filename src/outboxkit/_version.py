"""The version of outboxkit, in its one place: the wheel's metadata (pyproject.toml's
[tool.hatch.version]), ``outboxkit.__version__`` and ``outboxkit --version`` read it here."""

__version__ = "0.1.0"
