"""A malformed DSN is one line on every command that takes one, its password masked.

One child interpreter runs every command (``main`` as the console script calls it, stdout
and stderr captured per command), with the DSN of the issue (`postgres//…`: no scheme
separator) and with one whose password carries a bad percent escape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

COMMANDS = [
    ["migrate"],
    ["relay", "--broker", "nats://127.0.0.1:1"],
    ["status"],
    ["failed", "list"],
    ["failed", "show", "1"],
    ["failed", "discard", "--id", "1"],
    ["replay", "--id", "1"],
    ["purge", "--older-than", "7d"],
    ["dashboard", "--port", "0"],
    ["partitions", "list"],
    ["partitions", "maintain"],
    ["partitions", "set", "--keep", "7d"],
    ["cdc", "setup"],
    ["cdc", "status"],
    ["cdc", "drop"],
]
MALFORMED = ["postgres//postgres:Hunter2pw@127.0.0.1/x", "postgresql://app:Hunter2%ZZ@db/shop"]

_CHILD = """
import contextlib, io, json, os, sys
from outboxkit.ops.cli import main
results = []
for dsn, command in json.loads(sys.argv[1]):
    os.environ["OUTBOXKIT_DSN"] = dsn
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(command, prog_name="outboxkit")
            code = 0
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            import traceback
            traceback.print_exc()
            code = "raised"
    results.append([command, code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def test_a_malformed_dsn_is_one_line_on_every_command() -> None:
    """Before: a 49-line traceback ending in `psycopg.ProgrammingError: missing "="`."""
    runs = [[dsn, command] for dsn in MALFORMED for command in COMMANDS]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(runs)],
        capture_output=True, text=True, timeout=120, check=True,
        env={**os.environ, "COLUMNS": "60"},
    )  # fmt: skip
    results = json.loads(done.stdout.splitlines()[-1])
    assert len(results) == len(runs)
    for command, code, out, err in results:
        where = f"outboxkit {' '.join(command)}:\n{out}{err}"
        assert code == 2, where
        assert "Traceback" not in out + err and "Hunter2" not in out + err, where
        [line] = err.splitlines()
        assert line.startswith("error: --dsn (or OUTBOXKIT_DSN) is not a valid PostgreSQL"), where
        # The hint shows what to write, not a masked example.
        assert "***@" not in line and "postgresql://" in line, where
