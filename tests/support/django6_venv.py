"""A Python 3.13 virtual environment with Django 6 (``django.tasks``) and this checkout's
outboxkit, for the tests of the Tasks framework backend on Django's own framework.

Made once in build/django6-venv/ and reused: pip runs again only when what it installed
from changes (the pins below, constraints.txt, pyproject.toml or the checkout's path), as
recorded in its stamp file. outboxkit is installed editable (``pip install -e``), so the
checkout's code is what runs there without a reinstall.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / "build" / "django6-venv"
PYTHON_VERSION = "3.13"
# Django 6.0 is the release that brought django.tasks in; the other packages come from
# constraints.txt (Django and the django-tasks backport excepted: they pin Django 5.2).
PINS = ("Django==6.0.10", "pytest")
UNPINNED = ("django==", "django-tasks==", "django-tasks-db==")


def _wheel_check() -> Any:
    """.ci/wheel_check.py (not a package): its ``find_python`` looks on PATH and in pyenv."""
    spec = importlib.util.spec_from_file_location("_wheel_check", ROOT / ".ci" / "wheel_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_python() -> Path | None:
    """A 3.13 interpreter (this one, ``python3.13`` on PATH, pyenv's), or None."""
    found: Path | None = _wheel_check().find_python(PYTHON_VERSION)
    return found


def _constraints() -> str:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return "\n".join(x for x in lines if not x.lower().startswith(UNPINNED)) + "\n"


def _stamp(constraints: str) -> str:
    digest = hashlib.sha256()
    for part in (*PINS, constraints, (ROOT / "pyproject.toml").read_text(), str(ROOT)):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def ensure(python: Path) -> Path:
    """The venv's interpreter, the venv made or brought up to date first."""
    bin_python = VENV / "bin" / "python"
    constraints = _constraints()
    stamp = VENV / ".installed"
    wanted = _stamp(constraints)
    if bin_python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return bin_python
    if not bin_python.exists():
        _run([str(python), "-m", "venv", str(VENV)])
    (VENV / "constraints.txt").write_text(constraints)
    _run(
        [str(bin_python), "-m", "pip", "install", "-q", "-c", str(VENV / "constraints.txt"),
         *PINS, "-e", str(ROOT)],
        log=VENV / "pip-install.log",
    )  # fmt: skip
    stamp.write_text(wanted)
    return bin_python


def _run(args: list[str], *, log: Path | None = None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900, check=False)
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])
        raise RuntimeError(f"`{' '.join(args)}` exited {done.returncode}:\n{tail}")
