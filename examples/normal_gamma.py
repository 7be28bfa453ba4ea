"""CCAdL paper section 4.1 / Table 1: mean and precision of a normal, Normal-Gamma prior.

Shang, Zhu, Leimkuhler & Storkey (2015), section 4.1: N = 100 draws from N(0, 1), likelihood
N(x_i | mu, 1/gamma), prior mu | gamma ~ N(0, 1/gamma), gamma ~ Gam(1, 1), minibatches of
n = 10. The posterior is Normal-Gamma, so both marginals are known exactly (mu: Student t,
gamma: Gamma). For SGLD, SGHMC, SGNHT, CCAdL, mCCAdL and NOGIN at h in {0.001, 0.01} and
A in {1, 10}, the example reports, like the paper's Table 1, the RMSE of the marginal
histograms against the exact marginals and the integrated autocorrelation times, plus the
Monte Carlo part of each RMSE (batch means) and the sampled/exact variance ratios, which
separate bias from noise.

As in the paper, gamma is sampled directly (``default_transform=None``), not as log(gamma): the
dynamics, and so the autocorrelation times, are those of the paper's (mu, gamma) coordinates.

Run: ``.venv/bin/python examples/normal_gamma.py [--quick] [--output-dir DIR]``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pymc as pm
from _common import (
    integrated_autocorrelation_time,
    parse_args,
    results_dir,
    sample,
    save_figure,
    write_table,
)
from scipy import stats

from pymc_sgmcmc import NOGIN, SGHMC, SGLD, SGNHT, CCAdL, MCCAdL

NAME = "normal_gamma"
N_OBS, BATCH = 100, 10
#: Histogram bins for the RMSE of a marginal (probability mass per bin; the paper does not say
#: how it binned, see the README).
BINS = 100
#: Table 1 of the paper: (RMSE, autocorrelation time) per sampler and (h, A).
PAPER = {
    "SGHMC": [(0.0148, 236.12), (0.0029, 333.04), (0.0531, 29.78), (0.0132, 39.33)],
    "SGNHT": [(0.0037, 238.32), (0.0035, 406.71), (0.0044, 26.71), (0.0043, 55.00)],
    "CCAdL": [(0.0034, 238.06), (0.0031, 402.45), (0.0021, 26.71), (0.0035, 54.43)],
}
PAPER_SETTINGS = [(0.001, 1.0), (0.001, 10.0), (0.01, 1.0), (0.01, 10.0)]


def make_data(seed: int = 2015) -> np.ndarray:
    """The paper's synthetic data: N = 100 draws from the standard normal."""
    return np.random.default_rng(seed).standard_normal(N_OBS)


def exact_posterior(x: np.ndarray) -> dict[str, Any]:
    """The Normal-Gamma posterior's exact marginals (the paper's mu_N, kappa_N, alpha_N, beta_N).

    gamma ~ Gam(alpha_N, rate beta_N); mu ~ Student t with 2 alpha_N degrees of freedom,
    location mu_N, scale sqrt(beta_N / (alpha_N kappa_N)).
    """
    n, xbar = len(x), x.mean()
    mu_n, kappa_n, alpha_n = n * xbar / (n + 1), 1.0 + n, 1.0 + n / 2
    beta_n = 1.0 + np.sum((x - xbar) ** 2) / 2 + n * xbar**2 / (2 * (1 + n))
    return {
        "mu": stats.t(df=2 * alpha_n, loc=mu_n, scale=np.sqrt(beta_n / (alpha_n * kappa_n))),
        "gamma": stats.gamma(a=alpha_n, scale=1.0 / beta_n),
    }


def build_model(x: np.ndarray) -> pm.Model:
    """The paper's model, minibatched; gamma untransformed (``default_transform=None``)."""
    with pm.Model() as model:
        x_mb = pm.Minibatch(x, batch_size=BATCH)
        gamma = pm.Gamma("gamma", alpha=1.0, beta=1.0, default_transform=None)
        mu = pm.Normal("mu", 0.0, tau=gamma)
        pm.Normal("x", mu, tau=gamma, observed=x_mb, total_size=len(x))
    return model


