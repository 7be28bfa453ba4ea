"""The samplers' blocks under PyTensor's JAX backend: reductions in their declared type, and
the data kept on the device.

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

PyTensor hands a shared variable's value to the jitted function at every call, and a NumPy
array then crosses to the accelerator each time: a block's whole data set, not its
minibatches (P4's 400 MB at every block of 1,000 steps). :class:`DeviceData` gives a JAX block
private copies of the shared arrays it reads, held as device arrays and uploaded again only
when the original's value is replaced.
"""

from __future__ import annotations

import numpy as np
import pytensor
from pytensor.compile import optdb
from pytensor.compile.mode import Mode
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.graph.traversal import graph_inputs
from pytensor.link.jax.linker import JAXLinker
from pytensor.tensor.basic import cast
from pytensor.tensor.elemwise import CAReduce
from pytensor.tensor.type import TensorType

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


class DeviceData:
    """The shared arrays (data, ``pm.Data``) of JAX-compiled graphs, kept on the device.

    Compile the graphs with :attr:`givens` (each shared array replaced by a private shared
    copy) and call :meth:`refresh` before each call: it puts a copy's value on the device
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
            copy = pytensor.shared(value, name=var.name, shape=var.type.shape, borrow=True)
            if copy.type == var.type:
                self.originals.append(var)
                self.copies.append(copy)
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
