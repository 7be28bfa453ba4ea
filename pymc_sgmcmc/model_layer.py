"""From a PyMC model to the graphs a stochastic-gradient integrator needs.

Everything that touches the user's model lives here; the integrators only see a flat
position vector ``theta`` (all continuous free variables, raveled, in the unconstrained value
space) and the minibatch index vectors. The module builds

* the noisy force ``F(theta) = grad log prior + (N/n) sum_{i in B} grad log p(x_i | theta)``
  (``ALGORITHMS.md``, Notation). PyMC's ``total_size`` wrapper carries the ``N/n`` factor as
  a constant; the layer derives the minibatch terms without it and applies the same factor
  exactly once, as an input of the graphs (``SGModel._size_factor``), so that a model on
  another number of rows reuses the compiled blocks;
* the per-observation gradients ``G`` (``n x D``, row ``i`` = the gradient of observation ``i``'s
  *scaled* term ``(N/n) log p(x_i | theta)``), obtained by vectorising the one-observation gradient
  over the batch with :func:`pytensor.graph.replace.vectorize_graph` rather than with
  ``jacobian`` (O(n^2 D) in general, see ``PLATFORM_NOTES.md``);
* the minibatch estimate of the model log-density at ``theta``.

``pm.Minibatch`` draws its indices with a random generator that ``pm.sample`` never reseeds
(``PLATFORM_NOTES.md``): every ``MinibatchOp`` is therefore replaced by ``data[index]`` with
``index`` an explicit input that the step method draws from its own per-chain generator. That
makes runs reproducible and gives every chain its own minibatch stream.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cached_property, partial
from typing import NamedTuple

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
from pymc.data import MinibatchOp
from pymc.distributions.distribution import SymbolicRandomVariable
from pymc.distributions.timeseries import RandomWalkRV
from pymc.distributions.truncated import Truncated, TruncatedRV
from pymc.logprob.basic import transformed_conditional_logp
from pymc.logprob.utils import CheckParameterValue, replace_rvs_by_values
from pymc.variational.minibatch_rv import MinibatchRandomVariable
from pytensor.compile.builders import SymbolicOp
from pytensor.compile.ops import ViewOp
from pytensor.compile.rebuild import rebuild_collect_shared
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.gradient import NullTypeGradError
from pytensor.graph.basic import Apply, Constant, Variable
from pytensor.graph.replace import clone_replace, vectorize_graph
from pytensor.graph.traversal import ancestors, graph_inputs, toposort
from pytensor.graph.utils import MethodNotDefined
from pytensor.scalar import (
    Abs,
    Exp,
    Mul,
    Softplus,
    Sqr,
    Sqrt,
    get_scalar_type,
    upcast,
    upgrade_to_float,
)
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.math import variadic_add
from pytensor.tensor.random.basic import NormalRV
from pytensor.tensor.random.op import RandomVariable
from pytensor.tensor.subtensor import AdvancedSubtensor, Subtensor
from pytensor.tensor.type import float_dtypes, integer_dtypes
from pytensor.tensor.type_other import NoneTypeT
from pytensor.tensor.variable import TensorVariable

from pymc_sgmcmc.gram_product import CentredGramProduct
from pymc_sgmcmc.krylov import (
    LowRankExpm,
    LowRankShiftedSolve,
    conjugate_gradients,
    lanczos_expm,
    on_finite,
    reads_single_precision_rows,
)
from pymc_sgmcmc.numba_compile import deterministic_fastmath
from pymc_sgmcmc.python_mode import one_off_mode
from pymc_sgmcmc.rewrite_cache import caching_rewrites

__all__ = [
    "ControlVariate",
    "Covariance",
    "DenseCovariance",
    "DiagonalCovariance",
    "MinibatchSource",
    "ModelError",
    "NoiseCovariance",
    "PreconditionedTarget",
    "Preconditioner",
    "SGModel",
    "ShrunkCovariance",
    "ledoit_wolf_statistics",
    "non_centred_products",
]

#: Ops that reshape or index a variable without computing with it (for
#: :func:`non_centred_products`), and the ``ViewOp`` of a ``pm.Deterministic``.
_SHAPING_OPS = (DimShuffle, Subtensor, AdvancedSubtensor, ViewOp)
#: The positive functions by which a model may compute a scale from a free variable
#: (``tau = exp(log_tau)``), which :func:`non_centred_products` looks through.
_SCALE_FUNCTIONS = (Exp, Softplus, Sqrt, Sqr, Abs)


def building_graphs(dtype: str) -> AbstractContextManager:
    """PyTensor's settings for building and compiling a step's graphs: ``floatX`` set to the
    model's float type (new inputs, and constants from Python numbers, take that type, so a
    float32 model runs in float32 throughout), and no creation trace on each new variable
    (``traceback__limit = 0``).

    PyTensor records each variable's creation as eight frames of source lines. Those frames
    point into this package and PyMC, not the user's model, and recording them was a fifth of
    a step's construction (40-65 ms on P1-P3) and 0.1 s of SGLD's warm first draw on P1
    (2026-12-07). The model's own variables keep their traces."""
    return pytensor.config.change_flags(floatX=dtype, traceback__limit=0)


class ModelError(ValueError):
    """The model cannot be sampled with stochastic gradients as written."""


@dataclass(frozen=True, eq=False)
class MinibatchSource:
    """One ``pm.Minibatch(...)`` call: the full data arrays it slices and its sizes."""

    node: Apply
    data_names: tuple[str, ...]
    total_size: int
    batch_size: int

    @property
    def data(self) -> list[Variable]:
        # The MinibatchOp's inputs are the full data tensors followed by its generator.
        return list(self.node.inputs[:-1])

    @cached_property
    def shared_data(self) -> list[Variable]:
        """The data as shared variables (constants would be baked into compiled code, which
        makes numba's compile slower and its on-disk cache unusable) that borrow the
        constants' arrays (a copy doubled the memory of a large data set), with the static width
        of a row. The per-observation gradients are a one-row graph vectorised over the batch;
        its gradient keeps each row's shape with ``SpecifyShape``, which stays in the graph
        unless the width is known and then stops PyTensor's fused loops from reading
        ``X[idx]`` in place: with the width, CCAdL's step on the D = 100 linear regression
        fell from 40.3 to 31.2 us and mSGLD's from 52.3 to 44.6 (SGLD's: 21.4), on the D = 50
        logistic regression from 47.7 to 35.7 and 53.1 to 42.4 us."""
        return [
            pytensor.shared(
                d.data, name=f"minibatch_data_{i}", shape=(None, *d.data.shape[1:]), borrow=True
            )
            if isinstance(d, Constant)
            else _with_static_rows(d)
            for i, d in enumerate(self.data)
        ]

    @property
    def outputs(self) -> list[Variable]:
        # Its outputs are the sliced tensors followed by the generator update.
        return list(self.node.outputs[:-1])


def _with_static_rows(data: Variable) -> Variable:
    """A user's shared data array (``pm.Data``) with the static width of its rows, by
    ``SpecifyShape`` (see :attr:`MinibatchSource.shared_data`): the number of rows may
    still change with ``pm.set_data``, the width cannot without changing the model."""
    if not isinstance(data, SharedVariable) or data.type.ndim < 2:
        return data
    width = data.get_value(borrow=True).shape[1:]
    if data.type.shape[1:] == width:
        return data
    return pt.specify_shape(data, (None, *width))


def _describe(var: Variable) -> str:
    if var.name:
        return f"'{var.name}'"
    if isinstance(var, Constant):
        return f"a constant array of shape {var.data.shape}"
    return str(var)


def _minibatch_nodes(graphs: Sequence[Variable]) -> list[Apply]:
    nodes = []
    for var in ancestors(graphs):
        node = var.owner
        if node is not None and isinstance(node.op, MinibatchOp) and node not in nodes:
            nodes.append(node)
    return nodes


def _leading_length(var: Variable) -> int:
    static = var.type.shape[0] if var.type.ndim else None
    if static is not None:
        return int(static)
    return int(var.shape[0].eval())


def _check_finite_rows(data: Variable, name: str) -> None:
    """Reject minibatch data with NaN or Inf entries: every batch that draws such a row has a
    non-finite force, which the sampler could only report as divergences, never as bad data."""
    if isinstance(data, Constant):
        values = data.data
    elif isinstance(data, SharedVariable):
        values = data.get_value(borrow=True)
    else:  # a graph computed from other variables: nothing to read before sampling
        return
    values = np.asarray(values)
    if not np.issubdtype(values.dtype, np.floating) or values.ndim == 0:
        return
    bad = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    if bad.any():
        rows = np.flatnonzero(bad)
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        raise ModelError(
            f"pm.Minibatch data {name} hold NaN or Inf values in {len(rows)} of its "
            f"{len(values)} rows (rows {shown}). Every minibatch that draws such a row has a "
            "non-finite gradient: drop or impute those rows before building the model."
        )


def _find_sources(model: pm.Model) -> list[MinibatchSource]:
    graphs = [*model.observed_RVs, *model.rvs_to_values.values(), *model.potentials]
    sources = []
    for node in _minibatch_nodes(graphs):
        data = node.inputs[:-1]
        total = _leading_length(data[0])
        batch = node.outputs[0].type.shape[0]
        if batch is None:  # pragma: no cover - pm.Minibatch always has a static batch size
            raise ModelError("a pm.Minibatch output has no static batch size")
        names = tuple(_describe(v) for v in data)
        if batch > total:
            raise ModelError(
                f"pm.Minibatch over {', '.join(names)} has batch_size={batch} but the data have "
                f"only N={total} rows: choose batch_size <= {total} (or drop pm.Minibatch to use "
                "full-batch gradients)."
            )
        for array, name in zip(data, names, strict=True):
            _check_finite_rows(array, name)
        sources.append(MinibatchSource(node, names, total, int(batch)))
    sizes = {s.batch_size for s in sources}
    if len(sizes) > 1:
        detail = "; ".join(f"{', '.join(s.data_names)}: {s.batch_size}" for s in sources)
        raise ModelError(
            "the model reads several pm.Minibatch calls with different batch sizes "
            f"({detail}). Per-observation gradients pair row i of every batch, so all "
            "pm.Minibatch calls must use the same batch_size."
        )
    return sources


def _check_free_variables(model: pm.Model, value_vars: Sequence[Variable]) -> None:
    for rv in model.free_RVs:
        value = model.rvs_to_values[rv]
        if value.type.dtype.startswith(("int", "uint", "bool")):
            raise ModelError(
                f"free variable '{rv.name}' is discrete ({value.type.dtype}); stochastic-gradient "
                "samplers need continuous variables. Marginalise it out (e.g. with "
                "pymc_extras.marginalize) or reparametrise it as a continuous variable."
            )
    missing = [model.values_to_rvs[v].name for v in model.value_vars if v not in value_vars]
    if missing:
        raise ModelError(
            f"the step must update every free variable together, but {missing} were left out. "
            "Pass no `vars` (the default) to sample all of them."
        )


def non_centred_products(model: pm.Model) -> list[tuple[str, str]]:
    """(z, tau) pairs where the model multiplies a free variable ``z`` of one or more
    dimensions with a zero-location Normal prior by another free variable ``tau``, or by a
    positive function of one (``exp(log_tau)``, as the pair's second entry names it): the
    non-centred form ``a = mu + tau * z`` of a hierarchical model, for the warnings of a
    chain that drifts or relaxes slowly (its groups' rows pin each ``a`` down, so that
    changing ``tau`` moves every ``z`` together, along a curved surface no preconditioner
    follows). Looks through reshapes and indexing on either side."""
    free = set(model.free_RVs)

    def zero_location_normal(rv: Variable) -> bool:
        if not isinstance(rv.owner.op, NormalRV) or rv.ndim == 0:
            return False
        try:
            return pt.get_underlying_scalar_constant_value(rv.owner.inputs[2]) == 0
        except NotScalarConstantError:
            return False

    standard = {rv for rv in free if zero_location_normal(rv)}

    def unshaped(var: Variable) -> Variable:
        while var.owner is not None and isinstance(var.owner.op, _SHAPING_OPS):
            var = var.owner.inputs[0]
        return var

    def scale_name(var: Variable) -> str | None:
        """The free variable ``var`` is, or the positive function of one it computes."""
        var = unshaped(var)
        if var in free:
            return var.name
        node = var.owner
        if node is not None and isinstance(node.op, Elemwise):
            if isinstance(node.op.scalar_op, _SCALE_FUNCTIONS) and len(node.inputs) == 1:
                inner = scale_name(node.inputs[0])
                name = type(node.op.scalar_op).__name__.lower()
                return None if inner is None else f"{name}({inner})"
        return None

    pairs = []
    graphs = [*model.observed_RVs, *model.deterministics, *model.potentials]
    for node in toposort(graphs):
        if not (isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, Mul)):
            continue
        for i, factor in enumerate(node.inputs):
            z = unshaped(factor)
            if z not in standard:
                continue
            others = (v for j, v in enumerate(node.inputs) if j != i and unshaped(v) is not z)
            scales = (scale_name(other) for other in others)
            pairs += [(z.name, tau) for tau in scales if tau is not None]
    return list(dict.fromkeys(pairs))


def _minibatch_deterministic_fix(rv: Variable, model: pm.Model) -> str:
    """The fix for a ``pm.Deterministic`` that reads minibatch data (a free variable cannot
    be fixed so): PyMC's ordered likelihoods add one by default."""
    if rv not in model.deterministics:
        return ""
    # They return a pm.Categorical: only the name tells.
    made_by = [obs.name for obs in model.observed_RVs if rv.name == f"{obs.name}_probs"]
    if made_by:
        return (
            f" pm.OrderedLogistic and pm.OrderedProbit add it for '{made_by[0]}' unless given "
            "compute_p=False: pass compute_p=False."
        )
    return (
        " Drop the pm.Deterministic from the sampling model and compute it after sampling, on "
        "the model built on the full data (pm.sample_posterior_predictive(idata, "
        f"var_names=['{rv.name}']))."
    )


