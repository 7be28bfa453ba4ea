"""Engine profile (issue 4): the cost of one integrator step inside a compiled block, the
``cores=2`` speed-up of ``pm.sample`` and the time to the first draw.

Five measurements, each printed as a markdown table (``--output`` also writes them):

* ``steps``: CPU microseconds per integrator step of ``SGMCMC._fill_buffer`` (the compiled
  block plus the NumPy minibatch indices and noise), next to the same block compiled without
  the fused minibatch products (``pymc_sgmcmc.gather_dot``), the same model built in float32,
  the float64 model with its covariates X stored in float32, the index and noise
  generation alone and a hand-written numba SGLD / SGNHT-free reference loop (gather of the
  minibatch rows and two BLAS products, no PyTensor) on the same data (each block with
  ``control_variates=True``: ``control-variates``). CPU time of this process, so that other
  processes on a shared machine inflate it less than wall time
  (they still share the caches and memory bandwidth);
* ``cores``: steady draws/s of ``pm.sample`` with one chain on one core and two chains on
  two cores (wall time: parallelism is the point), for cheap draws (``--thin`` steps at a
  fixed step size) and for the default ``SGLD()`` (adapted step size and thin; a draw is
  then hundreds of steps), alternated twice, with the main
  process's CPU time per draw (with ``cores=2`` it receives and records the draws of both
  chains, a batch at a time);
* ``first-draw``: wall (and CPU) time from constructing the step and calling ``pm.sample``
  to the first stored draw, for a first and a second (warm) call in this process;
* ``per-draw`` (only when named): wall time per stored draw of ``pm.sample`` with the
  package's ``SGMCMC.step`` against PyMC's ``ArrayStepShared.step`` (the per-draw Python
  that serving a point PyMC hands back saves), at thin = 1 and ``--thin``;
* ``control-variates`` (only when named): CPU µs per step of each sampler's block with and
  without ``control_variates=True`` (SGLD and SGNHT, whose force is one single pass over the
  rows, and mCCAdL and NOGIN, whose force and noise come from per-observation gradients), at
  step sizes that keep the chain at its start (stable, no divergence).

Run: ``.venv/bin/python benchmarks/engine.py [steps] [cores] [first-draw] [per-draw]
[control-variates]`` (default: the first three).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from problems import Problem, make_problem  # noqa: E402
from report import machine, script_parser, versions  # noqa: E402

#: Step sizes that keep each problem's chain near its start (stable, no divergence): the
#: cost of a step does not depend on them, as long as the chain stays tame (mCCAdL's C step
#: takes more products in a chain far from equilibrium: at h = 1e-5 from P1's initial point,
#: kinetic temperatures of 1,000-3,300).
STEP_SIZES = {"SGLD": 1e-7, "SGNHT": 1e-4, "MCCAdL": 1e-7, "NOGIN": 1e-7}


def make_step(name: str, thin: int, control_variates: bool = False):
    import pymc_sgmcmc as sg

    cls = getattr(sg, name)
    return cls(step_size=STEP_SIZES[name], thin=thin, control_variates=control_variates)


def cpu_us_per_step(run, steps: int, repeats: int) -> float:
    """Smallest CPU time of ``repeats`` calls of ``run`` (each ``steps`` steps), in µs/step:
    the minimum is the least disturbed by other processes."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return min(times) / steps * 1e6


def block_cost(
    problem: Problem,
    name: str,
    thin: int,
    repeats: int,
    fused: bool = True,
    dtype: str = "float64",
    control_variates: bool = False,
    covariates: str | None = None,
) -> tuple[float, float]:
    """µs/step of ``_fill_buffer`` (block plus index/noise generation) and of the generation
    alone, after a first (compiling) block; ``fused=False`` compiles the block without the
    fused minibatch products (:mod:`pymc_sgmcmc.gather_dot`); ``dtype="float32"`` samples
    the model built in float32 (data, state, noise and arithmetic); ``covariates="float32"``
    only X stored in float32 (a float64 model, which the fused kernels read it into);
    ``control_variates`` adds the anchor's minibatch gradient to each step (the anchor's full
    pass is in the first, untimed block)."""
    import pymc_sgmcmc.base as base

    with problem.model(dtype=dtype, covariates=covariates):
        step = make_step(name, thin, control_variates)
    if not fused:
        original, base.with_gather_dot = base.with_gather_dot, lambda mode: mode
        try:
            step._block_function()
        finally:
            base.with_gather_dot = original
    step.setup_chain(np.random.default_rng(0), tune=0, draws=10**9)
    theta = problem.initial_point()
    step._fill_buffer(theta)
    steps = len(step.buffer["theta"]) * thin
    total = cpu_us_per_step(lambda: step._fill_buffer(theta), steps, repeats)
    rng = np.random.default_rng(1)

    def generate():
        step.sg_model.draw_indices(rng, steps)
        rng.standard_normal((steps, step.noise_vectors, step.dim))

    return total, cpu_us_per_step(generate, steps, repeats)


