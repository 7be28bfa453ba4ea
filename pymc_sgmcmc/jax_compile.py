"""The samplers' blocks under PyTensor's JAX backend: reductions in their declared type, the
data kept on the device, and the low-rank Krylov kernels as JAX while loops.

PyTensor sums float32 arrays in a float64 accumulator by default (``CAReduce``'s
``acc_dtype``) and declares a float32 result; PyTensor 3.3's JAX implementation returns the
accumulator instead (``.astype(acc_dtype)``). In a float32 model the force, a sum over the
minibatch's per-observation gradients (and PyMC's gradients of scalar parameters, sums over
rows), then comes out float64: the block's scan carries a float32 state into a float64 one,
which ``jax.lax.scan`` refuses ("carry input and carry output must have equal types").

The rewrite ``reduce_then_cast`` makes the narrowing explicit, ``Sum{acc=float64}(x)`` ->
``Cast{float32}(Sum{dtype=float64}(x))``: the same values (accumulated in float64, rounded
once) in every backend. In a float32 process PyTensor leaves JAX without 64-bit types, so
there the accumulator is float32 (``Sum{acc=float32}(x)``), as JAX would make it anyway. It
is registered under the tag ``sgmcmc_jax_reduce`` and included for the JAX backend only
(:func:`for_jax`), with ``split_once_for_all_rows``.

JAX splits an array only at positions known when it traces (``jnp.split``), and PyTensor's
JAX ``Blockwise`` maps the core op over the batch with ``jnp.vectorize``, which makes every
batched input a tracer. The per-observation gradients of a ``pm.Mixture`` with a list of
components (``pm.ZeroInflatedPoisson`` is one) differentiate the stack of the components'
log-densities, whose gradient is a ``Split``; vectorised over a batch's rows it becomes
``Blockwise{Split}`` with split sizes ``Alloc([[1]], 1, 2)``: one row of sizes, broadcast,
which is not folded to a constant. Under JAX the samplers that build those gradients (mSGLD,
CCAdL, mCCAdL, NOGIN) failed to trace ("Abstract tracer value encountered ... in
jax.numpy.split"). ``split_once_for_all_rows`` splits the whole batch along the core axis
with the sizes folded to a constant.

PyTensor hands a shared variable's value to the jitted function at every call, and a NumPy
array then crosses to the accelerator each time: a block's whole data set, not its
minibatches (P4's 400 MB at every block of 1,000 steps). :class:`DeviceData` gives a JAX block
private copies of the shared arrays it reads, held as device arrays and uploaded again only
when the original's value is replaced.

PyTensor's JAX backend turns a scan into ``jax.lax.scan``, which has a fixed length, so the
Krylov loops of mCCAdL's C step and NOGIN's damping, written as scans, would run all their
iterations (64 Lanczos products where about 3 are needed). For the low-rank estimate, which
the samplers use by default, :class:`~pymc_sgmcmc.krylov.LowRankExpm` and
:class:`~pymc_sgmcmc.krylov.LowRankShiftedSolve` are kept whole under JAX
(:func:`for_jax`) and run as :func:`lanczos_expm` and :func:`shifted_cg`, ``lax.while_loop``
versions of the numba kernels that stop where those stop. On a GPU a library call or a loop
iteration costs more than the arithmetic of these small problems, so a Lanczos run that
stops early takes exp(-t T) e_1 from a Taylor series rather than an eigen-solver call, and
the first conjugate-gradient iterations are straight-line code.
"""

from __future__ import annotations

import numpy as np
import pytensor
from pytensor.compile import optdb
from pytensor.compile.mode import Mode, get_mode
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.graph.traversal import graph_inputs
from pytensor.link.jax.linker import JAXLinker
from pytensor.tensor.basic import Split, cast, constant
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import CAReduce
from pytensor.tensor.type import TensorType

from pymc_sgmcmc.krylov import EXPAND_KRYLOV, LowRankExpm, LowRankShiftedSolve

TAG = "sgmcmc_jax_reduce"


@node_rewriter([CAReduce])
def reduce_then_cast(fgraph, node):
    """``CAReduce(acc_dtype=wide, dtype=narrow)(x)`` -> ``cast(CAReduce(dtype=wide)(x),
    narrow)``: the reduction's declared type is its accumulator's, which JAX returns."""
    op = node.op
    wide, narrow = getattr(op, "acc_dtype", None), node.outputs[0].type.dtype
    if wide is None or wide == narrow:
        return None
    if wide == "float64" and not jax_has_float64():
        # JAX would truncate the float64 accumulator to float32 anyway, warning ("Explicitly
        # requested dtype float64 ... is not available") at every block's first trace.
        return [op.clone(acc_dtype=narrow)(*node.inputs)]
    return [cast(op.clone(dtype=wide)(*node.inputs), narrow)]