def _check_observed(model: pm.Model, obs, sources: list[MinibatchSource]) -> MinibatchSource | None:
    """Return the minibatch source observed variable ``obs`` reads, or None for full data."""
    value = model.rvs_to_values[obs]
    nodes = _minibatch_nodes([obs, value])
    if not nodes:
        return None
    if len(nodes) > 1:
        raise ModelError(
            f"observed variable '{obs.name}' reads data from {len(nodes)} separate pm.Minibatch "
            "calls. Each call draws its own row indices, so the rows no longer match (x_i paired "
            "with some other y_j). Slice them together: `X_mb, y_mb = pm.Minibatch(X, y, "
            "batch_size=n)`."
        )
    source = next(s for s in sources if s.node is nodes[0])
    if not isinstance(obs.owner.op, MinibatchRandomVariable):
        raise ModelError(
            f"observed variable '{obs.name}' reads pm.Minibatch data but has no total_size, so "
            "its log-likelihood would not be scaled up to the full data set. Pass "
            f"total_size={source.total_size} to '{obs.name}'."
        )
    total = obs.owner.inputs[1]
    if not isinstance(total, Constant) or int(total.data) != source.total_size:
        raise ModelError(
            f"observed variable '{obs.name}' has total_size={total} along its first axis, but the "
            f"data it reads through pm.Minibatch have N={source.total_size} rows. Pass "
            f"total_size={source.total_size}."
        )
    if any(not (isinstance(t, Constant) and t.data is None) for t in obs.owner.inputs[2:]):
        raise ModelError(
            f"observed variable '{obs.name}' sets total_size along more than its first axis; "
            "only the observation (first) axis can be minibatched."
        )
    _check_data_sliced_with_parameters(obs, value)
    _check_rows_follow_batch(model, obs, source.batch_size)
    return source


def _check_data_sliced_with_parameters(obs, value: Variable) -> None:
    """Observed data that do not come from the pm.Minibatch call its parameters read (only
    X passed through it, y given whole) would pair batch row i with row i of the whole
    array. A scalar (or a length-1 axis) broadcast over the rows is the same for every row."""
    if _minibatch_nodes([value]) or value.type.ndim == 0 or value.type.shape[0] == 1:
        return
    described = f" (shape {value.data.shape})" if isinstance(value, Constant) else ""
    raise ModelError(
        f"observed variable '{obs.name}' reads pm.Minibatch data through its parameters, but "
        f"its observed data{described} are not from that pm.Minibatch call, so row i of the "
        "batch would be paired with row i of the whole array. Slice them together, "
        f"`X_mb, y_mb = pm.Minibatch(X, y, batch_size=n)`, and pass observed=y_mb to "
        f"'{obs.name}'."
    )


def _size_input(node: Apply) -> Variable | None:
    """The ``size`` input of a random variable's node, or None where it fixes no length: none
    given (PyMC sets it from the observed data's shape when neither ``shape`` nor ``dims``
    is), or an empty one (a multivariate variable whose core axis holds the whole batch)."""
    op = node.op
    if isinstance(op, TruncatedRV):
        # Its inputs are the base distribution's, then the bounds; a truncated Poisson
        # (rejection sampling) has no extended_signature for size_param to read.
        return _size_input(op.base_rv_op.make_node(*node.inputs[:-2]))
    if hasattr(op, "size_param"):
        size = op.size_param(node)
    elif getattr(op, "extended_signature", None) is not None:
        (_, index, _), _ = op.get_input_output_type_idxs(op.extended_signature)
        size = None if index is None else node.inputs[index]
    else:
        return None
    if size is None or isinstance(size.type, NoneTypeT) or size.type.shape == (0,):
        return None
    return size


def _check_rows_follow_batch(model: pm.Model, obs, batch_size: int) -> None:
    """A minibatched observed variable must take its number of rows from the batch. With
    ``dims`` or ``shape`` the length is fixed, and PyMC sizes the variable's log-density to
    it (``maybe_resize``): the one-row graph of the per-observation gradients would then
    count its row that many times (or fail to broadcast)."""
    size = _size_input(obs.owner.inputs[0].owner)
    if size is None or _minibatch_nodes([size]):
        return
    dims = model.named_vars_to_dims.get(obs.name)
    if dims:
        given = f"dims={dims!r} ({dims[0]!r} has {int(model.dim_lengths[dims[0]].eval())} rows)"
    elif isinstance(size, Constant):
        given = f"shape ({int(np.ravel(size.data)[0])} rows)"
    else:
        given = "shape"
    raise ModelError(
        f"observed variable '{obs.name}' reads pm.Minibatch data but its {given} fixes its "
        f"number of rows, where they must follow the batch (batch_size={batch_size}): PyMC "
        "sizes its log-density to that length, which the per-observation gradients, taken "
        f"one row at a time, cannot follow. Drop dims/shape from '{obs.name}' (keep dims on "
        "the free variables)."
    )


def _rebuild(outputs: Sequence[Variable], replace: dict[Variable, Variable]) -> list[Variable]:
    """The graphs ``outputs`` with ``replace`` applied, every node downstream of a replaced
    variable rebuilt for its new input types (nodes upstream of the replacements are shared).

    ``clone_replace(..., rebuild_strict=False)`` rebuilds a node through ``op.make_node``, and
    the ``make_node`` of a :class:`~pytensor.compile.builders.SymbolicOp` (PyTensor 3's
    ``softmax``, ``log_softmax``, ``logsumexp``, ...) does not rebuild its inner graph: it
    forces the new input into the input type the op was first built for (a ``SpecifyShape``
    to the old static shape) and keeps the old output type. A softmax over a batch of n rows
    then stays an (n, K) softmax in the one-row graph, and its gradient fails ("Incompatible
    shared dimension for dot product"). Calling the op, as here, builds it for the new types.
    """
    memo = dict(replace)
    for node in toposort(outputs, blockers=replace):
        inputs = [memo.get(i, i) for i in node.inputs]
        if all(new is old for new, old in zip(inputs, node.inputs, strict=True)):
            continue
        if isinstance(node.op, SymbolicOp):
            new_outputs = node.op(*inputs, return_list=True)
        elif isinstance(node.op, MinibatchRandomVariable):
            new_outputs = _rebuild_minibatch_rv(node.op, inputs)
        elif isinstance(node.op, TruncatedRV):
            new_outputs = _rebuild_truncated_rv(node.op, inputs)
        elif _rebuildable_rv(node.op):
            new_outputs = _rebuild_rv(node.op, inputs)
        else:
            new_outputs = node.clone_with_new_inputs(inputs, strict=False).outputs
        memo.update(zip(node.outputs, new_outputs, strict=True))
    return [memo.get(out, out) for out in outputs]


def _scaled_sum(rows: Sequence[tuple[Variable, Variable | None]]) -> Variable:
    """The minibatch's log-likelihood: each term's rows times its N/n factor, summed."""
    return pt.sum([r.sum() if f is None else (f * r).sum() for r, f in rows])


def _one_element_input(value: float, name: str) -> SharedVariable:
    """A number the blocks read as an input, as a one-element vector in the model's
    precision (floatX while the step builds its graphs): numba reads it as it reads the
    priors' numbers, where a 0-d input had it compile a 0-d array's views and conversions."""
    return pytensor.shared(np.full(1, value).astype(pytensor.config.floatX), name=name, shape=(1,))


def _unscaled(rv: Variable, batch_size: int) -> tuple[Variable, float | None]:
    """An observed variable read through ``pm.Minibatch`` without PyMC's ``total_size``
    wrapper, and the factor N/n by which the wrapper scales a batch's log-density, in float64
    as PyMC's ``get_scaling`` computes it (n is ``batch_size`` also in the one-row graph,
    whose term is a batch row's); ``(rv, None)`` for a variable without the wrapper.
    :func:`_check_observed` made N a constant, the data's number of rows, and the rows the
    only axis with a total size. The layer multiplies the log-density by the factor where the
    wrapper did, as an input of the graphs (:meth:`SGModel._size_factor`).

    The wrapper computes N/n from N, a constant, so every graph of the minibatch likelihood
    was one of its own data size: the same model on 8,000 rows instead of 10,000 compiled
    SGLD's block again (P1, 5.6 against 1.1 s to the first draw with warm caches). N itself
    shared (an int64, the wrapper's type) kept the graphs, but the rewrites then computed
    ``N * (1 / n)`` per row and the single-pass GLM kernels, which read float columns, were
    not formed."""
    node = rv.owner
    if node is None or not isinstance(node.op, MinibatchRandomVariable):
        return rv, None
    return node.inputs[0], float(node.inputs[1].data) / batch_size


def _rebuild_minibatch_rv(op: MinibatchRandomVariable, inputs: Sequence[Variable]):
    """PyMC's ``total_size`` wrapper for new inputs. A multivariate observation (``pm.MvNormal``
    rows) has ``total_size=(N, None)``, the ``None`` stored as ``NoneConst``; the op's
    ``make_node`` accepts ``None`` but not ``NoneConst``, so ``clone_with_new_inputs`` fails on
    it. The ``None`` entries are handed back as ``None``."""
    rv, *total_size = inputs
    sizes = [None if isinstance(t.type, NoneTypeT) else t for t in total_size]
    return op.make_node(rv, *sizes).outputs


def _distribution_name(obs: Variable) -> str:
    """The PyMC distribution of an observed variable, for messages (``AutoRegressiveRV``)."""
    node = obs.owner
    if isinstance(node.op, MinibatchRandomVariable):
        node = node.inputs[0].owner
    return type(node.op).__name__


def _rebuild_truncated_rv(op: TruncatedRV, inputs: Sequence[Variable]) -> list[Variable]:
    """``pm.Truncated`` for new inputs, as PyMC resizes it (``change_truncated_size``): the
    base distribution built afresh and truncated again. Its ``make_node`` forces new inputs
    into the old static shapes (``_rebuild``), and it has no ``rv_op`` taking its own inputs:
    a hurdle regression's truncated Poisson (``pm.HurdlePoisson`` with a minibatch ``mu``)
    kept the batch's 400 rows in the one-row graph and failed ("SpecifyShape: Got shape
    (1, 1), expected (None, 400)")."""
    *rv_inputs, lower, upper = inputs
    base = op.base_rv_op.make_node(*rv_inputs).default_output()
    rebuilt = Truncated.rv_op(base, lower=lower, upper=upper, max_n_steps=op.max_n_steps)
    return rebuilt.owner.outputs


def _rebuildable_rv(op) -> bool:
    return getattr(op, "extended_signature", None) is not None and hasattr(op, "rv_op")


def _rebuild_rv(op, inputs: Sequence[Variable]) -> list[Variable]:
    """A PyMC ``SymbolicRandomVariable`` (``pm.NormalMixture``'s mixture, ...) built afresh for
    new inputs. Its ``make_node`` would, like a SymbolicOp's, force the new inputs into the old
    static shapes with a ``SpecifyShape``: the one-row graph then hands PyMC's
    log-probability rewrites a ``SpecifyShape`` where they expect the component variables.
    Also when the input types are unchanged: ``pm.ZeroInflatedPoisson``'s ``DiracDelta``
    component takes its size from the batch's shape, a length-1 vector for n rows as for one,
    and a clone kept the output type of n rows, so the one-row term came out n times over.
    Only the log-density of the result is used, so a fresh random generator is harmless."""
    (rngs, size, params), _ = op.get_input_output_type_idxs(op.extended_signature)
    kwargs = {}
    if size is not None:
        kwargs["size"] = inputs[size]
    elif isinstance(op, RandomWalkRV):
        # Its inputs are the distributions already resized to (T, *batch, *support), from
        # which rv_op would take (T, *batch) for the batch: the walk's batch shape is given.
        init = inputs[params[0]]
        support = init.owner.op.ndim_supp
        kwargs["size"] = tuple(init.shape)[1 : init.type.ndim - support]
    parameters = inspect.signature(op.rv_op).parameters
    if len(rngs) == 1 and "rng" in parameters:
        kwargs["rng"] = inputs[rngs[0]]
    # Required arguments that are the op's settings, not inputs (pm.AR's ar_order and
    # constant_term; without them its rebuild raised a TypeError).
    for name, parameter in list(parameters.items())[len(params) :]:
        if parameter.default is inspect.Parameter.empty and hasattr(op, name):
            kwargs[name] = getattr(op, name)
    rebuilt = op.rebuild_rv(*(inputs[i] for i in params), **kwargs)
    value = rebuilt[-1] if isinstance(rebuilt, list | tuple) else rebuilt
    return value.owner.outputs


class SharedParameters(NamedTuple):
    """The model's random variables and potentials with the priors' numbers held in shared
    variables (:func:`share_parameters`)."""

    #: Each free and observed random variable and potential of the model -> its copy.
    copies: dict[Variable, Variable]
    rvs_to_values: dict[Variable, Variable]
    rvs_to_transforms: dict[Variable, object]
    #: The shared variables, in the order of the graph.
    parameters: list[SharedVariable]
    #: The log-density terms of the copies of the variables read in full at every step (the
    #: free variables and the observations without ``pm.Minibatch``), in their order: derived
    #: once, by the check that PyMC takes the numbers shared.
    fixed_terms: list[Variable]


