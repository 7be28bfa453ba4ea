"""The performance targets of issue 4, each measured in this one run, in one table.

1. Steady-state steps/s inside ``pm.sample`` of SGLD and SGNHT (thin = 10, about 7 s each)
   against BlackJAX's SGLD / SGNHT in a ``lax.scan`` and a hand-written NumPy SGLD, on P1 and
   P3 (``suite.py``'s runs: same problems, step sizes, seeds and clock), in three rounds; the
   ratios are medians over the rounds of ratios measured within a round.
2. CPU time per step of the covariance samplers' default (low-rank) paths against SGLD's at
   D = 100, n = 500 (``covariance.py``'s measurement), and of the periodically updated average
   of Sigma (not a default: see the guide).
3. Time from the step's construction to the first stored draw of SGLD on P1 in a fresh
   process, with empty compile caches ("cold") and then with the ones it filled ("warm"), in
   three rounds (medians).
4. P4 (N = 10^6): wall time to the accuracy criterion (means within 0.1 posterior sd,
   variances within 10 %) of ``pm.sample(step=Sampler(control_variates=True))`` with every
   other argument at its default, in a fresh process with empty compile caches and again with
   warm ones, against NUTS on the full data, projected from a short run
   (``suite.run_nuts_projected``: the full run takes about 15-30 minutes here): PyMC's own
   NUTS and nutpie, which ``pm.sample`` runs by default where it is installed (the ``bench``
   extra installs it). The target is judged against the default.
5. Steps/s of two chains with ``cores=2`` against one chain with ``cores=1`` (SGLD on P1 at
   thin = 1, thin = 10 and the defaults, two runs each; ``engine.py cores``'s measurement, in
   a fresh process).

Writes ``benchmarks/criteria_results.md``: the targets with the measured values, then each
section's rows. Run on a quiet machine: ``make bench-criteria`` (about 15 minutes; BlackJAX's
rows need the ``bench`` extra, which the target installs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import control_variates  # noqa: E402
import covariance  # noqa: E402
import suite  # noqa: E402
from compile_caches import compile_cache_env  # noqa: E402
from engine import cores_table  # noqa: E402
from problems import make_problem, reference  # noqa: E402
from report import child_result, header, load_average, script_parser  # noqa: E402

#: ``suite.py``'s command line for section 1.
SUITE_ARGUMENTS = "--problems P1 P3 --samplers SGLD SGNHT --baselines numpy blackjax --cold none"
#: Section 1's rounds, and each run's length in seconds in a round.
RATE_ROUNDS, RATE_BUDGET_S = 3, 7.0
#: Rounds of the cold and warm first draw (each a fresh compile directory).
FIRST_DRAW_ROUNDS = 3
#: The covariance samplers at their defaults (low-rank Sigma: mCCAdL's Lanczos C step,
#: NOGIN's conjugate gradients at D = 100), then with the periodic average.
COVARIANCE_DEFAULTS = [("mCCAdL", "mCCAdL", {}), ("NOGIN", "NOGIN", {})]
COVARIANCE_PERIODIC = [
    (f"{name}, average 0.1 updated every 300 steps", name, covariance.periodic(300))
    for name in ("mCCAdL", "NOGIN")
]
P4_SAMPLERS = ("SGLD", "SGNHT", "NOGIN")
#: A row of the summary: (target, wanted, measured, met; None where nothing could be measured).
Target = tuple[str, str, str, bool | None]


def ratio_cell(values: list[float], target: float, above: bool = True) -> tuple[str, bool]:
    """The ratios as a cell, and whether all are at least (``above``) or at most ``target``."""
    cells = " / ".join(f"{v:.2f}" for v in values)
    return cells, all(v >= target if above else v <= target for v in values)


def sampler_rates(lines: list[str]) -> list[Target]:
    """Section 1: SGLD and SGNHT against BlackJAX and NumPy on P1 and P3, in
    :data:`RATE_ROUNDS` rounds that alternate the problems; each target is the median over the
    rounds of the ratio measured within one round."""
    cfg, _ = suite.parse_args([*SUITE_ARGUMENTS.split(), "--budget", str(RATE_BUDGET_S)])
    methods = ("SGLD", "SGNHT", "BlackJAX SGLD", "BlackJAX SGNHT", "NumPy SGLD")
    lines += [
        "## 1. Steps/s inside `pm.sample` against BlackJAX and NumPy",
        "",
        f"`suite.py`'s runs: one chain, thin = {cfg.thin}, about {cfg.budget_s:g} s each, "
        "seed 1, wall clock; steady state after the first two blocks. "
        f"{RATE_ROUNDS} rounds, each running every method on P1, then on P3: a ratio compares "
        "runs made within about a minute of each other, and the target takes the median "
        "over the rounds (other work on a shared machine slows single runs).",
        "",
        "| problem | round | " + " | ".join(methods) + " |",
        "| --- " * (2 + len(methods)) + "|",
    ]
    missing = suite.bench_extra_missing("blackjax", "jax")
    rates: dict[str, list[dict[str, float]]] = {key: [] for key in cfg.problems}
    for round_ in range(1, RATE_ROUNDS + 1):
        for key in cfg.problems:
            rows, _ = suite.bench_problem(key, 1, cfg)
            rates[key].append({r.method: r.steps_per_s for r in rows})
            cells = [
                f"{rates[key][-1][m]:,.0f}" if m in rates[key][-1] else "skipped" for m in methods
            ]
            lines.append(f"| {key} | {round_} | " + " | ".join(cells) + " |")
    if missing:
        lines += ["", f"BlackJAX skipped: {missing}."]
    lines += [
        "",
        "Ratios of steps/s in each round (median):",
        "",
        "| ratio | " + " | ".join(cfg.problems) + " |",
        "| --- " * (1 + len(cfg.problems)) + "|",
    ]

    def median_ratio(ours: str, baseline: str, target: float) -> tuple[str, bool]:
        medians = []
        cells = []
        for key in cfg.problems:
            values = [r[ours] / r[baseline] for r in rates[key]]
            medians.append(float(np.median(values)))
            cells.append(", ".join(f"{v:.2f}" for v in values) + f" ({medians[-1]:.2f})")
        lines.append(f"| {ours} / {baseline} | " + " | ".join(cells) + " |")
        return ratio_cell(medians, target)

    out = []
    for ours in ("SGLD", "SGNHT"):
        name = f"{ours} vs BlackJAX {ours}, P1 / P3 (steps/s, median of {RATE_ROUNDS} rounds)"
        if missing:
            out.append((name, ">= 1.2x", "skipped", False))
            continue
        out.append((name, ">= 1.2x", *median_ratio(ours, f"BlackJAX {ours}", 1.2)))
    name = f"SGLD vs NumPy SGLD, P1 / P3 (steps/s, median of {RATE_ROUNDS} rounds)"
    out.append((name, ">= 2x", *median_ratio("SGLD", "NumPy SGLD", 2.0)))
    lines.append("")
    return out


def covariance_costs(lines: list[str]) -> list[Target]:
    """Section 2: the covariance samplers' cost per step against SGLD's at D = 100."""
    lines += [
        "## 2. Covariance samplers' cost per step at D = 100 (n = 500)",
        "",
        f"`covariance.py`'s measurement: CPU time inside the compiled block, thin = 10, the "
        f"smallest of {covariance.COST_REPEATS} block fills, alternated with SGLD's; h = 1e-3 "
        "from the posterior mean of the linear regression (N = 10,000).",
        "",
        "| sampler | µs per step | time per step / SGLD's |",
        "| --- | --- | --- |",
    ]
    ratios = []
    for label, cost, ratio in covariance.costs(100, COVARIANCE_DEFAULTS + COVARIANCE_PERIODIC):
        lines.append(f"| {label} | {cost:,.1f} | {ratio:.2f} |")
        print(lines[-1], flush=True)
        ratios.append(ratio)
    lines.append("")
    default, periodic = ratio_cell(ratios[:2], 1.6, above=False), ratio_cell(ratios[2:], 1.6, False)
    return [
        ("mCCAdL / NOGIN, default low-rank path, vs SGLD step, D = 100", "<= 1.6x", *default),
        ("mCCAdL / NOGIN, periodic average every 300 steps (not default)", "<= 1.6x", *periodic),
    ]


def first_draw(lines: list[str]) -> list[Target]:
    """Section 3: SGLD's first draw on P1, cold and warm compile caches, in
    :data:`FIRST_DRAW_ROUNDS` rounds, each with a new empty compile directory; the targets take
    the medians (a single cold run moved by 1-2 s with the host's load)."""
    problem = make_problem("P1")
    _, cov_u, centre, _ = reference(problem, allow_nuts=False)
    settings = suite.Settings.of(problem, cov_u, centre)
    lines += [
        "## 3. SGLD's first draw on P1",
        "",
        "Step construction to the first stored draw in a fresh process (`suite.compile_times`; "
        "the package imported before the clock starts, as in a user's script: runs before "
        "2026-12-02 23:00 UTC counted its import), with empty compile caches and then with the "
        f"ones that run filled, in {FIRST_DRAW_ROUNDS} rounds, each with a new compile "
        "directory (before 2026-12-06 one round); the targets take the medians.",
        "",
        "| round | load average (1 min) at its start | cold | warm |",
        "| --- | --- | --- | --- |",
    ]
    colds, warms = [], []
    for round_ in range(1, FIRST_DRAW_ROUNDS + 1):
        load = load_average().split(",")[0]
        cold, warm = suite.compile_times("P1", "SGLD", settings, "float64")
        colds.append(cold)
        warms.append(warm)
        lines.append(f"| {round_} | {load} | {cold:.1f} s | {warm:.1f} s |")
        print(lines[-1], flush=True)
    lines.append("")
    cold, warm = float(np.median(colds)), float(np.median(warms))

    def cell(median: float, values: list[float]) -> str:
        return f"{median:.1f} s (" + ", ".join(f"{v:.1f}" for v in values) + ")"

    rounds = f"median of {FIRST_DRAW_ROUNDS} rounds"
    return [
        (f"SGLD first draw on P1, cold ({rounds})", "<= 10 s", cell(cold, colds), cold <= 10),
        (f"SGLD first draw on P1, warm ({rounds})", "<= 3 s", cell(warm, warms), warm <= 3),
    ]


def p4_run(sampler: str, compiledir: str) -> dict:
    """``control_variates.run`` on P4 in a fresh process whose compile caches are in
    ``compiledir``."""
    return child_result([__file__, "--p4-child", sampler], env=compile_cache_env(compiledir))


def p4_against_nuts(lines: list[str]) -> list[Target]:
    """Section 4: time to the accuracy criterion on P4 against NUTS's projected default run,
    PyMC's own NUTS and nutpie (PyMC's default NUTS where it is installed). The target is
    judged against the default: nutpie's projection where nutpie is installed."""
    problem = make_problem("P4")
    ref = reference(problem, allow_nuts=False)[0]
    missing = suite.bench_extra_missing("nutpie")
    # The default NUTS last: the target's ratio is each row's last one.
    baselines = ["nuts"] if missing else ["nuts", "nutpie"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nuts = {
            b: suite.run_nuts_projected(problem, ref, 50, 50, seed=1, sampler=b) for b in baselines
        }
    labels = [suite.NUTS_BASELINES[b][0] for b in baselines]
    lines += [
        "## 4. P4 (N = 1,000,000, D = 50, n = 1,000): time to the accuracy criterion",
        "",
        "`pm.sample(step=Sampler(control_variates=True), chains=1)`, every other argument at "
        "its default, from the model's initial point, timed from the step's construction in a "
        "fresh process: with empty compile caches, then with the ones it filled. Reference: "
        "the Laplace approximation at the full-data MAP.",
        "",
        "| sampler | compile caches | time to result (s) | total (s) | final mean / var error "
        + "".join(f"| {label} time / this " for label in labels)
        + "|",
        "| --- " * (5 + len(labels)) + "|",
    ]
    ratios = {}
    for sampler in P4_SAMPLERS:
        with tempfile.TemporaryDirectory() as tmp:
            for cache in ("cold", "warm"):
                r = p4_run(sampler, tmp)
                result = r["result_s"]
                against = [None if result is None else nuts[b].result_s / result for b in nuts]
                ratios[sampler, cache] = against[-1]
                cells = " | ".join("-" if a is None else f"{a:.1f}" for a in against)
                lines.append(
                    f"| {sampler} | {cache} | "
                    f"{'not reached' if result is None else f'{result:.1f}'} | "
                    f"{r['total_s']:.1f} | {r['mean_err']:.3f} / {r['var_err']:.3f} | {cells} |"
                )
                print(lines[-1], flush=True)
    for n in nuts.values():
        cells = " | ".join(f"{other.result_s / n.result_s:.2f}" for other in nuts.values())
        lines.append(
            f"| {n.method} | - | {n.result_s:.1f} | {n.run_s:.1f} (short run) | "
            f"{n.mean_err:.3f} / {n.var_err:.3f} | {cells} |"
        )
    lines += [""]
    lines += [f"{n.method}: {n.note}." for n in nuts.values()]
    if missing:
        lines += [f"nutpie skipped: {missing}; the target is judged against PyMC's own NUTS."]
    lines += [""]
    out = []
    for cache in ("cold", "warm"):
        values = [ratios[s, cache] or 0.0 for s in P4_SAMPLERS]
        cell = " / ".join(f"{v:.0f}" for v in values) + f" ({' / '.join(P4_SAMPLERS)})"
        name = f"P4 time to accuracy, {labels[-1]} (PyMC's default NUTS here) / ours, {cache}"
        out.append((name, ">= 20x", cell, max(values) >= 20))
    return out


def parallel_chains(lines: list[str]) -> list[Target]:
    """Section 5: two chains on two cores against one chain on one, in a fresh process (as a
    user's script starts: ``pm.sample`` forks its workers from it)."""
    child = child_result([__file__, "--cores-child"])
    lines += [
        "## 5. `cores=2` (two chains) against `cores=1` (one chain), SGLD on P1",
        "",
        "`engine.py cores`'s measurement, in a fresh process: integrator steps/s of all chains "
        "together while every chain delivers, from the latest chain's quarter mark of its draws "
        "(wall time), each configuration twice.",
        "",
        *child["lines"],
        "",
    ]
    cell, met = ratio_cell(child["ratios"], 1.6)
    return [
        ("cores=2 vs cores=1 steps/s (thin 1, 10, default; two runs each)", ">= 1.6x", cell, met)
    ]


def accelerator() -> Target:
    """JAX's devices here; without one, where ``benchmarks/gpu.py`` last measured a GPU (a
    machine lent for a session: its results file, not this run)."""
    import jax

    devices = [d for d in jax.devices() if d.platform != "cpu"]
    found = ", ".join(str(d) for d in devices) or "none on this machine"
    if not devices and (HERE / "gpu_results.md").exists():
        found += "; a lent GPU measured apart: `gpu_results.md`"
    return ("an accelerator, measured there", "if available", found, None if not devices else True)


def main() -> None:
    suite.quiet_pymc()
    top = header("Issue 4's performance targets, measured in one run (`benchmarks/criteria.py`)")
    lines: list[str] = []
    criteria = []
    for section in (
        sampler_rates,
        covariance_costs,
        first_draw,
        p4_against_nuts,
        parallel_chains,
    ):
        criteria += section(lines)
    try:
        criteria.append(accelerator())
    except ImportError:
        criteria.append(("an accelerator, measured there", "if available", "JAX missing", None))
    summary = [
        *top,
        f"- load average (1, 5, 15 min) at the end: {load_average()}",
        "",
        "| target | wanted | measured | met |",
        "| --- | --- | --- | --- |",
        *(
            f"| {name} | {wanted} | {measured} | {'-' if met is None else 'yes' if met else 'no'} |"
            for name, wanted, measured, met in criteria
        ),
        "",
    ]
    text = "\n".join(summary + lines) + "\n"
    print(text)
    (HERE / "criteria_results.md").write_text(text)


def p4_child(sampler: str) -> None:
    """Child process of :func:`p4_run`: prints ``control_variates.run``'s result as JSON."""
    import pymc_sgmcmc as sg

    suite.quiet_pymc()
    problem = make_problem("P4")
    ref = reference(problem, allow_nuts=False)[0]
    cls = {"SGLD": sg.SGLD, "SGNHT": sg.SGNHT, "NOGIN": sg.NOGIN}[sampler]
    result = control_variates.run(problem, ref, cls, control=True)
    print(json.dumps(result, default=float))


def cores_child() -> None:
    """Child process of :func:`parallel_chains`: prints ``engine.cores_table``'s rows and
    ratios as JSON."""
    suite.quiet_pymc()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table, ratios = cores_table("P1", 10, 20_000, 1000)
    print(json.dumps({"lines": table, "ratios": ratios}))


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """The command line: no options of its own (``--help`` prints the module's description);
    the two child modes are for this script's own fresh processes."""
    parser = script_parser(__doc__)
    parser.add_argument("--p4-child", choices=P4_SAMPLERS, help=argparse.SUPPRESS)
    parser.add_argument("--cores-child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_arguments(sys.argv[1:])
    if arguments.p4_child:
        p4_child(arguments.p4_child)
    elif arguments.cores_child:
        cores_child()
    else:
        main()
