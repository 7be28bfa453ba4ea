"""Steps/s of our SGLD / SGNHT inside ``pm.sample`` against BlackJAX's and the NumPy SGLD,
alternated in rounds: the issue-4 ratio, measured so that a machine whose speed drifts during
a run (a shared 2-core VM: the suite's baselines, which run after our samplers, were up to
twice as slow in one run as in another) biases neither side.

Each round runs every method once on the same problem for ``--budget`` seconds (the suite's
``run_ours`` / ``run_blackjax`` / ``run_numpy_sgld``: steady steps/s after the first blocks,
thin = 10, one chain); a round's ratios compare methods measured minutes apart at most.
Reported: each ratio's median over the rounds and its range.

Run: ``.venv/bin/python benchmarks/head_to_head.py [--problems P1 P3] [--rounds 5]
[--output benchmarks/head_to_head_results.md]`` (needs the ``bench`` extra for BlackJAX).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402
import suite  # noqa: E402
from problems import make_problem, reference  # noqa: E402

PAIRS = (
    ("SGLD / BlackJAX SGLD", "SGLD", "BlackJAX SGLD"),
    ("SGNHT / BlackJAX SGNHT", "SGNHT", "BlackJAX SGNHT"),
    ("SGLD / NumPy SGLD", "SGLD", "NumPy SGLD"),
)


def one_round(key: str, cfg: suite.Config) -> dict[str, float]:
    """Steps/s of every method on problem ``key``, in a fixed order."""
    problem = make_problem(key)
    ref, cov_u, centre, _ = reference(problem, allow_nuts=cfg.nuts_references)
    s = suite.Settings.of(problem, cov_u, centre)
    rates = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("SGLD", "SGNHT"):
            rates[name] = suite.run_ours(problem, ref, name, s, cfg).steps_per_s
        for algo in ("SGLD", "SGNHT"):
            rates[f"BlackJAX {algo}"] = suite.run_blackjax(problem, ref, algo, s, cfg).steps_per_s
        rates["NumPy SGLD"] = suite.run_numpy_sgld(problem, ref, s, cfg).steps_per_s
    return rates


def main(argv: list[str]) -> None:
    parser = report.script_parser(__doc__)
    parser.add_argument("--problems", nargs="+", default=["P1", "P3"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=5.0, help="seconds per method and round")
    parser.add_argument("--output", type=Path, default=HERE / "head_to_head_results.md")
    args = parser.parse_args(argv)
    missing = suite.bench_extra_missing("blackjax", "jax")
    if missing is not None:
        sys.exit(f"BlackJAX is needed for this comparison: {missing}")
    cfg, _ = suite.parse_args(["--budget", str(args.budget)])
    suite.quiet_pymc()
    lines = report.header(f"Head-to-head steps/s (`benchmarks/head_to_head.py {' '.join(argv)}`)")
    lines += [
        f"- {args.rounds} rounds per problem; in each round every method runs once for about "
        f"{args.budget:g} s (thin = 10, one chain, steady rate after the first blocks)",
        "",
    ]
    for key in args.problems:
        rounds = []
        for r in range(args.rounds):
            rounds.append(one_round(key, cfg))
            print(key, r, {k: round(v) for k, v in rounds[-1].items()}, flush=True)
        rows = [f"## {key}", "", "| ratio of steps/s | median | range | per round |"]
        rows.append("| --- | --- | --- | --- |")
        for label, ours, theirs in PAIRS:
            ratios = np.array([x[ours] / x[theirs] for x in rounds])
            per_round = ", ".join(f"{v:.2f}" for v in ratios)
            rows.append(
                f"| {label} | {np.median(ratios):.2f} | {ratios.min():.2f}-{ratios.max():.2f} "
                f"| {per_round} |"
            )
        medians = {k: np.median([x[k] for x in rounds]) for k in rounds[0]}
        rows += ["", "Median steps/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in medians.items())]
        lines += [*rows, ""]
    lines.append(f"Load average at the end: {report.load_average()}")
    report.write(lines, args.output)


if __name__ == "__main__":
    main(sys.argv[1:])
