"""The block engine: a draw of ``thin`` steps is the same chain as ``thin`` stored steps.

A block computes every step and stores every thin-th. These tests pin down that thinning
changes nothing but what is kept: the stored draws and their stats are those of the thin = 1
chain at every thin-th step, and a divergence at an unstored step is still caught at its draw.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest
import scipy.stats
from checks import graph_nodes
from models import GaussianRegression

from pymc_sgmcmc import SGLD, SGNHT, MCCAdL
from pymc_sgmcmc.base import stat_rows
from pymc_sgmcmc.runaway import (
    SPREADS,
    WINDOW,
    checked_series,
    first_reference,
    runaway_flags,
    running_medians,
    transient_heat_flags,
    updated_reference,
)

SAMPLE_KWARGS = dict(tune=0, chains=1, progressbar=False, compute_convergence_checks=False)


def small_problem():
    return GaussianRegression.make(n_obs=500, dim=2, batch_size=50)


@pytest.mark.parametrize(
    "factory, stats",
    [
        (lambda thin: SGLD(step_size=1e-4, thin=thin), ["minibatch_logp", "step_size"]),
        (
            lambda thin: SGNHT(step_size=1e-2, friction=2.0, thin=thin),
            ["minibatch_logp", "step_size", "thermostat", "kinetic_temperature"],
        ),
    ],
    ids=["SGLD", "SGNHT"],
)
@pytest.mark.parametrize("thin", [10, 25])  # 25: the runaway check reads other steps too
def test_thinned_draws_are_every_thin_th_step_of_the_unthinned_chain(factory, stats, thin):
    # block_steps = 1000 with thin 1 and thin 10 or 25: the same steps per block, so the chain
    # consumes the same minibatch indices and noise in the same order.
    draws = 150
    with small_problem().model():
        every = pm.sample(draws=thin * draws, step=factory(1), random_seed=4, **SAMPLE_KWARGS)
        thinned = pm.sample(draws=draws, step=factory(thin), random_seed=4, **SAMPLE_KWARGS)
    stored = slice(thin - 1, None, thin)
    # Bit for bit: one compiled block serves every thin, and the log-density is computed in
    # a lazy branch of the steps the host reads it at.
    np.testing.assert_array_equal(
        thinned.posterior["w"].values[0], every.posterior["w"].values[0][stored]
    )
    for name in stats:
        np.testing.assert_array_equal(
            thinned.sample_stats[name].values[0],
            every.sample_stats[name].values[0][stored],
            err_msg=name,
        )
    assert (thinned.sample_stats["thin"].values == thin).all()


def several_variables_model() -> pm.Model:
    """Variables of several shapes, one of them log-transformed, all in one raveled draw."""
    rng = np.random.default_rng(3)
    X = rng.standard_normal((400, 3))
    y = X @ np.array([1.0, -0.5, 0.2]) + 0.3 * rng.standard_normal(400)
    with pm.Model() as model:
        Xb, yb = pm.Minibatch(X, y, batch_size=40)
        w = pm.Normal("w", 0.0, 1.0, shape=3)
        offset = pm.Normal("offset", 0.0, 1.0, shape=(2, 2))
        sigma = pm.HalfNormal("sigma", 1.0)
        pm.Normal("y", Xb @ w + offset.sum(), sigma, observed=yb, total_size=400)
    return model


def test_a_point_handed_back_is_served_without_pymcs_round_trip_and_gives_the_same_chain(
    monkeypatch,
):
    # PyMC's loop hands back the dict a step returned; SGMCMC.step then skips PyMC's
    # dict -> array -> dict mapping. A copy of that dict (another object with the same values)
    # takes PyMC's path: both must give the same draws, stats, names, shapes and dtypes.
    from pymc.blocking import DictToArrayBijection

    maps = []
    original_map = DictToArrayBijection.map
    monkeypatch.setattr(
        DictToArrayBijection, "map", staticmethod(lambda p: maps.append(1) or original_map(p))
    )
    with several_variables_model() as model:
        chains = {}
        for handed_back in (True, False):
            step = SGNHT(step_size=1e-3, thin=3, block_steps=60)  # 20 draws per block
            step.setup_chain(np.random.default_rng(5), tune=0, draws=50)
            point, draws, stats = model.initial_point(), [], []
            maps.clear()
            for _ in range(50):
                point, [draw_stats] = step.step(point if handed_back else dict(point))
                draws.append({name: np.array(value) for name, value in point.items()})
                stats.append(draw_stats)
            chains[handed_back] = draws, stats, len(maps)
    (fast, fast_stats, fast_maps), (plain, plain_stats, plain_maps) = chains[True], chains[False]
    assert (fast_maps, plain_maps) == (1, 50)  # the chain start only
    assert fast_stats == plain_stats
    initial = model.initial_point()
    for a, b in zip(fast, plain, strict=True):
        assert list(a) == list(b) == list(initial)
        for name in a:
            assert a[name].shape == initial[name].shape and a[name].dtype == initial[name].dtype
            np.testing.assert_array_equal(a[name], b[name])
    assert len({d["sigma_log__"].item() for d in fast}) == 50  # the chain moves


def test_a_run_of_draws_is_what_as_many_steps_give():
    # SGMCMC.step_run (the parallel workers' path) serves the rest of a block at once: the
    # same draws, stacked per variable, and the same stats as draw-by-draw step() calls,
    # across block boundaries (20 draws per block) and for variables of several shapes.
    with several_variables_model() as model:
        chains = []
        for runs in (False, True):
            step = SGNHT(step_size=1e-3, thin=3, block_steps=60)
            step.setup_chain(np.random.default_rng(5), tune=0, draws=50)
            step.stop_tuning()
            point, [first_stats] = step.step(model.initial_point())  # a start: not a run
            points, stats = [{n: v[None] for n, v in point.items()}], [first_stats]
            while sum(len(p["w"]) for p in points) < 50:
                run = step.step_run(point, 7) if runs else None
                if run is None:
                    point, [draw_stats] = step.step(point)
                    points.append({n: np.array(v)[None] for n, v in point.items()})
                    stats.append(draw_stats)
                    continue
                point, run_points, run_stats = run
                assert len(run_points["w"]) <= 7
                points.append(run_points)
                stats += stat_rows(run_stats)
            chains.append(({n: np.concatenate([p[n] for p in points]) for n in point}, stats))
    (steps, step_stats), (runs, run_stats) = chains
    assert step_stats == run_stats
    initial = model.initial_point()
    for name, value in initial.items():
        assert runs[name].shape == (50, *value.shape) and runs[name].dtype == value.dtype
        np.testing.assert_array_equal(steps[name], runs[name])
    assert step.step_run(model.initial_point(), 7) is None  # a point it did not serve


@pytest.mark.parametrize("thin", [7, 23])  # 23: the check reads every 10th step, not draws
def test_divergence_at_an_unstored_step_is_flagged_at_its_draw(thin):
    # eps = 0.1 grows the chain ~25x per step: the 1e10 threshold is crossed at an unstored
    # step of the first or second draw (the first draw itself may still lie below it: the
    # runaway check's first reference is the first checked step).
    with small_problem().model():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            idata = pm.sample(
                draws=60, step=SGLD(step_size=0.1, thin=thin), random_seed=2, **SAMPLE_KWARGS
            )
    w = idata.posterior["w"].values[0]
    diverging = idata.sample_stats["diverging"].values[0]
    assert diverging[:2].any() and diverging.mean() > 0.5
    assert np.isfinite(w).all() and np.abs(w).max() < 1e10
    # A diverging draw repeats the last sane position: the one before it, or the chain start
    # (the model's initial point, w = 0) for the first.
    previous = np.vstack([np.zeros((1, w.shape[1])), w[:-1]])
    np.testing.assert_array_equal(w[diverging], previous[diverging])
    assert np.isnan(idata.sample_stats["minibatch_logp"].values[0][diverging]).all()


def test_a_non_finite_chain_start_is_refused():
    # A NaN initval ran to the end: tuning halved the step size to 2e-31 and every draw,
    # flagged diverging, was NaN. PyMC's NUTS refuses such a start too (bad initial energy).
    with small_problem().model():
        with pytest.raises(pm.exceptions.SamplingError, match=r"not finite .* in \['w'\]"):
            pm.sample(
                draws=5, step=SGLD(), initvals={"w": np.array([np.nan, 0.0])}, **SAMPLE_KWARGS
            )


@pytest.mark.parametrize("thin", [1, 3, 25])
def test_minibatch_logp_is_the_model_logp_at_the_draw(thin):
    # A full-data model (no pm.Minibatch): the stat is then the exact log-density at the draw,
    # computed at the stored steps whether or not the runaway check reads them.
    problem = small_problem()
    with pm.Model():
        w = pm.Normal("w", 0, problem.prior_sd, shape=2)
        pm.Normal("y", problem.X @ w, problem.sigma, observed=problem.y)
        idata = pm.sample(draws=80, step=SGLD(step_size=1e-4, thin=thin), **SAMPLE_KWARGS)
    # The exact log-density in float64. PyMC's own (model.compile_logp()) differs from it by
    # 6e-11 relative: it computes log(prior_sd) in float32, the type PyTensor gives 10.0, where
    # the sampler computes with the prior's numbers in the model's precision.
    expected = [
        scipy.stats.norm.logpdf(w, 0, problem.prior_sd).sum()
        + scipy.stats.norm.logpdf(problem.y, problem.X @ w, problem.sigma).sum()
        for w in idata.posterior["w"].values[0]
    ]
    np.testing.assert_allclose(idata.sample_stats["minibatch_logp"].values[0], expected, rtol=1e-12)


def test_runaway_check_flags_non_finite_steps_and_the_start_of_a_collapse():
    # In the chain's first block the reference is its first step, the margin
    # the scale-free max(1e4, 10 |typical|); non-finite values are flagged where they occur.
    logps = np.full(60, -1e3)
    logps[30:] = -1e3 - 1e3 * np.arange(1, 31)  # falls by 1e3 per step from step 30
    medians = running_medians(logps, np.zeros(0))
    # The margin 1e4 is crossed at step 40; the first window mostly below ends at step 50.
    np.testing.assert_array_equal(np.flatnonzero(runaway_flags(logps, medians, None, [])), [40])
    logps[5] = np.nan
    flags = runaway_flags(logps, running_medians(logps, np.zeros(0)), None, [])
    assert flags[5] and flags[40]


def test_runaway_check_ignores_heavy_tailed_single_steps_but_not_a_drift():
    # n = 1 minibatch log-densities: most steps near the median, one in a hundred 30x
    # below it. A single-value check flagged about a quarter of such a chain's draws.
    rng = np.random.default_rng(0)
    logps = -800.0 - 200.0 * rng.exponential(size=20_000)
    logps[rng.random(20_000) < 0.01] *= 30
    history, spreads = np.zeros(0), []
    typical = updated_reference(None, spreads, logps[:1000], running_medians(logps[:1000], history))
    assert not runaway_flags(logps, running_medians(logps, history), typical, spreads).any()
    # A drift of 0.5 spreads per step is flagged once its running median is SPREADS below
    # (the median lags the drift by half a window).
    drift = logps[:1000] - 0.5 * spreads[0] * np.arange(1000)
    flags = runaway_flags(drift, running_medians(drift, history), typical, spreads)
    first = int(np.flatnonzero(flags)[0])
    assert flags.sum() == 1 and 2 * SPREADS - WINDOW < first < 2 * SPREADS + WINDOW


def test_runaway_check_of_a_momentum_sampler_follows_the_energy():
    # The log-density rises while the kinetic temperature p.p/D explodes (an unstable step
    # creates energy): the log-density alone is sane, the energy -H + D/2 is not.
    dim, logps = 10, np.linspace(-1e3, -9e2, 60)
    temperatures = np.ones(60)
    temperatures[30:] = 1e9
    medians = running_medians(logps, np.zeros(0))
    assert not runaway_flags(logps, medians, None, []).any()
    energy = checked_series(logps, temperatures, dim)
    np.testing.assert_allclose(energy[:30], logps[:30])
    flags = runaway_flags(energy, running_medians(energy, np.zeros(0)), None, [])
    assert np.flatnonzero(flags).tolist() == [30]
    # Samplers without a momentum (SGLD, mSGLD): the log-density itself.
    assert checked_series(logps, None, dim) is logps


def test_transient_kinetic_energy_is_bounded_by_its_sources():
    # In the transient the kinetic energy's excess (p.p - D)/2 may grow from the log-density's
    # rise or from the gradient noise's heat (at most 1/(8 h A) per coordinate under the
    # transient's step-size rule); growth beyond the range plus 10 times that heat is made
    # energy. What the first checked step already carries is the baseline.
    dim, h, friction = 20, 0.01, 1.0
    heat = 10 * (0.5 * dim / (8 * h * friction) + np.sqrt(dim))  # 1,295
    rise = np.linspace(-1e4, -1e3, 50)
    # A sane far start: the potential turned into kinetic energy, hot from the noise as well,
    # with 5,000 already gained before the first checked step.
    carried = 1.0 + 2.0 / dim * (5e3 + rise - rise[0]) + 1.0 / (8 * h * friction)
    flags, (low, high, baseline) = transient_heat_flags(rise, carried, dim, h, friction)
    assert not flags.any() and (low, high) == (rise[0], rise[-1])
    assert baseline == 0.5 * dim * (carried[0] - 1.0)
    # The same growth with a flat log-density: flagged where it exceeds the allowance.
    flat = np.full(50, -1e4)
    flags, _ = transient_heat_flags(flat, carried, dim, h, friction)
    growth = 0.5 * dim * (carried - carried[0])
    assert np.flatnonzero(flags).tolist() == [int(np.argmax(growth > heat))]
    # A later block of the same transient starts from the range and baseline of the earlier.
    earlier = (rise[0], rise[-1], baseline)
    assert not transient_heat_flags(flat[:5], carried[-5:], dim, h, friction, earlier)[0].any()
    exploded = np.full(5, 1e4)
    flags, _ = transient_heat_flags(flat[:5], exploded, dim, h, friction, earlier)
    assert flags[0]
    # A (re)start carries nothing: its first checked step is the baseline.
    assert not transient_heat_flags(flat[:5], exploded, dim, h, friction)[0].any()


def test_an_energy_blow_up_with_a_rising_log_density_is_a_divergence():
    # A non-centred hierarchical Poisson regression (a = mu + sd * z, 8 groups, N = 20,000):
    # early in tuning, SGNHT's kick on log(sd) grew with sd until one step threw it from 4.6
    # to about -6,600, with a kinetic temperature of 10^10 that the frozen thermostat barely
    # damped, while the minibatch log-density rose (sd = 0 pools the groups). The check on the
    # log-density alone kept 21 such draws (and the restart, after the position overflowed,
    # an sd of exactly 0); the energy check flags the explosion at its first step.
    rng = np.random.default_rng(3)
    n_obs, groups, dim = 20_000, 8, 4
    g = rng.integers(0, groups, n_obs)
    X = rng.standard_normal((n_obs, dim))
    exposure = rng.uniform(0.5, 2.0, n_obs)
    effects = rng.normal(0.3, 0.5, groups)[g] + X @ np.array([0.3, -0.2, 0.1, 0.0])
    y = rng.poisson(exposure * np.exp(effects)).astype(np.int32)
    with pm.Model():
        X_mb, g_mb, e_mb, y_mb = pm.Minibatch(X, g, exposure, y, batch_size=500)
        mu = pm.Normal("mu", 0, 1)
        sd = pm.HalfNormal("sd", 1)
        z = pm.Normal("z", 0, 1, shape=groups)
        b = pm.Normal("b", 0, 1, shape=dim)
        rate = pt.exp(mu + sd * z[g_mb] + X_mb @ b + pt.log(e_mb))
        pm.Poisson("y", rate, observed=y_mb, total_size=n_obs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            idata = pm.sample(
                tune=150, draws=1, step=SGNHT(thin=1), random_seed=1, discard_tuned_samples=False,
                chains=1, progressbar=False, compute_convergence_checks=False,
            )  # fmt: skip
    stats = idata.warmup_sample_stats
    temperatures = stats["kinetic_temperature"].values[0]
    assert stats["diverging"].values[0].any()
    assert np.nanmax(temperatures) < 1e6
    # After the restart a slower blow-up (kinetic temperature ~10^4) drove sd to 1e-71 within
    # the first block's scale-free margin; the transient's bound on the kinetic energy
    # (runaway.transient_heat_flags) flags it too.
    assert idata.warmup_posterior["sd"].values.min() > 0.1


def test_a_restart_in_the_first_block_is_judged_against_the_steps_before_the_divergence():
    # SGLD at 13 times the stable step size on a linear regression with an unknown noise
    # scale: the chain wanders (log-density -1.7e3 to -1e4) until its 13th step diverges.
    # The restart had no typical value yet, so its first step was its own reference: a draw
    # at sigma = 1.2e8 (log-density -6.8e15) was kept unflagged, and every later draw,
    # flagged, repeated it; the stability check then advised step_size=7e-17 from there.
    # Now the sane steps before the divergence are the reference (runaway.first_reference).
    assert first_reference(np.array([-3e3, -1e4, -2e3]), lambda: -5.0) == -3e3
    assert first_reference(np.zeros(0), lambda: -5.0) == -5.0  # none: the restart point's
    rng = np.random.default_rng(0)
    X = rng.normal(size=(2000, 3))
    y = X @ rng.normal(size=3) + 0.5 * rng.normal(size=2000)
    with pm.Model():
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=100)
        w = pm.Normal("w", 0, 1, shape=3)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", X_mb @ w, sigma, observed=y_mb, total_size=2000)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            idata = pm.sample(
                tune=100, draws=100, step=SGLD(step_size=0.002), random_seed=1, chains=1,
                discard_tuned_samples=False, progressbar=False, compute_convergence_checks=False,
            )  # fmt: skip
    stats = [idata.warmup_sample_stats, idata.sample_stats]
    diverging = np.concatenate([s["diverging"].values[0] for s in stats])
    logp = np.concatenate([s["minibatch_logp"].values[0] for s in stats])
    sigma = [idata[g]["sigma"].values for g in ("warmup_posterior", "posterior")]
    assert diverging.any()
    assert logp[~diverging].min() > -1e6
    assert max(s.max() for s in sigma) < 1e3


def test_small_minibatches_of_a_large_data_set_are_not_flagged_as_divergent():
    # n = 10 of N = 30,000: the minibatch log-density spreads over tens of thousands. The
    # runaway check once compared it with the best value of earlier blocks and flagged 693 of
    # these 3,000 draws (the first at draw 1,001, at the second block).
    rng = np.random.default_rng(0)
    n_obs, dim = 30_000, 20
    X = rng.standard_normal((n_obs, dim))
    y = (rng.random(n_obs) < 1 / (1 + np.exp(-X @ rng.standard_normal(dim)))).astype(float)
    with pm.Model():
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=10)
        w = pm.Normal("w", 0, 1, shape=dim)
        pm.Bernoulli("y", logit_p=X_mb @ w, observed=y_mb, total_size=n_obs)
        step = SGLD(step_size=1e-5, thin=1, adapt_preconditioner=False, block_steps=1000)
        idata = pm.sample(draws=3000, step=step, random_seed=1, **SAMPLE_KWARGS)
    assert int(idata.sample_stats["diverging"].sum()) == 0


def test_blocks_compile_with_plain_assignment_errors():
    # The plain message only while compiling (numba resolves the raising function then), and
    # numba's detailed one restored afterwards.
    import numba
    import numba.np.arrayobj as arrayobj

    from pymc_sgmcmc.numba_compile import plain_assignment_errors

    detailed = arrayobj.raise_with_shape_context

    @numba.njit
    def assign_row(a, b):
        a[0] = b

    with plain_assignment_errors():
        with pytest.raises(ValueError, match=r"^cannot assign slice from input of different size$"):
            assign_row(np.zeros((2, 3)), np.ones(4))
    assert arrayobj.raise_with_shape_context is detailed
    assign_row(a := np.zeros((2, 3)), np.ones(3))  # compiled: still assigns
    assert a[0].tolist() == [1.0, 1.0, 1.0]


def test_ctrl_c_while_a_block_runs_returns_the_draws_so_far():
    # As with PyMC's own samplers, pm.sample catches the KeyboardInterrupt and returns the
    # draws made so far. numba hands a Ctrl-C that arrives while a block runs back as a
    # SystemError ("returned a result with an exception set"), which pm.sample would let
    # through, losing the run. thin = 20000 (block_steps = 1000): a block per draw (about
    # 17 ms on the AMD host of 2026-12-06), so the interrupt, sent 0.1 s after the 4th draw,
    # lands in a block, which Python reports in numba's boxing of its outputs, or in the
    # Python between two blocks.
    #
    # The cyclic garbage collector is off while pm.sample runs. A SIGINT that arrives while
    # it collects is handled in the first Python code the collection runs: JAX's
    # `_xla_gc_callback` (in gc.callbacks once arviz's conversion has imported JAX), a weakref
    # callback of numba's typing context, a __del__. CPython reports a KeyboardInterrupt
    # raised there as "Exception ignored" and drops it (python/cpython#95959): the Ctrl-C is
    # lost whatever the sampler, and sampling goes on. That made this test fail in some full
    # runs of the suite (stops 81 and 86), whose heaps of earlier tests' garbage make long
    # collections. With cyclic garbage with finalizers made at each draw it failed so in 5 of
    # 90 runs, and in none of 90 with the collector off. The handler and the hook below
    # record where Python ran the handler and what it dropped.
    import gc
    import os
    import signal
    import sys
    import threading
    import traceback

    draws, sent, handled, dropped = 200, [], [], []

    def interrupt_soon(trace, draw):
        if draw.draw_idx == 3 and not sent:
            sent.append(threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)))
            sent[0].start()

    def recording_handler(signum, frame):
        handled.append(traceback.format_stack(frame, limit=4))
        raise KeyboardInterrupt

    def recording_hook(unraisable):
        dropped.append(f"{unraisable.exc_type.__name__} in {unraisable.object!r}")
        previous_hook(unraisable)

    previous, previous_hook = signal.signal(signal.SIGINT, recording_handler), sys.unraisablehook
    sys.unraisablehook = recording_hook
    gc.collect()
    gc.disable()
    try:
        with small_problem().model():
            idata = pm.sample(
                draws=draws,
                step=SGLD(step_size=1e-4, thin=20_000),
                random_seed=1,
                callback=interrupt_soon,
                **SAMPLE_KWARGS,
            )
    except KeyboardInterrupt:  # not caught by pm.sample: fail, do not stop the session
        pytest.fail("the KeyboardInterrupt escaped pm.sample")
    finally:
        gc.enable()
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGINT, previous)
    sent[0].join()
    kept = idata.posterior.sizes["draw"]
    where = f"the SIGINT handler ran at {handled}; dropped: {dropped}"
    assert 4 <= kept < draws, f"{kept} draws kept; {where}"
    assert np.isfinite(idata.posterior["w"].values).all()


def test_a_block_runs_on_one_openblas_thread_and_the_callers_setting_is_restored():
    # OpenBLAS starts a thread per core in each of pm.sample's forked chain processes and
    # hands even a step's small products to them: on pm.MvNormal rows a minibatch force took
    # 16 ms against 27 us on one thread (pymc_sgmcmc.blas_threads). The blocks, and the
    # chain start and adaptation around them, run on one thread; the caller keeps its own.
    from threadpoolctl import ThreadpoolController

    openblas = ThreadpoolController().select(internal_api="openblas", threading_layer="pthreads")
    with openblas.limit(limits=2):
        if not openblas.lib_controllers or min(c.num_threads for c in openblas.lib_controllers) < 2:
            pytest.skip("needs OpenBLAS on pthreads that can run two threads")
        seen = []
        with small_problem().model():
            step = SGLD(thin=5, block_steps=50)
            compile_block = step._block_function

            def recording_block_function():
                block_fn, stat_names = compile_block()

                def recorded(*args, **kwargs):
                    seen.append(max(c.num_threads for c in openblas.lib_controllers))
                    return block_fn(*args, **kwargs)

                return recorded, stat_names

            step._block_function = recording_block_function
            pm.sample(draws=30, step=step, random_seed=1, **{**SAMPLE_KWARGS, "tune": 30})
        assert len(seen) >= 6 and set(seen) == {1}  # tuning's and the draws' blocks
        assert min(c.num_threads for c in openblas.lib_controllers) == 2


def test_a_short_block_runs_no_padded_step(monkeypatch):
    # A block has one compiled length (block_length; here 8 steps); a shorter one (here the
    # 3 draws asked for) is padded, and the compiled loop stops after its last real step.
    # Minibatch indices out of range in every padded step would raise an IndexError in any
    # step that ran; the draws are those of the unpoisoned run.
    import pymc_sgmcmc.base as base

    def sample():
        with small_problem().model():
            step = SGLD(step_size=1e-4, thin=1, block_steps=8)
            return pm.sample(draws=3, step=step, random_seed=4, **SAMPLE_KWARGS)

    plain = sample()
    padded = base._padded

    def poisoned(sequences, flags, length):
        out = padded(sequences, flags, length)
        n_steps = len(flags[0])
        assert length == 8 and n_steps == 3
        for indices in out[:2]:  # the force's and the log-density's minibatch indices
            indices[n_steps:] = 10**9
        return out

    monkeypatch.setattr(base, "_padded", poisoned)
    idata = sample()
    np.testing.assert_array_equal(idata.posterior["w"].values, plain.posterior["w"].values)
    assert not idata.sample_stats["diverging"].any()


def test_a_thin_adapted_in_tune_reuses_the_one_compiled_block():
    # The adaptation changes thin at the end of every window, and with it the steps of a
    # full block (block_steps // thin draws of thin steps); the block is compiled for
    # block_steps steps and runs the others padded, so the run compiles it once (a block
    # per length compiled 4-11 of them in a default tune, 2.6x the cold run's time).
    with small_problem().model():
        step = SGLD()
        idata = pm.sample(
            draws=20, tune=300, step=step, chains=1, random_seed=5, discard_tuned_samples=False,
            progressbar=False, compute_convergence_checks=False,
        )  # fmt: skip
    thins = np.unique(idata.warmup_sample_stats["thin"].values)
    block_lengths = {(step.block_steps // t) * t for t in thins}
    assert len(block_lengths) > 1, f"thin must change the block length here: {thins}"
    assert list(step._block_functions) == [step.compiled_length] == [step.block_steps]


def test_the_block_loop_is_compiled_without_pytensors_storage_epilogue(monkeypatch):
    # A block's traces fill their storage (n_steps rows, a constant), so PyTensor's epilogue
    # after the loop (putting a circular buffer's rows in order, cutting a while loop's
    # outputs to the steps it ran) never changes the rows the host reads; dropping it saved
    # ~0.9 s of a cold start (P1 SGLD).
    import pytensor.link.numba.dispatch.scan as numba_scan
    from pytensor.scan.op import Scan

    import pymc_sgmcmc.numba_compile as nc

    with small_problem().model():
        step = SGLD(step_size=1e-4, thin=5, block_steps=20)
    block_fn, _ = step._block_function()
    (node,) = [n for n in block_fn.maker.fgraph.apply_nodes if isinstance(n.op, Scan)]
    assert node.op.name == nc.BLOCK_SCAN_NAME and node.op.info.as_while
    assert node.inputs[0].data == step.compiled_length == step.block_length == 20
    assert nc._traces_fill_their_storage(node.op, node)
    sources = []
    compile_src = numba_scan.compile_numba_function_src

    def record(src, name, *args, **kwargs):
        sources.append(src)
        return compile_src(src, name, *args, **kwargs)

    monkeypatch.setattr(numba_scan, "compile_numba_function_src", record)
    numba_scan.numba_funcify_Scan(node.op, node)
    (src,) = sources
    n_traces = len(node.op.outer_nitsot(node.inputs))
    assert src.count("np.concatenate") == src.count("_nitsot_storage[:i + 0]") == n_traces
    # The step's 0-d outputs (the sanity flag, the log-density, scalar stats) are read with
    # [()] where they are stored: numba's cast of a 0-d array compiles a `take` per trace.
    outputs = node.op.fgraph.outputs
    scalars = frozenset(k for k, v in enumerate(outputs) if v.type.ndim == 0)
    assert scalars and len(scalars) < len(outputs)
    lean = nc._scan_source(src, drop_epilogue=True, scalar_outputs=scalars)
    assert lean.split("i += 1")[1].strip().startswith("return ")  # nothing between
    assert "np.concatenate" not in lean and "[:i + 0]" not in lean
    assert lean.count("stable_state(") == src.count("_untraced_sit_sot_storage = ")
    for k in range(len(outputs)):
        if f"] = inner_out_{k}\n" in src:  # stored into its trace
            read = f"] = inner_out_{k}[()]\n" if k in scalars else f"] = inner_out_{k}\n"
            assert read in lean, k
    # Every trace but the draws' holds a scalar.
    assert sum(f"] = inner_out_{k}[()]\n" in lean for k in scalars) == n_traces - 1
    kept = nc._scan_source(src, drop_epilogue=False, scalar_outputs=scalars)
    assert kept.count("np.concatenate") == n_traces


def test_loops_nested_in_the_block_keep_their_epilogue(monkeypatch):
    # mCCAdL's Lanczos loop, inside the block's, is a while loop whose epilogue cuts its
    # outputs to the iterations it ran; without it the tridiagonal eigensolver was handed
    # uninitialised rows (a float32 chain then never returned from LAPACK). The D x D
    # estimate keeps the loop in the graph (the low-rank one runs it in a kernel).
    import pymc_sgmcmc.numba_compile as nc

    drops = []
    rewrite = nc._scan_source
    monkeypatch.setattr(
        nc,
        "_scan_source",
        lambda src, drop, scalars: drops.append(drop) or rewrite(src, drop, scalars),
    )
    with small_problem().model():
        step = MCCAdL(step_size=1e-3, thin=2, block_steps=10, covariance="full")
    step._block_function()
    assert len(drops) >= 2 and drops.count(True) == 1


def _numba_compilations(step) -> collections.Counter:
    """The names of the functions numba compiles for a short run of ``step``, without numba's
    cache (every function compiles here, where it is counted); numba must warn nothing."""
    import pytensor
    from numba.core import event

    with pytensor.config.change_flags(numba__cache=False):
        with event.install_recorder("numba:compile") as recorder:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                idata = pm.sample(draws=3, step=step, random_seed=1, **SAMPLE_KWARGS)
    assert not [str(w.message) for w in caught if "numba" in w.filename]
    assert np.isfinite(idata.posterior["w"].values).all()
    names = (e.data["dispatcher"].py_func.__name__ for _, e in recorder.buffer if e.is_start)
    return collections.Counter(names)


def test_the_blocks_loop_its_step_and_its_lazy_branches_compile_inside_the_block():
    # numba links a function's callees into its code, where LLVM optimises and emits them
    # again: the block's scan, its step, the lazy branches and their graphs are inlined into
    # the block's function instead of each being compiled as a function of its own.
    with small_problem().model():
        compiled = _numba_compilations(SGNHT(step_size=1e-2, thin=2))
    assert compiled["numba_funcified_fgraph"] >= 1
    assert not {"scan", "numba_scan", "lazy_ifelse", "numba_ofg"} & set(compiled)


def test_block_step_compiles_once_when_a_state_comes_back_as_a_view(monkeypatch):
    # SGNHT's thermostat is updated from p . p, which PyTensor's numba code returns as a 0-d
    # strided view (layout "A") while the state entered the loop as a C-contiguous array:
    # without stable_state numba unifies the loop variable's type and compiles the whole step
    # a second time. The step is a function of its own if numba cannot inline it; here all
    # of its arguments are made too many, and none is passed in tuples.
    import pymc_sgmcmc.numba_compile as nc

    monkeypatch.setattr(nc, "_MAX_INLINED_ARGUMENTS", 0)
    monkeypatch.setattr(nc, "_PACKABLE", frozenset())
    with small_problem().model():
        compiled = _numba_compilations(SGNHT(step_size=1e-2, thin=2))
    assert compiled["numba_scan"] == 1


def test_a_generated_function_with_many_arguments_takes_them_as_tuples_and_is_inlined():
    # CPython passes more than 30 arguments to a call as one tuple (CALL_FUNCTION_EX), which
    # numba does not inline: the callee's definition unpacks tuples of at most 30 instead,
    # and every call to it builds them.
    import numba

    from pymc_sgmcmc import numba_compile as nc

    names = [f"a{k}" for k in range(65)]
    weighted = " + ".join(f"{k} * {a}" for k, a in enumerate(names))
    src, packed = nc._with_packed_arguments(
        f"def scan({', '.join(names)}):\n    return {weighted}\n", "scan", {}
    )
    assert packed and src.startswith("def scan(_arguments_0, _arguments_1, _arguments_2):")
    env: dict = {}
    exec(src, env)
    nc._PACKED.add(env["scan"])
    callee = nc._inlined(numba.njit(env["scan"]), len(names))
    assert callee.targetoptions.get("inline") == "always"
    call, caller_packed = nc._with_packed_arguments(
        f"def caller(x):\n    return f({', '.join(['x'] * 65)})\n", "caller", {"f": callee}
    )
    assert not caller_packed and call.count("(x, ") == 3
    env = {"f": callee}
    exec(call, env)
    assert numba.njit(env["caller"])(2.0) == 2.0 * sum(range(65))
    # A source without such a call or definition stays as it is, comments and all.
    plain = "def scan(a):\n    # a comment\n    return a\n"
    assert nc._with_packed_arguments(plain, "scan", {"f": callee}) == (plain, False)


def _many_variables_model() -> pm.Model:
    """A regression with ten free variables: each prior's numbers are inputs of the block's
    loop, which then takes more than 30 arguments."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 8))
    y = 1.0 + x @ np.linspace(-1.0, 1.0, 8) + rng.normal(size=500)
    xb, yb = pm.Minibatch(x, y, batch_size=50)
    with pm.Model() as model:
        a = pm.Normal("w", 0.5, 10.0)  # the intercept
        b = [pm.Normal(f"b{k}", 0.1 * k, 1.0 + k) for k in range(8)]
        s = pm.HalfNormal("s", 2.0)
        mu = a + sum(bk * xb[:, k] for k, bk in enumerate(b))
        pm.Normal("y", mu, s, observed=yb, total_size=500)
    return model


