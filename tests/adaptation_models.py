"""Models of very different scale and conditioning for the warm-up adaptation (issue 6).

Each model reads its data through ``pm.Minibatch``; ``full_data=True`` builds the same model on
all rows for the NUTS reference. :func:`reference` is the exact posterior where it is known
(Gaussian) and a long, seeded NUTS run otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pymc as pm


@dataclass(frozen=True)
class Moments:
    """Posterior means and variances of every scalar element of the named variables."""

    mean: dict[str, np.ndarray]
    var: dict[str, np.ndarray]


def _minibatch(arrays, batch_size, full_data):
    if full_data:
        return arrays, None
    batches = pm.Minibatch(*arrays, batch_size=batch_size)
    if len(arrays) == 1:  # pm.Minibatch returns a single variable for a single array
        batches = (batches,)
    return batches, len(arrays[0])


def scaled_predictors(full_data: bool = False) -> pm.Model:
    """Regression whose predictors span four orders of magnitude (unknown noise scale)."""
    rng = np.random.default_rng(11)
    n_obs = 5000
    X = rng.standard_normal((n_obs, 4)) * np.array([0.01, 0.1, 1.0, 10.0])
    y = 2.0 + X @ np.array([30.0, -5.0, 1.0, 0.05]) + 0.5 * rng.standard_normal(n_obs)
    (X_mb, y_mb), total = _minibatch((X, y), 200, full_data)
    with pm.Model() as model:
        intercept = pm.Normal("intercept", 0, 10)
        w = pm.Normal("w", 0, 100, shape=4)
        sigma = pm.HalfNormal("sigma", 2)
        pm.Normal("y", intercept + X_mb @ w, sigma, observed=y_mb, total_size=total)
    return model


@dataclass(frozen=True)
class WideGaussian:
    """Known-noise regression whose posterior variances differ by 10^4 across coordinates."""

    X: np.ndarray
    y: np.ndarray
    sigma: float = 1.0
    prior_sd: float = 100.0

    @classmethod
    def make(cls) -> WideGaussian:
        rng = np.random.default_rng(12)
        X = rng.standard_normal((4000, 3)) * np.array([1.0, 10.0, 100.0])
        y = X @ np.array([1.0, -0.5, 0.02]) + rng.standard_normal(4000)
        return cls(X, y)

    def model(self, full_data: bool = False) -> pm.Model:
        (X_mb, y_mb), total = _minibatch((self.X, self.y), 100, full_data)
        with pm.Model() as model:
            w = pm.Normal("w", 0, self.prior_sd, shape=3)
            pm.Normal("y", X_mb @ w, self.sigma, observed=y_mb, total_size=total)
        return model

    def moments(self) -> Moments:
        precision = self.X.T @ self.X / self.sigma**2 + np.eye(3) / self.prior_sd**2
        cov = np.linalg.inv(precision)
        mean = cov @ self.X.T @ self.y / self.sigma**2
        return Moments({"w": mean}, {"w": np.diag(cov)})


def wide_variances(full_data: bool = False) -> pm.Model:
    return WideGaussian.make().model(full_data)


def normal_gamma(full_data: bool = False) -> pm.Model:
    """CCAdL's section 4.1 model: x_i ~ N(mu, 1/gamma), N = 100, n = 10."""
    rng = np.random.default_rng(13)
    x = rng.normal(1.0, 1.0 / np.sqrt(2.0), size=100)
    (x_mb,), total = _minibatch((x,), 10, full_data)
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 10)
        gamma = pm.Gamma("gamma", 1.0, 1.0)
        pm.Normal("x", mu, tau=gamma, observed=x_mb, total_size=total)
    return model


def hierarchical(full_data: bool = False) -> pm.Model:
    """Varying intercepts over 8 groups with a half-normal group scale. Centred: with 250
    observations per group the data dominate, where the non-centred form is the
    ill-conditioned one."""
    rng = np.random.default_rng(14)
    n_obs, n_groups = 2000, 8
    group = rng.integers(0, n_groups, n_obs)
    x = rng.standard_normal(n_obs)
    a = 1.0 + 0.5 * rng.standard_normal(n_groups)
    y = a[group] + 0.8 * x + 0.7 * rng.standard_normal(n_obs)
    (x_mb, y_mb, g_mb), total = _minibatch((x, y, group), 100, full_data)
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 5)
        tau = pm.HalfNormal("tau", 1)
        a = pm.Normal("a", mu, tau, shape=n_groups)
        b = pm.Normal("b", 0, 5)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", a[g_mb] + b * x_mb, sigma, observed=y_mb, total_size=total)
    return model


MODELS: dict[str, Callable[..., pm.Model]] = {
    "scaled_predictors": scaled_predictors,
    "wide_variances": wide_variances,
    "normal_gamma": normal_gamma,
    "hierarchical": hierarchical,
}


def moments_of(idata, names: list[str]) -> Moments:
    post = idata.posterior
    flat = {n: post[n].values.reshape(-1, *post[n].shape[2:]) for n in names}
    return Moments(
        {n: np.atleast_1d(v.mean(0)) for n, v in flat.items()},
        {n: np.atleast_1d(v.var(0)) for n, v in flat.items()},
    )


def reference(name: str) -> Moments:
    """Exact moments (wide_variances) or a long NUTS run on the full data (4 x 5000 draws)."""
    if name == "wide_variances":
        return WideGaussian.make().moments()
    model = MODELS[name](full_data=True)
    with model:
        idata = pm.sample(
            5000, tune=1000, chains=4, cores=1, random_seed=0, progressbar=False,
            compute_convergence_checks=False, nuts_sampler="pymc",
        )  # fmt: skip
    return moments_of(idata, [v.name for v in model.free_RVs])


def errors(result: Moments, ref: Moments) -> tuple[float, float]:
    """Largest |mean error| in reference sd and largest |variance ratio - 1| over elements."""
    mean_err = max(
        float(np.max(np.abs(result.mean[n] - ref.mean[n]) / np.sqrt(ref.var[n]))) for n in ref.mean
    )
    var_err = max(float(np.max(np.abs(result.var[n] / ref.var[n] - 1.0))) for n in ref.var)
    return mean_err, var_err
