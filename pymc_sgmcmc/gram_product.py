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

    def infer_shape(self, fgraph, node, shapes):
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


@numba.njit(cache=True, fastmath=True)
def _centred_gram(g, mean, w, out):
    """out = sum_i (g_i . w - m . w) g_i, four rows at a time: the loops of
    :func:`~pymc_sgmcmc.gather_dot._gather_matvec` and ``_gather_rmatvec`` in one, on rows in
    place (written out again, not shared: see ``gather_dot._GLM_KERNEL``), read as ``g[i, j]``
    rather than through row views (see ``gather_dot._row``)."""
    n, d = g.shape[0], _opaque(g.shape[1])  # the length opaque: see gather_dot._opaque
    c = _zero(out)
    for j in range(d):
        c += mean[j] * w[j]
    for j in range(d):
        out[j] = 0
    i = 0
    while i + 4 <= n:
        s0 = s1 = s2 = s3 = _zero(out)
        for j in range(d):
            wj = w[j]
            s0 += g[i, j] * wj
            s1 += g[i + 1, j] * wj
            s2 += g[i + 2, j] * wj
            s3 += g[i + 3, j] * wj
        s0, s1, s2, s3 = s0 - c, s1 - c, s2 - c, s3 - c
        for j in range(d):
            out[j] += g[i, j] * s0 + g[i + 1, j] * s1 + g[i + 2, j] * s2 + g[i + 3, j] * s3
        i += 4
    while i < n:
        s = _zero(out)
        for j in range(d):
            s += g[i, j] * w[j]
        s -= c
        for j in range(d):
            out[j] += g[i, j] * s
        i += 1


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
            + [inspect.getsource(f) for f in (_centred_gram, _numba_centred_gram)]
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
