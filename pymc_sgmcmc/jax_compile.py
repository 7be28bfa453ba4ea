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
once) in every backend. It is registered under the tag ``sgmcmc_jax_reduce`` and included
for the JAX backend only (:func:`for_jax`).

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
versions of the numba kernels that stop where those stop.
"""

from __future__ import annotations

import numpy as np
import pytensor
from pytensor.compile import optdb
from pytensor.compile.mode import Mode, get_mode
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.graph.traversal import graph_inputs
from pytensor.link.jax.linker import JAXLinker
from pytensor.tensor.basic import cast
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
    return [cast(op.clone(dtype=wide)(*node.inputs), narrow)]


# Late, after the rewrites that create or fuse reductions (the in-place ones run at 49.5+).
optdb.register("reduce_then_cast", in2out(reduce_then_cast), TAG, position=49.4)


def for_jax(mode) -> Mode | str | None:
    """Where the linker is JAX's, ``mode`` with the rewrite ``reduce_then_cast`` included and
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
# (See the module docstring.) On an H100, mCCAdL's step on the D = 100 regression (about 3
# products) took 2.2 ms with the scan of 64 iterations and 0.58 ms with the while loop
# (``benchmarks/gpu_results.md``).
#: Lanczos runs of at most this many products decompose this leading block of the tridiagonal
#: matrix (zero beyond the count), not the whole ``max_products`` square.
SMALL_TRIDIAGONAL = 8
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
    """x -> gain s (Gc^T Gc (s x)) + d x, as ``krylov._apply_low_rank`` (``Gc^T Gc w`` as
    ``G^T (G w - m . w)``; rows in float32 are promoted, the sums in the vectors' type)."""

    def apply(x):
        scaled = columns * x
        centred = g @ scaled - mean @ scaled
        return gain * columns * (centred @ g) + shift * x

    return apply


def lanczos_expm(g, mean, columns, gain, shift, t, v, u, max_products):
    """``krylov._lanczos_expm`` in JAX: the same iterations, stopping rule, tridiagonal
    matrix, result and a-posteriori check at the cap; the basis and T are padded to
    ``max_products`` with zeros, which leave the result unchanged."""
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

    def finish(size):
        # exp(-t T) e_1 from the leading size x size block of T (zero beyond the count).
        off = s["couplings"][: size - 1]
        tridiagonal = jnp.diag(s["alphas"][:size]) + jnp.diag(off, 1) + jnp.diag(off, -1)
        eigenvalues, vectors = jnp.linalg.eigh(tridiagonal)
        first = vectors[0]
        coefficients = vectors @ (jnp.exp(-t * eigenvalues) * first)
        result = norm_v * (coefficients @ s["basis"][:size])
        small = t * jnp.abs(eigenvalues) < 1e-8
        phi = jnp.where(small, t, -jnp.expm1(-t * eigenvalues) / jnp.where(small, 1.0, eigenvalues))
        estimate = s["beta_prev"] * jnp.abs(vectors[s["count"] - 1] @ (phi * first))
        return result, estimate

    if max_products > SMALL_TRIDIAGONAL:
        result, estimate = lax.cond(
            s["count"] <= SMALL_TRIDIAGONAL,
            lambda: finish(SMALL_TRIDIAGONAL),
            lambda: finish(max_products),
        )
    else:
        result, estimate = finish(max_products)
    accepted = s["stop"] | (estimate <= max(u, 100 * float(eps)))  # NaN fails
    return jnp.where(accepted, result, jnp.nan).astype(dtype), s["count"].astype("int64")


def shifted_cg(g, mean, columns, gain, diagonal, v, tolerance, iterations):
    """``krylov._shifted_cg`` in JAX: conjugate gradients from x0 = 0, stopped at the same
    residual or after ``iterations`` products."""
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

    start = (jnp.asarray(0), jnp.zeros_like(v), v, v, rr, jnp.asarray(False))
    return lax.while_loop(running, cg_step, start)[1].astype(v.dtype)
