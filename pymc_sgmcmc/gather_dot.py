"""Fused minibatch products: ``X[idx] @ B`` and ``X[idx].T @ R`` without gathering ``X[idx]``.

A minibatch likelihood that is linear in the data (``pm.Minibatch(X) @ w`` in a regression or
a GLM) needs two products per step: ``z = X[idx] @ w`` for the log-density and
``g = X[idx].T @ r`` for its gradient. PyTensor computes them as written: it copies the ``n``
rows of ``X`` into a new ``(n, D)`` array and hands that copy to BLAS twice. For the small
products of SG-MCMC the copy is a large part of the work (in isolation, numba's fancy indexing
took as long as the two products on the copy, or longer, to copy 500 random rows of 50-100
doubles).
In a whole SGLD step the fusion saves 5-9 % on the benchmark's linear regression (N = 10,000,
D = 100, n = 500) and 5-14 % on its logistic regression (N = 50,000, D = 50), where the rest
is mostly the likelihood's elementwise work (``benchmarks/engine.py``, two runs).

:class:`~pymc_sgmcmc.gather_dot.GatherDot` and :class:`~pymc_sgmcmc.gather_dot.GatherTDot`
read the rows where they are, four at a time (four independent sums keep the floating-point
pipeline busy), and the rewrite ``fuse_gather_dots`` puts them in place of
``Dot(AdvancedSubtensor(X, idx), B)`` and ``Dot(AdvancedSubtensor(X, idx).T, R)`` in a
compiled graph. The rewrite is registered under the tag ``sgmcmc_gather_dot`` and is off by
default (it changes nothing for other PyTensor users); the samplers include it for the numba
backend (:func:`~pymc_sgmcmc.gather_dot.with_gather_dot`), where the ops have their fused
kernels. Other backends keep PyTensor's graph.

A second rewrite, ``fuse_glm_products``, goes one step further where the gradient is
``X[idx].T @ f(X[idx] @ w, ...)`` for an elementwise ``f`` and nothing else reads
``X[idx] @ w``: :class:`~pymc_sgmcmc.gather_dot.GatherGLMProduct` computes it in one pass
over the rows (about 30 % of an SGLD step on the linear regression, 12 % on the logistic one).
The force with control variates reads the same rows at the draw and at the anchor, and
PyTensor fuses the two residuals into one ``Elemwise`` of two outputs: one op with two
predictors and two outputs computes both gradients in the same pass (without it the two
residuals' fusion kept both gradients in separate products, four passes over the rows).
In the same pass, ``fuse_glm_sums`` puts :class:`~pymc_sgmcmc.gather_dot.GatherGLMSum` in
place of the log-likelihood ``sum(f(X[idx] @ w, y[idx], ...))``, which the blocks compute
at the stored draws: one kernel in place of a product, a copy and a reduction, which numba
compiled for longer.

The covariance samplers (mSGLD, mCCAdL, NOGIN) need every row's gradient
``x_i f(z_i, y_i)`` (rounded to float32 for their low-rank products) and the rows' sum, the
force. PyTensor's fused loop writes both while it reads the rows, but it needs the predictors
first, from a product that has already read every row once (the anchor's predictors a third
time with control variates). ``fuse_glm_rows`` puts
:class:`~pymc_sgmcmc.gather_dot.GatherGLMRows` in their place: one read of each row gives its
predictors, its weights and its entries of the rows and of their sum. mCCAdL's step took
43.5 instead of 51.2 µs and NOGIN's 43.3 instead of 49.9 µs on the benchmark's linear
regression (D = 100, n = 500, h = 1e-7), and with control variates 46.0 instead of 58.9 and
44.4 instead of 57.8 µs (one run each, old and new code in turn, 2026-12-05).

Both single passes read the observed values ``y[idx]`` (any vector ``v[idx]`` that ``f``
or ``h`` takes as an (n, 1) column) in place, at the rows of X they read, prefetched with
them, as ``GatherGLMSum`` does: PyTensor copied ``y[idx]`` into a new array every step
(about 1 µs for 500 of 10,000 values in numba's indexing, 3 µs for 1,000 of 10^6). Such a
vector must have X's number of rows, as ``pm.Minibatch`` asserts of the arrays it
minibatches together; another length raises ``ValueError``.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import ClassVar

import numba
import numpy as np
import pytensor.tensor as pt
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload
from pytensor.compile import optdb
from pytensor.compile.mode import Mode, get_mode
from pytensor.graph.basic import Apply, Constant
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.link.numba.cache import compile_numba_function_src
from pytensor.link.numba.dispatch.basic import (
    numba_funcify_and_cache_key,
    numba_njit,
    register_funcify_and_cache_key,
    register_funcify_default_op_cache_key,
)
from pytensor.link.numba.linker import NumbaLinker
from pytensor.scalar import get_scalar_type, upcast
from pytensor.tensor.basic import as_tensor_variable
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.math import Dot, Sum
from pytensor.tensor.shape import SpecifyShape
from pytensor.tensor.subtensor import AdvancedSubtensor

TAG = "sgmcmc_gather_dot"


def _known_shape(shape, out_shape) -> tuple[int | None, ...]:
    """The static output shape: from the operands' types, else the one the op was given."""
    return tuple(s if s is not None else o for s, o in zip(shape, out_shape, strict=True))


class _GatherProduct(Op):
    """A product with the rows ``idx`` (n,) of a matrix ``X`` (N, D) and a matrix operand;
    subclasses give the output's static shape and the NumPy reference (``perform``)."""

    __props__ = ("out_shape",)
    #: Whether the operand may be a vector, standing for its one-column matrix.
    takes_vectors: ClassVar[bool] = False

    def __init__(self, out_shape: tuple[int | None, int | None] = (None, None)):
        # A static output shape known from the graph the op replaces (when X's shape is not
        # static): the product then needs no SpecifyShape, whose numba check formats an error
        # message and costs about a second of a cold compile.
        self.out_shape = tuple(out_shape)

    @staticmethod
    def _shape(x, idx, b) -> tuple[int | None, int | None]:
        raise NotImplementedError

    @staticmethod
    def _numpy(x, idx, b) -> np.ndarray:
        raise NotImplementedError

    def make_node(self, x, idx, b):
        x, idx, b = map(as_tensor_variable, (x, idx, b))
        if b.type.ndim not in ((1, 2) if self.takes_vectors else (2,)):
            raise TypeError(f"{type(self).__name__}: the operand does not fit")
        dtype = upcast(x.dtype, b.dtype)
        shape = _known_shape(self._shape(x.type, idx.type, b.type), self.out_shape)
        out = pt.tensor(dtype=dtype, shape=shape)
        return Apply(self, [x, idx, b], [out])

    def perform(self, node, inputs, outputs):
        out = np.asarray(self._numpy(*inputs), dtype=node.outputs[0].dtype)
        if not node.outputs[0].type.is_valid_value(out):
            raise ValueError(f"{type(self).__name__}: shapes do not match")
        outputs[0][0] = out


class GatherDot(_GatherProduct):
    """``X[idx] @ B`` for a matrix ``X`` (N, D), integer rows ``idx`` (n,) and ``B`` (D, k),
    or ``X[idx] @ b[:, None]`` (n, 1) for a vector ``b`` (D,).

    PyTensor writes the product of a vector of coefficients as that of a one-column matrix,
    ``b[:, None]``. Taking ``b`` itself (``fuse_gather_dots``) leaves no ``ExpandDims`` in the
    graph, and no column to copy in the kernels of the fused ops that replace the product: a
    numba ``DimShuffle`` and the column's copy each cost about 0.1-0.5 s of a cold compile."""

    takes_vectors = True

    @staticmethod
    def _shape(x, idx, b):
        return idx.shape[0], b.shape[1] if b.ndim == 2 else 1

    @staticmethod
    def _numpy(x, idx, b):
        return x[idx] @ _as_column(b)


class GatherTDot(_GatherProduct):
    """``X[idx].T @ R`` for a matrix ``X`` (N, D), integer rows ``idx`` (n,) and ``R`` (n, k)."""

    @staticmethod
    def _shape(x, idx, r):
        return x.shape[1], r.shape[1]

    @staticmethod
    def _numpy(x, idx, r):
        return x[idx].T @ r


def _as_column(b: np.ndarray) -> np.ndarray:
    """A vector of coefficients as the one-column matrix it stands for; a matrix as it is."""
    return b[:, None] if b.ndim == 1 else b


def _gathered_operands_fit(gathered: tuple[bool, ...], operands) -> bool:
    """Whether ``gathered`` (empty: none) marks exactly the vectors among ``operands``, the
    others being 2-d."""
    marks = gathered or (False,) * len(operands)
    return len(marks) == len(operands) and all(
        v.type.ndim == (1 if g else 2) for g, v in zip(marks, operands, strict=True)
    )


#: The error of a gathered vector (the observed values) whose length is not X's number of
#: rows: the kernels read it at X's rows, checked once, instead of checking every index again.
#: ``pm.Minibatch`` asserts the same of the arrays it minibatches together.
_ROWS_DIFFER = "a vector read at the minibatch rows (the observed values) and X differ in length"