def jax_has_float64() -> bool:
    """Whether JAX has its 64-bit types (``jax_enable_x64``), which PyTensor's JAX backend
    turns on when it is imported in a process whose ``floatX`` is float64, and off
    otherwise (a float32 model in a float64 process keeps them)."""
    import jax

    return bool(jax.config.jax_enable_x64)


@node_rewriter([Blockwise])
def split_once_for_all_rows(fgraph, node):
    """``Blockwise{Split}(x, sizes)`` with the same constant sizes for every batch entry
    (their batch dimensions broadcastable) -> ``Split`` of the whole ``x`` along the core
    axis, the sizes a constant that JAX's ``jnp.split`` can read when it traces."""
    op = node.op
    if not isinstance(op.core_op, Split):
        return None
    x, sizes = node.inputs
    core_x_ndim = len(op.inputs_sig[0])
    batch_ndim = x.ndim - core_x_ndim
    if not all(sizes.type.broadcastable[:-1]):
        return None
    if not all(isinstance(v, Constant) for v in graph_inputs([sizes])):
        return None
    from pymc_sgmcmc.python_mode import ONE_OFF_MODE

    core_sizes = sizes[(0,) * (sizes.ndim - 1)] if sizes.ndim > 1 else sizes
    values = pytensor.function([], core_sizes, mode=ONE_OFF_MODE)()
    core = op.core_op
    axis = (core.axis % core_x_ndim) + batch_ndim
    outputs = Split(core.len_splits, axis=axis)(x, constant(np.asarray(values)), return_list=True)
    if any(o.type.ndim != n.type.ndim for o, n in zip(outputs, node.outputs, strict=True)):
        return None
    return outputs


# Late, after the rewrites that create or fuse reductions (the in-place ones run at 49.5+).
optdb.register("reduce_then_cast", in2out(reduce_then_cast), TAG, position=49.4)
optdb.register("split_once_for_all_rows", in2out(split_once_for_all_rows), TAG, position=49.4)


def for_jax(mode) -> Mode | str | None:
    """Where the linker is JAX's, ``mode`` with the rewrites ``reduce_then_cast`` and
    ``split_once_for_all_rows`` included and
    the Krylov kernels kept (not expanded into scans; their JAX implementations registered,
    :func:`register_krylov_kernels`); otherwise ``mode`` unchanged."""
    resolved = get_mode(mode)
    if not isinstance(resolved.linker, JAXLinker):
        return mode
    register_krylov_kernels()
    return resolved.including(TAG).excluding(EXPAND_KRYLOV)


class DeviceData:
    """The shared arrays (data, ``pm.Data``) of JAX-compiled graphs, kept on the device.

    Compile the graphs with ``givens`` (each shared array replaced by a private shared
    copy) and call ``refresh()`` before each call: it puts a copy's value on the device
    (``jax.device_put``) when the original's value is a new array (first use,
    ``set_value``, ``pm.set_data``), so the functions read device arrays and nothing crosses
    to the accelerator but a block's own inputs. An array changed in place, under the same
    identity, is not seen; replace it instead, as ``pm.set_data`` does.
    """

    def __init__(self, outputs: list[Variable]):
        self.originals: list[SharedVariable] = []
        self.copies: list[SharedVariable] = []
        for var in graph_inputs(outputs):
            if not (isinstance(var, SharedVariable) and isinstance(var.type, TensorType)):
                continue  # the minibatch generators are the JAX linker's own concern
            value = var.get_value(borrow=True)
            self.originals.append(var)
            self.copies.append(
                pytensor.shared(value, name=var.name, shape=var.type.shape, borrow=True)
            )
        self._uploaded: list[np.ndarray | None] = [None] * len(self.copies)

    @property
    def givens(self) -> list[tuple[SharedVariable, SharedVariable]]:
        return list(zip(self.originals, self.copies, strict=True))

    def refresh(self) -> None:
        import jax

        for i, (original, copy) in enumerate(self.givens):
            value = original.get_value(borrow=True)
            if value is not self._uploaded[i]:
                # The container's storage is what the JAX linker passes to the jitted
                # function; a device array there is passed as it is.
                copy.container.storage[0] = jax.device_put(value)
                self._uploaded[i] = value


