"""``pm.sample`` records an SG step's runs of draws at once (``pymc_sgmcmc.recording``).

Recording changes how draws reach the trace, never which: each test compares with the run
that PyMC's loop records draw by draw (a ``callback`` makes ``pm.sample`` take that path),
bit for bit.
"""

from __future__ import annotations

import numpy as np
import pymc as pm
import pymc.sampling.mcmc as mcmc
from models import GaussianRegression

from pymc_sgmcmc import SGLD, SGNHT, recording

SAMPLE_KWARGS = dict(progressbar=False, compute_convergence_checks=False)


def test_pm_sample_records_through_the_packages_loop():
    assert mcmc._iter_sample is recording._iter_sample


def test_runs_recorded_at_once_equal_draws_recorded_one_by_one(progress_updates, per_draw_records):
    # Two chains one after the other, tuning draws kept: PyMC's
    # loop records each tuning draw itself (each feeds the adaptation), then each run the
    # step serves at once; the draws, stats and tuning flags land where PyMC's loop puts
    # them, and the progress bar advances draw by draw. With a callback every draw goes
    # through PyMC's loop.
    seen: list[tuple[int, int]] = []
    with GaussianRegression.make(n_obs=500, dim=2, batch_size=50).model():
        kwargs = dict(
            draws=700, tune=300, chains=2, cores=1, random_seed=11,
            discard_tuned_samples=False, **SAMPLE_KWARGS,
        )  # fmt: skip
        one_by_one = pm.sample(
            step=SGNHT(step_size=1e-3, friction=5.0, thin=3),
            callback=lambda trace, draw: seen.append((draw.chain, draw.draw_idx)),
            **kwargs,
        )
        assert per_draw_records[0] == 2 * 1000
        assert sorted(seen) == [(chain, k) for chain in range(2) for k in range(1000)]
        progress_updates.clear()
        at_once = pm.sample(step=SGNHT(step_size=1e-3, friction=5.0, thin=3), **kwargs)
    for group in ("posterior", "warmup_posterior", "sample_stats", "warmup_sample_stats"):
        assert set(one_by_one[group].data_vars) == set(at_once[group].data_vars)
        for name in one_by_one[group].data_vars:
            np.testing.assert_array_equal(
                one_by_one[group][name].values, at_once[group][name].values, err_msg=name
            )
    # Only the tuning draws went through PyMC's record (and at most a chain's first draw).
    assert 2 * 300 <= per_draw_records[0] - 2 * 1000 <= 2 * 301
    for chain in range(2):
        updates = [u[1:] for u in progress_updates if u[0] == chain]
        # PyMC's loop reports the last draw twice, the second time as the last.
        expected = [(k, k < 300, False) for k in range(1000)] + [(999, False, True)]
        assert updates == expected


def test_a_divergent_chain_is_recorded_as_draw_by_draw():
    # eps = 0.0087 lies just above the stability limit: the chain diverges and restarts
    # now and then, and the runs after a restart are short.
    with GaussianRegression.make(n_obs=500, dim=2, batch_size=50).model():
        kwargs = dict(draws=300, tune=0, chains=1, random_seed=3, **SAMPLE_KWARGS)
        one_by_one = pm.sample(
            step=SGLD(step_size=0.0087, block_steps=40),
            callback=lambda trace, draw: None,
            **kwargs,
        )
        at_once = pm.sample(step=SGLD(step_size=0.0087, block_steps=40), **kwargs)
    assert 0 < at_once.sample_stats["diverging"].values.sum() < 300 / 4
    for name in ("diverging", "divergences", "minibatch_logp", "step_size"):
        np.testing.assert_array_equal(
            one_by_one.sample_stats[name].values, at_once.sample_stats[name].values, name
        )
    np.testing.assert_array_equal(one_by_one.posterior["w"].values, at_once.posterior["w"].values)
