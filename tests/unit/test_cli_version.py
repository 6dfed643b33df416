"""`outboxkit --version` prints the version, and the version has one place: ``_version.py``.

pyproject.toml declares the version dynamic and reads it from ``src/outboxkit/_version.py``,
so the wheel's metadata, ``outboxkit.__version__`` and the CLI cannot drift apart (the wheel
check, .ci/wheel_check.py, compares the installed wheel's metadata with the CLI's line).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from packaging.version import Version

import outboxkit
from outboxkit.ops.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_prints_the_package_version(flag: str) -> None:
    result = CliRunner().invoke(main, [flag])
    assert result.exit_code == 0, result.output
    assert result.output == f"outboxkit, version {outboxkit.__version__}\n"


def test_version_is_a_release_version() -> None:
    version = Version(outboxkit.__version__)
    assert str(version) == outboxkit.__version__, "write the version in its normal form"
    assert not version.is_devrelease and not version.local


def test_pyproject_reads_the_version_from_the_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"], "a second copy of the version"
    assert "version" in pyproject["project"]["dynamic"]
    source = pyproject["tool"]["hatch"]["version"]["path"]
    text = (ROOT / source).read_text()
    (found,) = re.findall(r'^__version__ = "([^"]+)"', text, flags=re.MULTILINE)
    assert found == outboxkit.__version__


def test_console_script_prints_it_too() -> None:
    """The installed entry point (`python -m outboxkit` runs the same group)."""
    done = subprocess.run(
        [sys.executable, "-m", "outboxkit", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"outboxkit, version {outboxkit.__version__}"
