"""The noise covariance's product ``Gc^T Gc w`` in one pass over the per-observation gradients.

The covariance samplers' low-rank path (mCCAdL's Lanczos C step, NOGIN's conjugate gradients)
multiplies by :math:`\\Sigma \\propto G_c^\\top G_c`, with ``G`` the minibatch's n x D
per-observation gradients and ``Gc`` their centred rows, several times per step. As two
matrix-vector products, ``u = G w - (m . w)`` and ``G^T u`` (``u`` sums to zero, so it needs no
second centring), BLAS reads the n rows twice. :class:`CentredGramProduct` reads each row
once: ``u_i`` is known as soon as the row's dot product is, and the row is added to the result
while it is still in the L1 cache, four rows at a time (four independent sums keep the
floating-point pipeline busy). A product with the 500 x 100 gradients of the benchmark's
regression took 6.5 µs as two BLAS calls in numba and 5.1 µs fused; in the compiled blocks
at D = 100, n = 500, h = 1e-3, mCCAdL (3 products per step) went from 55.6 to 50.1 µs per
step and NOGIN with conjugate gradients (5) from 67.9 to 56.4 µs, measured alternately with
SGLD at 15.2-15.3 µs (``benchmarks/covariance.py``'s measurement, 2026-11-25 20:50 UTC); in
``benchmarks/covariance_results_cost.md`` (21:01 UTC) 3.35 and 3.75 times SGLD's step against
3.66 and 4.55 at 19:03 UTC, and 1.92 and 2.28 against 2.09 and 2.54 at D = 1,000. The cold
compile is unchanged (mCCAdL on P1, step construction to the first draw with empty caches:
22.3 s against 23.0 s; NOGIN 13.3 s against 13.3 s).

The kernel sums in the rows' precision. Rows rounded to float32 (the Krylov kernels' default
tolerances, :data:`~pymc_sgmcmc.krylov.SINGLE_PRECISION_ROWS`) are summed in float32, each
entry centred before it is multiplied (``_centred_gram_single``); float64 rows keep the
uncentred float64 sums (``_gram_uncentred_sums``). On the 2-core Xeon with AVX-512
(2026-12-02, numba's and PyTensor's caches emptied before each run), the float32 sums took
a Lanczos C step with 3 products from 28.9 to 21.5-22.4 µs, mCCAdL's step on the D = 100
regression from 71.2-71.4 to 64.8-65.6 µs and NOGIN's (5 conjugate-gradient products) from
86.0-87.2 to 76.5-77.8 µs, two runs each. The Krylov kernels multiply by the same rows
several times a step: they sum float32 rows uncentred where the rows' mean lies within
their spread, as near the posterior, which the first product measures, and elsewhere read a
centred copy of the rows (``_krylov_gram``). In ``benchmarks/covariance.py``'s measurement
at D = 100, five alternated pairs of processes (the 2-core AMD EPYC, 2026-12-05), the
uncentred products after a centred first one took mCCAdL's step from 59.2-66.4 to
57.6-60.7 µs (median 2.66 to 2.42 times SGLD's) and NOGIN's from 69.5-72.6 to 63.8-68.0 µs
(3.04 to 2.77); the uncentred first product (2026-12-06) did not move them measurably. The
other backends' graph (below) sums the uncentred rows in the vectors' precision.

Numba caches each function with the source file it is defined in, and a caller's cache holds
the kernels it calls compiled into it: after an edit of this module or of
:mod:`pymc_sgmcmc.gather_dot`, the cached Krylov kernels (and blocks in PyTensor's compile
directory that were compiled with them) keep running the old loops until
``pymc_sgmcmc/__pycache__/*.nb[ci]`` and PyTensor's cache are removed. Installing a release
rewrites every file, which renews numba's entries, and the ops' cache keys below follow
the kernels' sources.

The Krylov kernels of :mod:`pymc_sgmcmc.krylov` call this kernel for their products, so that
the loops around them run in numba too. Only the numba backend has the kernel. Everywhere else
the rewrite ``expand_centred_gram`` (tagged ``fast_run`` and ``fast_compile``, at the start of
the rewrites) puts the two products in its place, so that the C and JAX backends compile
PyTensor's own graph; :func:`with_covariance_kernels` excludes that rewrite (and the Krylov
kernels') for the samplers' numba blocks. Its kernel
rounds like the fused minibatch products (:mod:`pymc_sgmcmc.gather_dot`): full fast math on
loops whose length the optimiser cannot see, so a block loaded from the cache draws what the
compiling process drew (checked on mCCAdL and NOGIN at D = 100).
"""

