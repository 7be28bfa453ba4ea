"""The dense preconditioner (``adapt_preconditioner=True``): accuracy where it switches on, and
what it costs per step.

1. Accuracy: the regression on calendar years (y = -40 + 0.025 year + N(0, 1), years
   1990-2020, N = 5,000, n = 500, unknown noise sd; intercept and slope correlated at
   -0.99998 a posteriori), every sampler with its defaults (2 chains x 500 draws, tune =
   1,000, ``cores=1``), with ``adapt_preconditioner="diag"`` and with the default: the
   largest |mean error| / sd over the coordinates, the range of sd ratios, R-hat, the
   smallest bulk ESS, the wall time of ``pm.sample`` (compiling the blocks that the compile
   caches lack included) and the sampler's warnings, against the exact posterior
   (:func:`exact_year_posterior`: (a, b) given sigma is Gaussian, sigma's marginal by
   quadrature). A first row does the same for NUTS, PyMC's default sampler on the full data,
   2 x 2,000 draws, which this table used as its reference until 2026-12-02: its sd of sigma
   was 9 % too large, which made every sampler's look 5-10 % too small.
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

Writes ``benchmarks/dense_preconditioner_results.md``; with only some tables named, the others
are kept from that file as they were (the header then says which were rerun).
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


def year_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    year = rng.integers(1990, 2021, 5000).astype(float)
    return year, -40.0 + 0.025 * year + rng.standard_normal(5000)


#: The model's prior sds of the intercept a and slope b, and the HalfNormal scale of sigma.
YEAR_PRIOR_SDS = (100.0, 1.0)
YEAR_SIGMA_SCALE = 5.0


def year_regression(full_data: bool) -> pm.Model:
    year, y = year_data()
    with pm.Model() as model:
        x, obs = (year, y) if full_data else pm.Minibatch(year, y, batch_size=500)
        a = pm.Normal("a", 0, YEAR_PRIOR_SDS[0])
        b = pm.Normal("b", 0, YEAR_PRIOR_SDS[1])
        sigma = pm.HalfNormal("sigma", YEAR_SIGMA_SCALE)
        pm.Normal("y", a + b * x, sigma, observed=obs, total_size=None if full_data else 5000)
    return model


def exact_year_posterior(points: int = 4001) -> tuple[dict[str, float], dict[str, float]]:
    """Posterior means and sds of a, b and sigma of :func:`year_regression`, exactly (up to
    the quadrature): given sigma, (a, b) is Gaussian with precision L^-1 + X^T X / sigma^2
    (L the prior covariance, X the columns 1 and year), and sigma's marginal density is the
    HalfNormal prior times N(y; 0, sigma^2 I + X L X^T), evaluated on a grid of ``points``
    over +-10 of its approximate sds (1 / sqrt(2N) relative) around the residual sd of the
    least-squares fit."""
    year, y = year_data()
    X = np.column_stack([np.ones_like(year), year])
    prior_precision = np.diag(1.0 / np.square(YEAR_PRIOR_SDS))
    xtx, xty, yty, n = X.T @ X, X.T @ y, y @ y, len(y)

    def conditional(s: float) -> tuple[np.ndarray, np.ndarray, float]:
        """(mean, covariance) of (a, b) given sigma = s, and log p(y | s) up to a constant
        (Woodbury and the matrix determinant lemma on the n x n covariance)."""
        precision = prior_precision + xtx / s**2
        covariance = np.linalg.inv(precision)
        mean = covariance @ xty / s**2
        quadratic = yty / s**2 - xty @ mean / s**2
        return (
            mean,
            covariance,
            -0.5 * (quadratic + 2 * n * np.log(s) + np.linalg.slogdet(precision)[1]),
        )

    fit = np.linalg.lstsq(X, y, rcond=None)[0]
    centre = np.sqrt(np.mean((y - X @ fit) ** 2))
    grid = centre * (1 + np.linspace(-10, 10, points) / np.sqrt(2 * n))
    parts = [conditional(s) for s in grid]
    log_density = np.array([p[2] for p in parts]) - grid**2 / (2 * YEAR_SIGMA_SCALE**2)
    weights = np.exp(log_density - log_density.max())
    weights /= weights.sum()
    means = np.array([p[0] for p in parts])
    second = np.array([np.diag(p[1]) for p in parts]) + means**2
    ab_mean, ab_second = weights @ means, weights @ second
    sigma_mean = weights @ grid
    mean = {"a": ab_mean[0], "b": ab_mean[1], "sigma": sigma_mean}
    sd = {
        "a": np.sqrt(ab_second[0] - ab_mean[0] ** 2),
        "b": np.sqrt(ab_second[1] - ab_mean[1] ** 2),
        "sigma": np.sqrt(weights @ (grid - sigma_mean) ** 2),
    }
    return {k: float(v) for k, v in mean.items()}, {k: float(v) for k, v in sd.items()}


def year_ratios(ratios: np.ndarray) -> str:
    """The sd ratios of (a, b) and of sigma (a's and b's are the same to two digits)."""
    return f"{ratios[0]:.2f} / {ratios[2]:.2f}"


def accuracy_table(lines: list[str]) -> None:
    mean, sd = exact_year_posterior()

    def errors(idata):
        post = idata.posterior
        off = max(abs(float(post[v].mean()) - mean[v]) / sd[v] for v in NAMES)
        ratios = np.array([float(post[v].std()) / sd[v] for v in NAMES])
        rhat = max(float(az.rhat(idata, var_names=[v])[v]) for v in NAMES)
        ess = min(float(az.ess(idata, var_names=[v])[v]) for v in NAMES)
        return off, ratios, rhat, ess

    lines += [
        "## Accuracy: the regression on calendar years, against the exact posterior",
        "",
        f"Exact posterior sds: a {sd['a']:.4g}, b {sd['b']:.4g}, sigma {sd['sigma']:.4g}. "
        "The sd ratio column gives a's (b's is the same to two digits: they are correlated "
        "at -0.99998) and sigma's.",
        "",
        "| sampler | preconditioner | max \\|Δmean\\| (sd) | sd ratio (a, b / sigma) | R-hat | "
        "min ESS | dense? | time (s) | warnings |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    with year_regression(full_data=True):
        start = time.perf_counter()
        nuts = pm.sample(2000, tune=2000, chains=2, random_seed=0, progressbar=False)
        seconds = time.perf_counter() - start
    off, ratios, rhat, ess = errors(nuts)
    lines.append(
        f"| NUTS (`pm.sample`'s default, full data, 2 x 2,000 draws) | - | {off:.3f} | "
        f"{year_ratios(ratios)} | {rhat:.3f} | {ess:.0f} | - | {seconds:.0f} | - |"
    )
    print(lines[-1], flush=True)
    preconditioner_rows(lines, lambda: year_regression(full_data=False), errors, year_ratios)


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


def sd_ratio_range(ratios: np.ndarray) -> str:
    return f"{ratios.min():.2f}-{ratios.max():.2f}"


def preconditioner_rows(lines: list[str], model, errors, ratio_cell=sd_ratio_range) -> None:
    """A row per sampler, with ``adapt_preconditioner="diag"`` and with the default: its
    defaults otherwise, 2 chains x 500 draws after 1,000 tuning draws on ``model()``;
    ``errors(idata)`` gives the largest |mean error| in sd, the sd ratios (written by
    ``ratio_cell``), the worst R-hat and the smallest bulk ESS."""
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
                f"| {name} | {label} | {off:.3f} | {ratio_cell(ratios)} | "
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
    chosen = parser.parse_args().tables or list(tables)
    path = HERE / "dense_preconditioner_results.md"
    kept = kept_sections(path, len(tables)) if len(chosen) < len(tables) else {}
    lines = [*header("The dense preconditioner (`benchmarks/dense_preconditioner.py`)")]
    if kept:
        lines.append(f"- tables rerun in this run: {', '.join(chosen)}; the others as they were")
    lines.append("")
    for k, section in enumerate(tables):
        if section in chosen:
            tables[section](lines)
        else:
            lines += kept[k]
    path.write_text("\n".join(lines) + "\n")


def kept_sections(path: Path, count: int) -> list[list[str]]:
    """The ``count`` tables of the results file, in the order of ``main``'s (each from its
    "## " heading to the next), for a run that reruns only some of them."""
    sections: list[list[str]] = []
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            sections.append([])
        if sections:
            sections[-1].append(line)
    if len(sections) != count:
        raise SystemExit(f"{path.name} does not hold the {count} tables: run them all")
    return sections


if __name__ == "__main__":
    main()