def _read_gathered(gathered: tuple[bool, ...], operands: list, x, idx) -> list:
    """``operands`` with each gathered vector ``v`` read at the minibatch rows, as the
    (n, 1) column ``v[idx][:, None]`` it stands for; ``v`` must have X's number of rows."""
    if not gathered:
        return list(operands)
    if any(g and len(v) != len(x) for g, v in zip(gathered, operands, strict=True)):
        raise ValueError(_ROWS_DIFFER)
    return [v[idx][:, None] if g else v for g, v in zip(gathered, operands, strict=True)]


class GatherGLMProduct(Op):
    """``X[idx].T @ f(X[idx] @ b_1, ..., X[idx] @ b_m, a_1, ...)`` in one pass over the
    minibatch rows.

    ``f`` is an elementwise function (``scalar_op``, a PyTensor scalar op such as the
    ``Composite`` of a fused ``Elemwise``) of linear predictors ``z_k = X[idx] @ b_k`` (its
    arguments ``z_positions``) and further columns ``a_k`` of shape (n, 1) or (1, 1): the
    gradient of a likelihood that reads the data through one linear predictor (a linear or
    generalised linear regression). Each row of ``X[idx]`` is read once: its weight
    ``f(z_i, ...)`` is known as soon as its dot product is, and the row is added to the
    gradient while it is still in the L1 cache. The two separate products read the n rows twice
    (the second time from L2): in isolation the single pass took 20 instead of 27-30 us for
    500 random rows of an X of 10,000 x 100 (14 instead of 21 us for rows already in cache).

    With several predictors and an ``f`` of several outputs, one output ``X[idx].T @ f_k``
    per output of ``f``: the force with control variates, ``g(theta) - g(anchor)`` over the
    same rows, needs the gradient at two positions, whose predictors and weights PyTensor
    fuses into one ``Elemwise`` of two outputs. One pass reads each row for both.

    A column marked in ``gathered`` is a whole (N,) vector, such as the observed values,
    read at each minibatch row (``a_k[idx[i]]``) where the graph copied ``a_k[idx]`` into a
    column. The kernel reads it at X's row index, already checked: it must have X's number
    of rows (``ValueError`` otherwise).

    Each ``b_k`` is a one-column matrix or a vector (see :class:`GatherDot`). With an
    ``out_shape`` of length 1 the outputs are D-vectors instead of one-column matrices
    (``fuse_glm_products``): the gradient of a vector of coefficients, which PyTensor takes
    with a ``Squeeze`` of the product's column.
    """

    __props__ = ("scalar_op", "z_positions", "out_shape", "gathered")

    def __init__(
        self,
        scalar_op,
        z_positions: tuple[int, ...],
        out_shape: tuple[int | None, int | None],
        gathered: tuple[bool, ...] = (),
    ):
        self.scalar_op = scalar_op
        self.z_positions = tuple(z_positions)
        self.out_shape = tuple(out_shape)
        self.gathered = tuple(bool(g) for g in gathered)

    @property
    def vectors(self) -> bool:
        """Whether the outputs are vectors (else one-column matrices)."""
        return len(self.out_shape) == 1

    def make_node(self, x, idx, *operands):
        x, idx, *operands = map(as_tensor_variable, (x, idx, *operands))
        if len(operands) < len(self.z_positions):
            raise TypeError("GatherGLMProduct: one b per predictor")
        if any(b.type.ndim not in (1, 2) for b in operands[: len(self.z_positions)]):
            raise TypeError("GatherGLMProduct: each b is a vector or a one-column matrix")
        columns = operands[len(self.z_positions) :]
        if not _gathered_operands_fit(self.gathered, columns):
            raise TypeError("GatherGLMProduct: gathered columns are vectors, the others 2-d")
        shape = (x.type.shape[1],) if self.vectors else (x.type.shape[1], 1)
        shape = _known_shape(shape, self.out_shape)
        # In the predictors' type: float64 for float32 rows of a float64 model.
        dtype = upcast(x.type.dtype, *(b.type.dtype for b in operands[: len(self.z_positions)]))
        outputs = [pt.tensor(dtype=dtype, shape=shape) for _ in range(self.scalar_op.nout)]
        return Apply(self, [x, idx, *operands], outputs)

    def _arguments(self, predictors: list, columns: list) -> list:
        """``f``'s arguments: the predictors at ``z_positions``, the columns in order."""
        args, rest = [], iter(columns)
        by_position = dict(zip(self.z_positions, predictors, strict=True))
        for k in range(len(predictors) + len(columns)):
            args.append(by_position[k] if k in by_position else next(rest))
        return args

    def perform(self, node, inputs, outputs):
        x, idx, *operands = inputs
        m = len(self.z_positions)
        bs, columns = [_as_column(b) for b in operands[:m]], operands[m:]
        rows = x[idx]
        columns = _read_gathered(self.gathered, columns, x, idx)
        for column, var in zip(columns, node.inputs[2 + m :], strict=True):
            if var.type.ndim == 1:  # read at the rows: checked by the indexing
                continue
            expected = (1, 1) if var.type.broadcastable[0] else (len(idx), 1)
            if column.shape != expected:
                raise ValueError("GatherGLMProduct: shapes do not match")
        predictors = [rows @ b for b in bs]
        args = self._arguments(predictors, columns)
        weights = np.frompyfunc(self.scalar_op.impl, len(args), self.scalar_op.nout)(*args)
        weights = weights if self.scalar_op.nout > 1 else (weights,)
        for output, var, w in zip(outputs, node.outputs, weights, strict=True):
            out = rows.T @ np.asarray(w, dtype=var.type.dtype)
            out = out[:, 0] if self.vectors else out
            if not var.type.is_valid_value(out):
                raise ValueError("GatherGLMProduct: shapes do not match")
            output[0] = out


class GatherGLMSum(Op):
    """``sum(f(X[idx] @ b, a_1, ..., a_m))`` in one pass over the minibatch rows.

    The minibatch log-likelihood of a likelihood that reads the data through one linear
    predictor, as :class:`GatherGLMProduct` is its gradient: ``f`` (``scalar_op``) is the
    fused elementwise log-density of a row, of the predictor ``z = X[idx] @ b`` (argument
    ``z_position``) and further vectors ``a_k``, of shape (n,) or (1,), or read at the
    minibatch's rows (``gathered[k]``: ``a_k`` is then a whole (N,) column such as the
    observed values, read at ``a_k[idx[i]]`` where the graph copied ``a_k[idx]``). The sum is
    accumulated in ``acc_dtype`` and returned as a ``dtype`` scalar, as PyTensor's ``Sum``.
    ``b`` is a one-column matrix or a vector (see :class:`GatherDot`).

    SGLD's block computes the log-density at the steps whose draws the host reads, in a
    lazy branch of its own. There the one kernel, in place of the product, the copy of the
    observed values and the reduction, took 1.4 s on average off SGLD's cold first draw on
    the D = 100 regression (-0.3 to 2.9 s, three runs of about 16 s started together with
    the old code's on a slow host, 2026-12-03; ``docs/performance.md``), with the same value
    to the last bit.
    """

    __props__ = ("scalar_op", "z_position", "gathered", "acc_dtype", "dtype")

    def __init__(self, scalar_op, z_position: int, gathered, acc_dtype: str, dtype: str):
        self.scalar_op = scalar_op
        self.z_position = z_position
        self.gathered = tuple(bool(g) for g in gathered)
        self.acc_dtype = acc_dtype
        self.dtype = dtype

    def make_node(self, x, idx, b, *columns):
        x, idx, b, *columns = map(as_tensor_variable, (x, idx, b, *columns))
        if len(columns) != len(self.gathered) or any(c.type.ndim != 1 for c in columns):
            raise TypeError("GatherGLMSum: one vector per argument of f besides z")
        if b.type.ndim not in (1, 2):
            raise TypeError("GatherGLMSum: b is a vector or a one-column matrix")
        return Apply(self, [x, idx, b, *columns], [pt.tensor(dtype=self.dtype, shape=())])

    def _values(self, z: np.ndarray, columns: list[np.ndarray]) -> np.ndarray:
        args = list(columns)
        args.insert(self.z_position, z)
        scalar_types = [get_scalar_type(a.dtype) for a in args]
        (out_type,) = self.scalar_op.output_types(scalar_types)
        f = np.frompyfunc(self.scalar_op.impl, len(args), 1)
        return np.asarray(f(*args), dtype=out_type.dtype)

    def perform(self, node, inputs, outputs):
        x, idx, b, *columns = inputs
        n = len(idx)
        b = _as_column(b)
        if b.shape != (x.shape[1], 1):
            raise ValueError("GatherGLMSum: shapes do not match")
        read = []
        for column, var, gathered in zip(columns, node.inputs[3:], self.gathered, strict=True):
            if gathered:
                column = column[idx]
            elif column.shape[0] != (1 if var.type.broadcastable[0] else n):
                raise ValueError("GatherGLMSum: shapes do not match")
            read.append(column)
        values = self._values(x[idx] @ b[:, 0], read)
        total = values.sum(dtype=self.acc_dtype)
        outputs[0][0] = np.asarray(total, dtype=self.dtype)


