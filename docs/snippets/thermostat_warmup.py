"""SGNHT's thermostat under minibatch noise (the guide's "thermostat warm-up").

The first model's regression (N = 10,000, n = 1,000, curvature about 1e4) sampled with SGNHT,
A = 1, mu = D: at the fixed step sizes h = 1e-3 and h = 5e-3 (half the stability limit
1/sqrt(curvature)) without a preconditioner, 200 tuning draws; and with the defaults (step
size, preconditioner and thin adapted during pm.sample's default 1,000 tuning draws). The
thermostat starts at its equilibrium estimate A + h tr(Sigma) / (2D) at the chain start, at
each adaptation-window end and at the end of tuning (with an adapted step size it is held at A
in the initial interval instead). Prints tr(Sigma) / D (measured by
mSGLD's noise_trace stat near the posterior), the thermostat and kinetic temperature along
each SGNHT run, and the posterior standard deviations against the least-squares standard
errors (for sigma: its asymptotic sd sigma_hat / sqrt(2N)).
Run (the output is committed beside this file):
``.venv/bin/python docs/snippets/thermostat_warmup.py > docs/snippets/thermostat_warmup_output.txt``
"""

import arviz as az
import numpy as np
import pymc as pm

from pymc_sgmcmc import MSGLD, SGNHT

rng = np.random.default_rng(0)
N = 10_000
X = rng.standard_normal((N, 3))
y = 1.0 + X @ np.array([0.5, -1.0, 2.0]) + rng.standard_normal(N)
design = np.column_stack([np.ones(N), X])
coef, rss = np.linalg.lstsq(design, y)[:2]
sigma_hat = np.sqrt(rss[0] / (N - 4))
se = sigma_hat * np.sqrt(np.diag(np.linalg.inv(design.T @ design)))
# Reference sds of intercept, w[0..2] and sigma (the priors are negligible at N = 10,000).
reference_sd = np.append(se, sigma_hat / np.sqrt(2 * N))


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
        step = MSGLD(step_size=2e-6, thin=50, adapt_preconditioner=False)
        idata = pm.sample(
            draws=200, tune=200, step=step, chains=1, random_seed=1, progressbar=False
        )
    per_coordinate = float(idata.sample_stats["noise_trace"].mean()) / step.dim
    print(f"tr(Sigma) / D near the posterior: {per_coordinate:.3g}")


def run(step_size: float | None, tune: int = 200) -> None:
    with model():
        if step_size is None:
            step = SGNHT(friction=1.0)
        else:
            step = SGNHT(step_size=step_size, friction=1.0, thin=50, adapt_preconditioner=False)
        idata = pm.sample(
            draws=1000,
            tune=tune,
            step=step,
            chains=1,
            random_seed=1,
            progressbar=False,
            discard_tuned_samples=False,
            compute_convergence_checks=False,
        )
    h = float(idata.sample_stats["step_size"].values[0, -1])
    how = "fixed, no preconditioner" if step_size is not None else "adapted (the defaults)"
    print(f"\nSGNHT h = {h:.3g} ({how}), thin = {step.thin}, A = 1, thermostat_mass = D = 5")
    for group in ("warmup_sample_stats", "sample_stats"):
        stats = idata[group]
        print(f"  {group}, every 100th draw (of {stats.sizes['draw']}):")
        print("    thermostat:         ", stats["thermostat"].values[0, ::100].round(1))
        print("    kinetic_temperature:", stats["kinetic_temperature"].values[0, ::100].round(2))
    kinetic = idata.sample_stats["kinetic_temperature"].values[0]
    half = kinetic.size // 2
    print(
        "  mean kinetic temperature, first / second half of the draws:",
        kinetic[:half].mean().round(2),
        kinetic[half:].mean().round(2),
    )
    post = idata.posterior
    sd = np.concatenate([[float(post["intercept"].std())], post["w"].std(("chain", "draw")).values])
    sd = np.append(sd, float(post["sigma"].std()))
    print("  posterior sd / reference sd (intercept, w, sigma):", (sd / reference_sd).round(2))
    ess = az.ess(idata)
    print("  smallest bulk ESS:", round(min(float(ess[v].min()) for v in ess.data_vars)))


noise_per_coordinate()
run(step_size=1e-3)
run(step_size=5e-3)
run(step_size=None, tune=1000)  # pm.sample's default tune
