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

__all__ = [
    "DENSE_MAX_DIM",
    "DRIFT_THRESHOLD",
    "DRIFT_WARNING_FALSE_ALARMS",
    "ROTATION_GAIN",
    "STRONG_CORRELATION",
    "WindowVariance",
    "adaptation_boundaries",
    "is_positive_definite",
    "measured_curvature",
    "posterior_correlation",
    "strong_correlations",
]

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


#: A coordinate drifted over a slow window when the means of the window's two halves differ by
#: more than this many of their pooled within-half standard deviations. A stationary chain
#: stored about once per relaxation time (integrated autocorrelation time tau of about 2
#: draws) gives that statistic a standard deviation of about sqrt(4 tau / m) over m draws:
#: 0.6 in the shortest window (25 draws), 0.13 in the last one of tune=1000. A chain still
#: travelling trips it once it moves by about 3.3 of its own spreads over the window (a linear
#: drift Delta against a noise sd sigma scores (Delta/2) / sqrt(sigma^2 + Delta^2/48)), where
#: the drift would inflate the window's variance about 1.9-fold (SGNHT from about 180
#: posterior sd away with tune=20, ``tests/test_adaptation.py``, trips it in every
#: coordinate; with tune=100, before the transient held its thermostat, its scales came out
#: 15-25 times too large without the check). Only that storage gives the
#: statistic its calibration: with a user's ``step_size`` or ``thin`` the draws may be
#: correlated over many windows (``thin=1`` at a small step), and the check is not made.
DRIFT_THRESHOLD = 1.5
#: Integrated autocorrelation time, in draws, of draws stored once per relaxation time (the
#: adapted ``thin``; lag-1 autocorrelation e^-1, so tau = (1 + e^-1) / (1 - e^-1) = 2.16): the
#: calibration of :data:`DRIFT_THRESHOLD` above and of the warning below.
STORED_DRAWS_TAU = (1 + np.exp(-1)) / (1 - np.exp(-1))
#: Rate at which the end-of-tuning drift warning fires for a chain that was sampling over its
#: last window, over all coordinates together. 1.5 alone is a per-coordinate level: a short
#: window or many coordinates give a stationary chain one beyond it by chance (tau = 2.16: 19 %
#: of chains with 3 coordinates over a 15-draw window, 7 % with 100 over a 50-draw one, as
#: at tune=200), so the warning also asks for a statistic that chance reaches this rarely
#: (:meth:`WindowVariance.drift_warning`).
DRIFT_WARNING_FALSE_ALARMS = 0.01
#: Multiple correlation of a coordinate with all the others, in the posterior that the Hessian
#: at a chain's point describes, at which the warnings at the end of tuning name it
#: (:func:`strong_correlations`) and a dense preconditioner is refitted to a later window's
#: Hessian: the diagonal preconditioner then leaves the coordinate's
#: conditional spread sqrt(1 - R^2) = 0.2 of its marginal one, a direction 25 times narrower
#: in variance than the coordinate's scale, whose crossing of the long direction takes
#: about 5 relaxation times of the narrow one.
STRONG_CORRELATION = 0.98
#: A dense preconditioner is fitted to the Hessian at a slow window's last draw where that
#: Hessian's correlation matrix has at least this condition number (what no diagonal
#: preconditioner removes), and kept only if
#: it conditions the Hessian at the window's first draw at least this many times better than
#: the diagonal one (largest over smallest eigenvalue, the steps a relaxation time takes when
#: the curvature sets the step size). Where the posterior is correlated it gained 10^3-10^5
#: (an uncentred year, raw letter features, collinear covariates, a softmax with every class
#: free, an uncentred Poisson covariate: 1,500-210,000 down to 1.0-1.9); in a centred
#: hierarchical funnel it lost (15 up to 400), and the diagonal one stays.
ROTATION_GAIN = 4.0
#: The most coordinates for which tuning looks for a dense preconditioner, and the warnings
#: name strongly correlated coordinates. Each check reads the Hessian at a draw from D
#: Hessian-vector products on 4 minibatches (a logistic regression, n = 500: 0.08 s at
#: D = 64, 0.13 s at D = 100, 0.46 s at D = 250), once or twice per slow window; a dense
#: block adds four D x D products per step (at D = 200, n = 500: 1.15-1.59 times the
#: diagonal block's time per step, mSGLD 2.2 and CCAdL 12.7). A random-intercept model
#: with 99 groups (D = 100, intercept and group effects correlated at -0.99) was drawn
#: 0.23-1.5 sd off with sd ratios of 0.09-0.57 by the seven samplers under the diagonal
#: preconditioner, and within 0.1 sd with the dense one
#: (``benchmarks/dense_preconditioner_results.md``).
DENSE_MAX_DIM = 256


