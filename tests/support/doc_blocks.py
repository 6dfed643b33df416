"""The fenced code blocks of the README and the documentation pages, as programs.

tests/integration/test_readme.py runs the JOURNEY's Python blocks,
tests/integration/test_doc_pages.py those of the PAGES; tests/unit/test_docs_site.py compiles
every page's.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The README, then the documentation site's guide pages whose snippets run here, in the
# order a reader meets them (docs/install.md has shell lines only).
JOURNEY = [
    "README.md",
    "docs/install.md",
    "docs/writing.md",
    "docs/relaying.md",
    "docs/ordering.md",
    "docs/wal.md",
    "docs/inbox.md",
    "docs/frameworks.md",
    "docs/pgbouncer.md",
    "docs/kubernetes.md",
]
# Guide pages outside the journey whose snippets run, each with the setup its prose assumes.
PAGES = [
    "docs/brokers.md",
    "docs/testing-your-code.md",
    "docs/django.md",
    "docs/celery.md",
    "docs/operations.md",
    "docs/tasks.md",
    "docs/mariadb.md",
]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
NOT_RUNNABLE = re.compile(r"^\s*<!--\s*not-runnable:\s*(?P<reason>.+?)\s*-->\s*$")
SERVICE_MARK = "signal.SIGTERM"  # a block that runs until it is told to stop


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_runnable: str | None
    page: str = "README.md"

    @property
    def is_service(self) -> bool:
        return SERVICE_MARK in self.code

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def journey_blocks() -> list[Block]:
    """Every fenced block of the JOURNEY's pages, in reading order."""
    return [b for page in JOURNEY for b in readme_blocks((ROOT / page).read_text(), page)]


def page_python_blocks(page: str) -> list[Block]:
    """The ```python blocks of one page (a path from the repository's root)."""
    return [b for b in readme_blocks((ROOT / page).read_text(), page) if b.lang == "python"]


def readme_blocks(text: str | None = None, page: str = "README.md") -> list[Block]:
    """Every fenced block of a page (the README by default), dedented, with the reason it may
    not run (if given)."""
    lines = (text if text is not None else README.read_text()).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        start, indent = i, opening["indent"]
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        body = [line.removeprefix(indent) for line in lines[start + 1 : i]]
        code = textwrap.dedent("\n".join(body))
        previous = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        marker = NOT_RUNNABLE.match(previous)
        reason = marker and marker["reason"]
        blocks.append(Block(start + 1, opening["lang"], code + "\n", reason, page))
        i += 1
    return blocks
