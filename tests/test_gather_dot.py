"""The fused minibatch products compute exactly what the gather and the product compute.

``GatherDot(X, idx, B)`` is ``X[idx] @ B``, ``GatherTDot(X, idx, R)`` is ``X[idx].T @ R``,
``GatherGLMProduct`` is ``X[idx].T @ f(X[idx] @ b, ...)`` and ``GatherGLMSum`` is
``sum(f(X[idx] @ b, ...))`` (NumPy's indexing rules included), the rewrites put them only
where that identity holds, and a sampler's chain is the same with and without them (up to the
order of a floating-point sum).
"""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import pytensor
import pytensor.scalar as ps
import pytensor.tensor as pt
import pytest
from checks import chain_from_the_mean, graph_nodes
from models import GaussianRegression
from pytensor.tensor.elemwise import DimShuffle
from pytensor.tensor.shape import Shape, Shape_i
from pytensor.tensor.subtensor import AdvancedSubtensor

import pymc_sgmcmc.base as base
from pymc_sgmcmc import MSGLD, SGHMC, SGLD, SGNHT, MCCAdL
from pymc_sgmcmc.gather_dot import (
    GatherDot,
    GatherGLMProduct,
    GatherGLMRows,
    GatherGLMSum,
    GatherTDot,
    with_gather_dot,
)

NUMBA = with_gather_dot(pytensor.compile.mode.get_mode("NUMBA"))
FUSED = GatherDot | GatherTDot | GatherGLMProduct | GatherGLMSum | GatherGLMRows


def gathers(fn) -> int:
    """Copies ``v[idx]`` of minibatch rows (of the data or of the observed values) left in a
    compiled function's outer graph."""
    return sum(isinstance(node.op, AdvancedSubtensor) for node in fn.maker.fgraph.apply_nodes)


def fused_ops(fn) -> set[str]:
    """Names of the fused ops in a compiled function, inner graphs (the scan's, the lazy
    log-density branch's) included."""

    nodes = graph_nodes(fn.maker.fgraph)
    return {type(node.op).__name__ for node in nodes if isinstance(node.op, FUSED)}


def reshaped_vectors(fn) -> list[str]:
    """The DimShuffles of a compiled function, inner graphs included, that turn a vector into
    a column or a row, or a column or a row into a vector: each one a numba function compiled
    at a cold start (0.1-0.5 s for those of a matrix)."""

    return [
        f"{node.op} of {node.inputs[0].type}"
        for node in graph_nodes(fn.maker.fgraph)
        if isinstance(node.op, DimShuffle)
        and {node.op.input_ndim, len(node.op.new_order)} == {1, 2}
    ]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("n, k", [(7, 1), (8, 3), (1, 2), (31, 1)])  # 31: rows prefetched
def test_fused_products_equal_gather_then_product(dtype, n, k):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((50, 9)).astype(dtype)
    idx = rng.integers(-50, 50, size=n)  # NumPy's negative indices count from the end
    B = rng.standard_normal((9, k)).astype(dtype)
    R = rng.standard_normal((n, k)).astype(dtype)
    x, b, r = (pt.matrix(dtype=dtype) for _ in range(3))
    i, v = pt.vector(dtype="int64"), pt.vector(dtype=dtype)
    # A vector b stands for the column b[:, None].
    outputs = [GatherDot()(x, i, b), GatherTDot()(x, i, r), GatherDot()(x, i, v)]
    tol = 1e-12 if dtype == "float64" else 1e-4
    for mode in ("NUMBA", "FAST_COMPILE"):  # the numba kernels and the NumPy perform
        fn = pytensor.function([x, i, b, r, v], outputs, mode=mode)
        dot, tdot, vector_dot = fn(X, idx, B, R, B[:, 0])
        assert dot.dtype == tdot.dtype == vector_dot.dtype == dtype
        np.testing.assert_allclose(dot, X[idx] @ B, rtol=tol, atol=tol)
        np.testing.assert_allclose(tdot, X[idx].T @ R, rtol=tol, atol=tol)
        np.testing.assert_allclose(vector_dot, X[idx] @ B[:, :1], rtol=tol, atol=tol)


