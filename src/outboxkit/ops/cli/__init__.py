"""The ``outboxkit`` command line: the group in ``app``, one module per command group.

``options`` holds the options several commands share, ``output`` what they print,
``guard`` how an expected failure becomes one line; nothing here imports back up.
"""

from outboxkit.ops.cli.app import main
from outboxkit.ops.cli.options import LibraryOption, library_default, parse_duration

__all__ = ["LibraryOption", "library_default", "main", "parse_duration"]
