"""The one-off functions' mode: Python's perform, with every elementwise op run by a ufunc."""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
from models import censored_student_t
from pytensor.compile.builders import OpFromGraph
from pytensor.graph.replace import vectorize_graph
from pytensor.graph.utils import MethodNotDefined
from pytensor.scalar import Cast
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.special import log_softmax, softmax, xlogy

from pymc_sgmcmc import model_layer
from pymc_sgmcmc.model_layer import Preconditioner, SGModel, _differenced_hessian_vector_product
from pymc_sgmcmc.python_mode import ONE_OFF_MODE, one_off_mode


def per_element_python_ops(fn) -> list[str]:
    """The elementwise ops of a compiled function that Python's perform runs one element at a
    time (``np.frompyfunc`` on the scalar op's ``impl``): those without a NumPy ufunc. Casts are
    run by ``astype``."""
    return [
        type(node.op.scalar_op).__name__
        for node in fn.maker.fgraph.apply_nodes
        if isinstance(node.op, Elemwise)
        and getattr(node.op.scalar_op, "nfunc_spec", None) is None
        and not isinstance(node.op.scalar_op, Cast)
    ]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_ops_without_ufuncs_are_rewritten_to_the_same_values(dtype):
    x = pt.vector("x", dtype=dtype)
    rows = pt.matrix("rows", dtype=dtype)
    outputs = [
        pt.softplus(x),
        pt.softplus(rows),
        pt.log1mexp(-pt.abs(x)),
        pt.clip(x, -1.0, 2.0),
        pt.second(rows, x),
        pt.tensor_copy(x),
    ]
    plain = pytensor.function([x, rows], outputs, mode="FAST_COMPILE")
    one_off = pytensor.function([x, rows], outputs, mode=ONE_OFF_MODE)
    assert per_element_python_ops(plain)  # what the rewrite is for
    assert per_element_python_ops(one_off) == []

    # Each branch of Softplus.impl and Log1mexp.impl (-37, 18, 33.3; -log 2), the overflow
    # range of exp, 0 itself and the non-finite values.
    values = [-800, -40, -37.5, -20, -0.7, -1e-8, 0, 1e-8, 0.3, 17.9, 18.1, 33, 40, 800]
    values = np.array([*values, np.inf, -np.inf, np.nan], dtype=dtype)
    matrix = np.stack([values, values[::-1], 2 * values])
    for expected, got in zip(plain(values, matrix), one_off(values, matrix), strict=True):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=4 * np.finfo(dtype).eps, equal_nan=True)


def test_ops_with_several_outputs_are_left_as_they_are():
    """The gradient of ``gammainc`` is an elementwise loop with several outputs."""
    x = pt.vector("x")
    gradient = pt.grad(pt.gammainc(x, 2.0).sum(), x)
    values = np.array([0.5, 1.0, 3.0])
    expected = pytensor.function([x], gradient, mode="FAST_COMPILE")(values)
    with pytensor.config.change_flags(on_opt_error="raise"):
        one_off = pytensor.function([x], gradient, mode=ONE_OFF_MODE)
    np.testing.assert_array_equal(one_off(values), expected)


def test_a_softplus_network_gets_its_one_off_functions_without_per_element_python():
    """A one-hidden-layer network (the DRBM example's softplus): the chain-start and check
    functions of the model layer run every elementwise op through NumPy, and agree with the
    numba-compiled graph."""
    rng = np.random.default_rng(3)
    X = rng.standard_normal((300, 4))
    y = (X[:, 0] - X[:, 1] > 0).astype("int32")
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=50)
        W = pm.Normal("W", 0, 1, shape=(4, 8))
        v = pm.Normal("v", 0, 1, shape=8)
        pm.Bernoulli("y", logit_p=pt.softplus(X_mb @ W) @ v, observed=y_mb, total_size=300)
        sg = SGModel(model, model.value_vars)
    sg.check_factorisation()
    hvp_fn, rows_fn = sg._geometry_functions
    assert per_element_python_ops(hvp_fn) == []
    assert per_element_python_ops(rows_fn) == []

    numba_rows = sg._function([sg.theta, *sg.indices], sg.per_observation_gradients)
    theta = 0.3 * rng.standard_normal(sg.dim)
    idx = rng.integers(0, 300, size=50)
    np.testing.assert_allclose(rows_fn(theta, idx), numba_rows(theta, idx), rtol=1e-9)


def inner_graph_ops(fn) -> list[str]:
    """The nodes of a compiled function that link an inner graph of their own (an
    ``OpFromGraph``, or a ``Blockwise`` of one that calls it row by row): PyTensor links those
    graphs with C thunks whatever the outer function's linker."""
    return [
        str(node.op)
        for node in fn.maker.fgraph.apply_nodes
        if isinstance(getattr(node.op, "core_op", node.op), OpFromGraph)
    ]


