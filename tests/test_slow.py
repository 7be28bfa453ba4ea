"""Long statistical tests (``make test-slow``): the samplers against NUTS on the same model."""

from __future__ import annotations

import arviz as az
import numpy as np
import pymc as pm
import pytest
from checks import Z_TOLERANCE
from models import censored_student_t, skewed_logistic

from pymc_sgmcmc import NOGIN, SGLD, SGNHT

pytestmark = pytest.mark.slow

#: The NUTS references run PyMC's own NUTS: ``pm.sample`` would run nutpie instead where it is
#: installed (the ``bench`` extra installs it), and the seeded references would change.
PYMC_NUTS = {"nuts_sampler": "pymc"}


def regression(batch_size: int | None, n_obs=2000, seed=0):
    """Regression with unknown noise scale; batch_size=None gives the full-data model."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_obs, 3))
    y = X @ [1.0, -2.0, 0.5] + 0.7 * rng.standard_normal(n_obs)
    with pm.Model() as model:
        if batch_size is None:
            X_obs, y_obs, total = X, y, None
        else:
            X_obs, y_obs = pm.Minibatch(X, y, batch_size=batch_size)
            total = n_obs
        w = pm.Normal("w", 0, 10, shape=3)
        sigma = pm.HalfNormal("sigma", 2)
        pm.Normal("y", X_obs @ w, sigma, observed=y_obs, total_size=total)
    return model


def moments(x: np.ndarray) -> tuple[float, float, float, float]:
    """Mean and variance of one quantity's draws (chain, draw), each with its standard error
    from ArviZ's effective sample size."""
    sq = (x - x.mean()) ** 2
    return (
        x.mean(),
        x.std() / np.sqrt(az.ess(x)),
        sq.mean(),
        sq.std() / np.sqrt(az.ess(sq, method="mean")),
    )


def summaries(idata):
    post = idata.posterior
    draws = {"w": post["w"].values, "sigma": post["sigma"].values[..., None]}
    return {
        f"{name}[{j}]": moments(x[..., j]) for name, x in draws.items() for j in range(x.shape[-1])
    }


@pytest.fixture(scope="module")
def nuts_reference():
    with regression(None):
        idata = pm.sample(4000, tune=1000, chains=2, random_seed=0, progressbar=False, **PYMC_NUTS)
    return summaries(idata)


@pytest.mark.parametrize(
    "factory",
    [
        lambda: SGNHT(step_size=3e-4, friction=10.0, thin=30),
        lambda: SGLD(step_size=2e-6, thin=20),
    ],
    ids=["SGNHT", "SGLD"],
)
def test_matches_nuts_on_the_same_model(nuts_reference, factory):
    # n = 1000 of N = 2000. SGLD's gradient-noise bias (eps tr Sigma / 4, relative) is a few
    # tenths of a percent. SGNHT's, from parameter-dependent noise that one thermostat cannot
    # absorb (the bias CCAdL removes), was measured at +1 to +5 % of the variances at h = 3e-4
    # (+3 to +8 % at h = 1e-3); ESS ~ 2,000 per run puts the combined error of a variance near
    # 4.5 %, so at this h the bias stays below the tolerance of 4 standard errors.
    with regression(1000):
        idata = pm.sample(
            10_000,
            tune=1000,
            step=factory(),
            chains=2,
            random_seed=1,
            progressbar=False,
            compute_convergence_checks=False,
        )
    ours = summaries(idata)
    for name, (m, se_m, v, se_v) in ours.items():
        m0, se_m0, v0, se_v0 = nuts_reference[name]
        assert abs(m - m0) < Z_TOLERANCE * np.hypot(se_m, se_m0), (name, m, m0, se_m, se_m0)
        assert abs(v - v0) < Z_TOLERANCE * np.hypot(se_v, se_v0), (name, v, v0, se_v, se_v0)


def nogin_run(batch_size, noise_covariance):
    from checks import posterior_draws
    from models import GaussianRegression

    problem = GaussianRegression.make(n_obs=2000, dim=3, batch_size=batch_size, seed=11)
    h = 0.5 * np.sqrt(np.linalg.eigvalsh(problem.cov).min())
    with problem.model():
        step = NOGIN(step_size=h, friction=1.0, noise_covariance=noise_covariance, thin=10)
        idata = pm.sample(
            8000,
            tune=1000,
            step=step,
            chains=2,
            random_seed=3,
            progressbar=False,
            compute_convergence_checks=False,
        )
    return problem, posterior_draws(idata, "w")


