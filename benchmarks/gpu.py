"""The JAX backend on an accelerator against the default (numba) backend on the same machine.

Three problems: P1 (linear regression, N = 10,000, D = 100, n = 500), "P1x10" (the same
with N = 100,000, D = 1,000, n = 2,000: 10x the columns, 4x the minibatch, the scale at which
an accelerator has work to do) and P4 (logistic regression, N = 10^6, D = 50, n = 1,000). For
each sampler it times the first block (graph build, compile and the block's steps) and the
steady cost of a block (``SGMCMC._fill_buffer``: the compiled block plus the host's minibatch
indices and noise), as wall time, the median of ``--repeats`` fills, with the host's share
(drawing the indices and the noise) timed apart. The JAX part also times, for SGLD,

* ``per-call data``: the data handed to the jitted function at each call as NumPy arrays,
  which is what PyTensor does with a shared variable (``jax_compile.DeviceData`` keeps them
  on the device instead), and
* ``float32``: the model built under ``floatX = "float32"``,

and for mCCAdL and NOGIN ``previous kernels``: the Krylov kernels as they were before the
latest change, :func:`previous_krylov_kernels` (``benchmarks/jax_krylov.py`` times the
kernels alone),

and both parts run ``pm.sample`` end to end (by default SGLD and mCCAdL with their defaults on
P1, 1,000 tuning draws and 1,000 draws; ``--end-to-end-problem P1x10`` runs them at D = 1,000),
checking the posterior against the exact one; the two backends' draws are compared too (they
start from the same seed).

Each part runs in its own process, so on a GPU machine both run at once (the JAX part keeps
one CPU core busy, the numba part the others)::

    python benchmarks/gpu.py jax   --out DIR     # mode="JAX": on the GPU when JAX sees one
    python benchmarks/gpu.py numba --out DIR     # the default backend, on the CPU
    python benchmarks/gpu.py report DIR [--output benchmarks/gpu_results.md]

``--quick`` shrinks the problems (a dry run on a machine without a GPU); ``--problems``,
``--samplers``, ``--end-to-end`` and ``--end-to-end-problem`` choose what runs, and
``--no-variants`` times the float64 form alone.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from report import machine, script_parser, versions  # noqa: E402

SAMPLERS = ("SGLD", "SGNHT", "mCCAdL", "NOGIN")
#: (problem, samplers) measured in both parts.
PLAN = (("P1", SAMPLERS), ("P1x10", SAMPLERS), ("P4", ("SGLD", "SGNHT")))
#: Stop starting new measurements after this many seconds (the device lease is short).
BUDGET_S = 300.0


# ---------------------------------------------------------------------- problems
class Setup:
    """A problem's model factory, starting point and step sizes: h = 0.1 / sqrt(largest
    curvature), SGLD's eps = h^2, far inside the stable range, so no timed block diverges."""

    def __init__(self, key: str, quick: bool):
        from models import GaussianRegression
        from problems import make_problem

        if key == "P4":
            problem = make_problem("P4")
            if quick:
                problem.X, problem.y = problem.X[:20_000], problem.y[:20_000]
            self.model = lambda dtype="float64": problem.model(dtype=dtype)
            self.start = np.zeros(problem.dim)
            # At most 1/4 of X^T X's largest eigenvalue, N (1 + sqrt(D / N))^2 for these
            # standard-normal features (Marchenko-Pastur edge).
            curvature = 0.25 * len(problem.y) * (1 + np.sqrt(problem.dim / len(problem.y))) ** 2
            self.exact = None
        else:
            n_obs, dim, batch = (10_000, 100, 500) if key == "P1" else (100_000, 1_000, 2_000)
            if quick and key != "P1":
                n_obs, dim, batch = 10_000, 200, 400
            problem = GaussianRegression.make(
                n_obs=n_obs, dim=dim, batch_size=batch, prior_sd=np.sqrt(10)
            )
            precision = problem.precision
            curvature = float(np.linalg.eigvalsh(precision)[-1])
            self.start = problem.mean
            self.model = lambda dtype="float64": replace(problem, dtype=dtype).model()
            self.exact = (self.start, np.diag(np.linalg.inv(precision)))
        self.h = 0.1 / np.sqrt(curvature)

    def step(self, name: str, mode: str | None, block_steps: int = 1000, thin: int = 10):
        import pymc_sgmcmc as sg

        common = dict(mode=mode, block_steps=block_steps, thin=thin)
        if name == "SGLD":
            return sg.SGLD(step_size=self.h**2, **common)
        cls = {"SGNHT": sg.SGNHT, "mCCAdL": sg.MCCAdL, "NOGIN": sg.NOGIN}[name]
        return cls(step_size=self.h, friction=1.0, **common)


