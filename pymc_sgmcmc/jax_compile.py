"""The samplers' blocks under PyTensor's JAX backend: reductions in their declared type.

PyTensor sums float32 arrays in a float64 accumulator by default (``CAReduce``'s
``acc_dtype``) and declares a float32 result; PyTensor 3.3's JAX implementation returns the
accumulator instead (``.astype(acc_dtype)``). In a float32 model the force, a sum over the
minibatch's per-observation gradients (and PyMC's gradients of scalar parameters, sums over
rows), then comes out float64: the block's scan carries a float32 state into a float64 one,
which ``jax.lax.scan`` refuses ("carry input and carry output must have equal types").

The rewrite ``reduce_then_cast`` makes the narrowing explicit, ``Sum{acc=float64}(x)`` ->
``Cast{float32}(Sum{dtype=float64}(x))``: the same values (accumulated in float64, rounded
once) in every backend. It is registered under the tag ``sgmcmc_jax_reduce`` and included
for the JAX backend only (:func:`with_jax_reductions`).
"""

from __future__ import annotations

from pytensor.compile import optdb
from pytensor.compile.mode import Mode
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.link.jax.linker import JAXLinker
from pytensor.tensor.basic import cast
from pytensor.tensor.elemwise import CAReduce

from pymc_sgmcmc.gather_dot import including_for_linker

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


def with_jax_reductions(mode) -> Mode | str | None:
    """``mode`` with the rewrite ``reduce_then_cast`` included where the linker is JAX's."""
    return including_for_linker(mode, JAXLinker, TAG)