def test_out_of_bounds_rows_raise():
    x, i, b = pt.matrix(), pt.vector(dtype="int64"), pt.matrix()
    fn = pytensor.function([x, i, b], GatherDot()(x, i, b), mode="NUMBA")
    with pytest.raises(IndexError):
        fn(np.ones((5, 2)), np.array([0, 5]), np.ones((2, 1)))
    with pytest.raises(IndexError):  # where the row was prefetched (skipped) first
        fn(np.ones((5, 2)), np.array([0] * 20 + [-6]), np.ones((2, 1)))


@pytest.mark.parametrize("mode", ["NUMBA", "FAST_COMPILE"])
def test_static_output_shape_is_checked(mode):
    """A product told its output shape (taken from the graph it replaces) checks it, as the
    SpecifyShape it stands in for would; operands that do not fit raise too."""
    x, i, b, r = pt.matrix(), pt.vector(dtype="int64"), pt.matrix(), pt.matrix()
    dot = pytensor.function([x, i, b], GatherDot((None, 1))(x, i, b), mode=mode)
    tdot = pytensor.function([x, i, r], GatherTDot((3, 1))(x, i, r), mode=mode)
    X, idx = np.ones((5, 3)), np.array([0, 4])
    np.testing.assert_allclose(dot(X, idx, np.ones((3, 1))), np.full((2, 1), 3.0))
    np.testing.assert_allclose(tdot(X, idx, np.ones((2, 1))), np.full((3, 1), 2.0))
    with pytest.raises(ValueError):
        dot(X, idx, np.ones((3, 2)))  # two columns where one was specified
    with pytest.raises(ValueError):
        tdot(np.ones((5, 4)), idx, np.ones((2, 1)))  # four rows out where three were
    with pytest.raises(ValueError):
        dot(X, idx, np.ones((4, 1)))  # B does not fit X's rows
    with pytest.raises(ValueError):
        tdot(X, idx, np.ones((3, 1)))  # R does not fit the minibatch
    v = pt.vector()
    vector_dot = pytensor.function([x, i, v], GatherDot((2, 1))(x, i, v), mode=mode)
    np.testing.assert_allclose(vector_dot(X, idx, np.ones(3)), np.full((2, 1), 3.0))
    with pytest.raises(ValueError):
        vector_dot(X, idx, np.ones(4))  # b does not fit X's columns
    with pytest.raises(ValueError):
        vector_dot(X, np.array([0, 4, 1]), np.ones(3))  # three rows out where two were
    with pytest.raises(TypeError):
        GatherTDot()(x, i, v)  # only GatherDot's operand may be a vector


def test_rewrite_replaces_the_products_of_a_minibatch_and_its_gradient():
    X = np.random.default_rng(1).standard_normal((40, 6))
    idx, w = pt.vector("idx", dtype="int64", shape=(10,)), pt.vector("w", shape=(6,))
    data = pytensor.shared(X)
    logp = -0.5 * pt.sum((data[idx] @ w) ** 2)
    outputs = [logp, pt.grad(logp, w)]
    fused = pytensor.function([idx, w], outputs, mode=NUMBA)
    plain = pytensor.function([idx, w], outputs, mode="NUMBA")
    assert fused_ops(fused) == {"GatherDot", "GatherTDot"}
    assert fused_ops(plain) == set()  # off unless a mode includes it
    # The gradient's SpecifyShape (X's shape is not static) is absorbed into the product.
    ops = {type(n.op).__name__ for n in fused.maker.fgraph.apply_nodes}
    assert "SpecifyShape" in {type(n.op).__name__ for n in plain.maker.fgraph.apply_nodes}
    assert "SpecifyShape" not in ops
    args = (np.arange(10) * 3, np.linspace(-1, 1, 6))
    for got, expected in zip(fused(*args), plain(*args), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-12)
    # Gathering along another axis is not the pattern; products with several columns stay
    # with BLAS.
    other = pytensor.function([idx, w], data.T[:, idx[:6]] @ w, mode=NUMBA)
    assert fused_ops(other) == set()
    W = pt.matrix("W", shape=(6, 3))
    assert fused_ops(pytensor.function([idx, W], data[idx] @ W, mode=NUMBA)) == set()


