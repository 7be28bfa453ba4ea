"""The first model of the getting-started page: a linear regression read through pm.Minibatch.

Run from the repository root (the output is committed beside this file and shown on the page):
``.venv/bin/python docs/snippets/first_model.py > docs/snippets/first_model_output.txt 2>&1``
"""

import arviz as az
import numpy as np
import pymc as pm

from pymc_sgmcmc import SGLD

# Simulated data: N = 10,000 rows, 3 predictors, noise sd 1.
rng = np.random.default_rng(0)
N = 10_000
X = rng.standard_normal((N, 3))
y = 1.0 + X @ np.array([0.5, -1.0, 2.0]) + rng.standard_normal(N)

with pm.Model(coords={"predictor": ["x0", "x1", "x2"]}) as model:
    # One pm.Minibatch call slices X and y with the same 1,000 random rows at every step.
    X_mb, y_mb = pm.Minibatch(X, y, batch_size=1000)
    intercept = pm.Normal("intercept", 0.0, 10.0)
    w = pm.Normal("w", 0.0, 10.0, dims="predictor")
    sigma = pm.HalfNormal("sigma", 2.0)
    # total_size=N scales the batch log-likelihood by N/n: the target is the full-data posterior.
    pm.Normal("y", intercept + X_mb @ w, sigma, observed=y_mb, total_size=N)

    # No step size: it is chosen during tune, with a diagonal preconditioner and thin.
    step = SGLD()
    idata = pm.sample(step=step, chains=2, cores=1, random_seed=1, progressbar=False)

print(az.summary(idata))

# Reference: least squares and its standard errors (the priors are negligible at N = 10,000).
design = np.column_stack([np.ones(N), X])
coef, rss = np.linalg.lstsq(design, y)[:2]
sigma_hat = np.sqrt(rss[0] / (N - 4))
se = sigma_hat * np.sqrt(np.diag(np.linalg.inv(design.T @ design)))
print(
    "least squares:", coef.round(4), "standard errors:", se.round(4), "sigma:", sigma_hat.round(4)
)

# The adaptation's choices: the step size of each chain (a stat of every draw), and, after a
# cores=1 run, the last chain's thin and preconditioner scales (unconstrained space: log sigma).
stats = idata.sample_stats
print("step size per chain:", stats["step_size"].values[:, -1])
print("thin:", step.thin, "scales:", step.scale.round(4))
print("sample_stats:", sorted(stats.data_vars))
print("divergences:", int(stats["diverging"].sum()))
