"""Every address the CLI's help links to is one the package declares ([project.urls])."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import click
from click.testing import CliRunner

from outboxkit.ops.cli import main

ROOT = Path(__file__).resolve().parents[2]
_URL = re.compile(r"https?://[^\s)\]>'\"`]+")
# Hosts of examples and placeholders in the help ("https://example.com/hooks/{topic}"), not links.
_NOT_LINKS = re.compile(r"^(\d+\.\d+\.\d+\.\d+|localhost|[^.]*|(.*\.)?example\.(com|org|net))$")


def _declared() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    urls: dict[str, str] = project.get("urls", {})
    return urls


def _helps() -> dict[str, str]:
    """The --help text of every command and group, by command path."""
    texts: dict[str, str] = {}

    def walk(command: click.Command, path: list[str]) -> None:
        result = CliRunner().invoke(main, [*path, "--help"], terminal_width=200)
        assert result.exit_code == 0, (path, result.output)
        texts[" ".join(path) or "outboxkit"] = result.output
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])

    walk(main, [])
    return texts


def _links(text: str) -> list[str]:
    return [
        url.rstrip(".,;:")
        for url in _URL.findall(text)
        if not _NOT_LINKS.match(urlsplit(url).hostname or "")
    ]


def test_the_project_declares_its_urls() -> None:
    """Before: pyproject.toml had no [project.urls] while the help linked to GitHub."""
    declared = _declared()
    assert {"Homepage", "Repository", "Documentation", "Issues"} <= set(declared), declared


def test_every_link_in_the_help_is_declared_and_names_a_shipped_doc() -> None:
    declared = _declared()
    docs = declared.get("Documentation", "<no Documentation URL declared>").rstrip("/") + "/"
    links = {(where, url) for where, text in _helps().items() for url in _links(text)}
    assert links, "no link found in any --help: the check would prove nothing"
    for where, url in sorted(links):
        if url in declared.values():
            continue
        assert url.startswith(docs), f"`{where} --help` links to undeclared {url}"
        assert (ROOT / "docs" / url.removeprefix(docs)).is_file(), f"{url}: no such doc"


def test_the_installed_cli_prints_the_same_links() -> None:
    """The help as a user sees it, from a subprocess."""
    done = subprocess.run(
        [sys.executable, "-m", "outboxkit", "relay", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    declared = _declared()
    docs = declared.get("Documentation", "<none>").rstrip("/") + "/"
    links = _links(done.stdout)
    assert links and all(u in declared.values() or u.startswith(docs) for u in links), links