# ---------------------------------------------------------------------- Krylov kernels
# (See the module docstring.) Each kernel launch on a GPU costs microseconds whatever its size,
# and a library call more: mCCAdL's step on the D = 100 regression took 2.2 ms on an H100 with
# the scan of 64 Lanczos iterations, and 0.51 ms with the while loop on an H200, of which about
# 0.3 ms was the 8 x 8 eigen-decomposition (cuSOLVER); 0.22 ms with the Taylor series below
# (``benchmarks/gpu_results.md`` run 3, ``benchmarks/jax_krylov_results.md``); at D = 1,000,
# 0.79 ms with one substep of the series and 0.54 ms with four (run 4).
#: Lanczos runs that stop within this many products take exp(-t T) e_1 from a Taylor series
#: of this leading block of the tridiagonal T (zero beyond the count).
SMALL_TRIDIAGONAL = 8
#: ... when the shifted block X = -t (T - mu I) has infinity norm at most TAYLOR_RADIUS, where
#: the series to TAYLOR_DEGREE is exact to 0.5^16 / 16! e^0.5 = 1.2e-18 relative;
TAYLOR_RADIUS, TAYLOR_DEGREE = 0.5, 15
#: ... or, for a wider block, in s substeps, exp(X) e_1 = exp(X / s)^s e_1, with the first s
#: of these that brings X / s within the radius: D = 1,000 regression (``benchmarks/gpu.py``'s
#: P1x10) has norms of 0.75-2.5 (median 1.0, 2 % above 2), where a step spent about 0.29 ms
#: of its 0.78 ms on the eigen-decomposition. Other runs (and the a-posteriori check at the
#: cap) take the eigen-decomposition of T, as the numba kernel.
TAYLOR_SUBSTEPS = (1, 4)
#: Conjugate-gradient iterations run as straight-line code (each frozen once the residual is
#: small enough) before a while loop takes over: a GPU's while loop costs a device-to-host
#: copy of its condition per iteration. Under JAX on a CPU (numba is the CPU backend) the
#: iterations after the stop cost their products: the kernel took 51 against 28 µs on P1.
CG_UNROLLED = 8
_registered = False


def register_krylov_kernels() -> None:
    """Register the kernels' JAX implementations with PyTensor's JAX backend (once; imports
    JAX, so only when a block is compiled for it)."""
    global _registered
    if _registered:
        return
    from pytensor.link.jax.dispatch import jax_funcify

    @jax_funcify.register(LowRankExpm)
    def _jax_lanczos_expm(op, **kwargs):
        u, max_products = op._constants()

        def lanczos_expm_kernel(g, mean, columns, gain, shift, t, v):
            return lanczos_expm(g, mean, columns, gain, shift, t, v, u, max_products)

        return lanczos_expm_kernel

    @jax_funcify.register(LowRankShiftedSolve)
    def _jax_shifted_cg(op, **kwargs):
        tolerance, iterations = op.tolerance, op.iterations

        def shifted_cg_kernel(g, mean, columns, gain, diagonal, v):
            return shifted_cg(g, mean, columns, gain, diagonal, v, tolerance, iterations)

        return shifted_cg_kernel

    _registered = True


def _low_rank_operator(g, mean, columns, gain, shift):
    """x -> gain M^T (Gc^T Gc (M x)) + d x, as ``krylov._apply_low_rank``, with the column
    map M = diag(s) (``columns`` a vector) or a dense preconditioner's R S (a matrix)
    (``Gc^T Gc w`` as ``G^T (G w - m . w)``; rows in float32 are promoted, the sums in the
    vectors' type)."""
    dense = columns.ndim == 2

    def apply(x):
        mapped = columns @ x if dense else columns * x
        centred = g @ mapped - mean @ mapped
        gram = centred @ g
        return (gain * (columns.T @ gram) if dense else gain * columns * gram) + shift * x

    return apply