@pytest.mark.parametrize("batch_size", [20, 5])
def test_nogin_lemma2_down_to_tiny_batches(batch_size):
    # Lemma 2 with the exact Sigma at n = 20 and n = 5 (ESS of the variances ~850-3,400):
    # measured sd ratios 0.98-1.01 (n = 20) and 0.95-1.01 (n = 5).
    from checks import gaussian_check

    problem, draws = nogin_run(batch_size, "exact")
    check = gaussian_check(draws, problem.mean, problem.cov)
    assert check.passes(), check.describe()


def test_nogin_estimated_sigma_inflates_variance_as_batches_shrink():
    # With Sigma estimated from the minibatch the variance inflates as n shrinks (the sample
    # covariance's spread; measured sd ratios ~1.04 at n = 100 and ~1.39 at n = 20, the issue's
    # NumPy transcription gives 1.04 and 1.35). Asserted from the Monte Carlo error alone: each
    # inflation is > 4 se above 1 (ESS of the variances 3,000-13,000), and n = 20 inflates more
    # than n = 100 by > 4 combined se.
    from checks import gaussian_check

    checks = {}
    for n in (100, 20):
        problem, draws = nogin_run(n, "estimate")
        checks[n] = gaussian_check(draws, problem.mean, problem.cov)
    for check in checks.values():
        assert np.all(check.var_z > 1) and check.var_errors.min() > Z_TOLERANCE, check.describe()
    se = np.hypot(*(np.sqrt(2 / c.ess_var) * c.var_z for c in checks.values()))
    assert np.all(checks[20].var_z - checks[100].var_z > Z_TOLERANCE * se)


