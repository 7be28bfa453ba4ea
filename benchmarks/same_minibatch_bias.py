"""The bias of the papers' noise estimate: Sigma-hat from the same minibatch as the force.

mCCAdL (eq. 15 of Wei & Shang) and NOGIN estimate the gradient-noise covariance from the
per-observation gradients of the minibatch whose summed gradient is the step's force. The
force's noise eta and the estimate are then correlated through the third moment of the
per-observation gradients, and the damping exp(-h^2 Sigma-hat / 2) that follows the kick h F
removes, on average, (h^3 / 2) E[Sigma-hat eta] from the momentum each step: a constant force
-(h^2 / 2) c3 per unit time, with

    c3_j = sum_k Cov(Sigma-hat_jk, eta_k) = (N^3 / n^2) E[d_j |d|^2],   d = g_i - mean g,

so that the posterior mean moves by about delta = -(h^2 / 2) C c3 (C the posterior covariance).
It is large for a logistic regression with N / n = 100 (P3), and small but not zero for a
Gaussian linear regression (P1), whose g = x r has a third moment once theta is away from the
data's generating value. A second table gives the predicted shift at the suite's step sizes
h = 0.1 / sqrt(lambda_max) on P1, P3 and MNIST, to compare with the end-of-run mean errors of
``benchmarks/suite_results_covariance.md``.

This script runs P3 (N = 50,000, D = 50, n = 500) from theta = 0 with a fixed step size (no
tuning, no preconditioner; the suite's h = 0.1 / sqrt(lambda_max) and two others), keeps the
second half of 2 x 10^5 steps, and compares each sampler's mean error with the NUTS reference
and the observed shift vector z = (mean - ref) / sd with the predicted one: their correlation
and the slope of z on z_pred. Estimates that are not correlated with the force (CCAdL's and
mCCAdL's diagonal carries a smaller part of the third moment; the periodic average takes a new
minibatch estimate every 300 steps with weight 0.1) and SGNHT (no estimate) are the controls.

Run: ``python benchmarks/same_minibatch_bias.py [--output FILE]`` (about 6 minutes).
"""

from __future__ import annotations

import time
import warnings

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import arviz as az
import numpy as np
import pymc as pm
from problems import make_problem, reference
from report import header, output_path, write

import pymc_sgmcmc as sg

STEPS = 200_000
THIN = 10
H_SUITE = 0.00119  # the suite's h = 0.1 / sqrt(lambda_max) on P3
PERIODIC = {"averaging": 0.1, "averaging_interval": 300}
#: (label, sampler, step size, options)
RUNS = [
    ("mCCAdL, papers' estimate", sg.MCCAdL, H_SUITE, {}),
    ("NOGIN, papers' estimate", sg.NOGIN, H_SUITE, {}),
    ("mCCAdL, independent minibatch", sg.MCCAdL, H_SUITE, {"noise_minibatch": "independent"}),
    ("NOGIN, independent minibatch", sg.NOGIN, H_SUITE, {"noise_minibatch": "independent"}),
    ("mCCAdL, average every step, weight 0.1", sg.MCCAdL, H_SUITE, {"averaging": 0.1}),
    ("mCCAdL, periodic average (0.1 every 300 steps)", sg.MCCAdL, H_SUITE, PERIODIC),
    ("NOGIN, periodic average (0.1 every 300 steps)", sg.NOGIN, H_SUITE, PERIODIC),
    ("mCCAdL, diagonal estimate", sg.MCCAdL, H_SUITE, {"covariance": "diag"}),
    ("CCAdL (diagonal, moving average)", sg.CCAdL, H_SUITE, {}),
    ("SGNHT (no estimate)", sg.SGNHT, H_SUITE, {}),
    ("mCCAdL, papers' estimate", sg.MCCAdL, 0.0005, {}),
    ("mCCAdL, papers' estimate", sg.MCCAdL, 0.002, {}),
]