class GatherGLMRows(Op):
    """The rows ``h(X[idx], f(X[idx] @ b_1, ..., a...), c...)`` and their column sums, in one
    pass over the minibatch rows: the per-observation gradients of a GLM.

    A sampler that estimates the gradient noise's covariance needs every row's gradient
    ``g_i = x_i f(z_i, y_i)`` (``z_i = x_i . w``), not only their sum. PyTensor computes the
    predictors ``X[idx] @ w`` in one pass over the rows (``GatherDot``), the weights ``f``
    elementwise, then the rows ``h`` (each row times its weight, cast to float32 for the
    low-rank products) and their sum (the force) in a second pass that reads the rows again.
    This op reads each row once: its predictors, its weights, then its entries of every
    output while the row is still in the L1 cache.

    ``weights_op`` (``f``, optional) is a scalar op of the predictors ``z_k = X[idx] @ b_k``
    and operands of shape (n, 1) or (1, 1); ``rows_op`` (``h``) a scalar op of the row's
    entry ``x_ij``, the predictors, ``f``'s outputs and operands that broadcast against
    (n, D). ``weights_args`` and ``rows_args`` name each argument's source as a pair:
    ``("x", 0)`` the entry, ``("z", k)`` predictor k, ``("w", k)`` output k of ``f``,
    ``("c", k)`` operand k. Output k of ``h`` is an (n, D) matrix, or with
    ``sums[k] = (acc_dtype, dtype)`` its sum over the rows (D,), accumulated in
    ``acc_dtype`` as PyTensor's ``Sum``.

    The force with control variates, ``g_i(theta) - g_i(anchor)``, reads the rows at two
    positions: both predictors come from the same read of each row.

    An operand marked in ``gathered`` is a whole (N,) vector, such as the observed values,
    read at each minibatch row (``c_k[idx[i]]``) where the graph copied ``c_k[idx]`` into an
    (n, 1) column; as in :class:`GatherGLMProduct`, it must have X's number of rows. Each
    ``b_k`` is a one-column matrix or a vector (see :class:`GatherDot`).
    """

    __props__ = ("weights_op", "weights_args", "rows_op", "rows_args", "sums", "gathered")

    def __init__(self, weights_op, weights_args, rows_op, rows_args, sums, gathered=()):
        self.weights_op = weights_op
        self.weights_args = tuple((str(kind), int(k)) for kind, k in weights_args)
        self.rows_op = rows_op
        self.rows_args = tuple((str(kind), int(k)) for kind, k in rows_args)
        self.sums = tuple(None if s is None else (str(s[0]), str(s[1])) for s in sums)
        self.gathered = tuple(bool(g) for g in gathered)
        if len(self.sums) != rows_op.nout:
            raise ValueError("GatherGLMRows: one entry of sums per output of rows_op")
        if (weights_op is None) != (not self.weights_args):
            raise ValueError("GatherGLMRows: weights_args are the arguments of weights_op")

    @property
    def n_predictors(self) -> int:
        args = (*self.weights_args, *self.rows_args)
        return 1 + max((k for kind, k in args if kind == "z"), default=-1)

    def _dtypes(self, x_dtype: str, bs: list, operands: list) -> tuple[list[str], list[str]]:
        """The dtypes of ``f``'s and of ``h``'s arguments: the entries of ``x_dtype``, the
        predictors of their type and ``b_k``'s (float64 for float32 rows of a float64 model)."""
        predictors = [upcast(x_dtype, b.type.dtype) for b in bs]
        dtypes = {"x": lambda k: x_dtype, "z": lambda k: predictors[k]}
        dtypes["c"] = lambda k: operands[k].type.dtype
        weights = [dtypes[kind](k) for kind, k in self.weights_args]
        if self.weights_op is not None:
            outputs = self.weights_op.output_types([get_scalar_type(d) for d in weights])
            dtypes["w"] = lambda k: outputs[k].dtype
        return weights, [dtypes[kind](k) for kind, k in self.rows_args]

    def make_node(self, x, idx, *operands):
        x, idx, *operands = map(as_tensor_variable, (x, idx, *operands))
        m = self.n_predictors
        if (
            len(operands) < m
            or any(b.type.ndim not in (1, 2) for b in operands[:m])
            or not _gathered_operands_fit(self.gathered, operands[m:])
        ):
            raise TypeError(
                "GatherGLMRows: one b (a vector or a column) per predictor, then 2-d operands "
                "(gathered: vectors)"
            )
        _, dtypes = self._dtypes(x.type.dtype, operands[:m], operands[m:])
        out_types = self.rows_op.output_types([get_scalar_type(d) for d in dtypes])
        n, d = idx.type.shape[0], x.type.shape[1]
        outputs = [
            pt.tensor(dtype=t.dtype, shape=(n, d))
            if s is None
            else pt.tensor(dtype=s[1], shape=(d,))
            for t, s in zip(out_types, self.sums, strict=True)
        ]
        return Apply(self, [x, idx, *operands], outputs)

    def perform(self, node, inputs, outputs):
        x, idx, *operands = inputs
        m = self.n_predictors
        bs, columns = [_as_column(b) for b in operands[:m]], operands[m:]
        n, d = len(idx), x.shape[1]
        rows = x[idx]
        for b in bs:
            if b.shape != (d, 1):
                raise ValueError("GatherGLMRows: shapes do not match")
        columns = _read_gathered(self.gathered, columns, x, idx)
        for column, var in zip(columns, node.inputs[2 + m :], strict=True):
            if var.type.ndim == 1:  # read at the rows: checked by the indexing
                continue
            shape = zip(var.type.broadcastable, (n, d), strict=True)
            expected = tuple(1 if broadcast else size for broadcast, size in shape)
            if column.shape != expected:
                raise ValueError("GatherGLMRows: shapes do not match")
        predictors = [rows @ b for b in bs]
        values = {"x": lambda k: rows, "z": lambda k: predictors[k], "c": lambda k: columns[k]}

        def evaluate(scalar_op, args):
            arrays = [values[kind](k) for kind, k in args]
            result = np.frompyfunc(scalar_op.impl, len(arrays), scalar_op.nout)(*arrays)
            return result if scalar_op.nout > 1 else (result,)

        if self.weights_op is not None:
            weights = evaluate(self.weights_op, self.weights_args)
            values["w"] = lambda k: weights[k]
        results = evaluate(self.rows_op, self.rows_args)
        for output, var, result, total in zip(
            outputs, node.outputs, results, self.sums, strict=True
        ):
            result = np.broadcast_to(result, (n, d))
            if total is None:
                output[0] = np.asarray(result, dtype=var.type.dtype)
            else:
                output[0] = np.asarray(result.astype(total[0]).sum(axis=0), dtype=var.type.dtype)


# ---------------------------------------------------------------------- numba kernels
#: Rows requested ahead of the ones being read in the first pass over a minibatch: random rows
#: of a large X come from L3 or memory, and the CPU's prefetchers cannot guess the next row.
#: 8 was fastest of 4-20. The two products of a step (2,000 steps, alternated A/B) took 13-16
#: instead of 18-20 us at N = 50,000, D = 50 (X 20 MB), the same ~17 us at N = 10,000, D = 100
#: (X 8 MB, mostly in cache); a whole SGLD step on the benchmark's P3 ~8 % less.
PREFETCH_ROWS = 8
#: Elements between prefetches along a row: one per 64-byte cache line of float64 (two per line
#: of float32); a constant step, which the compiler unrolls.
_PREFETCH_STRIDE = 8


def _prefetch_codegen(context, builder, signature, args):
    """Code that starts loading the cache line of ``args[0][args[1:]]`` into the caches
    (LLVM's prefetch: read, high locality). A hint only: it changes no result and faults on
    no address."""
    array = context.make_array(signature.args[0])(context, builder, args[0])
    pointer = cgutils.get_item_pointer(
        context, builder, signature.args[0], array, args[1:], wraparound=False
    )
    i8_pointer, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    prefetch = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(ir.VoidType(), [i8_pointer, i32, i32, i32]),
        "llvm.prefetch.p0i8",
    )
    # (address, read = 0, locality = 3: keep in every level, data cache = 1)
    builder.call(prefetch, [builder.bitcast(pointer, i8_pointer), i32(0), i32(3), i32(1)])
    return context.get_dummy_value()


@intrinsic
def _prefetch(typingctx, x, row, col):
    """Start loading the cache line of ``x[row, col]`` (a matrix) into the caches."""
    return types.void(x, types.intp, types.intp), _prefetch_codegen


@intrinsic
def _prefetch_item(typingctx, v, i):
    """Start loading the cache line of ``v[i]`` (a vector) into the caches."""
    return types.void(v, types.intp), _prefetch_codegen


@intrinsic
def _opaque(typingctx, n):
    """``n`` itself, as a value the optimiser cannot see through (an empty inline assembly).

    The kernels' dot products are vectorised by reordering their sums (fast math), and how
    depends on what LLVM knows of their length: a length it can prove constant (from a
    shape check against the op's static shape, or from a caller it was inlined into) made
    the kernel round differently in a process that compiled it and in one that loaded it
    from numba's cache (:mod:`pymc_sgmcmc.numba_compile`). With the length opaque the loops
    compile alike in every context; 1-2 us a step slower on the D = 100 regression."""

    def codegen(context, builder, signature, args):
        (value,) = args
        barrier = ir.InlineAsm(ir.FunctionType(value.type, [value.type]), "", "=r,0")
        return builder.call(barrier, [value])

    return n(n), codegen