# ---------------------------------------------------------------------- measurements
def block_timing(step, start: np.ndarray, repeats: int) -> dict:
    """Wall seconds of the first fill (compile included), and the median µs per step of the
    next ``repeats`` fills and of their host share (the indices and the noise alone)."""
    step.setup_chain(np.random.default_rng(0), tune=0, draws=10**9)
    t0 = time.perf_counter()
    step._fill_buffer(start)
    first = time.perf_counter() - t0
    steps = len(step.buffer["theta"]) * step.thin
    fills, host = [], []
    rng = np.random.default_rng(1)
    for _ in range(repeats):
        t0 = time.perf_counter()
        step._fill_buffer(start)
        fills.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        step.sg_model.draw_indices(rng, steps)
        rng.standard_normal((steps, step.noise_vectors, step.dim), dtype=step.dtype)
        host.append(time.perf_counter() - t0)
    return {
        "first_block_s": first,
        "us_per_step": statistics.median(fills) / steps * 1e6,
        "host_us_per_step": statistics.median(host) / steps * 1e6,
        "steps_per_fill": steps,
        "diverged": bool(step.buffer["diverging"].any()),
    }


@contextmanager
def data_passed_at_each_call():
    """What PyTensor does with shared data under JAX: the NumPy arrays go to the jitted
    function at every call (and so to the device)."""
    from pymc_sgmcmc.jax_compile import DeviceData

    def host_refresh(self):
        for original, copy in self.givens:
            copy.container.storage[0] = original.get_value(borrow=True)

    kept = DeviceData.refresh
    DeviceData.refresh = host_refresh
    try:
        yield
    finally:
        DeviceData.refresh = kept


@contextmanager
def previous_krylov_kernels():
    """The JAX Krylov kernels as they were before the latest change (run 3 of
    ``gpu_results.md``): the Taylor series of exp(-t T) e_1 in one substep only, so a
    shifted T wider than its radius takes the eigen-decomposition (the constant is read when
    a block is traced)."""
    from pymc_sgmcmc import jax_compile

    kept = jax_compile.TAYLOR_SUBSTEPS
    jax_compile.TAYLOR_SUBSTEPS = (1,)
    try:
        yield
    finally:
        jax_compile.TAYLOR_SUBSTEPS = kept


END_TO_END = {"SGLD": "SGLD", "SGNHT": "SGNHT", "mCCAdL": "MCCAdL", "NOGIN": "NOGIN"}