@dataclass
class _Moments:
    """Count, mean and sum of squared deviations of a stream of draws (Welford's algorithm),
    and with ``full`` the sums of products of deviations (for a covariance matrix)."""

    dim: int
    count: int = 0
    full: bool = False
    mean: np.ndarray = field(init=False)
    m2: np.ndarray = field(init=False)
    products: np.ndarray | None = field(init=False)

    def __post_init__(self):
        self.mean = np.zeros(self.dim)
        self.m2 = np.zeros(self.dim)
        self.products = np.zeros((self.dim, self.dim)) if self.full else None

    def add(self, x: np.ndarray) -> None:
        self.count += 1
        delta = x - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (x - self.mean)
        if self.products is not None:
            self.products += np.outer(delta, x - self.mean)

    def merged(self, other: _Moments) -> _Moments:
        """The moments of both streams together (Chan, Golub & LeVeque's pairwise update)."""
        merged = _Moments(self.dim, self.count + other.count, self.full and other.full)
        if merged.count == 0:
            return merged
        delta = other.mean - self.mean
        merged.mean = self.mean + delta * other.count / merged.count
        merged.m2 = self.m2 + other.m2 + delta**2 * self.count * other.count / merged.count
        if merged.products is not None:
            cross = np.outer(delta, delta) * self.count * other.count / merged.count
            merged.products = self.products + other.products + cross
        return merged