def test_a_loop_with_more_arguments_than_numba_inlines_compiles_inside_the_block():
    # Before, the loop and its step of such a model were functions of their own (numba
    # compiled "scan" and "numba_scan"), whose code LLVM optimised and emitted again:
    # mCCAdL's cold first draw on this model took 3.4 s longer (about 6 %).
    from pytensor.scan.op import Scan

    with _many_variables_model():
        step = SGLD(step_size=1e-4, thin=2)
        compiled = _numba_compilations(step)
    block = step._block_function()[0].maker.fgraph
    loops = [node for node in graph_nodes(block) if isinstance(node.op, Scan)]
    assert loops and len(loops[0].inputs) > 30 and len(loops[0].op.fgraph.inputs) > 30
    assert compiled["numba_funcified_fgraph"] >= 1
    assert not {"scan", "numba_scan"} & set(compiled)


def _inverse_dimshuffle_pairs(fgraph) -> list[str]:
    """The ``DimShuffle(DimShuffle(x))`` of a graph and its inner graphs whose type is x's:
    those that give back x, and any other chain back to x's type."""
    from pytensor.tensor.elemwise import DimShuffle

    found = []
    for node in graph_nodes(fgraph):
        inner = node.inputs[0].owner if node.inputs else None
        if isinstance(node.op, DimShuffle) and inner and isinstance(inner.op, DimShuffle):
            if node.outputs[0].type == inner.inputs[0].type:
                found.append(f"{node.op}({inner.op}) of {inner.inputs[0].type}")
    return found


