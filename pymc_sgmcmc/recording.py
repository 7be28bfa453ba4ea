"""Draws recorded into PyMC's NumPy traces a run at a time, not one by one.

PyMC's sampling loops (``pymc.sampling.mcmc._iter_sample`` for ``cores=1``, ``_mp_sample``
for parallel chains) record each draw: a ``step`` call, the trace's compiled function of
the point, one array write per stat, a check for a ``"warning"`` stat. An SG draw can be a
single integrator step of 14-20 µs, served from a compiled block, and then that per-draw
Python costs about as much as the draw: with P1 SGLD at ``thin=1`` one chain's process took
34-46 µs of CPU per draw with PyMC's loop and 22-36 µs with the runs recorded here, and with
two chains, where the main process shares the two cores with both workers, the main process
15-19 µs per draw against 5-9 µs (``benchmarks/engine_results_cores_batch_recording.md``).

After tuning an SG step hands out the rest of each compiled block at once
(``SGMCMC.step_run``: the draws and stats as arrays), and
:func:`record_batch` writes such a run into the trace: the trace's function still evaluates
each draw's point, but the stats go in column by column. The draws, stats and tuning flags
are those PyMC's loop records, in the same places; the progress bar still advances draw by
draw. It applies where :func:`records_in_batches` holds: an SG step, PyMC's default NumPy
traces and no ``callback`` (which takes every draw). ``pymc_sgmcmc.parallel`` uses it for
the batches of parallel chains; :func:`install` makes the sequential loop use it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pymc.sampling.mcmc as mcmc
from pymc.backends.ndarray import NDArray

from pymc_sgmcmc.base import SGMCMC

__all__ = ["install", "last_stats", "record_batch", "records_in_batches"]


def records_in_batches(step: Any, traces: Sequence[Any], callback: Any) -> bool:
    """Whether a ``pm.sample`` call's draws can be recorded a run at a time: an SG step
    method (not part of a compound step), every trace PyMC's ``NDArray`` and no
    ``callback``, which PyMC hands every draw."""
    return (
        isinstance(step, SGMCMC)
        and callback is None
        and all(type(trace) is NDArray for trace in traces)
    )


def record_batch(trace: NDArray, points: dict[str, np.ndarray], runs: list) -> None:
    """Record a batch of draws as ``trace.record`` records each of them (``NDArray.record``:
    the trace's function of each draw's point, then each stat), with the stats of a run
    served by ``step_run`` (a dict of columns) written column by column; a run of single
    draws (a list of per-draw stats in PyMC's form) is written draw by draw. ``points``: each
    variable's draws stacked along the first axis, in the trace's point order. The loops'
    check for a ``"warning"`` stat is left out: an SG step has none."""
    start, values = trace.draw_idx, list(points.values())
    count = len(values[0])
    columns = [trace.samples[name] for name in trace.varnames]
    for k in range(count):
        # values[k, ...] keeps a scalar variable's draw a 0-d array, as PyMC's loops hand
        # it: a NumPy scalar broke the trace's compiled function for Deterministics (numba
        # types a float64 scalar apart from arrays).
        outputs = trace.fn(*(value[k, ...] for value in values))
        for column, output in zip(columns, outputs, strict=True):
            column[start + k] = output
    (stats,) = trace._stats  # one step method (see records_in_batches)
    k = start
    for run in runs:
        if isinstance(run, dict):
            n = len(next(iter(run.values())))
            for name, column in run.items():
                stats[name][k : k + n] = column
        else:
            n = len(run)
            for i, (draw_stats,) in enumerate(run):
                for name, value in draw_stats.items():
                    stats[name][k + i] = value
        k += n
    trace.draw_idx = start + count


def last_stats(runs: list) -> list[dict]:
    """The stats of a batch's last draw in PyMC's form (a list with one dict): what the
    progress bar shows for each of the batch's draws (its stats are cumulative:
    ``divergences``)."""
    last = runs[-1]
    if isinstance(last, dict):
        return [{name: column[-1].item() for name, column in last.items()}]
    return last[-1]


_PYMC_ITER_SAMPLE = mcmc._iter_sample


def _iter_sample(
    *,
    draws: int,
    step: Any,
    start: dict[str, np.ndarray],
    trace: Any,
    chain: int = 0,
    tune: int = 0,
    rng: np.random.Generator,
    model: Any = None,
    callback: Any = None,
) -> Iterator[list[dict[str, Any]]]:
    """PyMC's ``_iter_sample`` (one chain, ``cores=1``): the same stats yielded per draw for
    the progress bar, but where :func:`records_in_batches` holds, each run that
    ``step_run`` serves after tuning is recorded at once (:func:`record_batch`)."""
    if not records_in_batches(step, [trace], callback):
        yield from _PYMC_ITER_SAMPLE(
            draws=draws, step=step, start=start, trace=trace, chain=chain, tune=tune,
            rng=rng, model=model, callback=callback,
        )  # fmt: skip
        return
    draws = int(draws)
    if draws < 1:
        raise ValueError("Argument `draws` must be greater than 0.")
    step.setup_chain(rng, tune, draws - tune)  # as PyMC's: draws includes tuning here
    point = start
    try:
        step.tune = bool(tune)
        step.reset_tuning()
        i = 0
        while i < draws:
            if i == tune:
                step.stop_tuning()
            run = step.step_run(point, draws - i) if i >= tune else None
            if run is None:  # while tuning, and at a chain (re)start
                point, stats = step.step(point)
                trace.record(point, stats, in_warmup=i < tune)
                i += 1
                yield stats
                continue
            point, points, columns = run
            record_batch(trace, points, [columns])
            stats = last_stats([columns])
            n = len(next(iter(points.values())))
            for _ in range(n):
                yield stats
            i += n
    except BaseException:
        trace.close()
        raise
    else:
        trace.close()


def install() -> None:
    """Make ``pm.sample(cores=1)`` record an SG step's runs of draws at once (idempotent);
    every other step method, trace or a callback gets PyMC's loop."""
    mcmc._iter_sample = _iter_sample