@dataclass
class WindowVariance:
    """Running mean and variance of the draws of one window, kept for its two halves (the
    first ``length // 2`` draws added and the rest), which tell a chain that was still
    travelling (:meth:`drifting`) from one that was sampling."""

    dim: int
    length: int = 0
    #: Whether the window also keeps its draws' covariance matrix (:meth:`covariance`).
    full: bool = False
    halves: tuple[_Moments, _Moments] = field(init=False)

    def __post_init__(self):
        self.halves = (_Moments(self.dim, full=self.full), _Moments(self.dim, full=self.full))

    @property
    def count(self) -> int:
        return self.halves[0].count + self.halves[1].count

    def add(self, x: np.ndarray) -> None:
        first, second = self.halves
        (first if first.count < self.length // 2 else second).add(x)

    def drift_statistics(self) -> np.ndarray:
        """Per coordinate: the difference of the window's two halves' means in pooled
        within-half standard deviations (zeros when a half has fewer than 2 draws)."""
        first, second = self.halves
        if min(first.count, second.count) < 2:
            return np.zeros(self.dim)
        pooled = 0.5 * (first.m2 / (first.count - 1) + second.m2 / (second.count - 1))
        gap = np.abs(second.mean - first.mean)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(pooled > 0, gap / np.sqrt(pooled), np.where(gap > 0, np.inf, 0.0))

    def drifting(self) -> np.ndarray:
        """Per coordinate: did the window's two halves differ in mean by more than
        ``DRIFT_THRESHOLD`` pooled within-half standard deviations? A level per coordinate,
        for the preconditioner: a coordinate flagged by chance keeps its previous scale."""
        return self.drift_statistics() > DRIFT_THRESHOLD

    def drift_warning_threshold(self) -> float:
        """The statistic's level that a sampling chain (draws ``STORED_DRAWS_TAU`` apart)
        exceeds in any of the ``dim`` coordinates with probability
        ``DRIFT_WARNING_FALSE_ALARMS``, and at least ``DRIFT_THRESHOLD``. The halves' means
        of k1 and k2 such draws differ by about sqrt(tau (1/k1 + 1/k2)) of the spread, and
        the pooled spread, estimated from the window, makes the ratio Student-t with
        k1 + k2 - 2 degrees of freedom: within 5 % of the simulated 99-99.99 % quantiles of
        AR(1) draws with tau 2 and 3 over 15-150 draws. Bonferroni over the coordinates
        (``tests/test_adaptation.py`` measures the rate). The price is sensitivity in short
        windows: a linear drift over 15 draws of 3 coordinates (level 2.73) is reported
        from about 9 of its spreads, against 3.3 at the level 1.5."""
        first, second = (half.count for half in self.halves)
        if min(first, second) < 2:
            return np.inf
        level = 1.0 - DRIFT_WARNING_FALSE_ALARMS / (2 * self.dim)
        spread = np.sqrt(STORED_DRAWS_TAU * (1 / first + 1 / second))
        # Imported here, at the end of tuning: scipy.stats took 1.1 s of ``import
        # pymc_sgmcmc`` (0.25 s for scipy.special), inside the time to a first draw.
        from scipy.special import stdtrit  # the Student-t quantile, as stats.t.ppf

        return max(DRIFT_THRESHOLD, spread * float(stdtrit(first + second - 2, level)))

    def drift_warning(self) -> np.ndarray:
        """Per coordinate: beyond :meth:`drift_warning_threshold`, the level at which the
        chain is reported still travelling at the end of tuning."""
        return self.drift_statistics() > self.drift_warning_threshold()

    def covariance(self) -> tuple[np.ndarray, int] | None:
        """The covariance matrix of the window's draws and their number; None without
        ``full`` or with fewer than 2 draws."""
        whole = self.halves[0].merged(self.halves[1])
        if whole.products is None or whole.count < 2:
            return None
        return whole.products / (whole.count - 1), whole.count

    def standard_deviations(
        self, previous: np.ndarray, keep: np.ndarray | None = None
    ) -> np.ndarray:
        """The scales of the new preconditioner: the window's standard deviations, shrunk
        with the weight of ``PRIOR_DRAWS`` draws towards the previous scales brought to the
        window's overall level (their median ratio), as Stan regularises its metric: a short
        window cannot collapse one scale, and an unscaled start (all ones) is not a target.
        The coordinates of ``keep`` (those that drifted over the window: their spread there
        is the distance travelled, not the posterior's width) keep their previous scales."""
        variance = self.variances()
        if variance is None or not np.all(np.isfinite(variance)) or np.max(variance) <= 0:
            return previous
        target = previous**2 * np.median(variance / previous**2)
        weight = self.count / (self.count + PRIOR_DRAWS)
        scale = np.sqrt(weight * variance + (1.0 - weight) * target)
        return scale if keep is None else np.where(keep, previous, scale)

    def variances(self) -> np.ndarray | None:
        """The variances of the window's draws (None with fewer than 2)."""
        whole = self.halves[0].merged(self.halves[1])
        return whole.m2 / (whole.count - 1) if whole.count >= 2 else None


def measured_curvature(
    hessian: np.ndarray, coordinates: np.ndarray, covariance: np.ndarray, count: int
) -> np.ndarray:
    """``hessian`` (of -log p in theta) with its curvature along each of its eigen-directions
    in the coordinates phi of theta = ``coordinates`` phi raised to at least the precision
    that a window's ``count`` draws (``covariance``, in theta) show there: one over their
    variance along the direction, shrunk with the weight of ``PRIOR_DRAWS`` draws towards 1,
    the unit of phi (whose scales are the window's spreads), so that a direction the draws
    have not spanned is not read as infinitely narrow.

    For a Hessian that is not positive definite, where a posterior's curvature at a point
    misses its width: a Laplace prior has no curvature off its kink, covariates that sum to
    one in every row (one-hot groups) leave directions that only that prior identifies, and
    a hierarchical scale curves negatively away from its mode. The draws measure those
    directions, D variances along directions the Hessian gives, where a covariance matrix
    has D (D + 1) / 2 entries; the data's narrow directions keep the Hessian's curvature,
    which a window of a few draws estimates poorly. On the main example (a9a, D = 124, a
    Hessian with 12-16 eigenvalues at or below 0) the draws' correlation matrix has a
    condition number of 28,000 under the diagonal preconditioner, 37-140 in the coordinates
    this curvature gives from a window of 100-500 of its draws, and 2,200-2,700,000 in
    those of the window's covariance alone (Stan's dense metric)."""
    inverse = np.linalg.inv(coordinates)
    lam, vectors = np.linalg.eigh(coordinates.T @ hessian @ coordinates)
    spread = np.einsum("ij,ij->j", vectors, inverse @ covariance @ inverse.T @ vectors)
    weight = count / (count + PRIOR_DRAWS)
    precision = np.maximum(lam, 1.0 / (weight * np.maximum(spread, 0.0) + 1.0 - weight))
    return inverse.T @ ((vectors * precision) @ vectors.T) @ inverse


def is_positive_definite(matrix: np.ndarray) -> bool:
    """Whether ``matrix`` is finite and positive definite (its Cholesky factor exists)."""
    if not np.all(np.isfinite(matrix)):
        return False
    try:
        np.linalg.cholesky(matrix)
    except np.linalg.LinAlgError:
        return False
    return True


def posterior_correlation(hessian: np.ndarray) -> np.ndarray | None:
    """The correlation matrix of the Gaussian whose precision is ``hessian``; None unless
    ``hessian`` is finite and positive definite."""
    covariance = _inverse_if_positive_definite(hessian)
    return None if covariance is None else _correlation_matrix(covariance)


def _inverse_if_positive_definite(matrix: np.ndarray) -> np.ndarray | None:
    return np.linalg.inv(matrix) if is_positive_definite(matrix) else None


def _correlation_matrix(covariance: np.ndarray) -> np.ndarray:
    sd = np.sqrt(np.diag(covariance))
    return covariance / np.outer(sd, sd)


def strong_correlations(
    hessian: np.ndarray, level: float = STRONG_CORRELATION, limit: int = 3
) -> list[tuple[int, float, int, float]]:
    """The coordinates (i, R_i, j, r_ij), strongest first and at most ``limit``, that the
    Gaussian with precision ``hessian`` correlates with the others together at a multiple
    correlation R_i >= ``level`` (R_i^2 = 1 - 1 / (H_ii (H^-1)_ii)), each with its most
    correlated partner j (r_ij from H^-1). A coordinate that is its listed partner's own
    partner is not listed again. Empty unless ``hessian`` is finite and positive definite: a
    Hessian, not a chain's draws, since the draws of a chain whose ``thin`` is capped are
    correlated by chance over a window as two slow random walks are."""
    covariance = _inverse_if_positive_definite(hessian)
    if covariance is None:
        return []
    correlation = _correlation_matrix(covariance)
    r_squared = 1.0 - 1.0 / np.clip(np.diag(hessian) * np.diag(covariance), 1.0, None)
    np.fill_diagonal(correlation, 0.0)
    found: list[tuple[int, float, int, float]] = []
    for i in np.argsort(-r_squared):
        if r_squared[i] < level**2 or len(found) == limit:
            break
        j = int(np.argmax(np.abs(correlation[i])))
        if any(i == partner and j == k for k, _, partner, _ in found):
            continue
        found.append((int(i), float(np.sqrt(r_squared[i])), j, float(correlation[i, j])))
    return found
