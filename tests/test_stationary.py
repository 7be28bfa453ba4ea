"""Stationary distributions of the discretised schemes, predicted exactly and met in sampling.

On a Gaussian linear regression every integrator without a thermostat is a linear recursion
driven by Gaussian noise and by the minibatch-gradient noise, whose covariance Sigma(theta) is
quadratic in theta. Its stationary covariance is therefore the fixed point of a discrete
Lyapunov equation, computed here from the exact full-data Sigma (``models.py``). The draws must
match it within Monte Carlo error, and each test also checks that the prediction differs from
the exact posterior by many standard errors, so the test would see a wrong scaling of N/n, of
the injected noise or of the covariance correction. ``test_checks_can_fail`` runs the same
check on deliberately broken updates.
"""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest
from checks import Z_TOLERANCE, gaussian_check, posterior_draws
from models import GaussianRegression
from scipy.linalg import solve_discrete_lyapunov

from pymc_sgmcmc import MSGLD, SGHMC, SGLD

CHAINS, DRAWS = 2, 20_000


def fixed_point(problem: GaussianRegression, transition, noise_cov, dim_state, iterations=10):
    """Stationary covariance of z' = T z + noise, Cov(noise) = Q(E Sigma) with E Sigma depending
    on the theta-block of the stationary covariance itself."""
    d = problem.X.shape[1]
    cov = np.zeros((dim_state, dim_state))
    cov[:d, :d] = problem.cov
    for _ in range(iterations):
        sigma = problem.expected_noise_covariance(problem.mean, cov[:d, :d])
        cov = solve_discrete_lyapunov(transition, noise_cov(sigma))
    return cov[:d, :d]


def sgld_prediction(problem, eps):
    d = problem.X.shape[1]
    transition = np.eye(d) - 0.5 * eps * problem.precision
    return fixed_point(problem, transition, lambda s: eps * np.eye(d) + eps**2 / 4 * s, d)


def msgld_prediction(problem, eps):
    # Injected noise sqrt(eps)(I - eps Sigma_hat / 8) R: E[(I - eps Sigma_hat/8)^2] is taken as
    # (I - eps Sigma/8)^2; the error, eps^3 Var(Sigma_hat)/64, is below 1e-4 relative here.
    d = problem.X.shape[1]
    transition = np.eye(d) - 0.5 * eps * problem.precision

    def noise(s):
        shrink = np.eye(d) - eps / 8 * s
        return eps * shrink @ shrink + eps**2 / 4 * s

    return fixed_point(problem, transition, noise, d)


def sghmc_prediction(problem, h, friction, estimate: bool):
    # State (x, p), x = theta - mean: p' = (1 - hA) p - h P x + h xi + sqrt(2h) N R,
    # x' = x + h p'. Noise: xi (Cov Sigma) and the injected term with Cov A I (- h Sigma / 2).
    d = problem.X.shape[1]
    eye, prec = np.eye(d), problem.precision
    a = 1 - h * friction
    transition = np.block([[eye - h**2 * prec, h * a * eye], [-h * prec, a * eye]])
    xi_loading = np.array([[h**4, h**3], [h**3, h**2]])
    injected_loading = 2 * h * np.array([[h**2, h], [h, 1.0]])

    def noise(s):
        injected = friction * eye - (0.5 * h * s if estimate else 0)
        return np.kron(xi_loading, s) + np.kron(injected_loading, injected)

    return fixed_point(problem, transition, noise, 2 * d)


def sample(problem, step_factory, seed=1, thin=1):
    with problem.model():
        step = step_factory()
        idata = pm.sample(
            draws=DRAWS,
            tune=1000,
            step=step,
            chains=CHAINS,
            cores=1,
            random_seed=seed,
            progressbar=False,
            compute_convergence_checks=False,
        )
    return idata


