"""The wheel check's own checks bite (.ci/wheel_check.py; `make wheel-check` runs them for real).

A wheel that lacks a file of the package (a migration, a dashboard asset) or whose metadata
lacks a promise fails; a Python that is not on the machine is skipped, or fails in CI.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wheel_check", ROOT / ".ci" / "wheel_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["wheel_check"] = module  # dataclasses and exceptions look their module up
    spec.loader.exec_module(module)
    return module


def _package_files() -> list[Path]:
    package = ROOT / "src" / "outboxkit"
    return [
        p
        for p in sorted(package.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    ]


def _wheel(tmp_path: Path, files: dict[str, bytes]) -> Path:
    wheel = tmp_path / "outboxkit-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


def _package_as_wheel(tmp_path: Path, leave_out: str | None = None) -> Path:
    root = ROOT / "src"
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in _package_files()}
    if leave_out is not None:
        del files[leave_out]
    return _wheel(tmp_path, files)


def test_a_wheel_with_every_package_file_passes(
    check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    check.contents(_package_as_wheel(tmp_path))
    assert capsys.readouterr().out.startswith("ok   contents: all ")


@pytest.mark.parametrize(
    "left_out",
    [
        "outboxkit/backends/postgres/migrations/tasks/0001_tasks.sql",
        "outboxkit/ops/dashboard/static/app.js",
        "outboxkit/contrib/django/migrations/0004_tasks.py",
        "outboxkit/py.typed",
    ],
)
def test_a_wheel_missing_a_data_file_fails(
    check: ModuleType, tmp_path: Path, left_out: str
) -> None:
    if not (ROOT / "src" / left_out).exists():
        pytest.skip(f"{left_out} moved; the parametrisation names files that exist")
    with pytest.raises(check.CheckFailed, match=left_out.replace(".", r"\.")):
        check.contents(_package_as_wheel(tmp_path, leave_out=left_out))


def _metadata(check: ModuleType, drop: str | None = None) -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = [
        "Metadata-Version: 2.4",
        "Name: outboxkit",
        "Version: 0.0.0",
        "Summary: the outbox",
        "Requires-Python: >=3.11",
        "License-Expression: Apache-2.0",
        "Description-Content-Type: text/markdown",
        *(f"Classifier: Programming Language :: Python :: {v}" for v in check.PYTHONS),
        "Classifier: Typing :: Typed",
        *(f"Project-URL: {name}, {url}" for name, url in project["urls"].items()),
        *(f"Provides-Extra: {extra}" for extra in project["optional-dependencies"]),
    ]
    return "\n".join(line for line in lines if line != drop) + "\n\nREADME\n"


def test_complete_metadata_passes(
    check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = _wheel(tmp_path, {"outboxkit-0.0.0.dist-info/METADATA": _metadata(check).encode()})
    check.metadata(wheel)
    assert "ok   metadata: outboxkit 0.0.0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("drop", "said"),
    [
        ("Classifier: Typing :: Typed", "Typing :: Typed"),
        ("Classifier: Programming Language :: Python :: 3.13", "3.13"),
        ("Requires-Python: >=3.11", "no Requires-Python"),
        ("License-Expression: Apache-2.0", "no License-Expression"),
        ("Provides-Extra: kafka", "extras"),
    ],
)
def test_metadata_missing_a_promise_fails(
    check: ModuleType, tmp_path: Path, drop: str, said: str
) -> None:
    wheel = _wheel(
        tmp_path, {"outboxkit-0.0.0.dist-info/METADATA": _metadata(check, drop).encode()}
    )
    with pytest.raises(check.CheckFailed, match=said):
        check.metadata(wheel)


def test_the_readme_snippet_is_the_first_runnable_block(check: ModuleType, tmp_path: Path) -> None:
    code = check.readme_first_snippet(tmp_path / "snippet.py").read_text()
    compile(code, "snippet.py", "exec")
    assert "OUTBOXKIT_DSN" in code and "producer.send" not in code  # not the not-runnable one


def test_an_absent_python_is_skipped_with_the_reason_or_required_in_ci(
    check: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(check, "find_python", lambda version: None)
    monkeypatch.setattr(check, "REQUIRED", False)
    check.check_python("3.99", tmp_path / "x.whl", with_unit=True)
    assert capsys.readouterr().out.startswith("skip python 3.99: no python3.99 on PATH")
    monkeypatch.setattr(check, "REQUIRED", True)
    with pytest.raises(check.CheckFailed, match="OUTBOXKIT_REQUIRE_SERVICES=1"):
        check.check_python("3.99", tmp_path / "x.whl", with_unit=True)


def test_find_python_finds_the_running_interpreter_version(check: ModuleType) -> None:
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    found = check.find_python(version)
    assert found is not None, f"python{version} runs this test but was not found"
    assert check.find_python("3.99") is None
