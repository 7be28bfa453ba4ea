"""Weak order of the integrators: bias of the posterior variance against the step size.

Shared by ``tests/test_weak_order.py`` (the slow test) and ``benchmarks/weak_order.py`` (the
table). The target is a full-batch Gaussian linear regression (no ``pm.Minibatch``, so the force
is exact and Sigma = 0): only the discretisation bias remains. For each step size the draws are
whitened with the exact posterior covariance, z = L^{-1}(theta - mean), and

    b(h) = mean_j <z_j^2> - 1

is the relative bias of the posterior variance averaged over the D whitened directions. Its
Monte Carlo standard error comes from ArviZ's ESS of the series mean_j z_j^2. A scheme of weak
order p has b(h) = c h^p + O(h^{p+1}); the order is the slope of log|b| against log h, fitted by
weighted least squares with the delta-method errors se(log|b|) = se(b)/|b| and checked by a
parametric bootstrap.

For the schemes that are linear on a Gaussian target (SGLD, mSGLD without minibatches, SGHMC,
NOGIN) the stationary covariance of the discrete recursion is also computed exactly
(:func:`linear_scheme_bias`, a discrete Lyapunov equation), so each sampled bias can be compared
with its closed-form prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import arviz as az
import numpy as np
import pymc as pm
from models import GaussianRegression
from scipy.linalg import solve_discrete_lyapunov


def weak_order_problem(batch_size: int | None = None) -> GaussianRegression:
    """Regression with N = 100, D = 2, scaled so that the posterior precision is close to I
    (eigenvalues 0.81 and 1.06): h is then in units of 1/omega, the stability limit of the
    leapfrog-type schemes is 2/omega_max = 1.95, and friction 1 mixes the variance well.
    Full batch (exact force) unless ``batch_size`` is given.
    """
    return GaussianRegression.make(n_obs=100, dim=2, batch_size=batch_size, sigma=10.0, seed=0)


def omega_max(problem: GaussianRegression) -> float:
    """Largest frequency sqrt(lambda_max(P)) of the posterior precision P."""
    return float(np.sqrt(np.linalg.eigvalsh(problem.precision).max()))


class DivergenceError(RuntimeError):
    """The chain diverged at this step size: no bias is measured there."""


@dataclass
class VarianceBias:
    """b = mean_j <z_j^2> - 1 with its Monte Carlo standard error."""

    step_size: float
    bias: float
    se: float
    ess: float

    @property
    def z(self) -> float:
        """|b| in standard errors."""
        return abs(self.bias) / self.se


def variance_bias(draws: np.ndarray, mean: np.ndarray, cov: np.ndarray, step_size: float):
    """Relative variance bias of (chain, draw, D) ``draws`` against N(mean, cov)."""
    chol = np.linalg.cholesky(cov)
    z = np.linalg.solve(chol, (draws - mean)[..., None])[..., 0]
    series = (z**2).mean(axis=-1)  # (chain, draw): one scalar per draw
    ess = float(az.ess(series, method="mean"))
    se = float(series.std() / np.sqrt(ess))
    return VarianceBias(step_size, float(series.mean() - 1.0), se, ess)


def sample_variance_bias(
    problem: GaussianRegression,
    make_step: Callable[[float], pm.step_methods.arraystep.ArrayStepShared],
    step_size: float,
    draws: int,
    chains: int = 2,
    seed: int = 1,
) -> VarianceBias:
    """Run ``make_step(step_size)`` inside ``pm.sample`` and measure b(step_size).

    The chains start at the posterior mean; ``tune`` (a tenth of ``draws``) is burn-in.
    """
    with problem.model():
        idata = pm.sample(
            draws=draws,
            tune=max(draws // 10, 100),
            step=make_step(step_size),
            chains=chains,
            cores=1,
            random_seed=seed,
            initvals={"w": problem.mean},
            progressbar=False,
            compute_convergence_checks=False,
        )
    if int(idata.sample_stats["diverging"].sum()) > 0:
        raise DivergenceError(f"divergent draws at step size {step_size}")
    values = idata.posterior["w"].values
    return variance_bias(values, problem.mean, problem.cov, step_size)


@dataclass
class OrderFit:
    """log|b| = log c + p log h fitted to biases with Monte Carlo errors."""

    slope: float
    slope_se: float  # weighted least squares, delta-method weights
    bootstrap_sd: float  # sd of the slope over parametric bootstrap replicates of b
    intercept: float
    chi2: float  # weighted residual sum of squares; ~ chi^2 with len(h) - 2 dof for a power law

    def interval(self, z: float = 4.0) -> tuple[float, float]:
        """slope +- z standard errors (the larger of the WLS and bootstrap errors)."""
        se = max(self.slope_se, self.bootstrap_sd)
        return self.slope - z * se, self.slope + z * se


def _wls(log_h: np.ndarray, log_b: np.ndarray, sd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares of log_b on [1, log_h]: coefficients and their covariance."""
    design = np.column_stack([np.ones_like(log_h), log_h]) / sd[:, None]
    coef, *_ = np.linalg.lstsq(design, log_b / sd, rcond=None)
    return coef, np.linalg.inv(design.T @ design)