def lanczos_expm(g, mean, columns, gain, shift, t, v, u, max_products):
    """``krylov._lanczos_expm`` in JAX: the same iterations, stopping rule, tridiagonal
    matrix T, result and a-posteriori check at the cap; the basis and T are padded to
    ``max_products`` with zeros, which leave the result unchanged. exp(-t T) e_1 comes from
    T's eigen-decomposition, as in numba, except for a run that stopped within
    ``SMALL_TRIDIAGONAL`` products with a shifted T of norm up to ``TAYLOR_RADIUS`` times the
    largest of ``TAYLOR_SUBSTEPS`` (the usual case), which takes it from a Taylor series in
    substeps (``_expm_e1_taylor``, equal to rounding)."""
    import jax.numpy as jnp
    from jax import lax

    dtype = v.dtype
    tiny, eps = jnp.finfo(dtype).tiny, jnp.finfo(dtype).eps
    apply = _low_rank_operator(g, mean, columns, gain, shift)
    norm_v = jnp.sqrt(jnp.sum(v * v))
    zeros = jnp.zeros(max_products, dtype=dtype)
    start = {
        "count": jnp.asarray(0),
        "stop": jnp.asarray(False),
        "q": v / jnp.maximum(norm_v, tiny),
        "q_prev": jnp.zeros_like(v),
        "beta_prev": jnp.zeros((), dtype),
        "log_bound": jnp.zeros((), dtype),
        "gamma": jnp.asarray(-jnp.inf, dtype),
        "alphas": zeros,
        "couplings": zeros,
        "basis": jnp.zeros((max_products, v.shape[0]), dtype),
    }

    def running(s):
        return (s["count"] < max_products) & ~s["stop"]

    def lanczos_step(s):
        q, w = s["q"], apply(s["q"])
        alpha = jnp.sum(q * w)
        w = w - alpha * q - s["beta_prev"] * s["q_prev"]
        beta = jnp.sqrt(jnp.sum(w * w))
        count = s["count"] + 1
        log_bound = (
            s["log_bound"] + jnp.log(jnp.maximum(t * beta, tiny)) - jnp.log(count.astype(dtype))
        )
        gamma = jnp.maximum(s["gamma"], s["beta_prev"] + beta - alpha)
        stop = log_bound + t * jnp.maximum(gamma, 0.0) <= jnp.log(u)
        k = count - 1
        return {
            "count": count,
            "stop": stop,
            "q": w / jnp.maximum(beta, tiny),
            "q_prev": q,
            "beta_prev": beta,
            "log_bound": log_bound,
            "gamma": gamma,
            "alphas": s["alphas"].at[k].set(alpha),
            "couplings": s["couplings"].at[k].set(jnp.where(stop, 0.0, beta)),
            "basis": s["basis"].at[k].set(q),
        }

    s = lax.while_loop(running, lanczos_step, start)
    small = min(SMALL_TRIDIAGONAL, max_products)
    series, norm = _shifted_tridiagonal(s["alphas"][:small], s["couplings"][:small], s["count"], t)

    def by_taylor_series(substeps):
        def finish(s):
            return norm_v * (_expm_e1_taylor(*series, substeps) @ s["basis"][:small])

        return finish

    def by_eigen_decomposition(size):
        def finish(s):
            off = s["couplings"][: size - 1]
            tridiagonal = jnp.diag(s["alphas"][:size]) + jnp.diag(off, 1) + jnp.diag(off, -1)
            eigenvalues, vectors = jnp.linalg.eigh(tridiagonal)
            first = vectors[0]
            coefficients = vectors @ (jnp.exp(-t * eigenvalues) * first)
            result = norm_v * (coefficients @ s["basis"][:size])
            tiny_exponent = t * jnp.abs(eigenvalues) < 1e-8
            phi = jnp.where(
                tiny_exponent,
                t,
                -jnp.expm1(-t * eigenvalues) / jnp.where(tiny_exponent, 1.0, eigenvalues),
            )
            estimate = s["beta_prev"] * jnp.abs(vectors[s["count"] - 1] @ (phi * first))
            accepted = s["stop"] | (estimate <= max(u, 100 * float(eps)))  # NaN fails
            return jnp.where(accepted, result, jnp.nan)

        return finish

    # One branch runs: the Taylor series in the fewest substeps that fit, or the
    # decomposition of the small block (up to `small` products: zero beyond the count) or of
    # the whole padded T.
    finishes = [by_taylor_series(substeps) for substeps in TAYLOR_SUBSTEPS]
    short = s["count"] <= small
    branch = jnp.where(short, len(finishes), len(finishes) + 1)
    for i in reversed(range(len(finishes))):
        fits = s["stop"] & short & (norm <= TAYLOR_RADIUS * TAYLOR_SUBSTEPS[i])
        branch = jnp.where(fits, i, branch)
    finishes += [by_eigen_decomposition(small)]
    finishes += [by_eigen_decomposition(max_products)] if max_products > small else []
    result = lax.switch(jnp.minimum(branch, len(finishes) - 1), finishes, s)
    return result.astype(dtype), s["count"].astype("int64")


