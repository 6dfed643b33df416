"""MkDocs hooks for the site's own checks (`mkdocs.yml`'s `hooks:`), warnings under strict.

- every module of the public API (tests/support/public_api.py) has its section on the
  Python API page, and every public class, function and method in them has a docstring;
- every migration file shipped has its place on the table-schemas page.
"""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.plugins.outboxkit")


def on_pre_build(config: Any) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]
    from tests.support import public_api

    api_page = (ROOT / "docs" / "reference" / "api.md").read_text()
    for module in public_api.PUBLIC_MODULES:
        if f"::: {module}\n" not in api_page:
            log.warning("public module %s has no section on docs/reference/api.md", module)
    for name in _undocumented(public_api):
        log.warning("public name %s has no docstring", name)
    schemas = (ROOT / "docs" / "reference" / "schemas.md").read_text()
    for path in sorted((ROOT / "src").rglob("*.sql")):
        if path.relative_to(ROOT).as_posix() not in schemas:
            log.warning("migration %s is missing from docs/reference/schemas.md", path.name)


def _undocumented(public_api: Any) -> list[str]:
    import importlib

    missing: list[str] = []
    for module_name in public_api.PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in public_api.exported(module):
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not _own_doc(obj):
                missing.append(f"{module_name}.{name}")
            if inspect.isclass(obj):
                missing += [
                    f"{module_name}.{name}.{attr}"
                    for attr, value in vars(obj).items()
                    if not attr.startswith("_")
                    and inspect.isfunction(value)
                    and not _own_doc(value)
                ]
    return sorted(set(missing))


def _own_doc(obj: Any) -> bool:
    return bool((getattr(obj, "__doc__", None) or "").strip())
