"""What every benchmark's results file starts with, and how the scripts write it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

__all__ = [
    "child_result",
    "header",
    "load_average",
    "machine",
    "output_path",
    "versions",
    "write",
]


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {"cpu": cpu, "cores": str(os.cpu_count()), "platform": platform.platform()}


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    packages = (
        "pymc",
        "pytensor",
        "numpy",
        "numba",
        "arviz",
        "scipy",
        "jax",
        "jaxlib",
        "blackjax",
        "nutpie",
    )
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def header(title: str) -> list[str]:
    """The title, then date, machine, load and versions (one bullet each)."""
    m = machine()
    return [
        f"# {title}",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; load average (1, 5, "
        f"15 min) at the start: {load_average()}",
        "- versions: " + ", ".join(f"{name} {v}" for name, v in versions().items()),
    ]


def script_parser(doc: str) -> argparse.ArgumentParser:
    """The command-line parser of a benchmark script: ``--help`` prints its docstring ``doc``
    as written (what it measures, how long it takes, which file it writes)."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def output_path(doc: str) -> Path | None:
    """The ``--output FILE`` option of a benchmark script whose docstring is ``doc``."""
    parser = script_parser(doc)
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    return parser.parse_args().output


def write(lines: list[str], output: Path | None) -> None:
    """Print the report, and write it to ``output`` when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if output is not None:
        output.write_text(text)


def child_result(arguments: list[str], env: dict[str, str] | None = None):
    """Run ``python ARGUMENTS`` in a fresh process and return the JSON its stdout ends with.
    A failed child's stderr is raised with it: a measurement that fails once in several runs
    must say why, not only its exit status."""
    out = subprocess.run(
        [sys.executable, *arguments], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"{' '.join(arguments)} exited with status {out.returncode}; its stderr ended:\n"
            + out.stderr[-4000:]
        )
    return json.loads(out.stdout.strip().splitlines()[-1])
