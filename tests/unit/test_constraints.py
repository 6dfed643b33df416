"""The test dependencies are pinned: every package of the dev extra has a version in
constraints.txt, and `make install` installs with it (a new release of a test dependency once
turned a fresh clone's `make test` red: standardwebhooks 1.3 changed what `verify` raises)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = version
    return pins


def _dev_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    seen: set[str] = set()
    found: list[Requirement] = [Requirement(r) for r in project["dependencies"]]

    def walk(extra: str) -> None:
        if extra in seen:
            return
        seen.add(extra)
        for text in extras[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "outboxkit":
                for inner in req.extras:
                    walk(inner)
            else:
                found.append(req)

    walk("dev")
    return found


def test_every_dev_dependency_is_pinned_within_its_range() -> None:
    pins = _pins()
    missing, outside = [], []
    for req in _dev_requirements():
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            missing.append(req.name)
        elif not req.specifier.contains(version, prereleases=True):
            outside.append(f"{req.name}=={version} (pyproject asks {req.specifier})")
    assert not missing, f"not in constraints.txt (run `make upgrade-deps`): {missing}"
    assert not outside, f"constraints.txt pins outside pyproject's ranges: {outside}"


def test_make_install_uses_the_constraints() -> None:
    makefile = (ROOT / "Makefile").read_text()
    installs = re.findall(r"\$\(PIP\) install[^\n]*", makefile)
    assert installs, "no install line found in the Makefile"
    for line in installs:
        if "--upgrade pip" in line:
            continue
        assert "-c $(CONSTRAINTS)" in line, f"installs without the pins: {line}"
