"""One OpenBLAS thread while a sampler computes.

A step's linear algebra is small (a batch of n rows), and ``pm.sample`` runs its chains in
parallel processes. OpenBLAS, as NumPy and SciPy ship it, starts one thread per core in
every process and hands some of these small operations to its threads (a 4 x 4 triangular
solve with 500 right-hand sides; not a GLM's matrix-vector products); PyMC limits them
(``blas_cores``) only where the workers are not forked, so on Linux two chains on two cores
run four BLAS threads. On ``pm.MvNormal`` rows with an ``LKJCholeskyCov`` prior (those
solves, n = 500) the minibatch force then took 16 ms a call on a busy 2-core machine
against 27 us with one thread, and on an idle one two chains of 20,000 steps with
``cores=2`` took 17.1 s, and take 7.1 s with this limit (``docs/performance.md``, "BLAS
threads").

:func:`one_blas_thread` limits the OpenBLAS libraries that use its own pthreads layer
(PyPI's NumPy and SciPy) to one thread and restores their setting on exit: 12 us for the
two libraries, once per block of steps. Other BLAS libraries (MKL, an OpenBLAS built on
OpenMP) are left alone: changing an OpenMP runtime's threads inside a forked worker is
what crashed PyMC's workers in pymc-devs/pymc#7354.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from threadpoolctl import ThreadpoolController

__all__ = ["one_blas_thread"]


@functools.cache
def _openblas_pthreads() -> ThreadpoolController:
    """The process's OpenBLAS libraries on pthreads, found once (a forked worker inherits
    them with the rest of the parent's memory)."""
    return ThreadpoolController().select(internal_api="openblas", threading_layer="pthreads")


def one_blas_thread[F: Callable[..., Any]](method: F) -> F:
    """Run ``method`` with OpenBLAS limited to one thread (see the module docstring)."""

    @functools.wraps(method)
    def limited(*args, **kwargs):
        with _openblas_pthreads().limit(limits=1):
            return method(*args, **kwargs)

    return limited  # type: ignore[return-value]