@numba.njit(cache=True)
def _prefetch_row(x, i):
    """Prefetch row ``i`` of ``x`` (rows out of bounds are skipped: ``_row`` raises later)."""
    if i < 0:
        i += x.shape[0]
    if 0 <= i < x.shape[0]:
        for j in range(0, x.shape[1], _PREFETCH_STRIDE):
            _prefetch(x, i, j)


@numba.njit(cache=True)
def _prefetch_value(v, i):
    """Prefetch ``v[i]`` of a vector read at the rows, such as the observed values (skipped
    out of bounds, as ``_prefetch_row``): a large ``v`` read at random rows misses the caches
    as the rows do. With the rows of P4 (1,000 of 10^6 observed values) SGLD's step took
    106-117 us without it and 100-101 us with it (two alternated runs, 2026-12-05)."""
    if i < 0:
        i += v.shape[0]
    if 0 <= i < v.shape[0]:
        _prefetch_item(v, i)


@numba.njit(cache=True)
def _row(i, n_rows):
    """Row index with NumPy's meaning of negative indices, and its bounds check.

    The kernels read a row as ``x[row, j]`` in place, never as a view ``x[row]``: numba
    counts a view's references to its array with atomic instructions (``lock inc``/``dec``),
    which x86 orders as full barriers, so each view waited for the rows still being loaded
    from the caches or memory. On an Intel Xeon with AMX (2 vCPUs) 23 % of the CPU
    samples of P1 SGLD's block sat in those two instructions; indexing in place took its
    step from 29.8-30.3 to 24.8-27.3 us and P3's from 24.9-26.2 to 21.6-22.1 us
    (``benchmarks/engine.py steps``, old and new code alternated twice, 2026-12-02)."""
    if i < 0:
        i += n_rows
    if i < 0 or i >= n_rows:
        raise IndexError("minibatch row index out of bounds")
    return i


@numba.njit(cache=True)
def _column(b, c):
    """A contiguous copy of column c of b. Element by element, like :func:`_set_column`:
    numba's slice assignment compiles the formatting of its shape-mismatch error message,
    about 2 s of a cold compile per kernel that uses it."""
    out = np.empty(b.shape[0], dtype=b.dtype)
    for j in range(b.shape[0]):
        out[j] = b[j, c]
    return out


@numba.njit(cache=True)
def _set_column(out, c, col):
    """out[:, c] = col (see :func:`_column`)."""
    for i in range(col.shape[0]):
        out[i, c] = col[i]


def _zero(a):
    """0 in the element type of ``a``: sums of float32 rows then stay float32 (twice the SIMD
    lanes of float64, half the bytes read per row)."""
    return a.dtype.type(0)


@overload(_zero)
def _zero_constant(a):
    # A constant of the element type, chosen when numba types the call: no code to compile
    # (``a[:0].sum()`` compiled numba's array sum, 0.2-0.35 s of a cold start).
    zero = np.dtype(str(a.dtype)).type(0)
    return lambda a: zero


@numba.njit(cache=True, fastmath=True)
def _gather_matvec(x, idx, v, out):
    """out[i] = x[idx[i]] . v, four rows at a time; the first rows are prefetched here, the
    rest :data:`PREFETCH_ROWS` ahead."""
    n, d, n_rows = idx.shape[0], _opaque(x.shape[1]), x.shape[0]
    for k in range(min(PREFETCH_ROWS, n)):
        _prefetch_row(x, idx[k])
    i = 0
    while i + 4 <= n:
        for k in range(4):
            if i + PREFETCH_ROWS + k < n:
                _prefetch_row(x, idx[i + PREFETCH_ROWS + k])
        r0, r1 = _row(idx[i], n_rows), _row(idx[i + 1], n_rows)
        r2, r3 = _row(idx[i + 2], n_rows), _row(idx[i + 3], n_rows)
        s0 = s1 = s2 = s3 = _zero(v)
        for j in range(d):
            vj = v[j]
            s0 += x[r0, j] * vj
            s1 += x[r1, j] * vj
            s2 += x[r2, j] * vj
            s3 += x[r3, j] * vj
        out[i], out[i + 1], out[i + 2], out[i + 3] = s0, s1, s2, s3
        i += 4
    while i < n:
        row = _row(idx[i], n_rows)
        s = _zero(v)
        for j in range(d):
            s += x[row, j] * v[j]
        out[i] = s
        i += 1


@numba.njit(cache=True, fastmath=True)
def _gather_rmatvec(x, idx, w, out):
    """out = sum_i w[i] x[idx[i]] (out zeroed by the caller), four rows at a time."""
    n, d, n_rows = idx.shape[0], x.shape[1], x.shape[0]
    i = 0
    while i + 4 <= n:
        r0, r1 = _row(idx[i], n_rows), _row(idx[i + 1], n_rows)
        r2, r3 = _row(idx[i + 2], n_rows), _row(idx[i + 3], n_rows)
        w0, w1, w2, w3 = w[i], w[i + 1], w[i + 2], w[i + 3]
        for j in range(d):
            out[j] += x[r0, j] * w0 + x[r1, j] * w1 + x[r2, j] * w2 + x[r3, j] * w3
        i += 4
    while i < n:
        row = _row(idx[i], n_rows)
        wi = w[i]
        for j in range(d):
            out[j] += x[row, j] * wi
        i += 1


def _static(shape) -> tuple[int, int]:
    """The static output shape the kernels check, -1 where not known."""
    return tuple(-1 if s is None else int(s) for s in shape)


@register_funcify_and_cache_key(GatherDot)
def _numba_gather_dot(op, node, **kwargs):
    dtype = np.dtype(node.outputs[0].dtype)
    rows, cols = _static(op.out_shape)
    ndim = node.inputs[2].type.ndim
    key = hashlib.sha256(str(("GatherDot", op.out_shape, ndim, _CACHE_SALT)).encode())

    @numba.njit
    def gather_dot(x, idx, b):
        if x.shape[1] != b.shape[0] or (rows >= 0 and idx.shape[0] != rows):
            raise ValueError("GatherDot: shapes do not match")
        if cols >= 0 and b.shape[1] != cols:
            raise ValueError("GatherDot: shapes do not match")
        out = np.empty((idx.shape[0], b.shape[1]), dtype=dtype)
        col = np.empty(idx.shape[0], dtype=dtype)
        for c in range(b.shape[1]):
            _gather_matvec(x, idx, _column(b, c), col)
            _set_column(out, c, col)
        return out

    @numba.njit
    def gather_dot_vector(x, idx, b):
        if x.shape[1] != b.shape[0] or (rows >= 0 and idx.shape[0] != rows) or cols > 1:
            raise ValueError("GatherDot: shapes do not match")
        out = np.empty((idx.shape[0], 1), dtype=dtype)
        col = np.empty(idx.shape[0], dtype=dtype)
        _gather_matvec(x, idx, b, col)
        _set_column(out, out.shape[1] - 1, col)
        return out

    return (gather_dot_vector if ndim == 1 else gather_dot), key.hexdigest()


@register_funcify_default_op_cache_key(GatherTDot)
def _numba_gather_tdot(op, node, **kwargs):
    dtype = np.dtype(node.outputs[0].dtype)
    rows, cols = _static(op.out_shape)

    @numba.njit
    def gather_tdot(x, idx, r):
        if idx.shape[0] != r.shape[0] or (rows >= 0 and x.shape[1] != rows):
            raise ValueError("GatherTDot: shapes do not match")
        if cols >= 0 and r.shape[1] != cols:
            raise ValueError("GatherTDot: shapes do not match")
        out = np.empty((x.shape[1], r.shape[1]), dtype=dtype)
        col = np.empty(x.shape[1], dtype=dtype)
        for c in range(r.shape[1]):
            col[:] = 0.0
            _gather_rmatvec(x, idx, _column(r, c), col)
            _set_column(out, c, col)
        return out

    return gather_tdot, _CACHE_SALT


#: Lines of kernel source for a row of the minibatch: ``(name, r)``, the row's name in the
#: loop's variables ("0"-"3", or "i") and its row of x.
_RowLines = Callable[[str, str], list[str]]