from __future__ import annotations

import hashlib
import inspect

import numba
import numpy as np
import pytensor.tensor as pt
from numba.core import types
from numba.extending import overload
from pytensor.compile import optdb
from pytensor.compile.mode import Mode, get_mode
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.link.numba.dispatch.basic import register_funcify_default_op_cache_key
from pytensor.link.numba.linker import NumbaLinker
from pytensor.scalar import upcast
from pytensor.tensor.basic import as_tensor_variable

from pymc_sgmcmc import gather_dot
from pymc_sgmcmc.gather_dot import _opaque, _zero

#: Name of the rewrite that expands :class:`CentredGramProduct` into two ``Dot`` products.
EXPAND = "expand_centred_gram"
#: Tag of the rewrites that expand the fused covariance kernels (this module's and
#: :class:`~pymc_sgmcmc.krylov.LowRankExpm`) for backends other than numba.
EXPANSIONS = "expand_covariance_kernels"


class CentredGramProduct(Op):
    """``Gc^T (Gc w)`` for rows ``G`` (n, D) with mean ``m`` (D,), ``Gc = G - m``, and ``w``
    (D,): computed as ``G^T (G w - (m . w))``, exactly as the expanded graph does."""

    __props__ = ()

    def make_node(self, g, mean, w):
        g, mean, w = map(as_tensor_variable, (g, mean, w))
        if g.type.ndim != 2 or mean.type.ndim != 1 or w.type.ndim != 1:
            raise TypeError("CentredGramProduct takes a matrix, its row mean and a vector")
        dtype = upcast(g.dtype, mean.dtype, w.dtype)
        dim = next((s for s in (g.type.shape[1], mean.type.shape[0], w.type.shape[0]) if s), None)
        return Apply(self, [g, mean, w], [pt.tensor(dtype=dtype, shape=(dim,))])

    def perform(self, node, inputs, outputs):
        g, mean, w = inputs
        if not g.shape[1] == mean.shape[0] == w.shape[0]:
            raise ValueError("CentredGramProduct: shapes do not match")
        out = (g @ w - mean @ w) @ g
        outputs[0][0] = np.asarray(out, dtype=node.outputs[0].dtype)

    def infer_shape(self, node, shapes):
        return [(shapes[0][1],)]


@node_rewriter([CentredGramProduct])
def expand_centred_gram(fgraph, node):
    """``CentredGramProduct(G, m, w)`` -> ``(G w - m . w) @ G`` for backends without its
    kernel."""
    g, mean, w = node.inputs
    out = pt.dot(pt.dot(g, w) - pt.sum(mean * w), g).astype(node.outputs[0].type.dtype)
    return [pt.specify_shape(out, node.outputs[0].type.shape)]


# First among the graph rewrites (after the initial merge), so that the rest see the products.
optdb.register(
    EXPAND, in2out(expand_centred_gram), "fast_run", "fast_compile", EXPANSIONS, position=0.05
)


def _centred_gram(g, mean, w, out):
    """out = Gc^T (Gc w) for the rows ``g`` and their mean ``mean``, in the rows' precision:
    :func:`_centred_gram_single` for float32 rows, else :func:`_gram_uncentred_sums` (this
    function's overload chooses when numba compiles a caller; called from Python, here)."""
    kernel = _centred_gram_single if g.dtype == np.float32 else _gram_uncentred_sums
    kernel(g, mean, w, out)


@overload(_centred_gram, jit_options={"cache": True})
def _overload_centred_gram(g, mean, w, out):
    if g.dtype == types.float32:
        return lambda g, mean, w, out: _centred_gram_single(g, mean, w, out)
    return lambda g, mean, w, out: _gram_uncentred_sums(g, mean, w, out)


