"""Graphs compiled to check what they compute: PyTensor's Python backend, no machine code."""

from __future__ import annotations

import pytensor


def python_function(inputs, outputs, mode="FAST_COMPILE", **kwargs):
    """``pytensor.function`` in ``mode`` with C compilation switched off (``cxx=""``).

    ``FAST_COMPILE`` runs each node's Python ``perform``, but a loop (``Scan``) still links
    its inner graph with C thunks, one g++ run per op type on empty caches: 18 s for one
    Lanczos graph where this takes 0.4 s. numba, the default backend, compiles such a loop
    for 10-50 s. The samplers run these graphs compiled by numba (by default) inside their
    blocks, which ``test_samplers.py``, ``test_covariance_samplers.py`` and ``test_jax.py``
    check end to end.
    """
    with pytensor.config.change_flags(cxx=""):
        return pytensor.function(inputs, outputs, mode=mode, **kwargs)