def _four_row_loop_head(m: int, gathered: list[str], row_lines: _RowLines) -> list[str]:
    """The main loop's head in the source of :class:`GatherGLMProduct`'s and
    :class:`GatherGLMRows`'s kernels, four rows of x at a time: x's rows (and the ``gathered``
    vectors' values) prefetched ``PREFETCH_ROWS`` ahead, the rows' indices ``r0``-``r3``
    checked, ``row_lines(q, r{q})`` for each row, then row q's predictor k
    ``s{q}_{k} = x[r{q}] . v{k}`` for the ``m`` predictors, summed in one pass over the
    columns ``j``. The caller's lines follow in the loop (8 spaces), and in that pass over the
    columns (12)."""

    def dots(k: int) -> list[str]:
        return [f"            vj{k} = v{k}[j]"] + [
            f"            s{q}_{k} += x[r{q}, j] * vj{k}" for q in range(4)
        ]

    return [
        "    for k in range(min(PREFETCH_ROWS, n)):",
        "        _prefetch_row(x, idx[k])",
        *(f"        _prefetch_value({a}, idx[k])" for a in gathered),
        "    i = 0",
        "    while i + 4 <= n:",
        "        for k in range(4):",
        "            if i + PREFETCH_ROWS + k < n:",
        "                _prefetch_row(x, idx[i + PREFETCH_ROWS + k])",
        *(f"                _prefetch_value({a}, idx[i + PREFETCH_ROWS + k])" for a in gathered),
        "        r0, r1 = _row(idx[i], n_rows), _row(idx[i + 1], n_rows)",
        "        r2, r3 = _row(idx[i + 2], n_rows), _row(idx[i + 3], n_rows)",
        *(line for q in range(4) for line in row_lines(str(q), f"r{q}")),
        *(f"        s0_{k} = s1_{k} = s2_{k} = s3_{k} = _zero(v{k})" for k in range(m)),
        "        for j in range(d):",
        *(line for k in range(m) for line in dots(k)),
    ]


def _one_row_loop_head(m: int, row_lines: _RowLines) -> list[str]:
    """The head of the loop over the last rows (fewer than four), one at a time, as
    :func:`_four_row_loop_head`'s for row ``i`` (``row_lines("i", "row")``, predictors
    ``si_{k}``)."""
    return [
        "    while i < n:",
        "        row = _row(idx[i], n_rows)",
        *row_lines("i", "row"),
        *(f"        si_{k} = _zero(v{k})" for k in range(m)),
        "        for j in range(d):",
        *(f"            si_{k} += x[row, j] * v{k}[j]" for k in range(m)),
    ]


def _no_row_lines(name: str, row: str) -> list[str]:
    """No lines per row (:class:`GatherGLMProduct`'s kernel reads the rows' observed values
    where it calls ``f``)."""
    return []


#: The single-pass kernel of :class:`GatherGLMProduct`, as source, for predictors ``b0``,
#: ``b1``, ... and outputs ``g0``, ``g1``, ...: its loop calls the scalar function with the
#: op's own arguments; the ``{...}`` fields are filled in per op (:func:`_glm_kernel_source`)
#: with one line per predictor or output. Its loops repeat those of :func:`_gather_matvec` and
#: :func:`_gather_rmatvec` on purpose: the same loops as shared njit helpers (tuples of rows
#: and sums returned, with or without ``inline="always"``) made the two products 25 % slower
#: (28 -> 35 us for 500 random rows of 10,000 x 100, alternated runs).
_GLM_KERNEL = """
def gather_glm(x, idx, {operands}):
    n, d, n_rows = idx.shape[0], x.shape[1], x.shape[0]
    if rows >= 0 and d != rows:
        raise ValueError("GatherGLMProduct: shapes do not match")
{coefficients}
    d = _opaque(d)  # the loops' length unknown to the optimiser (see _opaque)
{checks}
{zeros}
{four_rows}
{weights}
        for j in range(d):
{accumulate}
        i += 4
{one_row}
{tail_weights}
        for j in range(d):
{tail_accumulate}
        i += 1
{outputs}
    return {returned}
"""


def _coefficient_lines(bs: list[tuple[str, str, int]], error: str) -> list[str]:
    """Kernel lines that check the coefficients ``(name, vector, ndim)`` of the predictors
    (their length d; one column) and give each as a vector: a vector itself, a column copied
    (``_column``). The column's index is known only at run time, as in the other kernels'
    loops: a literal 0 would compile the column helpers a second time (for
    ``Literal[int](0)``), ~0.2 s of a cold start."""
    lines = []
    for b, v, ndim in bs:
        column = "" if ndim == 1 else f" or {b}.shape[1] != 1"
        lines += [f"    if {b}.shape[0] != d{column}:", f"        raise ValueError({error!r})"]
        lines.append(f"    {v} = {b}" if ndim == 1 else f"    {v} = _column({b}, {b}.shape[1] - 1)")
    return lines


def _glm_kernel_source(op: GatherGLMProduct, broadcast: list[bool], b_ndims: list[int]) -> str:
    """The kernel of ``op``: ``m`` predictors (``s{row}_{k}`` the row's predictor k, from
    ``v{k}``, ``b{k}`` as a vector) and ``K`` outputs (``w{row}_{k}`` the row's weight in the
    output ``g{k}``)."""
    m, outputs = len(op.z_positions), op.scalar_op.nout
    columns = [(f"a{k}", bc) for k, bc in enumerate(broadcast)]
    gathered = op.gathered or (False,) * len(columns)
    bs = [f"b{k}" for k in range(m)]

    def lines(indent: int, template: str, count: int) -> str:
        return "\n".join(" " * indent + template.format(k=k) for k in range(count))

    def value(a: str, bc: bool, is_gathered: bool, row: str, r: str) -> str:
        """Column ``a``'s value at minibatch row ``row``, row ``r`` of x."""
        if is_gathered:  # at x's row, whose index is checked (a has x's length: checked)
            return f"{a}[{r}]"
        return f"{a}[0, 0]" if bc else f"{a}[{row}, 0]"

    def call(row: str, name: str) -> str:
        """The weights ``w{name}_k`` of a row from its predictors ``s{name}_k``."""
        r = "row" if name == "i" else f"r{name}"
        values = [value(a, bc, g, row, r) for (a, bc), g in zip(columns, gathered, strict=True)]
        args = op._arguments([f"s{name}_{k}" for k in range(m)], values)
        weights = ", ".join(f"w{name}_{k}" for k in range(outputs))
        return f"{weights} = f({', '.join(args)})"

    checks = [
        f"    if {a}.shape[0] != n_rows:\n        raise ValueError({_ROWS_DIFFER!r})"
        if g
        else f"    if {a}.shape[0] != {'1' if bc else 'n'} or {a}.shape[1] != 1:\n"
        '        raise ValueError("GatherGLMProduct: shapes do not match")'
        for (a, bc), g in zip(columns, gathered, strict=True)
    ]
    observed = [a for (a, _), g in zip(columns, gathered, strict=True) if g]
    body = {
        "four_rows": "\n".join(_four_row_loop_head(m, observed, _no_row_lines)),
        "one_row": "\n".join(_one_row_loop_head(m, _no_row_lines)),
        "operands": ", ".join(bs + [a for a, _ in columns]),
        "coefficients": "\n".join(
            _coefficient_lines(
                [(b, f"v{k}", ndim) for k, (b, ndim) in enumerate(zip(bs, b_ndims, strict=True))],
                "GatherGLMProduct: shapes do not match",
            )
        ),
        "checks": "\n".join(checks),
        "zeros": lines(4, "g{k} = np.zeros(d, dtype=dtype)", outputs),
        "weights": "\n".join(" " * 8 + call(f"i + {r}", str(r)) for r in range(4)),
        "accumulate": lines(
            12,
            "g{k}[j] += x[r0, j] * w0_{k} + x[r1, j] * w1_{k} + x[r2, j] * w2_{k} "
            "+ x[r3, j] * w3_{k}",
            outputs,
        ),
        "tail_weights": " " * 8 + call("i", "i"),
        "tail_accumulate": lines(12, "g{k}[j] += x[row, j] * wi_{k}", outputs),
        "outputs": lines(
            4,
            "out{k} = g{k}"
            if op.vectors
            else "out{k} = np.empty((d, 1), dtype=dtype)\n"
            "    _set_column(out{k}, out{k}.shape[1] - 1, g{k})",
            outputs,
        ),
        "returned": ", ".join(f"out{k}" for k in range(outputs)),
    }
    return _GLM_KERNEL.format(**body)


def _scalar_function(scalar_op, dtypes: list[str], kwargs) -> tuple:
    """The numba function of a scalar op for arguments of ``dtypes``, and its cache key (None
    when it has none)."""
    scalar_node = scalar_op.make_node(*(get_scalar_type(d)() for d in dtypes))
    return numba_funcify_and_cache_key(scalar_op, node=scalar_node, **kwargs)


def _compiled_kernel(source: str, name: str, functions: dict, key_parts, **names):
    """A kernel's ``source`` compiled with the scalar ``functions`` (name: (function, key)),
    the shared helpers and ``names`` as its globals; cached under ``key_parts`` and the
    functions' keys (not cached when one has none)."""
    keys = [key for _, key in functions.values()]
    key = None
    if all(k is not None for k in keys):
        parts = "|".join(map(str, (_CACHE_SALT, *key_parts, *keys)))
        key = hashlib.sha256(parts.encode()).hexdigest()
    helpers = (_prefetch_row, _prefetch_value, _row, _column, _set_column, _zero, _opaque)
    env = {"np": np, "PREFETCH_ROWS": PREFETCH_ROWS, **names}
    env |= {h.__name__: h for h in helpers}
    env |= {fname: f for fname, (f, _) in functions.items()}
    kernel = compile_numba_function_src(source, name, env, cache_key=key)
    # numba's full fast math, as the other kernels: its dot products are vectorised by
    # reordering their sums, in this function's own optimisation (``numba_compile``).
    return numba_njit(kernel, fastmath=True), key


