"""The Tasks framework backend on Django 6's own ``django.tasks``: Django 6 needs Python
3.12+, the suite runs on 3.11, so tests/integration/contrib/django6/ runs in a 3.13 venv
(tests/support/django6_venv.py: made once in build/django6-venv, then reused) against this
session's PostgreSQL. Skipped where no 3.13 interpreter exists; a failure in CI."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest

from tests.support import django6_venv


def test_the_backend_passes_its_tests_on_django6s_own_tasks_framework(pg_server: Any) -> None:
    python = django6_venv.find_python()
    if python is None:
        reason = (
            f"no python{django6_venv.PYTHON_VERSION} on PATH nor in pyenv"
            f" ({os.environ.get('PYENV_ROOT', '~/.pyenv')}/versions/3.13.*): Django 6 needs 3.12+"
        )
        if os.environ.get("OUTBOXKIT_REQUIRE_SERVICES") == "1" or os.environ.get("CI"):
            pytest.fail(f"{reason} (required in CI)", pytrace=False)
        pytest.skip(reason)
    started = time.monotonic()
    bin_python = django6_venv.ensure(python)
    installed = time.monotonic() - started
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OUTBOXKIT_TEST_DSN": pg_server.dsn, "PYTHONPATH": str(django6_venv.ROOT)}
    here = "tests/integration/contrib/django6"
    done = subprocess.run(
        [str(bin_python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-c", os.devnull,
         "--rootdir", str(django6_venv.ROOT), "--confcutdir", here, here],
        cwd=django6_venv.ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert " passed" in report and "skipped" not in report, report
    print(f"venv ready in {installed:.1f}s; {report.strip().splitlines()[-1]}")