def fit_order(biases: Sequence[VarianceBias], replicates: int = 4000, seed: int = 0) -> OrderFit:
    """Fit the weak order from at least three measured biases.

    Each |b| must be several standard errors from zero (the log of a bias that may be zero
    has no meaningful error bar): the caller checks ``VarianceBias.z``. The parametric
    bootstrap redraws every b from N(b, se^2), refits, and reports the sd of the slopes; it
    agrees with the delta-method error when every |b| >> se and exceeds it when not.
    """
    if len(biases) < 3:
        raise ValueError("the order needs at least three step sizes")
    h = np.array([b.step_size for b in biases])
    b = np.array([x.bias for x in biases])
    se = np.array([x.se for x in biases])
    log_h, log_b, sd = np.log(h), np.log(np.abs(b)), se / np.abs(b)
    coef, cov = _wls(log_h, log_b, sd)
    chi2 = float(np.sum(((log_b - coef[0] - coef[1] * log_h) / sd) ** 2))
    rng = np.random.default_rng(seed)
    resampled = np.abs(b + se * rng.standard_normal((replicates, len(b))))
    slopes = [_wls(log_h, np.log(row), sd)[0][1] for row in resampled]
    return OrderFit(
        slope=float(coef[1]),
        slope_se=float(np.sqrt(cov[1, 1])),
        bootstrap_sd=float(np.std(slopes)),
        intercept=float(coef[0]),
        chi2=chi2,
    )


# ------------------------------------------------------------------ closed-form predictions
def _stationary_position_cov(transition: np.ndarray, loading: np.ndarray, dim: int) -> np.ndarray:
    """Stationary covariance of z' = T z + G R (R standard normal), position block."""
    cov = solve_discrete_lyapunov(transition, loading @ loading.T)
    return cov[:dim, :dim]


def _relative_bias(problem: GaussianRegression, position_cov: np.ndarray) -> float:
    """mean_j Var(z_j) - 1 for the whitened stationary covariance: the quantity sampled."""
    chol = np.linalg.cholesky(problem.cov)
    whitened = np.linalg.solve(chol, np.linalg.solve(chol, position_cov).T)
    return float(np.trace(whitened) / position_cov.shape[0] - 1.0)


def _sgld(prec: np.ndarray, eps: float, friction: float):
    # theta' = theta - (eps/2) P theta + sqrt(eps) R (mSGLD is the same with Sigma = 0).
    d = prec.shape[0]
    return np.eye(d) - 0.5 * eps * prec, np.sqrt(eps) * np.eye(d)


def _sghmc(prec: np.ndarray, h: float, friction: float):
    # p' = p - h P x - h A p + sqrt(2 h A) R, x' = x + h p' (force at the new position).
    eye = np.eye(prec.shape[0])
    a = 1.0 - h * friction
    transition = np.block([[eye - h**2 * prec, h * a * eye], [-h * prec, a * eye]])
    root = np.sqrt(2.0 * h * friction)
    return transition, np.vstack([h * root * eye, root * eye])


def _nogin(prec: np.ndarray, h: float, friction: float, same_noise: bool = True):
    # ABOBA with Sigma = 0 on the augmented state (x, p, R1, R2). Algorithm 1 draws R once and
    # uses it in both half kicks (same_noise); two independent draws are a plausible bug.
    d, eye, zero = prec.shape[0], np.eye(prec.shape[0]), np.zeros_like(prec)
    lam2 = np.tanh(friction * h / 2.0)
    lam = np.sqrt(lam2)
    shrink = (1.0 - lam2) / (1.0 + lam2) * eye  # the O step with Sigma = 0: e^{-gamma h}

    def step_matrix(x_row, p_row):
        rest = [[zero, zero, eye, zero], [zero, zero, zero, eye]]
        return np.block([x_row, p_row, *rest])

    drift = step_matrix([eye, 0.5 * h * eye, zero, zero], [zero, eye, zero, zero])
    first = step_matrix([eye, zero, zero, zero], [-0.5 * h * prec, eye, lam * eye, zero])
    second_noise = [lam * eye, zero] if same_noise else [zero, lam * eye]
    second = step_matrix([eye, zero, zero, zero], [-0.5 * h * prec, eye, *second_noise])
    damp = step_matrix([eye, zero, zero, zero], [zero, shrink, zero, zero])
    step = drift @ second @ damp @ first @ drift  # applied right to left: A, B, O, B, A
    return step[: 2 * d, : 2 * d], step[: 2 * d, 2 * d :]


def nogin_two_draws_bias(problem: GaussianRegression, step_size: float, friction: float = 1.0):
    """Exact b(h) of NOGIN with independent noise in its two half kicks (a plausible bug)."""
    transition, loading = _nogin(problem.precision, step_size, friction, same_noise=False)
    return _relative_bias(problem, _stationary_position_cov(transition, loading, len(problem.mean)))


#: Linear schemes whose stationary covariance has a closed form on a Gaussian target.
LINEAR_SCHEMES = {"SGLD": _sgld, "mSGLD": _sgld, "SGHMC": _sghmc, "NOGIN": _nogin}


def linear_scheme_bias(
    name: str, problem: GaussianRegression, step_size: float, friction: float = 1.0
) -> float:
    """Exact b(h) of a linear scheme on the full-batch Gaussian ``problem``.

    Positions are centred at the posterior mean (every scheme here has it as its fixed point).
    """
    transition, loading = LINEAR_SCHEMES[name](problem.precision, step_size, friction)
    return _relative_bias(problem, _stationary_position_cov(transition, loading, len(problem.mean)))
