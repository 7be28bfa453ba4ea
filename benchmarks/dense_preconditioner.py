"""The dense preconditioner (``adapt_preconditioner=True``): accuracy where it switches on, and
what it costs per step.

1. Accuracy: the regression on calendar years (y = -40 + 0.025 year + N(0, 1), years
   1990-2020, N = 5,000, n = 500, unknown noise sd; intercept and slope correlated at
   -0.99998 a posteriori), every sampler with its defaults (2 chains x 500 draws, tune =
   1,000, ``cores=1``), with ``adapt_preconditioner="diag"`` and with the default: the
   largest |mean - NUTS mean| / NUTS sd over the coordinates, the range of sd / NUTS sd,
   R-hat, the smallest bulk ESS, the wall time of ``pm.sample`` (compiling the blocks that
   the compile caches lack included) and the sampler's warnings.
   NUTS: PyMC's default sampler on the full data, 2 x 2,000 draws.
2. Accuracy above D = 64: a random-intercept model, y = a + b[group] + N(0, 1) with 99
   groups of 50 rows (N = 4,950, n = 500, D = 100, a and b ~ N(0, 10), known noise sd, so
   the posterior is Gaussian and known exactly; a and each b_j correlated at -0.99), the
   same runs and columns against the exact posterior (R-hat and ESS the worst of the 100
   coordinates).
3. Accuracy where no one coordinate is strongly correlated with the others but the
   correlation matrix is ill-conditioned: MNIST 7 vs 9 on 100 random projections
   (``benchmarks/problems.py``, n = 500), the same runs and columns against the stored NUTS
   reference (``benchmarks/references/MNIST_nuts.npz``).
4. Cost: CPU time per step inside the compiled block (thin = 10, n = 500, a fixed step
   size, chains started at the exact posterior mean) of a linear regression at D = 16, 50
   and 200 with the rotation set to the Cholesky factor of the posterior covariance, as a
   ratio of the same sampler's diagonal block, fills alternated (the smallest of
   ``COST_REPEATS`` each); and the time of the dense block's first fill (its compilation).

Writes ``benchmarks/dense_preconditioner_results.md``.
Run: ``.venv/bin/python benchmarks/dense_preconditioner.py [accuracy] [intercepts] [mnist]
[cost]``.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import arviz as az
import numpy as np
import pymc as pm

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))

from covariance import CLASSES, COST_REPEATS, block_us_per_step, make, prepared_block  # noqa: E402
from models import GaussianRegression  # noqa: E402
from problems import make_problem, reference  # noqa: E402
from report import header, script_parser  # noqa: E402

NAMES = ("a", "b", "sigma")


def year_regression(full_data: bool) -> pm.Model:
    rng = np.random.default_rng(0)
    year = rng.integers(1990, 2021, 5000).astype(float)
    y = -40.0 + 0.025 * year + rng.standard_normal(5000)
    with pm.Model() as model:
        x, obs = (year, y) if full_data else pm.Minibatch(year, y, batch_size=500)
        a = pm.Normal("a", 0, 100)
        b = pm.Normal("b", 0, 1)
        sigma = pm.HalfNormal("sigma", 5)
        pm.Normal("y", a + b * x, sigma, observed=obs, total_size=None if full_data else 5000)
    return model


def accuracy_table(lines: list[str]) -> None:
    with year_regression(full_data=True):
        nuts = pm.sample(2000, tune=2000, chains=2, random_seed=0, progressbar=False)
    mean = {v: float(nuts.posterior[v].mean()) for v in NAMES}
    sd = {v: float(nuts.posterior[v].std()) for v in NAMES}

    def errors(idata):
        post = idata.posterior
        off = max(abs(float(post[v].mean()) - mean[v]) / sd[v] for v in NAMES)
        ratios = np.array([float(post[v].std()) / sd[v] for v in NAMES])
        rhat = max(float(az.rhat(idata, var_names=[v])[v]) for v in NAMES)
        ess = min(float(az.ess(idata, var_names=[v])[v]) for v in NAMES)
        return off, ratios, rhat, ess

    lines += [
        "## Accuracy: the regression on calendar years, against NUTS",
        "",
        "| sampler | preconditioner | max \\|Δmean\\| (NUTS sd) | sd / NUTS sd | R-hat | "
        "min ESS | dense? | time (s) | warnings |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    preconditioner_rows(lines, lambda: year_regression(full_data=False), errors)


def intercepts_table(lines: list[str]) -> None:
    problem = GaussianRegression.random_intercepts()
    errors = errors_of_w(problem.mean, np.sqrt(np.diag(problem.cov)))
    lines += [
        "## Accuracy above D = 64: a random-intercept model (99 groups, D = 100), exact posterior",
        "",
        "| sampler | preconditioner | max \\|Δmean\\| (sd) | sd ratio | R-hat | min ESS | dense? "
        "| time (s) | warnings |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    preconditioner_rows(lines, problem.model, errors)


def mnist_table(lines: list[str]) -> None:
    problem = make_problem("MNIST")
    nuts = reference(problem, allow_nuts=False)[0]
    errors = errors_of_w(nuts.mean, np.sqrt(nuts.var))
    lines += [
        "## Accuracy without a strong correlation of any one coordinate: MNIST 7 vs 9 (D = 100)",
        "",
        f"Against {nuts.source}. The largest multiple correlation of a coordinate with the "
        "others is 0.956 (Laplace covariance); the correlation matrix's condition number 384.",
        "",
        "| sampler | preconditioner | max \\|Δmean\\| (NUTS sd) | sd / NUTS sd | R-hat | "
        "min ESS | dense? | time (s) | warnings |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    preconditioner_rows(lines, problem.model, errors)


def errors_of_w(mean: np.ndarray, sd: np.ndarray):
    """``errors(idata)`` for :func:`preconditioner_rows` of the model's vector ``w`` against
    known posterior means and sds."""

    def errors(idata):
        draws = idata.posterior["w"].values.reshape(-1, len(mean))
        off = np.max(np.abs(draws.mean(axis=0) - mean) / sd)
        ratios = draws.std(axis=0) / sd
        return off, ratios, float(az.rhat(idata)["w"].max()), float(az.ess(idata)["w"].min())

    return errors


def preconditioner_rows(lines: list[str], model, errors) -> None:
    """A row per sampler, with ``adapt_preconditioner="diag"`` and with the default: its
    defaults otherwise, 2 chains x 500 draws after 1,000 tuning draws on ``model()``;
    ``errors(idata)`` gives the largest |mean error| in sd, the sd ratios, the worst R-hat
    and the smallest bulk ESS."""
    for name, cls in CLASSES.items():
        for setting in ("diag", True):
            with model(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step = cls(adapt_preconditioner=setting)
                start = time.perf_counter()
                idata = pm.sample(
                    500, tune=1000, step=step, chains=2, cores=1, random_seed=1,
                    progressbar=False, compute_convergence_checks=False,
                )  # fmt: skip
                seconds = time.perf_counter() - start
            off, ratios, rhat, ess = errors(idata)
            said = sorted({_kind(str(w.message)) for w in caught if cls.__name__ in str(w.message)})
            label = "diagonal" if setting == "diag" else "default"
            lines.append(
                f"| {name} | {label} | {off:.3f} | {ratios.min():.2f}-{ratios.max():.2f} | "
                f"{rhat:.3f} | {ess:.0f} | {'yes' if step.dense else 'no'} | {seconds:.0f} | "
                f"{', '.join(said) or '-'} |"
            )
            print(lines[-1], flush=True)
    lines.append("")


def _kind(message: str) -> str:
    for key, kind in (("drifting", "drift"), ("thin was capped", "capped thin")):
        if key in message:
            return kind
    return message[:60]


def cost_table(lines: list[str]) -> None:
    lines += [
        "## Cost per step of the dense block (thin = 10, n = 500; CPU time inside the block)",
        "",
        f"Smallest of {COST_REPEATS} block fills each, alternated with the diagonal block's.",
        "",
        "| D | sampler | diagonal µs per step | dense µs per step | dense / diagonal | "
        "dense block's first fill (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for dim in (16, 50, 200):
        problem = GaussianRegression.make(n_obs=10_000, dim=dim, batch_size=500)
        rotation, mean = np.linalg.cholesky(problem.cov), problem.mean
        for name in ("SGLD", "SGNHT", "mSGLD", "CCAdL", "mCCAdL", "NOGIN"):
            fills = {}
            for dense in (False, True):
                with problem.model() as model:
                    step = make(name, 1e-3, 1.0, thin=10)
                prepared_block(problem, step, model)
                if dense:
                    step.setup_chain(np.random.default_rng(0), tune=0, draws=10**9)
                    step.rotation, step.scale = rotation, np.ones(dim)
                    start = time.perf_counter()
                    step._fill_buffer(mean)
                    first_fill = time.perf_counter() - start
                fills[dense] = step
            times = {False: [], True: []}
            for _ in range(COST_REPEATS):
                for dense, step in fills.items():
                    times[dense].append(block_us_per_step(step, mean))
            diagonal, dense = min(times[False]), min(times[True])
            lines.append(
                f"| {dim} | {name} | {diagonal:,.1f} | {dense:,.1f} | {dense / diagonal:.2f} | "
                f"{first_fill:.1f} |"
            )
            print(lines[-1], flush=True)
    lines.append("")


def main():
    tables = {
        "accuracy": accuracy_table,
        "intercepts": intercepts_table,
        "mnist": mnist_table,
        "cost": cost_table,
    }
    parser = script_parser(__doc__)
    parser.add_argument(
        "tables", nargs="*", choices=list(tables), help="which tables to run (default: all)"
    )
    lines = [*header("The dense preconditioner (`benchmarks/dense_preconditioner.py`)"), ""]
    for section in parser.parse_args().tables or list(tables):
        tables[section](lines)
    (HERE / "dense_preconditioner_results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
