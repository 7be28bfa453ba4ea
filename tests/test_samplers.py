"""Samplers inside pm.sample: accuracy, the PyMC contract, reproducibility and bad input."""

from __future__ import annotations

import functools
import re
import warnings

import arviz as az
import numpy as np
import pymc as pm
import pytensor
import pytest
from checks import (
    Z_TOLERANCE,
    chain_from_the_mean,
    gaussian_check,
    graph_nodes,
    posterior_draws,
)
from models import GaussianRegression, rare_level_logistic
from pytensor.scan.op import Scan

import pymc_sgmcmc
from pymc_sgmcmc import MSGLD, NOGIN, SGHMC, SGLD, SGNHT, CCAdL, MCCAdL, PolynomialDecay

SAMPLE_KWARGS = dict(progressbar=False, compute_convergence_checks=False)


def regression_data(n_obs=2000, seed=0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_obs, 3))
    return X, X @ [1.0, -2.0, 0.5] + 0.7 * rng.standard_normal(n_obs)


def transformed_regression(n_obs=2000, batch=100, seed=0, dtype="float64"):
    """Regression with an unknown noise scale (log transform) and a Minibatch; with
    ``dtype="float32"`` float32 data in a model built under ``floatX="float32"``."""
    X, y = (a.astype(dtype) for a in regression_data(n_obs, seed))
    with pytensor.config.change_flags(floatX=dtype), pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=batch)
        w = pm.Normal("w", 0, 10, shape=3)
        sigma = pm.HalfNormal("sigma", 2)
        pm.Normal("y", X_mb @ w, sigma, observed=y_mb, total_size=n_obs)
    return model


SAMPLERS = {
    "SGLD": lambda: SGLD(step_size=1e-5),
    "MSGLD": lambda: MSGLD(step_size=1e-5),
    "SGHMC": lambda: SGHMC(step_size=1e-3, friction=10.0),
    "SGNHT": lambda: SGNHT(step_size=3e-3, friction=10.0),
    "CCAdL": lambda: CCAdL(step_size=1e-3, friction=10.0),
    "MCCAdL": lambda: MCCAdL(step_size=1e-3, friction=10.0),
    "NOGIN": lambda: NOGIN(step_size=1e-3, friction=10.0),
}


def documented_stats(cls) -> set[str]:
    section = cls.__doc__.split("Sampler stats")[1]
    return set(re.findall(r"^\s{4}(\w+) : ", section, flags=re.M))


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_sample_returns_datatree_with_documented_stats(name):
    with transformed_regression():
        step = SAMPLERS[name]()
        idata = pm.sample(draws=300, tune=100, step=step, chains=2, random_seed=1, **SAMPLE_KWARGS)
    assert set(idata.posterior.data_vars) == {"w", "sigma"}
    stats = set(idata.sample_stats.data_vars)
    assert stats == set(type(step).stats_dtypes_shapes)
    assert stats == documented_stats(type(step)), "every stat is documented in the docstring"
    assert all(idata.sample_stats[s].ndim == 2 for s in stats), "scalar stats only"
    assert idata.sample_stats["diverging"].dtype == bool
    summary = az.summary(idata)
    assert np.isfinite(summary["mean"]).all()
    assert np.all(idata.posterior["sigma"] > 0)
    assert type(step) not in pm.step_methods.STEP_METHODS


def float64_arrays_in_steps(block) -> set[str]:
    """The ops of a compiled block's integrator step (the scan's inner graph and the graphs
    nested in it) that output float64 arrays of more than one element. The scan's own
    outputs, the traces of the float64 stats, are not the step's work; nor are float64
    scalars (PyMC's N/n scaling is one) broadcast as (1, 1) arrays."""

    def is_float64_array(var) -> bool:
        kind = var.type
        return getattr(kind, "dtype", "") == "float64" and any(s != 1 for s in kind.shape)

    scans = [n for n in block.maker.fgraph.apply_nodes if isinstance(n.op, Scan)]
    assert scans, "the block is one scan over its steps"
    return {
        str(node.op)
        for scan in scans
        for node in graph_nodes(scan.op.fgraph)
        if any(is_float64_array(o) for o in node.outputs)
    }


#: Samplers whose float32 test runs only with ``make test-slow``: each compiles its float32
#: blocks cold in 50-120 s of a clean CI run (2026-11-25; 7-16 s warm), and in the default run
#: mCCAdL and NOGIN run in float32 in ``test_jax.py`` and NOGIN in ``test_covariance_samplers.py``.
FLOAT32_SLOW = {"MSGLD", "CCAdL", "MCCAdL", "NOGIN"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in FLOAT32_SLOW else n for n in SAMPLERS],
)
def test_float32_model_is_sampled_in_float32(name):
    """A model built under floatX="float32" runs in float32: the draws, and every array the
    compiled step computes (its scalar stats are recorded as float64); with the defaults
    (adapted step size) the posterior mean lands within 5 posterior sd (0.016) of the
    least-squares fit. The draws' accuracy in float32 is checked exactly by the stationary
    covariance of SGLD (``test_stationary.py``) and NOGIN's Lemma 2."""
    with transformed_regression(dtype="float32"):
        step = getattr(pymc_sgmcmc, name)()
        idata = pm.sample(draws=300, step=step, chains=1, random_seed=1, **SAMPLE_KWARGS)
    assert idata.posterior["w"].dtype == np.float32
    assert np.isfinite(idata.posterior["w"]).all() and not idata.sample_stats["diverging"].any()
    assert float64_arrays_in_steps(step._block_function()[0]) == set()
    X, y = regression_data()
    least_squares = np.linalg.lstsq(X, y, rcond=None)[0]
    mean = idata.posterior["w"].mean(("chain", "draw")).values
    np.testing.assert_allclose(mean, least_squares, atol=5 * 0.7 / np.sqrt(len(y)))


def test_sgnht_thermostat_reaches_unit_kinetic_temperature():
    # CCAdL's Proposition 2 in practice for the thermostat without covariance control: the
    # long-run kinetic temperature is 1 (standard error from the ESS of the stat), and the
    # thermostat settles above A, absorbing the minibatch-gradient noise (h tr Sigma / 2D ~ 3).
    problem = GaussianRegression.make(n_obs=1000, dim=2, batch_size=500)
    with problem.model():
        step = SGNHT(step_size=3e-3, friction=1.0, thin=5)
        idata = pm.sample(
            draws=10_000, tune=2000, step=step, chains=2, random_seed=2, **SAMPLE_KWARGS
        )
    kt = idata.sample_stats["kinetic_temperature"].values
    se = kt.std() / np.sqrt(az.ess(kt, method="mean"))
    assert abs(kt.mean() - 1) < Z_TOLERANCE * se, (kt.mean(), se)
    assert idata.sample_stats["thermostat"].mean() > 2.0


class SGNHTStartedHigh(SGNHT):
    """SGNHT with its thermostat started at 10 times its equilibrium level."""

    def _initial_state(self, theta):
        state = super()._initial_state(theta)
        state["thermostat"] = 10.0 * state["thermostat"]
        return state


