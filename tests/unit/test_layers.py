"""The package imports its own modules by their full name, never through the package root.

``from outboxkit import tracing`` reads the name off ``outboxkit/__init__.py`` (the public
surface, which imports nearly everything) and hides which module a layer depends on; the
import-linter contracts in pyproject.toml judge the real module-to-module imports.
"""

from __future__ import annotations

import ast
import pathlib

import outboxkit

SRC = pathlib.Path(outboxkit.__file__).parent


def _imports_through_the_root(source: str) -> list[int]:
    """Line numbers of ``from outboxkit import x`` and ``import outboxkit`` in ``source``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            through_root = node.level == 0 and node.module == "outboxkit"
        else:
            through_root = isinstance(node, ast.Import) and any(
                alias.name == "outboxkit" for alias in node.names
            )
        if through_root:
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_imports_outboxkit_through_the_package_root() -> None:
    found = [
        f"{path.relative_to(SRC.parent)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        for line in _imports_through_the_root(path.read_text())
    ]
    assert found == [], "import the module itself (from outboxkit.tracing import ...): " + (
        ", ".join(found)
    )


def test_the_check_sees_both_spellings_and_passes_full_names() -> None:
    source = (
        "from outboxkit import tracing\n"
        "import outboxkit\n"
        "from outboxkit.limits import MAX_KEY_BYTES\n"
        "import outboxkit.errors\n"
        "from . import base\n"
    )
    assert _imports_through_the_root(source) == [1, 2]
