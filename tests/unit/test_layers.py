"""The package imports its own modules by their full name, never through the package root.

``from outboxkit import tracing`` reads the name off ``outboxkit/__init__.py`` (the public
surface, which imports nearly everything) and hides which module a layer depends on; the
import-linter contracts in pyproject.toml judge the real module-to-module imports.
"""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import outboxkit

SRC = pathlib.Path(outboxkit.__file__).parent  # the source tree, or the installed wheel's copy
ROOT = pathlib.Path(__file__).resolve().parents[2]


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


# -- the import-linter contracts (pyproject.toml) bite -------------------------------------

LINT_IMPORTS = pathlib.Path(sys.executable).with_name("lint-imports")
VIOLATIONS = [  # (module, what it newly imports): each against one rule of pyproject.toml
    (
        "backends/postgres/postgres.py",
        "outboxkit.publishers",
    ),  # the database side under the brokers
    ("relay/engine.py", "outboxkit.testing"),  # the core under the test servers
    ("consumers/base.py", "outboxkit.relay"),  # two independent siblings
    ("limits.py", "outboxkit.events"),  # a helper above its layer
    ("write/outbox.py", "nats"),  # the write side and a broker client
    ("publishers/base.py", "psycopg"),  # a publisher and the database
    ("relay/engine.py", "fastapi"),  # the core and a framework
    ("tasks/worker.py", "outboxkit.backends.postgres"),  # task mode past its port
    ("tasks/context.py", "outboxkit.backends.mariadb"),  # (the enqueues alone may)
]


def _lint_imports(tmp_path: pathlib.Path, plant: tuple[str, str] | None) -> str:
    tree = tmp_path / "tree"
    shutil.copytree(SRC, tree / "outboxkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    if plant is not None:
        module, line = plant
        with (tree / "outboxkit" / module).open("a") as f:
            f.write(f"\n{line}\n")
    proc = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}"


def test_the_package_keeps_its_layers(tmp_path: pathlib.Path) -> None:
    report = _lint_imports(tmp_path, None)
    assert report.startswith("exit 0\n"), report
    assert " BROKEN" not in report


@pytest.mark.parametrize(("module", "imported"), VIOLATIONS)
def test_an_import_against_the_layers_breaks_a_contract(
    tmp_path: pathlib.Path, module: str, imported: str
) -> None:
    report = _lint_imports(tmp_path, (module, f"import {imported}"))
    assert report.startswith("exit 1\n"), report
    importer = "outboxkit." + module.partition("/")[0].removesuffix(".py")
    assert f"{importer} is not allowed to import {imported}" in report, report


def test_a_module_without_a_layer_breaks_the_contract(tmp_path: pathlib.Path) -> None:
    """exhaustive: a new top-level module must be placed in pyproject.toml's layers."""
    report = _lint_imports(tmp_path, ("newcomer.py", "X = 1"))
    assert report.startswith("exit 1\n"), report
    assert "outboxkit.newcomer" in report, report