def test_a_thermostat_still_relaxing_over_the_draws_is_reported():
    # N/n = 50, D = 10, a user's h = 0.1 / sqrt(lambda_max), tune=0, 4,000 draws of 10 steps:
    # 54 units of time. The posterior's xi is about 180; xi moves by (T - 1) per unit time.
    # From the model's initial point (7-112 posterior sd out) xi starts at A (the force
    # dominates its noise there) and climbs over the whole run: the draws' kinetic
    # temperature averages 3.0 (exactly, from xi's net change), their variances 2-5 times
    # the posterior's. Started at 10 times its level at the posterior mean, xi falls at most
    # 1 per unit time: a temperature of 0.24, variances 0.12-0.18 of the posterior's, the
    # chain nearly frozen (SGNHT's own start before it had the far-out rule). Both are reported,
    # never served silently. With the defaults (tune=300, step size adapted, xi restarted at
    # its equilibrium at each window's end) the far start gives a temperature within 0.001 of
    # 1 (0.9995-1.0004 over 2 seeds and 3 samplers at tune=500), and no warning.
    problem = GaussianRegression.make(n_obs=5000, dim=10, batch_size=100)
    h = 0.1 / np.sqrt(np.linalg.eigvalsh(problem.precision).max())
    kwargs = dict(draws=4000, tune=0, chains=1, random_seed=4, **SAMPLE_KWARGS)
    with problem.model():
        step = SGNHT(step_size=h, thin=10)
        with pytest.warns(
            RuntimeWarning, match=r"kinetic temperature averaged 3(\.0\d*)? over .* too hot"
        ):
            pm.sample(step=step, **kwargs)
        assert step.kept_kinetic_temperature() > 2.0
        step = SGNHTStartedHigh(step_size=h, thin=10)
        with pytest.warns(RuntimeWarning, match=r"kinetic temperature averaged 0\.\d* .* too cold"):
            pm.sample(step=step, initvals={"w": problem.mean}, **kwargs)
        assert step.kept_kinetic_temperature() < 0.5
        step = SGNHT()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm.sample(draws=500, tune=300, step=step, chains=1, random_seed=4, **SAMPLE_KWARGS)
    assert not [w for w in caught if "kinetic temperature" in str(w.message)]
    assert abs(step.kept_kinetic_temperature() - 1.0) < 0.01


def random_intercepts(group_sd: float) -> pm.Model:
    """Centred random intercepts, 5 groups of 400 rows (unit noise): with group_sd = 0.005
    the groups' data (se 0.05) do not pin their means down, tau piles up at 0 and the
    centred form is a funnel; with group_sd = 1 they do, and it is not."""
    rng = np.random.default_rng(3)
    groups, rows, batch = 5, 400, 100
    g = np.repeat(np.arange(groups), rows).astype(np.int32)
    y = 1.0 + group_sd * rng.standard_normal(groups)[g] + rng.standard_normal(groups * rows)
    with pm.Model() as model:
        gb, yb = pm.Minibatch(g, y, batch_size=batch)
        mu = pm.Normal("mu", 0.0, 5.0)
        tau = pm.HalfNormal("tau", 1.0)
        a = pm.Normal("a", mu, tau, shape=groups)
        sigma = pm.HalfNormal("sigma", 2.0)
        pm.Normal("y", a[gb], sigma, observed=yb, total_size=groups * rows)
    return model


def test_a_tuning_shorter_than_a_relaxation_time_with_a_thin_of_ones_own_is_reported():
    # With a user's thin the drift check is off; a tuning whose tune x thin steps fall short
    # of one relaxation time at the kept step size cannot have reached the posterior
    # (MvNormal + LKJ, thin=10, tune=400: means 25 sd off, only PyMC's R-hat said so).
    # N/n = 500 makes SGLD's adapted step noise-limited: a relaxation time of about 10^4
    # steps, against 50 (thin=1: reported) and 50,000 (thin=1000: silent) tuning steps.
    def tuning_warnings(thin):
        with GaussianRegression.make(n_obs=5000, dim=2, batch_size=10).model():
            step = SGLD(thin=thin)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pm.sample(draws=5, tune=50, chains=1, step=step, random_seed=1, **SAMPLE_KWARGS)
        relaxation = step.relaxation_steps(step.step_size)
        return relaxation, [w for w in caught if "tuning ran" in str(w.message)]

    relaxation, short = tuning_warnings(1)
    assert relaxation > 50 and len(short) == 1
    assert "tune=50 x thin=1" in str(short[0].message)
    relaxation, long = tuning_warnings(1000)
    assert relaxation < 50_000 and not long
    assert not tuning_warnings(None)[1]  # adapted thin: the drift check's business


@pytest.mark.parametrize(
    "group_sd, chains, reported",
    # Slow: 8 mCCAdL chains of 2,000 draws, 130-150 s with empty caches; the default run
    # keeps the rule's own test below and the funnel's "fine" side.
    [pytest.param(0.005, 8, True, marks=pytest.mark.slow), (1.0, 1, False)],
    ids=["funnel", "fine"],
)
def test_a_thermostat_absorbing_far_more_heat_than_tuning_allowed_for_is_reported(
    group_sd, chains, reported
):
    # In the funnel's neck mCCAdL's xi climbed from A = 1 to 12-21 in the draws and stayed
    # there; its sds were 0.3-0.6 of NUTS's (on the non-centred form) in both chains of two
    # seeds, with no divergence, and the relaxation check (xi's net change: a temperature of
    # 1.02) saw nothing. Where the centred form is right the time average of xi stays within
    # a few percent of A (0.98-1.08 for SGNHT, CCAdL and mCCAdL on regressions).
    # Whether a chain enters the neck depends on its realisation, which a last-ulp change to
    # the arithmetic changes: 6 of 8 chains (seed 1) did, with xi averaging 3.8-17.5, the
    # others 1.96 and 1.01; on 2026-12-06 the first 4 chains of seed 1 entered 3 times,
    # and after a change of the last bits (stop 92) none did, where seeds 2 and 3 entered
    # 1 and 4 times (5 of 12: xi averaging 11.7-18.2, the others 1.00-1.01). Hence 8 chains,
    # of which at least one must be reported (all 8 escaping: about 1 % at 5 in 12).
    with random_intercepts(group_sd):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            idata = pm.sample(
                draws=1000, tune=1000, step=MCCAdL(), chains=chains, cores=1, random_seed=1,
                **SAMPLE_KWARGS,
            )  # fmt: skip
    absorbing = [w for w in caught if "absorbed the heat" in str(w.message)]
    mean_xi = idata.sample_stats["thermostat"].values.mean(axis=1)  # A = 1
    assert bool(absorbing) == reported, (mean_xi, [str(w.message)[:200] for w in caught])
    assert len(absorbing) <= np.sum(mean_xi > 1.5)  # only chains whose xi is well above A
    assert (mean_xi.max() > 2.0) == reported


