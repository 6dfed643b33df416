"""The public API as text, one line a name: what the compatibility promise covers.

The public API is what ``outboxkit.__all__`` and the documented modules below export
(a module without ``__all__`` exports its own public classes and functions). Each
class brings its constructor and its public methods, properties and class attributes
(those outboxkit defines, not the standard library's), each function its signature.

``tests/unit/data/public_api.txt`` is the API as last released (``make api-snapshot``
writes it at a release); ``tests/unit/test_api_snapshot.py`` fails when a name in it
disappears or changes its signature and the CHANGELOG's ``[Unreleased]`` section has no
"Removed", "Changed" or "Deprecated" entry naming it in a code span. Names added since
the snapshot are free to change until they are released.

Hand-written because the tools that diff APIs (griffe's ``check``) compare two git
refs of the source, while this compares what an installed package exposes at import
time, the same under an editable install and the wheel.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT / "tests" / "unit" / "data" / "public_api.txt"
CHANGELOG = ROOT / "CHANGELOG.md"

# The modules the documentation teaches users to import from (docs/reference/api.md
# documents each; a test checks the two lists agree).
PUBLIC_MODULES = (
    "outboxkit",
    "outboxkit.tasks",
    "outboxkit.testing",
    "outboxkit.pytest",
    "outboxkit.consumers",
    "outboxkit.consumers.kafka",
    "outboxkit.consumers.nats",
    "outboxkit.consumers.rabbitmq",
    "outboxkit.consumers.redis",
    "outboxkit.consumers.sqs",
    "outboxkit.publishers",
    "outboxkit.publishers.routing",
    "outboxkit.publishers.memory",
    "outboxkit.contrib.alembic",
    "outboxkit.contrib.celery",
    "outboxkit.contrib.django",
    "outboxkit.contrib.django.tasks_backend",
)

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _signature(obj: Any) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return _ADDRESS.sub("", text)


def exported(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return sorted(names)
    return sorted(
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", "") == module.__name__
    )


def _own_classes(cls: type) -> list[type]:
    """The class and its bases that outboxkit defines (the standard library's vary by
    Python version and are not ours to promise)."""
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "outboxkit"]


def _class_lines(qualname: str, cls: type) -> Iterator[str]:
    bases = ", ".join(b.__name__ for b in cls.__bases__ if b is not object)
    if issubclass(cls, enum.Enum):
        yield f"class {qualname}({bases})"
        for member in cls:
            yield f"{qualname}.{member.name} = {member.value!r}"
        return
    yield f"class {qualname}({bases}): {qualname}{_signature(cls)}"
    seen: set[str] = set()
    for owner in _own_classes(cls):
        for name, attr in vars(owner).items():
            if name in seen or (name.startswith("_") and name not in _DUNDERS):
                continue
            seen.add(name)
            yield from _member_lines(f"{qualname}.{name}", attr)


# Dunder methods whose presence is part of how a class is used.
_DUNDERS = {"__call__", "__enter__", "__aenter__", "__iter__", "__aiter__", "__len__"}


def _member_lines(qualname: str, attr: Any) -> Iterator[str]:
    if isinstance(attr, property):
        yield f"{qualname}: property"
    elif isinstance(attr, (classmethod, staticmethod)):
        kind = type(attr).__name__
        yield f"{kind} {qualname}{_signature(attr.__func__)}"
    elif inspect.iscoroutinefunction(attr):
        yield f"async {qualname}{_signature(attr)}"
    elif inspect.isfunction(attr):
        yield f"{qualname}{_signature(attr)}"
    elif inspect.isclass(attr):
        yield f"{qualname}: class"
    elif not callable(attr):
        yield f"{qualname}: {type(attr).__name__}"


def _name_lines(qualname: str, obj: Any) -> Iterator[str]:
    if inspect.isclass(obj):
        yield from _class_lines(qualname, obj)
    elif inspect.iscoroutinefunction(obj):
        yield f"async {qualname}{_signature(obj)}"
    elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
        yield f"{qualname}{_signature(obj)}"
    elif inspect.ismodule(obj):
        yield f"{qualname}: module"
    else:
        yield f"{qualname}: {type(obj).__name__}"


def collect() -> dict[str, str]:
    """Each public name (``module:Qual.name``) and its line."""
    api: dict[str, str] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in exported(module):
            if name == "__version__":
                continue  # a value that changes at every release, not an interface
            for line in _name_lines(name, getattr(module, name)):
                key = _key(line)
                api[f"{module_name}:{key}"] = line
    return api


def _key(line: str) -> str:
    """The dotted name a line describes ("async Relay.run(...)" -> "Relay.run")."""
    words = line.split(" ", 1)
    rest = words[1] if words[0] in ("class", "async", "classmethod", "staticmethod") else line
    return re.split(r"[(:= ]", rest, maxsplit=1)[0]


def read_snapshot(path: Path = SNAPSHOT) -> dict[str, str]:
    api: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        if not raw or raw.startswith("#"):
            continue
        key, _, line = raw.partition("  ")
        api[key] = line
    return api


def write_snapshot(path: Path = SNAPSHOT) -> int:
    api = collect()
    header = (
        "# outboxkit's public API as last released: `make api-snapshot` writes it at a\n"
        "# release. tests/unit/test_api_snapshot.py compares the package with it.\n"
    )
    body = "".join(f"{key}  {api[key]}\n" for key in sorted(api))
    path.write_text(header + body)
    return len(api)


def unreleased_notes(changelog: str) -> str:
    """The text of the CHANGELOG's "Removed", "Changed" and "Deprecated" entries under
    ``[Unreleased]``: the ``### Removed`` (…) sections and ``**Changed:**`` (…) bullets."""
    start = changelog.find("## [Unreleased]")
    if start < 0:
        return ""
    end = changelog.find("\n## [", start + 1)
    section = changelog[start : end if end > 0 else None]
    notes: list[str] = []
    heading = ""
    for block in re.split(r"\n(?=### |- )", section):
        if block.startswith("### "):
            heading = block.splitlines()[0][4:].strip()
            continue
        if heading in ("Removed", "Changed", "Deprecated") or re.match(
            r"- \*\*(Removed|Changed|Deprecated)\b", block
        ):
            notes.append(block)
    return "\n".join(notes)


def mentioned(key: str, notes: str) -> bool:
    """Whether a code span in the notes names ``module:Qual.name`` or its class (as
    ``Qual.name``, ``module.Qual.name``, ``Qual.name(...)``; ``Qual`` covers its members)."""
    module, _, qual = key.partition(":")
    parts = qual.split(".")
    names = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    names |= {f"{module}.{name}" for name in names}
    spans = re.findall(r"`([^`]+)`", notes)
    return any(re.split(r"[(\[ ]", span, maxsplit=1)[0] in names for span in spans)


def differences(
    snapshot: dict[str, str], current: dict[str, str], notes: str
) -> tuple[list[str], list[str]]:
    """The removed and the changed names the notes do not account for."""
    removed = [k for k in snapshot if k not in current and not mentioned(k, notes)]
    changed = [
        k
        for k in snapshot
        if k in current and current[k] != snapshot[k] and not mentioned(k, notes)
    ]
    return removed, changed


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python -m tests.support.public_api --write")
    print(f"wrote {write_snapshot()} public names to {SNAPSHOT.relative_to(ROOT)}")