def reference_loop_cost(problem: Problem, steps: int, repeats: int) -> float | None:
    """µs/step of SGLD written directly in numba for a linear or logistic problem: per step a
    gather X[idx] and two matrix-vector products (BLAS), the floor for this formulation."""
    if problem.kind not in ("linear", "logistic"):
        return None
    import numba

    logistic = problem.kind == "logistic"
    scale, prior_var = problem.n_obs / problem.batch_size, problem.prior_sd**2

    @numba.njit
    def run(X, y, idx, noise, theta, eps):
        for t in range(idx.shape[0]):
            batch = X[idx[t]]
            eta = batch @ theta
            resid = y[idx[t]] - (1.0 / (1.0 + np.exp(-eta)) if logistic else eta)
            force = -theta / prior_var + scale * (batch.T @ resid)
            theta = theta + 0.5 * eps * force + np.sqrt(eps) * noise[t]
        return theta

    rng = np.random.default_rng(0)
    idx = rng.integers(0, problem.n_obs, size=(steps, problem.batch_size))
    noise = rng.standard_normal((steps, problem.dim))
    args = (problem.X, problem.y, idx, noise, problem.initial_point(), STEP_SIZES["SGLD"])
    run(*args)
    return cpu_us_per_step(lambda: run(*args), steps, repeats)


