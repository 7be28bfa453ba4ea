"""Predictions and LOO from a model sampled through pm.Minibatch (the getting-started page).

Run from the repository root (the output is committed beside this file and shown on the page):
``.venv/bin/python docs/snippets/predictions.py > docs/snippets/predictions_output.txt 2>&1``
"""

import arviz as az
import numpy as np
import pymc as pm

from pymc_sgmcmc import SGLD

rng = np.random.default_rng(0)
N = 5_000
X = rng.standard_normal((N, 3))
y = 1.0 + X @ np.array([0.5, -1.0, 2.0]) + rng.standard_normal(N)
X_new = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5]])  # two rows to predict


def linear_regression(X, y=None, batch_size=None):
    """The model, on minibatches of (X, y) for sampling or on the full X for predictions."""
    with pm.Model(coords={"predictor": ["x0", "x1", "x2"]}) as model:
        if batch_size is not None:
            X, y = pm.Minibatch(X, y, batch_size=batch_size)
        intercept = pm.Normal("intercept", 0.0, 10.0)
        w = pm.Normal("w", 0.0, 10.0, dims="predictor")
        sigma = pm.HalfNormal("sigma", 2.0)
        total_size = N if batch_size is not None else None
        pm.Normal("y", intercept + X @ w, sigma, observed=y, total_size=total_size)
    return model


with linear_regression(X, y, batch_size=500):
    idata = pm.sample(step=SGLD(), chains=2, cores=1, random_seed=1, progressbar=False)

# The sampling model's "y" is a random minibatch: pm.sample_posterior_predictive on it would
# predict 500 random rows. Predict from the same variables in a model built on the new rows.
with linear_regression(X_new):
    predictions = pm.sample_posterior_predictive(
        idata, var_names=["y"], predictions=True, random_seed=2, progressbar=False
    )

y_new = predictions.predictions["y"]
print("predictive mean:", y_new.mean(("chain", "draw")).values.round(2))
print("predictive sd:", y_new.std(("chain", "draw")).values.round(2))
print("true mean:", (1.0 + X_new @ np.array([0.5, -1.0, 2.0])).round(2), "noise sd: 1")

# Likewise the pointwise log-likelihood for LOO: on the sampling model it would be that of one
# random batch; on the model built on the full data it has one column per row of (X, y).
pm.compute_log_likelihood(idata, model=linear_regression(X, y), progressbar=False)
loo = az.loo(idata)
print("log-likelihood shape (chain, draw, row):", idata.log_likelihood["y"].shape)
print(f"elpd_loo: {loo.elpd:.1f} (se {loo.se:.1f}), p_loo: {loo.p:.2f} (5 parameters)")
