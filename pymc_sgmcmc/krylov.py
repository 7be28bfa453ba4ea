"""Krylov methods with the noise covariance: exp(t Sigma) v by the Lanczos process, and
(alpha I + b Sigma)^{-1} v by conjugate gradients.

mCCAdL's C step multiplies the momentum by :math:`\\exp(-\\tfrac{h^2}{2}\\Sigma)` with
:math:`\\Sigma`-vector products only (:func:`lanczos_expm`). As a PyTensor graph the process is
a loop of data-dependent length whose every iteration is a handful of small vector operations
around the product, followed by the eigen-decomposition of the small tridiagonal matrix; in
numba that bookkeeping costs more than a third of the products' time on the D = 100
regression (n = 500, 3 products: 22.2 µs per call as a graph, 16.8 µs as one kernel, 14.4 µs
for the three products alone; 38.6 against 31.0 µs with 5.8 products, 2026-11-26).

For the low-rank estimate from the per-observation gradients, in all the forms the samplers
build from it (preconditioned, shrunk towards the identity or the diagonal),
:math:`\\Sigma v = c\\, M^\\top G_c^\\top G_c M v + d \\odot v`, with M the
preconditioner's map (diag(s), or R S for a dense one), and
:class:`LowRankExpm` runs the whole process in one numba kernel around
:class:`~pymc_sgmcmc.gram_product.CentredGramProduct`'s. The same algorithm, step for step:
the same stopping rule, tridiagonal matrix, result and a-posteriori check at the cap.
NOGIN's damping solve by :func:`conjugate_gradients` gets the same treatment
(:class:`LowRankShiftedSolve`). In the compiled blocks at D = 100 that took mCCAdL from 3.35
to 2.86 times SGLD's time per step and NOGIN with conjugate gradients from 3.75 to 3.29
(``benchmarks/covariance_results_cost.md``), and 8 s off mCCAdL's cold compile, which no
longer has a loop nested in the block's. At the default tolerances the kernels read the rows
in float32 (:data:`SINGLE_PRECISION_ROWS`): 2.60 and 3.01 (2026-11-26 03:54 UTC); with the
trace of Sigma computed at the stored steps only, 2.47-2.56 and 2.99-3.13 (05:52, 06:36 UTC).

The numba backend and JAX have the kernels (JAX's are while loops,
:mod:`pymc_sgmcmc.jax_compile`); the rewrite ``expand_krylov_kernels`` builds the loop graphs
in their place for the others, and :func:`~pymc_sgmcmc.gram_product.with_covariance_kernels`
and :func:`~pymc_sgmcmc.jax_compile.for_jax` exclude it for the samplers' numba and JAX
blocks.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable

import numba
import numpy as np
import pytensor
import pytensor.tensor as pt
from numba.extending import overload
from pytensor.compile import optdb
from pytensor.graph.basic import Apply, Variable
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.link.numba.dispatch.basic import register_funcify_default_op_cache_key
from pytensor.scalar import upcast
from pytensor.scan.utils import until
from pytensor.tensor.basic import as_tensor_variable

from pymc_sgmcmc import gram_product
from pymc_sgmcmc.gather_dot import _zero
from pymc_sgmcmc.gram_product import EXPANSIONS, CentredGramProduct, _krylov_gram
from pymc_sgmcmc.numba_compile import _stable_state, stable_state

#: The error tolerances of :func:`lanczos_expm`: ||error|| <= u ||v||.
EXPM_TOLERANCE = {"half": 2.0**-11, "single": 2.0**-24, "double": 2.0**-53}

#: The Lanczos tolerances, and the smallest conjugate-gradient tolerance, at which the
#: low-rank kernels of a float64 model read the per-observation gradients G as float32
#: (``model_layer.Covariance.low_rank_parts``), and numba's product kernels sum them in
#: float32, uncentred where the rows' mean lies within their spread, else from a centred
#: copy of the rows (``gram_product._krylov_gram``).
#: Rounding G moves each centred entry by at most 2^-24 (abs(Gc_ij) + abs(m_j)). Near the
#: posterior the mean m is small against the spread of the rows, so that is about 1e-7 of
#: Sigma, and the float32 sums bring the products' error to about 3e-7: a third of the
#: conjugate-gradient tolerance, a thousandth of the Lanczos one, and far below the
#: estimate's own error (about sqrt(D / n)). The Sigma used is thus a slightly different
#: estimate, applied to that accuracy. The kernels then read half the bytes per product
#: (``benchmarks/covariance_results_cost.md``, 2026-11-26 03:54 UTC, against 01:37 UTC):
#: mCCAdL 2.60 instead of 2.86 times SGLD's step at D = 100 and 1.64 instead of 1.96 at
#: D = 1,000, NOGIN with conjugate gradients 3.01 instead of 3.29 and 1.79 instead of 2.22;
#: the float32 sums took mCCAdL's step from 71 to 65 µs and NOGIN's from 87 to 77 µs
#: (2026-12-02). (mSGLD's product Sigma R, a correction of order eps Sigma / 8, reads them
#: so always.)
SINGLE_PRECISION_ROWS = {"expm": ("half",), "cg": 1e-6}


def reads_single_precision_rows(method: str, tolerance: str | float) -> bool:
    """Whether the low-rank kernels read G in float32 for ``method`` ("expm": Lanczos, whose
    tolerance is a name; "cg": conjugate gradients, a relative residual) at ``tolerance``."""
    if method == "expm":
        return tolerance in SINGLE_PRECISION_ROWS["expm"]
    return tolerance >= SINGLE_PRECISION_ROWS["cg"]


def inner(x: Variable, y: Variable) -> Variable:
    """x . y of two vectors as an elementwise product and sum, not a ``Dot``.

    PyTensor's numba backend turns every ``Dot`` into a BLAS call whose wrapper numba compiles
    once per combination of the operands' array layouts, about 1 s for C-contiguous operands
    and 3-4 s for any whose layout numba only knows as "A" (a row of a matrix, an output of a
    fused reduction), as vectors often are. A vector inner product gains nothing from BLAS at
    these sizes, and as a loop it compiles with the elementwise code it is fused into."""
    return pt.sum(x * y)


def on_finite(decompose, matrix: Variable):
    """``decompose(matrix)`` (one output or a tuple), NaN wherever ``matrix`` -- a covariance
    or Gram matrix of the noise estimate, or a Lanczos tridiagonal matrix, from which
    ``decompose`` builds the matrix it factorises -- has a non-finite entry. A diverged
    state must come out of a block as NaN, which the divergence check flags; but numba's
    LAPACK wrappers raise on a non-finite matrix (``LinAlgError``), and the Pade ``expm``
    computes an integer power of 2 from the norm (``OverflowError``): a step size far beyond
    the stability limit crashed ``pm.sample`` instead. The identity stands in for such a
    matrix: every decomposition here accepts what is built from it."""
    finite = pt.all(pt.isfinite(matrix))
    result = decompose(pt.switch(finite, matrix, pt.eye(matrix.shape[0], dtype=matrix.dtype)))
    if isinstance(result, Variable):
        return pt.switch(finite, result, np.nan)
    return tuple(pt.switch(finite, r, np.nan) for r in result)


def lanczos_expm(
    matvec: Callable[[Variable], Variable],
    scale,
    v: Variable,
    tolerance: str = "half",
    max_products: int = 64,
    fixed_count: bool = False,
) -> tuple[Variable, Variable]:
    r"""exp(scale Sigma) v for scale <= 0 and a positive semi-definite Sigma given by its
    products ``matvec(x)`` = Sigma x, by the Lanczos process.

    k steps of Lanczos from q_1 = v / ||v|| give the orthonormal Krylov basis Q_k and the
    tridiagonal T_k = Q_k^T Sigma Q_k (diagonal alpha_i, off-diagonal beta_i), and
    exp(t Sigma) v ~ ||v|| Q_k exp(t T_k) e_1, with exp(t T_k) from the eigen-decomposition
    of the small T_k (Saad 1992; Hochbruck & Lubich 1997). It stops at the first k where

    .. math:: \frac{\prod_{i \le k} (|t| \beta_i)}{k!}\,
              e^{|t| \max(0, \gamma_k)} \le u,
              \qquad \gamma_k = \max_{i \le k} (\beta_{i-1} + \beta_i - \alpha_i),

    a bound on the error relative to ||v|| (u from ``tolerance``: "half" 2^-11, "single"
    2^-24, "double" 2^-53). Why it bounds the error: u(tau) = ||v|| Q_k exp(-tau T_k) e_1
    solves u' = -Sigma u + r with the defect r = ||v|| beta_k q_{k+1} [exp(-tau T_k)]_{k1};
    Sigma is positive semi-definite, so ||exp(-s Sigma)|| <= 1 and the error at ``|t|`` is
    at most the integral of ||r||; the (k, 1) entry, a sum over paths of a
    nearest-neighbour walk from 1 to k, is at most
    tau^(k-1) prod_{i<k} beta_i / (k-1)! e^(tau gamma_k). The bound uses no norm of Sigma,
    and the off-diagonals beta_i are those of Sigma less any multiple of the identity (its
    mean eigenvalue, a shrinkage target), so the count follows the spread of the spectrum
    only. At most ``max_products`` products: a step that stops there is kept when Saad's
    a-posteriori estimate ``||v|| beta_k |[t phi_1(t T_k)]_{k1}|`` (the defect integrated
    with its sign) meets u (or 100 times the rounding unit, which limits it), and is NaN
    otherwise, which the samplers treat as a divergence.

    The error lies along the next basis vector q_{k+1}, orthogonal to v, to first order:
    the product's length, hence the kinetic energy, is kept far more closely than the
    tolerance (on the regression below at h = 1e-3, mean relative error 1e-4 at "half",
    but ``|cos(v, error)| <= 2e-5`` and relative energy changes of 3e-8 per step, against
    the 1e-3 that the friction exchanges).

    This replaces the scaled Taylor polynomial of mCCAdL's eqs. 18-22 (Al-Mohy & Higham
    2011), which needs an estimate of ||Sigma|| (four products of power iteration) and
    s m products proportional to ||t Sigma||. Measured on minibatch estimates of the D = 100
    regression (n = 500, 10 minibatches each, against ``scipy.linalg.expm``): at the
    posterior mean, ||t Sigma|| = 0.4 (h = 1e-3), 3 products against 9, error <= 2e-4;
    ||t Sigma|| = 10 (h = 5e-3), 11 against 55; at theta = 0, ||t Sigma|| = 49, 29-33
    against 263.

    ``fixed_count=True`` (for JAX, which has no loop of data-dependent length) always runs
    ``max_products`` iterations, those after the stop contributing nothing: the same
    result. Returns (result, number of Sigma-vector products).
    """
    u = EXPM_TOLERANCE[tolerance]
    dtype = v.type.dtype
    tiny = np.finfo(dtype).tiny
    t = -pt.as_tensor(scale).astype(dtype)  # |t|
    norm_v = pt.sqrt(inner(v, v))

    def lanczos_step(q_prev, q, beta_prev, log_bound, gamma, count, done):
        w = matvec(q)
        alpha = inner(q, w)
        w = w - alpha * q - beta_prev * q_prev
        beta = pt.sqrt(inner(w, w))
        gamma_new = pt.maximum(gamma, beta_prev + beta - alpha)
        count_new = count + 1
        # log of prod (|t| beta_i) / k!, in logs: the product under- or overflows.
        log_bound_new = (
            log_bound + pt.log(pt.maximum(t * beta, tiny)) - pt.log(count_new.astype(dtype))
        )
        stop = log_bound_new + t * pt.maximum(gamma_new, 0.0) <= np.log(u)
        # The last off-diagonal beta_k couples T_k to q_{k+1}, outside the basis: 0 in T.
        coupling = pt.switch(stop, 0.0, beta)
        new = (q, w / pt.maximum(beta, tiny), beta, log_bound_new, gamma_new, count_new, stop)
        if not fixed_count:
            return (alpha, coupling, q, *new), until(stop)
        # Iterations after the stop leave the state and add zeros to T and Q.
        old = (q_prev, q, beta_prev, log_bound, gamma, count, done)
        state = tuple(pt.switch(done, o, n) for o, n in zip(old, new, strict=True))
        nothing = pt.zeros_like(alpha)
        out = (pt.switch(done, nothing, alpha), pt.switch(done, nothing, coupling))
        return (*out, pt.switch(done, pt.zeros_like(q), q), *state)

    zero = pt.constant(0.0, dtype=dtype)
    outputs = pytensor.scan(
        lanczos_step,
        outputs_info=[
            None,
            None,
            None,
            pt.zeros_like(v),
            v / pt.maximum(norm_v, tiny),
            zero,
            zero,
            pt.constant(-np.inf, dtype=dtype),
            pt.constant(0, dtype="int64"),
            pt.constant(False, dtype="bool"),
        ],
        n_steps=max_products,
        return_updates=False,
    )
    alphas, couplings, basis = outputs[:3]
    last_beta, count, converged = outputs[5][-1], outputs[8][-1], outputs[9][-1]
    off = couplings[:-1]
    tridiagonal = pt.diag(alphas) + pt.diag(off, 1) + pt.diag(off, -1)
    eigenvalues, vectors = on_finite(pt.linalg.eigh, tridiagonal)  # NaN from a diverged state
    first = vectors[0]
    # Products with the small k x k and k x D matrices as elementwise sums (see :func:`inner`).
    coefficients = pt.sum(vectors * (pt.exp(-t * eigenvalues) * first), axis=1)
    result = norm_v * pt.sum(coefficients[:, None] * basis, axis=0)
    # Saad's estimate at the cap: the defect's (k, 1) entry integrated over [0, |t|],
    # (1 - exp(-|t| lambda)) / lambda per eigenvalue (|t| at lambda = 0).
    small = t * pt.abs(eigenvalues) < 1e-8
    safe = pt.switch(small, 1.0, eigenvalues)
    phi = pt.switch(small, t, -pt.expm1(-t * eigenvalues) / safe)
    estimate = last_beta * pt.abs(inner(vectors[count - 1], phi * first))
    # Rounding alone leaves errors of some eps: a tolerance below that is met at 100 eps.
    accepted = pt.or_(converged, estimate <= max(u, 100 * np.finfo(dtype).eps))
    result = pt.switch(accepted, result, np.nan)
    return result, count


def conjugate_gradients(
    apply: Callable[[Variable], Variable],
    v: Variable,
    iterations: int,
    tolerance: float,
    fixed_count: bool = False,
) -> Variable:
    """A^{-1} v by conjugate gradients for a symmetric positive definite A given by its
    products ``apply(x)`` = A x, from x0 = 0.

    Stops when the residual falls below ``tolerance`` times ||v|| or after ``iterations``
    products. ``fixed_count=True`` (for JAX, which has no data-dependent loop) always runs
    ``iterations`` products and freezes the iterate once converged: the same result."""
    stop = (tolerance**2) * inner(v, v)

    def cg_step(x, r, d, rr):
        ad = apply(d)
        step = pt.switch(rr > 0, rr / inner(d, ad), 0.0)
        x_new = x + step * d
        r_new = r - step * ad
        rr_new = inner(r_new, r_new)
        d_new = r_new + pt.switch(rr > 0, rr_new / rr, 0.0) * d
        if fixed_count:
            done = rr <= stop  # converged at an earlier iteration
            old, new = (x, r, d, rr), (x_new, r_new, d_new, rr_new)
            return tuple(pt.switch(done, o, n) for o, n in zip(old, new, strict=True))
        return (x_new, r_new, d_new, rr_new), until(rr_new <= stop)

    # From x0 = 0 (r0 = v): the first iteration's x1, the best multiple of v, is at least
    # as good as x0 = v / alpha, which costs a product for its residual (5 products
    # either way at h = 1e-3 on the D = 100 regression, 13.8 against 14.7 at 5e-3).
    outputs = pytensor.scan(
        cg_step,
        outputs_info=[pt.zeros_like(v), v, v, inner(v, v)],
        n_steps=iterations,
        return_updates=False,
    )
    return outputs[0][-1]


def low_rank_matvec(g, mean, columns, gain, shift) -> Callable[[Variable], Variable]:
    """x -> gain M^T (Gc^T Gc (M x)) + d x, with the column map M = diag(s) for a vector s =
    ``columns`` or the matrix ``columns`` itself (a dense preconditioner's R S), and d =
    ``shift``: the products with the operators of :class:`LowRankExpm` and
    :class:`LowRankShiftedSolve` (whose ``diagonal`` is d), as :func:`lanczos_expm` and
    :func:`conjugate_gradients` take them."""
    if columns.type.ndim == 2:
        return lambda x: gain * (columns.T @ CentredGramProduct()(g, mean, columns @ x)) + shift * x

    def matvec(x):
        return gain * columns * CentredGramProduct()(g, mean, columns * x) + shift * x

    return matvec


def _low_rank_inputs(op: Op, values, ndims: list[int]) -> tuple[list[Variable], Variable]:
    """The inputs of a low-rank kernel, of ``ndims`` dimensions each, and its vector result's
    type. The dtype is that of the rows and vectors; the scalars follow it, as they do in the
    graphs. Rows in float32 stay float32 in a float64 kernel, which reads and sums them in
    single precision (:data:`SINGLE_PRECISION_ROWS`)."""
    inputs = [as_tensor_variable(x) for x in values]
    got = [x.type.ndim for x in inputs]
    # The third input, the column map, is a vector of scales or a D x D matrix.
    if got[:2] + got[3:] != ndims[:2] + ndims[3:] or got[2] not in (1, 2):
        raise TypeError(f"{type(op).__name__} takes inputs of {ndims} dimensions")
    dtype = upcast(*(x.type.dtype for x in inputs if x.type.ndim))
    rows, *rest = inputs
    rows = rows if rows.type.dtype == "float32" else rows.astype(dtype)
    inputs = [rows, *(x.astype(dtype) for x in rest)]
    dim = next((s for x in inputs[1:] for s in x.type.shape if s), None)
    return inputs, pt.tensor(dtype=dtype, shape=(dim,))


class LowRankExpm(Op):
    """``(exp(-t Sigma) v, products)`` for ``Sigma x = gain M^T (Gc^T Gc (M x)) + d x``, with
    ``Gc`` the rows ``G`` (n, D) less their mean ``m``, the column map ``M`` (column scales
    s (D,) for diag(s), or a D x D matrix) and shift ``d`` (D,), ``t >= 0``:
    :func:`lanczos_expm` with ``tolerance`` and ``max_products``, in one kernel."""

    __props__ = ("tolerance", "max_products")

    def __init__(self, tolerance: str = "half", max_products: int = 64):
        if tolerance not in EXPM_TOLERANCE:
            raise ValueError(
                f"tolerance must be one of {sorted(EXPM_TOLERANCE)}, got {tolerance!r}"
            )
        self.tolerance = tolerance
        self.max_products = int(max_products)

    def make_node(self, g, mean, columns, gain, shift, t, v):
        inputs, result = _low_rank_inputs(
            self, (g, mean, columns, gain, shift, t, v), [2, 1, 1, 0, 1, 0, 1]
        )
        return Apply(self, inputs, [result, pt.scalar(dtype="int64")])

    def perform(self, node, inputs, outputs):
        result, count = _lanczos_expm.py_func(*inputs, *self._constants())
        outputs[0][0] = np.asarray(result, dtype=node.outputs[0].dtype)
        outputs[1][0] = np.asarray(count, dtype="int64")

    def _constants(self) -> tuple[float, int]:
        return EXPM_TOLERANCE[self.tolerance], self.max_products

    def infer_shape(self, node, shapes):
        return [shapes[-1], ()]


class LowRankShiftedSolve(Op):
    """``A^{-1} v`` for ``A x = a x + gain M^T (Gc^T Gc (M x))``, with ``Gc`` the rows ``G``
    (n, D) less their mean ``m``, the column map ``M`` as in :class:`LowRankExpm` and a
    positive diagonal ``a`` (D,): :func:`conjugate_gradients` with ``tolerance`` and
    ``iterations``, in one kernel."""

    __props__ = ("tolerance", "iterations")

    def __init__(self, tolerance: float, iterations: int):
        self.tolerance = float(tolerance)
        self.iterations = int(iterations)

    def make_node(self, g, mean, columns, gain, diagonal, v):
        inputs, result = _low_rank_inputs(
            self, (g, mean, columns, gain, diagonal, v), [2, 1, 1, 0, 1, 1]
        )
        return Apply(self, inputs, [result])

    def perform(self, node, inputs, outputs):
        result = _shifted_cg.py_func(*inputs, self.tolerance, self.iterations)
        outputs[0][0] = np.asarray(result, dtype=node.outputs[0].dtype)

    def infer_shape(self, node, shapes):
        return [shapes[-1]]


@node_rewriter([LowRankShiftedSolve])
def expand_shifted_solve(fgraph, node):
    """``LowRankShiftedSolve`` -> :func:`conjugate_gradients`'s graph for backends without
    its kernel."""
    *operator, v = node.inputs
    result = conjugate_gradients(
        low_rank_matvec(*operator), v, node.op.iterations, node.op.tolerance
    )
    return [pt.specify_shape(result, node.outputs[0].type.shape)]


@node_rewriter([LowRankExpm])
def expand_lanczos_expm(fgraph, node):
    """``LowRankExpm`` -> :func:`lanczos_expm`'s graph for backends without its kernel."""
    g, mean, columns, gain, shift, t, v = node.inputs
    op = node.op
    matvec = low_rank_matvec(g, mean, columns, gain, shift)
    result, count = lanczos_expm(matvec, -t, v, op.tolerance, op.max_products)
    return [pt.specify_shape(result, node.outputs[0].type.shape), count]


#: Name of the rewrite that expands the kernels into loop graphs (for backends without them).
EXPAND_KRYLOV = "expand_krylov_kernels"
# Before the Gram product's expansion (0.05), which then expands the products in their loops.
optdb.register(
    EXPAND_KRYLOV,
    in2out(expand_lanczos_expm, expand_shifted_solve),
    "fast_run",
    "fast_compile",
    EXPANSIONS,
    position=0.04,
)


@numba.njit(cache=True)
def _check(ok: bool) -> None:
    if not ok:
        raise ValueError("low-rank Krylov kernel: shapes do not match")


def _map_in(columns, x, out):
    """out = M x for the low-rank operator's column map M: diag(s) for a vector s of column
    scales, the matrix itself for a dense preconditioner's map R S (D x D)."""
    out[:] = columns * x if columns.ndim == 1 else columns @ x


def _map_out(columns, gain, shift, x, gram, out):
    """out = gain M^T gram + d x, for M as in :func:`_map_in` (``gram`` = Gc^T Gc M x)."""
    mapped = columns * gram if columns.ndim == 1 else columns.T @ gram
    out[:] = gain * mapped + shift * x


@overload(_map_in, jit_options={"cache": True})
def _overload_map_in(columns, x, out):
    if columns.ndim == 1:

        def by_scales(columns, x, out):
            for j in range(x.shape[0]):
                out[j] = columns[j] * x[j]

        return by_scales

    def by_matrix(columns, x, out):  # a row of M at a time: M is C-contiguous
        for i in range(x.shape[0]):
            total = 0.0
            for j in range(x.shape[0]):
                total += columns[i, j] * x[j]
            out[i] = total

    return by_matrix


@overload(_map_out, jit_options={"cache": True})
def _overload_map_out(columns, gain, shift, x, gram, out):
    if columns.ndim == 1:

        def by_scales(columns, gain, shift, x, gram, out):
            for j in range(x.shape[0]):
                out[j] = gain * columns[j] * gram[j] + shift[j] * x[j]

        return by_scales

    def by_matrix(columns, gain, shift, x, gram, out):  # M^T gram, reading M by rows
        for j in range(x.shape[0]):
            out[j] = 0.0
        for i in range(x.shape[0]):
            gi = gram[i]
            for j in range(x.shape[0]):
                out[j] += columns[i, j] * gi
        for j in range(x.shape[0]):
            out[j] = gain * out[j] + shift[j] * x[j]

    return by_matrix


@numba.njit(cache=True)
def _apply_low_rank(rows, centre, columns, gain, shift, x, scaled, gram, out, first):
    """out = gain M^T (Gc^T Gc (M x)) + d x, with M = diag(s) or a dense preconditioner's
    map (``scaled`` and ``gram`` are work space): the operator of both kernels, as
    :func:`low_rank_matvec` writes it as a graph. Returns the rows and centre for the next
    product (``gram_product._krylov_gram``: G and m to start, with ``first`` true)."""
    _map_in(columns, x, scaled)
    rows, centre = _krylov_gram(rows, centre, scaled, gram, first)
    _map_out(columns, gain, shift, x, gram, out)
    return rows, centre


@numba.njit(cache=True)
def _lanczos_expm(g, mean, columns, gain, shift, t, v, u, max_products):
    """:func:`lanczos_expm` on ``x -> gain M^T (Gc^T Gc (M x)) + d x``, line by line; the
    vector loops in order (no fast math: the products dominate, and the same rounding
    wherever the kernel was compiled). Written as loops, without NumPy's array expressions,
    reductions and constructors (``v * v``, ``np.sum``, ``np.diag``, ``np.full``,
    ``np.all``): each of those is more code for numba to compile."""
    dim = v.shape[0]
    _check(g.shape[1] == dim and mean.shape[0] == dim == columns.shape[-1] == shift.shape[0])
    tiny, eps = np.finfo(v.dtype).tiny, np.finfo(v.dtype).eps
    log_u, gain, t = np.log(u), gain.item(), t.item()
    basis = np.empty((max_products, dim), dtype=v.dtype)  # rows below count only
    alphas = np.zeros(max_products, dtype=v.dtype)
    couplings = np.zeros(max_products, dtype=v.dtype)
    scaled, gram = np.empty(dim, dtype=v.dtype), np.empty(dim, dtype=v.dtype)
    w, q = np.empty(dim, dtype=v.dtype), np.empty(dim, dtype=v.dtype)
    norm_v = _zero(v)  # sums in the vectors' type, as np.sum's
    for j in range(dim):
        norm_v += v[j] * v[j]
    norm_v = np.sqrt(norm_v)
    for j in range(dim):
        q[j] = v[j] / max(norm_v, tiny)
    beta_prev, log_bound, gamma, count, stop = 0.0, 0.0, -np.inf, 0, False
    rows, centre = g, mean
    while count < max_products and not stop:
        rows, centre = _apply_low_rank(
            rows, centre, columns, gain, shift, q, scaled, gram, w, count == 0
        )
        alpha = 0.0
        for j in range(dim):
            alpha += q[j] * w[j]
        beta = _zero(w)
        for j in range(dim):
            previous = basis[count - 1, j] if count > 0 else 0.0
            w[j] = w[j] - alpha * q[j] - beta_prev * previous
            beta += w[j] * w[j]
        beta = np.sqrt(beta)
        gamma = max(gamma, beta_prev + beta - alpha)
        count += 1
        log_bound += np.log(max(t * beta, tiny)) - np.log(count)
        stop = log_bound + t * max(gamma, 0.0) <= log_u
        alphas[count - 1] = alpha
        couplings[count - 1] = 0.0 if stop else beta
        for j in range(dim):
            basis[count - 1, j] = q[j]
            q[j] = w[j] / max(beta, tiny)
        beta_prev = beta
    result = np.zeros(dim, dtype=v.dtype)
    tridiagonal = np.zeros((count, count), dtype=v.dtype)
    finite = True
    for i in range(count):
        tridiagonal[i, i] = alphas[i]
        finite = finite and np.isfinite(alphas[i])
    for i in range(count - 1):
        tridiagonal[i, i + 1] = tridiagonal[i + 1, i] = couplings[i]
        finite = finite and np.isfinite(couplings[i])
    if not finite:
        # A diverged state (non-finite momentum or gradients): numba's eigh would raise on
        # it; NaN is what the divergence check flags.
        for k in range(dim):
            result[k] = np.nan
        return result, np.asarray(count)
    eigenvalues, vectors = np.linalg.eigh(tridiagonal)
    for i in range(count):
        coefficient = 0.0
        for j in range(count):
            coefficient += vectors[i, j] * np.exp(-t * eigenvalues[j]) * vectors[0, j]
        for k in range(dim):
            result[k] += norm_v * coefficient * basis[i, k]
    if not stop:  # Saad's a-posteriori estimate at the cap
        estimate = 0.0
        for j in range(count):
            lam = eigenvalues[j]
            phi = t if t * abs(lam) < 1e-8 else -np.expm1(-t * lam) / lam
            estimate += vectors[count - 1, j] * phi * vectors[0, j]
        if not beta_prev * abs(estimate) <= max(u, 100 * eps):  # also NaN
            for k in range(dim):
                result[k] = np.nan
    return result, np.asarray(count)  # a 0-d array, as PyTensor passes int64 scalars


@numba.njit(cache=True)
def _shifted_cg(g, mean, columns, gain, diagonal, v, tolerance, iterations):
    """:func:`conjugate_gradients` on ``x -> a x + gain M^T (Gc^T Gc (M x))``, line by line
    (vector loops in order, without array expressions, as in :func:`_lanczos_expm`)."""
    dim = v.shape[0]
    _check(g.shape[1] == dim and mean.shape[0] == dim == columns.shape[-1] == diagonal.shape[0])
    gain = gain.item()
    x = np.zeros(dim, dtype=v.dtype)
    r, d = np.empty(dim, dtype=v.dtype), np.empty(dim, dtype=v.dtype)
    scaled, gram = np.empty(dim, dtype=v.dtype), np.empty(dim, dtype=v.dtype)
    ad = np.empty(dim, dtype=v.dtype)
    rr = _zero(v)  # in the vector's type, as np.sum's
    for j in range(dim):
        r[j] = d[j] = v[j]
        rr += v[j] * v[j]
    stop = tolerance**2 * rr
    rows, centre = g, mean
    for iteration in range(iterations):
        rows, centre = _apply_low_rank(
            rows, centre, columns, gain, diagonal, d, scaled, gram, ad, iteration == 0
        )
        curvature = 0.0
        for j in range(dim):
            curvature += d[j] * ad[j]
        step = rr / curvature if rr > 0 else 0.0
        rr_new = 0.0
        for j in range(dim):
            x[j] += step * d[j]
            r[j] -= step * ad[j]
            rr_new += r[j] * r[j]
        ratio = rr_new / rr if rr > 0 else 0.0
        for j in range(dim):
            d[j] = r[j] + ratio * d[j]
        rr = rr_new
        if rr_new <= stop:
            break
    return x


@register_funcify_default_op_cache_key(LowRankShiftedSolve)
def _numba_shifted_cg(op, node, **kwargs):
    # The cap as a NumPy integer: a Python int in the closure is a literal type to numba, which
    # compiles the loop below once per value (as _numba_lanczos_expm's count).
    tolerance, iterations = op.tolerance, np.int64(op.iterations)

    @numba.njit
    def shifted_cg_kernel(g, mean, columns, gain, diagonal, v):
        # The operator's small operands as writable C-contiguous arrays (a graph's constant is
        # read-only, a vector cut from a matrix strided): one compiled loop per dtype and shape.
        mean, columns, gain = stable_state(mean), stable_state(columns), stable_state(gain)
        diagonal = stable_state(diagonal)
        return _shifted_cg(g, mean, columns, gain, diagonal, v, tolerance, iterations)

    return shifted_cg_kernel, _CACHE_SALT


@register_funcify_default_op_cache_key(LowRankExpm)
def _numba_lanczos_expm(op, node, **kwargs):
    u, max_products = op._constants()
    # A NumPy integer, not a Python int, which numba types as a literal and for which it
    # compiled _lanczos_expm once per cap (about 1 s with empty caches; a float is never one).
    max_products = np.int64(max_products)

    @numba.njit
    def lanczos_expm_kernel(g, mean, columns, gain, shift, t, v):
        # As in the conjugate gradients' kernel.
        mean, columns, gain = stable_state(mean), stable_state(columns), stable_state(gain)
        shift, t = stable_state(shift), stable_state(t)
        return _lanczos_expm(g, mean, columns, gain, shift, t, v, u, max_products)

    return lanczos_expm_kernel, _CACHE_SALT


#: Salts PyTensor's cache key of the ops with the kernels' sources (and the Gram kernel's).
_CACHE_SALT = int(
    hashlib.sha256(
        "".join(
            [str(gram_product._CACHE_SALT)]
            + [
                inspect.getsource(f)
                for f in (
                    stable_state,
                    _stable_state,
                    _check,
                    _map_in,
                    _map_out,
                    _overload_map_in,
                    _overload_map_out,
                    _apply_low_rank,
                    _lanczos_expm,
                    _numba_lanczos_expm,
                    _shifted_cg,
                    _numba_shifted_cg,
                )
            ]
        ).encode()
    ).hexdigest()[:12],
    16,
)
