"""CCAdL's ``averaging_interval``: what taking the noise estimate every m steps saves, and what
it changes in the draws.

1. Cost: CPU time per step inside the compiled block (thin = 10, n = 500, h = 1e-3, A = 1,
   chains started at the exact posterior mean) of the cost table's linear regression of
   ``benchmarks/dense_preconditioner.py`` at D = 50 (CCAdL's "full" estimate) and D = 200
   (its "diag" one), with the diagonal preconditioner and with the rotation set to the
   Cholesky factor of the posterior covariance, for SGNHT and for CCAdL with
   ``averaging_interval`` 1 (the paper), 10 (the default) and 100, fills alternated (the
   smallest of ``COST_REPEATS`` each), as a ratio of SGNHT's.
2. Accuracy: CCAdL with its defaults but for the interval (adapted step size, preconditioner
   and thin; 2 chains x 500 draws after 1,000 tuning draws, ``cores=1``, seeds 1 and 2) on
   the dense-preconditioner benchmark's three problems: the regression on calendar years and
   the random-intercept model (against their exact posteriors) and MNIST 7 vs 9 (against the
   stored NUTS reference). The largest |mean error| in posterior sd, the range of sd ratios,
   the smallest bulk ESS, the mean thermostat (A = 1 by Proposition 2) and the wall time of
   ``pm.sample``, compiling included where the compile caches lack the blocks.

Writes ``benchmarks/ccadl_interval_results.md``.
Run: ``.venv/bin/python benchmarks/ccadl_interval.py``.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import arviz as az  # noqa: E402
import numpy as np  # noqa: E402
import pymc as pm  # noqa: E402
from covariance import COST_REPEATS, block_us_per_step, make, prepared_block  # noqa: E402
from dense_preconditioner import (  # noqa: E402
    NAMES,
    errors_of_w,
    exact_year_posterior,
    year_regression,
)
from models import GaussianRegression  # noqa: E402
from problems import make_problem, reference  # noqa: E402
from report import header, script_parser  # noqa: E402

from pymc_sgmcmc import CCAdL  # noqa: E402

COST_INTERVALS = (1, 10, 100)
ACCURACY_INTERVALS = (1, 10, 50)
SEEDS = (1, 2)


def cost_table(lines: list[str]) -> None:
    lines += [
        "## Cost per step (thin = 10, n = 500, h = 1e-3; CPU time inside the block)",
        "",
        f"Smallest of {COST_REPEATS} block fills each, alternated; in brackets the ratio to "
        "SGNHT's in the same preconditioner.",
        "",
        "| D | CCAdL's estimate | preconditioner | SGNHT µs | "
        + " | ".join(f"CCAdL every {m} µs" for m in COST_INTERVALS)
        + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in COST_INTERVALS) + " |",
    ]
    for dim in (50, 200):
        problem = GaussianRegression.make(n_obs=10_000, dim=dim, batch_size=500)
        rotation, mean = np.linalg.cholesky(problem.cov), problem.mean
        for dense in (False, True):
            steps = {}
            for m in (None, *COST_INTERVALS):
                name, kwargs = ("SGNHT", {}) if m is None else ("CCAdL", {"averaging_interval": m})
                with problem.model() as model:
                    step = make(name, 1e-3, 1.0, thin=10, **kwargs)
                prepared_block(problem, step, model)
                if dense:
                    step.setup_chain(np.random.default_rng(0), tune=0, draws=10**9)
                    step.rotation, step.scale = rotation, np.ones(dim)
                    step._fill_buffer(mean)  # compiles the dense block
                steps[m] = step
            times = {m: [] for m in steps}
            for _ in range(COST_REPEATS):
                for m, step in steps.items():
                    times[m].append(block_us_per_step(step, mean))
            best = {m: min(t) for m, t in times.items()}
            cells = [f"{best[m]:,.1f} ({best[m] / best[None]:.2f})" for m in COST_INTERVALS]
            lines.append(
                f"| {dim} | {steps[1].covariance} | {'dense' if dense else 'diagonal'} | "
                f"{best[None]:,.1f} | " + " | ".join(cells) + " |"
            )
            print(lines[-1], flush=True)
    lines.append("")


def accuracy_problems() -> dict:
    """name -> (model factory, errors(idata) -> (largest |mean error| / sd, sd ratios))."""
    mean, sd = exact_year_posterior()

    def year_errors(idata):
        post = idata.posterior
        off = max(abs(float(post[v].mean()) - mean[v]) / sd[v] for v in NAMES)
        ratios = np.array([float(post[v].std()) / sd[v] for v in NAMES])
        return off, ratios, float(min(az.ess(idata, var_names=[v])[v] for v in NAMES))

    def of_w(errors):
        def three(idata):
            off, ratios, _, ess = errors(idata)
            return off, ratios, ess

        return three

    intercepts = GaussianRegression.random_intercepts()
    mnist = make_problem("MNIST")
    nuts = reference(mnist, allow_nuts=False)[0]
    return {
        "calendar years (D = 3, exact)": (lambda: year_regression(full_data=False), year_errors),
        "random intercepts (D = 100, exact)": (
            intercepts.model,
            of_w(errors_of_w(intercepts.mean, np.sqrt(np.diag(intercepts.cov)))),
        ),
        "MNIST 7 vs 9 (D = 100, NUTS)": (
            mnist.model,
            of_w(errors_of_w(nuts.mean, np.sqrt(nuts.var))),
        ),
    }


def accuracy_table(lines: list[str]) -> None:
    lines += [
        "## Accuracy with the defaults but for the interval",
        "",
        "Time: the wall time of `pm.sample`, compiling included where the compile caches "
        "lack the blocks.",
        "",
        "| problem | interval | seed | max \\|Δmean\\| (sd) | sd ratios | min ESS | "
        "dense? | h | thin | mean ξ | time (s) | warnings |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (model, errors) in accuracy_problems().items():
        for m in ACCURACY_INTERVALS:
            for seed in SEEDS:
                with model(), warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    step = CCAdL(averaging_interval=m)
                    start = time.perf_counter()
                    idata = pm.sample(
                        500, tune=1000, step=step, chains=2, cores=1, random_seed=seed,
                        progressbar=False, compute_convergence_checks=False,
                    )  # fmt: skip
                    seconds = time.perf_counter() - start
                off, ratios, ess = errors(idata)
                said = sorted({str(w.message)[:60] for w in caught if "CCAdL" in str(w.message)})
                xi = float(idata.sample_stats["thermostat"].values.mean())
                lines.append(
                    f"| {name} | {m} | {seed} | {off:.3f} | {ratios.min():.2f}-{ratios.max():.2f} "
                    f"| {ess:.0f} | {'yes' if step.dense else 'no'} | {step.step_size:.3g} | "
                    f"{step.thin} | {xi:.3f} | {seconds:.0f} | {'; '.join(said) or '-'} |"
                )
                print(lines[-1], flush=True)
    lines.append("")


def main():
    script_parser(__doc__).parse_args()
    lines = [*header("CCAdL's averaging interval (`benchmarks/ccadl_interval.py`)"), ""]
    cost_table(lines)
    accuracy_table(lines)
    (HERE / "ccadl_interval_results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