def _python_values(outputs: Sequence[Variable], leaves: dict[Variable, np.ndarray]) -> list | None:
    """``outputs`` computed node by node by their ops' Python implementations, from the
    graph's constants and the values of ``leaves``, in the outputs' types, as PyTensor's
    constant folding computes them; None if a graph input is neither, or an op has no Python
    implementation.

    A few scalar operations cost microseconds this way, where compiling a function for them
    cost about 20 ms (P1-P3, 2026-12-07)."""
    # Checked first, so that nothing is computed for a graph that reads anything else.
    if any(not isinstance(v, Constant) and v not in leaves for v in graph_inputs(outputs)):
        return None
    values: dict[Variable, object] = dict(leaves)

    def value(var: Variable) -> object:
        return values[var] if var in values else var.data  # else a constant

    for node in toposort(outputs):
        # An op that overwrites an input would overwrite a leaf's value (never in the
        # unrewritten graphs PyMC builds).
        if node.op.destroy_map:
            return None
        out = [[None] for _ in node.outputs]
        try:
            # prepare_node gives the node the NumPy ufunc's signature (its output type): an
            # op's ufunc set up for another node computed a reciprocal of int8 3 as the int8 0.
            node.op.prepare_node(node, None, None, "py")
            node.op.perform(node, [value(var) for var in node.inputs], out)
        except Exception:  # no Python implementation (perform or impl)
            return None
        for var, (result,) in zip(node.outputs, out, strict=True):
            dtype = getattr(var.type, "dtype", None)  # a slice's or a scalar's type has none
            values[var] = result if dtype is None else np.asarray(result, dtype=dtype)
    return [value(var) for var in outputs]


def _constant_value(var: Variable) -> np.ndarray | None:
    """The value of ``var`` if it is a constant, or an elementwise expression of constants
    (PyMC's ``1 / lam`` for ``pm.Exponential``'s scale, ``tau ** -0.5`` for ``pm.Normal``'s
    ``sigma`` given ``tau``) and ``DimShuffle`` s of them (PyMC's ``ExpandDims`` of a
    parameter to the variable's size); else None."""
    if isinstance(var, Constant):
        return np.asarray(var.data)
    if not all(isinstance(node.op, DimShuffle | Elemwise) for node in toposort([var])):
        return None
    values = _python_values([var], {})
    return None if values is None else np.asarray(values[0], dtype=var.type.dtype)


def _distribution_parameters(node: Apply) -> list[Variable]:
    """The parameter inputs of a random variable's node (not its generator or size)."""
    op = node.op
    if isinstance(op, RandomVariable):
        return list(op.dist_params(node))
    if isinstance(op, SymbolicRandomVariable) and op.extended_signature is not None:
        (_, _, params), _ = op.get_input_output_type_idxs(op.extended_signature)
        return [node.inputs[i] for i in params]
    return []


def _shared_number(var: Variable, dtype: str) -> SharedVariable | None:
    """A shared variable holding the number ``var`` (a constant or an expression of constants:
    :func:`_constant_value`) in the model's precision ``dtype``; None if ``var`` is no number.

    PyTensor types a number by its value: ``0`` and ``10`` int8, ``10.0`` float32 (it holds
    it exactly), ``0.3`` float64. Each type was another graph, compiled again. The number is
    promoted as PyTensor promotes it where it meets a float (``upgrade_to_float``: int8 ->
    float32, int64 -> float64), then to ``dtype``, so in a float64 model all four are one
    float64 input and a changed prior number never compiles anew. An integer too large for the
    float to hold exactly stays a constant.
    """
    if not isinstance(var.type, pt.TensorType):
        return None
    kind = var.type.dtype
    if kind in integer_dtypes:
        (float_type,) = upgrade_to_float(get_scalar_type(kind))
        kind = float_type.dtype
    elif kind not in float_dtypes:
        return None
    value = _constant_value(var)
    if value is None:
        return None
    number = value.astype(upcast(kind, dtype))
    if not np.array_equal(number, value):
        return None
    # The parameter as the node reads it, its ExpandDims applied: the copies then have the
    # shapes PyMC's folding of the constant gave.
    return pytensor.shared(number, name="parameter", shape=var.type.shape)


def _with_copies(mapping: dict, copies: dict[Variable, Variable]) -> dict:
    """``mapping`` (the model's values or transforms of its variables) with each variable
    replaced by its copy: one log-density term per value variable."""
    return {copies.get(var, var): entry for var, entry in mapping.items()}


def _copies(
    model: pm.Model, terms: Sequence[Variable], numbers: dict[Variable, SharedVariable]
) -> SharedParameters:
    """``terms`` rebuilt with ``numbers`` shared (:func:`_rebuild`), and the model's values
    and transforms keyed by the copies; their log-density terms are left to be derived."""
    copies = dict(zip(terms, _rebuild(terms, numbers) if numbers else terms, strict=True))
    return SharedParameters(
        copies=copies,
        rvs_to_values=_with_copies(model.rvs_to_values, copies),
        rvs_to_transforms=_with_copies(model.rvs_to_transforms, copies),
        parameters=list(numbers.values()),
        fixed_terms=[],
    )


def _log_densities(shared: SharedParameters, rvs: Sequence[Variable]) -> list[Variable]:
    """The log-density terms of the copies of ``rvs``, derived together as ``model.logp``
    derives them: each variable's density given the values of the others."""
    if not rvs:
        return []
    return transformed_conditional_logp(
        [shared.copies[rv] for rv in rvs],
        rvs_to_values=shared.rvs_to_values,
        rvs_to_transforms=shared.rvs_to_transforms,
    )


def _with_numbers_taken(
    model: pm.Model,
    terms: Sequence[Variable],
    numbers: dict[Variable, SharedVariable],
    rvs: Sequence[Variable],
) -> SharedParameters | None:
    """The copies of ``terms`` with ``numbers`` shared (:func:`_copies`) and the log-density
    terms of the copies of ``rvs``; None if PyMC does not derive them so, or a copy's type
    changed. Some distributions need a number as a constant: ``pm.Interpolated`` reads its
    points' values, ``pm.ZeroSumNormal``'s and ``pm.LKJCholeskyCov``'s sizes and
    ``pm.StickBreakingWeights``'s ``K`` are integers that fix shapes, and so may a number in a
    ``pm.CustomDist``'s ``logp``. Their errors differ (a ``TypeError``, an
    ``AttributeError``, the ``logp``'s own), hence the broad ``except``: a distribution that
    fails here keeps its numbers as constants, and any error of its own is raised where its
    term is derived without them (:func:`share_parameters`)."""
    try:
        shared = _copies(model, terms, numbers)
        if any(copy.type != term.type for term, copy in shared.copies.items()):
            return None
        return shared._replace(fixed_terms=_log_densities(shared, rvs))
    except Exception:
        return None


def _numbers_each_distribution_takes(
    model: pm.Model, numbers: dict[Variable, SharedVariable]
) -> dict[Variable, SharedVariable]:
    """The ``numbers`` whose free variables' log-densities, each taken alone, take them
    shared (:func:`_with_numbers_taken`); a number two variables read, only if both do."""
    free = set(model.free_RVs)
    taken, kept = {}, set()
    for rv in model.free_RVs:
        ancestry = toposort([rv], blockers=free - {rv})
        own = {var: numbers[var] for node in ancestry for var in node.inputs if var in numbers}
        if own and _with_numbers_taken(model, [rv], own, [rv]) is not None:
            taken.update(own)
        else:
            kept.update(own)
    return {var: number for var, number in taken.items() if var not in kept}


def _prior_numbers(model: pm.Model, dtype: str) -> dict[Variable, SharedVariable]:
    """Each number given as a parameter of a free variable's distribution -> a shared
    variable holding it in ``dtype`` (:func:`_shared_number`)."""
    shared: dict[Variable, SharedVariable] = {}
    for node in toposort(model.free_RVs):
        for var in _distribution_parameters(node):
            number = None if var in shared else _shared_number(var, dtype)
            if number is not None:
                shared[var] = number
    return shared


def share_parameters(
    model: pm.Model, dtype: str, fixed_rvs: Sequence[Variable]
) -> SharedParameters:
    """Copies of the model's terms in which the numbers given as the priors' parameters
    (``pm.Normal("w", 0, 10)``'s two, ``pm.Exponential("s", 1)``'s scale ``1 / 1``, an array
    of prior scales, a prior covariance) are shared variables holding the same values, in the
    model's precision ``dtype`` (:func:`_shared_number`), and the log-density terms of the
    copies of ``fixed_rvs`` (the free variables and the observations read in full).

    The compiled blocks then read these numbers as inputs instead of compiling them in: a
    model that differs only in them (a prior's scale changed between two runs, ``10`` ->
    ``2.5`` -> ``0.3``) has the same graphs, so PyTensor's rewritten-graph cache
    (:mod:`pymc_sgmcmc.rewrite_cache`) and numba's cache serve it the blocks compiled for the
    first. Such a change recompiled every block (P1, step construction to the first draw with
    warm caches: SGLD 5.8-6.1 s, mCCAdL 8.9-9.1 s, against 2.0-2.9 s now). The compiled step
    computes from them what a constant's folding did once (a ``log(sigma)``), a few scalar
    operations per step, and in the model's precision where PyMC computes an int8's or a
    float32's ``log`` in float32: the log-density differs from ``model.compile_logp()``'s by
    that rounding (3e-8 relative on a ``pm.HalfCauchy("s", 5)``), and an int8 sum that
    overflows in PyMC does not here (``pm.Beta("p", 100, 100)``'s log-density is NaN in
    PyMC 6.4). A distribution whose log-density needs its numbers as constants keeps them
    (:func:`_with_numbers_taken`): if PyMC fails on the copies, each free variable's
    distribution is tried alone.

    The likelihood's numbers stay constants: the step computes with them once per minibatch
    row, where folding them matters (shared, P1's ``sigma=1.0`` made mCCAdL's and NOGIN's
    steps 7-8 % slower, five alternated pairs). So do numbers inside an expression of a
    variable (a ``2.0 * x``) and the log-densities' own constants, whose values the rewrites
    use (``x ** 2`` -> ``sqr(x)``).
    """
    terms = [*model.free_RVs, *model.observed_RVs, *model.potentials]
    numbers = _prior_numbers(model, dtype)
    if numbers:
        # The check that PyMC takes the numbers shared derives the terms kept: deriving them
        # twice cost 55-75 ms of a step's construction (P1-P3, 2026-12-06).
        shared = _with_numbers_taken(model, terms, numbers, fixed_rvs)
        if shared is not None:
            return shared
        numbers = _numbers_each_distribution_takes(model, numbers)
    shared = _copies(model, terms, numbers)
    return shared._replace(fixed_terms=_log_densities(shared, fixed_rvs))


def passed_checks(
    outputs: Sequence[Variable], parameters: Sequence[SharedVariable]
) -> dict[Variable, Variable]:
    """The parameter checks (``sigma > 0``) in ``outputs`` that read only the shared
    ``parameters`` and hold for their values, each mapped to the value it checks, to replace
    it.

    With the parameters as constants, PyTensor's constant folding removed these checks when
    it compiled a function; with shared variables it cannot, and each block compiled and ran
    the comparisons (nine more ops on P1 while its likelihood's number was shared too). A
    check that fails stays, as it stayed before: the log-density is -inf. So does one that
    cannot be computed in Python (:func:`_python_values`), and one that reads anything else
    (a value variable, data), for which that gives None."""
    leaves = {p: p.get_value(borrow=True) for p in parameters}
    passed = {}
    for node in toposort(outputs):
        if isinstance(node.op, CheckParameterValue):
            values = _python_values(node.inputs[1:], leaves)
            if values is not None and all(np.all(v) for v in values):
                passed[node.outputs[0]] = node.inputs[0]
    return passed


def join_value_variables(
    point: dict[str, np.ndarray],
    outputs: Sequence[Variable],
    value_vars: Sequence[Variable],
    replace: dict[Variable, Variable],
) -> tuple[list[Variable], TensorVariable]:
    """``outputs`` as functions of one vector ``theta`` of all ``value_vars``, with ``replace``
    applied too, and ``theta``: PyMC's ``join_nonshared_inputs`` (the same graphs), in one
    clone of all outputs instead of one per output and another for ``replace`` (P1: 15 ms
    less of a step's construction, 2026-12-07)."""
    joined = pt.concatenate(
        [pt.as_tensor(v, allow_xtensor_conversion=True).ravel() for v in value_vars]
    )
    theta = joined.type("theta")
    pieces, start = {}, 0
    for var in value_vars:
        shape = point[var.name].shape
        size = int(np.prod(shape, dtype=int))
        piece = theta[start : start + size].reshape(shape).astype(var.dtype)
        pieces[var] = var.type.filter_variable(piece)
        start += size
    # One pass of rebuild_collect_shared clones each replacement in the order given, with the
    # pairs before it applied (clone_replace substitutes all pairs at once, so a check's
    # value kept the value variables): the values first, so that a check's value reads theta.
    _, joined_outputs, _ = rebuild_collect_shared(
        list(outputs), replace=pieces | replace, rebuild_strict=False, copy_inputs_over=True
    )
    return joined_outputs, theta


#: Minibatches pooled to estimate the gradient noise's largest eigenvalue (see
#: :meth:`SGModel.gradient_noise`).
NOISE_BATCHES = 16
#: Largest number of per-observation gradient values (rows x D) held at once for that
#: estimate: 2^24 float64 values are 128 MiB (8 minibatches of 2,000 rows at D = 1,000).
NOISE_VALUES_BUDGET = 2**24


#: Products of the power iterations behind the step-size rule's two eigenvalues.
POWER_ITERATIONS = 20


class NoiseMoments(NamedTuple):
    """The preconditioned minibatch-force covariance's largest eigenvalue and its diagonal
    (:meth:`SGModel.gradient_noise`)."""

    largest: float
    diagonal: np.ndarray


