"""A documentation block run as the program a reader would paste it into.

tests/integration/test_readme.py (the README's journey) and tests/integration/test_doc_pages.py
(the other guide pages) run their blocks through these: each block a file, started as
``python file.py`` with the environment a user's shell would give it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.doc_blocks import Block


class Program:
    """One block written to a file and started as `python file.py`."""

    def __init__(self, block: Block, directory: Path, env: dict[str, str]) -> None:
        self.block = block
        stem = f"{Path(block.page).stem.lower().replace('-', '_')}_line_{block.line}"
        path = directory / f"{stem}.py"
        path.write_text(block.code)
        self.log = directory / f"{stem}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(path)],
            cwd=directory,
            env=env,
            stdin=subprocess.PIPE,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def type(self, line: str) -> None:
        """What the reader types at the block's `input()` prompt."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.block} exited by itself ({self.proc.returncode}):\n{self.output()}")
        self.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        """Killed if still running (a test that failed midway leaves no process behind)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def wait_ok(self) -> None:
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"{self.block} did not finish within 60 s:\n{self.output()}")
        assert code == 0, f"{self.block} exited with {code}:\n{self.output()}"
        assert "Traceback" not in self.output(), f"{self.block}:\n{self.output()}"


def until(condition: Callable[[], bool], program: Program, what: str) -> None:
    """Wait (60 s at most) for ``condition`` while ``program`` keeps running."""
    deadline = time.monotonic() + 60
    while not condition():
        if program.proc.poll() is not None:
            pytest.fail(f"{program.block} exited ({program.proc.returncode}):\n{program.output()}")
        if time.monotonic() > deadline:
            program.proc.kill()
            pytest.fail(f"{program.block}: timed out waiting for {what}:\n{program.output()}")
        time.sleep(0.2)