def test_length_one_views_of_scalars_are_read_as_the_scalars():
    # PyTensor's scalarize rewrite reads an elementwise operation on length-1 vectors as one on
    # scalars through Squeeze; where the vector was ExpandDims of a 0-d input the two views
    # undo each other, and numba compiled the 0-d Squeeze and a strided view for them.
    import pytensor
    from pytensor.graph.fg import FunctionGraph

    from pymc_sgmcmc.numba_compile import drop_inverse_dimshuffles, with_inverse_dimshuffles_dropped

    a, b = pt.scalar("a"), pt.scalar("b")
    v = pt.vector("v", shape=(3,))
    outputs = [(a * b) * v, pt.exp(a) * b * v + pt.sum(v * v) * a]
    plain = pytensor.function([a, b, v], outputs, mode="NUMBA")
    dropped = pytensor.function([a, b, v], outputs, mode=with_inverse_dimshuffles_dropped("NUMBA"))
    assert _inverse_dimshuffle_pairs(plain.maker.fgraph) != []
    assert _inverse_dimshuffle_pairs(dropped.maker.fgraph) == []
    args = (0.5, -3.0, np.arange(3.0))
    for got, expected in zip(dropped(*args), plain(*args), strict=True):
        np.testing.assert_array_equal(got, expected)
    # A chain that is not the identity stays as it is (merged, it would be a new kind).
    chain = v[None, :].T
    fgraph = FunctionGraph([v], [chain], clone=False)
    assert drop_inverse_dimshuffles.transform(fgraph, chain.owner) is None