def _power_iteration(matvec, start: np.ndarray) -> float:
    """Largest |eigenvalue| of a symmetric operator after :data:`POWER_ITERATIONS` products
    (nan if it produces non-finite values)."""
    x, estimate = start, np.nan
    for _ in range(POWER_ITERATIONS):
        norm = np.linalg.norm(x)
        if not np.isfinite(norm) or norm == 0:
            return float("nan") if not np.isfinite(norm) else 0.0
        x = x / norm
        y = matvec(x)
        estimate = float(x @ y)
        x = y
    return abs(estimate)


class SGModel:
    """A PyMC model split into a full-data part and a minibatch part, in flat coordinates.

    Parameters
    ----------
    model : pm.Model
    value_vars : sequence of value variables
        Must be all of the model's value variables (every free variable is updated together).

    Attributes
    ----------
    theta : TensorVariable
        Flat position (``D``,), the raveled value variables in ``value_vars`` order.
    indices : tuple of TensorVariable
        One int64 vector of ``n`` row indices per ``pm.Minibatch`` call; the graphs leave its
        length open, so a model run again with another ``batch_size`` compiles nothing again
        (with the N/n factor an input too, :meth:`_size_factor`).
    sources : list of MinibatchSource
    batch_size : int
        ``n``; equal to ``N`` (and no indices) for a model without ``pm.Minibatch``.
    """

    def __init__(self, model: pm.Model, value_vars: Sequence[Variable]):
        self.model = model
        _check_free_variables(model, list(value_vars))
        # Ravel in the model's order, which is the order PyMC ravels points in.
        self.value_vars = list(model.value_vars)
        self.sources = _find_sources(model)
        self.indices = tuple(
            pt.vector(f"minibatch_index_{k}", dtype="int64", shape=(None,))
            for k, s in enumerate(self.sources)
        )
        self.batch_size = self.sources[0].batch_size if self.sources else None
        #: Each minibatch-observed variable's N/n factor (:meth:`_size_factor`).
        self._size_factors: dict[Variable, SharedVariable] = {}
        self._row_count: RowCount | None = None
        self._partition_terms()
        #: The floating-point type of the position, that of the value variables (float32 for a
        #: model built under ``floatX="float32"``): the log-density graphs derived here, and
        #: the samplers' state, noise and arithmetic, use it too.
        self.dtype = upcast(*(v.type.dtype for v in self.value_vars))
        with building_graphs(self.dtype):
            self.shared_parameters = share_parameters(model, self.dtype, self._fixed_rvs)
            self._build_graphs()

    # ------------------------------------------------------------------ graph construction
    def _partition_terms(self) -> None:
        model = self.model
        self._batch_obs = {k: [] for k in range(len(self.sources))}
        fixed_obs = []
        for obs in model.observed_RVs:
            source = _check_observed(model, obs, self.sources)
            if source is None:
                fixed_obs.append(obs)
            else:
                self._batch_obs[self.sources.index(source)].append(obs)
        for pot in model.potentials:
            if _minibatch_nodes([pot]):
                raise ModelError(
                    f"potential '{pot.name}' reads pm.Minibatch data: a potential has no "
                    "total_size, so its N/n scaling and its split into observations are unknown. "
                    "Write that term as an observed variable (e.g. pm.CustomDist with "
                    "total_size=N)."
                )
        for rv in [*model.free_RVs, *model.deterministics]:
            if _minibatch_nodes([rv]):
                raise ModelError(
                    f"'{rv.name}' is computed from pm.Minibatch data, so it would change with "
                    "every batch. Only observed variables may read minibatch data."
                    + _minibatch_deterministic_fix(rv, model)
                )
        self._fixed_rvs = [*model.free_RVs, *fixed_obs]

    def _slice_replacements(self, rows, graphs: Sequence[Variable]) -> dict[Variable, Variable]:
        """Map every minibatch output in ``graphs`` to ``rows(k, j, data)``: the rows of data
        array j of source k that the graph should see (our own indexing or placeholders).

        Graph clones (e.g. by ``replace_rvs_by_values``) copy the MinibatchOp node but not its
        data inputs, so nodes are matched to their source through the data they slice.
        """
        replace = {}
        for node in _minibatch_nodes(graphs):
            k = next(
                k
                for k, s in enumerate(self.sources)
                if len(node.inputs) == len(s.node.inputs)
                and all(a is b for a, b in zip(node.inputs[:-1], s.node.inputs[:-1], strict=True))
            )
            for j, (out, data) in enumerate(
                zip(node.outputs[:-1], self.sources[k].shared_data, strict=True)
            ):
                replace[out] = rows(k, j, data)
        return replace

    def _row_terms(self, rows) -> list[tuple[Variable, Variable | None]]:
        """Per-observation log-likelihood terms, one (n,) vector per observed variable, each
        with its N/n factor (:func:`_unscaled`; ``None`` without ``pm.Minibatch``), also where
        ``rows`` gives a single row.

        The slicing is replaced in the *random-variable* graphs, before PyMC derives their
        log-density: PyMC's logp rewrites fold a static number of rows into the graph, so the
        terms are derived afresh for each kind of rows: the minibatch's, whose length the
        graphs leave open (another ``batch_size`` is the same graph), and one row.
        """
        model = self.model
        observed = [obs for group in self._batch_obs.values() for obs in group]
        if not observed:
            return []
        # Free variables become their (back-transformed) value variables first, so that the
        # clone below copies only the likelihood part of the graph.
        shared = self.shared_parameters
        free = {shared.copies[rv]: model.rvs_to_values[rv] for rv in model.free_RVs}
        in_values = replace_rvs_by_values(
            [shared.copies[obs] for obs in observed],
            rvs_to_values=free,
            rvs_to_transforms=shared.rvs_to_transforms,
        )
        values = [model.rvs_to_values[obs] for obs in observed]
        replace = self._slice_replacements(rows, [*in_values, *values])
        try:
            sliced = _rebuild([*in_values, *values], replace)
            new_values = sliced[len(observed) :]
            unscaled = [_unscaled(rv, self.batch_size) for rv in sliced[: len(observed)]]
            new_rvs = [rv for rv, _ in unscaled]
            terms = transformed_conditional_logp(
                rvs=new_rvs,
                rvs_to_values=dict(zip(new_rvs, new_values, strict=True)),
                rvs_to_transforms={},
            )
        except Exception as error:
            # PyMC's random-variable classes are rebuilt for a batch's rows here; one this
            # layer does not know how to rebuild fails deep inside PyMC or PyTensor.
            kinds = [f"'{obs.name}' ({_distribution_name(obs)})" for obs in observed]
            raise ModelError(
                f"the log-density of the observed variables {', '.join(kinds)} could not be "
                f"taken one minibatch row at a time ({type(error).__name__}: {error}). Each "
                "row of the batch must be an independent observation of a distribution that "
                "PyMC can rebuild for fewer rows; write the likelihood with pm.CustomDist or a "
                "standard distribution over the rows if this one cannot be."
            ) from error
        rows = []
        for obs, term, (_, factor) in zip(observed, terms, unscaled, strict=True):
            if term.type.ndim == 0:
                raise ModelError(
                    f"observed variable '{obs.name}' ({_distribution_name(obs)}) has one "
                    "joint log-density for the whole batch (a time series such as pm.AR or "
                    "pm.GaussianRandomWalk, or a multivariate distribution, along the "
                    "observation axis), so it cannot be split per observation. Make the "
                    "observation axis the first, batch, axis of independent rows (independent "
                    "series as rows of an (N, T) array, total_size=(N, None))."
                )
            row = term.sum(axis=tuple(range(1, term.type.ndim)))
            rows.append((row, None if factor is None else self._size_factor(obs, factor)))
        return rows

    def _size_factor(self, obs: Variable, factor: float) -> SharedVariable:
        """The N/n factor of ``obs``'s log-density (:func:`_unscaled`), one shared variable
        for all its graphs, holding the value PyTensor's constant folding gave the wrapper's
        ``cast(N / n, floatX)`` (the same draws, bit for bit). A one-element vector, as the
        priors' numbers are (:func:`share_parameters`): numba reads it as it reads them. A 0-d
        factor had it compile a 0-d array's views and conversions, 8-10 functions more, and
        SGLD's and mCCAdL's cold first draws took about 1 s longer."""
        if obs not in self._size_factors:
            self._size_factors[obs] = _one_element_input(factor, f"{obs.name}_size_factor")
        return self._size_factors[obs]

    def _batch_rows(self) -> RowCount:
        """The minibatch's n and n / (n - 1) as inputs, for :class:`NoiseCovariance`: read
        from the rows' shape, which is left open (another ``batch_size`` is the same graph),
        they were 7-19 more functions for numba to compile at a cold start (the shape, its
        conversions to a float and back to a vector). One-element vectors, as the N/n factor
        is (:meth:`_size_factor`)."""
        if self._row_count is None:
            n = self.batch_size
            self._row_count = RowCount(
                _one_element_input(n, "batch_rows"),
                _one_element_input(n / (n - 1.0), "batch_rows_correction"),
            )
        return self._row_count

    def _fixed_logp(self) -> Variable:
        """The log-density of the terms read in full at every step (priors, observations
        without ``pm.Minibatch``, potentials), summed in their order as ``model.logp`` does,
        from the copies with shared parameters (:func:`share_parameters`)."""
        shared = self.shared_parameters
        terms = shared.fixed_terms + replace_rvs_by_values(
            [shared.copies[t] for t in self.model.potentials],
            rvs_to_values=shared.rvs_to_values,
            rvs_to_transforms=shared.rvs_to_transforms,
        )
        sums = [pt.as_tensor(term, allow_xtensor_conversion=True).sum() for term in terms]
        return variadic_add(*sums) if sums else pt.constant(0.0)

    def _build_graphs(self) -> None:
        model = self.model
        point = model.initial_point()
        point = {v.name: point[v.name] for v in self.value_vars}
        fixed = self._fixed_logp()
        batch_rows = self._row_terms(lambda k, j, data: data[self.indices[k]])
        batch = _scaled_sum(batch_rows) if batch_rows else pt.constant(0.0)

        # One-observation graph: the same terms on a batch of one row, a placeholder per data
        # array (vectorising over gathered rows avoids a batched indexing loop), scaled by
        # the batch's N/n (_unscaled): each row's gradient is (N/n) g_i.
        single = {
            (k, j): data.type.clone(shape=(1, *data.type.shape[1:]))(f"row_{k}_{j}")
            for k, source in enumerate(self.sources)
            for j, data in enumerate(source.shared_data)
        }
        row_terms = self._row_terms(lambda k, j, data: single[(k, j)])

        # Each term's unscaled sum, differentiated on its own and then scaled: the N/n factor
        # multiplies the gradient's D-vector. Differentiating the scaled rows put it inside
        # SGLD's fused product kernel once the batch's length was left open (a (1, 1) column
        # per row, other last bits, and more functions for numba to compile).
        batch_sums = [r.sum() for r, _ in batch_rows]
        row_sums = [r.sum() for r, _ in row_terms]
        outputs = [fixed, batch, *batch_sums, *row_sums]
        passed = passed_checks(outputs, self.shared_parameters.parameters)
        joined, self.theta = join_value_variables(point, outputs, self.value_vars, passed)
        self.dim = int(sum(np.size(v) for v in point.values()))
        fixed_lp, batch_lp = joined[0], joined[1]
        joined_batch = joined[2 : 2 + len(batch_sums)]
        joined_rows = joined[2 + len(batch_sums) :]
        self.fixed_logp = fixed_lp
        self.logp = fixed_lp + batch_lp
        # A term may not depend on every coordinate (a pm.Flat prior has a constant logp).
        grad = partial(pt.grad, wrt=self.theta, disconnected_inputs="ignore")

        def scaled_grad(sums, terms):
            pairs = zip(sums, [f for _, f in terms], strict=True)
            return variadic_add(*[grad(s) if f is None else f * grad(s) for s, f in pairs])

        self.fixed_force = grad(fixed_lp)
        self.force = (
            self.fixed_force + scaled_grad(joined_batch, batch_rows)
            if batch_rows
            else self.fixed_force
        )
        if row_terms:
            row_grad = scaled_grad(joined_rows, row_terms)
            self._row_gradient = (row_grad, single)
            self.per_observation_gradients = vectorize_graph(
                row_grad,
                {
                    row: self.sources[k].shared_data[j][self.indices[k]][:, None]
                    for (k, j), row in single.items()
                },
            )
        else:
            self.per_observation_gradients = None
        self.initial_theta = np.concatenate([np.ravel(point[v.name]) for v in self.value_vars])

    # ------------------------------------------------------------------ helpers for integrators
    @property
    def has_minibatch(self) -> bool:
        return bool(self.sources)

    def _at(self, theta: Variable, indices: Sequence[Variable], outputs: Sequence[Variable]):
        """The graphs ``outputs`` re-expressed at another position and other index inputs."""
        replace = {self.theta: theta, **dict(zip(self.indices, indices, strict=True))}
        return clone_replace(list(outputs), replace)

    def force_at(
        self,
        theta: Variable,
        indices: Sequence[Variable],
        control: ControlVariate | None = None,
    ) -> Variable:
        """Noisy force F(theta) of the minibatch ``indices``; with ``control``, the
        control-variate force (:class:`ControlVariate`)."""
        (force,) = self._at(theta, indices, [self.force])
        if control is not None and self.has_minibatch:
            (at_anchor,) = self._at(control.anchor, indices, [self.force])
            force = control.anchor_force + (force - at_anchor)
        return force

    def logp_at(self, theta: Variable, indices: Sequence[Variable]) -> Variable:
        """The minibatch estimate of log p(theta | X): the fixed terms plus N/n times the
        minibatch's log-likelihood."""
        (logp,) = self._at(theta, indices, [self.logp])
        return logp

    def force_and_noise(
        self,
        theta: Variable,
        indices: Sequence[Variable],
        optional: bool = False,
        control: ControlVariate | None = None,
    ):
        """As :meth:`force_at`, and the :class:`NoiseCovariance` of that force.

        The force is assembled from the per-observation gradients, so they are computed once;
        with ``control`` they are the differences g_i(theta) - g_i(anchor), whose spread is
        the control-variate force's noise.
        A one-row minibatch has no spread to estimate the covariance from: an error, or with
        ``optional`` (a sampler that only starts from the estimate) a zero covariance.
        """
        one_row = self.per_observation_gradients is not None and self.batch_size < 2
        if self.per_observation_gradients is None or (one_row and optional):
            return self.force_at(theta, indices, control), NoiseCovariance(None, self.dim)
        if one_row:
            raise ModelError(
                "the noise covariance is estimated from the spread of the minibatch's "
                "per-observation gradients, which needs at least 2 rows: use "
                "pm.Minibatch(..., batch_size >= 2) with this sampler"
            )
        fixed_force, grads = self._at(
            theta, indices, [self.fixed_force, self.per_observation_gradients]
        )
        force = fixed_force + grads.sum(axis=0)
        if control is not None:
            fixed_at_anchor, grads_at_anchor = self._at(
                control.anchor, indices, [self.fixed_force, self.per_observation_gradients]
            )
            grads = grads - grads_at_anchor
            force = control.anchor_force + fixed_force - fixed_at_anchor + grads.sum(axis=0)
        return force, NoiseCovariance(grads, self.dim, self.batch_size, rows=self._batch_rows())

    def full_data_force(self, theta: np.ndarray, functions: tuple | None = None) -> np.ndarray:
        """The exact force at ``theta``: the fixed terms plus every row's gradient, from the
        per-observation gradients of consecutive one-minibatch chunks (one pass over the
        data; the last chunk wraps around and its repeated rows are dropped). ``functions``:
        the (rows, fixed) functions to use, by default the compiled ones of the control
        variates' anchors."""
        rows_fn, fixed_fn = functions or self._full_pass_functions
        total, n = self.total_rows, self.batch_size
        force = np.array(fixed_fn(theta), dtype=float)
        for start in range(0, total, n):
            chunk = np.arange(start, start + n) % total
            rows = rows_fn(theta, *([chunk] * len(self.sources)))  # each (N/n) g_i
            force += rows[: min(n, total - start)].sum(axis=0) * (n / total)
        return force

    def exact_force(self, theta: np.ndarray) -> np.ndarray | None:
        """The exact force at ``theta`` for a one-off check, with the host-side helpers (no
        numba compilation): the fixed terms' alone without ``pm.Minibatch``, one pass over
        the data with it; None where one pass cannot give it (``pm.Minibatch`` calls over
        different numbers of rows)."""
        rows_fn, fixed_fn = self._geometry_functions[1], self._one_off_fixed_force
        if rows_fn is None:
            return np.array(fixed_fn(theta), dtype=float)
        if len({s.total_size for s in self.sources}) != 1:
            return None
        return self.full_data_force(theta, (rows_fn, fixed_fn))

    @cached_property
    def _one_off_fixed_force(self):
        return self._one_off_function([self.theta], self.fixed_force)

    @property
    def total_rows(self) -> int:
        """N, the rows every ``pm.Minibatch`` draws from (a full pass needs one N)."""
        totals = {s.total_size for s in self.sources}
        if len(totals) != 1:
            raise ModelError(
                "control variates need every pm.Minibatch over the same number of rows, got "
                f"{sorted(totals)}"
            )
        return totals.pop()

    def _function(self, inputs, outputs, mode=None):
        """A host-side helper function of the model's graphs, compiled in the model's float
        type (rewrites rebuild nodes under ``floatX``: a float32 graph compiled under
        float64 would get float64 nodes); it takes the host's float64 arrays."""
        with building_graphs(self.dtype), deterministic_fastmath():
            return pytensor.function(
                inputs,
                outputs,
                mode=caching_rewrites(mode),
                on_unused_input="ignore",
                allow_input_downcast=True,
            )

    def _one_off_function(self, inputs, outputs):
        """A helper run once or a few times per chain, in ``one_off_mode``: Python's
        perform, or compiled where an op loops per element."""
        return self._function(inputs, outputs, one_off_mode(outputs))

    @cached_property
    def _full_pass_functions(self):
        rows_fn = self._function([self.theta, *self.indices], self.per_observation_gradients)
        fixed_fn = self._function([self.theta], self.fixed_force)
        return rows_fn, fixed_fn

    def check_exact_noise_covariance(self) -> None:
        """``exact_noise_covariance`` is that of a single ``pm.Minibatch`` source's rows."""
        if len(self.sources) != 1:
            raise ModelError("the exact noise covariance needs exactly one pm.Minibatch call")

    def exact_noise_covariance(self, theta: Variable) -> DenseCovariance:
        """The full-data covariance Sigma(theta) = (N^2/n) Cov_i g_i(theta) of the minibatch
        force (population covariance over all N rows, batches drawn with replacement).

        A testing device (NOGIN's Lemma 2 needs the exact Sigma): it costs a full pass over
        the data. Only for a single ``pm.Minibatch`` source.
        """
        self.check_exact_noise_covariance()
        row_grad, single = self._row_gradient
        all_rows = {row: self.sources[0].shared_data[j][:, None] for (_, j), row in single.items()}
        rows = vectorize_graph(row_grad, all_rows)  # (N, D), each (N/n) g_i
        rows = clone_replace(rows, {self.theta: theta})
        centred = rows - rows.mean(axis=0)
        # Cov_pop of the scaled rows is (N/n)^2 Cov_pop(g): Sigma = n Cov_pop(scaled rows).
        n_rows = centred.shape[0].astype(centred.dtype)
        return DenseCovariance(self.batch_size * (centred.T @ centred) / n_rows, self.dim)

    def gradient_noise(
        self,
        points: Sequence[np.ndarray],
        preconditioner: Preconditioner,
        rng: np.random.Generator,
        batches: int = NOISE_BATCHES,
        anchor: np.ndarray | None = None,
    ) -> NoiseMoments:
        """The largest eigenvalue of the preconditioned minibatch-force covariance
        S R^T Sigma R S (:class:`Preconditioner`), averaged over ``points``: one of the two
        numbers a step size is chosen from (the other is :meth:`largest_curvature`); and the
        same covariance's diagonal, the noise's variance in each preconditioned coordinate
        (SGNHT's user step-size check).

        Power iteration on the covariance of the per-observation gradients, pooled over
        ``batches`` minibatches spread evenly over the points (each minibatch centred on its
        own mean), as many as :data:`NOISE_VALUES_BUDGET` holds and at least one per point.
        One minibatch's sample covariance spreads its spectrum (Marchenko-Pastur, wider still
        for heavy-tailed rows), so that its largest eigenvalue over-states the covariance's:
        on linear regressions at the posterior it measured 1.7x (D = 10, n = 200), 2.5x
        (D = 100, n = 500), 5.2x (D = 200, n = 400) and 5.9x (D = 1,000, n = 2,000), up to
        9.7x with t3-distributed residuals; 16 pooled minibatches measured 1.03-1.56x on the
        same problems, never below 1 on average. The diagonal is unbiased. 0 without
        ``pm.Minibatch``; nan where the model is not finite at a point. With an ``anchor``,
        the noise is that of the control-variate force (the spread of g_i(theta) -
        g_i(anchor)).
        """
        blocks = self._centred_noise_rows(points, preconditioner, rng, batches, anchor)
        if blocks is None:
            return NoiseMoments(0.0, np.zeros(self.dim))
        weights = [self.batch_size / (len(b) - 1.0) / len(blocks) for b in blocks]

        def sigma(v):
            return sum(w * (b.T @ (b @ v)) for w, b in zip(weights, blocks, strict=True))

        largest = _power_iteration(sigma, rng.standard_normal(self.dim))
        diagonal = sum(w * np.sum(b * b, axis=0) for w, b in zip(weights, blocks, strict=True))
        return NoiseMoments(largest, diagonal)

    def noise_third_moment(
        self,
        theta: np.ndarray,
        preconditioner: Preconditioner,
        rng: np.random.Generator,
        batches: int = NOISE_BATCHES,
        anchor: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """c3_j = sum_k Cov(Sigma-hat_jk, eta_k), the covariance of the same minibatch's noise
        estimate with the force's noise eta, in the preconditioned coordinates, and its
        standard error: (N^3 / n^2) E[d_j |d|^2] over the unscaled per-observation gradients d,
        that is n E[r_j |r|^2] over the N/n-scaled rows r of ``batches`` pooled minibatches,
        each centred on its own mean (the guide's "The same-minibatch estimate shifts the
        mean"). None without ``pm.Minibatch``. ``anchor``: as for :meth:`gradient_noise`."""
        blocks = self._centred_noise_rows([theta], preconditioner, rng, batches, anchor)
        if blocks is None:
            return None
        terms = np.concatenate([b * np.sum(b * b, axis=1, keepdims=True) for b in blocks])
        n = self.batch_size
        return n * terms.mean(axis=0), n * terms.std(axis=0, ddof=1) / np.sqrt(len(terms))

    def _centred_noise_rows(
        self,
        points: Sequence[np.ndarray],
        preconditioner: Preconditioner,
        rng: np.random.Generator,
        batches: int,
        anchor: np.ndarray | None,
    ) -> list[np.ndarray] | None:
        """The noise's rows (:meth:`_noise_rows`) of ``batches`` minibatches spread evenly
        over ``points`` (as many as :data:`NOISE_VALUES_BUDGET` holds, at least one per
        point), in the preconditioned coordinates, each minibatch centred on its own mean;
        None without ``pm.Minibatch``."""
        _, rows_fn = self._geometry_functions
        if rows_fn is None:
            return None
        fits = NOISE_VALUES_BUDGET // (self.batch_size * self.dim)
        per_point = max(1, min(batches, fits) // len(points))
        if self.batch_size == 1:
            per_point = max(per_point, 2)
        blocks = []
        for theta in points:
            rows = [
                preconditioner.pull_back(self._noise_rows(theta, ix, anchor))
                for ix in self._batch_indices(rng, per_point)
            ]
            if self.batch_size == 1:
                # One row per minibatch has no spread of its own: its moments are those of
                # single (N-scaled) rows, estimated from the point's rows together.
                rows = [np.concatenate(rows)]
            blocks += [r - r.mean(axis=0) for r in rows]
        return blocks

    def _noise_rows(self, theta: np.ndarray, ix, anchor: np.ndarray | None) -> np.ndarray:
        """The rows whose spread is the force's noise: g_i(theta), or g_i(theta) - g_i(anchor)
        with control variates (each scaled by N/n)."""
        _, rows_fn = self._geometry_functions
        rows = rows_fn(theta, *ix)
        return rows if anchor is None else rows - rows_fn(anchor, *ix)

    def largest_curvature(
        self,
        theta: np.ndarray,
        preconditioner: Preconditioner,
        rng: np.random.Generator,
        batches: int = 2,
    ) -> float:
        """The largest eigenvalue of the preconditioned Hessian of -log p, S R^T H R S, at
        ``theta``, averaged over ``batches`` minibatches (one minibatch's Hessian
        over-estimates the largest eigenvalue): power iteration on Hessian-vector products."""
        hessian = self._averaged_hessian(theta, self._batch_indices(rng, batches))
        pull_back, to_theta = preconditioner.pull_back, preconditioner.to_theta
        return _power_iteration(
            lambda v: pull_back(hessian(to_theta(v))), rng.standard_normal(self.dim)
        )

    def shrinkage_intensity(
        self,
        points: Sequence[np.ndarray],
        preconditioner: Preconditioner,
        rng: np.random.Generator,
        batches: int = 2,
        target: str = "identity",
        anchor: np.ndarray | None = None,
    ) -> float:
        """The shrinkage intensity towards ``target`` for the minibatch estimate of
        S R^T Sigma R S, pooled over ``batches`` minibatches at each of ``points``: the ratio of
        the averaged statistics of :func:`ledoit_wolf_statistics`, clipped to [0, 1]. 0 without
        ``pm.Minibatch``. ``anchor``: as in :meth:`gradient_noise`."""
        _, rows_fn = self._geometry_functions
        if rows_fn is None:
            return 0.0
        stats = [
            ledoit_wolf_statistics(
                preconditioner.pull_back(self._noise_rows(theta, ix, anchor)), target
            )
            for theta in points
            for ix in self._batch_indices(rng, batches)
        ]
        beta2, delta2 = np.mean(stats, axis=0)
        if not (np.isfinite(beta2) and np.isfinite(delta2)) or delta2 <= 0:
            return 1.0 if np.isfinite(beta2) else 0.0
        return float(min(beta2, delta2) / delta2)

    def curvature_diagonal(
        self, theta: np.ndarray, rng: np.random.Generator, batches: int = 4
    ) -> np.ndarray:
        """The diagonal of the Hessian of -log p at ``theta``, averaged over ``batches``
        minibatches: exact from D Hessian-vector products up to D = ``EXACT_CURVATURE_DIM``,
        above that Hutchinson's estimate E[v * Hv] over as many Rademacher vectors."""
        if self.dim <= EXACT_CURVATURE_DIM:
            return self.curvature_entries(theta, rng, np.arange(self.dim), batches)
        hessian = self._averaged_hessian(theta, self._batch_indices(rng, batches))
        vs = rng.choice([-1.0, 1.0], size=(EXACT_CURVATURE_DIM, self.dim))
        return np.mean([v * hessian(v) for v in vs], axis=0)

    def curvature_matrix(
        self, theta: np.ndarray, rng: np.random.Generator, batches: int = 4
    ) -> np.ndarray:
        """The Hessian of -log p at ``theta``, averaged over ``batches`` minibatches: one
        Hessian-vector product per column and minibatch, symmetrised."""
        return np.mean(self.curvature_matrices(theta, rng, batches), axis=0)

    def curvature_matrices(
        self, theta: np.ndarray, rng: np.random.Generator, batches: int = 4, groups: int = 2
    ) -> list[np.ndarray]:
        """:meth:`curvature_matrix` from ``groups`` disjoint sets of ``batches // groups``
        minibatches each: independent estimates, whose mean is the one of all the batches."""
        if batches < groups or batches % groups:
            # Unequal groups would not average to the Hessian on all the batches, and an empty
            # one would be NaN, read as "not positive definite" without a word.
            raise ValueError(f"{batches} minibatches do not split into {groups} equal groups")
        indices, size = self._batch_indices(rng, batches), batches // groups
        matrices = []
        for group in range(groups):
            hessian = self._averaged_hessian(theta, indices[group * size : (group + 1) * size])
            columns = np.array([hessian(e) for e in np.eye(self.dim)])
            matrices.append(0.5 * (columns + columns.T))
        return matrices

    def curvature_entries(
        self, theta: np.ndarray, rng: np.random.Generator, coordinates: np.ndarray, batches: int = 4
    ) -> np.ndarray:
        """H_ii at ``theta`` for the given coordinates, exactly (one Hessian-vector product
        each), averaged over ``batches`` minibatches."""
        hessian = self._averaged_hessian(theta, self._batch_indices(rng, batches))
        unit = np.eye(self.dim)
        return np.array([hessian(unit[i])[i] for i in coordinates])

    def minibatch_logp(
        self, theta: np.ndarray, rng: np.random.Generator, batches: int = 4
    ) -> float:
        """The minibatch estimate of log p at ``theta``, averaged over ``batches`` minibatches
        (a one-off function, compiled on first use)."""
        fn = self._logp_function
        return float(np.mean([fn(theta, *ix) for ix in self._batch_indices(rng, batches)]))

    def undefined_rows(self, theta: np.ndarray, limit: int = 5) -> np.ndarray:
        """Up to ``limit`` rows of the ``pm.Minibatch`` data on which the log-density at
        ``theta`` is not finite: one pass over the data in minibatch-sized chunks (row r of
        the pass reads row r mod N of each source), then each row of a non-finite chunk as a
        batch of its own (that row repeated). A random batch draws one such row of 5,000
        with probability 0.05 at n = 250, so the construction's check of one batch rarely
        sees it, and every step that draws it diverges. A ``ModelError`` if no chunk and no
        row of the first chunk is finite (then the rows are not the cause)."""
        if not self.sources:
            return np.array([], dtype=int)
        fn, n = self._logp_function, self.batch_size
        total = max(s.total_size for s in self.sources)

        def finite(rows: np.ndarray) -> bool:
            return bool(np.isfinite(fn(theta, *[rows % s.total_size for s in self.sources])))

        starts = np.arange(0, total, n)
        bad_chunks = [start for start in starts if not finite(np.arange(start, start + n))]
        rows_alone_finite = (finite(np.full(n, row)) for row in range(min(n, total)))
        if len(bad_chunks) == len(starts) and not any(rows_alone_finite):
            raise ModelError(
                "the log-density is not finite (NaN or -inf) at the chain's start on any "
                "minibatch of the data, nor on any row of the first batch alone: the prior or a "
                "pm.Potential is not finite there."
            )
        bad: list[int] = []
        for start in bad_chunks:
            for row in range(start, min(start + n, total)):
                if not finite(np.full(n, row)):
                    bad.append(row)
                    if len(bad) == limit:
                        return np.array(bad)
        return np.array(bad, dtype=int)

    @cached_property
    def _logp_function(self):
        return self._one_off_function([self.theta, *self.indices], self.logp)

    def _batch_indices(self, rng: np.random.Generator, batches: int) -> list[list[np.ndarray]]:
        """Index vectors (one per ``pm.Minibatch`` source) of ``batches`` minibatches."""
        idx = self.draw_indices(rng, batches)
        return [[i[b] for i in idx] for b in range(batches)]

    def _averaged_hessian(self, theta: np.ndarray, batch_idx):
        """v -> H v, the Hessian of -log p at ``theta`` averaged over the given minibatches."""
        hvp_fn, _ = self._geometry_functions

        def hessian(v):
            return np.mean([hvp_fn(theta, *ix, v) for ix in batch_idx], axis=0)

        return hessian

    @cached_property
    def _geometry_functions(self):
        hvp_fn = self._hessian_vector_product()
        rows_fn = None
        if self.per_observation_gradients is not None:
            rows_fn = self._one_off_function(
                [self.theta, *self.indices], self.per_observation_gradients
            )
        return hvp_fn, rows_fn

    def _hessian_vector_product(self) -> Callable[..., np.ndarray]:
        """(theta, *indices, v) -> H v, the Hessian of the minibatch's -log p: the gradient of
        F . v where PyTensor can differentiate the force again, else central differences of
        the force on the same rows (the error O(eps^(2/3)) of the Hessian's scale, far
        below the minibatch's own variation). Some ops have a gradient but no second
        derivative: PyMC's Student-t CDF (``pm.Censored(pm.StudentT.dist(nu=nu, ...))`` with
        a free ``nu``) differentiates the incomplete beta function by a ``ScalarLoop``
        that PyTensor cannot differentiate again, and the step size and preconditioner,
        which only need these products, would otherwise stop the model from sampling."""
        v = pt.vector("v", shape=(self.dim,), dtype=self.dtype)
        try:
            hvp = -pt.grad(pt.dot(self.force, v), self.theta)
        except (MethodNotDefined, NotImplementedError, NullTypeGradError):
            return partial(
                _differenced_hessian_vector_product,
                self._one_off_function([self.theta, *self.indices], self.force),
                np.finfo(self.dtype).eps ** (1 / 3),
            )
        return self._one_off_function([self.theta, *self.indices, v], hvp)

    def __getstate__(self):
        # Compiled helpers are rebuilt where needed (pickled to worker processes).
        state = self.__dict__.copy()
        state.pop("_geometry_functions", None)
        state.pop("_full_pass_functions", None)
        state.pop("_one_off_fixed_force", None)
        state.pop("_logp_function", None)
        return state

    def check_data_rows(self) -> None:
        """Check that the ``pm.Data`` arrays read through ``pm.Minibatch`` still have the N
        rows the step was built for: indices are drawn from range(N), and ``pm.set_data``
        with another number of rows would otherwise make them miss rows or run past the end."""
        for source in self.sources:
            for data, name in zip(source.data, source.data_names, strict=True):
                if not isinstance(data, SharedVariable):
                    continue
                rows = len(data.get_value(borrow=True))
                if rows != source.total_size:
                    raise ModelError(
                        f"pm.Minibatch data {name} now have {rows} rows, but the step was built "
                        f"for N={source.total_size} (pm.set_data after building it?). Build the "
                        f"step again, with total_size={rows} on the observed variables."
                    )

    def draw_indices(self, rng: np.random.Generator, steps: int) -> list[np.ndarray]:
        """Row indices for ``steps`` consecutive minibatches, drawn with replacement.

        With replacement, as ``pm.Minibatch`` draws them; ``ALGORITHMS.md`` gives the noise
        covariance for that case.
        """
        return [
            rng.integers(0, s.total_size, size=(steps, s.batch_size), dtype=np.int64)
            for s in self.sources
        ]

    def check_factorisation(self, rng: np.random.Generator | None = None) -> None:
        """Check numerically that the likelihood splits into independent per-row terms.

        Sums of the per-observation gradient rows must reproduce the batch gradient on a random
        batch; a term that couples rows (a batch mean, a joint density) fails this.
        """
        if self.per_observation_gradients is None:
            return
        rng = rng or np.random.default_rng(0)
        batch_force = self.force - self.fixed_force
        fn = self._one_off_function(
            [self.theta, *self.indices],
            [batch_force, self.per_observation_gradients.sum(0)],
        )
        theta = self.initial_theta + 0.1 * rng.standard_normal(self.dim)
        idx = [i[0] for i in self.draw_indices(rng, 1)]
        summed, from_rows = fn(theta, *idx)
        if not np.isfinite(summed).all():
            raise ModelError(
                "the minibatch force is not finite (NaN or Inf) near the model's initial point, "
                "on a random batch: check that the likelihood is defined for every row of the "
                "data, and the initial values the model declares (initval=...)."
            )
        scale = np.max(np.abs(summed)) + 1e-12
        # float32 sums of n rows in two orders differ by ~sqrt(n) 1e-7 relative; a term that
        # couples rows changes the gradient at the order of the term itself.
        rtol, atol = (1e-6, 1e-8) if self.dtype == "float64" else (1e-3, 1e-4)
        if not np.allclose(from_rows, summed, rtol=rtol, atol=atol * scale):
            names = [o.name for obs in self._batch_obs.values() for o in obs]
            raise ModelError(
                f"the minibatch log-likelihood of {names} does not split into independent "
                "per-observation terms (the sum of per-row gradients differs from the batch "
                "gradient by up to "
                f"{np.max(np.abs(from_rows - summed)):.3g}). Each observation's log-density may "
                "depend only on its own row of the minibatch, not on batch statistics."
            )


#: Largest dimension (or number of coordinates) whose Hessian diagonal is computed exactly,
#: one Hessian-vector product per coordinate; above it Hutchinson's estimate, whose error in
#: one coordinate can exceed its value where coordinates are coupled.
EXACT_CURVATURE_DIM = 64

#: The targets a noise-covariance estimate can be shrunk towards (:class:`ShrunkCovariance`).
SHRINKAGE_TARGETS = ("identity", "diagonal")


class Covariance:
    """A symmetric positive semi-definite D x D operator: the minibatch-force covariance in one
    of three forms (low-rank from the per-observation gradients, dense, diagonal)."""

    dim: int

    def matvec(self, v: Variable, single_precision_rows: bool = False) -> Variable:
        """Sigma v. ``single_precision_rows``: of the low-rank estimate's forms, from G rounded
        to float32 (summed in float64), as :meth:`low_rank_parts` gives it; the other forms
        ignore it."""
        raise NotImplementedError

    def trace(self, single_precision_rows: bool = False) -> Variable:
        """tr Sigma. ``single_precision_rows`` as for :meth:`matvec`: a graph computing the
        trace apart from the step (a stat of the stored steps) then reads the float32 rows the
        step wrote for its products, instead of keeping a float64 copy of G."""
        raise NotImplementedError

    def diagonal(self) -> Variable:
        raise NotImplementedError

    def dense(self) -> Variable:
        raise NotImplementedError

    def scaled(self, scale: Variable) -> Covariance:
        """S Sigma S with S = diag(scale): the covariance in the coordinates theta / scale."""
        raise NotImplementedError

    def rotated(self, rotation: Variable) -> Covariance:
        """R^T Sigma R: the covariance of the force R^T F in the coordinates R^-1 theta (a
        dense preconditioner's rotation, :class:`Preconditioner`); only the model's own
        estimates (low-rank rows, dense) are ever rotated."""
        raise NotImplementedError

    def shrunk(self, intensity: Variable, target: str = "identity") -> ShrunkCovariance:
        """(1 - rho) Sigma + rho T: shrinkage towards T = (tr Sigma / D) I ("identity") or
        T = diag(Sigma) ("diagonal")."""
        return ShrunkCovariance(self, intensity, target)

    def solve_shifted(self, alpha, b, v: Variable) -> Variable:
        """(alpha I + b Sigma)^{-1} v for alpha > 0, b >= 0 (NOGIN's damping solve); alpha
        may also be a vector of D positive entries, for diag(alpha) + b Sigma."""
        return on_finite(
            lambda sigma: pt.linalg.solve(
                alpha * pt.eye(self.dim) + b * sigma, v, assume_a="pos", check_finite=False
            ),
            self.dense(),
        )

    def solve_shifted_cg(
        self,
        alpha,
        b,
        v: Variable,
        iterations: int = 200,
        tolerance: float | None = None,
        fixed_count: bool = False,
    ) -> Variable:
        """The same solve by conjugate gradients, with matrix-vector products only
        (:func:`~pymc_sgmcmc.krylov.conjugate_gradients`; in one kernel for the low-rank
        estimate's forms, :class:`~pymc_sgmcmc.krylov.LowRankShiftedSolve`, which stops early
        under JAX too).

        Stops when the residual falls below ``tolerance`` times ||v|| (default 1e-10; in
        float32 at least 1e-5, since its rounding leaves residuals of about 1e-6) or after
        ``iterations`` products. The matrix is well conditioned (its eigenvalues lie in
        [alpha, alpha + b lambda_max]), so a few iterations usually suffice: with a shrunk
        estimate (``ShrunkCovariance``) the spread, hence the count, drops further.
        ``fixed_count=True`` (for JAX, whose scans have no data-dependent length) always runs
        ``iterations`` products on the other forms and freezes the iterate once converged:
        the same result."""
        floor = 1e-5 if v.type.dtype == "float32" else 0.0
        tolerance = max(1e-10 if tolerance is None else tolerance, floor)
        single = reads_single_precision_rows("cg", tolerance)
        parts = self.low_rank_parts(single_precision_rows=single)
        if parts is not None:
            # alpha I + b (c S Gc^T Gc S + d): in one kernel (:mod:`pymc_sgmcmc.krylov`; in
            # JAX, :func:`pymc_sgmcmc.jax_compile.shifted_cg`).
            g, mean, columns, gain, shift = parts
            operator = (g, mean, columns, b * gain, alpha + b * shift)
            return LowRankShiftedSolve(tolerance, iterations)(*operator, v)

        def apply(x):
            return alpha * x + b * self.matvec(x)

        return conjugate_gradients(apply, v, iterations, tolerance, fixed_count)

    def expm_matvec(
        self,
        scale,
        v: Variable,
        tolerance: str = "half",
        max_products: int = 64,
        fixed_count: bool = False,
    ) -> tuple[Variable, Variable]:
        """exp(scale Sigma) v for scale <= 0 with Sigma-vector products only: the Lanczos
        process with a bound on its error (:func:`~pymc_sgmcmc.krylov.lanczos_expm`, where
        the arguments are described), in one kernel for the low-rank estimate's forms
        (:class:`~pymc_sgmcmc.krylov.LowRankExpm`, which stops early under JAX too;
        ``fixed_count`` applies to the other forms). Returns (result, number of Sigma-vector
        products)."""
        single = reads_single_precision_rows("expm", tolerance)
        parts = self.low_rank_parts(single_precision_rows=single)
        if parts is None:
            return lanczos_expm(self.matvec, scale, v, tolerance, max_products, fixed_count)
        return LowRankExpm(tolerance, max_products)(*parts, -pt.as_tensor(scale), v)

    def low_rank_parts(self, single_precision_rows: bool = False) -> tuple[Variable, ...] | None:
        """(G, m, s, c, d) with Sigma x = c s (Gc^T Gc (s x)) + d x, Gc = G - m, for the
        forms of the low-rank estimate; None for the others. ``single_precision_rows``: G
        as float32 (:data:`~pymc_sgmcmc.krylov.SINGLE_PRECISION_ROWS`)."""
        return None


class DenseCovariance(Covariance):
    """Sigma held as a D x D matrix (CCAdL's full moving average, the exact Sigma)."""

    def __init__(self, matrix: Variable, dim: int):
        self.matrix = matrix
        self.dim = dim

    def matvec(self, v, single_precision_rows=False):
        return self.matrix @ v

    def trace(self, single_precision_rows=False):
        return pt.trace(self.matrix)

    def diagonal(self):
        return pt.diagonal(self.matrix)

    def dense(self):
        return self.matrix

    def scaled(self, scale: Variable) -> DenseCovariance:
        return DenseCovariance(scale[:, None] * self.matrix * scale[None, :], self.dim)

    def rotated(self, rotation: Variable) -> DenseCovariance:
        return DenseCovariance(rotation.T @ self.matrix @ rotation, self.dim)

    def expm(self, scale) -> Variable:
        """exp(scale Sigma) as a D x D matrix (Pade approximation with scaling and squaring,
        O(D^3))."""
        return on_finite(lambda sigma: pt.linalg.expm(scale * sigma), self.matrix)

    def inverse_shifted(self, alpha, b) -> Variable:
        """(alpha I + b Sigma)^{-1} as a D x D matrix, alpha > 0, b >= 0 (O(D^3))."""
        # (alpha I + b Sigma)^{-1} = (I + (b / alpha) Sigma)^{-1} / alpha: an alpha * I, which
        # depends on nothing inside a lazy branch, would be computed outside it at every step.
        eye = pt.eye(self.dim, dtype=self.matrix.dtype)
        return (
            on_finite(lambda sigma: pt.linalg.inv((b / alpha) * sigma + eye), self.matrix) / alpha
        )


class DiagonalCovariance(Covariance):
    """Sigma approximated by its diagonal (O(D) storage and products)."""

    def __init__(self, diagonal: Variable, dim: int):
        self.diag = diagonal
        self.dim = dim

    def matvec(self, v, single_precision_rows=False):
        return self.diag * v

    def trace(self, single_precision_rows=False):
        return pt.sum(self.diag)

    def diagonal(self):
        return self.diag

    def dense(self):
        return pt.diag(self.diag)

    def solve_shifted(self, alpha, b, v):
        return v / (alpha + b * self.diag)

    def expm(self, scale) -> Variable:
        """The diagonal of exp(scale Sigma)."""
        return pt.exp(scale * self.diag)

    def inverse_shifted(self, alpha, b) -> Variable:
        """The diagonal of (alpha I + b Sigma)^{-1}."""
        return 1.0 / (alpha + b * self.diag)

    def expm_matvec(self, scale, v, tolerance="half", max_products=64, fixed_count=False):
        # Exact, elementwise: no products with Sigma (0 in the count).
        return pt.exp(scale * self.diag) * v, pt.constant(0, dtype="int64")

    def scaled(self, scale: Variable) -> DiagonalCovariance:
        return DiagonalCovariance(scale**2 * self.diag, self.dim)


class RowCount(NamedTuple):
    """The number of rows n of a :class:`NoiseCovariance`'s gradients, and the factor
    n / (n - 1) of its unbiased estimate."""

    count: Variable
    correction: Variable


class NoiseCovariance(Covariance):
    """Covariance Sigma of the minibatch force, from the per-observation gradients of one batch.

    With rows ``G_i = (N/n) g_i`` (the scaled per-observation gradients) and their centred
    version ``Gc``, Sigma = (N^2/n) V with V = Gc^T Gc / (n - 1) in the unscaled rows
    (``ALGORITHMS.md``, Notation; batches drawn with replacement as ``pm.Minibatch`` does)
    becomes ``Sigma = n / (n - 1) * Gc^T Gc``. Under a preconditioner theta = R S phi the noise
    covariance of the force S R^T F is M^T Sigma M with the column map M = R S (``columns`` =
    the diagonal of S, ``rotation`` = R, absent for a diagonal preconditioner). The products
    apply M to the vector, M^T (Gc^T Gc (M v)), at O(D^2) for a rotation: rotating the rows
    instead, G R, would cost O(n D^2) per step.

    Products never form the D x D matrix, nor the centred or column-scaled n x D matrices:
    each pass over the n x D rows costs about as much as the gradient itself, so
    ``Gc w = G w - (g_mean . w) 1`` and ``Gc^T Gc w = G^T (Gc w)`` (the centred vector sums to
    zero) take one pass (:class:`~pymc_sgmcmc.gram_product.CentredGramProduct`; two where the
    backend has no fused kernel), and the diagonal one, ``sum_i G_i^2 - n g_mean^2``. The row
    mean is the force's row sum, computed once. The uncentred sums lose about
    ``log10(g_mean^2 / var)`` of float64's 16 digits: harmless unless the gradients' mean
    exceeds their spread by many orders of magnitude. The dense and eigen-decomposition paths,
    which cost O(n D^2) anyway, centre explicitly.

    ``gradients=None`` stands for a full-data force, whose noise covariance is zero.
    ``n_rows`` is the batch size, which picks the graph of a solve (Woodbury where D > n);
    ``rows`` gives n and n / (n - 1) as inputs (:meth:`SGModel._batch_rows`), read from the
    gradients' shape where absent.
    """

    def __init__(
        self,
        gradients: Variable | None,
        dim: int,
        n_rows: int = 0,
        columns: Variable | None = None,
        rotation: Variable | None = None,
        rows: RowCount | None = None,
    ):
        self.dim = dim
        self.n_rows = n_rows
        self.is_zero = gradients is None
        self.gradients = gradients
        self.columns = columns
        self.rotation = rotation
        if gradients is not None:
            if rows is None:
                n = gradients.shape[0].astype(gradients.dtype)
                rows = RowCount(n, n / (n - 1.0))
            self.mean = gradients.sum(axis=0) / rows.count
            self.scale = rows.correction
        self.rows = rows

    def _scaled(self, v: Variable) -> Variable:
        return v if self.columns is None else self.columns * v

    def _map(self, v: Variable) -> Variable:
        """M v = R (S v)."""
        scaled = self._scaled(v)
        return scaled if self.rotation is None else self.rotation @ scaled

    def _map_back(self, w: Variable) -> Variable:
        """M^T w = S (R^T w)."""
        return self._scaled(w if self.rotation is None else w @ self.rotation)

    @property
    def centred(self) -> Variable:
        """Gc M = (Gc R) S as an n x D matrix, for the O(n D^2) paths only."""
        centred = self.gradients - self.mean
        return self._scaled(centred if self.rotation is None else centred @ self.rotation)

    def matvec(self, v: Variable, single_precision_rows: bool = False) -> Variable:
        """Sigma v, O(nD)."""
        if self.is_zero:
            return pt.zeros_like(v)
        # G^T (G w - m . w) in one pass over the rows (:mod:`pymc_sgmcmc.gram_product`).
        product = CentredGramProduct()(self._rows(single_precision_rows), self.mean, self._map(v))
        return self.scale * self._map_back(product)

    def _rows(self, single_precision_rows: bool) -> Variable:
        """G, or G rounded to float32: cast where G is computed, so that the fused loop
        writing G writes float32."""
        return self.gradients.astype("float32") if single_precision_rows else self.gradients

    def low_rank_parts(self, single_precision_rows=False):
        if self.is_zero:
            return None
        ones = pt.ones(self.dim, dtype=self.gradients.dtype)
        columns = ones if self.columns is None else self.columns
        if self.rotation is not None:
            columns = self.rotation * columns[None, :]  # M = R S
        rows = self._rows(single_precision_rows)
        # The kernels take the gain as a scalar.
        gain = self.scale.squeeze() if self.scale.ndim else self.scale
        return rows, self.mean, columns, gain, pt.zeros_like(ones)

    def dense(self) -> Variable:
        """Sigma as a D x D matrix (O(n D^2); for small D and for tests)."""
        if self.is_zero:
            return pt.zeros((self.dim, self.dim))
        if self.rotation is not None:
            # M^T (c Gc^T Gc) M, its Gram matrix shared with the diagonal and the trace.
            rotated = self.rotation.T @ self._theta_gram() @ self.rotation
            return self._scaled(self._scaled(rotated).T)
        centred = self.centred
        return self.scale * pt.dot(centred.T, centred)

    def _theta_gram(self, single_precision_rows: bool = False) -> Variable:
        """c Gc^T Gc: Sigma in the model's coordinates, before the column map (O(n D^2))."""
        rows = self._rows(single_precision_rows).astype(self.gradients.dtype)
        centred = rows - self.mean
        return self.scale * (centred.T @ centred)

    def trace(self, single_precision_rows=False) -> Variable:
        if self.is_zero:
            return pt.constant(0.0)
        return pt.sum(self.diagonal(single_precision_rows))

    def diagonal(self, single_precision_rows: bool = False) -> Variable:
        if self.is_zero:
            return pt.zeros(self.dim)
        if self.rotation is not None:
            # diag(R^T Sigma R)_j = sum_i R_ij (Sigma R)_ij, from the D x D Gram matrix (O(n D^2),
            # which CCAdL's dense estimate shares): CCAdL, and the trace stat.
            sigma = self._theta_gram(single_precision_rows)
            rotated = pt.sum(self.rotation * (sigma @ self.rotation), axis=0)
            return self._scaled(self._scaled(pt.maximum(rotated, 0.0)))
        rows = self._rows(single_precision_rows).astype(self.gradients.dtype)
        squares = pt.sum(rows**2, axis=0) - self.rows.count * self.mean**2
        # Rounding can leave a tiny negative variance where a column is (nearly) constant.
        return self.scale * self._scaled(self._scaled(pt.maximum(squares, 0.0)))

    def scaled(self, scale: Variable) -> NoiseCovariance:
        if self.is_zero:
            return self
        columns = scale if self.columns is None else self.columns * scale
        return NoiseCovariance(
            self.gradients, self.dim, self.n_rows, columns, self.rotation, self.rows
        )

    def rotated(self, rotation: Variable) -> NoiseCovariance:
        # The model's rows are kept: products map the vector (M^T Gc^T Gc M v), and the fused
        # kernels and Krylov ops take M = R S as their column map.
        if self.is_zero:
            return self
        if self.columns is not None or self.rotation is not None:
            raise ValueError("rotate the model's estimate once, before scaling its columns")
        return NoiseCovariance(
            self.gradients, self.dim, self.n_rows, rotation=rotation, rows=self.rows
        )

    def as_form(self, form: str) -> Covariance:
        """The same Sigma as "lowrank" (this object), "full" (D x D) or "diag"."""
        if form == "lowrank" or self.is_zero:
            return self
        if form == "full":
            return DenseCovariance(self.dense(), self.dim)
        if form == "diag":
            return DiagonalCovariance(self.diagonal(), self.dim)
        raise ValueError(f"covariance form must be 'lowrank', 'full' or 'diag', got {form!r}")

    def solve_shifted(self, alpha, b, v: Variable) -> Variable:
        """(alpha I + b Sigma)^{-1} v: a D x D solve when D <= n, else Woodbury through the
        n x n system. With Sigma = c Gc^T Gc and a diagonal A = diag(alpha) (alpha a scalar
        or a vector), W = Gc A^{-1/2}: (A + b c Gc^T Gc)^{-1} v
        = A^{-1/2} (u - W^T (I / (b c) + W W^T)^{-1} W u), u = A^{-1/2} v."""
        if self.is_zero:
            return v / alpha
        if self.dim <= self.n_rows:
            return super().solve_shifted(alpha, b, v)
        root = pt.sqrt(alpha)
        w = self.centred / root
        u = v / root
        # b = 0 (full shrinkage) makes the diagonal infinite, legitimately: only the data's
        # Gram matrix is checked.
        inner = on_finite(
            lambda gram: pt.linalg.solve(
                pt.eye(w.shape[0]) / (b * self.scale) + gram,
                w @ u,
                assume_a="pos",
                check_finite=False,
            ),
            w @ w.T,
        )
        return (u - w.T @ inner) / root

    def sqrt_shifted_matvec(self, a, b, v: Variable) -> tuple[Variable, Variable]:
        """(a I - b Sigma)^{1/2} v, and the smallest eigenvalue of a I - b Sigma.

        Exact, through an eigen-decomposition in the smaller of the two spaces: of Sigma itself
        (D x D) when D <= n, else of the n x n Gram matrix Gc Gc^T = U S^2 U^T, from which
        Sigma = c W S^2 W^T with W = Gc^T U S^{-1} and
        (a I - b Sigma)^{1/2} = sqrt(a) I + W (sqrt(a - b c S^2) - sqrt(a)) W^T.
        Negative eigenvalues of a I - b Sigma are clipped to zero (no noise along those
        directions); the caller reports them through the returned minimum.
        """
        if self.is_zero:
            return pt.sqrt(a) * v, pt.as_tensor(a).astype("float64")
        if self.dim <= self.n_rows:
            eigvals, eigvecs = on_finite(pt.linalg.eigh, self.dense())
            shifted = a - b * eigvals
            root = eigvecs @ (pt.sqrt(pt.maximum(shifted, 0.0)) * (eigvecs.T @ v))
            return root, pt.min(shifted)
        centred = self.centred
        s2, u = on_finite(pt.linalg.eigh, centred @ centred.T)
        s2 = pt.maximum(s2, 0.0)
        nonzero = s2 > 1e-12 * pt.max(s2) + 1e-300
        w = (centred.T @ u) * pt.switch(nonzero, 1.0 / pt.sqrt(pt.switch(nonzero, s2, 1.0)), 0.0)
        shifted = a - b * self.scale * s2
        coefficient = pt.sqrt(pt.maximum(shifted, 0.0)) - pt.sqrt(a)
        root = pt.sqrt(a) * v + w @ (coefficient * (w.T @ v))
        return root, pt.minimum(pt.min(shifted), a)


class ShrunkCovariance(Covariance):
    r"""The estimate shrunk towards a structured target, :math:`(1 - \rho)\hat\Sigma + \rho T`:
    ``target="identity"``, :math:`T = \mu I` with :math:`\mu = \operatorname{tr}\hat\Sigma / D`
    (Ledoit & Wolf 2004), or ``target="diagonal"``, :math:`T = \operatorname{diag}\hat\Sigma`
    (Schäfer & Strimmer 2005, their target D: only the correlations are shrunk).

    The sample covariance of n per-observation gradients spreads its eigenvalues (at D/n = 0.2
    the Marchenko-Pastur law puts them between 0.3 and 2.1 times their mean for an isotropic
    truth). The covariance-controlled integrators subtract that estimate from the gradient
    noise actually present; directions where it falls short are under-damped and heat up, the
    variance inflation that grows with the step size (issue text: NOGIN's variance ratio 1.47 at
    h = 5e-3 with the raw estimate, 0.98 with the exact covariance). The intensity that
    minimises the expected Frobenius error is estimated from the same n rows
    (:func:`ledoit_wolf_statistics`). Every operation reduces to one of the base estimate with
    shifted coefficients (a scalar shift for the identity target, a diagonal one for the
    diagonal target), so the low-rank, Woodbury and Lanczos paths are kept and cost the same.
    """

    def __init__(self, base: Covariance, intensity: Variable, target: str = "identity"):
        if target not in SHRINKAGE_TARGETS:
            raise ValueError(f"shrinkage target must be one of {SHRINKAGE_TARGETS}, got {target!r}")
        self.base = base
        self.dim = base.dim
        self.target = target
        self.intensity = pt.as_tensor(intensity)
        # rho T as a scalar multiple of I or as the diagonal of a diagonal matrix.
        if target == "identity":
            self.level = self.intensity * base.trace() / base.dim
        else:
            self.level = self.intensity * base.diagonal()

    def matvec(self, v, single_precision_rows=False):
        base = self.base.matvec(v, single_precision_rows)
        return (1.0 - self.intensity) * base + self.level * v

    def low_rank_parts(self, single_precision_rows=False):
        parts = self.base.low_rank_parts(single_precision_rows)
        if parts is None:
            return None
        g, mean, columns, gain, shift = parts
        keep = 1.0 - self.intensity
        return g, mean, columns, keep * gain, keep * shift + self.level

    def trace(self, single_precision_rows=False):
        if not single_precision_rows:
            return self.base.trace()  # (1 - rho) tr S + rho tr T, and tr T = tr S
        # (1 - rho) tr S for the rows the kernels read, plus the target's share, whose trace
        # is that of S itself.
        rho = self.intensity
        return (1.0 - rho) * self.base.trace(True) + rho * self.base.trace()

    def diagonal(self):
        return (1.0 - self.intensity) * self.base.diagonal() + self.level

    def dense(self):
        level = self.level * pt.eye(self.dim) if self.target == "identity" else pt.diag(self.level)
        return (1.0 - self.intensity) * self.base.dense() + level

    def solve_shifted(self, alpha, b, v):
        # alpha I + b ((1 - rho) S + rho T) = (alpha + b rho T) + b (1 - rho) S, with the
        # first term a multiple of I or a diagonal matrix.
        return self.base.solve_shifted(alpha + b * self.level, b * (1.0 - self.intensity), v)

    def sqrt_shifted_matvec(self, a, b, v):
        if self.target != "identity":
            raise NotImplementedError("(a I - b Sigma)^(1/2) with a diagonal shrinkage target")
        return self.base.sqrt_shifted_matvec(a - b * self.level, b * (1.0 - self.intensity), v)


def moving_average(previous, count, estimate, weight: float | None):
    """The running estimate after the ``count``-th one (count >= 1): weight kappa_t = 1/t on the
    newest, an equal-weight mean of all so far (CCAdL's kappa_t, ``weight=None``), or
    max(1/t, weight): the mean of the first 1/weight estimates, then an exponential moving
    average with that weight (a window of about 2/weight - 1 estimates)."""
    kappa = 1.0 / count if weight is None else pt.maximum(1.0 / count, weight)
    return (1.0 - kappa) * previous + kappa * estimate


def ledoit_wolf_statistics(rows: np.ndarray, target: str = "identity") -> tuple[float, float]:
    r"""The shrinkage statistics of n rows for a target T: the estimation error of their
    covariance and its distance from T, whose ratio (clipped to [0, 1]) is the intensity that
    minimises the expected Frobenius error.

    With the centred rows :math:`x_i`, :math:`S = \tfrac1n\sum_i x_i x_i^\top`:

    * ``"identity"``, :math:`T = \mu I`, :math:`\mu = \operatorname{tr} S / D` (Ledoit & Wolf
      2004, Lemma 3.3 and Theorem 3.4): :math:`\bar\beta^2 = \tfrac{1}{n^2}\sum_i
      \|x_i x_i^\top - S\|_F^2 = \tfrac{1}{n^2}(\sum_i \|x_i\|^4 - n \|S\|_F^2)` and
      :math:`\delta^2 = \|S - \mu I\|_F^2`;
    * ``"diagonal"``, :math:`T = \operatorname{diag} S` (Schäfer & Strimmer 2005, target D,
      in the same 1/n normalisation): both sums over the off-diagonal entries only,
      :math:`\bar\beta^2 = \tfrac{1}{n^2}(\sum_i (\|x_i\|^4 - \sum_j x_{ij}^4)
      - n(\|S\|_F^2 - \sum_j S_{jj}^2))` and :math:`\delta^2 = \|S\|_F^2 - \sum_j S_{jj}^2`.

    :math:`\|S\|_F^2` comes from the smaller of the n x n and D x D Gram matrices. Both are
    invariant to a common scale of the rows, as the intensity must be.
    """
    if target not in SHRINKAGE_TARGETS:
        raise ValueError(f"shrinkage target must be one of {SHRINKAGE_TARGETS}, got {target!r}")
    centred = rows - rows.mean(axis=0)
    n, dim = centred.shape
    gram = centred @ centred.T if n <= dim else centred.T @ centred
    frobenius2 = float(np.sum(gram**2)) / n**2  # ||S||_F^2
    norms2 = np.sum(centred**2, axis=1)
    if target == "identity":
        mu = float(np.sum(norms2)) / (n * dim)
        beta2 = (float(np.sum(norms2**2)) - n * frobenius2) / n**2
        delta2 = frobenius2 - dim * mu**2
    else:
        diagonal2 = float(np.sum((np.sum(centred**2, axis=0) / n) ** 2))  # sum_j S_jj^2
        fourth = float(np.sum(norms2**2) - np.sum(centred**4))
        beta2 = (fourth - n * (frobenius2 - diagonal2)) / n**2
        delta2 = frobenius2 - diagonal2
    return max(beta2, 0.0), max(delta2, 0.0)


@dataclass(frozen=True)
class ControlVariate:
    r"""The control-variate force of Baker, Fearnhead, Fox & Nemeth (2019, eq. 4),

    .. math:: \tilde F_{cv}(\theta) = F(\hat\theta) + \tilde F(\theta) - \tilde F(\hat\theta),

    with :math:`F(\hat\theta)` the exact (full-data) force at an anchor and both minibatch
    forces on the same rows: unbiased, and its noise, the spread of
    :math:`g_i(\theta) - g_i(\hat\theta)`, vanishes as :math:`\theta \to \hat\theta`
    instead of staying at the data's spread. Symbolic anchor and anchor force, in theta.
    """

    anchor: Variable
    anchor_force: Variable


@dataclass(frozen=True)
class Preconditioner:
    """The sampler's coordinates phi: theta = R (s * phi), with s = ``scale`` (a diagonal
    preconditioner) and, when the posterior correlates its coordinates too strongly for a
    diagonal one, R = ``rotation``, a D x D matrix (a dense preconditioner:
    mass matrix M = (R S)^-T (R S)^-1). The entries are NumPy arrays on the host, or the
    compiled functions' symbolic inputs: the same expressions serve both.

    A force (a gradient of log p in theta) and per-observation gradient rows pull back to
    phi as S R^T F (rows: G R S), a covariance as S R^T Sigma R S; so every operator of
    every integrator (A, B, O, C, D) is preconditioned consistently by writing it for phi.
    """

    scale: np.ndarray | Variable
    rotation: np.ndarray | Variable | None = None

    def to_theta(self, phi):
        """theta for the coordinates phi (a vector, or rows of them)."""
        scaled = self.scale * phi
        return scaled if self.rotation is None else scaled @ self.rotation.T

    def matrix(self) -> np.ndarray:
        """R S, the D x D matrix of theta = (R S) phi (host only)."""
        return self.to_theta(np.eye(len(self.scale))).T

    def to_phi(self, theta: np.ndarray) -> np.ndarray:
        """phi for a position theta (host only)."""
        if self.rotation is not None:
            theta = np.linalg.solve(self.rotation, theta)  # D <= adaptation.DENSE_MAX_DIM
        return theta / self.scale

    def pull_back(self, gradient):
        """A gradient in theta (a vector, or per-observation rows) in the coordinates phi:
        S R^T g (rows: G R S)."""
        rotated = gradient if self.rotation is None else gradient @ self.rotation
        return self.scale * rotated

    def covariance(self, sigma: Covariance) -> Covariance:
        """The force's noise covariance in phi: S R^T Sigma R S."""
        rotated = sigma if self.rotation is None else sigma.rotated(self.rotation)
        return rotated.scaled(self.scale)


class PreconditionedTarget:
    """The model in the coordinates phi of a :class:`Preconditioner`: sampling phi with unit
    mass is sampling theta with the preconditioner's mass matrix. The preconditioner's
    entries are symbolic inputs, so a new one needs no recompilation (a new kind, diagonal
    or dense, does)."""

    def __init__(
        self,
        model: SGModel,
        preconditioner: Preconditioner,
        shrinkage: Variable,
        control: ControlVariate | None = None,
    ):
        self.model = model
        self.preconditioner = preconditioner
        self.shrinkage = shrinkage  # for the samplers' noise_shrinkage option
        self.control = control  # control variates (in theta), or None

    def position(self, phi: Variable) -> Variable:
        """theta for the coordinates phi."""
        return self.preconditioner.to_theta(phi)

    def force(self, phi: Variable, indices: Sequence[Variable]) -> Variable:
        force = self.model.force_at(self.position(phi), indices, self.control)
        return self.preconditioner.pull_back(force)

    def force_and_noise(self, phi: Variable, indices: Sequence[Variable], optional: bool = False):
        force, sigma = self.model.force_and_noise(
            self.position(phi), indices, optional, self.control
        )
        return self.preconditioner.pull_back(force), self.preconditioner.covariance(sigma)

    def exact_noise_covariance(self, phi: Variable) -> DenseCovariance:
        sigma = self.model.exact_noise_covariance(self.position(phi))
        return self.preconditioner.covariance(sigma)


def _differenced_hessian_vector_product(
    force_fn: Callable[..., np.ndarray], relative_step: float, theta: np.ndarray, *args
) -> np.ndarray:
    """H v = -(F(theta + e v) - F(theta - e v)) / (2 e) on the rows ``args[:-1]`` (``v`` is
    ``args[-1]``), with e v of length ``relative_step`` max(1, |theta|): the step that
    balances the central difference's truncation error against the force's rounding."""
    *indices, v = args
    length = np.linalg.norm(v)
    if length == 0:
        return np.zeros_like(v)
    e = relative_step * max(1.0, float(np.linalg.norm(theta))) / length
    return -(force_fn(theta + e * v, *indices) - force_fn(theta - e * v, *indices)) / (2 * e)
