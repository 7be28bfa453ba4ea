"""Control variates (``control_variates=True``) against the plain minibatch force and NUTS.

What a user runs: ``pm.sample(step=Sampler(control_variates=True), chains=1)`` with every other
argument at its default (1,000 tuning and 1,000 kept draws, step size, preconditioner and thin
adapted), from the model's initial point. Timed from the step's construction (compilation
included) with a callback on every draw; time to result as in ``suite.py`` (posterior means
within 0.1 sd and variances within 10 % on the second half of the kept draws so far, holding to
the end), against the exact posterior (P1) or the Laplace reference (P4). NUTS in the same run:
measured on P1, projected on P4 from a short run (``suite.run_nuts_projected``).

Run: ``python benchmarks/control_variates.py [--output FILE]`` (about 8 minutes).
"""

from __future__ import annotations

import time
import warnings

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import numpy as np
import pymc as pm
from problems import make_problem, reference
from report import header, output_path, write
from suite import run_nuts, run_nuts_projected, time_to_result

import pymc_sgmcmc as sg

#: (problem, sampler, control variates). Plain SGLD on P4 is left out: its noise-capped step
#: makes the default run 2 x 10^6 steps (about 400 s; NOGIN measured 402 s for errors 0.11 /
#: 0.13).
RUNS = [
    ("P1", sg.SGLD, False),
    ("P1", sg.SGLD, True),
    ("P1", sg.SGNHT, True),
    ("P1", sg.NOGIN, True),
    ("P4", sg.SGLD, True),
    ("P4", sg.SGNHT, True),
    ("P4", sg.NOGIN, True),
]


def run(problem, ref, cls, control: bool, seed: int = 1, covariates: str | None = None) -> dict:
    """One default ``pm.sample`` run of ``cls`` on ``problem`` (``covariates="float32"``: its
    X stored in float32, the model in float64) and its time to the accuracy criterion."""
    times: list[float] = []

    def record(trace, draw):
        times.append(time.perf_counter())

    with problem.model(covariates=covariates), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        step = cls(control_variates=control)
        idata = pm.sample(
            step=step, chains=1, random_seed=seed, progressbar=False,
            compute_convergence_checks=False, callback=record,
            initvals={"w": problem.initial_point()},
        )  # fmt: skip
    draws = problem.draws_from_idata(idata)
    t = np.asarray(times[-len(draws) :]) - start  # the kept draws' times
    k, mean_err, var_err = time_to_result(draws, t, ref)
    stats = idata.sample_stats
    return {
        "total_s": float(times[-1] - start),
        "result_s": None if k is None else float(t[k - 1]),
        "mean_err": mean_err,
        "var_err": var_err,
        "step_size": float(stats["step_size"].values[0, -1]),
        "thin": int(stats["thin"].values[0, -1]),
        "diverging": int(stats["diverging"].values.sum()),
    }


def main() -> None:
    output = output_path(__doc__)
    lines = [
        *header("Control variates (`benchmarks/control_variates.py`)"),
        "- each run: `pm.sample(step=..., chains=1)` with the defaults (1,000 tuning + 1,000 "
        "draws, adapted step size / preconditioner / thin), from the model's initial point; "
        "one thread per runtime",
        "",
        "| problem | sampler | control variates | time to result (s) | total (s) | final mean "
        "/ var error | step size (preconditioned) | thin | diverging | NUTS time / this |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    nuts = {}
    for key in dict.fromkeys(k for k, _, _ in RUNS):
        problem = make_problem(key)
        ref = reference(problem, allow_nuts=False)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if key == "P4":
                nuts[key] = run_nuts_projected(problem, ref, 50, 50, seed=1)
            else:
                nuts[key] = run_nuts(problem, ref, 1000, 1000, seed=1)
        for rkey, cls, control in RUNS:
            if rkey != key:
                continue
            r = run(problem, ref, cls, control)
            nuts_s = nuts[key].result_s
            ratio = (
                "-" if r["result_s"] is None or nuts_s is None else f"{nuts_s / r['result_s']:.1f}"
            )
            result = "not reached" if r["result_s"] is None else f"{r['result_s']:.1f}"
            lines.append(
                f"| {key} | {cls.__name__} | {'yes' if control else 'no'} | {result} | "
                f"{r['total_s']:.1f} | {r['mean_err']:.3f} / {r['var_err']:.3f} | "
                f"{r['step_size']:.3g} | {r['thin']} | {r['diverging']} | {ratio} |"
            )
            print(lines[-1], flush=True)
        n = nuts[key]
        lines.append(
            f"| {key} | PyMC NUTS ({n.settings or 'default'}) | - | "
            f"{'not reached' if n.result_s is None else f'{n.result_s:.1f}'} | {n.run_s:.1f} | "
            f"{n.mean_err:.3f} / {n.var_err:.3f} | - | - | - | 1.0 |"
        )
        print(lines[-1], flush=True)
    lines += ["", "NUTS notes: " + "; ".join(f"{k}: {n.note}" for k, n in nuts.items())]
    write(lines, output)


if __name__ == "__main__":
    main()