def _compiled_glm_kernel(
    op, bs, columns, z_positions, name, z_dtype, source, key_parts, kwargs, **names
):
    """A GLM op's kernel: ``source(op, broadcast, b_ndims)`` compiled with the numba function
    ``f`` of the op's scalar op (the predictors, of ``z_dtype``, at ``z_positions``; the op's
    further inputs ``columns`` elsewhere, ``broadcast`` saying which of them broadcast; the
    coefficients ``bs``, vectors or columns)."""
    dtypes = [c.type.dtype for c in columns]
    for position in sorted(z_positions):
        dtypes.insert(position, z_dtype)
    f = _scalar_function(op.scalar_op, dtypes, kwargs)
    broadcast = [bool(c.type.broadcastable[0]) for c in columns]
    b_ndims = [b.type.ndim for b in bs]
    return _compiled_kernel(
        source(op, broadcast, b_ndims), name, {"f": f}, (*key_parts, broadcast, b_ndims), **names
    )


@register_funcify_and_cache_key(GatherGLMProduct)
def _numba_gather_glm(op, node, **kwargs):
    dtype = np.dtype(node.outputs[0].dtype)
    m = len(op.z_positions)
    return _compiled_glm_kernel(
        op,
        node.inputs[2 : 2 + m],
        node.inputs[2 + m :],
        op.z_positions,
        "gather_glm",
        dtype.name,
        _glm_kernel_source,
        (op.z_positions, op.out_shape, op.gathered),
        kwargs,
        dtype=dtype,
        rows=_static(op.out_shape)[0],
    )


#: The kernel of :class:`GatherGLMSum`, as source (``{args}`` filled in per op): the predictor
#: of each row, then the sum of ``f``. Two loops, one row at a time: evaluating ``f`` in the
#: first made a logistic regression's log-likelihood (a ``softplus`` per row) 20 % slower than
#: the separate product and sum (N = 50,000, D = 50, n = 500); apart they took as long, and
#: the plain loops compile sooner than the four-row loops of the force's kernel. It runs only
#: at the steps whose log-density is read.
_GLM_SUM_KERNEL = """
def gather_glm_sum(x, idx, b, {columns}):
    n, d, n_rows = idx.shape[0], x.shape[1], x.shape[0]
{coefficients}
    d = _opaque(d)  # the loop's length unknown to the optimiser (see _opaque)
{checks}
    z = np.empty(n, dtype=v.dtype)
    for k in range(min(PREFETCH_ROWS, n)):
        _prefetch_row(x, idx[k])
    for i in range(n):
        if i + PREFETCH_ROWS < n:
            _prefetch_row(x, idx[i + PREFETCH_ROWS])
        row = _row(idx[i], n_rows)
        s = _zero(v)
        for j in range(d):
            s += x[row, j] * v[j]
        z[i] = s
    total = acc(0)
    for i in range(n):
        total += acc(f({args}))
    return np.asarray(cast(total))
"""


def _glm_sum_kernel_source(op: GatherGLMSum, broadcast: list[bool], b_ndims: list[int]) -> str:
    columns = [f"a{k}" for k in range(len(op.gathered))]
    values = []
    checks = []
    for a, gathered, bc in zip(columns, op.gathered, broadcast, strict=True):
        if gathered:  # the observed values of the row (``_row`` checks the index)
            values.append(f"{a}[_row(idx[i], {a}.shape[0])]")
        else:
            values.append(f"{a}[0]" if bc else f"{a}[i]")
            checks.append(
                f"    if {a}.shape[0] != {'1' if bc else 'n'}:\n"
                '        raise ValueError("GatherGLMSum: shapes do not match")'
            )
    values.insert(op.z_position, "z[i]")
    return _GLM_SUM_KERNEL.format(
        columns=", ".join(columns),
        checks="\n".join(checks),
        args=", ".join(values),
        coefficients="\n".join(
            _coefficient_lines([("b", "v", *b_ndims)], "GatherGLMSum: shapes do not match")
        ),
    )


@register_funcify_and_cache_key(GatherGLMSum)
def _numba_gather_glm_sum(op, node, **kwargs):
    return _compiled_glm_kernel(
        op,
        node.inputs[2:3],
        node.inputs[3:],
        (op.z_position,),
        "gather_glm_sum",
        upcast(node.inputs[0].type.dtype, node.inputs[2].type.dtype),
        _glm_sum_kernel_source,
        ("sum", op.z_position, op.gathered, op.acc_dtype, op.dtype),
        kwargs,
        acc=np.dtype(op.acc_dtype).type,
        cast=np.dtype(op.dtype).type,
    )


def _glm_rows_kernel_source(
    op: GatherGLMRows, broadcast: list[tuple[bool, bool]], b_ndims: list[int]
) -> str:
    """The kernel of :class:`GatherGLMRows`: the loops of :class:`GatherGLMProduct`'s kernel
    (four rows at a time, rows prefetched ahead), with each row's entries of ``h`` written or
    summed in place of its gradient. ``s{row}_{k}`` is the row's predictor k, ``w{row}_{k}``
    output k of ``f``, ``e{row}_{k}`` output k of ``h`` at column j, ``y{row}_{k}`` the row's
    value of gathered operand k; ``broadcast`` the operands' broadcastable dimensions."""
    m, n_out = op.n_predictors, op.rows_op.nout
    n_weights = 0 if op.weights_op is None else op.weights_op.nout
    cs = [f"c{k}" for k in range(len(broadcast))]
    gathered = [k for k, g in enumerate(op.gathered) if g]

    def operand(k: int, name: str, row: str, col: str) -> str:
        if k in gathered:  # read once per row, before the loops over its columns
            return f"y{name}_{k}"
        bc_row, bc_col = broadcast[k]
        return f"c{k}[{'0' if bc_row else row}, {'0' if bc_col else col}]"

    def observed(name: str, r: str) -> list[str]:
        """The row's values of the gathered operands, at x's row ``r`` (same length)."""
        return [f"        y{name}_{k} = c{k}[{r}]" for k in gathered]

    def args(sources, name: str, row: str, r: str) -> str:
        value = {
            "x": lambda k: f"x[{r}, j]",
            "z": lambda k: f"s{name}_{k}",
            "w": lambda k: f"w{name}_{k}",
            "c": lambda k: operand(k, name, row, "j"),
        }
        return ", ".join(value[kind](k) for kind, k in sources)

    def weight_lines(name: str, row: str, r: str) -> list[str]:
        """The row's weights (``row``: its index in the minibatch, ``r``: its row of x)."""
        if not n_weights:
            return []
        weights = ", ".join(f"w{name}_{k}" for k in range(n_weights))
        return [f"        {weights} = f({args(op.weights_args, name, row, r)})"]

    def entries(name: str, row: str, r: str) -> str:
        """The row's entries of h at column j."""
        outs = ", ".join(f"e{name}_{k}" for k in range(n_out))
        return f"            {outs} = h({args(op.rows_args, name, row, r)})"

    lines = [
        f"def gather_glm_rows(x, idx, {', '.join([f'b{k}' for k in range(m)] + cs)}):",
        "    n, d, n_rows = idx.shape[0], x.shape[1], x.shape[0]",
    ]
    lines += _coefficient_lines(
        [(f"b{k}", f"v{k}", ndim) for k, ndim in enumerate(b_ndims)],
        "GatherGLMRows: shapes do not match",
    )
    for k, bc in enumerate(broadcast):
        if k in gathered:  # a vector read at x's rows
            lines += [
                f"    if c{k}.shape[0] != n_rows:",
                f"        raise ValueError({_ROWS_DIFFER!r})",
            ]
            continue
        bc_row, bc_col = bc
        lines += [
            f"    if c{k}.shape[0] != {'1' if bc_row else 'n'} or "
            f"c{k}.shape[1] != {'1' if bc_col else 'd'}:",
            '        raise ValueError("GatherGLMRows: shapes do not match")',
        ]
    lines += [
        "    d = _opaque(d)  # the loops' length unknown to the optimiser (see _opaque)",
    ]
    for k, total in enumerate(op.sums):
        lines.append(
            f"    o{k} = np.empty((n, d), dtype=dtype{k})"
            if total is None
            else f"    o{k} = np.zeros(d, dtype=acc{k})"
        )
    lines += _four_row_loop_head(m, [f"c{k}" for k in gathered], observed)
    for q in range(4):
        lines += weight_lines(str(q), f"i + {q}", f"r{q}")
    lines.append("        for j in range(d):")
    lines += [entries(str(q), f"i + {q}", f"r{q}") for q in range(4)]
    for k, total in enumerate(op.sums):
        if total is None:
            lines += [f"            o{k}[i + {q}, j] = e{q}_{k}" for q in range(4)]
        else:
            lines.append(
                f"            o{k}[j] += " + " + ".join(f"acc{k}(e{q}_{k})" for q in range(4))
            )
    lines += [
        "        i += 4",
        *_one_row_loop_head(m, observed),
        *weight_lines("i", "i", "row"),
        "        for j in range(d):",
        entries("i", "i", "row"),
    ]
    for k, total in enumerate(op.sums):
        lines.append(
            f"            o{k}[i, j] = ei_{k}"
            if total is None
            else f"            o{k}[j] += acc{k}(ei_{k})"
        )
    lines.append("        i += 1")
    returned = []
    for k, total in enumerate(op.sums):
        if total is None:
            returned.append(f"o{k}")
        else:  # the sum in the output's dtype, element by element (see _column)
            lines += [
                f"    t{k} = np.empty(d, dtype=dtype{k})",
                "    for j in range(d):",
                f"        t{k}[j] = o{k}[j]",
            ]
            returned.append(f"t{k}")
    lines.append(f"    return {', '.join(returned)}")
    return "\n".join(lines) + "\n"


