"""A lazy branch that keeps its inputs returns them, not copies (numba).

PyTensor compiles ``ifelse(c, computed, kept)`` for numba as a ``LazyIfElse`` whose two
branches are ``OpFromGraph``s that own their output buffers: a branch that passes an input
through returns a copy of it (a ``DeepCopyOp``). A periodic average of Sigma
(``pymc_sgmcmc.base.SGMCMC.periodically_averaged_noise``) is such a branch: every step
that does not update the average keeps the D x D average and the D x D damping matrix made
from it, and copied both: 160 kB per step at D = 100, 3-4 µs of mCCAdL's 34 µs step and
5-6 µs of NOGIN's 33 µs step, updated every 300 steps, on the Intel Xeon host (two
alternated runs; ``docs/performance.md``, "Covariance-controlled samplers").

The rewrite ``keep_inputs_in_place`` gives such a node a :class:`KeepingLazyIfElse`, whose
branches return a passed-through input itself, and which declares each such output a view of
that input (``view_map``): PyTensor's in-place rewrites, which run after it, then leave the
input alone wherever it is still read, as for any view. A state a scan's step keeps this way
is the same array from one step to the next (PyTensor's numba scan rebinds an untraced state
to the step's output). The rewrite is registered under ``TAG`` and included only where the
linker is numba's (:func:`with_kept_branches`).
"""

from __future__ import annotations

from pytensor.compile import optdb
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.mode import Mode
from pytensor.compile.ops import DeepCopyOp
from pytensor.conditional.op import LazyIfElse
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.link.numba.linker import NumbaLinker

from pymc_sgmcmc.gather_dot import including_for_linker

__all__ = ["TAG", "KeepingLazyIfElse", "keep_inputs_in_place", "with_kept_branches"]

TAG = "sgmcmc_kept_branches"


def copied_inputs(branch: OpFromGraph) -> dict[int, int]:
    """{output position: input position} of the outputs of ``branch`` that are copies of
    one of its inputs."""
    fgraph = branch.fgraph
    positions = {}
    for k, out in enumerate(fgraph.outputs):
        node = out.owner
        if node is not None and isinstance(node.op, DeepCopyOp) and node.inputs[0] in fgraph.inputs:
            positions[k] = fgraph.inputs.index(node.inputs[0])
    return positions


def returned_inputs(branch: OpFromGraph) -> dict[int, int]:
    """{output position: input position} of the outputs of ``branch`` that are inputs."""
    fgraph = branch.fgraph
    return {
        k: fgraph.inputs.index(out) for k, out in enumerate(fgraph.outputs) if out in fgraph.inputs
    }


def without_copies(branch: OpFromGraph, outputs: set[int]) -> OpFromGraph:
    """``branch`` with the given outputs (copies of an input) returning that input itself."""
    if not outputs:
        return branch
    fgraph = branch.fgraph.unfreeze()
    new_outputs = [
        out.owner.inputs[0] if k in outputs else out for k, out in enumerate(fgraph.outputs)
    ]
    return branch.clone_with_inner_graph(FunctionGraph(fgraph.inputs, new_outputs, clone=False))


class KeepingLazyIfElse(LazyIfElse):
    """A ``LazyIfElse`` whose branches return the inputs they pass through instead of copies,
    each such output declared a view of its input (``view_map``, in the node's input
    positions: the condition first)."""

    def __init__(self, true_branch, false_branch, output_types):
        super().__init__(true_branch, false_branch, output_types)
        kept = {**returned_inputs(true_branch), **returned_inputs(false_branch)}
        self.view_map = {k: [i + 1] for k, i in kept.items()}

    def __str__(self):
        return "KeepingLazyIfElse"


@node_rewriter([LazyIfElse])
def keep_inputs_in_place(fgraph, node):
    """A ``LazyIfElse`` that passes inputs through -> a :class:`KeepingLazyIfElse`.

    An output is kept in place if a branch passes an input through and the other branch
    computes it or passes the same input through (an output can be declared a view of one
    input only)."""
    op = node.op
    if isinstance(op, KeepingLazyIfElse):
        return None
    true_kept, false_kept = copied_inputs(op.true_branch), copied_inputs(op.false_branch)
    # Output k kept from input i by one branch, and by the other too or computed there.
    kept = {
        k
        for k, i in {**true_kept, **false_kept}.items()
        if true_kept.get(k, i) == false_kept.get(k, i)
    }
    if not kept:
        return None
    new_op = KeepingLazyIfElse(
        without_copies(op.true_branch, kept & true_kept.keys()),
        without_copies(op.false_branch, kept & false_kept.keys()),
        op.output_types,
    )
    return new_op(*node.inputs, return_list=True)


# After the lazy branches are made (48.9) and the elementwise fusion (49), before the
# in-place rewrites (49.5), which must see the views.
optdb.register("keep_inputs_in_place", in2out(keep_inputs_in_place), TAG, position=49.3)


def with_kept_branches(mode) -> Mode | str | None:
    """``mode`` with the rewrite ``keep_inputs_in_place`` included if its linker is numba's."""
    return including_for_linker(mode, NumbaLinker, TAG)
