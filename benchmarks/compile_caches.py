"""The environment of a fresh process whose compile caches live in a given directory.

A cold first draw needs both caches empty: PyTensor's base compile directory (its numba cache
of PyTensor's functions lives in ``base_compiledir/numba``, not in ``compiledir``) and numba's
own cache directory, where the package's ``cache=True`` kernel helpers
(:mod:`pymc_sgmcmc.gather_dot`) are cached; by default those stay in the package's
``__pycache__`` from earlier runs. A second process with the same directory measures warm.
"""

from __future__ import annotations

import os

__all__ = ["compile_cache_env"]


def compile_cache_env(directory: str) -> dict[str, str]:
    """``os.environ`` with PyTensor's and numba's compile caches under ``directory``."""
    flags = ",".join(
        f for f in (os.environ.get("PYTENSOR_FLAGS"), f"base_compiledir={directory}") if f
    )
    return {
        **os.environ,
        "PYTENSOR_FLAGS": flags,
        "NUMBA_CACHE_DIR": os.path.join(directory, "numba_cache_dir"),
    }
