"""The runaway check: steps whose minibatch log-density has left the chain's typical range.

An unstable chain grows geometrically, or drifts away slowly when damping holds the growth
back, and its log-density collapses long before the position overflows. The check compares
each step with the chain's *typical* value (in its first block the first step's value, or the
median of the steps before a divergence that ended it, or the log-density where the chain
restarted, ``first_reference``; then the median
of the highest long sane block so far, never lowered, so that a drifting chain cannot drag it
along) through a *running median* of the last ``WINDOW`` steps: at small batch
sizes a single minibatch's log-density is heavy-tailed (n = 1 of N = 30,000
logistic-regression rows: one step in a hundred falls 30 times below the median, and a test
on single values flagged 1,182 of 5,000 draws of a sane chain), while a runaway moves all of
them. A single step ``EXTREME`` margins below is flagged at once, with the run of low steps
that led to it. The margin is ``SPREADS`` times the typical spread of the running medians
within a block (at least ``MIN_MARGIN``); the chain's first block has only the scale-free
``max(1e4, 10 |typical|)``.

For the momentum samplers the check follows the negative energy instead, plus ``D / 2``:
``log p - (p . p - D) / 2`` (``checked_series``). Friction only
removes energy, so a sane chain turns potential into kinetic energy and loses it, however far
from the posterior it starts, while an unstable step creates energy. The log-density alone
can miss one: SGNHT on a non-centred hierarchical Poisson regression (8 groups,
``a = mu + sd * z``) moved the group scale's logarithm from 4.6 to -6,574 in one step and then
6,400 further in each of the next 20, at a kinetic temperature of 10^10, while the minibatch
log-density *rose* (a zero scale pools the groups) -- until the position overflowed, and the
restart from the last sane draw kept a scale of exactly 0, in every draw of both chains
(R-hat 1.06). After the restart the same chain blew up again more slowly (kinetic
temperature about 10^4), inside the first block's scale-free margin, and collapsed the scale
once more. In the *transient* from the chain's start (the initial interval of an adapted
step size), ``transient_heat_flags`` therefore also bounds the kinetic energy itself by
what the chain can have come by: its growth since the first checked step may not exceed the
log-density's range so far plus the heat that the transient's step-size rule lets the
gradient noise inject. With both, that model's chains kept their scale (0.61 +- 0.03 over the
draws, NUTS 0.58 +- 0.18), though the non-centred ridge left it unmixed (R-hat 2.3).

The log-density is computed only where it is read: at every ``STRIDE``-th step (every stored
draw when ``thin`` is smaller), so "steps" below are the checked steps. Non-finite positions,
momenta and forces are still caught at every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

__all__ = [
    "EXTREME",
    "HEAT_ALLOWANCE",
    "MIN_MARGIN",
    "MIN_SPREAD_STEPS",
    "SPREADS",
    "STRIDE",
    "TRANSIENT_START",
    "WINDOW",
    "TransientReference",
    "checked_series",
    "extreme_flags",
    "first_reference",
    "kinetic_excess",
    "margin",
    "runaway_flags",
    "running_medians",
    "spread",
    "trailing_history",
    "transient_heat_flags",
    "updated_reference",
]

#: Integrator steps between checked steps (``min(thin, STRIDE)`` in a chain). Computing the
#: minibatch log-density at every step cost as much as the rest of a logistic-regression
#: step (P3: SGLD 21-32 instead of 46-54 us without it); one step in ten costs a tenth of
#: that, and a runaway is still caught within about ``STRIDE * WINDOW / 2`` steps of leaving
#: the typical range.
STRIDE = 10
#: Checked steps in the running median (a runaway is flagged once more than half are low).
WINDOW = 21
#: Margin below the typical value, in spreads of the running median. In 20,000-step sane
#: chains (SGLD, SGNHT, NOGIN at their default step sizes on P1, P2, P4 and a logistic
#: regression) the running median fell at most 3.8-5.4 spreads below the typical value at
#: n >= 10, and 16.5-17.3 at n = 1, reading every step; 3.1-6.7 reading every ``STRIDE``-th
#: at n >= 10 (``benchmarks/runaway_calibration_results.md``). At n = 1 read every
#: ``STRIDE``-th step, SGLD's came to 49.4: its first long block's spread, a median absolute
#: deviation of 100 running medians of overlapping 21-step windows, was a quarter of the later ones
#: (258 against 1,000-2,700), and set the next block's margin alone in the replay, which
#: starts at the kept draws (the sampler, with its tuning blocks' spreads too, flagged no draw
#: of that chain). Even where
#: single steps are heavy-tailed the running median is not: it falls below a quantile q only
#: when 11 of 21 steps do, with probability about C(21, 11) q^11. A NOGIN chain drifting away
#: at N = 10^6, n = 1,000 (the benchmark's P4) crossed 50 spreads at about 30 posterior sd,
#: 100 spreads only at about 135.
SPREADS = 50.0
#: A single step this many margins below is flagged without waiting for the window: an
#: unstable step grows the log-density's deficit by orders of magnitude per step, while in
#: those sane chains a single step fell at most 1.0 margins below at n >= 10 and 4.1 at n = 1
#: (13 for SGLD's chain above, read every ``STRIDE``-th step).
EXTREME = 100.0
#: The smallest margin, in log-density units: a chain's own log-density fluctuates by about
#: sqrt(D / 2), so a full-batch chain on a small model must not be held to a few units.
MIN_MARGIN = 100.0
#: Checked steps a block needs to set the typical value and add its spread (a 1,000-step block
#: has 100 or more; the blocks before an adaptation boundary or after a divergence can have a
#: few).
MIN_SPREAD_STEPS = 100


def checked_series(
    logps: np.ndarray, kinetic_temperatures: np.ndarray | None, dim: int
) -> np.ndarray:
    """What the check follows at each step: the minibatch log-density, less, where the
    sampler has a momentum, its kinetic energy's excess over the equilibrium mean ``D / 2``
    (``kinetic_temperature`` is ``p . p / D``, unit mass in the preconditioned coordinates):
    ``-H + D / 2`` for the energy ``H = -log p + p . p / 2``. At equilibrium the excess
    fluctuates by about ``sqrt(D / 2)``, well inside the margins."""
    if kinetic_temperatures is None:
        return logps
    return logps - kinetic_excess(kinetic_temperatures, dim)


def kinetic_excess(kinetic_temperatures: np.ndarray, dim: int) -> np.ndarray:
    """The kinetic energy's excess over its equilibrium mean, ``(p . p - D) / 2``, from the
    ``kinetic_temperature`` stat ``p . p / D``."""
    return 0.5 * dim * (kinetic_temperatures - 1.0)


#: Allowance of ``transient_heat_flags`` in units of the most heat the gradient noise can
#: hold in equilibrium under the transient's step-size rule (and of the kinetic energy's
#: thermal fluctuation).
HEAT_ALLOWANCE = 10.0


class TransientReference(NamedTuple):
    """What ``transient_heat_flags`` carries from block to block of a transient; the
    defaults are a chain's (re)start: no checked step yet."""

    #: Lowest and highest log-density of the checked steps since the (re)start.
    lowest: float = np.inf
    highest: float = -np.inf
    #: The kinetic energy's excess at the first checked step since the (re)start.
    baseline: float = np.nan