@register_funcify_and_cache_key(GatherGLMRows)
def _numba_gather_glm_rows(op, node, **kwargs):
    m = op.n_predictors
    bs, operands = node.inputs[2 : 2 + m], node.inputs[2 + m :]
    weight_dtypes, row_dtypes = op._dtypes(node.inputs[0].type.dtype, bs, operands)
    functions = {"h": _scalar_function(op.rows_op, row_dtypes, kwargs)}
    if op.weights_op is not None:
        functions["f"] = _scalar_function(op.weights_op, weight_dtypes, kwargs)
    broadcast = [tuple(bool(b) for b in c.type.broadcastable) for c in operands]
    names = {}
    for k, (var, total) in enumerate(zip(node.outputs, op.sums, strict=True)):
        names[f"dtype{k}"] = np.dtype(var.type.dtype)
        if total is not None:
            names[f"acc{k}"] = np.dtype(total[0]).type
    b_ndims = [b.type.ndim for b in bs]
    return _compiled_kernel(
        _glm_rows_kernel_source(op, broadcast, b_ndims),
        "gather_glm_rows",
        functions,
        ("rows", op.weights_args, op.rows_args, op.sums, op.gathered, broadcast, b_ndims),
        **names,
    )


#: PyTensor caches a compiled op under its class name and props: salting that key with the
#: kernels' source (and the constants compiled into them, which no source above shows)
#: makes an edited kernel recompile instead of loading the cached one.
_CACHE_SALT = int(
    hashlib.sha256(
        "".join(
            inspect.getsource(f)
            for f in (
                _prefetch_codegen,
                _prefetch._defn,  # the intrinsics' Python definitions
                _prefetch_item._defn,
                _opaque._defn,
                _prefetch_row,
                _prefetch_value,
                _row,
                _zero_constant,
                _column,
                _set_column,
                _coefficient_lines,
                _static,
                _gather_matvec,
                _gather_rmatvec,
                _numba_gather_dot,
                _numba_gather_tdot,
                _glm_kernel_source,
                _scalar_function,
                _compiled_kernel,
                _compiled_glm_kernel,
                _numba_gather_glm,
                _glm_sum_kernel_source,
                _numba_gather_glm_sum,
                _glm_rows_kernel_source,
                _numba_gather_glm_rows,
            )
        ).encode()
        + _GLM_KERNEL.encode()
        + _GLM_SUM_KERNEL.encode()
        + _ROWS_DIFFER.encode()
        + f"{PREFETCH_ROWS},{_PREFETCH_STRIDE}".encode()
    ).hexdigest()[:12],
    16,
)


# ---------------------------------------------------------------------- the rewrite
def _gathered_rows(var):
    """``(X, idx)`` if ``var`` is ``X[idx]`` for a matrix X and an integer vector idx."""
    node = var.owner
    if node is None or not isinstance(node.op, AdvancedSubtensor) or node.op.idx_list != (0,):
        return None
    x, idx = node.inputs
    if x.type.ndim != 2 or idx.type.ndim != 1 or not idx.type.dtype.startswith(("int", "uint")):
        return None
    return x, idx


def _rows_fit(x, dtype: str) -> bool:
    """Whether the fused GLM kernels read rows of X's type into arithmetic of ``dtype``: the
    same type, or float32 rows of a float64 model (covariates stored in float32, which halves
    the bytes a step reads from a large X; the rows' values are exact in float64)."""
    return x.type.dtype == dtype or (x.type.dtype, dtype) == ("float32", "float64")


def _transposed(var):
    node = var.owner
    if node is not None and isinstance(node.op, DimShuffle) and node.op.new_order == (1, 0):
        return node.inputs[0]
    return None


@node_rewriter([Dot])
def fuse_gather_dots(fgraph, node):
    """``Dot(X[idx], B)`` -> ``GatherDot(X, idx, B)``; ``Dot(X[idx].T, R)`` ->
    ``GatherTDot(X, idx, R)``, for a B or R of one column: matrix-vector products, which
    PyTensor writes as products with a one-column matrix by this stage. A B that is
    ``b[:, None]`` gives ``GatherDot`` the vector ``b``. With k columns the
    kernels read the rows k times, where one copy and a matrix-matrix product may be faster:
    left to BLAS."""
    a, b = node.inputs
    if a.type.ndim != 2 or b.type.ndim != 2 or b.type.shape[1] != 1:
        return None
    shape = node.outputs[0].type.shape
    if (rows := _gathered_rows(a)) is not None:
        vector = _expanded_vector(b)
        new = GatherDot(shape)(*rows, b if vector is None else vector)
    elif (inner := _transposed(a)) is not None and (rows := _gathered_rows(inner)) is not None:
        new = GatherTDot(shape)(*rows, b)
    else:
        return None
    return [new] if new.type == node.outputs[0].type else None


@node_rewriter([SpecifyShape])
def absorb_specified_shape(fgraph, node):
    """``SpecifyShape(GatherDot(...), shape)`` -> ``GatherDot(shape)(...)`` for a constant
    shape: the kernels check it themselves, and a cold numba compile of SpecifyShape's check
    (which formats its error message) costs about a second."""
    product, *dims = node.inputs
    if product.owner is None or not isinstance(product.owner.op, _GatherProduct):
        return None
    if not all(isinstance(d, Constant) for d in dims) or len(fgraph.clients[product]) != 1:
        return None
    new = type(product.owner.op)(node.outputs[0].type.shape)(*product.owner.inputs)
    return [new] if new.type == node.outputs[0].type else None


@node_rewriter([GatherTDot])
def fuse_glm_products(fgraph, node):
    """``GatherTDot(X, idx, f(GatherDot(X, idx, b), a...))`` -> ``GatherGLMProduct`` for an
    elementwise ``f`` (one ``Elemwise``, fused by then) of columns of the predictors' float
    type (X's, or float64 for float32 rows of a float64 model: ``_rows_fit``), when nothing
    else reads the predictor ``z = X[idx] @ b`` or the weights
    ``f(z, ...)``: the single pass computes neither for others (a sampler that also needs
    ``z``, for per-observation gradients, keeps the two products).

    ``f`` may read several predictors of the same rows and have several outputs, each read
    only by its own ``GatherTDot`` of the rows: the gradients at two positions that the force
    with control variates subtracts, whose residuals PyTensor fuses into one ``Elemwise``
    (``f(z_1, z_2, y) = (y - z_1, y - z_2)``). All of them are replaced by one op. Columns
    ``v[idx][:, None]`` of a vector ``v`` (the observed values) are read in place."""
    x, idx, weights = node.inputs
    elemwise = weights.owner
    dtype = node.outputs[0].type.dtype
    if (
        elemwise is None
        or not isinstance(elemwise.op, Elemwise)
        or dtype not in ("float32", "float64")
        or not _rows_fit(x, dtype)
    ):
        return None
    products = []  # the GatherTDot reading each output of f
    for output in elemwise.outputs:
        clients = fgraph.clients[output]
        if len(clients) != 1:
            return None
        client, _ = clients[0]
        if not isinstance(client.op, GatherTDot) or client.inputs[:2] != [x, idx]:
            return None
        if client.outputs[0].type != node.outputs[0].type:
            return None
        products.append(client.outputs[0])
    positions = [
        k
        for k, var in enumerate(elemwise.inputs)
        if var.owner is not None
        and isinstance(var.owner.op, GatherDot)
        and var.owner.inputs[:2] == [x, idx]
    ]
    if not positions:
        return None
    predictors = [elemwise.inputs[k] for k in positions]
    columns = [v for k, v in enumerate(elemwise.inputs) if k not in positions]
    if any(len(fgraph.clients[z]) != 1 for z in predictors) or not all(
        v.type.ndim == 2 and v.type.broadcastable[1] and v.type.dtype == dtype
        for v in [*predictors, *elemwise.outputs, *columns]
    ):
        return None
    bs = [z.owner.inputs[2] for z in predictors]
    columns, gathered = _read_in_place(columns, idx)
    # A vector's gradient, where only its Squeeze reads the column: the vector itself, which
    # the kernel returns without copying it into a column. numba compiled the Squeeze for
    # 0.3-0.5 s of SGLD's cold first draw on P1.
    squeezed = [_only_squeezed(fgraph, product) for product in products]
    if None not in squeezed:
        products = squeezed
    op = GatherGLMProduct(elemwise.op.scalar_op, tuple(positions), products[0].type.shape, gathered)
    new = op(x, idx, *bs, *columns)
    new = new if isinstance(new, list) else [new]
    if any(n.type != old.type for n, old in zip(new, products, strict=True)):
        return None
    return dict(zip(products, new, strict=True))


