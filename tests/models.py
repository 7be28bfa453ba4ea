"""Test models with known posteriors, shared by the test modules."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pymc as pm
import pytensor


@dataclass
class GaussianRegression:
    """y = X w + N(0, sigma^2), prior w ~ N(0, prior_sd^2 I): the posterior is Gaussian.

    ``dtype="float32"``: the model reads float32 data and is built under
    ``floatX="float32"`` (the reference moments stay those of the float64 data, which differ
    by float32's rounding, ~1e-7 relative). ``covariates="float32"``: only X is stored in
    float32, the model stays in ``dtype``."""

    X: np.ndarray
    y: np.ndarray
    sigma: float
    prior_sd: float
    batch_size: int | None
    dtype: str = "float64"
    covariates: str | None = None

    @classmethod
    def make(
        cls,
        n_obs=1000,
        dim=2,
        batch_size=100,
        sigma=1.0,
        prior_sd=10.0,
        seed=0,
        dtype="float64",
        covariates=None,
    ):
        rng = np.random.default_rng(seed)
        X = rng.standard_normal((n_obs, dim))
        w = rng.standard_normal(dim)
        y = X @ w + sigma * rng.standard_normal(n_obs)
        return cls(X, y, sigma, prior_sd, batch_size, dtype, covariates)

    @classmethod
    def random_intercepts(cls, groups=99, rows=50, batch_size=500):
        """y = a + b[group] + N(0, 1) with a and b ~ N(0, 10), as a regression on the one-hot
        design with an intercept column: only a + b_j is pinned down by the rows, so a and
        every b_j are strongly correlated a posteriori (-0.99 for 99 groups of 50 rows)."""
        rng = np.random.default_rng(0)
        group = np.repeat(np.arange(groups), rows)
        X = np.column_stack([np.ones(len(group)), np.eye(groups)[group]])
        y = 3.0 + rng.standard_normal(groups)[group] + rng.standard_normal(len(group))
        return cls(X, y, 1.0, 10.0, batch_size)

    @property
    def precision(self) -> np.ndarray:
        return self.X.T @ self.X / self.sigma**2 + np.eye(self.X.shape[1]) / self.prior_sd**2

    @property
    def mean(self) -> np.ndarray:
        return np.linalg.solve(self.precision, self.X.T @ self.y / self.sigma**2)

    @property
    def cov(self) -> np.ndarray:
        return np.linalg.inv(self.precision)

    def model(self) -> pm.Model:
        n_obs, dim = self.X.shape
        X, y = self.X.astype(self.covariates or self.dtype), self.y.astype(self.dtype)
        with pytensor.config.change_flags(floatX=self.dtype), pm.Model() as model:
            if self.batch_size is None:
                total = None
            else:
                X, y = pm.Minibatch(X, y, batch_size=self.batch_size)
                total = n_obs
            w = pm.Normal("w", 0.0, self.prior_sd, shape=dim)
            pm.Normal("y", X @ w, self.sigma, observed=y, total_size=total)
        return model

    def per_observation_gradients(self, theta: np.ndarray) -> np.ndarray:
        """Unscaled g_i(theta) = grad log p(y_i | theta) for every observation (N x D)."""
        residual = self.y - self.X @ theta
        return self.X * residual[:, None] / self.sigma**2

    def expected_noise_covariance(self, mean: np.ndarray, cov: np.ndarray) -> np.ndarray:
        """E_theta Sigma(theta) for theta ~ N(mean, cov), batches drawn with replacement.

        Sigma(theta) = (N^2/n) Cov_i g_i(theta) (population covariance over the N rows). The
        residual is linear in theta, so the expectation is exact: the centre term plus
        E_i[x x^T (x^T C x)] - Xbar C Xbar with Xbar = E_i x x^T (Isserlis).
        """
        n_obs = self.X.shape[0]
        G = self.per_observation_gradients(mean)
        centre = np.cov(G.T, bias=True)
        X = self.X / self.sigma**2
        second = np.einsum("ni,nj,n->ij", X, X, np.einsum("ni,ij,nj->n", self.X, cov, self.X))
        xbar = X.T @ self.X / n_obs
        spread = second / n_obs - xbar @ cov @ xbar.T
        return n_obs**2 / self.batch_size * (centre + spread)


def censored_student_t(batch_size: int | None, n_obs=5000):
    """A regression with Student-t noise of unknown ``nu``, censored below at per-row bounds:
    PyTensor has no second derivative of the Student-t CDF in ``nu``."""
    rng = np.random.default_rng(10)
    X = rng.normal(size=(n_obs, 2))
    lower = rng.uniform(-2, 0, size=n_obs)
    y = np.maximum(rng.standard_t(5, size=n_obs), lower)
    with pm.Model() as model:
        if batch_size is None:
            X_obs, y_obs, lower_obs, total = X, y, lower, None
        else:
            X_obs, y_obs, lower_obs = pm.Minibatch(X, y, lower, batch_size=batch_size)
            total = n_obs
        w = pm.Normal("w", 0, 1, shape=2)
        nu = pm.Gamma("nu", 2, 0.1)
        t = pm.StudentT.dist(nu=nu, mu=X_obs @ w, sigma=1)
        pm.Censored("y", t, lower=lower_obs, upper=None, observed=y_obs, total_size=total)
    return model


def skewed_logistic(n_obs=10_000, dim=10, batch_size=100, seed=5):
    """Logistic regression whose per-observation gradients (y - p) x are skewed; N / n = 100.
    Returns the minibatch model, the full-data model, the full-data MAP, its Laplace
    covariance and the first-order shift constant c3 = (N^3 / n^2) E[d |d|^2] of the centred
    per-observation gradients d."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_obs, dim))
    y = (rng.random(n_obs) < 1 / (1 + np.exp(-X @ rng.standard_normal(dim)))).astype(float)
    w = np.zeros(dim)
    for _ in range(30):  # Newton on the log-posterior (prior N(0, 10^2))
        p = 1 / (1 + np.exp(-X @ w))
        hessian = (X * (p * (1 - p))[:, None]).T @ X + np.eye(dim) / 100
        w += np.linalg.solve(hessian, X.T @ (y - p) - w / 100)
    d = X * (y - 1 / (1 + np.exp(-X @ w)))[:, None]
    d -= d.mean(axis=0)
    c3 = n_obs**3 / batch_size**2 * np.mean(d * np.sum(d**2, axis=1, keepdims=True), axis=0)
    models = []
    for minibatch in (True, False):
        with pm.Model() as model:
            if minibatch:
                X_obs, y_obs = pm.Minibatch(X, y, batch_size=batch_size)
            else:
                X_obs, y_obs = X, y
            weights = pm.Normal("w", 0, 10, shape=dim)
            pm.Bernoulli(
                "y",
                logit_p=X_obs @ weights,
                observed=y_obs,
                total_size=n_obs if minibatch else None,
            )
        models.append(model)
    return *models, w, np.linalg.inv(hessian), c3


def rare_level_logistic(n_obs=4000, batch_size=100, seed=0):
    """A logistic regression with a one-hot level of 10 rows in 4,000 (weight ``w[3]``,
    posterior sd 0.64) under a Laplace prior of free scale, as the main example's model: a
    minibatch of 100 holds that level's rows in about a fifth of the steps."""
    rng = np.random.default_rng(seed)
    group = rng.choice(4, n_obs, p=[0.498, 0.3, 0.2, 0.002])
    X = np.hstack([np.eye(4)[group], rng.standard_normal((n_obs, 2))])
    w = np.array([0.8, -0.4, 0.2, -0.6, 1.0, -0.7])
    y = (rng.random(n_obs) < 1 / (1 + np.exp(-X @ w))).astype(float)
    with pm.Model() as model:
        X_obs, y_obs = pm.Minibatch(X, y, batch_size=batch_size)
        scale = pm.HalfNormal("scale", 1.0)
        weights = pm.Laplace("w", 0.0, scale, shape=X.shape[1])
        pm.Bernoulli("y", logit_p=X_obs @ weights, observed=y_obs, total_size=n_obs)
    return model