@pytest.mark.parametrize("sampler", [SGNHT, MCCAdL])
def test_no_pair_of_views_undoing_each_other_is_left_in_a_block(sampler):
    # Three Squeeze(ExpandDims) per step of SGNHT and mCCAdL (the thermostat and step sizes
    # read as scalars) before 2026-12-06: five more numba functions at a cold start.
    with small_problem().model():
        step = sampler(step_size=1e-2, thin=2)
    assert _inverse_dimshuffle_pairs(step._block_function()[0].maker.fgraph) == []


def test_covariance_loops_call_blas_with_c_contiguous_operands_only():
    # numba compiles PyTensor's BLAS wrapper (the Dot op) once per combination of its operands'
    # array layouts: ~1 s for C-contiguous ones, 3-4 s for one that numba types as "A". The
    # Lanczos and conjugate-gradient loops and the thermostat's p . p used to hand it a row of
    # a matrix, a fused reduction's output and G^T inside a loop ("A" and "F" operands).
    import pytensor
    from numba.core import event

    from pymc_sgmcmc.model_layer import NoiseCovariance
    from pymc_sgmcmc.operators import kinetic_temperature, thermostat

    rows, dim = 20, 5
    gradients = pt.matrix("gradients", shape=(rows, dim))
    v = pt.vector("v", shape=(dim,))
    sigma = NoiseCovariance(gradients, dim, rows)
    damped, _ = sigma.expm_matvec(-0.1, v)
    solved = sigma.solve_shifted_cg(1.0, 0.1, v)
    outputs = [damped, solved, kinetic_temperature(damped), thermostat(1.0, solved, 0.1, 1.0 / dim)]
    # No numba cache: every Dot compiles here, where its argument types are recorded.
    with pytensor.config.change_flags(numba__cache=False):
        with event.install_recorder("numba:compile") as recorder:
            fn = pytensor.function([gradients, v], outputs, mode="NUMBA")
            results = fn(np.random.default_rng(0).normal(size=(rows, dim)), np.ones(dim))
    layouts = [
        tuple(arg.layout for arg in e.data["args"] if hasattr(arg, "layout"))
        for _, e in recorder.buffer
        if e.is_start and "numba_funcify_Dot" in e.data["dispatcher"].py_func.__qualname__
    ]
    assert layouts  # the products with the gradients stay BLAS calls
    assert set(layouts) == {("C", "C")}
    assert all(np.isfinite(r).all() for r in results)


