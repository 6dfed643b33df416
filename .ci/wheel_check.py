"""The wheel on its own: build it as users get it, install it, use it (`make wheel-check`).

1. `python -m build` makes the sdist and, from the sdist, the wheel; a second wheel built
   straight from the tree must be the same, file for file. Every file of src/outboxkit (the
   SQL migrations, the dashboard's static files, py.typed, the Django app's migrations ...)
   must be in it; the metadata must be complete; `twine check --strict` must pass.
2. For each Python (3.11, 3.12, 3.13): a virtual environment of its own (kept in
   build/wheel-check/ and reused; outboxkit is reinstalled from the new wheel every run, the
   rest comes from constraints.txt and pip's cache), the wheel installed with the extras the
   steps need, then .ci/wheel_steps.py run from a directory outside the repository: the
   README's first snippet, `outboxkit migrate` for every kind, the Django migrations,
   `outboxkit relay` to NATS, `outboxkit worker`, `outboxkit dashboard`, mypy on `import
   outboxkit`. Under 3.12 and 3.13 the unit tests (tests/unit) also run on the installed wheel.

A Python that is not on the machine is skipped with the reason; with
OUTBOXKIT_REQUIRE_SERVICES=1 (CI) it is a failure. Any failure exits 1 with the reason.
"""

from __future__ import annotations

import argparse
import email.parser
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "wheel-check"
PACKAGE = ROOT / "src" / "outboxkit"
CONSTRAINTS = ROOT / "constraints.txt"
PYTHONS = ("3.11", "3.12", "3.13")
UNIT_PYTHONS = ("3.12", "3.13")
REQUIRED = os.environ.get("OUTBOXKIT_REQUIRE_SERVICES") == "1"
# What the steps import beyond the base install: outboxkit.testing's servers and the NATS
# client (demo), Django, and mypy; the unit tests need the whole dev extra.
STEP_EXTRAS = "demo,django"
# Variables that would let the source tree or another environment leak into the check.
LEAKY_ENV = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP", "OUTBOXKIT_DSN")


class CheckFailed(Exception):
    pass


def say(line: str) -> None:
    print(line, flush=True)


def run(
    args: list[str],
    *,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    timeout: float = 900,
) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
        raise CheckFailed(f"`{' '.join(args)}` exited {done.returncode}:\n{tail}")
    return done.stdout


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


# --------------------------------------------------------------------------- the build


def build() -> tuple[Path, Path]:
    dist, tree = WORK / "dist", WORK / "from-tree"
    for folder in (dist, tree):
        shutil.rmtree(folder, ignore_errors=True)
    python = sys.executable
    # The build backend from constraints.txt (build's isolated environment is made by pip): a
    # new hatchling cannot change the wheel under the check overnight.
    env = {**os.environ, "PIP_CONSTRAINT": str(CONSTRAINTS)}
    run([python, "-m", "build", "--outdir", str(dist), "."], env=env)  # the sdist, its wheel
    run([python, "-m", "build", "--wheel", "--outdir", str(tree), "."], env=env)
    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    (direct,) = tree.glob("*.whl")
    if wheel.name != direct.name or _contents(wheel) != _contents(direct):
        differ = sorted(set(_contents(wheel).items()) ^ set(_contents(direct).items()))
        raise CheckFailed(f"the sdist builds another wheel than the tree: {differ[:10]}")
    say(
        f"ok   build: {sdist.name} ({sdist.stat().st_size // 1024} KiB), {wheel.name}"
        f" ({wheel.stat().st_size // 1024} KiB); the wheel built from the sdist is the tree's,"
        f" file for file ({len(_contents(wheel))} files)"
    )
    return sdist, wheel


