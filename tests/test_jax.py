"""Every sampler under PyTensor's JAX backend (``mode="JAX"``) draws the default backend's chain.

All randomness (minibatch indices, Gaussian noise) is drawn on the host in NumPy and passed to
the compiled block, so with the same ``random_seed`` the two backends run the same arithmetic
on the same inputs: the draws must agree to rounding (float64; float32 where the default
backend's covariance products sum float32 rows, :data:`FLOAT32_ROWS`), the sharpest check
that the JAX path (static block lengths with padded short blocks, fixed-count CG and Lanczos
loops) computes the same chain. Skipped when JAX is not installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
from models import GaussianRegression
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from python_backend import python_function

from pymc_sgmcmc import MSGLD, NOGIN, SGHMC, SGLD, SGNHT, CCAdL, MCCAdL
from pymc_sgmcmc import parallel as sg_parallel
from pymc_sgmcmc.model_layer import DenseCovariance, ModelError

pytest.importorskip("jax")

SAMPLE_KWARGS = dict(chains=1, progressbar=False, compute_convergence_checks=False)
#: Rounding only: the two compilers may order floating-point sums differently, and the
#: chains' dynamics amplify such differences a little over a few hundred steps.
TOLERANCE = 1e-10
#: The samplers whose low-rank covariance products read the per-observation gradients
#: rounded to float32 at their defaults (``krylov.SINGLE_PRECISION_ROWS``; mSGLD's always):
#: the default backend's kernels sum them in float32 (``gram_product``),
#: JAX's graph in float64, so each product differs by about 3e-7 relative and the draws by
#: up to 4.6e-8 (2026-12-02; the draws' sds are 0.03-0.5). The tolerance is 20 times that;
#: an error in the JAX path's algorithm moves the draws by a fraction of an sd.
FLOAT32_ROWS = {"MSGLD", "MCCAdL", "NOGIN", "NOGIN-independent", "MCCAdL-shrinkage"}
FLOAT32_ROWS_TOLERANCE = 1e-6


def small_model() -> pm.Model:
    return GaussianRegression.make(n_obs=200, dim=3, batch_size=20).model()


def sample_both(factory, **kwargs):
    """The same run with the default mode and with JAX: (default, jax) DataTrees."""
    results = []
    for mode in (None, "JAX"):
        with small_model(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # divergence warnings
            results.append(pm.sample(step=factory(mode), random_seed=5, **kwargs))
    return results


def assert_same_chain(
    default, jax, stats=("minibatch_logp", "step_size", "diverging"), tolerance=TOLERANCE
):
    np.testing.assert_allclose(
        jax.posterior["w"].values, default.posterior["w"].values, rtol=0, atol=tolerance
    )
    for name in stats:
        np.testing.assert_allclose(
            jax.sample_stats[name].values,
            default.sample_stats[name].values,
            rtol=tolerance,
            err_msg=name,
        )


# Options that reach the code JAX needs changed: NOGIN's CG (a loop with a stopping rule) and
# mCCAdL's Lanczos product (a loop of data-dependent length), the eigen-decompositions of
# mSGLD and SGHMC's B-hat, CCAdL's moving average; the noise-estimate options' carried
# average (NOGIN), its periodic update (mCCAdL, CCAdL), Sigma-hat from independent rows
# (NOGIN) and diagonal shrinkage (mCCAdL's Lanczos product).
SAMPLERS = {
    "SGLD": lambda **kw: SGLD(step_size=0.01, **kw),
    # mSGLD at 0.01 is at this model's stability edge (4 / lambda_max ~ 0.01) and diverges
    # after the first 4-draw preconditioner window with some random streams.
    "MSGLD": lambda **kw: MSGLD(step_size=0.005, **kw),
    "SGHMC": lambda **kw: SGHMC(step_size=0.01, gradient_noise="estimate", **kw),
    "SGNHT": lambda **kw: SGNHT(step_size=0.01, **kw),
    # The paper's estimate at every step; the default takes one every 10 steps, in a lazy
    # branch without a damping operator (CCAdL damps with the average itself).
    "CCAdL": lambda **kw: CCAdL(step_size=0.01, averaging_interval=1, **kw),
    "CCAdL-periodic-averaging": lambda **kw: CCAdL(step_size=0.01, **kw),
    "MCCAdL": lambda **kw: MCCAdL(step_size=0.01, **kw),
    "NOGIN": lambda **kw: NOGIN(step_size=0.01, solver="cg", **kw),
    "NOGIN-averaging": lambda **kw: NOGIN(step_size=0.01, averaging=0.2, **kw),
    # A lazy branch (the update) with an eigen-decomposition, every 7 steps across blocks.
    "MCCAdL-periodic-averaging": lambda **kw: MCCAdL(
        step_size=0.01, averaging=0.2, averaging_interval=7, **kw
    ),
    # Sigma-hat from rows of its own: a third index input drawn on the host.
    "NOGIN-independent": lambda **kw: NOGIN(
        step_size=0.01, solver="cg", noise_minibatch="independent", **kw
    ),
    "MCCAdL-shrinkage": lambda **kw: MCCAdL(
        step_size=0.01, noise_shrinkage=0.3, noise_shrinkage_target="diagonal", **kw
    ),
    # Control variates: the anchor and its exact force as kernel inputs, a second minibatch
    # gradient (and, for NOGIN, per-observation gradients) at the anchor.
    "SGLD-control": lambda **kw: SGLD(step_size=0.01, control_variates=True, **kw),
    "NOGIN-control": lambda **kw: NOGIN(step_size=0.01, control_variates=True, **kw),
}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_jax_draws_equal_the_default_backend(name):
    # block_steps = 50: the 30 tuning draws are one short block (padded under JAX, at the end
    # of tuning), the 70 draws a full block and a short last one.
    make = SAMPLERS[name]
    default, jax = sample_both(
        lambda mode: make(block_steps=50, mode=mode), tune=30, draws=70, **SAMPLE_KWARGS
    )
    assert not default.sample_stats["diverging"].values.any()
    assert_same_chain(
        default, jax, tolerance=FLOAT32_ROWS_TOLERANCE if name in FLOAT32_ROWS else TOLERANCE
    )


@pytest.mark.parametrize("name", ["SGLD", "MCCAdL", "NOGIN"])
def test_jax_runs_a_float32_model_in_float32(name):
    # The accelerator's natural type: the same chain as the default backend's float32 one, to
    # float32 rounding, and JAX's float64 switch left as PyTensor set it for this process.
    import jax

    make = SAMPLERS[name]
    results = []
    for mode in (None, "JAX"):
        problem = GaussianRegression.make(n_obs=200, dim=3, batch_size=20, dtype="float32")
        with problem.model(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = make(block_steps=50, mode=mode)
            results.append(pm.sample(step=step, random_seed=5, tune=30, draws=70, **SAMPLE_KWARGS))
    default, on_jax = (r.posterior["w"].values for r in results)
    assert default.dtype == on_jax.dtype == np.float32
    # JAX has no float64 here: nothing asks it for one (its reductions' float64 accumulators
    # and the stats' casts were truncated, with a warning at each block's first trace).
    assert not [w for w in caught if "float64" in str(w.message)], caught
    np.testing.assert_allclose(on_jax, default, rtol=0, atol=1e-5)
    assert jax.config.jax_enable_x64 == (pytensor.config.floatX == "float64")


def test_jax_samples_a_mixture_of_a_list_of_components_with_per_row_gradients():
    # pm.ZeroInflatedPoisson is a pm.Mixture of a list of two components: the per-row
    # gradients of their stacked log-densities split the stack again, per row, with sizes
    # that JAX could not read when it traced (``jax_compile.split_once_for_all_rows``); the
    # samplers that build those gradients (mSGLD, CCAdL, mCCAdL, NOGIN) failed there.
    rng = np.random.default_rng(1)
    n_obs = 300
    X = rng.standard_normal((n_obs, 2))
    counts = rng.poisson(np.exp(0.5 + X @ np.array([0.4, -0.3])))
    y = np.where(rng.random(n_obs) < 0.25, 0, counts).astype(np.int32)
    results = []
    for mode in (None, "JAX"):
        with pm.Model():
            X_mb, y_mb = pm.Minibatch(X, y, batch_size=30)
            w = pm.Normal("w", 0, 2, shape=2)
            mu = pm.math.exp(pm.Normal("a", 0, 2) + X_mb @ w)
            psi = pm.Beta("psi", 2, 2)
            pm.ZeroInflatedPoisson("y", psi=psi, mu=mu, observed=y_mb, total_size=n_obs)
            step = NOGIN(step_size=1e-3, block_steps=50, mode=mode)
            results.append(pm.sample(step=step, random_seed=5, tune=0, draws=60, **SAMPLE_KWARGS))
    assert_same_chain(*results, stats=("minibatch_logp", "diverging"))


def test_jax_rejects_a_force_it_cannot_compile_when_the_step_is_built():
    # The gradient of a censored Student-t's CDF in a free nu is a ScalarLoop, which PyTensor's
    # JAX backend does not implement: said when the step is built, not as a NotImplementedError
    # from the first block (from a worker process with cores > 1). The default backend
    # samples it (``test_slow.py``, against NUTS).
    rng = np.random.default_rng(0)
    y = np.maximum(rng.standard_t(5, 200), -1.0)
    with pm.Model():
        y_mb = pm.Minibatch(y, batch_size=20)
        nu = pm.Gamma("nu", 2, 0.2)
        t = pm.StudentT.dist(nu=nu, mu=pm.Normal("mu", 0, 1), sigma=1)
        pm.Censored("y", t, lower=-1.0, upper=None, observed=y_mb, total_size=200)
        with pytest.raises(ModelError, match=r"ScalarLoop.*Use the default backend"):
            SGLD(mode="JAX")


class _Cube(Op):
    """x ** 3, with no JAX implementation."""

    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = np.asarray(inputs[0] ** 3)

    def pullback(self, inputs, outputs, cotangents):
        return [3 * inputs[0] ** 2 * cotangents[0]]


def test_jax_says_which_op_it_cannot_compile_and_what_to_use_instead():
    # Any other op without a JAX implementation is found when the first block compiles:
    # PyTensor's NotImplementedError, from deep in its JAX conversion, becomes a ModelError
    # that names the op and the way out.
    rng = np.random.default_rng(0)
    x = rng.standard_normal(200)
    y = 0.5 * x + rng.standard_normal(200)
    with pm.Model():
        x_mb, y_mb = pm.Minibatch(x, y, batch_size=20)
        w = pm.Normal("w", 0, 1)
        pm.Normal("y", _Cube()(w) * x_mb, 1, observed=y_mb, total_size=200)
        step = SGLD(step_size=1e-3, mode="JAX")
        with pytest.raises(ModelError, match=r"_Cube.*use the default backend"):
            pm.sample(step=step, tune=0, draws=5, **SAMPLE_KWARGS)


_FLOAT32_PROCESS_RUN = """
import warnings
import jax, numpy as np, pymc as pm
from pymc_sgmcmc import SGLD
rng = np.random.default_rng(0)
X = rng.standard_normal((200, 2)).astype("float32")
y = (X @ np.array([1.0, -1.0]) + rng.standard_normal(200)).astype("float32")
with pm.Model(), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    X_mb, y_mb = pm.Minibatch(X, y, batch_size=20)
    w = pm.Normal("w", 0, 1, shape=2)
    pm.Normal("y", X_mb @ w, 1, observed=y_mb, total_size=200)
    idata = pm.sample(step=SGLD(step_size=1e-3, mode="JAX"), tune=0, draws=20, chains=1,
                      progressbar=False, compute_convergence_checks=False)
