"""A lazy branch that passes an input through returns the input itself under numba, declared a
view of it, so that the in-place rewrites after it cannot overwrite a value still read
(``pymc_sgmcmc.kept_branches``)."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.mode import get_mode
from pytensor.compile.ops import DeepCopyOp
from pytensor.conditional.op import LazyIfElse, ifelse
from pytensor.scan.op import Scan

from pymc_sgmcmc.kept_branches import KeepingLazyIfElse, with_kept_branches


def numba_function(inputs, outputs):
    return pytensor.function(inputs, outputs, mode=with_kept_branches(get_mode("NUMBA")))


def lazy_branches(fgraph) -> list:
    """The lazy branch nodes of ``fgraph`` and of the inner graphs of its scans."""
    nodes = []
    for node in fgraph.apply_nodes:
        if isinstance(node.op, LazyIfElse):
            nodes.append(node)
        if isinstance(node.op, Scan):
            nodes.extend(lazy_branches(node.op.fgraph))
    return nodes


def copies(branch) -> int:
    return sum(isinstance(n.op, DeepCopyOp) for n in branch.fgraph.apply_nodes)


def test_a_passed_through_input_is_returned_as_a_declared_view():
    # Output 0 is x kept by the false branch, output 1 is computed by both: only output 0
    # becomes a view, of the node's input x, and neither branch copies.
    c, x, y = pt.scalar("c", dtype="bool"), pt.vector("x"), pt.vector("y")
    kept, computed = ifelse(c, [pt.exp(x), pt.log(y)], [x, pt.sqrt(y)])
    fn = numba_function([c, x, y], [kept * 2.0, computed])
    (node,) = lazy_branches(fn.maker.fgraph)
    assert isinstance(node.op, KeepingLazyIfElse)
    ((output, (position,)),) = node.op.view_map.items()
    assert output == 0 and node.inputs[position] is x
    assert copies(node.op.true_branch) == copies(node.op.false_branch) == 0
    values = np.array([0.5, 2.0]), np.array([4.0, 9.0])
    np.testing.assert_allclose(fn(False, *values), [2 * values[0], np.sqrt(values[1])])
    np.testing.assert_allclose(fn(True, *values), [2 * np.exp(values[0]), np.log(values[1])])


def test_a_kept_scan_state_is_not_overwritten_by_an_in_place_op_while_still_read():
    # A scan's state s goes through a lazy branch that keeps it on odd steps; its next value
    # (kept + 1, which PyTensor computes in place where it may) must not overwrite s before
    # the step's other output (s * 3) reads it. Against the same loop in NumPy, whose values
    # differ if the in-place add runs first on the shared buffer (seen to fail with the view
    # undeclared, KeepingLazyIfElse.view_map emptied).
    s0, flags = pt.vector("s0"), pt.vector("flags", dtype="bool")

    def step(flag, s):
        kept = ifelse(flag, s * 0.5, s)
        return kept + 1.0, s * 3.0

    (states, reads) = pytensor.scan(
        step, sequences=[flags], outputs_info=[s0, None], return_updates=False
    )
    fn = numba_function([s0, flags], [states[-1], reads])
    (node,) = lazy_branches(fn.maker.fgraph)
    assert isinstance(node.op, KeepingLazyIfElse) and copies(node.op.false_branch) == 0

    start, steps = np.array([1.0, -2.0, 3.0]), np.arange(9) % 2 == 0
    s, expected = start.copy(), []
    for flag in steps:
        expected.append(s * 3.0)
        s = (s * 0.5 if flag else s) + 1.0
    final, traced = fn(start.copy(), steps)
    np.testing.assert_allclose(traced, expected)
    np.testing.assert_allclose(final, s)
