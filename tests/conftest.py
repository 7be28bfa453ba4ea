import warnings

import pytest
from pymc.backends.ndarray import NDArray
from pymc.progress_bar import MCMCProgressBarManager

# PyTensor warns about BLAS on pip installs; the numba backend does not need it.
warnings.filterwarnings("ignore", message="PyTensor could not link to a BLAS")


@pytest.fixture
def progress_updates(monkeypatch):
    """The progress bar's updates in this (the main) process: (chain, draw, tuning, last)."""
    updates: list[tuple[int, int, bool, bool]] = []
    update = MCMCProgressBarManager.update

    def recording(self, chain_idx, is_last, draw, tuning, stats):
        updates.append((chain_idx, draw, tuning, is_last))
        update(self, chain_idx, is_last, draw, tuning, stats)

    monkeypatch.setattr(MCMCProgressBarManager, "update", recording)
    return updates


@pytest.fixture
def per_draw_records(monkeypatch):
    """How many draws this (the main) process recorded one by one (``NDArray.record``)."""
    count = [0]
    record = NDArray.record

    def counting(self, *args, **kwargs):
        count[0] += 1
        record(self, *args, **kwargs)

    monkeypatch.setattr(NDArray, "record", counting)
    return count
