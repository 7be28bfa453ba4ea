"""P4's time to the accuracy criterion with its covariates X stored in float32 (the model in
float64) against X in float64.

Each run is ``control_variates.run``: SGLD's default ``pm.sample`` run with
``control_variates=True``, one chain, timed from the step's construction to the first kept
draw from which the means stay within 0.1 posterior sd and the variances within 10 % of the
Laplace reference. The two storages alternate, so that both see the same hours of a shared
machine; the first round also loads (or, with empty caches, compiles) the blocks.

Run: ``.venv/bin/python benchmarks/float32_covariates.py [--rounds 3] [--output FILE]``
(about two minutes; ``docs/performance.md`` quotes the run of 2026-12-05).
"""

from __future__ import annotations

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

from pathlib import Path

import control_variates
import suite
from problems import make_problem, reference
from report import header, script_parser, write

import pymc_sgmcmc as sg


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    arguments = parser.parse_args()
    suite.quiet_pymc()
    problem = make_problem("P4")
    ref = reference(problem, allow_nuts=False)[0]
    lines = [
        *header("P4 with float32 covariates (`benchmarks/float32_covariates.py`)"),
        "",
        "| round | X stored in | time to result (s) | total (s) | final mean / var error |",
        "| --- | --- | --- | --- | --- |",
    ]
    for round_ in range(1, arguments.rounds + 1):
        for covariates in ("float64", "float32"):
            r = control_variates.run(problem, ref, sg.SGLD, control=True, covariates=covariates)
            result = "not reached" if r["result_s"] is None else f"{r['result_s']:.1f}"
            lines.append(
                f"| {round_} | {covariates} | {result} | {r['total_s']:.1f} | "
                f"{r['mean_err']:.4f} / {r['var_err']:.4f} |"
            )
            print(lines[-1], flush=True)
    write(lines, arguments.output)


if __name__ == "__main__":
    main()