def test_inner_graphs_run_inline_in_python_and_row_by_row_ones_vectorised():
    """logsumexp, softmax, log_softmax and xlogy are ``OpFromGraph``s, vectorised over a
    matrix's rows as ``Blockwise``s of them (the per-observation gradients of a mixture or a
    softmax regression): in the one-off mode no such node is left, and the values are the
    compiled graph's."""
    x = pt.vector("x")
    rows = pt.matrix("rows")
    one_row = (
        pt.logsumexp(x)
        + log_softmax(x).sum()
        + xlogy(x, x).sum()
        + (softmax(x) ** 2).sum()
        + pt.logsumexp(softmax(x))  # one inside another
    )
    outputs = vectorize_graph([one_row, pt.grad(one_row, x)], {x: rows})
    plain = pytensor.function([rows], outputs, mode="FAST_COMPILE")
    one_off = pytensor.function([rows], outputs, mode=ONE_OFF_MODE)
    assert any("Blockwise" in op for op in inner_graph_ops(plain))  # what the rewrite is for
    assert inner_graph_ops(one_off) == []
    assert per_element_python_ops(one_off) == []

    values = np.random.default_rng(5).uniform(0.1, 3.0, size=(7, 4))
    compiled = pytensor.function([rows], outputs)
    for expected, got in zip(compiled(values), one_off(values), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-13)


def test_a_mixtures_one_off_functions_link_no_inner_graph():
    """A normal mixture's log-density is a logsumexp per row: the model layer's one-off
    functions (chain start, factorisation check, geometry) link no inner graph, so a first
    run with an empty compile directory compiles no C module for them."""
    y = np.concatenate([np.random.default_rng(6).normal(-2, 1, 100), np.full(200, 1.5)])
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 5, shape=2)
        observed = pm.Minibatch(y, batch_size=30)
        pm.NormalMixture("y", w=[0.3, 0.7], mu=mu, sigma=1.0, observed=observed, total_size=300)
        sg = SGModel(model, model.value_vars)
    sg.check_factorisation()
    for fn in [*sg._geometry_functions, sg._one_off_fixed_force]:
        assert inner_graph_ops(fn) == []
    _, rows_fn = sg._geometry_functions
    numba_rows = sg._function([sg.theta, *sg.indices], sg.per_observation_gradients)
    theta, idx = np.array([-1.5, 1.0]), np.arange(0, 300, 10)
    np.testing.assert_allclose(rows_fn(theta, idx), numba_rows(theta, idx), rtol=1e-9)


def test_a_loop_inside_an_inner_graph_is_seen():
    """An inner graph put inline brings its ``ScalarLoop`` into the outer function, so
    ``one_off_mode`` looks inside inner graphs too, vectorised ones included."""
    x = pt.vector("x")
    inner = OpFromGraph([x], [pt.grad(pt.gammainc(x, 2.0).sum(), x)])
    assert one_off_mode(inner(x)) is not ONE_OFF_MODE
    assert one_off_mode(vectorize_graph(inner(x), {x: pt.matrix("rows")})) is not ONE_OFF_MODE
    assert one_off_mode(pt.logsumexp(x)) is ONE_OFF_MODE


def test_a_graph_that_loops_per_element_is_compiled():
    """An elementwise ``ScalarLoop`` (the incomplete gamma / beta functions' gradients) would
    run every iteration for every element in Python: such one-off functions are compiled in
    the default mode, the others keep the Python mode."""
    x = pt.vector("x")
    assert one_off_mode(pt.grad(pt.gammainc(x, 2.0).sum(), x)) is not ONE_OFF_MODE
    assert one_off_mode([pt.softplus(x), pt.exp(x)]) is ONE_OFF_MODE


def test_a_likelihood_without_a_second_derivative_gets_its_curvature_by_differences(
    monkeypatch,
):
    """PyTensor cannot differentiate the gradient of the Student-t CDF in ``nu`` again (a
    ``ScalarLoop``): the curvature that sets the step size and the preconditioner then comes
    from central differences of the force. The functions run in Python here, on batches of
    4 rows, to keep numba's 20 s compilation of the loop out of the default run (the
    compiled mode's choice is the test above; ``make test-slow`` samples this model against
    NUTS)."""
    monkeypatch.setattr(model_layer, "one_off_mode", lambda outputs: ONE_OFF_MODE)
    with censored_student_t(batch_size=4, n_obs=400) as model:
        sg = SGModel(model, model.value_vars)
    with pytest.raises(MethodNotDefined):
        pt.grad(pt.dot(sg.force, pt.ones(sg.dim)), sg.theta)  # what the differences are for
    diagonal = sg.curvature_diagonal(sg.initial_theta, np.random.default_rng(0))
    assert np.all(np.isfinite(diagonal) & (diagonal > 0)), diagonal
    assert np.isfinite(
        sg.largest_curvature(
            sg.initial_theta, Preconditioner(np.ones(sg.dim)), np.random.default_rng(1)
        )
    )


def test_the_differenced_hessian_vector_product_matches_the_symbolic_one():
    rng = np.random.default_rng(4)
    X = rng.standard_normal((300, 3))
    y = rng.poisson(np.exp(X @ np.array([0.3, -0.2, 0.1])))
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y.astype("int32"), batch_size=30)
        w = pm.Normal("w", 0, 1, shape=3)
        pm.Poisson("y", pt.exp(X_mb @ w), observed=y_mb, total_size=300)
        sg = SGModel(model, model.value_vars)
    hvp_fn, _ = sg._geometry_functions
    force_fn = sg._function([sg.theta, *sg.indices], sg.force, ONE_OFF_MODE)
    step = np.finfo("float64").eps ** (1 / 3)
    theta, idx = rng.standard_normal(3), rng.integers(0, 300, size=30)
    for v in np.eye(3)[0], rng.standard_normal(3):
        exact = hvp_fn(theta, idx, v)
        differenced = _differenced_hessian_vector_product(force_fn, step, theta, idx, v)
        np.testing.assert_allclose(differenced, exact, rtol=1e-7, atol=1e-7 * np.abs(exact).max())