def step_factory(sampler: str, h: float, friction: float, thin: int) -> Callable[[], Any]:
    """The step object of one table cell.

    SGLD uses epsilon = h^2 (one SGLD step = one Langevin step with fully refreshed momentum),
    SGHMC estimates B-hat = h Sigma / 2 (the CCAdL paper's eq. 14), SGNHT uses Ding et al.'s
    Euler scheme (the paper's baseline), CCAdL the full 2 x 2 moving-average covariance, NOGIN
    friction gamma = A.
    """
    # The papers' unit-mass schemes: no preconditioner adapted during tune.
    common = {"thin": thin, "adapt_preconditioner": False, "block_steps": 20_000}
    makers = {
        "SGLD": lambda: SGLD(step_size=h**2, **common),
        "SGHMC": lambda: SGHMC(step_size=h, friction=friction, gradient_noise="estimate", **common),
        "SGNHT": lambda: SGNHT(step_size=h, friction=friction, splitting="euler", **common),
        # The paper's estimate of the noise at every step (the default takes one every 10).
        "CCAdL": lambda: CCAdL(
            step_size=h, friction=friction, covariance="full", averaging_interval=1, **common
        ),
        "mCCAdL": lambda: MCCAdL(step_size=h, friction=friction, **common),
        "NOGIN": lambda: NOGIN(step_size=h, friction=friction, **common),
    }
    return makers[sampler]


def bin_masses(draws: np.ndarray, exact: Any) -> tuple[np.ndarray, np.ndarray]:
    """Probability mass per bin of the draws and of the exact marginal, over BINS equal bins
    covering the central 99.98 % of the exact marginal."""
    edges = np.linspace(exact.ppf(1e-4), exact.ppf(1 - 1e-4), BINS + 1)
    counts, _ = np.histogram(draws, bins=edges)
    return counts / draws.size, np.diff(exact.cdf(edges))


def histogram_rmse(draws: np.ndarray, exact: Any) -> float:
    """RMSE over the bins between the draws' and the exact probability masses."""
    sampled, true = bin_masses(draws, exact)
    return float(np.sqrt(np.mean((sampled - true) ** 2)))


def monte_carlo_rmse(draws: np.ndarray, exact: Any, segments: int = 10) -> float:
    """The part of :func:`histogram_rmse` due to Monte Carlo noise, by batch means.

    The chain is cut into ``segments`` contiguous pieces (each far longer than the
    autocorrelation time); the spread of a bin's mass between pieces, divided by
    ``segments``, is that bin's Monte Carlo variance for the whole chain. An RMSE well above
    this value is bias.
    """
    pieces = np.array([bin_masses(p, exact)[0] for p in np.array_split(draws, segments)])
    return float(np.sqrt(np.mean(pieces.var(axis=0, ddof=1) / segments)))


def variance_ratio(draws: np.ndarray, exact: Any, thin: int) -> tuple[float, float]:
    """Sampled / exact variance and its Monte Carlo standard error (from the ESS of the
    squared deviations)."""
    squares = (draws - draws.mean()) ** 2
    ess = draws.size * thin / integrated_autocorrelation_time(squares, thin)
    return float(squares.mean() / exact.var()), float(squares.std() / np.sqrt(ess) / exact.var())


def settings(quick: bool) -> dict[str, Any]:
    """Budgets. Full: the paper's 10^6 stored steps after a burn-in; the draws are thinned so
    that the autocorrelation time (27-400 steps) stays well above ``thin``."""
    if quick:
        return {"grid": [(0.01, 1.0)], "steps": 10_000, "burn_in": 1_000}
    return {"grid": PAPER_SETTINGS, "steps": 1_000_000, "burn_in": 20_000}


def thin_for(h: float) -> int:
    return 5 if h >= 0.01 else 20


