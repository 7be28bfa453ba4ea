"""Warm-up adaptation: the windows in which the preconditioner is estimated, and the estimate.

The schedule is Stan's / PyMC's NUTS warm-up (Stan Reference Manual, "HMC algorithm
parameters"): a fast initial interval in which only the step size is re-chosen (the chain
travels from its starting point into the typical set), a series of doubling slow windows at
whose ends the diagonal preconditioner is re-estimated from the window's draws, and a
terminal interval that runs the final kernel. All counts are in stored (tuning) draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["WindowVariance", "adaptation_boundaries"]

#: Stan's defaults for tune >= 150 draws: initial interval, first slow window, terminal interval.
INITIAL_BUFFER, BASE_WINDOW, TERMINAL_BUFFER = 75, 25, 50
#: Weight, in draws, of the previous preconditioner in a window's estimate.
PRIOR_DRAWS = 5
#: Below this many tuning draws the preconditioner is not adapted (too few draws to estimate it).
MIN_TUNE_FOR_WINDOWS = 20


def adaptation_boundaries(tune: int) -> list[tuple[int, bool]]:
    """Tuning draws after which the kernel is re-chosen, and whether the preconditioner is
    re-estimated there (``True``: the end of a slow window) or only the step size.

    Windows double in length; the last one stretches to the start of the terminal interval
    instead of leaving a window shorter than twice its predecessor.
    """
    if tune < MIN_TUNE_FOR_WINDOWS:
        return []
    initial, base, terminal = INITIAL_BUFFER, BASE_WINDOW, TERMINAL_BUFFER
    if initial + base + terminal > tune:
        initial, terminal = int(0.15 * tune), int(0.1 * tune)
        base = tune - initial - terminal
    boundaries = [(initial, False)] if initial > 0 else []
    end_of_slow = tune - terminal
    start, size = initial, base
    while start < end_of_slow:
        end = start + size
        if end + 2 * size > end_of_slow:
            end = end_of_slow
        boundaries.append((end, True))
        start, size = end, 2 * size
    return boundaries


@dataclass
class WindowVariance:
    """Running mean and variance of the draws of one window (Welford's algorithm)."""

    dim: int
    count: int = 0
    mean: np.ndarray = field(init=False)
    m2: np.ndarray = field(init=False)

    def __post_init__(self):
        self.mean = np.zeros(self.dim)
        self.m2 = np.zeros(self.dim)

    def add(self, x: np.ndarray) -> None:
        self.count += 1
        delta = x - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (x - self.mean)

    def standard_deviations(self, previous: np.ndarray) -> np.ndarray:
        """The scales of the new preconditioner: the window's standard deviations, shrunk
        with the weight of ``PRIOR_DRAWS`` draws towards the previous scales brought to the
        window's overall level (their median ratio), as Stan regularises its metric: a short
        window cannot collapse one scale, and an unscaled start (all ones) is not a target."""
        if self.count < 2:
            return previous
        variance = self.m2 / (self.count - 1)
        if not np.all(np.isfinite(variance)) or np.max(variance) <= 0:
            return previous
        target = previous**2 * np.median(variance / previous**2)
        weight = self.count / (self.count + PRIOR_DRAWS)
        return np.sqrt(weight * variance + (1.0 - weight) * target)