_COMPILE_RUN = """
import json, sys
import numpy as np, pymc as pm
from numba.core import event
from pymc_sgmcmc import SGLD
x = np.random.default_rng(0).normal(size=200)
with pm.Model():
    mu = pm.Normal("mu", 0.0, 1.0)
    scale = float(sys.argv[1])
    pm.Normal("x", scale * mu, 1.0, observed=pm.Minibatch(x, batch_size=20), total_size=200)
    with event.install_recorder("numba:compile") as recorder:
        idata = pm.sample(
            draws=5, tune=0, chains=1, step=SGLD(step_size=1e-3), random_seed=1,
            progressbar=False, compute_convergence_checks=False,
        )
compiled = sum(1 for _, e in recorder.buffer if e.is_start)
print(json.dumps({"compiled": compiled, "draws": idata.posterior["mu"].values.ravel().tolist()}))
"""


def _env_with_compiledir(compiledir, **extra: str) -> dict[str, str]:
    """``os.environ`` for a child process whose PyTensor compile directory is ``compiledir``."""
    import os

    flags = ",".join(
        f for f in [os.environ.get("PYTENSOR_FLAGS", ""), f"base_compiledir={compiledir}"] if f
    )
    return {**os.environ, "PYTENSOR_FLAGS": flags, **extra}