def mean_and_se(draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-coordinate means of (chains, draws, D) draws and their Monte Carlo standard errors."""
    flat = draws.reshape(-1, draws.shape[-1])
    return flat.mean(axis=0), flat.std(axis=0) / np.sqrt(az.ess(draws))


def test_papers_noise_estimate_shifts_the_mean_by_the_third_moment_unlike_independent_rows():
    # The papers' Sigma-hat comes from the force's own minibatch, so it is correlated with the
    # force's noise eta through the third moment of the per-observation gradients: the C step
    # after the kick h F removes (h^3 / 2) E[Sigma-hat eta] from p per step on average, and the
    # mean moves by -(h^2 / 2) C c3 (benchmarks/same_minibatch_bias.py; on P3 the observed
    # shift correlates 1.000 with this, slope 0.82-0.96 as h^2 lambda_max(Sigma) / 2 falls from
    # 0.53 to 0.09). The periodic average (a new estimate every 300 steps, weight 0.1) is
    # nearly uncorrelated with the force, and noise_minibatch="independent" not at all: both
    # must agree with NUTS on the full data within 4 combined standard errors per coordinate.
    # Here h^2 lambda_max(Sigma) / 2 = 0.34; ESS ~ 550 per coordinate in each chain (se of a
    # mean 0.04 sd), ~2,000 for NUTS. Measured: predicted shift 1.62 sd rms, observed 1.51,
    # correlation 1.000, slope 0.94; the periodic average 0.071 and independent rows 0.052 sd
    # rms from the Laplace mode.
    from pymc_sgmcmc import MCCAdL

    model, full_model, mode, cov, c3 = skewed_logistic()
    sd = np.sqrt(np.diag(cov))
    with full_model:
        nuts = pm.sample(1000, tune=1000, chains=2, random_seed=2, progressbar=False, **PYMC_NUTS)
    nuts_mean, nuts_se = mean_and_se(nuts.posterior["w"].values)
    h = 0.002
    predicted = -(h**2) / 2 * (cov @ c3) / sd
    means = {}
    for name, options in [
        ("papers", {}),
        ("periodic", {"averaging": 0.1, "averaging_interval": 300}),
        ("independent", {"noise_minibatch": "independent"}),
    ]:
        with model:
            idata = pm.sample(
                10_000, tune=0, step=MCCAdL(step_size=h, thin=10, **options), chains=1,
                random_seed=1, initvals={"w": mode}, progressbar=False,
                compute_convergence_checks=False,
            )  # fmt: skip
        means[name] = mean_and_se(idata.posterior["w"].values[:, 2000:])
    for unbiased in ("periodic", "independent"):
        mean, se = means[unbiased]
        z = (mean - nuts_mean) / np.hypot(se, nuts_se)
        assert np.all(np.abs(z) < Z_TOLERANCE), (unbiased, z)
    observed = (means["papers"][0] - means["periodic"][0]) / sd
    assert np.sqrt(np.mean(observed**2)) > 1.0, observed  # about 25 se: the bias is there
    assert np.corrcoef(observed, predicted)[0, 1] > 0.95, (observed, predicted)
    slope = observed @ predicted / (predicted @ predicted)
    # First order in h^2 Sigma: exact as h -> 0, an overestimate as the C step saturates.
    assert 0.7 < slope < 1.05, slope


def zero_inflated_poisson(batch_size: int | None, n_obs=3000, seed=0):
    """Counts with 30 % structural zeros; batch_size=None gives the full-data model."""
    rng = np.random.default_rng(seed)
    counts = np.where(rng.random(n_obs) < 0.3, 0, rng.poisson(3.0, n_obs)).astype(np.int32)
    with pm.Model() as model:
        psi = pm.Beta("psi", 1.0, 1.0)
        mu = pm.Gamma("mu", 2.0, 1.0)
        if batch_size is None:
            observed, total = counts, None
        else:
            observed, total = pm.Minibatch(counts, batch_size=batch_size), n_obs
        pm.ZeroInflatedPoisson("c", psi=psi, mu=mu, observed=observed, total_size=total)
    return model


@pytest.mark.parametrize("sampler", ["NOGIN", "MCCAdL"])
def test_covariance_samplers_match_nuts_on_a_zero_inflated_poisson(sampler):
    # The covariance samplers with their defaults (adapted step size) on a likelihood whose
    # per-observation gradients come from a mixture with a point mass (the one-row graph
    # rebuilds PyMC's mixture; before it did, the model was rejected as not splitting per
    # row). ESS relied on: about 600 per quantity for each sampler (1,000 draws of 2 chains
    # at the adapted thin), 3,900 for NUTS. Measured (2026-11-26): mean errors within 1.5 and
    # variances within 0.8 combined standard errors (0.01-0.05 posterior sd; variance ratios
    # 0.96-1.06). Tolerance: 4 combined standard errors per mean and variance.
    import pymc_sgmcmc

    with zero_inflated_poisson(None):
        nuts = pm.sample(2000, tune=1000, chains=2, random_seed=1, progressbar=False, **PYMC_NUTS)
    with zero_inflated_poisson(100):
        idata = pm.sample(
            step=getattr(pymc_sgmcmc, sampler)(),
            chains=2,
            random_seed=2,
            progressbar=False,
            compute_convergence_checks=False,
        )
    assert int(idata.sample_stats["diverging"].sum()) == 0
    for name in ("psi", "mu"):
        m, se_m, v, se_v = moments(idata.posterior[name].values)
        m0, se_m0, v0, se_v0 = moments(nuts.posterior[name].values)
        assert abs(m - m0) < Z_TOLERANCE * np.hypot(se_m, se_m0), (name, m, m0, se_m, se_m0)
        assert abs(v - v0) < Z_TOLERANCE * np.hypot(se_v, se_v0), (name, v, v0, se_v, se_v0)


def test_a_likelihood_without_a_second_derivative_matches_nuts():
    # SGNHT's defaults, their step size and preconditioner set from central differences of
    # the force. ESS relied on: about 300-500 per quantity (500 draws of 2 chains at the
    # adapted thin), 1,000+ for NUTS; tolerance 4 combined standard errors per mean and
    # variance.
    with censored_student_t(None):
        nuts = pm.sample(1000, tune=1000, chains=2, random_seed=1, progressbar=False, **PYMC_NUTS)
    with censored_student_t(250):
        idata = pm.sample(
            500, step=SGNHT(), chains=2, random_seed=2, progressbar=False,
            compute_convergence_checks=False,
        )  # fmt: skip
    assert int(idata.sample_stats["diverging"].sum()) == 0
    draws = {"nu": idata.posterior["nu"].values[..., None], "w": idata.posterior["w"].values}
    reference = {"nu": nuts.posterior["nu"].values[..., None], "w": nuts.posterior["w"].values}
    for name, x in draws.items():
        for j in range(x.shape[-1]):
            m, se_m, v, se_v = moments(x[..., j])
            m0, se_m0, v0, se_v0 = moments(reference[name][..., j])
            assert abs(m - m0) < Z_TOLERANCE * np.hypot(se_m, se_m0), (name, j, m, m0, se_m, se_m0)
            assert abs(v - v0) < Z_TOLERANCE * np.hypot(se_v, se_v0), (name, j, v, v0, se_v, se_v0)


#: Tolerance, in Monte Carlo standard errors, of each of the main example's 124 posterior
#: means (prior scale, weights) against NUTS: for exact samplers the largest of 124
#: independent |z| exceeds 4.6 in about 1 run in 2,000.
EXAMPLE_Z_TOLERANCE = 4.6
#: Band of the median, over the 124 coordinates, of the example's sd / NUTS's sd. Four runs
#: (two seeds, h = 3e-3 and 1.5e-3) gave 0.960-1.008, a spread of about 0.02: the band is 5
#: such spreads wide on each side, and a tenth narrower or wider is the benchmarks' accuracy
#: criterion (variances within 10 %) with room for the run-to-run spread.
EXAMPLE_SD_RATIO_BAND = (0.9, 1.1)


def test_the_main_example_matches_nuts():
    # `make example` (NOGIN on a9a: 2 chains x 2,000 draws of 50 steps, 20-30 s) against
    # nutpie on the full data (benchmarks/a9a_reference.py: low-rank mass matrix, committed
    # in benchmarks/references/a9a_nuts.npz; bulk ESS 1,367-4,102): every posterior mean
    # within EXAMPLE_Z_TOLERANCE of both runs' Monte Carlo errors (the example's bulk ESS
    # is 41-437 over the coordinates) and the sds' median ratio within
    # EXAMPLE_SD_RATIO_BAND. The sds are not tested one by one: their z-scores have heavier
    # tails than the means' at these ESS (a rerun with seed 7 drew one weight's sd 0.69
    # times NUTS's, z = -5.1 at ESS 179, with its mean 3.6 Monte Carlo errors off). SGNHT at
    # the example's settings, whose thermostat cannot follow this posterior's uneven
    # gradient noise, fails both: largest |z| 19.8, median sd ratio 0.43 (2026-12-05;
    # NOGIN: 2.31 and 0.96).
    from test_examples import load_example

    example = load_example("a9a_logistic_regression")
    idata, _, _ = example.sample(*example.training_rows())
    comparison = example.against_reference(idata)
    assert comparison is not None, f"no reference at {example.REFERENCE}"
    assert comparison["max_abs_z_mean"] < EXAMPLE_Z_TOLERANCE, comparison
    low, high = EXAMPLE_SD_RATIO_BAND
    assert low < comparison["sd_ratio_median"] < high, comparison


def test_the_main_examples_model_with_control_variates_and_adapted_kernel_matches_nuts():
    # The example's model with NOGIN(averaging=0.1, averaging_interval=300,
    # control_variates=True) and the step size, preconditioner and thin adapted (tune =
    # 1,000, 2 x 2,000 draws): 41 s, a bulk ESS of at least 490, the means' largest |z|
    # 2.70 (seed 7: 99 s, 362 and 3.13). A drifting coordinate's scale used to widen to
    # H_ii^(-1/2) at the window's last draw, and a rare one-hot level's weight far in its
    # rows' logistic tails (H_ii about 1e-24) got a scale of 9e11: seed 7 then ran one chain
    # at h = 1e-13 and drew a bulk ESS of 3, the means' largest |z| 10.9 and sds up to
    # 175,000 times NUTS's, with divergences. Same criteria as the example's test, and a
    # bulk ESS of at least 100 for every coordinate.
    from test_examples import load_example

    example = load_example("a9a_logistic_regression")
    idata, _, _ = example.sample_with_control_variates(*example.training_rows())
    assert int(idata.sample_stats["diverging"].sum()) == 0
    assert example.moments(example.coordinates(idata))["ess_bulk"].min() >= 100
    comparison = example.against_reference(idata)
    assert comparison is not None, f"no reference at {example.REFERENCE}"
    assert comparison["max_abs_z_mean"] < EXAMPLE_Z_TOLERANCE, comparison
    low, high = EXAMPLE_SD_RATIO_BAND
    assert low < comparison["sd_ratio_median"] < high, comparison
