"""Cheap checks of ``benchmarks/suite.py``: the baselines sample the same posterior as the PyMC
models (their hand-written gradients equal PyMC's), and the time-to-result criterion."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from problems import Problem, Reference
from suite import moment_errors, steady_rate, time_to_result


def small_problems() -> list[Problem]:
    """Each kind of problem on a few rows (the suite's problems differ only in size)."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((40, 3))
    y_lin = X @ np.array([1.0, -0.5, 0.2]) + rng.standard_normal(40)
    y_log = (rng.random(40) < 0.5).astype(float)
    return [
        Problem("lin", "linear", "linear", X, y_lin, 8, prior_sd=np.sqrt(10.0)),
        Problem("log", "logistic", "logistic", X, y_log, 8),
        Problem("ng", "Normal-Gamma", "normal_gamma", None, rng.standard_normal(30), 5),
    ]


def pymc_gradient(problem: Problem, theta: np.ndarray) -> np.ndarray:
    """Full-data gradient of the model's log-density (with Jacobians) in value-variable order."""
    model = problem.model(minibatch=False)
    dlogp = model.compile_dlogp(jacobian=True, mode="FAST_COMPILE")
    point, start = {}, 0
    for var in model.value_vars:
        size = int(np.prod(model.initial_point()[var.name].shape))
        shape = model.initial_point()[var.name].shape
        point[var.name] = theta[start : start + size].reshape(shape)
        start += size
    return dlogp(point)


@pytest.mark.parametrize("problem", small_problems(), ids=lambda p: p.kind)
def test_hand_written_gradients_match_pymc(problem):
    rng = np.random.default_rng(1)
    theta = 0.3 * rng.standard_normal(problem.dim)
    every_row = np.arange(problem.n_obs)  # the minibatch force with all rows is the gradient
    expected = pymc_gradient(problem, theta)
    np.testing.assert_allclose(problem.numpy_force(theta, every_row), expected, rtol=1e-10)
    G = problem.per_observation_gradients(theta)
    prior = problem.numpy_force(theta, every_row) - G.sum(0)
    np.testing.assert_allclose(prior + G.sum(0), expected, rtol=1e-10)


@pytest.mark.parametrize("problem", small_problems(), ids=lambda p: p.kind)
def test_jax_log_density_matches_pymc(problem):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    log_prior, log_lik = problem.jax_densities()
    data = jax.tree.map(jnp.asarray, problem.jax_data())

    def log_density(theta):
        return log_prior(theta) + jnp.sum(jax.vmap(log_lik, in_axes=(None, 0))(theta, data))

    theta = 0.3 * np.random.default_rng(2).standard_normal(problem.dim)
    got = np.asarray(jax.grad(log_density)(jnp.asarray(theta)))
    np.testing.assert_allclose(got, pymc_gradient(problem, theta), rtol=1e-10)


def test_time_to_result_finds_the_first_lasting_checkpoint():
    rng = np.random.default_rng(3)
    ref = Reference(np.zeros(5), np.ones(5), "standard normal")
    # 2,000 far-off draws (a transient), then exact iid draws: the criterion (on the second
    # half of the draws so far) can only hold once the transient is out of that half.
    draws = np.concatenate([np.full((2000, 5), 50.0), rng.standard_normal((38_000, 5))])
    times = np.arange(1, len(draws) + 1) * 1e-3
    k, mean_err, var_err = time_to_result(draws, times, ref)
    assert k is not None and 4000 <= k <= 12_000
    assert mean_err < 0.1 and var_err < 0.1
    # A sampler with 30 % too much variance never reaches it.
    k, _, var_err = time_to_result(1.3 * rng.standard_normal((20_000, 5)), times[:20_000], ref)
    assert k is None and var_err > 0.2
    assert moment_errors(np.array([[1.0], [3.0]]), Reference(np.ones(1), np.ones(1), ""))[0] == 1


def test_steady_rate_excludes_the_first_two_blocks():
    # First block (10 draws, 10 steps each) ready after 5 s of compilation, the second after a
    # 3 s one-off check, then 1 s per block: the steady rate is 100 steps/s.
    blocks = np.array([5.0, 9.0, 10.0, 11.0, 12.0])
    times = np.repeat(blocks, 10)
    assert steady_rate(times, block_draws=10, steps_per_draw=10) == pytest.approx(100.0)
