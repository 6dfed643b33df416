"""The README is the front door and the site holds the rest: checks that need no build.

`make docs-build` (in .ci/run) builds the site strictly: broken links and anchors, missing
references, undocumented public names and migration files absent from the schema page fail
there (docs/hooks.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

from tests.support import public_api
from tests.support.doc_blocks import readme_blocks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300, "README over 300 lines: move the detail to docs/"
    for heading in ("## Install", "## Why", "## Write events atomically", "## Run the relay"):
        assert heading in text
    assert "make demo" in text.split("##")[0] and "make test" in text.split("##")[0]


def test_the_readme_s_relative_links_resolve() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    missing = [t for t in links if "://" not in t and not (ROOT / t).exists()]
    assert missing == []


def _nav_pages(nav: list[object]) -> list[str]:
    pages: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [str(value)]
    return pages


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))
    nav = set(_nav_pages(config["nav"]))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - nav == set(), "pages the site would not link to"
    assert nav - pages == set(), "navigation entries without a page"


def test_the_api_page_documents_each_public_module() -> None:
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    documented = re.findall(r"^::: (\S+)$", page, flags=re.M)
    assert documented == list(public_api.PUBLIC_MODULES)


def test_every_python_snippet_of_the_site_compiles() -> None:
    """The journey's snippets run (tests/integration/test_readme.py), and those of the PAGES
    (tests/integration/test_doc_pages.py); every other page's must at least be Python."""
    for page in sorted((ROOT / "docs").rglob("*.md")):
        name = page.relative_to(ROOT).as_posix()
        for block in readme_blocks(page.read_text(), name):
            if block.lang == "python":
                flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
                compile(block.code, str(block), "exec", flags)