print(jax.config.jax_enable_x64, idata.posterior["w"].dtype,
      sum("float64" in str(w.message) for w in caught))
"""


def test_jax_in_a_float32_process_asks_for_no_float64():
    # PyTensor turns JAX's 64-bit types off in a float32 process: a float64 accumulator or
    # stat cast would be truncated, with a warning at each block's first trace.
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTENSOR_FLAGS": "floatX=float32"}
    out = subprocess.run(
        [sys.executable, "-c", _FLOAT32_PROCESS_RUN], env=env, check=True, capture_output=True
    )
    assert out.stdout.decode().split() == ["False", "float32", "0"], out.stderr.decode()[-2000:]


def test_jax_follows_the_adaptation_windows():
    # Adapted step size and thin: blocks end at every window boundary, thin changes with the
    # step size (one compiled block length per thin under JAX).
    default, jax = sample_both(
        lambda mode: SGNHT(block_steps=200, mode=mode), tune=150, draws=50, **SAMPLE_KWARGS
    )
    assert len(np.unique(default.sample_stats["thin"].values)) == 1  # fixed after tuning
    assert_same_chain(default, jax, stats=("minibatch_logp", "step_size", "thin", "thermostat"))


@pytest.mark.slow
def test_jax_runs_the_dense_preconditioner_of_a_correlated_posterior():
    # The regression on calendar years (intercept and slope correlated at -0.99998): the
    # preconditioner turns dense at the first slow window, a second block with the rotation as
    # an input, reading the data already on the device. Slow: two JAX compilations (~60 s).
    rng = np.random.default_rng(0)
    year = rng.integers(1990, 2021, 2000).astype(float)
    X = np.column_stack([np.ones_like(year), year])
    problem = GaussianRegression(X, X @ [-40.0, 0.025] + rng.standard_normal(2000), 1.0, 100, 200)
    results = []
    for mode in (None, "JAX"):
        with problem.model(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            step = NOGIN(mode=mode)
            results.append(pm.sample(50, tune=300, step=step, random_seed=5, **SAMPLE_KWARGS))
    default, jax = results
    assert default.sample_stats["dense_preconditioner"].all()
    assert_same_chain(default, jax, stats=("minibatch_logp", "step_size", "dense_preconditioner"))


def test_jax_divergence_restarts_identically():
    # eps = 0.5 diverges within a few steps: the chain restarts from its last sane draw and
    # runs the short blocks that follow a divergence (1, 2, 4, ... draws), padded under JAX.
    default, jax = sample_both(
        lambda mode: SGLD(step_size=0.5, block_steps=40, mode=mode),
        tune=0,
        draws=60,
        **SAMPLE_KWARGS,
    )
    diverging = default.sample_stats["diverging"].values
    assert diverging.sum() > 5
    assert_same_chain(default, jax)


def test_static_shapes_follow_the_mode():
    with small_model():
        assert SGLD(step_size=0.01, mode="JAX").static_shapes
        assert not SGLD(step_size=0.01).static_shapes


def test_a_jax_steps_parallel_chains_start_without_fork(monkeypatch):
    # pm.sample picks its start method from its own backend before it sees the step (fork on
    # Linux); forking a process in which JAX has started its threads can deadlock (with fork, a
    # cores=2 run after a cores=1 JAX run in the same process hung), so the workers of a
    # JAX step start with forkserver, and draw the sequential chains. The parallel run goes
    # first: with fork again it fails here rather than hangs, unless an earlier test of this
    # worker ran JAX.
    methods = []
    start = sg_parallel._BatchProcessAdapter.__init__

    def recording(self, *args, **kwargs):
        bound = inspect.signature(start).bind(self, *args, **kwargs)
        methods.append(bound.arguments["mp_ctx"].get_start_method())
        start(self, *args, **kwargs)

    monkeypatch.setattr(sg_parallel._BatchProcessAdapter, "__init__", recording)
    kwargs = dict(draws=20, tune=0, chains=2, random_seed=3, progressbar=False,
                  compute_convergence_checks=False)  # fmt: skip
    with small_model():
        parallel = pm.sample(step=SGLD(step_size=1e-3, mode="JAX"), cores=2, **kwargs)
        sequential = pm.sample(step=SGLD(step_size=1e-3, mode="JAX"), cores=1, **kwargs)
    assert methods == ["forkserver", "forkserver"]
    np.testing.assert_array_equal(parallel.posterior["w"], sequential.posterior["w"])


def test_expm_product_with_a_fixed_count_is_the_stopping_loops():
    # JAX runs a fixed number of Lanczos iterations: those after the stop change nothing (the
    # same result and count as the loop that stops), and a cap too low for the tolerance
    # gives NaN (a divergence for the sampler), never a silently truncated product.
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 6))
    sigma = DenseCovariance(pt.constant(a @ a.T), 6)
    v = pt.constant(rng.standard_normal(6))
    scale = pt.scalar("scale")
    free, free_count = sigma.expm_matvec(scale, v, "double", 64)
    fixed, fixed_count = sigma.expm_matvec(scale, v, "double", 64, fixed_count=True)
    short = sigma.expm_matvec(scale, v, "double", 2, fixed_count=True)[0]
    fn = python_function([scale], [free, free_count, fixed, fixed_count, short])
    free, free_count, fixed, fixed_count, short = fn(-0.3)
    assert 2 < free_count == fixed_count < 64
    # The padded tridiagonal matrix is decomposed as a whole: the same to rounding.
    np.testing.assert_allclose(fixed, free, rtol=1e-12, atol=1e-15)
    assert np.isnan(short).all()


def test_jax_blocks_read_their_data_on_the_device_and_see_set_data():
    # The data cross to the device once, not at every block (PyTensor passes a shared NumPy
    # array to the jitted function at each call), and a step sampled again after
    # pm.set_data reads the new data: both runs draw the default backend's chains.
    import jax

    rng = np.random.default_rng(0)
    X = rng.standard_normal((200, 3))
    y = X @ np.array([1.0, -1.0, 0.5]) + rng.standard_normal(200)
    runs = {}
    for mode in (None, "JAX"):
        with pm.Model():
            X_mb, y_mb = pm.Minibatch(pm.Data("X", X), pm.Data("y", y), batch_size=20)
            w = pm.Normal("w", 0.0, 10.0, shape=3)
            pm.Normal("obs", X_mb @ w, 1.0, observed=y_mb, total_size=200)
            step = SGLD(step_size=0.01, block_steps=50, mode=mode)
            kwargs = dict(step=step, random_seed=5, tune=0, draws=60, **SAMPLE_KWARGS)
            before = pm.sample(**kwargs)
            pm.set_data({"y": -y})
            runs[mode] = before, pm.sample(**kwargs)
        if mode == "JAX":
            # X and y, the distributions' numbers (model_layer.share_parameters) and the
            # likelihood's N/n factor (model_layer.SGModel._size_factor).
            copies = [c.get_value(borrow=True) for c in step._device_data.copies]
            numbers = len(step.sg_model.shared_parameters.parameters)
            assert len(copies) == 2 + numbers + 1
            assert all(isinstance(c, jax.Array) for c in copies)
    for default, on_jax in zip(runs[None], runs["JAX"], strict=True):
        assert_same_chain(default, on_jax)
    # The new data flip the posterior: the second chain is near minus the first.
    first, second = (r.posterior["w"].values[0, 30:].mean(0) for r in runs["JAX"])
    np.testing.assert_allclose(second, -first, atol=0.2)


@pytest.mark.parametrize(
    ("name", "kernel", "stat"),
    [("MCCAdL", "LowRankExpm", "expm_products"), ("NOGIN", "LowRankShiftedSolve", None)],
)
def test_jax_blocks_run_the_low_rank_kernels_which_stop_early(name, kernel, stat):
    # Under JAX the low-rank estimate's Krylov loops are the kernels' while loops (which
    # stop where the default backend's stop), not scans of all their iterations: the block
    # holds the kernel and no nested scan, and mCCAdL's product counts equal the default's.
    from pytensor.scan.op import Scan

    runs = []
    for mode in (None, "JAX"):
        with small_model():
            step = SAMPLERS[name](block_steps=50, mode=mode)
            runs.append(pm.sample(step=step, random_seed=5, tune=0, draws=50, **SAMPLE_KWARGS))
    outer = step._block_function()[0].maker.fgraph.apply_nodes
    (block_scan,) = [node.op for node in outer if isinstance(node.op, Scan)]
    inner = [node.op for node in block_scan.fgraph.apply_nodes]
    assert kernel in {type(op).__name__ for op in inner}
    assert not any(isinstance(op, Scan) for op in inner)
    assert_same_chain(*runs, tolerance=FLOAT32_ROWS_TOLERANCE)
    if stat:
        counts = [r.sample_stats[stat].values for r in runs]
        np.testing.assert_array_equal(counts[1], counts[0])
        assert counts[1].max() < 10


def test_jax_taylor_series_of_a_small_tridiagonal_exponential_is_exact_to_rounding():
    # The JAX Lanczos kernel's exp(-t T) e_1 for a short run: the Taylor series of the
    # shifted block, exact to rounding wherever its infinity norm is at most TAYLOR_RADIUS
    # times the substeps (the bound the kernel checks), against SciPy's expm; zero beyond
    # the block.
    from scipy.linalg import expm

    from pymc_sgmcmc.jax_compile import (
        SMALL_TRIDIAGONAL,
        TAYLOR_RADIUS,
        TAYLOR_SUBSTEPS,
        _expm_e1_taylor,
        _shifted_tridiagonal,
    )

    rng = np.random.default_rng(3)
    for count in (1, 3, SMALL_TRIDIAGONAL):
        alphas = np.zeros(SMALL_TRIDIAGONAL)
        couplings = np.zeros(SMALL_TRIDIAGONAL)
        alphas[:count] = 40.0 + rng.uniform(-1.0, 1.0, count)
        couplings[: count - 1] = rng.uniform(0.2, 1.0, count - 1)
        tridiagonal = np.diag(alphas) + np.diag(couplings[:-1], 1) + np.diag(couplings[:-1], -1)
        for target, substeps in [(0.05, 1)] + [(TAYLOR_RADIUS * s, s) for s in TAYLOR_SUBSTEPS]:
            _, norm = _shifted_tridiagonal(alphas, couplings, np.asarray(count), 1.0)
            t = target / float(norm) if count > 1 else 0.01
            series, norm = _shifted_tridiagonal(alphas, couplings, np.asarray(count), t)
            assert float(norm) <= TAYLOR_RADIUS * substeps * (1 + 1e-12)
            expected = expm(-t * tridiagonal[:count, :count])[:, 0]
            result = np.asarray(_expm_e1_taylor(*series, substeps))
            np.testing.assert_allclose(result[:count], expected, rtol=1e-14, atol=1e-16)
            assert not result[count:].any()


@pytest.mark.parametrize("column_map", ["scales", "dense preconditioner"])
def test_jax_low_rank_kernels_equal_the_numba_kernels(column_map):
    # The while loops step for step: the same products, counts, results (a run stopped
    # within 8 products, exp(-t T) e_1 from a Taylor series; one of more products, from the
    # eigen-decomposition) and NaN at a cap too low. The column map M is diag(s), or a
    # dense preconditioner's R S (near the identity here, so that the counts stay those of
    # the scales).
    from pymc_sgmcmc.gram_product import with_covariance_kernels
    from pymc_sgmcmc.jax_compile import SMALL_TRIDIAGONAL, for_jax
    from pymc_sgmcmc.krylov import LowRankExpm, LowRankShiftedSolve

    rng = np.random.default_rng(0)
    g = rng.standard_normal((40, 12))
    columns = rng.uniform(0.5, 2.0, 12)
    if column_map == "dense preconditioner":
        columns = (np.eye(12) + 0.05 * np.tril(rng.standard_normal((12, 12)))) * columns
    operator = [g, g.mean(0), columns, 0.1, rng.uniform(1.0, 2.0, 12)]
    v = rng.standard_normal(12)
    inputs = [pt.matrix(), pt.vector(), pt.tensor(shape=(None,) * columns.ndim)]
    inputs += [pt.scalar(), pt.vector(), pt.scalar()]
    vector = pt.vector()
    caps = (64, 4)
    outputs = []
    for cap in caps:  # both caps in one function: one compilation on each backend
        outputs += [
            *LowRankExpm("double", cap)(*inputs, vector),
            # At t = 0.05, 4 products and a shifted T of norm 1.1 (the Taylor series in 4
            # substeps); at t = 0.2, 7 products and one too wide for the series.
            *LowRankExpm("half", cap)(*inputs, vector),
        ]
    outputs += [
        LowRankShiftedSolve(1e-12, 200)(*inputs[:5], vector),
        # A loose tolerance on a well-conditioned system (a few iterations), which one
        # iteration more or less would miss by far.
        LowRankShiftedSolve(1e-3, 200)(*inputs[:4], 10.0 + inputs[4], vector),
    ]
    on_numba, on_jax = (
        pytensor.function([*inputs, vector], outputs, mode=prepare(mode))
        for prepare, mode in ((with_covariance_kernels, "NUMBA"), (for_jax, "JAX"))
    )
    counts = []
    for t in (0.001, 0.05, 0.2):
        expected, result = on_numba(*operator, t, v), on_jax(*operator, t, v)
        for i, cap in enumerate(caps):
            double, count, half, half_count = range(4 * i, 4 * i + 4)
            np.testing.assert_allclose(result[double], expected[double], rtol=0, atol=1e-14)
            assert result[count] == expected[count]
            assert result[half_count] == expected[half_count]
            np.testing.assert_allclose(result[half], expected[half], rtol=0, atol=1e-14)
            counts.append(int(result[count]))
            assert np.isnan(result[double]).all() == (cap == 4)
        np.testing.assert_allclose(result[-2], expected[-2], rtol=0, atol=1e-12)
        np.testing.assert_allclose(result[-1], expected[-1], rtol=0, atol=1e-14)
    assert min(counts) <= SMALL_TRIDIAGONAL < max(counts) < 64