#: The fused ops of each sampler's block: the force in one pass (SGLD's gradient, or the
#: per-observation gradients and their sum that mCCAdL's covariance estimate needs), and the
#: minibatch log-density in another (a lazy branch).
FORCE_OPS = {
    SGLD: {"GatherGLMProduct", "GatherGLMSum"},
    MCCAdL: {"GatherGLMRows", "GatherGLMSum"},
}


DTYPES = ["float64", "float32", "float32 covariates"]


def fused_product_cases() -> list:
    """Every (sampler, control variates, dtype) case. The default run takes six that hold
    every pair of settings once (each sampler in each dtype, each sampler and each dtype with
    and without control variates); the other six, 170 s of the 360 with empty caches, are
    slow."""
    default = {
        (SGLD, False, "float64"), (SGLD, True, "float32"), (SGLD, False, "float32 covariates"),
        (MCCAdL, True, "float64"), (MCCAdL, False, "float32"), (MCCAdL, True, "float32 covariates"),
    }  # fmt: skip
    return [
        pytest.param(*case, marks=() if case in default else pytest.mark.slow)
        for case in itertools.product(FORCE_OPS, (False, True), DTYPES)
    ]


@pytest.mark.parametrize("sampler, control_variates, dtype", fused_product_cases())
def test_sampler_chain_is_the_same_with_and_without_the_fused_products(
    monkeypatch, dtype, control_variates, sampler
):
    """With control variates the force reads the minibatch's rows at the draw and at the
    anchor: the same single pass computes both (no separate product is left). Covariates
    stored in float32 in a float64 model are read as they are, in float64 arithmetic."""
    covariates = "float32" if dtype == "float32 covariates" else None
    dtype = "float64" if covariates else dtype
    problem = GaussianRegression.make(
        n_obs=500, dim=3, batch_size=50, dtype=dtype, covariates=covariates
    )
    make = partial(sampler, step_size=1e-4, thin=5, control_variates=control_variates)

    def draws():
        with problem.model():  # from the posterior mean: near the anchor, thermostat at rest
            step = make()
            idata = chain_from_the_mean(problem, step, draws=300, seed=3)
        return step, idata.posterior["w"].values[0]

    step, fused = draws()
    assert fused_ops(step._block_function()[0]) == FORCE_OPS[sampler]
    monkeypatch.setattr(base, "with_gather_dot", lambda mode: mode)
    step, plain = draws()
    assert fused_ops(step._block_function()[0]) == set()
    assert fused.dtype == plain.dtype == dtype
    # Rounding differences of the sums' order (posterior sd ~0.045), not amplified.
    np.testing.assert_allclose(fused, plain, rtol=0, atol=1e-9 if dtype == "float64" else 1e-4)


@pytest.mark.parametrize("sampler", [SGLD, SGNHT, SGHMC, MCCAdL])
def test_a_block_takes_its_vectors_as_they_are(sampler):
    """Each step's noise comes as D-vectors (a sequence per vector) and the fused force reads
    and returns the coefficient vector itself: no DimShuffle in the block turns a vector into
    a column or a row, or back. Before 2026-12-06 a Squeeze took the noise's row and another
    the gradient's column (0.3 and 0.5 s of numba compiling SGLD's cold first draw on P1),
    after an ExpandDims of the position. Left: the step sizes' column, outside the loop, and
    where the block writes each row's gradient (mCCAdL), the (1, 1) broadcast of the
    likelihood's N/n factor that scales the rows (outside the loop) and its Squeeze back
    for the force, which PyTensor's rewrites take out of the rows' sum after the loop's
    code that reads only its non-sequences was moved out (moving it out again after those
    rewrites made SGLD diverge on a regression with a free noise scale)."""
    problem = GaussianRegression.make(n_obs=500, dim=3, batch_size=50)
    with problem.model():
        step = sampler(step_size=1e-4)
    h_seq = pt.vector(shape=(step.compiled_length,))
    expected = [f"ExpandDims{{axis=1}} of {h_seq.type}"]
    if sampler is MCCAdL:
        expected.append(f"ExpandDims{{axis=0}} of {pt.vector(shape=(1,)).type}")
        expected.append(f"Squeeze{{axis=0}} of {pt.matrix(shape=(1, 1)).type}")
    assert sorted(reshaped_vectors(step._block_function()[0])) == sorted(expected)


