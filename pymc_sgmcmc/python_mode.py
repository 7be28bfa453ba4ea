"""The compilation mode of functions run once or a few times per chain.

A chain start, the factorisation check, the geometry and step-size checks each run a helper
function a handful of times, so it is compiled in PyTensor's ``FAST_COMPILE`` mode: the graph is
not compiled to machine code and each node runs its Python ``perform``, in well under a second
where numba would compile it for seconds on a cold start.

In that mode an ``Elemwise`` whose scalar op has no NumPy ufunc (no ``nfunc_spec``) runs the
scalar op's Python ``impl`` once per element, through ``np.frompyfunc``: about 1 µs per element.
``pt.softplus``, the hidden layer of a neural network or an RBM, is one of them: on the DRBM
example's minibatch (1,000 rows x 100 hidden units x 26 classes) one call of the factorisation
check's function took 5.2 s, nearly all of it in ``Softplus.impl``, and 0.33 s once rewritten
(``docs/performance.md``, "The one-off functions"). The rewrite here, included only in
:data:`ONE_OFF_MODE`, writes those ops as compositions of ops that do have ufuncs, so that NumPy
runs each over the whole array.

A ``ScalarLoop`` (the series and continued fractions of PyTensor's incomplete beta and gamma
functions' gradients: a Student-t CDF's gradient in its ``nu``, as in
``pm.Censored(pm.StudentT.dist(nu=nu, ...))``) has no such form: its Python ``perform`` runs
every iteration of the loop for every element, and a chain start took minutes. Graphs that
hold one are compiled in the default mode instead (``one_off_mode``).

An op with an inner graph (PyTensor's ``OpFromGraph``: ``logsumexp``, ``softmax``,
``log_softmax``, ``xlogy`` and their derivatives) links that graph on its own, with PyTensor's
``vm`` linker, which makes C thunks wherever a C++ compiler is installed, whatever the outer
function's linker: with an empty compile directory every new op in it waited for ``g++``
(57 modules, 69 s of the NOGIN mixture example's first run). Another rewrite of
:data:`ONE_OFF_MODE`, run before the ufunc forms, puts such graphs inline, so that their nodes
run in Python too.
"""

from __future__ import annotations

import math

import pytensor.tensor as pt
from pytensor.compile import optdb
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.mode import Mode, get_default_mode, get_mode
from pytensor.compile.rewriting import inline_ofg_node
from pytensor.graph.basic import Apply, Variable
from pytensor.graph.replace import vectorize_graph
from pytensor.graph.rewriting.basic import dfs_rewriter, in2out, node_rewriter
from pytensor.graph.traversal import ancestors
from pytensor.scalar.basic import Clip, Composite, Identity, ScalarOp, Second
from pytensor.scalar.loop import ScalarLoop
from pytensor.scalar.math import Log1mexp, Softplus
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.extra_ops import broadcast_shape

__all__ = ["ONE_OFF_MODE", "has_scalar_loop", "one_off_mode"]

TAG = "sgmcmc_ufunc_elemwise"


def _softplus(x: Variable) -> Variable:
    # log(1 + e^x) = max(x, 0) + log1p(e^-|x|): exp never overflows, and log1p keeps e^x's
    # relative accuracy where x is very negative (Softplus.impl's own branches do the same).
    return pt.maximum(x, 0) + pt.log1p(pt.exp(-pt.abs(x)))


def _log1mexp(x: Variable) -> Variable:
    # log(1 - e^x) for x <= 0, Maechler's two branches (as Log1mexp.impl): log1p(-e^x) away
    # from 0, log(-expm1(x)) near it, each accurate where the other cancels.
    return pt.switch(x < -math.log(2.0), pt.log1p(-pt.exp(x)), pt.log(-pt.expm1(x)))


def _clip(x: Variable, low: Variable, high: Variable) -> Variable:
    return pt.minimum(pt.maximum(x, low), high)


def _second(x: Variable, y: Variable) -> Variable:
    # y broadcast to the shape of x and y together (only x's shape is used: ``fill``).
    return pt.alloc(y, *broadcast_shape(x, y))


_UFUNC_FORMS = {Softplus: _softplus, Log1mexp: _log1mexp, Clip: _clip, Second: _second}