def test_a_thermostat_is_reported_only_when_its_mean_is_more_than_a_above_a_and_chance():
    # The rule of the test above, without its chains: with the step size adapted, xi's time
    # average over the draws may exceed A by A (THERMOSTAT_EXCESS_WARNING) and by
    # RELAXATION_Z equilibrium sds 1/sqrt(mu) (mu = D), whichever is larger; a user's step
    # size is never second-guessed.
    def warned(dim, mean_xi, user_step_size=None):
        with pm.Model():
            w = pm.Normal("w", 0, 1, shape=dim)
            rows = pm.Minibatch(np.zeros(10), batch_size=5)
            pm.Normal("y", w.sum(), 1, observed=rows, total_size=10)
            step = MCCAdL(step_size=user_step_size)
        step.step_size = 0.01 if user_step_size is None else user_step_size
        time = 20.0
        step.kept_thermostat = (step.friction, 0.0, time)
        step.kept_friction_integral = mean_xi * step.friction * time
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step._warn_if_thermostat_absorbing()
        return [str(w.message) for w in caught if "absorbed the heat" in str(w.message)]

    # D = 50: 5 sds are 0.71 A, so the 2 A rule decides.
    assert not warned(50, 1.9)
    (message,) = warned(50, 2.1)
    assert "averaged 2.1 over the draws" in message and "funnel" in message
    assert not warned(50, 2.1, user_step_size=0.01)
    # D = 2: 5 sds are 3.5 A, so xi's own fluctuation decides.
    assert not warned(2, 4.4)
    assert warned(2, 4.7)


def test_a_chain_thrown_into_a_funnels_neck_restarts_from_a_draw_before_it():
    # In the funnel above (seed 7), one 15-step tuning draw threw the group scale from 0.06
    # to 2.8e-18 (the minibatch log-density from about -2,800 to -2.9e36) and the next step
    # was NaN. The runaway check reads every 10th step and the draw was not one of them, so
    # the chain restarted from that draw, every later block diverged from it and every kept
    # draw repeated it (tau = 2.8e-18, all flagged, and step_size=9e-35 advised). A stored
    # draw that far below the chain's typical value (runaway.EXTREME margins) is now itself
    # a divergence, and the chain restarts from the draw before.
    with random_intercepts(0.005):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            idata = pm.sample(
                draws=100, tune=1000, step=MCCAdL(), chains=1, random_seed=7,
                discard_tuned_samples=False, **SAMPLE_KWARGS,
            )  # fmt: skip
    groups = ("warmup_sample_stats", "sample_stats")
    diverging = np.concatenate([idata[g]["diverging"].values[0] for g in groups])
    logp = np.concatenate([idata[g]["minibatch_logp"].values[0] for g in groups])
    tau = np.concatenate([idata[g]["tau"].values[0] for g in ("warmup_posterior", "posterior")])
    assert diverging[:100].any()  # the throw, early in tuning
    assert logp[~diverging].min() > -1e5  # sane draws: -3,400 to -2,300
    assert tau.min() > 1e-8
    assert not idata.sample_stats["diverging"].values.any()


def test_sgnht_starts_its_thermostat_at_the_noise_level_of_sixteen_minibatches():
    # At a (re)start xi = A + h tr(Sigma) / (2D), from 16 minibatches: the same level as one
    # minibatch's estimate, with a quarter of its spread (400 starts each at the posterior
    # mean: the ratio of the sds has a standard error of about 0.015 for Gaussian levels,
    # more for these skewed ones). Far out, where the force dominates its noise, xi = A.
    problem = GaussianRegression.make(n_obs=5000, dim=10, batch_size=100)
    with problem.model() as model:
        step = SGNHT(step_size=1e-3, thin=1, block_steps=10)
        step.setup_chain(np.random.default_rng(5), tune=0, draws=20)
        step.step(model.initial_point())
    theta = problem.mean / step.scale
    single = [step._start_evaluation(theta)["thermostat"] for _ in range(400)]
    averaged = [step._initial_state(problem.mean)["thermostat"] for _ in range(400)]
    se = np.sqrt((np.var(single) + np.var(averaged)) / 400)
    assert abs(np.mean(averaged) - np.mean(single)) < Z_TOLERANCE * se
    assert np.mean(single) > step.friction + 10.0  # the noise level is measurable at this h
    assert 0.18 < np.std(averaged) / np.std(single) < 0.35
    far = step.sg_model.initial_theta  # 7-112 posterior sd out
    assert step._start_evaluation(far / step.scale)["thermostat"] > 5 * np.mean(single)
    assert step._initial_state(far)["thermostat"] == step.friction


@pytest.mark.parametrize("splitting", ["BADODAB", "euler"])
def test_sgnht_matches_exact_gaussian_posterior(splitting):
    # N = 1000, n = 500, h omega ~ 0.1: discretisation bias <= (h omega)^2 / 4 ~ 0.3 % of the
    # variance, below the Monte Carlo error (ESS ~ 4,000 per coordinate: se ~ 2 %).
    problem = GaussianRegression.make(n_obs=1000, dim=2, batch_size=500)
    with problem.model():
        step = SGNHT(step_size=3e-3, friction=10.0, splitting=splitting, thin=5)
        idata = pm.sample(
            draws=10_000, tune=1000, step=step, chains=2, random_seed=3, **SAMPLE_KWARGS
        )
    check = gaussian_check(posterior_draws(idata, "w"), problem.mean, problem.cov)
    assert check.passes(), check.describe()
    assert check.ess_var.min() > 2000, check.describe()


def moment_errors(x: np.ndarray, mean: float, var: float) -> tuple[float, float]:
    """Errors of the sample mean and variance of (chain, draw) draws, in standard errors."""
    se_mean = np.sqrt(var / az.ess(x))
    sq = (x - mean) ** 2
    se_var = sq.std() / np.sqrt(az.ess(sq, method="mean"))
    return abs(x.mean() - mean) / se_mean, abs(sq.mean() - var) / se_var


def normal_gamma(n_obs=100, batch_size=None, seed=0):
    """CCAdL section 4.1: x_i ~ N(mu, 1/gamma), mu | gamma ~ N(0, 1/gamma), gamma ~ Gam(1, 1)."""
    x = np.random.default_rng(seed).standard_normal(n_obs)
    with pm.Model() as model:
        gamma = pm.Gamma("gamma", 1.0, 1.0)  # sampled as log(gamma)
        mu = pm.Normal("mu", 0.0, 1.0 / pm.math.sqrt(gamma))
        data = x if batch_size is None else pm.Minibatch(x, batch_size=batch_size)
        pm.Normal(
            "x",
            mu,
            1.0 / pm.math.sqrt(gamma),
            observed=data,
            total_size=None if batch_size is None else n_obs,
        )
    kappa, xbar = 1 + n_obs, x.mean()
    alpha = 1 + n_obs / 2
    beta = 1 + 0.5 * ((x - xbar) ** 2).sum() + n_obs * xbar**2 / (2 * kappa)
    exact = {
        "gamma": (alpha / beta, alpha / beta**2),
        "mu": (n_obs * xbar / kappa, beta / (kappa * (alpha - 1))),
    }
    return model, exact