@pytest.mark.parametrize("sampler", [MSGLD, MCCAdL])
def test_a_covariance_samplers_block_reads_no_shape(sampler):
    """The noise covariance's n and n / (n - 1) come into the block as inputs
    (``SGModel._batch_rows``), so another batch size is the same graph and nothing computes
    them from the rows' shape. Read from the shape they were 7-19 more functions for numba
    to compile at a cold start (the shape, its conversions to a float and back to a vector;
    mSGLD 140 against 121 on a D = 3 regression). The model and step are those of the test
    above, whose mCCAdL block this one reuses."""
    problem = GaussianRegression.make(n_obs=500, dim=3, batch_size=50)
    with problem.model():
        step = sampler(step_size=1e-4)
    nodes = graph_nodes(step._block_function()[0].maker.fgraph)
    assert [str(node.op) for node in nodes if isinstance(node.op, Shape | Shape_i)] == []
    count, correction = (v.get_value() for v in step.sg_model._batch_rows())
    np.testing.assert_array_equal([count, correction], [[50.0], [50.0 / 49.0]])


def glm_log_likelihoods(idx, w):
    """Minibatch log-likelihoods that read the data through X[idx] @ w, with data of ``w``'s
    type: a linear regression whose noise scale stays an input (a broadcast argument of f)
    and a logistic regression (f reads ``y[idx]``, an argument taken at the minibatch's
    rows)."""
    rng = np.random.default_rng(1)
    dtype = w.type.dtype
    data = pytensor.shared(rng.standard_normal((40, 6)).astype(dtype))
    y = pytensor.shared((rng.random(40) < 0.5).astype(dtype))
    sigma = pytensor.shared(np.array(0.7, dtype=dtype))
    z = data[idx] @ w
    linear = -0.5 * pt.sum(((y[idx] - z) / sigma) ** 2)
    logistic = pt.sum(y[idx] * z - pt.softplus(z))
    return [linear, logistic]