@node_rewriter([Elemwise])
def ufunc_elemwise(fgraph, node: Apply) -> list[Variable] | None:
    """An ``Elemwise`` of a scalar op without a NumPy ufunc, rewritten as ops with ufuncs."""
    scalar_op = node.op.scalar_op
    if type(scalar_op) is Identity:
        (out,) = node.outputs
        return [node.inputs[0]] if node.inputs[0].type == out.type else None
    form = _UFUNC_FORMS.get(type(scalar_op))
    if form is None:  # any other op, multi-output ones (a ScalarLoop) included
        return None
    (out,) = node.outputs
    inputs = node.inputs
    if not isinstance(scalar_op, Second):
        # Computed in the output's float type, as the scalar op computes it.
        inputs = [pt.cast(i, out.dtype) for i in inputs]
    new = pt.cast(form(*inputs), out.dtype)
    return [out.type.filter_variable(new, allow_convert=True)]


# Just before the "py_only" rewrites (49.1), after the graph's canonical rewrites; included
# only where the tag is (``ONE_OFF_MODE``), so no other user of FAST_COMPILE is affected.
optdb.register("ufunc_elemwise", in2out(ufunc_elemwise), TAG, position=49.05)


@node_rewriter([OpFromGraph, Blockwise])
def inline_inner_graph(fgraph, node: Apply) -> list[Variable] | None:
    """An ``OpFromGraph`` replaced by its inner graph, whose nodes the outer function's linker
    then runs (PyTensor inlines only those built with ``inline=True``); one vectorised over
    rows (a ``Blockwise`` of it: the per-observation gradients) by its inner graph
    vectorised, which NumPy runs over all rows at once where ``Blockwise`` would call the
    inner function once per row."""
    if isinstance(node.op, OpFromGraph):
        return inline_ofg_node(node)
    if not isinstance(node.op.core_op, OpFromGraph):
        return None
    core = node.op.core_op.fgraph.unfreeze()
    rows = dict(zip(core.inputs, node.inputs, strict=True))
    batched = vectorize_graph(core.outputs, replace=rows)
    return [
        out.type.filter_variable(new, allow_convert=True)
        for out, new in zip(node.outputs, batched, strict=True)
    ]


# After every rewrite that can introduce one (the canonical rewrites recognise softmax and
# logsumexp), and before the ufunc forms, which then see the inner nodes too.
optdb.register("inline_inner_graphs", dfs_rewriter(inline_inner_graph), TAG, position=49.04)

#: Compilation mode of the functions run once or a few times per chain: ``FAST_COMPILE``
#: (no compilation to machine code) with every elementwise op run by a NumPy ufunc.
ONE_OFF_MODE = get_mode("FAST_COMPILE").including(TAG)


def _loops_per_element(scalar_op: ScalarOp) -> bool:
    if isinstance(scalar_op, ScalarLoop):
        return True
    if isinstance(scalar_op, Composite):
        return any(_loops_per_element(node.op) for node in scalar_op.fgraph.apply_nodes)
    return False


def one_off_mode(outputs: Variable | list[Variable]) -> Mode:
    """The mode of a one-off function of ``outputs``: :data:`ONE_OFF_MODE`, or PyTensor's
    default (compiled) mode where an elementwise op loops per element (a ``ScalarLoop``,
    see the module docstring). On a censored Student-t regression with a free ``nu``
    (N = 5,000, n = 250) SGNHT's first chain start had not finished after 10 minutes in
    Python; compiled, tuning and 100 draws took 63 s."""
    return get_default_mode() if has_scalar_loop(outputs) else ONE_OFF_MODE


def has_scalar_loop(outputs: Variable | list[Variable]) -> bool:
    """Whether the graphs of ``outputs`` hold an elementwise ``ScalarLoop`` (PyTensor's
    series and continued fractions for the derivatives of the incomplete beta and gamma
    functions in their shape parameters), inner graphs included: :data:`ONE_OFF_MODE` puts
    those inline."""
    outputs = outputs if isinstance(outputs, list | tuple) else [outputs]
    for var in ancestors(outputs):
        node = var.owner
        if node is None:
            continue
        if isinstance(node.op, Elemwise) and _loops_per_element(node.op.scalar_op):
            return True
        inner = getattr(node.op, "core_op", node.op)
        if isinstance(inner, OpFromGraph) and has_scalar_loop(list(inner.inner_outputs)):
            return True
    return False