def _shifted_tridiagonal(alphas, couplings, count, t):
    """The leading count x count block of -t T as ``-t (T - mu I)`` (mu the mean of its
    diagonal, so exp(-t T) = e^(-t mu) exp(-t (T - mu I))): its diagonal, the couplings below
    and above the diagonal by row (zero outside the block) and e^(-t mu), the arguments of
    :func:`_expm_e1_taylor`; and its infinity norm."""
    import jax.numpy as jnp

    dtype = alphas.dtype
    inside = jnp.arange(alphas.shape[0]) < count
    diagonal = jnp.where(inside, alphas, 0.0)
    mu = jnp.sum(diagonal) / count.astype(dtype)
    diagonal = jnp.where(inside, -t * (diagonal - mu), 0.0)
    couplings = -t * couplings[:-1]  # zero at and beyond the stop
    zero = jnp.zeros(1, dtype)
    below, above = jnp.concatenate([zero, couplings]), jnp.concatenate([couplings, zero])
    norm = jnp.max(jnp.abs(diagonal) + jnp.abs(below) + jnp.abs(above))
    return (diagonal, below, above, jnp.exp(-t * mu)), norm


def _expm_e1_taylor(diagonal, below, above, scale, substeps: int = 1):
    """scale exp(X) e_1 for the tridiagonal X of :func:`_shifted_tridiagonal`, as
    exp(X / s)^s e_1 with s = ``substeps`` and the Taylor series of exp(X / s) to
    ``TAYLOR_DEGREE`` (the caller checks that X's norm is at most s ``TAYLOR_RADIUS``):
    the series as a matrix, its terms' products with X as shifted rows, and s products of it
    with a vector; no library call. (A series of vectors in s rounds would be one chain of s
    times the terms, which XLA compiled to a kernel 30 times slower than one round.)"""
    import jax.numpy as jnp

    size = diagonal.shape[0]
    zero = jnp.zeros((1, size), diagonal.dtype)
    diagonal, below, above = (part[:, None] / substeps for part in (diagonal, below, above))
    term = total = jnp.eye(size, dtype=diagonal.dtype)
    for j in range(1, TAYLOR_DEGREE + 1):
        previous = jnp.concatenate([zero, term[:-1]])
        following = jnp.concatenate([term[1:], zero])
        term = (diagonal * term + below * previous + above * following) / j
        total = total + term
    vector = total[:, 0]
    for _ in range(substeps - 1):
        vector = jnp.sum(total * vector, axis=1)
    return scale * vector


def shifted_cg(g, mean, columns, gain, diagonal, v, tolerance, iterations):
    """``krylov._shifted_cg`` in JAX: conjugate gradients from x0 = 0, stopped at the same
    residual or after ``iterations`` products; the first ``CG_UNROLLED`` iterations are
    straight-line code (an iteration after the stop is computed and discarded)."""
    import jax.numpy as jnp
    from jax import lax

    apply = _low_rank_operator(g, mean, columns, gain, diagonal)
    rr = jnp.sum(v * v)
    stop = tolerance**2 * rr

    def running(s):
        return (s[0] < iterations) & ~s[5]

    def cg_step(s):
        count, x, r, d, rr, _ = s
        ad = apply(d)
        step = jnp.where(rr > 0, rr / jnp.sum(d * ad), 0.0)
        x, r = x + step * d, r - step * ad
        rr_new = jnp.sum(r * r)
        d = r + jnp.where(rr > 0, rr_new / rr, 0.0) * d
        return count + 1, x, r, d, rr_new, rr_new <= stop

    s = (jnp.asarray(0), jnp.zeros_like(v), v, v, rr, jnp.asarray(False))
    for _ in range(min(CG_UNROLLED, iterations)):
        moving, s_next = running(s), cg_step(s)
        s = tuple(jnp.where(moving, new, old) for new, old in zip(s_next, s, strict=True))
    s = lax.cond(running(s), lambda s: lax.while_loop(running, cg_step, s), lambda s: s, s)
    return s[1].astype(v.dtype)