def test_normal_gamma_full_batch_through_the_log_transform():
    # Without Minibatch the force is exact (Sigma = 0): only the O(h^2) splitting bias remains
    # (h omega ~ 0.1, below 1 % of the variance; ESS ~ 5,000: se of a variance ~ 2-3 %).
    model, exact = normal_gamma()
    with model:
        step = SGNHT(step_size=0.01, friction=10.0, thin=5)
        idata = pm.sample(
            draws=10_000, tune=1000, step=step, chains=2, random_seed=4, **SAMPLE_KWARGS
        )
    for name, (mean, var) in exact.items():
        err_mean, err_var = moment_errors(idata.posterior[name].values, mean, var)
        assert err_mean < Z_TOLERANCE and err_var < Z_TOLERANCE, (name, err_mean, err_var)


# --------------------------------------------------------------------------- reproducibility
def small_problem():
    return GaussianRegression.make(n_obs=500, dim=2, batch_size=50)


@pytest.mark.parametrize("control_variates", [False, True], ids=["plain", "control-variates"])
def test_same_seed_same_draws_whatever_cores(control_variates):
    # With control variates the reused step also carries its anchor's compiled full pass.
    problem = small_problem()
    with problem.model():
        step = SGNHT(step_size=1e-3, friction=5.0, control_variates=control_variates)
        kwargs = dict(draws=200, tune=50, step=step, chains=2, random_seed=7, **SAMPLE_KWARGS)
        one = pm.sample(cores=1, **kwargs)
        # forkserver: the worker processes do not inherit this process's threads (JAX's, when
        # the JAX tests ran earlier in it: forking a multithreaded process can deadlock).
        two = pm.sample(cores=2, mp_ctx="forkserver", **kwargs)
        again = pm.sample(cores=1, **kwargs)  # the same step object, reused: no state leaks
    for other in (two, again):
        np.testing.assert_array_equal(one.posterior["w"].values, other.posterior["w"].values)
        np.testing.assert_array_equal(
            one.sample_stats["thermostat"].values, other.sample_stats["thermostat"].values
        )
    # The chains start at the same point but move differently.
    w = one.posterior["w"].values
    assert not np.allclose(w[0], w[1])