#: A chain's (re)start: the reference of a transient's first block.
TRANSIENT_START = TransientReference()


def transient_heat_flags(
    logps: np.ndarray,
    kinetic_temperatures: np.ndarray,
    dim: int,
    step_size: float,
    friction: float,
    earlier: TransientReference = TRANSIENT_START,
) -> tuple[np.ndarray, TransientReference]:
    """The first checked step of a transient whose kinetic energy has grown by more than the
    chain can have come by, as a flag array over the block's checked steps (``logps`` and
    ``kinetic_temperatures`` there); and what the next block starts from: the lowest and
    highest log-density since the chain's (re)start and the kinetic energy's excess at its
    first checked step (``earlier``: the same from the blocks before; :data:`TRANSIENT_START` at a
    (re)start).

    Friction only removes energy, so the kinetic energy's excess ``(p . p - D) / 2`` can grow
    from the potential, at most by the log-density's rise (bounded here by its range over the
    checked steps, minibatch noise included), or from the gradient noise. In the transient the
    step-size rule keeps ``h sigma_max <= 1/2``, so the noise holds each coordinate's kinetic
    temperature at most ``1 / (8 h A)`` above 1 in equilibrium (the injected variance
    ``h sigma^2`` per unit time against the friction's ``2 A (T - 1)``). Growth since the
    first checked step beyond the range plus :data:`HEAT_ALLOWANCE` times that heat over the
    ``D`` coordinates (and as many times ``sqrt(D)``, the thermal fluctuation) made energy:
    the integrator is unstable there. What the chain gained before its first checked step
    (up to ``STRIDE - 1`` steps from a far start) is the baseline, not counted.
    """
    lowest0, highest0, baseline = earlier
    finite = np.isfinite(logps)
    lowest = np.minimum.accumulate(np.concatenate([[lowest0], np.where(finite, logps, np.inf)]))
    highest = np.maximum.accumulate(np.concatenate([[highest0], np.where(finite, logps, -np.inf)]))
    excess = kinetic_excess(kinetic_temperatures, dim)
    if not np.isfinite(baseline):
        baseline = float(excess[0])
    heat = 0.5 * dim / (8.0 * step_size * friction) + np.sqrt(dim)
    with np.errstate(invalid="ignore"):  # -inf - inf before the first finite value
        hot = excess - baseline > highest[1:] - lowest[1:] + HEAT_ALLOWANCE * heat
    flags = np.zeros(len(logps), dtype=bool)
    if hot.any():
        flags[int(np.argmax(hot))] = True
    return flags, TransientReference(float(lowest[-1]), float(highest[-1]), baseline)


