"""Print the constraints file for the interpreter running it: every installed package pinned.

`make upgrade-deps` runs it in a virtual environment resolved afresh from the dev extra, after
the suite passed there; `make install` then installs with `-c constraints.txt`.
"""

from __future__ import annotations

import datetime
import subprocess
import sys

HEADER = """\
# The versions `make test` installs (pip install -c constraints.txt -e '.[dev]').
# Written by `make upgrade-deps` after the whole suite passed on them; edit by running it.
# Python {python}, {date}.
"""


def main() -> None:
    frozen = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "freeze",
            "--exclude-editable",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    pins = sorted(
        (line for line in frozen if "==" in line and not line.lower().startswith("outboxkit==")),
        key=str.lower,
    )
    python = ".".join(map(str, sys.version_info[:3]))
    sys.stdout.write(HEADER.format(python=python, date=datetime.date.today().isoformat()))
    sys.stdout.write("\n".join(pins) + "\n")


if __name__ == "__main__":
    main()