def _expanded_vector(var):
    """``v`` if ``var`` is the one-column matrix ``v[:, None]`` of a vector, else None."""
    node = var.owner
    if node is None or not isinstance(node.op, DimShuffle) or node.op.new_order != (0, "x"):
        return None
    return node.inputs[0]


def _only_squeezed(fgraph, var):
    """``var[:, 0]`` if that is all that reads the one-column matrix ``var``, else None."""
    clients = fgraph.clients[var]
    if len(clients) != 1:
        return None
    client, _ = clients[0]
    if not isinstance(client.op, DimShuffle) or client.op.new_order != (0,):
        return None
    return client.outputs[0]


def _squeezed_gather_dot(var):
    """The ``GatherDot`` node whose one column ``var`` is (``z[:, 0]`` of ``z = X[idx] @ b``)."""
    node = var.owner
    if node is None or not isinstance(node.op, DimShuffle) or node.op.new_order != (0,):
        return None
    product = node.inputs[0].owner
    if product is None or not isinstance(product.op, GatherDot):
        return None
    return product


def _rows_of(var, idx):
    """``v`` if ``var`` is ``v[idx]`` for a vector ``v``, else None."""
    node = var.owner
    if node is None or not isinstance(node.op, AdvancedSubtensor) or node.op.idx_list != (0,):
        return None
    v, var_idx = node.inputs
    return v if v.type.ndim == 1 and var_idx is idx else None


def _read_in_place(columns, idx) -> tuple[list, tuple[bool, ...]]:
    """``columns`` with each ``v[idx][:, None]`` (the observed values of the rows, copied into
    a column) replaced by the vector ``v``, which the kernels read at the rows, and which of
    them were: the copy is an allocation and a gather of n values per step (about 1 us for
    500 rows, more where ``v`` is too large for the caches)."""
    replaced, gathered = [], []
    for var in columns:
        node, v = var.owner, None
        if node is not None and isinstance(node.op, DimShuffle) and node.op.new_order == (0, "x"):
            v = _rows_of(node.inputs[0], idx)
        replaced.append(var if v is None else v)
        gathered.append(v is not None)
    return replaced, tuple(gathered) if any(gathered) else ()


@node_rewriter([Sum])
def fuse_glm_sums(fgraph, node):
    """``Sum(f(GatherDot(X, idx, b)[:, 0], a...))`` -> ``GatherGLMSum`` for an elementwise
    ``f`` (one ``Elemwise``, fused by then) of vectors, when nothing else reads the predictor
    or the values summed: a GLM's minibatch log-likelihood. Vectors ``v[idx]`` (the observed
    values of the rows) are read in place."""
    (values,) = node.inputs
    elemwise = values.owner
    if (
        values.type.ndim != 1
        or elemwise is None
        or not isinstance(elemwise.op, Elemwise)
        or len(elemwise.outputs) != 1
        or len(fgraph.clients[values]) != 1
        or node.op.axis not in (None, (0,))
        or values.type.dtype not in ("float32", "float64")
    ):
        return None
    positions = [
        k for k, var in enumerate(elemwise.inputs) if _squeezed_gather_dot(var) is not None
    ]
    if len(positions) != 1:
        return None
    (z_position,) = positions
    z = elemwise.inputs[z_position]
    product = _squeezed_gather_dot(z)
    x, idx, b = product.inputs
    if (
        len(fgraph.clients[z]) != 1
        or len(fgraph.clients[product.outputs[0]]) != 1
        or not _rows_fit(x, z.type.dtype)
    ):
        return None
    columns, gathered = [], []
    for k, var in enumerate(elemwise.inputs):
        if k == z_position:
            continue
        if var.type.ndim != 1:
            return None
        rows = _rows_of(var, idx)
        columns.append(var if rows is None else rows)
        gathered.append(rows is not None)
    op = GatherGLMSum(
        elemwise.op.scalar_op, z_position, gathered, node.op.acc_dtype, node.outputs[0].type.dtype
    )
    new = op(x, idx, b, *columns)
    return [new] if new.type == node.outputs[0].type else None


def _predictor_of(var, x, idx) -> bool:
    """Whether ``var`` is a one-column ``X[idx] @ b`` (of X's type or a wider one)."""
    node = var.owner
    return (
        node is not None
        and isinstance(node.op, GatherDot)
        and node.inputs[:2] == [x, idx]
        and var.type.broadcastable[1]
        and _rows_fit(x, var.type.dtype)
    )


def _only_read_by(fgraph, outputs, nodes) -> bool:
    """Whether every client of ``outputs`` is one of ``nodes``."""
    return all(client in nodes for out in outputs for client, _ in fgraph.clients[out])


@node_rewriter([Elemwise])
def fuse_glm_rows(fgraph, node):
    """``h(X[idx], f(X[idx] @ b, a...), c...)`` -> ``GatherGLMRows``, for an elementwise
    ``h`` (one ``Elemwise`` of (n, D) outputs) of the rows, predictors ``X[idx] @ b`` (read
    directly or through an elementwise ``f`` of (n, 1) columns) and other operands, when
    nothing else reads the predictors or ``f``: the per-observation gradients of a GLM. An
    output read only by ``Sum(axis=0)`` becomes that sum (the force), so it is never
    written. Columns ``v[idx][:, None]`` of a vector ``v`` (the observed values) are read in
    place."""
    inputs = node.inputs
    row_inputs = [(k, _gathered_rows(v)) for k, v in enumerate(inputs) if v.type.ndim == 2]
    row_inputs = [(k, rows) for k, rows in row_inputs if rows is not None]
    if len(row_inputs) != 1 or any(v.type.ndim != 2 for v in inputs):
        return None
    x_position, (x, idx) = row_inputs[0]
    if x.type.dtype not in ("float32", "float64") or node.outputs[0].type.broadcastable[1]:
        return None
    weights = {
        v.owner
        for v in inputs
        if v.owner is not None
        and isinstance(v.owner.op, Elemwise)
        and any(_predictor_of(u, x, idx) for u in v.owner.inputs)
    }
    if len(weights) > 1:
        return None
    weights_node = weights.pop() if weights else None
    if weights_node is not None and (
        not _only_read_by(fgraph, weights_node.outputs, {node})
        or not all(v.type.ndim == 2 and v.type.broadcastable[1] for v in weights_node.inputs)
    ):
        return None
    predictors, operands = [], []

    def source(var) -> tuple[str, int]:
        if _predictor_of(var, x, idx):
            if var not in predictors:
                predictors.append(var)
            return ("z", predictors.index(var))
        if var not in operands:
            operands.append(var)
        return ("c", operands.index(var))

    weights_args = [] if weights_node is None else [source(v) for v in weights_node.inputs]
    rows_args = []
    for k, var in enumerate(inputs):
        if k == x_position:
            rows_args.append(("x", 0))
        elif weights_node is not None and var.owner is weights_node:
            rows_args.append(("w", weights_node.outputs.index(var)))
        else:
            rows_args.append(source(var))
    readers = {node} if weights_node is None else {node, weights_node}
    if not predictors or not _only_read_by(fgraph, predictors, readers):
        return None
    sums, replaced = [], []
    for out in node.outputs:
        clients = fgraph.clients[out]
        client = clients[0][0] if len(clients) == 1 else None
        if client is not None and isinstance(client.op, Sum) and client.op.axis == (0,):
            sums.append((client.op.acc_dtype, client.outputs[0].type.dtype))
            replaced.append(client.outputs[0])
        else:
            sums.append(None)
            replaced.append(out)
    operands, gathered = _read_in_place(operands, idx)
    op = GatherGLMRows(
        None if weights_node is None else weights_node.op.scalar_op,
        weights_args,
        node.op.scalar_op,
        rows_args,
        sums,
        gathered,
    )
    new = op(x, idx, *(z.owner.inputs[2] for z in predictors), *operands)
    new = new if isinstance(new, list) else [new]
    if any(n.type != old.type for n, old in zip(new, replaced, strict=True)):
        return None
    return dict(zip(replaced, new, strict=True))


# After specialisation (the products are in their final Dot form), before elemwise fusion (49).
optdb.register(
    "fuse_gather_dots", in2out(fuse_gather_dots, absorb_specified_shape), TAG, position=48.5
)
# After elemwise fusion (49; ``f`` is then one Elemwise), before the in-place rewrites (49.5).
optdb.register(
    "fuse_glm_products",
    in2out(fuse_glm_products, fuse_glm_sums, fuse_glm_rows),
    TAG,
    position=49.25,
)


def including_for_linker(mode, linker: type, tag: str) -> Mode | str | None:
    """``mode`` with the rewrites tagged ``tag`` included if its linker is a ``linker``;
    otherwise ``mode`` unchanged."""
    resolved = get_mode(mode)
    if isinstance(resolved.linker, linker):
        return resolved.including(tag)
    return mode


def with_gather_dot(mode) -> Mode | str | None:
    """``mode`` with the fused products included where they have kernels (numba)."""
    return including_for_linker(mode, NumbaLinker, TAG)