def _compile_run(compiledir, scale: float) -> dict:
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _COMPILE_RUN, str(scale)],
        env=_env_with_compiledir(compiledir),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_compiled_blocks_are_cached_across_processes_and_reused_by_a_changed_model(tmp_path):
    # lean_cache_wrappers caches the block's outermost graph without PyTensor's wrapper (under
    # a file name that does not change between processes) and keeps the leaf ops' wrappers.
    first = _compile_run(tmp_path, 2.0)
    again = _compile_run(tmp_path, 2.0)
    # Another number in an expression: a new block graph. (A distribution's parameter would
    # not be: it is an input of the graphs, ``test_rewrite_cache.py``.)
    changed = _compile_run(tmp_path, 3.0)
    assert again["compiled"] == 0  # loaded whole from the cache, nothing compiled
    assert again["draws"] == first["draws"]
    # Only the graphs holding the changed constant compile again; the leaf ops are reused.
    assert 0 < changed["compiled"] < first["compiled"] // 2


_LEAF_RUN = """
import json
import numpy as np, pytensor, pytensor.tensor as pt
from numba.core import event
from pymc_sgmcmc.numba_compile import lean_cache_wrappers
x = pt.vector("x", shape=(3,))
y = pt.vector("y", shape=(3,))
with lean_cache_wrappers():
    fn = pytensor.function([x, y], [pt.exp(x) * y, pt.sort(x)[::-1]], mode="NUMBA")
with event.install_recorder("numba:compile") as recorder:
    fn(np.arange(3.0), np.ones(3))
compiled, callers = [], []
for _, e in recorder.buffer:
    py = e.data["dispatcher"].py_func
    if e.is_start:
        compiled.append([*callers, py.__name__])
        callers.append(py.__name__)
    else:
        callers.pop()
print(json.dumps(compiled))
"""