CASES = {
    # name: (problem, step factory, prediction, the prediction of a plausible bug)
    "sgld": (
        dict(n_obs=1000, dim=2, batch_size=100),
        lambda: SGLD(step_size=5e-4, adapt_preconditioner=False),
        lambda p: sgld_prediction(p, 5e-4),
        lambda p: p.cov,  # the exact posterior
    ),
    # The same in float32 (state, noise, data and arithmetic): its rounding must not show.
    "sgld_float32": (
        dict(n_obs=1000, dim=2, batch_size=100, dtype="float32"),
        lambda: SGLD(step_size=5e-4, adapt_preconditioner=False),
        lambda p: sgld_prediction(p, 5e-4),
        lambda p: p.cov,
    ),
    "msgld": (
        dict(n_obs=1000, dim=2, batch_size=500),
        lambda: MSGLD(step_size=5e-4, adapt_preconditioner=False),
        lambda p: msgld_prediction(p, 5e-4),
        lambda p: sgld_prediction(p, 5e-4),  # the noise correction missing
    ),
    "sghmc": (
        dict(n_obs=1000, dim=2, batch_size=500),
        lambda: SGHMC(step_size=5e-3, friction=10.0, thin=5, adapt_preconditioner=False),
        lambda p: sghmc_prediction(p, 5e-3, 10.0, estimate=False),
        lambda p: p.cov,
    ),
    "sghmc_estimate": (
        dict(n_obs=1000, dim=2, batch_size=500),
        lambda: SGHMC(
            step_size=5e-3,
            friction=10.0,
            gradient_noise="estimate",
            thin=5,
            adapt_preconditioner=False,
        ),
        lambda p: sghmc_prediction(p, 5e-3, 10.0, estimate=True),
        lambda p: sghmc_prediction(p, 5e-3, 10.0, estimate=False),  # B-hat ignored
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stationary_covariance_matches_discrete_lyapunov(case):
    kwargs, factory, predict, predict_bug = CASES[case]
    problem = GaussianRegression.make(**kwargs)
    predicted = predict(problem)
    idata = sample(problem, factory)
    draws = posterior_draws(idata, "w")
    check = gaussian_check(draws, problem.mean, predicted)
    print(case, "inflation", np.diag(predicted) / np.diag(problem.cov), check.describe())
    assert check.passes(), check.describe()
    assert not idata.sample_stats["diverging"].any()
    if "noise_clipped" in idata.sample_stats:
        assert not idata.sample_stats["noise_clipped"].any()
    # ...and the same draws are many standard errors away from what a plausible bug gives.
    alternative = gaussian_check(draws, problem.mean, predict_bug(problem))
    assert alternative.var_errors.max() > 2 * Z_TOLERANCE, alternative.describe()


class BrokenSGLD(SGLD):
    """SGLD with the injected noise of the eps/2 convention mixed up: sqrt(2 eps) R."""

    def integrate(self, state, indices, noise, h):
        theta = state["theta"] + 0.5 * h * state["force"] + pt.sqrt(2 * h) * noise[0]
        return self.carried({"theta": theta, **self.evaluate(theta, indices, noise, h)})


class DoubleScaledSGLD(SGLD):
    """SGLD that applies N/n a second time to the minibatch part of the force."""

    def evaluate(self, theta, indices, noise, h):
        out = super().evaluate(theta, indices, noise, h)
        position = self.target.position(theta)
        fixed = self.sg_model._at(position, indices, [self.sg_model.fixed_force])[0]
        fixed = self.target.preconditioner.pull_back(fixed)
        out["force"] = fixed + 10.0 * (out["force"] - fixed)
        return out


@pytest.mark.parametrize("broken", [BrokenSGLD, DoubleScaledSGLD])
def test_checks_can_fail(broken):
    problem = GaussianRegression.make(n_obs=1000, dim=2, batch_size=100)
    idata = sample(
        problem,
        lambda: broken(
            step_size=5e-4 if broken is BrokenSGLD else 5e-5, adapt_preconditioner=False
        ),
    )
    eps = 5e-4 if broken is BrokenSGLD else 5e-5
    check = gaussian_check(posterior_draws(idata, "w"), problem.mean, sgld_prediction(problem, eps))
    assert not check.passes(), check.describe()