def running_medians(logps: np.ndarray, history: np.ndarray) -> np.ndarray:
    """The median of each step's trailing window of :data:`WINDOW` steps, reaching back
    into ``history`` (the last sane steps before the block); at a chain start, where no step
    has a full window yet, the steps before the first full window share its median.
    Non-finite values count as the lowest."""
    values = np.concatenate([history, logps])
    values = np.where(np.isnan(values), -np.inf, values)
    with np.errstate(invalid="ignore"):  # -inf - -inf inside the median's partition
        if len(values) < WINDOW:
            return np.full(len(logps), np.median(values))
        windows = np.lib.stride_tricks.sliding_window_view(values, WINDOW)
        medians = np.median(windows, axis=1)
    medians = np.concatenate([np.full(WINDOW - 1, medians[0]), medians])
    return medians[len(history) :]


def trailing_history(history: np.ndarray, logps: np.ndarray) -> np.ndarray:
    """The last ``WINDOW - 1`` values of ``history`` followed by ``logps``: what the next
    block's first running medians reach back into."""
    return np.concatenate([history, logps])[1 - WINDOW :]


def spread(medians: np.ndarray) -> float:
    """Robust scale of a block's running medians: 1.4826 times their median absolute
    deviation (the standard deviation for Gaussian values)."""
    return float(1.4826 * np.median(np.abs(medians - np.median(medians))))


def runaway_flags(
    logps: np.ndarray, medians: np.ndarray, typical: float | None, spreads: list[float]
) -> np.ndarray:
    """Flags on the steps that start a runaway: every non-finite step; the first low step
    (more than the margin below the typical value, :func:`margin`) of the first window whose
    running median is low; and the first of the run of low steps that ends in the first
    single step :data:`EXTREME` margins below. The caller truncates at the first flag."""
    flagged = ~np.isfinite(logps)
    if typical is None:
        # The chain's first block: its first step (a blow-up within the first window would
        # already drag the window's median along).
        typical = float(logps[0])
    if not np.isfinite(typical):
        return flagged
    allowed = margin(typical, spreads)
    low = ~(logps >= typical - allowed)
    low_windows = np.flatnonzero(~(medians >= typical - allowed))
    if low_windows.size:
        # The first window that is mostly below: the runaway began at its first low step.
        end = low_windows[0]
        start = max(0, end - WINDOW + 1)
        flagged[start + int(np.argmax(low[start : end + 1]))] = True
    extreme = np.flatnonzero(extreme_flags(logps, typical, spreads))
    if extreme.size:
        # A geometric blow-up, caught before the window fills: its run of low steps.
        start = extreme[0]
        while start > 0 and low[start - 1]:
            start -= 1
        flagged[start] = True
    return flagged


def extreme_flags(values: np.ndarray, typical: float, spreads: list[float]) -> np.ndarray:
    """Flags on the values :data:`EXTREME` margins below the typical value (or not finite):
    single steps no sane chain reaches. Also applied to the stored draws between the checked
    steps (``thin > STRIDE``), whose log-density is computed anyway: the draw before a
    non-finite step is where the chain restarts, and a chain that fell into a funnel's neck
    in one step (a centred random-intercept model: the group scale from 0.06 to 3e-18 within
    a 15-step draw, the minibatch log-density from -2,800 to -3e36, and NaN the step after)
    restarted from that draw, with every later block diverging from it."""
    return ~(values >= typical - EXTREME * margin(typical, spreads))


def margin(typical: float, spreads: list[float]) -> float:
    """How far below the typical value a running median may fall: :data:`SPREADS` times the
    median spread of the chain's long sane blocks (at least :data:`MIN_MARGIN`); before the
    first long block, the scale-free ``max(1e4, 10 |typical|)``."""
    if not spreads:
        return max(1e4, 10 * abs(typical))
    return max(SPREADS * float(np.median(spreads)), MIN_MARGIN)


def first_reference(sane_logps: np.ndarray, at_restart: Callable[[], float]) -> float:
    """The typical value a chain restarts with when a divergence came before any sane block:
    the median of the sane checked steps before the divergence, or, with none,
    ``at_restart()``, the minibatch log-density at the restart point (a sane draw or the
    chain's start; for the momentum samplers the energy's value there too, the momentum
    being drawn afresh). Without it the restarted block's first step would be its own
    reference, however far it had already run away: SGLD at 13 times the stable step on a
    linear regression restarted from a draw at log-density -1e4, and its next step, at
    -7e15 (a noise scale of 1e8), became the reference and the draw that every later one
    repeated; CCAdL at 60 times, every block diverging from the start, kept a draw at
    -2e113."""
    return float(np.median(sane_logps)) if len(sane_logps) else float(at_restart())


def updated_reference(
    typical: float | None, spreads: list[float], logps: np.ndarray, medians: np.ndarray
) -> float:
    """The typical value after a sane block, and its spread appended to ``spreads``. The
    typical value is the first block's median, raised to the median of each later block of
    at least :data:`MIN_SPREAD_STEPS` steps that is higher (a short block's median is too
    noisy a reference; a higher one only makes the check stricter)."""
    median = float(np.median(logps))
    if typical is None:
        typical = median
    if len(logps) >= MIN_SPREAD_STEPS:
        typical = max(typical, median)
        spreads.append(spread(medians))
    return typical
