"""Parallel chains (``cores > 1``) hand their draws to the main process in batches.

The batches change how draws travel, never which draws a chain makes: every test compares
with the sequential run of the same seed, bit for bit. Worker processes start with
``forkserver``: they must not inherit this process's threads (JAX's, when the JAX tests ran
earlier in it).
"""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm
import pymc.sampling.parallel as ps
import pytest
from models import GaussianRegression

from pymc_sgmcmc import SGLD, SGNHT
from pymc_sgmcmc import parallel as sg_parallel

SAMPLE_KWARGS = dict(progressbar=False, compute_convergence_checks=False)


@pytest.fixture
def handovers(monkeypatch):
    """The draws of each batch the main process receives from a worker."""
    counts: list[int] = []
    receive = sg_parallel._BatchProcessAdapter.recv_batch

    def counting(processes):
        proc, first, count, stats = receive(processes)
        counts.append(count)
        return proc, first, count, stats

    monkeypatch.setattr(sg_parallel._BatchProcessAdapter, "recv_batch", staticmethod(counting))
    return counts


def test_pm_sample_uses_the_batching_sampler():
    assert ps.ParallelSampler is sg_parallel.ParallelSampler


@pytest.mark.parametrize("recording", ["batches", "callback"])
def test_batched_chains_equal_sequential_chains(
    recording, handovers, progress_updates, per_draw_records
):
    # Three chains on two cores (one waits for a free core), tuning draws kept: every draw,
    # tuning flag and stat arrives where the sequential run puts it. Without a callback the
    # main process records each batch at once; a callback takes every draw, so with one each
    # draw goes through PyMC's loop. Either way the progress bar advances draw by draw.
    seen: list[tuple[int, int]] = []
    callback = (
        (lambda trace, draw: seen.append((draw.chain, draw.draw_idx)))
        if recording == "callback"
        else None
    )
    with GaussianRegression.make(n_obs=500, dim=2, batch_size=50).model():
        step = SGNHT(step_size=1e-3, friction=5.0, thin=3)
        kwargs = dict(
            draws=700, tune=300, step=step, chains=3, random_seed=7,
            discard_tuned_samples=False, **SAMPLE_KWARGS,
        )  # fmt: skip
        sequential = pm.sample(cores=1, **kwargs)
        recorded_sequentially = per_draw_records[0]
        progress_updates.clear()
        parallel = pm.sample(cores=2, mp_ctx="forkserver", callback=callback, **kwargs)
    for group in ("posterior", "warmup_posterior", "sample_stats", "warmup_sample_stats"):
        assert set(sequential[group].data_vars) == set(parallel[group].data_vars)
        for name in sequential[group].data_vars:
            np.testing.assert_array_equal(
                sequential[group][name].values, parallel[group][name].values, err_msg=name
            )
    assert sum(handovers) == 3 * 1000
    assert len(handovers) < 3 * 1000 / 10, "draws travel in batches"
    recorded_in_parallel = per_draw_records[0] - recorded_sequentially
    assert recorded_in_parallel == (3 * 1000 if recording == "callback" else 0)
    if recording == "callback":
        assert sorted(seen) == [(chain, k) for chain in range(3) for k in range(1000)]
    for chain in range(3):
        updates = [u[1:] for u in progress_updates if u[0] == chain]
        assert updates == [(k, k < 300, k == 999) for k in range(1000)]


def runtime_warnings(caught: list) -> list[str]:
    return sorted(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))


def test_batched_divergent_chains_equal_sequential_chains():
    # eps = 0.0087 lies just above the stability limit: now and then a chain diverges and
    # restarts, between runs of sane draws. The restarts, the short blocks after them and the
    # running count of divergent draws come out as in the sequential run; so do the warnings
    # (each chain's divergence warning with the step size to try), which PyMC's workers
    # would print to their own stderr or lose, never to the caller.
    with GaussianRegression.make(n_obs=500, dim=2, batch_size=50).model():
        kwargs = dict(
            draws=300, tune=0, step=SGLD(step_size=0.0087, block_steps=40), chains=2,
            random_seed=3, **SAMPLE_KWARGS,
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as sequential_warnings:
            warnings.simplefilter("always")
            sequential = pm.sample(cores=1, **kwargs)
        with warnings.catch_warnings(record=True) as parallel_warnings:
            warnings.simplefilter("always")
            parallel = pm.sample(cores=2, mp_ctx="forkserver", **kwargs)
    expected = runtime_warnings(sequential_warnings)
    assert sum(" diverged " in message for message in expected) == 2  # one per chain
    assert runtime_warnings(parallel_warnings) == expected
    diverging = sequential.sample_stats["diverging"].values
    assert 5 < diverging.sum() < diverging.size / 4
    for name in ("diverging", "divergences", "minibatch_logp", "step_size"):
        np.testing.assert_array_equal(
            sequential.sample_stats[name].values, parallel.sample_stats[name].values, name
        )
    np.testing.assert_array_equal(sequential.posterior["w"].values, parallel.posterior["w"].values)


def test_scalar_variables_and_deterministics_arrive_as_in_sequential_chains():
    # The main process computes Deterministics from each handed-over point with a compiled
    # function, which takes a scalar free variable (here log sigma) as a 0-d array: a NumPy
    # scalar in its place made numba reject the call (a TypingError on every such model).
    data = GaussianRegression.make(n_obs=500, dim=2, batch_size=50)
    with pm.Model():
        X, y = pm.Minibatch(data.X, data.y, batch_size=50)
        w = pm.Normal("w", 0.0, 10.0, shape=2)
        sigma = pm.HalfNormal("sigma", 2.0)
        pm.Deterministic("signal_to_noise", pm.math.sqrt((w**2).sum()) / sigma)
        pm.Normal("y", X @ w, sigma, observed=y, total_size=500)
        kwargs = dict(
            draws=100, tune=0, step=SGLD(step_size=1e-4), chains=2, random_seed=5,
            **SAMPLE_KWARGS,
        )  # fmt: skip
        sequential = pm.sample(cores=1, **kwargs)
        parallel = pm.sample(cores=2, mp_ctx="forkserver", **kwargs)
    for name in ("w", "sigma", "signal_to_noise"):
        np.testing.assert_array_equal(
            sequential.posterior[name].values, parallel.posterior[name].values, err_msg=name
        )
    assert parallel.posterior["sigma"].shape == (2, 100)


class FailingSGNHT(SGNHT):
    """Raises in the worker at the block that would start with its 50th draw."""

    def _fill_buffer(self, theta):
        if self.step_count >= 50 * self.thin:
            raise RuntimeError("integrator exploded")
        super()._fill_buffer(theta)


def test_an_error_in_a_worker_reaches_the_caller():
    with GaussianRegression.make(n_obs=500, dim=2, batch_size=50).model():
        step = FailingSGNHT(step_size=1e-3, friction=5.0, block_steps=10)
        with pytest.raises(ps.ParallelSamplingError, match="integrator exploded"):
            pm.sample(
                draws=100, tune=0, step=step, chains=2, cores=2, random_seed=1,
                mp_ctx="forkserver", **SAMPLE_KWARGS,
            )  # fmt: skip


def test_other_step_methods_run_pymc_own_parallel_sampler(handovers):
    with pm.Model():
        pm.Normal("x")
        idata = pm.sample(
            draws=50, tune=50, step=pm.Metropolis(), chains=2, cores=2, random_seed=1,
            mp_ctx="forkserver", **SAMPLE_KWARGS,
        )  # fmt: skip
    assert idata.posterior["x"].shape == (2, 50)
    assert handovers == []
