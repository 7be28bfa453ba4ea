"""NUTS reference for the main example's posterior (``examples/a9a_logistic_regression.py``):
Bayesian logistic regression on a9a (32,561 rows, 123 weights, a Laplace prior with an unknown
scale), sampled by nutpie on the full data.

nutpie's default diagonal mass matrix leaves this posterior's wide directions (a9a's one-hot
groups sum to one per row, so shifting weight between groups is constrained by the prior
alone) for its trees to cross: a 2 x 1,000-draw run had not finished after 28 minutes. Its
low-rank mass matrix adaptation (``adaptation="low_rank"``) learns them, and trees 5-6 deep
(about 63 leapfrog steps per draw) sample it.

Writes ``benchmarks/references/a9a_nuts.npz`` (per coordinate, prior scale first: mean, sd,
their Monte Carlo errors, bulk ESS; and the run's settings) and
``benchmarks/a9a_reference_results.md``, which compares two runs on the minibatch model with
it: the example's NOGIN (its given step size and ``thin``), and NOGIN with control variates
and the step size, preconditioner and ``thin`` adapted (``NOGIN(averaging=0.1,
averaging_interval=300, control_variates=True)``, ``tune=1000``, 2 x 2,000 draws).
Needs the ``bench`` extra (nutpie). Takes about 20-35 minutes on 2 cores (the two runs:
about 1-2 minutes); ``--compare-only`` keeps the committed reference and reruns the two.
Run: ``.venv/bin/python benchmarks/a9a_reference.py [--tune 500] [--draws 1500] [--chains 2]
[--compare-only]``.
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "examples"))

import a9a_logistic_regression as example  # noqa: E402
import report  # noqa: E402

SEED = 2011


def nuts_reference(X: np.ndarray, y: np.ndarray, tune: int, draws: int, chains: int) -> dict:
    """nutpie on the full-data model; the per-coordinate moments and the run's settings."""
    import nutpie

    model = example.build_model(X, y, batch_size=None)
    when, load = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC", report.load_average()
    start = time.perf_counter()
    compiled = nutpie.compile_pymc_model(model)
    compile_s = time.perf_counter() - start
    trace = nutpie.sample(
        compiled, tune=tune, draws=draws, chains=chains, cores=chains, seed=SEED,
        adaptation="low_rank", progress_bar=False,
    )  # fmt: skip
    sample_s = time.perf_counter() - start - compile_s
    stats = trace.sample_stats
    return example.moments(example.coordinates(trace)) | {
        "tune": tune, "draws": draws, "chains": chains, "compile_s": compile_s,
        "sample_s": sample_s, "divergences": int(stats["diverging"].sum()),
        "mean_depth": float(stats["depth"].mean()),
        "mean_leapfrog": float(stats["n_steps"].mean()), "nutpie": nutpie.__version__,
        "date": when, "load_average": load, "machine": report.machine()["cpu"],
    }  # fmt: skip


def largest_z_quantile(q: float, k: int) -> float:
    """The ``q`` quantile of the largest |z| of ``k`` independent standard normals."""
    from scipy.stats import norm

    return float(norm.ppf(0.5 + 0.5 * q ** (1.0 / k)))


#: The compared runs: a column heading and a description each.
RUNS = {
    "example": (
        "the example",
        "NOGIN, `make example`: step size 3e-3 and thin 50 given, 2 x 2,000 draws",
    ),
    "control_variates": (
        "control variates, adapted",
        "`NOGIN(averaging=0.1, averaging_interval=300, control_variates=True)`, step size, "
        "preconditioner and thin adapted, tune = 1,000, 2 x 2,000 draws",
    ),
}


