"""Warm-up adaptation on models of very different scale: every sampler with its defaults.

For each model of ``tests/adaptation_models.py`` and each sampler, ``pm.sample`` with no
step size (adapted during tune) is compared with the reference (exact posterior or long NUTS):
largest mean error in posterior sd, largest relative variance error, divergences, the chosen
step size and thin, and the smallest bulk ESS. The same sampler with a fixed step size and no
adaptation (``FIXED``: the step sizes of the README's first example) is shown beside it.
Writes ``benchmarks/adaptation_results.md``.

Run: ``.venv/bin/python benchmarks/adaptation.py [--quick] [--samplers NAME ...]``
(``--samplers``: rerun only those samplers and replace their rows in the committed table.)
"""

from __future__ import annotations

import platform
import sys
import time
import warnings
from pathlib import Path

import arviz as az
import pymc as pm

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))

from adaptation_models import MODELS, errors, moments_of, reference  # noqa: E402
from report import script_parser  # noqa: E402

from pymc_sgmcmc import MSGLD, NOGIN, SGHMC, SGLD, SGNHT, CCAdL, MCCAdL  # noqa: E402

SAMPLERS = {
    "SGLD": SGLD,
    "MSGLD": MSGLD,
    "SGHMC": SGHMC,
    "SGNHT": SGNHT,
    "CCAdL": CCAdL,
    "MCCAdL": MCCAdL,
    "NOGIN": NOGIN,
}
#: A fixed, unadapted step size for comparison (SGLD's epsilon vs the thermostats' h).
FIXED = {"SGLD": 1e-5, "MSGLD": 1e-5}
FIXED_H = 1e-3


def run(model, step, draws: int, tune: int, seed: int):
    with model, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        start = time.perf_counter()
        idata = pm.sample(
            draws, tune=tune, step=step, chains=2, cores=1, random_seed=seed,
            progressbar=False, compute_convergence_checks=False,
        )  # fmt: skip
        seconds = time.perf_counter() - start
    return idata, seconds


def describe(name, model, step, draws, tune, ref, seed):
    idata, seconds = run(model, step, draws, tune, seed)
    names = list(ref.mean)
    mean_err, var_err = errors(moments_of(idata, names), ref)
    ess = min(float(az.ess(idata, var_names=[n])[n].min()) for n in names)
    stats = idata.sample_stats
    h = stats["step_size"].values[:, -1]
    return {
        "h": " / ".join(f"{v:.3g}" for v in h),
        "thin": step.thin,
        "mean": mean_err,
        "var": var_err,
        "div": int(stats["diverging"].sum()),
        "ess": ess,
        "seconds": seconds,
    }


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer draws, two samplers")
    parser.add_argument(
        "--samplers", nargs="+", choices=list(SAMPLERS), help="rerun only these; keep other rows"
    )
    args = parser.parse_args()
    draws, tune = (500, 500) if args.quick else (3000, 1000)
    names = ("SGNHT", "NOGIN") if args.quick else (args.samplers or list(SAMPLERS))
    samplers = {k: SAMPLERS[k] for k in names}
    out = HERE / "adaptation_results.md"
    kept = _table_rows(out) if args.samplers else {}
    lines = [
        "# Warm-up adaptation: defaults on models of very different scale",
        "",
        f"{platform.processor() or platform.machine()}, python {platform.python_version()}, "
        f"pymc {pm.__version__}, {time.strftime('%Y-%m-%d')}. `python benchmarks/adaptation.py`"
        f"{' --quick' if args.quick else ''}: 2 chains x {draws} draws after {tune} tuning "
        "draws; errors against the exact posterior (wide_variances) or NUTS (4 x 5000 draws).",
        "",
        "mean err: largest |mean - ref| / ref sd over all scalar parameters; var err: largest "
        "|var / ref var - 1|; ESS: smallest bulk ESS. `fixed`: step size 1e-3 (SGLD, mSGLD: "
        "1e-5), thin 10, no preconditioner.",
        "",
        "| model | sampler | h (chain 1 / 2) | thin | mean err | var err | div | ESS | s | "
        "fixed: mean err | var err | div |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model_name, build in MODELS.items():
        ref = reference(model_name)
        for name, cls in samplers.items():
            seed = 3  # as in tests/test_adaptation.py::test_defaults_match_reference
            with build() as model:
                step = cls()
            adapted = describe(name, model, step, draws, tune, ref, seed)
            with build() as model:
                fixed_step = cls(
                    step_size=FIXED.get(name, FIXED_H), thin=10, adapt_preconditioner=False
                )
            fixed = describe(name, model, fixed_step, draws, tune, ref, seed)
            row = (
                f"| {model_name} | {name} | {adapted['h']} | {adapted['thin']} | "
                f"{adapted['mean']:.3f} | {adapted['var']:.3f} | {adapted['div']} | "
                f"{adapted['ess']:.0f} | {adapted['seconds']:.1f} | {fixed['mean']:.3g} | "
                f"{fixed['var']:.3g} | {fixed['div']} |"
            )
            print(row, flush=True)
            kept[model_name, name] = row
    if args.samplers:
        lines = out.read_text().splitlines()
        lines = [kept.get(_row_key(line), line) for line in lines]
        # An earlier note about the same samplers' rows no longer holds.
        note = f"Rows of {', '.join(args.samplers)} rerun on "
        lines = [line for line in lines if not line.startswith(note)]
        while lines and not lines[-1].strip():
            lines.pop()
        lines.append(
            f"\n{note}{time.strftime('%Y-%m-%d %H:%M')} "
            "(`--samplers`); the other rows are from the run above."
        )
    else:
        lines += [kept[m, s] for m in MODELS for s in samplers]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def _row_key(line: str) -> tuple[str, str] | None:
    """(model, sampler) of a table row of the results file, else None."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    return (cells[0], cells[1]) if line.startswith("| ") and len(cells) > 2 else None


def _table_rows(path: Path) -> dict[tuple[str, str], str]:
    """The committed table's rows by (model, sampler)."""
    rows = {}
    for line in path.read_text().splitlines():
        key = _row_key(line)
        if key and key[0] in MODELS:
            rows[key] = line
    return rows


if __name__ == "__main__":
    main()