def _contents(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def contents(wheel: Path) -> None:
    shipped = set(_contents(wheel))
    sources = sorted(
        path.relative_to(PACKAGE.parent).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )
    missing = [name for name in sources if name not in shipped]
    if missing:
        raise CheckFailed(f"files of src/outboxkit missing from the wheel: {missing}")

    def count(pattern: str) -> int:
        found = [n for n in shipped if re.fullmatch(pattern, n)]
        if not found:
            raise CheckFailed(f"the wheel has no file matching {pattern}")
        return len(found)

    sql = count(r"outboxkit/.+/migrations/.+\.sql")
    django = count(r"outboxkit/contrib/django/migrations/\d{4}_\w+\.py")
    static = count(r"outboxkit/ops/dashboard/static/.+")
    count(r"outboxkit/py\.typed")
    say(
        f"ok   contents: all {len(sources)} files of src/outboxkit, among them {sql} SQL"
        f" migrations, {django} Django migrations, {static} dashboard static files, py.typed"
    )


def metadata(wheel: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(archive.read(name).decode())
    problems = []
    for field in ("Summary", "Requires-Python", "License-Expression", "Description-Content-Type"):
        if not meta.get(field):
            problems.append(f"no {field}")
    classifiers = set(meta.get_all("Classifier") or [])
    for wanted in (*(f"Programming Language :: Python :: {v}" for v in PYTHONS), "Typing :: Typed"):
        if wanted not in classifiers:
            problems.append(f"no classifier {wanted!r}")
    extras = set(meta.get_all("Provides-Extra") or [])
    if extras != set(project["optional-dependencies"]):
        problems.append(f"extras {sorted(extras)} != pyproject's")
    urls = {u.split(", ", 1)[0] for u in meta.get_all("Project-URL") or []}
    if urls != set(project["urls"]):
        problems.append(f"project URLs {sorted(urls)} != pyproject's")
    if problems:
        raise CheckFailed("the wheel's metadata: " + "; ".join(problems))
    say(
        f"ok   metadata: {meta['Name']} {meta['Version']}, Requires-Python"
        f" {meta['Requires-Python']}, {meta['License-Expression']}, {len(classifiers)}"
        f" classifiers, {len(extras)} extras, {len(urls)} URLs"
    )


def twine(sdist: Path, wheel: Path) -> None:
    run([sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)])
    say("ok   twine check --strict: sdist and wheel pass")


# --------------------------------------------------------------------------- each Python


def find_python(version: str) -> Path | None:
    """An interpreter of `version`: this one, on PATH, else pyenv's (its shims run only the
    active version)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [sys.executable, shutil.which(f"python{version}")]
    candidates += sorted(
        glob.glob(str(root / "versions" / f"{version}.*" / "bin" / "python3")), reverse=True
    )
    candidates.append(f"/usr/bin/python{version}")
    for candidate in candidates:
        if not candidate or not Path(candidate).exists():
            continue
        probe = subprocess.run(
            [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return Path(candidate)
    return None


def readme_first_snippet(dest: Path) -> Path:
    """The README's first ```python block meant to run (as tests/integration/test_readme.py)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "```python":
            continue
        previous = next((p for p in reversed(lines[:i]) if p.strip()), "")
        if "not-runnable:" in previous:
            continue
        end = lines.index("```", i + 1)
        dest.write_text("\n".join(lines[i + 1 : end]) + "\n")
        return dest
    raise CheckFailed("README.md has no runnable ```python block")


def install(python: Path, version: str, wheel: Path, extras: str, mypy_too: bool) -> Path:
    venv = WORK / f"venv-{version}"
    bin_python = venv / "bin" / "python"
    if not bin_python.exists():
        run([str(python), "-m", "venv", str(venv)])
    env = clean_env()
    pip = [str(bin_python), "-m", "pip", "--disable-pip-version-check"]
    run([*pip, "uninstall", "-y", "-q", "outboxkit"], env=env)  # a reused venv: the new wheel
    wanted = [f"outboxkit[{extras}] @ {wheel.as_uri()}", *(["mypy"] if mypy_too else [])]
    run(
        [*pip, "install", "-q", "-c", str(CONSTRAINTS), *wanted],
        env=env,
        log=venv / "pip-install.log",
    )
    return bin_python


def check_python(version: str, wheel: Path, with_unit: bool) -> None:
    started = time.monotonic()
    python = find_python(version)
    if python is None:
        reason = f"no python{version} on PATH nor in pyenv (~/.pyenv/versions/{version}.*)"
        if REQUIRED:
            raise CheckFailed(f"python {version}: {reason} (OUTBOXKIT_REQUIRE_SERVICES=1)")
        say(f"skip python {version}: {reason}")
        return
    bin_python = install(
        python, version, wheel, "dev" if with_unit else STEP_EXTRAS, mypy_too=not with_unit
    )
    django_migrations = len(list((PACKAGE / "contrib" / "django" / "migrations").glob("0*.py")))
    say(
        f"ok   python {version}: {wheel.name}[{'dev' if with_unit else STEP_EXTRAS}] installed"
        f" into {bin_python.parent.parent.relative_to(ROOT)} ({time.monotonic() - started:.0f}s)"
    )
    with tempfile.TemporaryDirectory(prefix=f"outboxkit-wheel-{version}-") as scratch:
        here = Path(scratch)
        if ROOT in here.resolve().parents:
            raise CheckFailed(f"{here} is inside the repository")
        steps = shutil.copy(ROOT / ".ci" / "wheel_steps.py", here / "wheel_steps.py")
        snippet = readme_first_snippet(here / "readme_first.py")
        cache = WORK / f"mypy-cache-{version}"
        done = subprocess.run(
            [str(bin_python), str(steps), str(snippet), str(django_migrations), str(cache)],
            cwd=here,
            env=clean_env(),
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise CheckFailed(f"python {version}: a step failed (above)")
    if with_unit:
        unit(bin_python, version)


def unit(bin_python: Path, version: str) -> None:
    """tests/unit on the installed wheel: the repository's root on the path, never src/."""
    started = time.monotonic()
    program = (
        "import sys, outboxkit, pytest\n"
        "assert 'site-packages' in outboxkit.__file__, outboxkit.__file__\n"
        "sys.exit(pytest.main(['-p', 'no:cacheprovider', '-q', '-n', '2', 'tests/unit']))\n"
    )
    done = subprocess.run(
        [str(bin_python), "-c", program],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0:
        say(done.stdout[-6000:] + done.stderr[-3000:])
        raise CheckFailed(f"python {version}: the unit tests failed on the wheel: {summary}")
    say(
        f"ok   python {version}: unit tests on the wheel: {summary.strip('= ')}"
        f" ({time.monotonic() - started:.0f}s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--python",
        default=",".join(PYTHONS),
        help="comma-separated versions [default: %(default)s]",
    )
    parser.add_argument(
        "--unit",
        default=",".join(UNIT_PYTHONS),
        help="versions that also run tests/unit [default: %(default)s]",
    )
    args = parser.parse_args()
    started = time.monotonic()
    WORK.mkdir(parents=True, exist_ok=True)
    try:
        sdist, wheel = build()
        contents(wheel)
        metadata(wheel)
        twine(sdist, wheel)
        units = set(filter(None, args.unit.split(",")))
        for version in filter(None, args.python.split(",")):
            check_python(version, wheel, with_unit=version in units)
    except CheckFailed as exc:
        say(f"FAIL wheel check: {exc}")
        raise SystemExit(1) from None
    say(f"ok   wheel check done in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
