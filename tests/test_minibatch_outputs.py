"""PyMC's per-row outputs computed on ``pm.Minibatch`` data warn (``minibatch_outputs``).

In the sampled model an observed variable is a random minibatch, so posterior predictive draws
and the pointwise log-likelihood computed there hold, at each draw, another random batch's
rows: before, nothing said so and ``az.loo`` on them gave a meaningless elpd."""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm
import pytest
from scipy import stats

from pymc_sgmcmc import SGLD

N_ROWS, BATCH = 400, 40
RNG = np.random.default_rng(7)
X = RNG.standard_normal((N_ROWS, 2))
Y = X @ np.array([1.0, -0.5]) + RNG.standard_normal(N_ROWS)


def regression(batch_size: int | None) -> pm.Model:
    """The model on minibatches of ``batch_size`` rows, or on all rows (``None``)."""
    with pm.Model() as model:
        x, y = (X, Y) if batch_size is None else pm.Minibatch(X, Y, batch_size=batch_size)
        w = pm.Normal("w", 0.0, 10.0, shape=2)
        total_size = None if batch_size is None else N_ROWS
        pm.Normal("y", x @ w, 1.0, observed=y, total_size=total_size)
    return model


def ours(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("pymc_sgmcmc: ")]


@pytest.fixture(scope="module")
def sampled():
    """Draws of the minibatch model, with the log-likelihood ``pm.sample`` adds on request,
    and the warnings that run raised (with their file)."""
    with regression(BATCH), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        idata = pm.sample(
            draws=30,
            tune=0,
            chains=1,
            step=SGLD(step_size=1e-3),
            random_seed=3,
            progressbar=False,
            compute_convergence_checks=False,
            idata_kwargs={"log_likelihood": True},
        )
    return idata, [(str(w.message), w.filename) for w in caught]


def test_pm_sample_asked_for_the_log_likelihood_warns_at_the_callers_line(sampled):
    idata, caught = sampled
    warned = [(m, f) for m, f in caught if m.startswith("pymc_sgmcmc: the log-likelihood")]
    assert len(warned) == 1
    message, filename = warned[0]
    assert "['y']" in message and "random minibatch" in message and "LOO" in message
    assert filename == __file__  # the user's pm.sample call, not PyMC's conversion code
    # What the warning is about: BATCH columns, not one per row.
    assert idata.log_likelihood["y"].shape == (1, 30, BATCH)


def test_the_log_likelihood_warns_on_the_minibatch_model_and_not_on_the_full_data(sampled):
    idata, _ = sampled
    with regression(BATCH), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.compute_log_likelihood(idata, extend_inferencedata=False, progressbar=False)
        pm.stats.compute_log_prior(idata, extend_inferencedata=False, progressbar=False)
    assert len(ours(caught)) == 1 and "log-likelihood of ['y']" in ours(caught)[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = pm.compute_log_likelihood(
            idata, model=regression(None), extend_inferencedata=False, progressbar=False
        )
    assert ours(caught) == []
    # Unchanged results: one column per row, each row's normal log-density at each draw.
    w = idata.posterior["w"].values[0]
    expected = stats.norm.logpdf(Y, w @ X.T, 1.0)
    np.testing.assert_allclose(full["y"].values[0], expected, rtol=1e-12)


def test_predictive_draws_of_minibatch_variables_warn_and_of_others_do_not(sampled):
    idata, _ = sampled
    with regression(BATCH), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.sample_posterior_predictive(idata, progressbar=False, random_seed=1)
        pm.sample_prior_predictive(5, random_seed=1)
    assert len(ours(caught)) == 2
    assert all("['y'] read pm.Minibatch data" in m for m in ours(caught))

    with regression(BATCH), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.sample_posterior_predictive(idata, var_names=["w"], progressbar=False, random_seed=1)
    assert ours(caught) == []
    with regression(None), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predictive = pm.sample_posterior_predictive(idata, progressbar=False, random_seed=1)
    assert ours(caught) == []
    assert predictive.posterior_predictive["y"].shape == (1, 30, N_ROWS)
