"""JAX backend on the CPU against the default (numba) backend: SGLD and SGNHT on P1.

P1 is the linear regression of ``ALGORITHMS.md`` (N = 10,000, D = 100, n = 500). For each
sampler and mode it prints the time of the first block (graph build, compile and 1,000
steps) and the steady cost of a block of 1,000 steps (``SGMCMC._fill_buffer``: the compiled
block plus the NumPy minibatch indices and noise) as CPU time of this process, the minimum
over ``--repeats`` blocks, with single-threaded BLAS and XLA, so that the two backends are
compared on one core (other processes on a shared machine inflate CPU time less than wall
time). No GPU was available where this was written; the JAX numbers are JAX on the CPU.

Run: ``.venv/bin/python benchmarks/jax_backend.py [--modes default JAX] [--repeats 5]``
(needs ``jax``: ``pip install -e ".[test]"``). ``--modes default`` alone also runs against an
older checkout of the package put first on ``PYTHONPATH``, to compare two versions.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from engine import STEP_SIZES, cpu_us_per_step  # noqa: E402
from problems import make_problem  # noqa: E402
from report import script_parser  # noqa: E402

BLOCK_STEPS = 1000


def make_step(name: str, mode: str | None):
    import pymc_sgmcmc as sg

    cls = sg.SGLD if name == "SGLD" else sg.SGNHT
    return cls(step_size=STEP_SIZES[name], thin=1, block_steps=BLOCK_STEPS, mode=mode)


def measure(name: str, mode: str | None, repeats: int) -> tuple[float, float]:
    """Wall seconds of the first block (compile included) and steady CPU µs per step."""
    problem = make_problem("P1")
    with problem.model():
        step = make_step(name, mode)
    step.setup_chain(np.random.default_rng(0), tune=0, draws=10**9)
    theta = problem.initial_point()
    start = time.perf_counter()
    step._fill_buffer(theta)
    first = time.perf_counter() - start
    return first, cpu_us_per_step(lambda: step._fill_buffer(theta), BLOCK_STEPS, repeats)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--modes", nargs="+", default=["default", "JAX"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import pymc_sgmcmc

    print(f"package: {Path(pymc_sgmcmc.__file__).parent}")
    print(
        "| sampler | mode | first block (s, compile included) | CPU µs / step | steps / s (CPU) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name in ("SGLD", "SGNHT"):
        for mode in args.modes:
            first, us = measure(name, None if mode == "default" else mode, args.repeats)
            print(f"| {name} | {mode} | {first:.1f} | {us:.1f} | {1e6 / us:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
