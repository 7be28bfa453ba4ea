"""Shorter numba compilations of the samplers' blocks.

numba compiles a block when it first runs it. Every array assignment ``a[i] = b`` in the
compiled code -- PyTensor's ``scan`` stores each step's outputs that way -- carries the
formatting of a detailed shape-mismatch message (f-strings, ``str`` of integer tuples), and
compiling that formatting cost 3-4 s of a cold start (P1 SGLD, step construction to the first
draw with an empty compile directory: 20.4 / 19.7 s -> 15.7 / 17.1 s, alternated).
:func:`plain_assignment_errors` swaps in the plain message of numba's generic target while a
block is compiled. The blocks' shapes are static and checked when their graph is built, so
such an error would be an internal bug, not the user's: it needs no shapes in the message.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numba.np.arrayobj as arrayobj
from numba.extending import overload

__all__ = ["plain_assignment_errors"]


def _raise_shape_mismatch(src_shapes, index_shape):
    """Stands in for ``numba.np.arrayobj.raise_with_shape_context`` (a stub as that one)."""
    raise NotImplementedError


@overload(_raise_shape_mismatch)
def _plain_shape_mismatch(src_shapes, index_shape):
    def impl(src_shapes, index_shape):
        raise ValueError("cannot assign slice from input of different size")

    return impl


@contextmanager
def plain_assignment_errors() -> Iterator[None]:
    """numba functions compiled in this context raise a plain message for a shape mismatch
    in an array assignment (numba looks the raising function up when it compiles one)."""
    detailed = arrayobj.raise_with_shape_context
    arrayobj.raise_with_shape_context = _raise_shape_mismatch
    try:
        yield
    finally:
        arrayobj.raise_with_shape_context = detailed