def predicted_shift(problem, ref, cov: np.ndarray, h: float) -> np.ndarray:
    """delta / sd with delta = -(h^2 / 2) C c3, c3 from all N per-observation gradients at
    the reference mean (the population third moment that the minibatch's rows sample)."""
    n_obs, n = problem.n_obs, problem.batch_size
    d = problem.per_observation_gradients(ref.mean)
    d = d - d.mean(axis=0)
    c3 = n_obs**3 / n**2 * np.mean(d * np.sum(d**2, axis=1, keepdims=True), axis=0)
    return -(h**2) / 2.0 * (cov @ c3) / np.sqrt(ref.var)


def run(problem, sampler, h: float, options: dict) -> tuple[np.ndarray, float]:
    with problem.model(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = sampler(step_size=h, friction=1.0, thin=THIN, **options)
        start = time.perf_counter()
        idata = pm.sample(
            draws=STEPS // THIN, tune=0, step=step, chains=1, progressbar=False,
            compute_convergence_checks=False, random_seed=1,
            initvals={"w": problem.initial_point()},
        )  # fmt: skip
        seconds = time.perf_counter() - start
    draws = problem.draws_from_idata(idata)
    return draws[len(draws) // 2 :], seconds


def main() -> None:
    output = output_path(__doc__)
    problem = make_problem("P3")
    ref, cov, _, _ = reference(problem, allow_nuts=False)
    lines = header("Same-minibatch bias of the papers' noise estimate (P3)")
    lines += [
        f"- `benchmarks/same_minibatch_bias.py`: P3 (N = {problem.n_obs:,}, D = "
        f"{problem.dim}, n = {problem.batch_size}) from theta = 0, A = 1, fixed h, no tuning "
        f"and no preconditioner; moments of the second half of {STEPS:,} steps (thin "
        f"{THIN}) against {ref.source}.",
        "- mean err: root mean square over coordinates of (mean - ref) / ref sd, as in "
        "`suite.py`; var err likewise for var / ref var - 1; ESS: smallest bulk ESS of the "
        "kept draws, so that a mean error of about 1 / sqrt(ESS) is Monte Carlo noise.",
        "- predicted: the first-order shift -(h^2 / 2) C c3 in sd, c3 = (N^3 / n^2) "
        "E[d |d|^2] over all N per-observation gradients d at the reference mean; corr and "
        "slope: correlation of the observed shift vector with it and the least-squares "
        "slope of observed on predicted.",
        "",
        "| sampler | h | mean err | var err | ESS | predicted rms shift | corr | slope | s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, sampler, h, options in RUNS:
        draws, seconds = run(problem, sampler, h, options)
        z = (draws.mean(axis=0) - ref.mean) / np.sqrt(ref.var)
        var_err = np.sqrt(np.mean((draws.var(axis=0) / ref.var - 1.0) ** 2))
        ess = float(np.min(az.ess(draws[None, :, :])))
        pred = predicted_shift(problem, ref, cov, h)
        corr = np.corrcoef(z, pred)[0, 1]
        slope = float(z @ pred / (pred @ pred))
        row = (
            f"| {label} | {h:g} | {np.sqrt(np.mean(z**2)):.3f} | {var_err:.3f} | {ess:.0f} | "
            f"{np.sqrt(np.mean(pred**2)):.2f} | {corr:.3f} | {slope:.2f} | {seconds:.1f} |"
        )
        print(row, flush=True)
        lines.append(row)
    lines += [
        "",
        "## The predicted shift at the suite's step sizes",
        "",
        "h = 0.1 / sqrt(lambda_max), A = 1, as in `suite.py`; NOGIN's damping sees half the "
        "kick, so half mCCAdL's shift. To compare with the final mean errors of the papers' "
        "estimate in `benchmarks/suite_results_covariance.md`.",
        "",
        "| problem | h | predicted rms shift, mCCAdL | NOGIN |",
        "| --- | --- | --- | --- |",
    ]
    for key in ("P1", "P3", "MNIST"):
        other = make_problem(key)
        other_ref, other_cov, _, _ = reference(other, allow_nuts=False)
        h = 0.1 / np.sqrt(other.curvature(other_cov))
        shift = np.sqrt(np.mean(predicted_shift(other, other_ref, other_cov, h) ** 2))
        lines.append(f"| {key} | {h:.3g} | {shift:.3f} | {shift / 2:.3f} |")
        print(lines[-1], flush=True)
    write(lines, output)


if __name__ == "__main__":
    main()