def run_cell(model, exact, sampler, h, friction, budget, seed) -> tuple[dict, dict]:
    """One (sampler, h, A) cell: sample, then the table's numbers."""
    thin = thin_for(h)
    run = sample(
        model,
        step_factory(sampler, h, friction, thin),
        draws=budget["steps"] // thin,
        tune=budget["burn_in"] // thin,
        seed=seed,
    )
    row: dict[str, Any] = {"sampler": sampler, "h": h, "A": friction if sampler != "SGLD" else "-"}
    for name in ("mu", "gamma"):
        draws = run.draws(name)[0]
        ratio, ratio_se = variance_ratio(draws, exact[name], thin)
        row[f"rmse_{name}"] = histogram_rmse(draws, exact[name])
        row[f"mc_{name}"] = monte_carlo_rmse(draws, exact[name])
        row[f"iat_{name}"] = integrated_autocorrelation_time(draws, thin)
        row[f"var_{name}"] = ratio
        row[f"var_se_{name}"] = ratio_se
    row["divergences"] = run.divergences
    row["seconds"] = run.seconds
    return row, {name: run.draws(name)[0] for name in ("mu", "gamma")}


def plot_marginals(exact, draws_by_cell, grid, path: Path) -> Path:
    """The paper's Figure 1: marginal densities of mu (top) and gamma (bottom) per (h, A)."""
    fig, axes = plt.subplots(2, len(grid), figsize=(3.6 * len(grid), 6), squeeze=False)
    for col, (h, friction) in enumerate(grid):
        for row, name in enumerate(("mu", "gamma")):
            ax = axes[row, col]
            dist = exact[name]
            edges = np.linspace(dist.ppf(1e-4), dist.ppf(1 - 1e-4), 61)
            centres = 0.5 * (edges[1:] + edges[:-1])
            for sampler, draws in draws_by_cell[(h, friction)].items():
                density, _ = np.histogram(draws[name], bins=edges, density=True)
                ax.plot(centres, density, lw=1, label=sampler)
            ax.plot(centres, dist.pdf(centres), "k--", lw=1.5, label="exact")
            ax.set_title(f"{name}: h={h:g}, A={friction:g}", fontsize=9)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def main(quick: bool = False, output_dir: str | Path | None = None) -> list[dict]:
    """Run the experiment and write ``table1.md``/``.csv`` and ``marginals.png``."""
    folder = results_dir(NAME, output_dir)
    budget = settings(quick)
    x = make_data()
    exact = exact_posterior(x)
    model = build_model(x)
    rows, draws_by_cell = [], {}
    samplers = ["SGLD", "SGHMC", "SGNHT", "CCAdL", "mCCAdL", "NOGIN"]
    for h, friction in budget["grid"]:
        draws_by_cell[(h, friction)] = {}
        for k, sampler in enumerate(samplers):
            earlier = [cell for cell in draws_by_cell if cell[0] == h and cell[1] != friction]
            if sampler == "SGLD" and earlier:
                # SGLD has no friction: one run per step size serves every A.
                draws_by_cell[(h, friction)][sampler] = draws_by_cell[earlier[0]][sampler]
                continue
            row, draws = run_cell(model, exact, sampler, h, friction, budget, seed=100 + k)
            rows.append(row)
            draws_by_cell[(h, friction)][sampler] = draws
            print(", ".join(f"{key}={value}" for key, value in row.items()), flush=True)
    notes = (
        f"{budget['steps']:,} stored steps per run after {budget['burn_in']:,} burn-in steps, one "
        f"chain; N = {N_OBS}, n = {BATCH}. rmse_*: RMSE of the probability mass in {BINS} equal "
        "bins over the central 99.98 % of the exact marginal; mc_*: its Monte Carlo part (batch "
        "means over 10 segments; rmse well above mc is bias); iat_*: integrated autocorrelation "
        "time in steps; var_*: sampled / exact variance, var_se_* its standard error."
    )
    write_table(rows, folder, "table1", "Normal-Gamma (CCAdL paper, Table 1)", notes)
    plot_marginals(exact, draws_by_cell, budget["grid"], folder / "marginals.png")
    return rows


if __name__ == "__main__":
    args = parse_args(__doc__)
    main(**args)