@numba.njit(cache=True, fastmath=True)
def _gram_uncentred_sums(g, mean, w, out, squares=False):
    """out = sum_i (g_i . w - m . w) g_i, four rows at a time: the loops of
    :func:`~pymc_sgmcmc.gather_dot._gather_matvec` and ``_gather_rmatvec`` in one, on rows in
    place (written out again, not shared: see ``gather_dot._GLM_KERNEL``), read as ``g[i, j]``
    rather than through row views (see ``gather_dot._row``). Returns the sum of the rows'
    squared entries where ``squares`` is true, else 0: LLVM takes the test out of the loop,
    so that one compiled loop serves both (without the squares, 4.6 us at 500 x 100 float32
    rows, as without the flag; with them 5.5 us), where the flag comes as a runtime bool (a
    constant True or False at the call is a literal type to numba, each compiled apart).
    The sums are uncentred, in the type of ``out``: in float64 that loses about
    ``log10(m^2 / var)`` of 16 digits, and centring each entry first (as
    :func:`_centred_gram_single` does) took 15 % longer."""
    n, d = g.shape[0], _opaque(g.shape[1])  # the length opaque: see gather_dot._opaque
    c = _zero(out)
    for j in range(d):
        c += mean[j] * w[j]
    for j in range(d):
        out[j] = 0
    q0 = q1 = q2 = q3 = _zero(g)
    i = 0
    while i + 4 <= n:
        s0 = s1 = s2 = s3 = _zero(out)
        for j in range(d):
            wj = w[j]
            s0 += g[i, j] * wj
            s1 += g[i + 1, j] * wj
            s2 += g[i + 2, j] * wj
            s3 += g[i + 3, j] * wj
            if squares:
                q0 += g[i, j] * g[i, j]
                q1 += g[i + 1, j] * g[i + 1, j]
                q2 += g[i + 2, j] * g[i + 2, j]
                q3 += g[i + 3, j] * g[i + 3, j]
        s0, s1, s2, s3 = s0 - c, s1 - c, s2 - c, s3 - c
        for j in range(d):
            out[j] += g[i, j] * s0 + g[i + 1, j] * s1 + g[i + 2, j] * s2 + g[i + 3, j] * s3
        i += 4
    while i < n:
        s = _zero(out)
        for j in range(d):
            s += g[i, j] * w[j]
            if squares:
                q0 += g[i, j] * g[i, j]
        s -= c
        for j in range(d):
            out[j] += g[i, j] * s
        i += 1
    return (q0 + q1) + (q2 + q3)


@numba.njit(cache=True, fastmath=True)
def _centred_gram_single(g, mean, w, out):
    """out = sum_i ((g_i - m) . w) (g_i - m) for float32 rows, summed in float32 with ``m``
    and ``w`` rounded to float32, each entry centred before it is multiplied: the single
    products of :class:`CentredGramProduct` (mSGLD's Sigma R).

    Float32 sums need no conversions and twice the SIMD lanes: with float64 ``m``, ``w`` and
    sums, as :func:`_gram_uncentred_sums` computes them, a product with 500 x 100 rows took
    8.4 instead of 5.9 us (2-core Xeon with AVX-512, 2026-12-02). The centring keeps the
    rounding relative to the rows' spread: uncentred sums in float32 lose ``log10(m^2 / var)``
    of about 7 digits (a relative error of 2.5e-3 with rows 100 sds from zero, above the
    Lanczos kernel's 2^-11). Against the float64 product of the rows before rounding, at
    500 x 100: 3e-7 relative with rows at zero and 1.5e-6 at 100 sds, where the rounding of
    the rows alone costs 1.4e-6 (the float64 sums of the rounded rows, uncentred: 1.5e-8
    and 4e-5 to 1.3e-4, their mean ``m`` being that of the rows before rounding)."""
    n, d = g.shape[0], _opaque(g.shape[1])  # the length opaque: see gather_dot._opaque
    zero = _zero(g)
    w32, m32, total = np.empty(d, g.dtype), np.empty(d, g.dtype), np.zeros(d, g.dtype)
    for j in range(d):
        w32[j], m32[j] = w[j], mean[j]
    i = 0
    while i + 4 <= n:
        s0 = s1 = s2 = s3 = zero
        for j in range(d):
            wj, mj = w32[j], m32[j]
            s0 += (g[i, j] - mj) * wj
            s1 += (g[i + 1, j] - mj) * wj
            s2 += (g[i + 2, j] - mj) * wj
            s3 += (g[i + 3, j] - mj) * wj
        for j in range(d):
            mj = m32[j]
            total[j] += (
                (g[i, j] - mj) * s0
                + (g[i + 1, j] - mj) * s1
                + (g[i + 2, j] - mj) * s2
                + (g[i + 3, j] - mj) * s3
            )
        i += 4
    while i < n:
        s = zero
        for j in range(d):
            s += (g[i, j] - m32[j]) * w32[j]
        for j in range(d):
            total[j] += (g[i, j] - m32[j]) * s
        i += 1
    for j in range(d):
        out[j] = total[j]