class RecordingSGLD(SGLD):
    """Records the minibatch indices each chain draws."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []
        draw = self.sg_model.draw_indices

        def recording(rng, steps):
            out = draw(rng, steps)
            self.seen[-1].append(out[0])
            return out

        self.sg_model.draw_indices = recording

    def setup_chain(self, rng, tune, draws):
        super().setup_chain(rng, tune, draws)
        self.seen.append([])


def test_chains_draw_independent_minibatch_streams():
    problem = small_problem()
    with problem.model():
        step = RecordingSGLD(step_size=1e-4)
        pm.sample(draws=20, tune=0, step=step, chains=2, cores=1, random_seed=5, **SAMPLE_KWARGS)
    first, second = (np.concatenate(c) for c in step.seen)
    assert first.shape == second.shape
    assert (first != second).mean() > 0.9  # with replacement from N = 500: ~0.998 differ


# --------------------------------------------------------------------------- schedules, thin
def minibatch_noise_trace(problem, theta, rows) -> float:
    """tr Sigma-hat of one minibatch: n / (n - 1) sum_i |G_i - G_mean|^2 with the scaled rows
    G_i = (N / n) g_i(theta) (``NoiseCovariance``)."""
    n_obs, n = len(problem.y), len(rows)
    scaled = (n_obs / n) * problem.per_observation_gradients(theta)[rows]
    return n / (n - 1) * np.sum((scaled - scaled.mean(axis=0)) ** 2)


@pytest.mark.parametrize(
    "factory",
    [MSGLD, MCCAdL, functools.partial(MCCAdL, noise_minibatch="independent")],
    ids=["MSGLD", "MCCAdL", "MCCAdL-independent"],
)
def test_noise_trace_is_that_of_the_draws_minibatch(factory):
    # The stat is computed only at the stored steps (a lazy branch): at thin = 3 each stored
    # value must be tr Sigma-hat of the minibatch of its own step, at the draw, where both
    # samplers evaluate the force. The minibatches are replayed from the sampler's own draws
    # of indices: per block the force's rows, then (noise_minibatch="independent") the rows
    # of Sigma-hat, drawn after the force's and the noise. Both compute it from G rounded to
    # float32, as their products read G (mCCAdL's Lanczos kernel at the default tolerance):
    # ~1e-7 relative; the trace of the force's rows differs from the others' by ~6 %.
    problem = GaussianRegression.make(n_obs=2000, dim=5, batch_size=100, seed=2)
    thin, draws, block = 3, 40, 30
    with problem.model():
        step = factory(step_size=1e-4, thin=thin, block_steps=block)
        blocks = []
        draw_indices = step.sg_model.draw_indices

        def recorded(rng, steps):
            indices = draw_indices(rng, steps)
            if steps == block:  # a block's, not a chain start's or a geometry check's
                blocks.append(indices[0])
            return indices

        step.sg_model.draw_indices = recorded
        idata = chain_from_the_mean(problem, step, draws=draws, seed=3)
    if step.noise_minibatch == "independent":
        blocks = blocks[1::2]
    stored_rows = np.concatenate([rows[thin - 1 :: thin] for rows in blocks])
    positions = idata.posterior["w"].values[0]
    expected = [
        minibatch_noise_trace(problem, w, r) for w, r in zip(positions, stored_rows, strict=True)
    ]
    np.testing.assert_allclose(idata.sample_stats["noise_trace"].values[0], expected, rtol=1e-5)


def test_nogin_noise_trace_estimates_the_noise_at_the_posterior():
    # NOGIN evaluates Sigma at the step's midpoint, which is not stored: its stat is checked
    # against E tr Sigma(theta) over the posterior (``expected_noise_covariance``). A single
    # minibatch's trace spreads by about sqrt(2 / (n D)) = 6 % at n = 100, D = 5; over 400
    # draws the mean's error is ~0.3 %, far inside 3 % (a value from the wrong step of the
    # block would be NaN).
    problem = GaussianRegression.make(n_obs=2000, dim=5, batch_size=100, seed=2)
    with problem.model():
        step = NOGIN(step_size=1e-3, friction=1.0, thin=3, solver="cg")
        idata = chain_from_the_mean(problem, step, draws=400, seed=3)
    trace = idata.sample_stats["noise_trace"].values[0]
    expected = np.trace(problem.expected_noise_covariance(problem.mean, problem.cov))
    assert np.all(np.isfinite(trace))
    np.testing.assert_allclose(trace.mean(), expected, rtol=0.03)


def test_polynomial_decay_schedule_is_recorded_per_draw():
    schedule = PolynomialDecay(a=1e-3, b=10.0, gamma=0.55)
    with small_problem().model():
        idata = pm.sample(
            draws=50,
            tune=10,
            step=SGLD(step_size=schedule, thin=3),
            chains=1,
            random_seed=1,
            **SAMPLE_KWARGS,
        )
    # The stored draw k (tuning included) is the state after step 3(k + 1) - 1.
    t = 3 * (10 + np.arange(50) + 1) - 1
    np.testing.assert_allclose(idata.sample_stats["step_size"].values[0], schedule(t))


def test_full_batch_model_samples_exact_gaussian():
    problem = GaussianRegression.make(n_obs=200, dim=2, batch_size=None)
    with problem.model():
        idata = pm.sample(
            draws=4000,
            tune=500,
            step=SGNHT(step_size=0.01, friction=5.0, thin=4),
            chains=2,
            random_seed=3,
            **SAMPLE_KWARGS,
        )
    check = gaussian_check(posterior_draws(idata, "w"), problem.mean, problem.cov)
    assert check.passes(), check.describe()


def test_control_variates_lift_the_noise_cap_and_keep_the_exact_posterior():
    # N / n = 500: SGLD's adapted step size is held down by the gradient noise, about
    # 4 alpha / sigma^2_max. With control variates the noise is the spread of
    # g_i(theta) - g_i(anchor), small near the anchor (the end of tuning), so the step size is
    # set by the curvature, and the draws still follow the exact Gaussian posterior.
    problem = GaussianRegression.make(n_obs=10_000, dim=3, batch_size=20)
    with problem.model():
        plain, controlled = SGLD(), SGLD(control_variates=True)
        pm.sample(draws=10, tune=300, step=plain, chains=1, random_seed=3, **SAMPLE_KWARGS)
        idata = pm.sample(
            draws=2000, tune=300, step=controlled, chains=2, random_seed=3, **SAMPLE_KWARGS
        )
    assert controlled.step_size > 20 * plain.step_size, (controlled.step_size, plain.step_size)
    assert not idata.sample_stats["diverging"].values.any()
    check = gaussian_check(posterior_draws(idata, "w"), problem.mean, problem.cov)
    assert check.passes(), check.describe()


@pytest.mark.parametrize(
    "factory",
    [lambda: CCAdL(control_variates=True), lambda: SGNHT(control_variates=True, splitting="euler")],
    ids=["ccadl", "sgnht-euler"],
)
def test_euler_thermostats_with_control_variates_keep_the_exact_posterior(factory):
    # With control variates the curvature alone limits the adapted step size (h = 0.28 here
    # under the base rule). Euler's friction then makes the thermostat settle at
    # xi (1 - h xi / 2) = A, and the positions sampled at the temperature A / xi: CCAdL's sds
    # were 0.87-0.93 of the posterior's, Euler SGNHT's 0.89-0.92. The step size is capped at
    # h A <= 0.1 (a temperature error of at most 5 %).
    problem = GaussianRegression.make(n_obs=10_000, dim=3, batch_size=20)
    with problem.model():
        step = factory()
        idata = pm.sample(draws=2000, tune=300, step=step, chains=2, random_seed=3, **SAMPLE_KWARGS)
    assert step.step_size <= 0.1
    check = gaussian_check(posterior_draws(idata, "w"), problem.mean, problem.cov)
    assert check.passes(), check.describe()


@pytest.mark.parametrize(
    "factory, anchored",
    [(lambda: SGLD(control_variates=True), True), (SGHMC, False)],
    ids=["SGLD-control-variates", "SGHMC"],
)
def test_a_far_start_whose_kernel_is_kept_is_reported(factory, anchored):
    # With tune below 20 the step size, preconditioner and thin are chosen at the chain's
    # start and kept for the draws, and so is the control variates' anchor, whose noise the
    # step size allows for. From w = 0, about a hundred posterior sd from the mode at
    # N = 10,000, SGHMC and mSGLD with control variates drew sds 10-28 times the
    # posterior's without a warning; SGHMC without them, from a pm.find_MAP() of a minibatch
    # model (370 posterior sd out in the noise scale), drew that scale's sd 19.5 times the
    # posterior's, its capped thin's advice (a larger thin) no help. At the posterior mean
    # nothing is reported.
    problem = GaussianRegression.make(n_obs=10_000, dim=3, batch_size=20)
    with problem.model():
        for initvals, warned in ((None, True), ({"w": problem.mean}, False)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pm.sample(
                    draws=5, tune=0, step=factory(), chains=1, random_seed=3,
                    initvals=initvals, **SAMPLE_KWARGS,
                )  # fmt: skip
            messages = [str(w.message) for w in caught]
            far = [m for m in messages if "the chain starts about" in m]
            assert len(far) == int(warned), messages
            assert all(("control variates' anchor" in m) == anchored for m in far), far
            if warned:  # the far start, not thin, is what to fix
                assert not [m for m in messages if "thin was capped" in m], messages


@pytest.mark.parametrize("factory", [SGLD, NOGIN], ids=["SGLD", "NOGIN"])
def test_a_far_start_whose_way_in_the_draws_keep_is_reported(factory):
    # With a given step size and tune below 20 nothing is chosen at the start, but the draws
    # begin there and include the chain's way in: NOGIN at the benchmarks' h from w = 0 on a
    # logistic regression of 10^6 rows ended 9.2 posterior sd off, still on its way, with no
    # warning. Here from w = 0, about 160 posterior sd out, 400 steps small enough for the
    # gradient noise check to stay silent leave the draws' means 110-190 sd off, and the
    # check (after the first block of 100 steps) says so; from the posterior mean, at the
    # same step size, it says nothing.
    problem = GaussianRegression.make(n_obs=10_000, dim=3, batch_size=20)
    sd = np.sqrt(np.diag(problem.cov))
    with problem.model():
        for initvals, warned in ((None, True), ({"w": problem.mean}, False)):
            step = factory(step_size=3e-8 if factory is SGLD else 1e-4, block_steps=100)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                idata = pm.sample(
                    draws=400, tune=0, step=step, chains=1, random_seed=3, initvals=initvals,
                    **SAMPLE_KWARGS,
                )  # fmt: skip
            messages = [str(w.message) for w in caught]
            far = [m for m in messages if "the chain starts about" in m]
            assert len(far) == int(warned), messages
            error = np.abs(posterior_draws(idata, "w").mean(axis=0) - problem.mean) / sd
            if warned:
                assert "include its way in" in far[0]
                assert error.max() > 10, error  # what the warning is about
            else:
                assert error.max() < 10, error


def test_an_anchor_at_a_posterior_draw_of_a_correlated_posterior_is_not_reported():
    # After tuning the anchor sits where the chain was, a posterior draw. Its distance is
    # the Newton step F_i / sqrt(H_ii), of unit variance there; with the posterior's
    # marginal sds in place of H_ii^(-1/2) its variance is Sigma_ii H_ii, 25-50 for these
    # AR(1) covariates (rho = 0.98), and the anchor was reported 3.2-3.7 sd out on a
    # logistic regression whose draws matched NUTS. With the Newton step the statistic is
    # sqrt(chi2_8 / 8) at a posterior draw, P(> 3) ~ 1e-15.
    rho, dim, n_obs = 0.98, 8, 10_000
    rng = np.random.default_rng(5)
    cov = rho ** np.abs(np.subtract.outer(np.arange(dim), np.arange(dim)))
    X = rng.multivariate_normal(np.zeros(dim), cov, size=n_obs)
    y = X @ rng.standard_normal(dim) + rng.standard_normal(n_obs)
    problem = GaussianRegression(X, y, sigma=1.0, prior_sd=10.0, batch_size=100)
    with problem.model(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.sample(
            draws=5, tune=300, step=SGLD(control_variates=True), chains=2, cores=1,
            random_seed=4, **SAMPLE_KWARGS,
        )  # fmt: skip
    assert not [w for w in caught if "anchor is about" in str(w.message)]


def test_an_anchor_where_a_coordinate_has_no_curvature_is_measured_by_the_windows_spread(
    monkeypatch,
):
    # A Laplace prior has no curvature off its kink, nor has a rare one-hot level whose few
    # rows sit far in their logistic tails: there H_ii^(-1/2) is no width, and the main
    # example's model with control variates reported its anchor, a tuning draw, 7e7
    # posterior sd from the mode. The marginal sd that the windows measured bounds it (for
    # a Gaussian H_ii^(-1/2), the sd with the other coordinates held, is at most that).
    with pm.Model():
        pm.Normal("w", 0, 1, shape=2)
        step = SGLD(control_variates=True)
    step.setup_chain(np.random.default_rng(0), tune=0, draws=1)
    step.anchor_force = np.array([1.0, 0.5])
    monkeypatch.setattr(step, "_curvature_scale", lambda theta, rng: np.array([1e12, 1.0]))
    for widths, warned in ((None, 1), (np.array([1.0, 2.0]), 0)):
        step.measured_widths = widths
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step._warn_if_far_from_mode(np.zeros(2), "anchor")
        assert len([w for w in caught if "anchor is about" in str(w.message)]) == warned


@pytest.mark.slow  # 2 x 2 mCCAdL chains: 80 s cold; its rule has its own test below
def test_a_chain_that_runs_away_from_the_anchor_is_flagged_not_returned_as_a_posterior():
    # A level of 10 rows in 4,000 sits in about a fifth of the minibatches of 100. With
    # control variates MCCAdL's C step damps the momentum with a Sigma-hat from the kick's own
    # rows, so it removes the very kicks those rows give that level's weight: one chain
    # drifted from its anchor steadily to w[3] = -390 (posterior sd 0.64), at no divergence,
    # the runaway check blind to it (the median minibatch holds none of those rows). Its
    # draws beyond ANCHOR_DISTANCE_LIMIT widths are flagged, with one warning; the other
    # chain stayed within 6 widths. Without control variates nothing is flagged.
    for control_variates in (True, False):
        with rare_level_logistic(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = MCCAdL(control_variates=control_variates)
            idata = pm.sample(
                draws=500, tune=500, step=step, chains=2, cores=1, random_seed=1,
                **SAMPLE_KWARGS,
            )  # fmt: skip
        far = [str(w.message) for w in caught if "control variates' anchor" in str(w.message)]
        diverging = idata.sample_stats["diverging"].values
        if not control_variates:
            assert not far and not diverging.any()
            continue
        assert len(far) == 1 and "w[3]" in far[0], far
        w3 = idata.posterior["w"].values[..., 3]
        assert diverging[0].sum() > 100 and not diverging[1].any(), diverging.sum(axis=1)
        assert np.abs(w3[0][diverging[0]]).min() > 10 and np.abs(w3[1]).max() < 10


def test_only_kept_draws_far_from_the_anchor_are_flagged():
    with pm.Model():
        w = pm.Normal("w", 0, 1, shape=2)
        rows = pm.Minibatch(np.zeros(10), batch_size=5)
        pm.Normal("y", w.sum(), 1, observed=rows, total_size=10)
        step = SGLD(control_variates=True)
    step.setup_chain(np.random.default_rng(0), tune=0, draws=1)
    step.anchor, step.measured_widths = np.array([1.0, 0.0]), np.array([1.0, 0.5])
    limit = pymc_sgmcmc.base.ANCHOR_DISTANCE_LIMIT
    offsets = [[0.0, 0.0], [limit - 0.1, 0.0], [0.0, -0.5 * limit - 0.1], [limit + 0.1, 0.0]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # warned once
            buffer = {"theta": step.anchor + np.array(offsets), "diverging": np.zeros(4, bool)}
            step._flag_far_from_anchor(buffer)
            assert buffer["diverging"].tolist() == [False, False, True, True]
    assert len(caught) == 1 and "theta[1]" in str(caught[0].message)  # unserved: no names
    for attribute, value in (("tune", True), ("control_variates", False)):  # one at a time
        unchecked = {"theta": step.anchor + np.array(offsets), "diverging": np.zeros(4, bool)}
        original = getattr(step, attribute)
        setattr(step, attribute, value)
        step._flag_far_from_anchor(unchecked)
        setattr(step, attribute, original)
        assert not unchecked["diverging"].any(), attribute


# --------------------------------------------------------------------------- divergences
def test_divergence_is_flagged_and_never_returned_as_nan():
    problem = small_problem()
    with problem.model():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            idata = pm.sample(
                draws=100,
                tune=0,
                step=SGLD(step_size=0.1),
                chains=2,
                cores=1,
                random_seed=1,
                **SAMPLE_KWARGS,
            )
    messages = [str(w.message) for w in caught if "diverged" in str(w.message)]
    assert len(messages) == 2, "one warning per chain"
    suggested = float(re.search(r"try step_size=([\d.e+-]+)", messages[0]).group(1))
    # Largest curvature ~ N = 500: SGLD is stable below 4/500; the hint is half that.
    assert 1e-3 < suggested < 8e-3
    diverging = idata.sample_stats["diverging"].values
    # Growth by ~25x per step crosses the 1e10 threshold within 10 steps; the chain keeps
    # restarting and diverging.
    assert diverging[:, :10].any(axis=1).all() and diverging.mean() > 0.5
    w = idata.posterior["w"].values
    assert np.isfinite(w).all() and np.abs(w).max() < 1e10
    assert (idata.sample_stats["divergences"].values[:, -1] == diverging.sum(axis=1)).all()


def test_a_block_filled_directly_that_diverges_warns_with_a_step_size_hint():
    # The benchmarks fill blocks without pm.sample's first astep, which records the chain's
    # start; the hint (curvature at the start) is then taken where the block started.
    with small_problem().model() as model:
        step = SGLD(step_size=0.1)
    step.setup_chain(np.random.default_rng(0), tune=0, draws=100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step._fill_buffer(model.initial_point()["w"])
    messages = [str(w.message) for w in caught if "diverged" in str(w.message)]
    assert len(messages) == 1 and step.buffer["diverging"].any()
    suggested = float(re.search(r"try step_size=([\d.e+-]+)", messages[0]).group(1))
    assert 1e-3 < suggested < 8e-3  # as in pm.sample (the previous test)


@pytest.mark.parametrize(
    "factory",
    [
        lambda: MCCAdL(step_size=1.0),
        lambda: MCCAdL(step_size=1.0, covariance="full"),
        lambda: MCCAdL(step_size=1.0, averaging=0.1, averaging_interval=10),
        lambda: CCAdL(step_size=1.0, covariance="full"),
        lambda: SGHMC(step_size=1.0, gradient_noise="estimate"),
    ],
    ids=["mccadl-lowrank", "mccadl-full", "mccadl-periodic-average", "ccadl-full", "sghmc-B"],
)
def test_diverging_linear_algebra_is_flagged_not_raised(factory):
    # h = 1 against a largest curvature of ~500: the state overflows within a few steps, and
    # non-finite matrices reach the Lanczos, expm and eigen-decompositions of the noise
    # estimate. numba's LAPACK wrappers raise on them and the Pade expm overflows an integer
    # power: mCCAdL's low-rank C step (LinAlgError) and its periodic average (OverflowError)
    # crashed pm.sample before those matrices were checked (krylov.on_finite).
    with small_problem().model():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            idata = pm.sample(
                draws=100, tune=0, step=factory(), chains=1, random_seed=1, **SAMPLE_KWARGS
            )
    assert idata.sample_stats["diverging"].values.mean() > 0.3
    assert np.isfinite(idata.posterior["w"].values).all()


@pytest.mark.parametrize(
    "step_size, warned",
    [(2e-2, True), (1e-4, False), (PolynomialDecay(a=0.2, b=1e4), False)],
    ids=["beyond", "within", "schedule-within"],
)
def test_a_step_size_beyond_the_stability_limit_is_named_in_a_warning(step_size, warned):
    # Largest curvature ~ N = 500 in the regression's coordinates: SGLD's linear-stability
    # limit is 4/500 = 8e-3. The check runs once per chain, at the first kept draw after
    # tuning, on the step size then in use (the schedule's is 0.2 * (1e4 + t)^-0.55 ~ 1.3e-3,
    # its a = 0.2).
    problem = small_problem()
    with problem.model():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm.sample(draws=20, tune=10, step=SGLD(step_size=step_size), chains=1, **SAMPLE_KWARGS)
    messages = [str(w.message) for w in caught if "linear-stability limit" in str(w.message)]
    assert len(messages) == int(warned)
    if warned:
        limit = float(re.search(r"limit ([\d.e+-]+)", messages[0]).group(1))
        suggested = float(re.search(r"try step_size=([\d.e+-]+)", messages[0]).group(1))
        assert 5e-3 < limit < 1.2e-2 and suggested == pytest.approx(limit / 2, rel=0.01)


def sampled_from_the_mean(problem, make_step, draws: int) -> tuple[np.ndarray, list[str]]:
    """The draws of ``w`` (one chain, ``tune=0``, from the posterior mean) by the step that
    ``make_step()`` builds in the model, and the warnings' messages: the user step-size
    checks run after the first block."""
    with problem.model():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            idata = pm.sample(
                draws=draws,
                tune=0,
                step=make_step(),
                chains=1,
                random_seed=3,
                initvals={"w": problem.mean},
                **SAMPLE_KWARGS,
            )
    return idata.posterior["w"].values[0], [str(w.message) for w in caught]


#: (sampler, step size and thin for an excess E of its variance from the gradient noise) on
#: the N / n = 100 regression of the test below, whose noise covariance at the posterior is
#: about sigma2 I (sigma2 = N^2 / n = 5e5) and curvature about lambda = N = 5,000 (SGHMC's
#: friction 140 about twice sqrt(lambda)): ``thin`` about one relaxation time.
NOISE_EXCESS_STEPS = {
    "SGLD": lambda e: SGLD(step_size=4 * e / 5e5, thin=max(1, round(5e-4 / (4 * e / 5e5)))),
    "MSGLD": lambda e: MSGLD(
        step_size=8 * np.sqrt(e) / 5e5, thin=max(1, round(5e-4 / (8 * np.sqrt(e) / 5e5)))
    ),
    "SGHMC": lambda e: SGHMC(
        step_size=280 * e / 5e5, friction=140.0, thin=max(1, round(0.028 / (280 * e / 5e5)))
    ),
}


@pytest.mark.parametrize("name", list(NOISE_EXCESS_STEPS))
def test_a_step_size_the_gradient_noise_makes_too_hot_is_named_in_a_warning(name):
    # SGLD, mSGLD and SGHMC (without its noise estimate) leave the minibatch noise in the
    # draws: their variance is (1 + E) times the posterior's in the noisiest direction, with
    # E = eps sigma^2 / 4, (eps sigma^2 / 8)^2 and h sigma^2 / (2A). At E = 1 the chain is
    # twice as wide as the posterior and nothing diverges: the check at the first kept draw
    # estimates E from the gradient noise there and warns (E = 0.05, 0.3 and 1 gave variance
    # ratios of 1.00-1.07, 1.23-1.38 and 1.83-2.28, and the warning said 1.30-1.31 and
    # 2.00-2.02). At E = 0.03 it stays silent. Starts at the posterior mean, tune=0: the
    # check runs after the first block, where the identity preconditioner is kept.
    problem = GaussianRegression.make(n_obs=5000, dim=2, batch_size=50)
    said = {}
    for excess, draws in [(1.0, 2000), (0.03, 20)]:
        w, messages = sampled_from_the_mean(
            problem, functools.partial(NOISE_EXCESS_STEPS[name], excess), draws
        )
        said[excess] = [
            float(re.search(r"about ([\d.e+-]+) times", m).group(1))
            for m in messages
            if "gradient noise" in m
        ]
        if excess == 1.0:
            ratio = np.var(w, axis=0) / np.diag(problem.cov)
            # ESS about 900 of 2,000 draws a relaxation time apart: se about 0.035 on the mean.
            assert ratio.mean() > 1.6, ratio
    assert len(said[1.0]) == 1 and 1.6 < said[1.0][0] < 2.6, said
    assert said[0.03] == [], said


def test_sgnht_with_a_step_size_its_thermostat_cannot_follow_the_noise_at_is_warned():
    # The thermostat absorbs the noise's average over the coordinates: at xi = A + h tr/(2D)
    # a coordinate with noise variance Sigma_jj runs at (A + h Sigma_jj / 2) / xi. With the
    # second covariate three times the first's scale the noise variances are 5e5 and 4.5e6
    # (N = 5,000, n = 50), and at h Sigma_11 / 2 = A the coordinates run at 1/3 and 5/3:
    # nothing diverges, the kinetic temperature averages 1, and only this check tells.
    # A = 140 (about twice the slower coordinate's frequency) keeps a relaxation time near
    # 300 steps; at a fiftieth of that h the temperatures are 0.93 and 1.07, and no warning.
    rng = np.random.default_rng(0)
    X = rng.standard_normal((5000, 2)) * np.array([1.0, 3.0])
    problem = GaussianRegression(
        X, X @ np.array([0.5, -0.5]) + rng.standard_normal(5000), 1.0, 10.0, 50
    )
    said = {}
    for fraction, draws in [(1.0, 1500), (0.02, 20)]:
        w, messages = sampled_from_the_mean(
            problem,
            functools.partial(SGNHT, step_size=fraction * 280 / 5e5, friction=140.0, thin=300),
            draws,
        )
        said[fraction] = [
            tuple(map(float, re.search(r"about ([\d.]+) to ([\d.]+) times", m).groups()))
            for m in messages
            if "thermostat, which absorbs its average" in m
        ]
        if fraction == 1.0:
            ratio = np.var(w, axis=0) / np.diag(problem.cov)
            assert ratio[0] < 0.6 and ratio[1] > 1.4, ratio
    assert len(said[1.0]) == 1, said
    low, high = said[1.0][0]
    assert 0.25 < low < 0.42 and 1.5 < high < 1.85, said
    assert said[0.02] == [], said


@pytest.mark.parametrize(
    "factory",
    [
        CCAdL,
        MCCAdL,
        NOGIN,
        MSGLD,
        lambda step_size: SGHMC(step_size=step_size, gradient_noise="estimate"),
    ],
    ids=["CCAdL", "MCCAdL", "NOGIN", "MSGLD", "SGHMC-estimate"],
)
def test_samplers_that_estimate_the_noise_reject_one_row_minibatches(factory):
    # The noise covariance is estimated from the spread of the minibatch's rows.
    problem = GaussianRegression.make(n_obs=500, dim=2, batch_size=1)
    with problem.model():
        with pytest.raises(ValueError, match="at least 2 rows"):
            pm.sample(draws=5, tune=0, step=factory(step_size=1e-3), chains=1, **SAMPLE_KWARGS)


def test_sgld_and_sgnht_sample_one_row_minibatches():
    # SGNHT only starts its thermostat from the noise estimate: with one row it starts at A.
    problem = GaussianRegression.make(n_obs=500, dim=2, batch_size=1)
    with problem.model():
        sgnht = pm.sample(draws=50, tune=50, step=SGNHT(friction=2.0), chains=1, **SAMPLE_KWARGS)
        sgld = pm.sample(draws=50, tune=50, step=SGLD(), chains=1, **SAMPLE_KWARGS)
    for idata in (sgnht, sgld):
        assert np.isfinite(idata.posterior["w"].values).all()
        assert not idata.sample_stats["diverging"].values.any()
    assert np.isfinite(sgnht.sample_stats["thermostat"].values).all()


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: SGLD(step_size=0.0), "step_size must be positive"),
        (lambda: SGLD(step_size=-1e-3), "step_size must be positive"),
        (lambda: SGLD(step_size=float("nan")), "step_size must be positive"),
        (lambda: SGHMC(step_size=1e-3, friction=0), "friction must be positive"),
        (lambda: SGHMC(step_size=1e-3, gradient_noise="yes"), "gradient_noise must be"),
        (lambda: SGNHT(step_size=1e-3, splitting="leapfrog"), "splitting must be"),
        (lambda: SGNHT(step_size=1e-3, thermostat_mass=-1), "thermostat_mass must be positive"),
        (lambda: SGLD(step_size=1e-3, thin=0), "thin must be a positive integer"),
        (lambda: SGLD(step_size=1e-3, thin=float("nan")), "thin must be a positive integer"),
        (
            lambda: SGLD(step_size=PolynomialDecay(a=1e-3, gamma=0.5)),
            r"gamma must lie in \(0.5, 1\]",
        ),
        (lambda: MSGLD(step_size="big"), "step_size must be a positive number"),
        (lambda: NOGIN(step_size=1e-3, averaging=0.0), r"averaging must be None or lie in"),
        (lambda: NOGIN(step_size=1e-3, cg_tolerance=0.0), r"cg_tolerance must lie in \(0, 1\)"),
        (lambda: MCCAdL(step_size=1e-3, averaging=1.5), r"averaging must be None or lie in"),
        (lambda: CCAdL(step_size=1e-3, averaging=-0.1), r"averaging must be None or lie in"),
        (
            lambda: NOGIN(step_size=1e-3, averaging=0.1, averaging_interval=0),
            "averaging_interval must be a positive integer",
        ),
        (
            lambda: MCCAdL(step_size=1e-3, averaging=0.1, averaging_interval=2.5),
            "averaging_interval must be a positive integer",
        ),
        (
            lambda: MCCAdL(step_size=1e-3, averaging_interval=100),
            "averaging_interval needs averaging",
        ),
        (lambda: NOGIN(step_size=1e-3, noise_shrinkage=2.0), "noise_shrinkage must be None"),
        (
            lambda: MCCAdL(step_size=1e-3, noise_shrinkage_target="spherical"),
            "noise_shrinkage_target must be one of",
        ),
        (
            lambda: NOGIN(step_size=1e-3, noise_covariance="exact", averaging=0.1),
            "apply to the estimated covariance only",
        ),
        (
            lambda: NOGIN(step_size=1e-3, noise_covariance="exact", noise_minibatch="independent"),
            "apply to the estimated covariance only",
        ),
        (
            lambda: MCCAdL(step_size=1e-3, noise_minibatch="other"),
            "noise_minibatch must be 'same' or 'independent'",
        ),
        (
            lambda: NOGIN(step_size=1e-3, noise_covariance="exact", control_variates=True),
            "cannot be combined with control_variates",
        ),
    ],
)
def test_bad_parameters_are_rejected(factory, message):
    with small_problem().model():
        with pytest.raises((ValueError, TypeError), match=message):
            factory()


def test_exact_noise_covariance_with_two_minibatch_sources_is_rejected_when_built():
    # A testing device for one source: said at the step's construction, not at the first
    # block inside pm.sample.
    rng = np.random.default_rng(0)
    x1, x2 = rng.standard_normal(40), rng.standard_normal(60)
    with pm.Model():
        mu = pm.Normal("mu")
        pm.Normal("a", mu, 1.0, observed=pm.Minibatch(x1, batch_size=10), total_size=40)
        pm.Normal("b", mu, 1.0, observed=pm.Minibatch(x2, batch_size=10), total_size=60)
        with pytest.raises(pymc_sgmcmc.ModelError, match=r"needs exactly one pm\.Minibatch call"):
            NOGIN(step_size=1e-3, noise_covariance="exact")
        NOGIN(step_size=1e-3)


@pytest.mark.parametrize(
    "step_size, tune, warned", [(None, 300, False), (1e-4, 0, True)], ids=["adapted", "given"]
)
def test_noise_clipped_in_the_kept_draws_is_reported_and_in_tuning_is_not(step_size, tune, warned):
    # SGHMC's B-hat = (h/2) Sigma-hat: A I - B-hat is not positive semi-definite at the
    # transient's step size (clipped in about two thirds of the 300 tuning draws), but the
    # kept step size never clips. The warning named the transient's step size and, given
    # once per chain, could not report a kept draw after it. h = 1e-4 clips every draw.
    rng = np.random.default_rng(7)
    n_obs, dim = 10_000, 5
    X = rng.normal(size=(n_obs, dim))
    y = 2.0 + X @ np.array([1.0, -0.5, 0.2, 0.0, 0.7]) + 0.5 * rng.normal(size=n_obs)
    with pm.Model():
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=500)
        a = pm.Normal("a", 0, 5)
        w = pm.Normal("w", 0, 2, shape=dim)
        sigma = pm.HalfNormal("sigma", 2)
        pm.Normal("y", a + X_mb @ w, sigma, observed=y_mb, total_size=n_obs)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            idata = pm.sample(
                draws=50, tune=tune, step=SGHMC(step_size=step_size, gradient_noise="estimate"),
                chains=1, random_seed=2, discard_tuned_samples=False, **SAMPLE_KWARGS,
            )  # fmt: skip
    messages = [str(w.message) for w in record if "positive semi-definite" in str(w.message)]
    kept_clipped = idata.sample_stats["noise_clipped"].values
    assert kept_clipped.all() if warned else not kept_clipped.any()
    if tune:
        assert idata.warmup_sample_stats["noise_clipped"].values.mean() > 0.3
    assert len(messages) == int(warned), messages