def glm_gradients(idx, w):
    """Gradients of minibatch log-likelihoods that read the data through X[idx] @ w
    (:func:`glm_log_likelihoods`): for the linear regression f has a (1, 1) column (the noise
    scale), for the logistic one f is a fused Composite of y[idx] and z."""
    return [pt.grad(logp, w) for logp in glm_log_likelihoods(idx, w)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("n", [10, 31, 3])  # 31: rows past the prefetch distance and a tail
def test_single_pass_product_equals_the_two_products(n, dtype):
    idx = pt.vector("idx", dtype="int64", shape=(n,))
    w = pt.vector("w", shape=(6,), dtype=dtype)
    args = (np.random.default_rng(2).integers(-40, 40, size=n), np.linspace(-1, 1, 6, dtype=dtype))
    tol = 1e-12 if dtype == "float64" else 1e-5  # float32 sums of a few rows
    for grad in glm_gradients(idx, w):
        fused = pytensor.function([idx, w], grad, mode=NUMBA)
        assert "GatherGLMProduct" in fused_ops(fused) and "GatherDot" not in fused_ops(fused)
        assert gathers(fused) == 0  # y[idx] is read in place too
        # It reads w and returns the gradient as vectors: no column made of either.
        assert reshaped_vectors(fused) == []
        plain = pytensor.function([idx, w], grad, mode="NUMBA")
        assert reshaped_vectors(plain) != []  # PyTensor's products: w[:, None], g[:, 0]
        assert fused(*args).dtype == dtype
        np.testing.assert_allclose(fused(*args), plain(*args), rtol=tol, atol=tol)
        # The NumPy perform of the same op (the graph the rewrite produced).
        python = pytensor.function(
            [idx, w], grad, mode=NUMBA.clone(linker="py", optimizer=NUMBA.optimizer)
        )
        assert "GatherGLMProduct" in fused_ops(python)
        np.testing.assert_allclose(python(*args), plain(*args), rtol=tol, atol=tol)


def two_positions(n: int, dtype: str):
    """Inputs (rows, position, anchor) of a minibatch of ``n`` rows of the 40 x 6 data, and
    values for them (negative rows among them)."""
    idx = pt.vector("idx", dtype="int64", shape=(n,))
    w, anchor = (pt.vector(name, shape=(6,), dtype=dtype) for name in ("w", "anchor"))
    rng = np.random.default_rng(2)
    args = (
        rng.integers(-40, 40, size=n),
        np.linspace(-1, 1, 6, dtype=dtype),
        rng.standard_normal(6).astype(dtype),
    )
    return (idx, w, anchor), args


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("n", [10, 31, 3])
def test_single_pass_of_two_positions_equals_the_four_products(n, dtype):
    """The control-variate difference g(w) - g(anchor) over the same rows: both gradients
    in one pass, each the same as the two products give."""
    (idx, w, anchor), args = two_positions(n, dtype)
    tol = 1e-12 if dtype == "float64" else 1e-5
    gradients = glm_gradients(idx, w)
    at_anchor = pytensor.graph.clone_replace(gradients, {w: anchor})  # the same data
    for difference in (g - g_anchor for g, g_anchor in zip(gradients, at_anchor, strict=True)):
        fused = pytensor.function([idx, w, anchor], difference, mode=NUMBA)
        assert fused_ops(fused) == {"GatherGLMProduct"}  # one op, no product left
        (node,) = [n for n in fused.maker.fgraph.apply_nodes if isinstance(n.op, FUSED)]
        assert len(node.op.z_positions) == 2 and len(node.outputs) == 2
        plain = pytensor.function([idx, w, anchor], difference, mode="NUMBA")
        assert fused(*args).dtype == dtype
        np.testing.assert_allclose(fused(*args), plain(*args), rtol=tol, atol=tol)
        python = pytensor.function(
            [idx, w, anchor], difference, mode=NUMBA.clone(linker="py", optimizer=NUMBA.optimizer)
        )
        assert fused_ops(python) == {"GatherGLMProduct"}
        np.testing.assert_allclose(python(*args), plain(*args), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("n", [10, 31, 3])
def test_single_pass_sum_equals_the_product_then_the_sum(n, dtype):
    idx = pt.vector("idx", dtype="int64", shape=(n,))
    w = pt.vector("w", shape=(6,), dtype=dtype)
    args = (np.random.default_rng(2).integers(-40, 40, size=n), np.linspace(-1, 1, 6, dtype=dtype))
    tol = 1e-12 if dtype == "float64" else 1e-5
    for logp in glm_log_likelihoods(idx, w):
        fused = pytensor.function([idx, w], logp, mode=NUMBA)
        assert fused_ops(fused) == {"GatherGLMSum"}  # no product, no copy of y[idx]
        assert reshaped_vectors(fused) == []  # w read as it is, not as a column
        plain = pytensor.function([idx, w], logp, mode="NUMBA")
        assert fused(*args).dtype == plain(*args).dtype == dtype
        np.testing.assert_allclose(fused(*args), plain(*args), rtol=tol, atol=tol)
        python = pytensor.function(
            [idx, w], logp, mode=NUMBA.clone(linker="py", optimizer=NUMBA.optimizer)
        )
        assert fused_ops(python) == {"GatherGLMSum"}
        np.testing.assert_allclose(python(*args), plain(*args), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["column", "vector"])
@pytest.mark.parametrize("mode", ["NUMBA", "FAST_COMPILE"])
def test_single_pass_sum_checks_shapes_and_rows(mode, kind):
    (b, B, misfit), x, i = coefficients(kind, 3), pt.matrix(), pt.vector(dtype="int64")
    column, scalar, gathered = pt.vector(), pt.vector(shape=(1,)), pt.vector()
    sa, sz, sc, sy = (ps.float64(name) for name in "azcy")
    f = ps.Composite([sa, sz, sc, sy], [sa - sz + sc * sy])  # f(a, z, c, y) = a - z + c y
    op = GatherGLMSum(f, 1, (False, False, True), "float64", "float64")
    fn = pytensor.function(
        [x, i, b, column, scalar, gathered], op(x, i, b, column, scalar, gathered), mode=mode
    )
    X, idx = np.arange(15.0).reshape(5, 3), np.array([0, 4, -1])
    a, c, y = np.array([2.0, 1.0, 5.0]), np.array([3.0]), np.arange(5.0) ** 2
    z = X[idx] @ B.reshape(3)
    np.testing.assert_allclose(fn(X, idx, B, a, c, y), np.sum(a - z + c * y[idx]))
    with pytest.raises(ValueError):
        fn(X, idx, B, np.ones(2), c, y)  # a vector that does not fit the minibatch
    with pytest.raises(ValueError):
        fn(X, idx, misfit, a, c, y)  # b does not fit X's columns
    with pytest.raises(IndexError):
        fn(X, np.array([0, 5, 1]), B, a, c, y)  # a row of X that is not there
    with pytest.raises(IndexError):
        fn(X, idx, B, a, c, y[:4])  # an observed value that is not there


def test_single_pass_only_where_nothing_else_reads_the_predictor():
    """With the log-density as an output, X[idx] @ w is needed on its own: the two products
    stay (the single pass would compute it twice)."""
    idx, w = pt.vector("idx", dtype="int64", shape=(10,)), pt.vector("w", shape=(6,))
    data = pytensor.shared(np.ones((40, 6)))
    logp = -0.5 * pt.sum((data[idx] @ w) ** 2)
    fn = pytensor.function([idx, w], [logp, pt.grad(logp, w)], mode=NUMBA)
    assert fused_ops(fn) == {"GatherDot", "GatherTDot"}


def coefficients(kind: str, d: int):
    """The coefficients b of a hand-made fused op: a one-column matrix (``"column"``) or the
    vector that ``fuse_gather_dots`` takes from ``b[:, None]`` (``"vector"``); its symbol, a
    value of ones for X's d columns, and a value that does not fit them."""
    if kind == "column":
        return pt.matrix(), np.ones((d, 1)), np.ones((d + 1, 1))
    return pt.vector(), np.ones(d), np.ones(d + 1)


@pytest.mark.parametrize("kind", ["column", "vector"])
@pytest.mark.parametrize("mode", ["NUMBA", "FAST_COMPILE"])
def test_single_pass_product_checks_shapes_and_rows(mode, kind):
    """With a vector b, the op told a vector output shape returns the gradient as a vector."""
    (b, B, misfit), x, i = coefficients(kind, 3), pt.matrix(), pt.vector(dtype="int64")
    column, scalar = pt.tensor(shape=(None, 1)), pt.tensor(shape=(1, 1))
    out_shape = (None, 1) if kind == "column" else (None,)
    op = GatherGLMProduct(ps.sub, (1,), out_shape)  # f(a, z) = a - z
    out = op(x, i, b, column) * 1.0 + op(x, i, b, scalar)
    assert out.type.ndim == len(out_shape)
    fn = pytensor.function([x, i, b, column, scalar], out, mode=mode)
    X, idx = np.arange(15.0).reshape(5, 3), np.array([0, 4, -1])
    a, c = np.full((3, 1), 2.0), np.full((1, 1), 3.0)
    z = X[idx] @ B.reshape(3, 1)
    expected = X[idx].T @ ((a - z) + (c - z))  # a column
    np.testing.assert_allclose(fn(X, idx, B, a, c), expected.reshape(B.shape))
    with pytest.raises(ValueError):
        fn(X, idx, B, np.ones((2, 1)), c)  # a column that does not fit the minibatch
    with pytest.raises(ValueError):
        fn(X, idx, misfit, a, c)  # b does not fit X's columns
    with pytest.raises(IndexError):
        fn(X, np.array([0, 5, 1]), B, a, c)


@pytest.mark.parametrize("mode", ["NUMBA", "FAST_COMPILE"])
def test_single_pass_of_two_predictors_checks_shapes_and_rows(mode):
    x, i, b, c = pt.matrix(), pt.vector(dtype="int64"), pt.matrix(), pt.matrix()
    column = pt.tensor(shape=(None, 1))
    sz, sa, sc = (ps.float64(name) for name in "zac")
    f = ps.Composite([sz, sa, sc], [sa - sz, sz * sc])  # f(z1, a, z2) = (a - z1, z1 z2)
    op = GatherGLMProduct(f, (0, 2), (None, 1))
    fn = pytensor.function([x, i, b, c, column], op(x, i, b, c, column), mode=mode)
    X, idx = np.arange(15.0).reshape(5, 3), np.array([0, 4, -1])
    B, C, a = np.ones((3, 1)), np.array([[1.0], [-1.0], [0.5]]), np.full((3, 1), 2.0)
    z1, z2 = X[idx] @ B, X[idx] @ C
    first, second = fn(X, idx, B, C, a)
    np.testing.assert_allclose(first, X[idx].T @ (a - z1))
    np.testing.assert_allclose(second, X[idx].T @ (z1 * z2))
    with pytest.raises(ValueError):
        fn(X, idx, B, C, np.ones((2, 1)))  # a column that does not fit the minibatch
    with pytest.raises(ValueError):
        fn(X, idx, B, np.ones((4, 1)), a)  # the second b does not fit X's columns
    with pytest.raises(IndexError):
        fn(X, np.array([0, 5, 1]), B, C, a)


def glm_rows(idx, w, anchor):
    """Per-observation gradients of minibatch likelihoods that read the data through
    X[idx] @ w, as the covariance samplers use them: rounded to float32 for the low-rank
    products, and summed over the rows for the force. A linear regression (the weights a
    separate ``Elemwise`` of the predictor and y[idx]), its control-variate difference
    g_i(w) - g_i(anchor) over the same rows (two predictors, one weight ``Elemwise`` of two
    outputs) and a logistic regression (the predictor read by the rows' ``Elemwise``
    itself)."""
    rng = np.random.default_rng(1)
    dtype = w.type.dtype
    data = pytensor.shared(rng.standard_normal((40, 6)).astype(dtype))
    y = pytensor.shared(rng.standard_normal(40).astype(dtype))

    def linear(w):
        return data[idx] * (y[idx] - data[idx] @ w)[:, None] * 20.0

    logistic = data[idx] * pt.sigmoid(data[idx] @ w)[:, None]
    return [linear(w), linear(w) - linear(anchor), logistic]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("n", [10, 31, 3])  # 31: rows past the prefetch distance and a tail
def test_rows_in_one_pass_equal_the_gather_and_the_elementwise_rows(n, dtype):
    """The rows and their sum from one read of each row, with no product or copy of the rows
    left, the same as PyTensor's predictor product and fused loop give."""
    (idx, w, anchor), args = two_positions(n, dtype)
    tol = 1e-12 if dtype == "float64" else 1e-5  # float32 sums of a few rows
    python_mode = NUMBA.clone(linker="py", optimizer=NUMBA.optimizer)
    for rows in glm_rows(idx, w, anchor):
        outputs = [rows.astype("float32"), rows.sum(axis=0)]
        compile_in = partial(pytensor.function, [idx, w, anchor], outputs, on_unused_input="ignore")
        fused, plain = compile_in(mode=NUMBA), compile_in(mode="NUMBA")
        python = compile_in(mode=python_mode)  # the NumPy perform of the same op
        assert fused_ops(fused) == fused_ops(python) == {"GatherGLMRows"}
        assert gathers(fused) == 0  # the rows and y are read in place, never copied
        assert reshaped_vectors(fused) == []  # w and the anchor read as they are
        expected = plain(*args)
        for got in (fused(*args), python(*args)):
            for value, reference in zip(got, expected, strict=True):
                assert value.dtype == reference.dtype
                np.testing.assert_allclose(value, reference, rtol=tol, atol=tol * 20)


@pytest.mark.parametrize("kind", ["column", "vector"])
@pytest.mark.parametrize("mode", ["NUMBA", "FAST_COMPILE"])
def test_rows_in_one_pass_check_shapes_and_rows(mode, kind):
    """A hand-made op: weights f(a, z) = a - z of a column a, rows h(x, w, c) = (x w + c,
    x w) of a (1, D) operand c, the second summed over the rows."""
    (b, B, misfit), x, i = coefficients(kind, 3), pt.matrix(), pt.vector(dtype="int64")
    column, row = pt.tensor(shape=(None, 1)), pt.tensor(shape=(1, None))
    sx, sw, sc = (ps.float64(name) for name in "xwc")
    h = ps.Composite([sx, sw, sc], [sx * sw + sc, sx * sw])
    op = GatherGLMRows(
        ps.sub,
        [("c", 0), ("z", 0)],
        h,
        [("x", 0), ("w", 0), ("c", 1)],
        [None, ("float64", "float64")],
    )
    fn = pytensor.function([x, i, b, column, row], op(x, i, b, column, row), mode=mode)
    X, idx = np.arange(15.0).reshape(5, 3), np.array([0, 4, -1, 2, 1])
    a, c = np.arange(5.0)[:, None], np.array([[1.0, -1.0, 0.5]])
    weighted = X[idx] * (a - X[idx] @ B.reshape(3, 1))
    rows, total = fn(X, idx, B, a, c)
    np.testing.assert_allclose(rows, weighted + c)
    np.testing.assert_allclose(total, weighted.sum(axis=0))
    with pytest.raises(ValueError):
        fn(X, idx, B, np.ones((2, 1)), c)  # a column that does not fit the minibatch
    with pytest.raises(ValueError):
        fn(X, idx, B, a, np.ones((1, 4)))  # a row that does not fit X's columns
    with pytest.raises(ValueError):
        fn(X, idx, misfit, a, c)  # b does not fit X's columns
    with pytest.raises(IndexError):
        fn(X, np.array([0, 5, 1, 2, 3]), B, a, c)  # a row of X that is not there


@pytest.mark.parametrize("mode", ["NUMBA", "FAST_COMPILE"])
def test_single_pass_ops_read_gathered_vectors_at_the_rows(mode):
    """A vector marked gathered stands for the column ``y[idx][:, None]``: both ops read it
    at the minibatch rows (negative rows counted from the end), at X's rows, so a vector of
    another length than X raises, as ``pm.Minibatch`` does for its arrays."""
    x, i, b, y = pt.matrix(), pt.vector(dtype="int64"), pt.matrix(), pt.vector()
    product = GatherGLMProduct(ps.sub, (1,), (None, 1), gathered=(True,))  # f(y, z) = y - z
    sx, sw = ps.float64("x"), ps.float64("w")
    rows = GatherGLMRows(
        ps.sub,
        [("c", 0), ("z", 0)],
        ps.Composite([sx, sw], [sx * sw, sx * sw]),
        [("x", 0), ("w", 0)],
        [None, ("float64", "float64")],
        gathered=(True,),
    )
    fn = pytensor.function([x, i, b, y], [product(x, i, b, y), *rows(x, i, b, y)], mode=mode)
    X, B, Y = np.arange(21.0).reshape(7, 3), np.ones((3, 1)), np.arange(7.0) ** 2
    for idx in (np.array([0, 6, -1, 2, 1]), np.array([3])):  # four rows and a tail; a tail
        weighted = X[idx] * (Y[idx][:, None] - X[idx] @ B)
        got_product, got_rows, got_sum = fn(X, idx, B, Y)
        np.testing.assert_allclose(got_product[:, 0], weighted.sum(axis=0))
        np.testing.assert_allclose(got_rows, weighted)
        np.testing.assert_allclose(got_sum, weighted.sum(axis=0))
    for other_length in (Y[:6], np.ones(8)):  # fewer or more observed values than rows
        with pytest.raises(ValueError, match="differ in length"):
            fn(X, np.array([0, 1, 2, 3, 4]), B, other_length)
    with pytest.raises(IndexError):
        fn(X, np.array([0, 1, 2, 3, 7]), B, Y)  # a row that is not there
    with pytest.raises(TypeError):
        product(x, i, b, pt.matrix())  # a gathered operand is a vector
    with pytest.raises(TypeError):
        rows(x, i, b, pt.matrix())


def test_rows_in_one_pass_only_where_nothing_else_reads_the_predictor():
    """With the predictor an output too, the product stays (the single pass would compute
    it twice), and PyTensor's own loop writes the rows."""
    idx, w = pt.vector("idx", dtype="int64", shape=(10,)), pt.vector("w", shape=(6,))
    data = pytensor.shared(np.ones((40, 6)))
    z = data[idx] @ w
    fn = pytensor.function([idx, w], [z, data[idx] * z[:, None]], mode=NUMBA)
    assert fused_ops(fn) == {"GatherDot"}
