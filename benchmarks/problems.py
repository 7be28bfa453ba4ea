"""The benchmark problems of ``benchmarks/suite.py``: data, PyMC models, reference posteriors.

Each problem supplies everything the suite's samplers need, written once:

* the PyMC model (minibatched for the SG samplers, full data for NUTS),
* a hand-written log-prior and per-row log-likelihood for JAX (the BlackJAX baselines),
* a hand-written NumPy minibatch force for the NumPy SGLD baseline,
* the posterior means and variances the accuracy criterion is measured against, and where they
  come from (exact, a Laplace approximation, or a long NUTS run cached on disk).

All samplers work in the unconstrained space of the PyMC model (the ``value_vars``, in model
order); draws are compared with the reference in the reported space (for Normal-Gamma: the
precision gamma, not log gamma).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pymc as pm
import pytensor

HERE = Path(__file__).parent
REFERENCES = HERE / "references"
sys.path.insert(0, str(HERE.parent / "examples"))

from _data import load  # noqa: E402


@dataclass
class Reference:
    """Posterior means and variances in the reported space, and where they come from."""

    mean: np.ndarray
    var: np.ndarray
    source: str


@dataclass
class Problem:
    """One benchmark problem (see the module docstring).

    ``kind`` is "linear", "logistic" or "normal_gamma"; ``X``/``y`` are the data (``X`` is
    None for Normal-Gamma, whose observations are ``y``).
    """

    key: str
    title: str
    kind: str
    X: np.ndarray | None
    y: np.ndarray
    batch_size: int
    prior_sd: float = 1.0
    noise_sd: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_obs(self) -> int:
        return len(self.y)

    @property
    def dim(self) -> int:
        return 2 if self.kind == "normal_gamma" else self.X.shape[1]

    def astype(self, dtype: str) -> Problem:
        """The same problem with its data in ``dtype`` (for the baselines' float32 runs; the
        scales become Python floats, which NumPy and JAX do not let promote float32)."""
        X = None if self.X is None else self.X.astype(dtype)
        return replace(
            self,
            X=X,
            y=self.y.astype(dtype),
            prior_sd=float(self.prior_sd),
            noise_sd=float(self.noise_sd),
        )

    # ------------------------------------------------------------------ PyMC
    def model(
        self, minibatch: bool = True, dtype: str = "float64", covariates: str | None = None
    ) -> pm.Model:
        """The PyMC model: minibatched with ``total_size`` for SG samplers, full data for NUTS.

        ``dtype="float32"``: the data in float32 and the model built under
        ``floatX="float32"``, so that the samplers run in float32. ``covariates="float32"``:
        X alone stored in float32, the model in ``dtype``."""
        with pytensor.config.change_flags(floatX=dtype):
            return self._model(minibatch, dtype, covariates or dtype)

    def _model(self, minibatch: bool, dtype: str, covariates: str) -> pm.Model:
        X = None if self.X is None else self.X.astype(covariates)
        y = self.y.astype(dtype)
        with pm.Model() as model:
            if self.kind == "normal_gamma":
                gamma = pm.Gamma("gamma", 1.0, 1.0)  # sampled as log(gamma)
                sd = 1.0 / pm.math.sqrt(gamma)
                mu = pm.Normal("mu", 0.0, sd)
                data = pm.Minibatch(y, batch_size=self.batch_size) if minibatch else y
                total = self.n_obs if minibatch else None
                pm.Normal("x", mu, sd, observed=data, total_size=total)
                return model
            if minibatch:
                X, y = pm.Minibatch(X, y, batch_size=self.batch_size)
                total = self.n_obs
            else:
                total = None
            w = pm.Normal("w", 0.0, self.prior_sd, shape=self.dim)
            if self.kind == "linear":
                pm.Normal("y", X @ w, self.noise_sd, observed=y, total_size=total)
            else:
                pm.Bernoulli("y", logit_p=X @ w, observed=y, total_size=total)
        return model

    def draws_from_idata(self, idata) -> np.ndarray:
        """Draws of chain 0 in the reported space, shape (draws, D)."""
        post = idata.posterior
        if self.kind == "normal_gamma":
            return np.column_stack([post["gamma"].values[0], post["mu"].values[0]])
        return np.asarray(post["w"].values[0])

    def to_reported(self, theta: np.ndarray) -> np.ndarray:
        """Unconstrained draws (value-variable order) to the reported space."""
        if self.kind == "normal_gamma":
            return np.column_stack([np.exp(theta[:, 0]), theta[:, 1]])
        return theta

    def initial_point(self) -> np.ndarray:
        """The model's initial point in the unconstrained space (PyMC's default start):
        w = 0; for Normal-Gamma log gamma = log(1) = 0 (the prior mean) and mu = 0."""
        return np.zeros(self.dim)

    # ------------------------------------------------------------------ NumPy baseline
    def numpy_force(self, theta: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Minibatch force grad log prior + (N/n) sum_i grad log p(x_i | theta), by hand."""
        scale = self.n_obs / len(idx)
        if self.kind == "normal_gamma":
            s, mu = theta
            gamma, x = np.exp(s), self.y[idx]
            r = x - mu
            ds = -gamma + 1.5 - 0.5 * gamma * mu**2 + scale * np.sum(0.5 - 0.5 * gamma * r**2)
            dmu = -gamma * mu + scale * gamma * np.sum(r)
            return np.array([ds, dmu])
        Xb, yb = self.X[idx], self.y[idx]
        eta = Xb @ theta
        if self.kind == "linear":
            resid = (yb - eta) / self.noise_sd**2
        else:
            resid = yb - 1.0 / (1.0 + np.exp(-eta))
        return -theta / self.prior_sd**2 + scale * (Xb.T @ resid)

    def per_observation_gradients(self, theta: np.ndarray) -> np.ndarray:
        """g_i(theta) = grad log p(x_i | theta) for every observation (N x D), by hand."""
        if self.kind == "normal_gamma":
            gamma, r = np.exp(theta[0]), self.y - theta[1]
            return np.column_stack([0.5 - 0.5 * gamma * r**2, gamma * r])
        eta = self.X @ theta
        if self.kind == "linear":
            resid = (self.y - eta) / self.noise_sd**2
        else:
            resid = self.y - 1.0 / (1.0 + np.exp(-eta))
        return self.X * resid[:, None]

    def noise_scale(self, theta: np.ndarray) -> float:
        """Largest eigenvalue of the covariance of the minibatch force at ``theta``:
        Sigma = (N^2 / n) Cov_i g_i (batches drawn with replacement, ALGORITHMS.md)."""
        G = self.per_observation_gradients(theta)
        cov = np.atleast_2d(np.cov(G.T, bias=True))
        return float(self.n_obs**2 / self.batch_size * np.linalg.eigvalsh(cov)[-1])

    # ------------------------------------------------------------------ JAX baseline
    def jax_densities(self):
        """(log_prior(theta), log_likelihood(theta, row)) in JAX, for BlackJAX's
        ``grad_estimator`` (which vmaps the row log-likelihood over the minibatch and
        multiplies its mean by N)."""
        import jax
        import jax.numpy as jnp

        if self.kind == "normal_gamma":

            def log_prior(theta):
                s, mu = theta[0], theta[1]
                return -jnp.exp(s) + 1.5 * s - 0.5 * jnp.exp(s) * mu**2

            def log_lik(theta, x):
                s, mu = theta[0], theta[1]
                return 0.5 * s - 0.5 * jnp.exp(s) * (x - mu) ** 2

            return log_prior, log_lik

        prior_var, noise_var = self.prior_sd**2, self.noise_sd**2

        def log_prior(theta):
            return -0.5 * jnp.sum(theta**2) / prior_var

        if self.kind == "linear":

            def log_lik(theta, row):
                x, y = row
                return -0.5 * (y - x @ theta) ** 2 / noise_var

        else:

            def log_lik(theta, row):
                x, y = row
                eta = x @ theta
                return y * eta - jax.nn.softplus(eta)

        return log_prior, log_lik

    def jax_data(self):
        """The data as BlackJAX minibatches index them: an array or a tuple of arrays."""
        return self.y if self.kind == "normal_gamma" else (self.X, self.y)

    # ------------------------------------------------------------------ reference
    def curvature(self, reference_cov_unconstrained: np.ndarray) -> float:
        """Largest eigenvalue of the posterior precision in the unconstrained space."""
        return float(1.0 / np.linalg.eigvalsh(reference_cov_unconstrained)[0])


