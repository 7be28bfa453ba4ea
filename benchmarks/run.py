"""First benchmark: SGLD and SGNHT inside pm.sample against a hand-written NumPy SGLD.

Problem P1 (``ALGORITHMS.md``): Bayesian linear regression, N = 10,000, D = 100, n = 500,
prior N(0, 10 I). Reports, measured in this one run:

* steady-state integrator steps per second inside ``pm.sample`` (thin = 1: one draw per step,
  every draw through PyMC's trace; thin = 10),
* the same for a hand-written NumPy SGLD with the analytic gradient (the baseline),
* time to the first draw (model and graph build, compile and first block) in a fresh process
  with PyMC and pymc_sgmcmc imported, with the compile cache cold and warm.

Writes ``benchmarks/results.md``. Run: ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from compile_caches import compile_cache_env
from report import child_result, script_parser
from report import header as report_header

HERE = Path(__file__).parent
N, D, BATCH, PRIOR_VAR, EPS = 10_000, 100, 500, 10.0, 1e-4
STEPS = 40_000


def data(seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N, D))
    y = X @ rng.standard_normal(D) + rng.standard_normal(N)
    return X, y


def model():
    import pymc as pm

    X, y = data()
    with pm.Model() as m:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=BATCH)
        w = pm.Normal("w", 0.0, np.sqrt(PRIOR_VAR), shape=D)
        pm.Normal("y", X_mb @ w, 1.0, observed=y_mb, total_size=N)
    return m


def make_step(name: str, thin: int):
    from pymc_sgmcmc import SGLD, SGNHT

    if name == "SGLD":
        return SGLD(step_size=EPS, thin=thin)
    return SGNHT(step_size=1e-3, friction=1.0, thin=thin)


def numpy_sgld(steps: int, seed: int = 1) -> float:
    """Steps per second of a hand-written NumPy SGLD with the analytic gradient."""
    X, y = data()
    rng = np.random.default_rng(seed)
    theta = np.zeros(D)
    scale = N / BATCH
    start = time.perf_counter()
    for _ in range(steps):
        idx = rng.integers(0, N, BATCH)
        Xb = X[idx]
        grad = -theta / PRIOR_VAR + scale * (Xb.T @ (y[idx] - Xb @ theta))
        theta = theta + 0.5 * EPS * grad + np.sqrt(EPS) * rng.standard_normal(D)
    return steps / (time.perf_counter() - start)


def pymc_steps_per_second(name: str, thin: int) -> float:
    import pymc as pm

    # Speed only: the chains start at 0, about 115 posterior sd from the mode, at the fixed
    # step sizes of the first benchmark, and the samplers rightly warn that such draws are
    # not the posterior (the way in, SGLD's noise-inflated variance, SGNHT still too hot).
    with model(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        step = make_step(name, thin)
        kwargs = dict(
            step=step, chains=1, tune=0, progressbar=False, compute_convergence_checks=False
        )
        pm.sample(draws=200, random_seed=0, **kwargs)  # compile and warm up
        idata = pm.sample(draws=STEPS // thin, random_seed=1, **kwargs)
    return STEPS / idata.posterior.attrs["sampling_time"]


def time_to_first_draw(name: str) -> float:
    """Build, compile and draw once (run in a fresh process; the packages imported before the
    clock starts, as in a user's script and in ``criteria.py``'s first draw)."""
    import pymc as pm

    import pymc_sgmcmc  # noqa: F401

    start = time.perf_counter()
    with model():
        pm.sample(
            draws=1,
            tune=0,
            chains=1,
            step=make_step(name, 1),
            progressbar=False,
            compute_convergence_checks=False,
            random_seed=0,
        )
    return time.perf_counter() - start


def first_draw_in_subprocess(name: str, env: dict) -> float:
    return child_result([__file__, "--first-draw", name], env=env)["seconds"]


def main() -> None:
    header = report_header("Benchmark results (`make bench`)")  # the load before the run
    rows = []
    baseline = numpy_sgld(STEPS)
    print(f"NumPy SGLD: {baseline:,.0f} steps/s")
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in ("SGLD", "SGNHT"):
            caches = compile_cache_env(f"{cache_dir}/{name}")  # empty, then warm
            cold = first_draw_in_subprocess(name, caches)
            warm = first_draw_in_subprocess(name, caches)
            for thin in (1, 10):
                rate = pymc_steps_per_second(name, thin)
                rows.append((name, thin, rate, rate / baseline, cold, warm))
                print(
                    f"{name} thin={thin}: {rate:,.0f} steps/s ({rate / baseline:.2f}x NumPy), "
                    f"first draw {cold:.1f} s cold / {warm:.1f} s warm"
                )
    lines = [
        *header,
        f"- baseline, hand-written NumPy SGLD (analytic gradient): **{baseline:,.0f} steps/s**",
        "",
        f"P1 linear regression, N = {N:,}, D = {D}, n = {BATCH}; {STEPS:,} steps per measurement;"
        " one chain; steps/s inside `pm.sample` (every stored draw goes through PyMC's trace).",
        "",
        "| sampler | thin | steps/s | ratio to NumPy | first draw cold (s) | first draw warm (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, thin, rate, ratio, cold, warm in rows:
        lines.append(f"| {name} | {thin} | {rate:,.0f} | {ratio:.2f}x | {cold:.1f} | {warm:.1f} |")
    lines += [
        "",
        "Time to first draw = the model's construction + graph construction + factorisation",
        "check + compile + one block, in a fresh Python process, PyMC and pymc_sgmcmc imported",
        "before the clock starts (runs before 2026-12-05 19:23 UTC counted pymc_sgmcmc's import;",
        "the criteria's first draw, `criteria_results.md`, starts the clock after the model's",
        "construction); 'cold' with empty compile caches",
        "(PyTensor's base compile directory, which holds numba's cache of PyTensor's functions,",
        "and numba's cache directory), 'warm' with the same ones again.",
    ]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {HERE / 'results.md'}")


if __name__ == "__main__":
    parser = script_parser(__doc__)
    # The child mode of the first-draw timing: one fresh process per measurement.
    parser.add_argument("--first-draw", metavar="SAMPLER", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.first_draw:
        print(json.dumps({"seconds": time_to_first_draw(arguments.first_draw)}))
    else:
        main()
