"""``@tasks.handler`` returns a TaskFunction whose ``enqueue`` is typed by the handler's
payload: mypy (strict) catches a wrong payload or a misspelt option at the call site."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SNIPPET = textwrap.dedent(
    """
    from dataclasses import dataclass

    import psycopg

    from outboxkit.tasks import TaskContext, Tasks

    tasks = Tasks()


    @dataclass
    class Report:
        report_id: int


    @dataclass
    class Mail:
        to: str


    @tasks.handler("report.generate")
    def generate(report: Report) -> int:
        return report.report_id


    @tasks.handler("mail.send")
    async def send(mail: Mail, ctx: TaskContext) -> None:
        return None


    def enqueue(conn: psycopg.Connection[tuple[object, ...]]) -> int | None:
        generate.enqueue(conn, Mail(to="x"))  # the wrong payload
        send.enqueue(conn, Mail(to="x"), dely=3)  # a misspelt option
        assert generate(Report(report_id=1)) == 1  # still the function
        return send.enqueue(conn, Mail(to="x"), delay=3)
    """
)


def test_mypy_catches_a_wrong_payload_and_a_misspelt_option_at_the_call_site(
    tmp_path: Path,
) -> None:
    source = tmp_path / "snippet.py"
    source.write_text(SNIPPET)
    # A process of its own: mypy's api raises the interpreter's recursion limit for good,
    # which changes what other tests in this process see (a 3 000-level JSON then parses).
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir",
         str(tmp_path / "cache"), str(source)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out, err, status = done.stdout, done.stderr, done.returncode
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert status == 1, out + err
    assert len(errors) == 2, out
    assert (
        'snippet.py:32: error: Argument 2 to "enqueue" of "TaskFunction" has incompatible'
        in errors[0]
    )
    assert '"Mail"; expected "Report"' in errors[0]
    assert 'snippet.py:33: error: Unexpected keyword argument "dely"' in errors[1]