def test_a_leaf_op_compiles_once_as_its_caching_wrapper(tmp_path):
    # PyTensor caches each leaf op's numba function through a wrapper that calls it, one more
    # level whose code LLVM optimises and emits again; lean_cache_wrappers inlines the op's
    # function into its wrapper instead, which is still cached under the op's key.
    import json
    import subprocess
    import sys

    def compiled() -> list[list[str]]:
        run = [sys.executable, "-c", _LEAF_RUN]
        out = subprocess.run(
            run, env=_env_with_compiledir(tmp_path), capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = compiled()
    leaves = [path for path in first if len(path) == 2]
    assert len(leaves) >= 2  # the elementwise product and the sort, at least
    # No leaf compiles a function of its own name (a wrapper compiling its op's function).
    assert not [path for path in first if len(path) == 3 and path[1] == path[2]]
    assert compiled() == []  # the next process loads everything from the cache


_CHAIN_RUN = """
import sys
import numpy as np, pymc as pm
sys.path.insert(0, sys.argv[2])
from models import GaussianRegression
from pymc_sgmcmc import SGLD, SGNHT
chains = {}
for name, step, (n_obs, dim, batch) in [
    ("SGLD", lambda: SGLD(step_size=1e-5, thin=2), (10_000, 100, 500)),
    ("SGNHT", lambda: SGNHT(step_size=1e-3, friction=5.0), (500, 2, 50)),
]:
    with GaussianRegression.make(n_obs=n_obs, dim=dim, batch_size=batch).model():
        idata = pm.sample(
            draws=300, tune=50, step=step(), chains=1, random_seed=7,
            progressbar=False, compute_convergence_checks=False,
        )
    chains[name] = idata.posterior["w"].values
    for stat in idata.sample_stats.data_vars:
        chains[f"{name}_{stat}"] = idata.sample_stats[stat].values
np.savez(sys.argv[1], **chains)
"""


def _chain_run(tmp_path, name: str) -> dict:
    import subprocess
    import sys
    from pathlib import Path

    caches = tmp_path / "caches"
    env = _env_with_compiledir(caches, NUMBA_CACHE_DIR=str(caches / "numba_dir"))
    out = tmp_path / f"{name}.npz"
    tests = str(Path(__file__).parent)
    subprocess.run([sys.executable, "-c", _CHAIN_RUN, str(out), tests], env=env, check=True)
    return dict(np.load(out))


def test_no_fast_math_flags_reorder_sums_while_a_block_compiles(monkeypatch):
    # Both places PyTensor takes LLVM's fast-math flags from -- numba_njit, and the
    # elemwise/blockwise/random overloads' _jit_options (whose fused reductions sum the
    # minibatch log-likelihood over rows) -- give no "reassoc" inside deterministic_fastmath,
    # and PyTensor's own flags again after it.
    import pytensor.link.numba.dispatch.basic as numba_basic
    import pytensor.link.numba.dispatch.blockwise as numba_blockwise
    import pytensor.link.numba.dispatch.elemwise as numba_elemwise
    import pytensor.link.numba.dispatch.random as numba_random

    from pymc_sgmcmc.numba_compile import FASTMATH, deterministic_fastmath

    njit_flags = []  # numba.njit's flags, recorded instead of compiling

    def record_njit(*args, fastmath, **kwargs):
        njit_flags.append(fastmath)
        return lambda function: function

    monkeypatch.setattr(numba_basic, "_njit", record_njit)

    def flags() -> list[set]:
        numba_basic.numba_njit(lambda x: x)
        modules = (numba_elemwise, numba_blockwise, numba_random)
        return [set(njit_flags.pop())] + [set(m._jit_options()["fastmath"]) for m in modules]

    before = flags()
    assert all("reassoc" in f for f in before)  # PyTensor's default (numba__fastmath=True)
    with deterministic_fastmath():
        assert flags() == [set(FASTMATH)] * 4
    assert flags() == before


def test_a_block_loaded_from_the_cache_draws_what_the_compiling_process_drew(tmp_path):
    # numba caches a block with its callees linked in as copies that LLVM optimises again;
    # the compiling process runs the callees' own code. Under PyTensor's fast math
    # ("reassoc") sums were then vectorised differently in the two, and the chains parted
    # after a few steps (last-place differences amplified): SGLD's on the D = 100 regression
    # from its first draws, SGNHT's (and its kinetic temperature) after ~100 (the case of
    # cores=2 against cores=1 with a cold cache). deterministic_fastmath and the kernels'
    # opaque loop lengths make the code the same wherever it was optimised. (On an AVX2
    # host the log-likelihood's fused sum over rows still differed in minibatch_logp's last
    # place while it kept "reassoc": see the test above.)
    compiled = _chain_run(tmp_path, "compiled")  # empty caches: compiles every block
    loaded = _chain_run(tmp_path, "loaded")  # the same caches: loads them
    assert compiled.keys() == loaded.keys() and len(compiled) > 4
    for key, values in compiled.items():
        np.testing.assert_array_equal(values, loaded[key], err_msg=key)