def steps_table(problems: list[str], thin: int, repeats: int) -> list[str]:
    lines = [
        f"CPU µs per integrator step (minimum of {repeats} blocks of 1,000 steps, thin = "
        f"{thin}; SGNHT with h = {STEP_SIZES['SGNHT']:g}, SGLD with eps = "
        f"{STEP_SIZES['SGLD']:g})",
        "",
        "| problem | SGLD block | SGLD block without the fused products | SGNHT block | of which "
        "indices + noise (NumPy) | numba reference SGLD loop (gather + 2 BLAS products, no RNG) "
        "| SGLD block, float32 model | SGNHT block, float32 model | SGLD block, float32 "
        "covariates (float64 model) | SGNHT block, float32 covariates |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in problems:
        problem = make_problem(key)
        sgld, generation = block_cost(problem, "SGLD", thin, repeats)
        unfused, _ = block_cost(problem, "SGLD", thin, repeats, fused=False)
        sgnht, _ = block_cost(problem, "SGNHT", thin, repeats)
        floor = reference_loop_cost(problem, 1000, repeats)
        floor_s = "-" if floor is None else f"{floor:.1f}"
        sgld32, _ = block_cost(problem, "SGLD", thin, repeats, dtype="float32")
        sgnht32, _ = block_cost(problem, "SGNHT", thin, repeats, dtype="float32")
        sgld_x32, _ = block_cost(problem, "SGLD", thin, repeats, covariates="float32")
        sgnht_x32, _ = block_cost(problem, "SGNHT", thin, repeats, covariates="float32")
        lines.append(
            f"| {key} | {sgld:.1f} | {unfused:.1f} | {sgnht:.1f} | {generation:.1f} | {floor_s} "
            f"| {sgld32:.1f} | {sgnht32:.1f} | {sgld_x32:.1f} | {sgnht_x32:.1f} |"
        )
        print(lines[-1], flush=True)
    return lines


def control_variates_table(problems: list[str], thin: int, repeats: int) -> list[str]:
    """Each sampler's block with and without control variates (:func:`block_cost`)."""
    lines = [
        f"CPU µs per integrator step with and without `control_variates=True` (minimum of "
        f"{repeats} blocks of 1,000 steps, thin = {thin}; step sizes "
        + ", ".join(f"{name} {h:g}" for name, h in STEP_SIZES.items())
        + ")",
        "",
        "| problem | sampler | block | with control variates | ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key in problems:
        problem = make_problem(key)
        for name in STEP_SIZES:
            plain, _ = block_cost(problem, name, thin, repeats)
            controlled, _ = block_cost(problem, name, thin, repeats, control_variates=True)
            lines.append(
                f"| {key} | {name} | {plain:.1f} | {controlled:.1f} | {controlled / plain:.2f} |"
            )
            print(lines[-1], flush=True)
    return lines


@contextmanager
def recorded_draws(records: list[tuple[int, int, float, float, list[int]]]):
    """Each draw or run of draws as the main process records it into the trace: (chain,
    index of its first draw in the trace, wall time, this process's CPU time, each draw's
    thin). ``NDArray.record`` is PyMC's per draw; :func:`pymc_sgmcmc.recording.record_batch`
    takes a run (``cores=1``) or a worker's batch (``cores > 1``) at once. Timed where the
    draws are recorded, not in a ``pm.sample`` callback: under a callback, which takes every
    draw, ``pm.sample`` records draw by draw."""
    from pymc.backends.ndarray import NDArray

    import pymc_sgmcmc.recording as recording

    record, record_batch = NDArray.record, recording.record_batch

    def timed_record(trace, point, sampler_stats=None, *, in_warmup):
        record(trace, point, sampler_stats, in_warmup=in_warmup)
        now = (time.perf_counter(), time.process_time())
        records.append((trace.chain, trace.draw_idx - 1, *now, [sampler_stats[0]["thin"]]))

    def timed_batch(trace, points, runs):
        record_batch(trace, points, runs)
        now = (time.perf_counter(), time.process_time())
        thins = []
        for run in runs:
            thins += run["thin"].tolist() if isinstance(run, dict) else [s["thin"] for (s,) in run]
        records.append((trace.chain, trace.draw_idx - len(thins), *now, thins))

    NDArray.record, recording.record_batch = timed_record, timed_batch
    try:
        yield
    finally:
        NDArray.record, recording.record_batch = record, record_batch


def draws_per_second(
    problem: Problem,
    chains: int,
    cores: int,
    thin: int | None,
    draws: int,
    draw_by_draw: bool = False,
) -> tuple[float, float, float, list[int]]:
    """Steady draws/s and integrator steps/s of all chains together, this (main) process's
    CPU µs per draw, and the thins seen: while every chain delivers, from the latest of the
    chains' quarter marks of their stored draws (every worker has compiled and served its
    first block) to the earliest of their last draws; the workers start, compile and finish
    at different times, and a window over all draws would mix in spans where only one chain
    runs. ``thin`` None: the default sampler (``SGLD()``: step size adapted in
    :data:`DEFAULT_TUNE` tuning draws, thin = its relaxation time, which can differ between
    chains); tuning draws are not counted. With cores > 1 the main process receives every
    draw through a pipe and records it, for all chains (a batch at a time: a draw counts as
    recorded when its batch is). ``draw_by_draw``: a callback that does nothing, under which
    ``pm.sample`` records each draw through PyMC's loop (``step`` once per draw) instead of
    each run of draws at once (:mod:`pymc_sgmcmc.recording`)."""
    import pymc as pm

    import pymc_sgmcmc as sg

    records: list[tuple[int, int, float, float, list[int]]] = []
    tune = 0 if thin is not None else DEFAULT_TUNE
    with problem.model(), recorded_draws(records):
        pm.sample(
            draws=draws,
            tune=tune,
            step=make_step("SGLD", thin) if thin is not None else sg.SGLD(),
            chains=chains,
            cores=cores,
            random_seed=1,
            progressbar=False,
            compute_convergence_checks=False,
            discard_tuned_samples=True,
            callback=(lambda trace, draw: None) if draw_by_draw else None,
        )
    # One row per kept draw, at the time its batch was recorded.
    chain, wall, cpu, thins = (
        np.asarray(column)
        for column in zip(
            *(
                (c, w, p, t)
                for c, first, w, p, batch in records
                for k, t in enumerate(batch)
                if first + k >= tune
            ),
            strict=True,
        )
    )
    per_chain = [wall[chain == c] for c in range(chains)]
    start = max(times[len(times) // 4] for times in per_chain)
    end = min(times[-1] for times in per_chain)
    window = (wall > start) & (wall <= end)
    if not window.any():
        raise RuntimeError(
            f"the {chains} chains never delivered draws at the same time (one ended before "
            "another had stored a quarter of its draws): give them more draws"
        )
    # The CPU time is read when a batch is recorded: from the batch before the window's
    # first to the window's last.
    first, last = np.flatnonzero(window)[[0, -1]]
    before = cpu[wall < wall[first]]
    n = int(window.sum())
    return (
        n / (end - start),
        thins[window].sum() / (end - start),
        (cpu[last] - (before[-1] if len(before) else cpu[first])) / n * 1e6,
        sorted(set(thins.tolist())),
    )


#: Tuning draws of the default configuration in ``cores`` (its adaptation needs about 500).
DEFAULT_TUNE = 1000


def cores_table(
    key: str, thin: int, draws: int, default_draws: int
) -> tuple[list[str], list[float]]:
    """``cores=2`` against ``cores=1`` for the cheapest draws (thin = 1, the default with a
    given step size), for cheap draws (``thin`` steps of a fixed step size) and for the
    default ``SGLD()`` (adapted step size, thin = relaxation time), alternated, two runs
    each: the table and its ratios. The ratio is of integrator steps/s: with the defaults
    each chain adapts its own thin. At thin = 1 each chain makes ``draws * thin`` draws, as
    many steps as at ``thin``: a few seconds, against a fraction of one, so that the
    steady window is not a few of the workers' batches."""
    problem = make_problem(key)
    lines = [
        f"{key} SGLD: steady draws/s and steps/s of all chains while all deliver (wall time), "
        "the main process's CPU per draw, and the thins; "
        f"thin = 1: {draws * thin} and thin = {thin}: {draws} draws per chain at eps = "
        f"{STEP_SIZES['SGLD']:g}; default: `SGLD()`, {DEFAULT_TUNE} tuning + {default_draws} "
        "draws per chain",
        "",
        "| configuration | run | cores=1, 1 chain: draws/s, steps/s (main CPU µs/draw; thin) "
        "| cores=2, 2 chains | ratio of steps/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    configurations = [
        ("thin = 1", 1, draws * thin),
        (f"thin = {thin}", thin, draws),
        ("default", None, default_draws),
    ]
    ratios = []
    for label, config, n in configurations:
        for run in (1, 2):
            cells, rates = [], []
            for chains in (1, 2):
                per_draw, per_step, cpu, thins = draws_per_second(
                    problem, chains, chains, config, n
                )
                thin_s = "/".join(map(str, thins))
                cells.append(f"{per_draw:,.1f}, {per_step:,.0f} ({cpu:.0f}; {thin_s})")
                rates.append(per_step)
            ratios.append(rates[1] / rates[0])
            lines.append(f"| {label} | {run} | {cells[0]} | {cells[1]} | {ratios[-1]:.2f} |")
            print(lines[-1], flush=True)
    return lines, ratios


@contextmanager
def pymc_round_trip():
    """``SGMCMC.step`` replaced by PyMC's ``ArrayStepShared.step``, which ravels every point
    it is handed and splits every draw into a new dict (the baseline of ``per-draw``)."""
    from pymc.step_methods.arraystep import ArrayStepShared

    from pymc_sgmcmc.base import SGMCMC

    served = SGMCMC.__dict__["step"]
    SGMCMC.step = ArrayStepShared.step
    try:
        yield
    finally:
        SGMCMC.step = served


def per_draw_table(problems: list[str], thin: int, draws: int, rounds: int = 3) -> list[str]:
    """Wall µs per stored draw of ``pm.sample`` (one chain, SGLD with a fixed step size) with
    the package's ``SGMCMC.step``, which serves a point PyMC hands back without PyMC's
    dict / array round trip, and with PyMC's ``ArrayStepShared.step``: alternated
    ``rounds`` times, medians. Everything else per draw (PyMC's loop, its trace's recording
    function, the stats) is the same on both sides. Both run PyMC's loop draw by draw (a
    callback): without one ``pm.sample`` records each run of draws at once, calling ``step``
    only while tuning."""
    lines = [
        f"Wall µs per stored draw of `pm.sample` (1 chain, {draws} draws, SGLD at eps = "
        f"{STEP_SIZES['SGLD']:g}; steady state over the last three quarters), with "
        "`SGMCMC.step` (a point handed back is served without PyMC's dict / array round "
        f"trip) and with PyMC's `ArrayStepShared.step`; medians of {rounds} alternated rounds "
        "(range)",
        "",
        "| problem | thin | PyMC's `ArrayStepShared.step` | `SGMCMC.step` | draws/s ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key in problems:
        problem = make_problem(key)
        for t in (1, thin):
            ours, pymcs = [], []
            for _ in range(rounds):
                with pymc_round_trip():
                    pymcs.append(1e6 / draws_per_second(problem, 1, 1, t, draws, True)[0])
                ours.append(1e6 / draws_per_second(problem, 1, 1, t, draws, True)[0])
            cells = [f"{np.median(x):,.1f} ({min(x):,.1f}-{max(x):,.1f})" for x in (pymcs, ours)]
            ratio = np.median(pymcs) / np.median(ours)
            lines.append(f"| {key} | {t} | {cells[0]} | {cells[1]} | {ratio:.2f} |")
            print(lines[-1], flush=True)
    return lines


def first_draw_table(problems: list[str]) -> list[str]:
    """Step construction + ``pm.sample`` to the first stored draw, wall and CPU seconds, for a
    first call and a second (warm) one in this process."""
    import pymc as pm

    lines = [
        "Seconds from constructing the step to the first stored draw of `pm.sample`, wall "
        "(CPU of this process); warm: a second call in this process (numba cache, PyTensor's "
        "compile directory and imports warm)",
        "",
        "| problem | sampler | first call | warm |",
        "| --- | --- | --- | --- |",
    ]
    for key in problems:
        problem = make_problem(key)
        for name in ("SGLD", "SGNHT"):
            cells = []
            for _ in range(2):
                times: list[tuple[float, float]] = []

                def record(trace, draw, times=times):
                    times.append((time.perf_counter(), time.process_time()))

                with problem.model():
                    start = (time.perf_counter(), time.process_time())
                    pm.sample(
                        draws=1,
                        tune=0,
                        step=make_step(name, 10),
                        chains=1,
                        random_seed=1,
                        progressbar=False,
                        compute_convergence_checks=False,
                        callback=record,
                    )
                wall, cpu = (times[0][k] - start[k] for k in (0, 1))
                cells.append(f"{wall:.2f} ({cpu:.2f})")
            lines.append(f"| {key} | {name} | {cells[0]} | {cells[1]} |")
            print(lines[-1], flush=True)
    return lines


def main(argv: list[str]) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("what", nargs="*", default=["steps", "cores", "first-draw"])
    parser.add_argument("--problems", nargs="+", default=["P1", "P3"])
    parser.add_argument("--thin", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--draws", type=int, default=20000, help="per chain, for 'cores'")
    parser.add_argument(
        "--default-draws", type=int, default=1000, help="per chain, for 'cores' at the defaults"
    )
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.getLogger("pymc").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    loads = [os.getloadavg()]
    sections = []
    if "steps" in args.what:
        sections.append(steps_table(args.problems, args.thin, args.repeats))
    if "cores" in args.what:
        sections.append(cores_table(args.problems[0], args.thin, args.draws, args.default_draws)[0])
    if "first-draw" in args.what:
        sections.append(first_draw_table(args.problems))
    if "per-draw" in args.what:
        sections.append(per_draw_table(args.problems, args.thin, args.draws))
    if "control-variates" in args.what:
        sections.append(control_variates_table(args.problems, args.thin, args.repeats))
    loads.append(os.getloadavg())
    cpu = machine()
    header = [
        f"# Engine profile (`benchmarks/engine.py {' '.join(argv)}`)",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; {os.cpu_count()} cores; load average "
        f"(1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in loads[0])}, after "
        f"{', '.join(f'{x:.2f}' for x in loads[1])}",
        f"- machine: {cpu['cpu']}, {cpu['platform']}",
        "- versions: " + ", ".join(f"{name} {v}" for name, v in versions().items()),
        "",
    ]
    text = "\n".join(header + [line for s in sections for line in [*s, ""]])
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
