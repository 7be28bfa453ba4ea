"""How far sane chains' minibatch log-densities stray below their typical value, in the units of
the runaway check (``pymc_sgmcmc.runaway``): the calibration of ``SPREADS`` and ``EXTREME``.

Each case runs one chain of 20,000 kept steps (``thin=1``, default step size after 500 tuning
draws, started at the posterior mean, or for the logistic regression at the generating
weights) and replays the check in 1,000-step blocks on the series it follows (the recorded
minibatch log-densities, less the kinetic energy's excess for SGNHT and NOGIN:
``runaway.checked_series``): the largest
deficit of the running median below the typical value in spreads (allowed: ``SPREADS``), and
of a single step in margins (allowed: ``EXTREME``), over all blocks after the first. Replayed
on every step (a chain with ``thin=1``) and on every ``STRIDE``-th step (what the check reads
once ``thin >= STRIDE``).

Run: ``python benchmarks/runaway_calibration.py [--output FILE]`` (about 3 minutes).
"""

from __future__ import annotations

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import numpy as np
import pymc as pm
from problems import make_problem, reference
from report import header, output_path, write

import pymc_sgmcmc as sg
from pymc_sgmcmc import runaway

BLOCK = 1000
DRAWS = 20_000
SAMPLE_KWARGS = dict(tune=500, draws=DRAWS, chains=1, progressbar=False, random_seed=1)


def replay(logps: np.ndarray, stride: int = 1) -> tuple[float, float, int]:
    """(largest running-median deficit in spreads, largest single-step deficit in margins,
    blocks the check flags), over the blocks after the first, reading every ``stride``-th
    step."""
    logps, block_size = logps[stride - 1 :: stride], BLOCK // stride
    typical, spreads, history = None, [], np.zeros(0)
    worst_median = worst_single = 0.0
    flagged = 0
    for start in range(0, len(logps) - block_size + 1, block_size):
        block = logps[start : start + block_size]
        medians = runaway.running_medians(block, history)
        if spreads:
            margin = runaway.margin(typical, spreads)
            worst_median = max(worst_median, (typical - medians.min()) / np.median(spreads))
            worst_single = max(worst_single, (typical - block.min()) / margin)
            flagged += int(runaway.runaway_flags(block, medians, typical, spreads).any())
        typical = runaway.updated_reference(typical, spreads, block, medians)
        history = runaway.trailing_history(history, block)
    return worst_median, worst_single, flagged


def logistic_model(batch_size: int, seed: int = 0) -> tuple[pm.Model, np.ndarray]:
    """The synthetic logistic regression of ``tests/test_engine.py`` (N = 30,000, D = 20)."""
    rng = np.random.default_rng(seed)
    n_obs, dim = 30_000, 20
    X = rng.standard_normal((n_obs, dim))
    w_true = rng.standard_normal(dim)
    y = (rng.random(n_obs) < 1 / (1 + np.exp(-X @ w_true))).astype(float)
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=batch_size)
        w = pm.Normal("w", 0, 1, shape=dim)
        pm.Bernoulli("y", logit_p=X_mb @ w, observed=y_mb, total_size=n_obs)
    return model, w_true


def cases():
    """(label, model, initial values, samplers) of every case."""
    for batch_size in (1, 10):
        model, w_true = logistic_model(batch_size)
        samplers = (sg.SGLD, sg.SGNHT) + ((sg.NOGIN,) if batch_size > 1 else ())
        yield f"logistic N = 30,000, n = {batch_size}", model, {"w": w_true}, samplers
    for key in ("P1", "P2", "P4"):
        problem = make_problem(key)
        initvals = None if key == "P2" else {"w": reference(problem, allow_nuts=False)[0].mean}
        yield key, problem.model(), initvals, (sg.SGLD, sg.SGNHT, sg.NOGIN)


def main() -> None:
    output = output_path(__doc__)
    lines = [
        *header("Runaway-check calibration (`benchmarks/runaway_calibration.py`)"),
        f"- allowed: running median {runaway.SPREADS:g} spreads, single step "
        f"{runaway.EXTREME:g} margins; {DRAWS:,} kept steps per chain, {BLOCK:,}-step blocks",
        "",
        f"Each cell: every step / every {runaway.STRIDE}th step.",
        "",
        "| case | sampler | worst running-median deficit (spreads) | worst single step "
        "(margins) | blocks flagged | sampler's diverging draws |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, model, initvals, samplers in cases():
        for cls in samplers:
            with model:
                step = cls(thin=1)
                idata = pm.sample(
                    step=step, initvals=initvals, compute_convergence_checks=False,
                    **SAMPLE_KWARGS,
                )  # fmt: skip
            stats = idata.sample_stats
            temperatures = (
                stats["kinetic_temperature"].values[0] if "kinetic_temperature" in stats else None
            )
            series = runaway.checked_series(
                stats["minibatch_logp"].values[0], temperatures, step.dim
            )
            (m1, s1, f1), (m10, s10, f10) = replay(series), replay(series, runaway.STRIDE)
            diverging = int(stats["diverging"].sum())
            lines.append(
                f"| {label} | {cls.__name__} | {m1:.1f} / {m10:.1f} | {s1:.2f} / {s10:.2f} | "
                f"{f1} / {f10} | {diverging} |"
            )
            print(lines[-1], flush=True)
    write(lines, output)


if __name__ == "__main__":
    main()
