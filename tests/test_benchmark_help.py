"""Every benchmark script answers ``--help`` with its description and does nothing else: no
measurement starts and no results file is rewritten. (``criteria.py --help`` once started its
15-minute run and rewrote ``criteria_results.md``; ``noise_estimator.py --help`` crashed.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: Runs each script given on its command line as ``__main__`` with ``--help``, in this one
#: process (PyMC is imported once), and prints {script: [exit code, printed a usage line]}.
DRIVER = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[1])
report = {}
for script in sys.argv[2:]:
    sys.argv = [script, "--help"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            runpy.run_path(script, run_name="__main__")
            code = "ran to the end"
        except SystemExit as exit:
            code = exit.code
    report[script] = [code, printed.getvalue().startswith("usage:")]
print(json.dumps(report))
"""


def entry_points() -> list[Path]:
    """The scripts a user runs (the others are modules they import)."""
    return [p for p in sorted(BENCHMARKS.glob("*.py")) if "__main__" in p.read_text()]


def results_files() -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in BENCHMARKS.iterdir() if "_results" in p.name}


def test_every_benchmark_script_answers_help_without_running():
    scripts = entry_points()
    assert len(scripts) >= 17
    before = results_files()
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(BENCHMARKS), *map(str, scripts)],
        capture_output=True,
        text=True,
        timeout=300,  # about 3 s here; a script that starts measuring runs for minutes
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    answers = {Path(script).name: tuple(answer) for script, answer in report.items()}
    assert answers == {p.name: (0, True) for p in scripts}
    assert results_files() == before