def end_to_end(setup: Setup, name: str, mode: str | None) -> tuple[dict, np.ndarray]:
    """``pm.sample`` as a user runs it (the sampler's defaults: step size and thin adapted
    during tuning, from PyMC's initial point): wall time and the posterior's errors."""
    import pymc as pm

    import pymc_sgmcmc as sg

    with setup.model(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        step = getattr(sg, END_TO_END[name])(mode=mode)
        t0 = time.perf_counter()
        idata = pm.sample(
            tune=1000,
            draws=1000,
            step=step,
            chains=1,
            random_seed=1,
            progressbar=False,
            compute_convergence_checks=False,
        )
        wall = time.perf_counter() - t0
    draws = np.asarray(idata.posterior["w"].values[0])
    mean, var = setup.exact
    return {
        "wall_s": wall,
        "thin": int(step.thin),
        "step_size": float(step.step_size),
        "mean_error_sd": float(np.max(np.abs(draws.mean(0) - mean) / np.sqrt(var))),
        "var_ratio": float(np.median(draws.var(0) / var)),
        "diverging": int(idata.sample_stats["diverging"].values.sum()),
        "warnings": [str(w.message)[:160] for w in caught if "pymc_sgmcmc" in w.filename],
    }, draws


def environment() -> dict:
    """Date, machine and versions (``report``'s, as every results file has them), and the GPU."""
    env = {"date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC", **machine(), **versions()}
    try:
        smi = [
            "nvidia-smi",
            "--query-gpu=name,memory.total,driver_version",
            "--format=csv,noheader",
        ]
        env["gpu"] = subprocess.run(smi, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["gpu"] = "none"
    return env


def run_part(
    part: str,
    out: Path,
    quick: bool,
    repeats: int,
    problems: list[str],
    samplers: list[str],
    end_to_end_samplers: list[str],
    end_to_end_problem: str = "P1",
    extra_variants: bool = True,
) -> None:
    import pymc as pm  # noqa: F401  (before the clock starts)

    mode = "JAX" if part == "jax" else None
    log = (out / f"{part}.jsonl").open("w")

    def record(**row) -> None:
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    env = environment()
    if mode:
        import jax

        env["jax_devices"] = ", ".join(str(d) for d in jax.devices())
    record(kind="environment", part=part, **env)
    started = time.perf_counter()
    for key, names in PLAN:
        if key not in problems:
            continue
        setup = Setup(key, quick)
        big = key == "P1x10"
        for name in (n for n in names if n in samplers):
            variants = [("float64", None)]
            if mode and extra_variants and name == "SGLD":
                variants += [("per-call data", data_passed_at_each_call), ("float32", None)]
            if mode and extra_variants and name in ("mCCAdL", "NOGIN"):
                variants += [("previous kernels", previous_krylov_kernels)]
            for variant, context in variants:
                if time.perf_counter() - started > BUDGET_S:
                    record(kind="skipped", problem=key, sampler=name, variant=variant)
                    continue
                # The CPU's large blocks would take minutes: 100 steps there.
                block = 100 if (big and not mode) else 1000
                thin = 10 if block == 1000 else 1
                try:
                    dtype = "float32" if variant == "float32" else "float64"
                    with context() if context else nullcontext():
                        with setup.model(dtype):
                            step = setup.step(name, mode, block_steps=block, thin=thin)
                        row = block_timing(step, setup.start, repeats)
                except Exception as exc:  # a report, not a test: record it and go on
                    row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                record(kind="block", part=part, problem=key, sampler=name, variant=variant, **row)
    setup = Setup(end_to_end_problem, quick)
    draws = {}
    for name in end_to_end_samplers:
        try:
            row, draws[name] = end_to_end(setup, name, mode)
        except Exception as exc:
            row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        record(kind="pm.sample", part=part, problem=end_to_end_problem, sampler=name, **row)
        np.savez(out / f"draws_{part}.npz", **draws)
    record(kind="done", part=part, elapsed_s=time.perf_counter() - started)


# ---------------------------------------------------------------------- report
def report(folder: Path) -> list[str]:
    rows = [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.open()]
    envs = {r["part"]: r for r in rows if r["kind"] == "environment"}
    blocks = {
        (r["problem"], r["sampler"], r["variant"], r["part"]): r
        for r in rows
        if r["kind"] == "block"
    }
    lines = ["# The JAX backend on a GPU (`benchmarks/gpu.py`)", ""]
    for part, env in envs.items():
        described = ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("kind", "part"))
        lines.append(f"- {part} part: {described}")
    lines += [
        "",
        "Steady µs per step: the median of the timed block fills (wall time: the compiled block "
        "and the host's indices and noise); host: the indices and noise alone. First block: "
        "graph build, compilation and one block. Ratio: numba's µs per step over JAX's (above "
        "1: the GPU is faster).",
        "",
        "| problem | sampler | variant | JAX µs/step (host) | numba µs/step (host) | ratio | "
        "JAX first block s | numba first block s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cell(row, key, fmt):
        if row is None:
            return "-"
        if "error" in row:
            return "error"
        return format(row[key], fmt)

    for key, names in PLAN:
        for name in names:
            for variant in ("float64", "per-call data", "float32", "previous kernels"):
                jax_row = blocks.get((key, name, variant, "jax"))
                cpu_row = blocks.get((key, name, "float64", "numba"))
                if jax_row is None:
                    continue
                ratio = "-"
                if jax_row and cpu_row and "error" not in jax_row and "error" not in cpu_row:
                    ratio = f"{cpu_row['us_per_step'] / jax_row['us_per_step']:.2f}"
                jax_cell = f"{cell(jax_row, 'us_per_step', '.1f')} "
                jax_cell += f"({cell(jax_row, 'host_us_per_step', '.1f')})"
                cpu_cell = (
                    ""
                    if variant != "float64"
                    else (
                        f"{cell(cpu_row, 'us_per_step', '.1f')} "
                        f"({cell(cpu_row, 'host_us_per_step', '.1f')})"
                    )
                )
                cpu_first = cell(cpu_row, "first_block_s", ".1f") if variant == "float64" else ""
                lines.append(
                    f"| {key} | {name} | {variant} | {jax_cell} | {cpu_cell} | "
                    f"{ratio if variant == 'float64' else ''} | "
                    f"{cell(jax_row, 'first_block_s', '.1f')} | {cpu_first} |"
                )
    errors = [r for r in rows if "error" in r]
    for r in errors:
        lines.append(f"- error, {r['part']} {r['problem']} {r['sampler']}: {r['error']}")
    lines += [
        "",
        "`pm.sample` (the samplers' defaults, 1,000 tuning draws, 1,000 draws, one chain, "
        "seed 1; wall time includes compilation; thin: the adapted steps per draw; errors "
        "against the exact posterior: largest |mean error| / sd, median variance ratio):",
        "",
        "| problem | sampler | part | wall s | thin | mean error (sd) | variance ratio | "
        "divergent draws |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["kind"] == "pm.sample" and "error" not in r:
            lines.append(
                f"| {r['problem']} | {r['sampler']} | {r['part']} | {r['wall_s']:.1f} | "
                f"{r.get('thin', '-')} | {r['mean_error_sd']:.3f} | {r['var_ratio']:.3f} | "
                f"{r['diverging']} |"
            )
    a, b = folder / "draws_jax.npz", folder / "draws_numba.npz"
    if a.exists() and b.exists():
        with np.load(a) as on_jax, np.load(b) as on_numba:
            for name in sorted(set(on_jax.files) & set(on_numba.files)):
                diff = np.max(np.abs(on_jax[name] - on_numba[name]))
                lines.append(f"- {name}: largest difference between the backends' draws {diff:.2e}")
    return lines


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("part", choices=("jax", "numba", "report"))
    parser.add_argument("folder", nargs="?", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--problems", nargs="+", default=[key for key, _ in PLAN])
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS))
    parser.add_argument(
        "--end-to-end", nargs="*", default=["SGLD", "mCCAdL"], choices=list(END_TO_END)
    )
    parser.add_argument("--end-to-end-problem", default="P1", choices=["P1", "P1x10"])
    parser.add_argument("--no-variants", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.part == "report":
        text = "\n".join(report(args.folder or args.out)) + "\n"
        print(text)
        if args.output:
            args.output.write_text(text)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    run_part(
        args.part,
        args.out,
        args.quick,
        args.repeats,
        args.problems,
        args.samplers,
        args.end_to_end,
        args.end_to_end_problem,
        not args.no_variants,
    )


if __name__ == "__main__":
    main()
