"""SGNHT's thermostat under minibatch noise (the guide's "thermostat warm-up").

The first model's regression (N = 10,000, n = 1,000, curvature about 1e4) sampled with SGNHT,
A = 1, mu = D, at h = 1e-3 and at h = 5e-3 (half the stability limit 1/sqrt(curvature)). The
thermostat starts at xi = A and restarts there at the end of tuning. Prints tr(Sigma) / D
(measured by mSGLD's noise_trace stat near the posterior), the thermostat and kinetic
temperature along each SGNHT run, and the posterior standard deviations against the
least-squares standard errors. Run (the output is committed beside this file):
``.venv/bin/python docs/snippets/thermostat_warmup.py > docs/snippets/thermostat_warmup_output.txt``
"""

import numpy as np
import pymc as pm

from pymc_sgmcmc import MSGLD, SGNHT

rng = np.random.default_rng(0)
N = 10_000
X = rng.standard_normal((N, 3))
y = 1.0 + X @ np.array([0.5, -1.0, 2.0]) + rng.standard_normal(N)
design = np.column_stack([np.ones(N), X])
coef, rss = np.linalg.lstsq(design, y)[:2]
se = np.sqrt(rss[0] / (N - 4)) * np.sqrt(np.diag(np.linalg.inv(design.T @ design)))


def model() -> pm.Model:
    with pm.Model() as m:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=1000)
        intercept = pm.Normal("intercept", 0.0, 10.0)
        w = pm.Normal("w", 0.0, 10.0, shape=3)
        sigma = pm.HalfNormal("sigma", 2.0)
        pm.Normal("y", intercept + X_mb @ w, sigma, observed=y_mb, total_size=N)
    return m


def noise_per_coordinate() -> None:
    """tr(Sigma) / D near the posterior, from mSGLD's noise_trace stat (after burn-in)."""
    with model():
        step = MSGLD(step_size=2e-6, thin=50)
        idata = pm.sample(
            draws=200, tune=200, step=step, chains=1, random_seed=1, progressbar=False
        )
    per_coordinate = float(idata.sample_stats["noise_trace"].mean()) / step.dim
    print(f"tr(Sigma) / D near the posterior: {per_coordinate:.3g}")


def run(step_size: float) -> None:
    with model():
        step = SGNHT(step_size=step_size, friction=1.0, thin=50)
        idata = pm.sample(
            draws=1000,
            tune=200,
            step=step,
            chains=1,
            random_seed=1,
            progressbar=False,
            discard_tuned_samples=False,
            compute_convergence_checks=False,
        )
    print(f"\nSGNHT h = {step_size:g}, A = 1, thermostat_mass = D = {step.dim}")
    for group in ("warmup_sample_stats", "sample_stats"):
        stats = idata[group]
        print(f"  {group}, every 100th draw (of {stats.sizes['draw']}, thin = 50):")
        print("    thermostat:         ", stats["thermostat"].values[0, ::100].round(1))
        print("    kinetic_temperature:", stats["kinetic_temperature"].values[0, ::100].round(2))
    kinetic = idata.sample_stats["kinetic_temperature"].values[0]
    half = kinetic.size // 2
    print(
        "  mean kinetic temperature, first / second half of the draws:",
        kinetic[:half].mean().round(2),
        kinetic[half:].mean().round(2),
    )
    sd = np.array([float(idata.posterior["intercept"].std())])
    sd = np.concatenate([sd, idata.posterior["w"].std(("chain", "draw")).values])
    print("  posterior sd / least-squares standard error:", (sd / se).round(2))


noise_per_coordinate()
run(step_size=1e-3)
run(step_size=5e-3)