@numba.njit(cache=True)
def _uncentred_gram_single(g, mean, w, out, squares):
    """out = Gc^T (Gc w) for float32 rows, the uncentred sums of :func:`_gram_uncentred_sums`
    in float32 with ``m`` and ``w`` rounded to float32; returns the sum of the rows' squared
    entries where ``squares`` is true. ``squares`` has no default, and callers pass a runtime
    bool: an omitted argument, like a constant True or False, is a type of its own to numba,
    and would compile the loop a second time. Uncentred sums round relative to ``|g_i|^2``
    rather than to the centred entries' squares, a factor of about ``1 + |m|^2 / var``: at
    most about 2 with the mean within the spread, where :func:`_krylov_gram` uses it on the
    rows themselves. It skips the subtraction per entry of :func:`_centred_gram_single`: 4.6
    against 6.6 us with 500 x 100 rows, 5.5 us with the squares; the error against the
    float64 product of the rows before rounding 3.6e-7 and 6.6e-7 against 3.0e-7 and 3.1e-7
    with the rows' mean at zero and at one sd per coordinate, and where it is not used on
    them 1.0e-4 and 3.2e-3 against 3.5e-7 and 2.8e-7 at 10 and 100 sds (the 2-core AMD EPYC
    host, 2026-12-06)."""
    d = w.shape[0]
    w32, m32, total = np.empty(d, g.dtype), np.empty(d, g.dtype), np.empty(d, g.dtype)
    for j in range(d):
        w32[j], m32[j] = w[j], mean[j]
    sum_of_squares = _gram_uncentred_sums(g, m32, w32, total, squares)
    for j in range(d):
        out[j] = total[j]
    return sum_of_squares


@numba.njit(cache=True)
def _centred_rows(g, mean):
    """The rows less their mean (rounded to the rows' type), a new array: the rows whose
    uncentred sums are the centred ones, for a Krylov kernel's products where the rows' mean
    lies outside their spread. A copy of 500 x 100 float32 rows took 4.6-4.8 us, which the
    2 us saved per product repays after about three products (the 2-core AMD EPYC host,
    2026-12-06)."""
    n, d = g.shape
    centred, m = np.empty((n, d), g.dtype), np.empty(d, g.dtype)
    for j in range(d):
        m[j] = mean[j]
    for i in range(n):
        for j in range(d):
            centred[i, j] = g[i, j] - m[j]
    return centred