# ---------------------------------------------------------------------- constructors
def linear_regression(seed: int = 0) -> Problem:
    """P1 (mCCAdL section 3.1): N = 10,000, D = 100, n = 500, prior N(0, 10 I), unit noise."""
    rng = np.random.default_rng(seed)
    n_obs, dim = 10_000, 100
    X = rng.standard_normal((n_obs, dim))
    y = X @ rng.standard_normal(dim) + rng.standard_normal(n_obs)
    return Problem("P1", "P1 linear regression", "linear", X, y, 500, prior_sd=np.sqrt(10.0))


def normal_gamma(seed: int = 0) -> Problem:
    """P2 (CCAdL section 4.1): x_i ~ N(mu, 1/gamma), mu | gamma ~ N(0, 1/gamma),
    gamma ~ Gamma(1, 1); N = 100, n = 10 (the model of ``tests/test_samplers.py``)."""
    x = np.random.default_rng(seed).standard_normal(100)
    return Problem("P2", "P2 Normal-Gamma", "normal_gamma", None, x, 10)


def synthetic_logistic(key: str, n_obs: int, dim: int, batch: int, seed: int) -> Problem:
    """Logistic regression on standard-normal features; true weights N(0, 4/D) (logit sd 2,
    so most probabilities are far from 0 and 1); prior N(0, I)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_obs, dim))
    w = rng.standard_normal(dim) * 2.0 / np.sqrt(dim)
    y = (rng.random(n_obs) < 1.0 / (1.0 + np.exp(-(X @ w)))).astype(np.float64)
    title = f"{key} logistic regression (synthetic)"
    return Problem(key, title, "logistic", X, y, batch, prior_sd=1.0)


def mnist_projected(seed: int = 0) -> Problem:
    """MNIST 7 vs 9 (mCCAdL section 3.2): pixels / 255 projected on 100 seeded Gaussian
    directions, each projected feature standardised; prior N(0, I); n = 500; no intercept."""
    data = load("mnist")
    X = data["X_train"].astype(np.float64) / 255.0
    proj = np.random.default_rng(seed).standard_normal((X.shape[1], 100)) / np.sqrt(X.shape[1])
    Z = X @ proj
    Z = (Z - Z.mean(0)) / Z.std(0)
    y = data["y_train"].astype(np.float64)
    return Problem("MNIST", "MNIST 7 vs 9 logistic regression", "logistic", Z, y, 500)


def make_problem(key: str) -> Problem:
    """Build a problem by its key (P1, P2, P3, P4, MNIST)."""
    if key == "P1":
        return linear_regression()
    if key == "P2":
        return normal_gamma()
    if key == "P3":
        return synthetic_logistic("P3", 50_000, 50, 500, seed=3)
    if key == "P4":
        return synthetic_logistic("P4", 1_000_000, 50, 1_000, seed=4)
    if key == "MNIST":
        return mnist_projected()
    raise ValueError(f"unknown problem {key!r}")


PROBLEMS = ("P1", "P2", "P3", "P4", "MNIST")


# ---------------------------------------------------------------------- exact and Laplace
def exact_reference(problem: Problem) -> tuple[Reference, np.ndarray, np.ndarray]:
    """Exact posterior moments of the conjugate problems, the unconstrained covariance (exact
    for P1; for Normal-Gamma the Laplace covariance in (log gamma, mu)) and the unconstrained
    posterior centre; the last two only scale the step sizes."""
    if problem.kind == "linear":
        prec = problem.X.T @ problem.X / problem.noise_sd**2 + np.eye(problem.dim) / (
            problem.prior_sd**2
        )
        cov = np.linalg.inv(prec)
        mean = cov @ problem.X.T @ problem.y / problem.noise_sd**2
        return Reference(mean, np.diag(cov).copy(), "exact Gaussian posterior"), cov, mean
    x = problem.y
    n_obs, xbar = len(x), x.mean()
    kappa, alpha = 1 + n_obs, 1 + n_obs / 2
    beta = 1 + 0.5 * ((x - xbar) ** 2).sum() + n_obs * xbar**2 / (2 * kappa)
    mean = np.array([alpha / beta, n_obs * xbar / kappa])
    var = np.array([alpha / beta**2, beta / (kappa * (alpha - 1))])
    # Curvature in (log gamma, mu) at the mode: d2/ds2 ~ alpha, d2/dmu2 = kappa * E[gamma].
    cov_u = np.diag([1.0 / alpha, 1.0 / (kappa * mean[0])])
    centre = np.array([np.log(mean[0]), mean[1]])
    return Reference(mean, var, "exact Normal-Gamma posterior"), cov_u, centre


def laplace_logistic(problem: Problem, iters: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """MAP by Newton's method on the full data and the inverse Hessian there.

    Bernstein-von Mises: the posterior differs from this Gaussian by O(1/sqrt(N)) relative to
    its sd (about 0.1 % at N = 10^6); the suite checks the Laplace moments against the NUTS
    reference on P3.
    """
    X, y = problem.X, problem.y
    w = np.zeros(problem.dim)
    prior_prec = 1.0 / problem.prior_sd**2
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(X @ w)))
        grad = X.T @ (y - p) - prior_prec * w
        hess = (X * (p * (1 - p))[:, None]).T @ X + prior_prec * np.eye(problem.dim)
        delta = np.linalg.solve(hess, grad)
        w = w + delta
        if np.max(np.abs(delta)) < 1e-12:
            break
    p = 1.0 / (1.0 + np.exp(-(X @ w)))
    hess = (X * (p * (1 - p))[:, None]).T @ X + prior_prec * np.eye(problem.dim)
    return w, np.linalg.inv(hess)


def nuts_reference(problem: Problem, draws: int, seed: int = 20261121) -> np.ndarray:
    """Long full-data NUTS run (2 chains, 1,000 tuning draws each), draws of both chains."""
    with problem.model(minibatch=False):
        idata = pm.sample(
            draws=draws,
            tune=1000,
            chains=2,
            cores=1,
            random_seed=seed,
            progressbar=False,
            compute_convergence_checks=False,
            nuts_sampler="pymc",  # the cached reference's sampler, nutpie installed or not
        )
    return np.concatenate(idata.posterior["w"].values, axis=0)


def reference(problem: Problem, allow_nuts: bool, nuts_draws: int = 1500):
    """Reference moments, the unconstrained covariance and centre (to scale step sizes) and,
    for the logistic problems, the Laplace moments (else None).

    Logistic problems: a long NUTS run where it is affordable (P3, MNIST), whose moments are
    kept in the small committed ``benchmarks/references/<key>_nuts.npz`` and reused while the
    data set is unchanged (a checksum of X and y), recomputed otherwise when ``allow_nuts``;
    else (P4, or ``--quick`` without a stored reference) the Laplace approximation.
    """
    if problem.kind != "logistic":
        return (*exact_reference(problem), None)
    mode, cov = laplace_logistic(problem)
    laplace = Reference(mode, np.diag(cov).copy(), "Laplace approximation at the full-data MAP")
    if problem.key == "P4":
        return laplace, cov, mode, laplace
    REFERENCES.mkdir(exist_ok=True)
    path = REFERENCES / f"{problem.key}_nuts.npz"
    # The cache is valid for this exact data set: keyed by a checksum of X and y.
    checksum = float(np.sum(problem.X[::97]) + np.sum(problem.y * np.arange(problem.n_obs)))
    if path.exists():
        with np.load(path) as f:
            if float(f["checksum"]) == checksum:
                ess = float(f["ess_min"])
                source = (
                    f"NUTS, 2 chains x {int(f['draws'])} draws after 1,000 tuning draws "
                    f"(min bulk ESS {ess:.0f}), stored in {path.relative_to(HERE.parent)}"
                )
                return Reference(f["mean"], f["var"], source), cov, mode, laplace
    if not allow_nuts:
        return laplace, cov, mode, laplace
    import arviz as az

    draws = nuts_reference(problem, nuts_draws)
    ess = az.ess(draws.reshape(2, nuts_draws, -1), method="bulk")
    ess_min = float(np.min(np.asarray(ess)))
    np.savez(
        path,
        mean=draws.mean(0),
        var=draws.var(0),
        checksum=checksum,
        draws=nuts_draws,
        ess_min=ess_min,
    )
    source = (
        f"NUTS, 2 chains x {nuts_draws} draws after 1,000 tuning draws (min bulk ESS "
        f"{ess_min:.0f}), computed in this run, stored in {path.relative_to(HERE.parent)}"
    )
    return Reference(draws.mean(0), draws.var(0), source), cov, mode, laplace
