"""Locate the shared offline data sets (``../shared/data`` beside the checkout)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def data_dir() -> Path:
    """``$PYMC_SGMCMC_DATA`` if set, else ``shared/data`` beside the repository checkout."""
    env = os.environ.get("PYMC_SGMCMC_DATA")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    if not path.is_dir():
        raise FileNotFoundError(
            f"data directory {path} not found: set PYMC_SGMCMC_DATA to the folder holding a9a/, "
            "mnist/, ... (the examples never download data)"
        )
    return path


def load(name: str) -> dict[str, np.ndarray]:
    folder = data_dir() / name
    (archive,) = sorted(folder.glob("*.npz"))
    with np.load(archive) as f:
        return {k: f[k] for k in f.files}