def results(ref: dict, runs: dict[str, dict]) -> list[str]:
    """The results file: the reference's run, then each of ``runs`` (keyed as :data:`RUNS`:
    its comparison, wall time and bulk ESS) against it."""
    k = len(ref["mean"])
    nuts_runs = (
        f"{int(ref['chains'])} chains x ({int(ref['tune'])} tune + {int(ref['draws'])} draws)"
    )
    lines = [
        *report.header("NUTS reference for the main example (a9a logistic regression)"),
        "",
        f"- **NUTS** (nutpie {ref['nutpie']}, low-rank mass matrix, full data; run "
        f"{ref['date']} on {ref['machine']}, load average at its start {ref['load_average']}"
        f"{ref.get('note', '')}): {nuts_runs}, {float(ref['compile_s']):.0f} s compile + "
        f"{float(ref['sample_s']):.0f} s sampling; {int(ref['divergences'])} divergences, mean "
        f"tree depth {float(ref['mean_depth']):.2f} ({float(ref['mean_leapfrog']):.0f} leapfrog "
        f"steps per draw); bulk ESS {ref['ess_bulk'].min():.0f}-{ref['ess_bulk'].max():.0f} "
        f"over the {k} coordinates; prior scale {ref['mean'][0]:.3f} +- {ref['sd'][0]:.3f}.",
    ]  # fmt: skip
    for key, run in runs.items():
        heading, description = RUNS[key]
        lines.append(
            f"- **{heading.capitalize()}** ({description}; run now): {run['seconds']:.0f} s "
            f"for `pm.sample`, compile included; bulk ESS {run['ess'].min():.0f}-"
            f"{run['ess'].max():.0f}."
        )
    headings = " | ".join(RUNS[key][0] for key in runs)
    rows = {
        "largest \\|z\\| of a mean difference (over both Monte Carlo errors)": [
            f"{run['comparison']['max_abs_z_mean']:.2f}" for run in runs.values()
        ],
        "largest \\|z\\| of an sd difference": [
            f"{run['comparison']['max_abs_z_sd']:.2f}" for run in runs.values()
        ],
        "sd ratio to NUTS's: min / median / max": [
            " / ".join(
                f"{run['comparison'][f'sd_ratio_{s}']:.2f}" for s in ("min", "median", "max")
            )
            for run in runs.values()
        ],
    }
    lines += [
        "",
        f"| over the {k} coordinates (prior scale, weights) | {headings} |",
        "| --- |" + " --- |" * len(runs),
        *(f"| {name} | {' | '.join(cells)} |" for name, cells in rows.items()),
        "",
        f"For two exact samplers the largest |z| over {k} independent coordinates has median "
        f"{largest_z_quantile(0.5, k):.2f} and 95th percentile {largest_z_quantile(0.95, k):.2f}"
        " (the coordinates are correlated, which lowers both).",
    ]
    return lines


def main() -> None:
    parser = report.script_parser(__doc__)
    parser.add_argument("--tune", type=int, default=500)
    parser.add_argument("--draws", type=int, default=1500)
    parser.add_argument("--chains", type=int, default=2)
    parser.add_argument(
        "--compare-only", action="store_true",
        help="keep the committed reference; rerun the example and the comparison only",
    )  # fmt: skip
    args = parser.parse_args()
    X, y = example.training_rows()
    if args.compare_only:
        ref = dict(np.load(example.REFERENCE))
    else:
        ref = nuts_reference(X, y, args.tune, args.draws, args.chains)
        example.REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        np.savez(example.REFERENCE, **ref)
    runs = {}
    idata, _, seconds = example.sample(X, y)
    runs["example"] = (idata, seconds)
    idata, _, seconds = example.sample_with_control_variates(X, y)
    runs["control_variates"] = (idata, seconds)
    compared = {
        key: {
            "comparison": example.against_reference(idata),
            "seconds": seconds,
            "ess": example.moments(example.coordinates(idata))["ess_bulk"],
        }
        for key, (idata, seconds) in runs.items()
    }
    report.write(results(ref, compared), HERE / "a9a_reference_results.md")


if __name__ == "__main__":
    main()