def _krylov_gram(rows, centre, w, out, first: bool):
    """out = Gc^T (Gc w) for the Krylov kernels, which multiply by the same rows 3-14 times a
    step; returns the rows and the centre for the next product (``rows, centre =
    _krylov_gram(g, mean, w, out, first)`` with ``first`` true for the first product and
    false for the later ones, from ``rows`` and ``centre``: a runtime bool, such as
    ``count == 0``, since a constant is a literal type to numba, which compiles the product
    loop again for each).

    Float32 rows: every product sums uncentred rows (:func:`_uncentred_gram_single`). The
    first also sums the rows' squares ``S``. The centred entries' squares sum to
    ``S - n |m|^2``, and where the mean lies within the spread, ``n |m|^2`` at most that sum
    (the mean's norm at most the rows' root-mean-square distance from it), as for the
    minibatch gradients near the posterior, whose mean is about their spread over sqrt(n),
    the uncentred sums are as accurate as centred ones. Elsewhere the first product is
    computed again from a centred copy of the rows (:func:`_centred_rows`, with a zero
    centre), which the later products read. Float64 rows: :func:`_gram_uncentred_sums`
    (uncentred always). Numba callers only: the overload below is the implementation.

    One float32 product loop is compiled, with the squares as a runtime flag. The kernels
    before 2026-12-06 centred every entry of the first product (:func:`_centred_gram_single`,
    a second loop to compile, 7.5 against 5.8-6.3 us). Three products near the posterior take
    15.0-16.1 instead of 17.1-17.6 us and five 24.2-25.8 instead of 26.6-27.0 us; with the
    mean 3 sds out, three take 24.9-25.1 instead of 22.7 us and five 34.3-34.6 instead of
    37.3-37.9 us. Until 05:00 UTC that day the kernels passed the flag as a constant True or
    False, two literal types to numba, which compiled the loop once for each; passed at run
    time, numba's compilation of the product kernels in mCCAdL's first draw on P1 with empty
    compile caches took 1.6 instead of 2.6 s, and the first draw 20.5 instead of 22.2 s for
    NOGIN and 25.7 instead of 27.0 s for mCCAdL (means of four alternated pairs, the change
    faster in 4 and 3 of them; the 2-core AMD EPYC host, 2026-12-06)."""
    raise NotImplementedError("_krylov_gram runs inside numba kernels only")


@overload(_krylov_gram, jit_options={"cache": True})
def _overload_krylov_gram(rows, centre, w, out, first):
    if rows.dtype != types.float32:

        def double(rows, centre, w, out, first):
            _gram_uncentred_sums(rows, centre, w, out)
            return rows, centre

        return double

    def single(rows, centre, w, out, first):
        # Every call passes the flag as a runtime bool: a constant True or False is a literal
        # type to numba, each compiling the product loop again.
        squares = _uncentred_gram_single(rows, centre, w, out, first)
        if not first:
            return rows, centre
        norm = _zero(rows)
        for j in range(centre.shape[0]):
            mj = np.float32(centre[j])
            norm += mj * mj
        if 2 * rows.shape[0] * norm <= squares:
            return rows, centre
        centred, zero = _centred_rows(rows, centre), np.zeros_like(centre)
        _uncentred_gram_single(centred, zero, w, out, not first)
        return centred, zero

    return single


@register_funcify_default_op_cache_key(CentredGramProduct)
def _numba_centred_gram(op, node, **kwargs):
    dtype = np.dtype(node.outputs[0].dtype)

    @numba.njit
    def centred_gram(g, mean, w):
        if not g.shape[1] == mean.shape[0] == w.shape[0]:
            raise ValueError("CentredGramProduct: shapes do not match")
        out = np.empty(w.shape[0], dtype=dtype)
        _centred_gram(g, mean, w, out)
        return out

    return centred_gram, _CACHE_SALT


#: Salts PyTensor's cache key of the op (its class name) with the kernel's source, so that an
#: edited kernel recompiles instead of loading the cached one.
_CACHE_SALT = int(
    hashlib.sha256(
        "".join(
            [str(gather_dot._CACHE_SALT)]  # the shared helpers' sources (_opaque, _zero)
            + [
                inspect.getsource(f)
                for f in (
                    _overload_centred_gram,
                    _gram_uncentred_sums,
                    _centred_gram_single,
                    _uncentred_gram_single,
                    _centred_rows,
                    _overload_krylov_gram,
                    _numba_centred_gram,
                )
            ]
        ).encode()
    ).hexdigest()[:12],
    16,
)


def with_covariance_kernels(mode) -> Mode | str | None:
    """``mode`` without the rewrites that expand the fused covariance kernels
    (:class:`CentredGramProduct`, :class:`~pymc_sgmcmc.krylov.LowRankExpm`) where the linker
    is numba's, which runs them."""
    resolved = get_mode(mode)
    if isinstance(resolved.linker, NumbaLinker):
        return resolved.excluding(EXPANSIONS)
    return mode
