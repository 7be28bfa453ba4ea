"""mCCAdL paper section 3.1 / Figure 1: 2-Wasserstein distance on a Bayesian linear regression.

Wei & Shang (2026), section 3.1: N = 10,000 rows x_i ~ N(0, I_100), y_i = theta^T x_i + noise
(unit variance, known), prior theta ~ N(0, 10 I), minibatches of n = 500 drawn with
replacement. The posterior is Gaussian, N(m, S) with S = (X^T X + I / 10)^-1 and m = S X^T y.
After k stored draws the example forms the Gaussian N(mean_k, cov_k) of the draws so far and
reports its 2-Wasserstein distance to N(m, S) (Givens & Shortt's formula) against the number
of passes over the data, for SGHMC, SGNHT, CCAdL, mCCAdL and NOGIN at the paper's step sizes
h in {5e-4, 1e-3, 5e-3} and A = 1 (the paper also shows A = 10). At h = 5e-3 the paper
sees SGHMC and CCAdL blow up; here that shows in the ``diverging`` stat.

Every chain starts at the exact posterior mean (``initvals``), as the package's stability test
does: from the prior mean the minibatch noise covariance is ~10^4 times larger for the first
steps, which makes mCCAdL's C step (s*m covariance products) very expensive, and the
measurement is about the stationary accuracy, not burn-in.

Run: ``.venv/bin/python examples/linear_regression_w2.py [--quick] [--output-dir DIR]``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pymc as pm
from _common import gaussian_w2, parse_args, passes, results_dir, sample, save_figure, write_table

from pymc_sgmcmc import NOGIN, SGHMC, SGNHT, CCAdL, MCCAdL

NAME = "linear_regression_w2"
N_OBS, DIM, BATCH, PRIOR_VAR = 10_000, 100, 500, 10.0
SAMPLERS = ["SGHMC", "SGNHT", "CCAdL", "mCCAdL", "NOGIN"]
STEP_SIZES = [5e-4, 1e-3, 5e-3]
FRICTIONS = [1.0, 10.0]


def make_data(seed: int = 2026) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic data of the paper's eq. 27, with theta ~ N(0, I) (the paper does not say
    which theta it used)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N_OBS, DIM))
    theta = rng.standard_normal(DIM)
    return X, X @ theta + rng.standard_normal(N_OBS)


def exact_posterior(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance of the Gaussian posterior (the paper's eq. 29)."""
    cov = np.linalg.inv(X.T @ X + np.eye(DIM) / PRIOR_VAR)
    return cov @ X.T @ y, cov


def build_model(X: np.ndarray, y: np.ndarray) -> pm.Model:
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=BATCH)
        theta = pm.Normal("theta", 0.0, np.sqrt(PRIOR_VAR), shape=DIM)
        pm.Normal("y", X_mb @ theta, 1.0, observed=y_mb, total_size=N_OBS)
    return model


def step_factory(sampler: str, h: float, friction: float, thin: int) -> Callable[[], Any]:
    """SGHMC with B-hat = 0 (Chen et al.'s usual choice, and the cheap one at D = 100), SGNHT in
    Ding et al.'s Euler form (the CCAdL papers' baseline), CCAdL with the diagonal moving
    average (the CCAdL paper's choice in high dimension; the full 100 x 100 average costs
    about 20 times more per step here), mCCAdL with its low-rank C step, NOGIN with friction A."""
    # The papers' unit-mass schemes: no preconditioner adapted during tune.
    common = {"thin": thin, "adapt_preconditioner": False, "block_steps": 2_000}
    makers = {
        "SGHMC": lambda: SGHMC(step_size=h, friction=friction, **common),
        "SGNHT": lambda: SGNHT(step_size=h, friction=friction, splitting="euler", **common),
        # The paper's estimate of the noise at every step (the default takes one every 10).
        "CCAdL": lambda: CCAdL(
            step_size=h, friction=friction, covariance="diag", averaging_interval=1, **common
        ),
        "mCCAdL": lambda: MCCAdL(step_size=h, friction=friction, **common),
        "NOGIN": lambda: NOGIN(step_size=h, friction=friction, **common),
    }
    return makers[sampler]


def w2_curve(draws: np.ndarray, mean: np.ndarray, cov: np.ndarray, checkpoints: np.ndarray):
    """W2 between N(mean, cov) and the Gaussian of the first k draws, for each k."""
    return np.array(
        [
            gaussian_w2(draws[:k].mean(0), np.cov(draws[:k], rowvar=False), mean, cov)
            for k in checkpoints
        ]
    )


def settings(quick: bool) -> dict[str, Any]:
    """Budgets: 6,000 steps (300 passes) per run at both of the paper's frictions
    (``FRICTIONS``) in full mode, 600 steps at A = 1 in quick mode."""
    if quick:
        return {"steps": 600, "thin": 2, "grid": [(1e-3, 1.0)], "samplers": ["SGNHT", "mCCAdL"]}
    grid = [(h, a) for a in FRICTIONS for h in STEP_SIZES]
    return {"steps": 6_000, "thin": 3, "grid": grid, "samplers": SAMPLERS}


def plot_curves(curves: dict, iid_curve, grid, path: Path) -> Path:
    """The paper's Figure 1: W2 against passes, one panel per step size, line style per A."""
    step_sizes = sorted({h for h, _ in grid})
    fig, axes = plt.subplots(1, len(step_sizes), figsize=(5 * len(step_sizes), 4), squeeze=False)
    colours = dict(zip(SAMPLERS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, h in zip(axes[0], step_sizes, strict=True):
        for (sampler, hh, a), (x, w2) in curves.items():
            if hh == h:
                style = "-" if a == 1.0 else "--"
                ax.loglog(x, w2, style, color=colours[sampler], label=f"{sampler}, A={a:g}")
        ax.loglog(*iid_curve, ":", color="black", label="exact i.i.d. draws")
        ax.set_title(f"h = {h:g}")
        ax.set_xlabel("passes over the data")
        ax.set_ylabel("2-Wasserstein distance")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def main(quick: bool = False, output_dir: str | Path | None = None) -> list[dict]:
    """Run the experiment; write ``w2.md``/``.csv``, ``w2_curves.csv`` and ``w2.png``."""
    folder = results_dir(NAME, output_dir)
    budget = settings(quick)
    X, y = make_data()
    mean, cov = exact_posterior(X, y)
    model = build_model(X, y)
    thin, n_draws = budget["thin"], budget["steps"] // budget["thin"]
    checkpoints = np.unique(np.geomspace(DIM + 1, n_draws, 15).astype(int))
    rng = np.random.default_rng(0)
    iid = rng.multivariate_normal(mean, cov, size=n_draws)
    iid_curve = (passes(checkpoints * thin, BATCH, N_OBS), w2_curve(iid, mean, cov, checkpoints))
    rows, curves, curve_rows = [], {}, []
    for k, sampler in enumerate(budget["samplers"]):
        for h, a in budget["grid"]:
            run = sample(
                model,
                step_factory(sampler, h, a, thin),
                draws=n_draws,
                tune=0,
                seed=10 + k,
                initvals={"theta": mean},
            )
            draws = run.draws("theta")[0]
            diverging = run.stat("diverging")[0]
            first = int(np.argmax(diverging)) if diverging.any() else n_draws
            kept = checkpoints[checkpoints <= first]  # W2 of the draws before any divergence
            w2 = w2_curve(draws, mean, cov, kept) if kept.size else np.array([np.nan])
            x = passes(kept * thin, BATCH, N_OBS) if kept.size else np.array([np.nan])
            curves[(sampler, h, a)] = (x, w2)
            curve_rows += [
                {"sampler": sampler, "h": h, "A": a, "passes": p, "w2": w}
                for p, w in zip(x, w2, strict=True)
            ]
            ratio = (
                np.trace(np.cov(draws[:first], rowvar=False)) / np.trace(cov)
                if first > DIM
                else np.nan
            )
            row = {
                "sampler": sampler,
                "h": h,
                "A": a,
                "w2_final": float(w2[-1]) if first == n_draws else np.nan,
                "w2_iid": float(iid_curve[1][-1]),
                "variance_ratio": float(ratio),
                "divergences": run.divergences,
                "first_divergence_pass": float(passes(first * thin, BATCH, N_OBS))
                if diverging.any()
                else np.nan,
                "seconds": run.seconds,
            }
            rows.append(row)
            print(", ".join(f"{key}={value}" for key, value in row.items()), flush=True)
    notes = (
        f"{budget['steps']:,} steps per run ({passes(budget['steps'], BATCH, N_OBS):g} passes), "
        f"every {thin}th stored, from the exact posterior mean; N = {N_OBS:,}, D = {DIM}, "
        f"n = {BATCH}. w2_final: W2 of all draws (NaN if the run diverged); variance_ratio: "
        "trace of the sampled / exact covariance over the draws before any divergence; "
        "first_divergence_pass: passes until the first diverging draw; w2_iid: W2 of as many "
        "exact i.i.d. draws (the Monte Carlo floor of a sampler without bias or correlation)."
    )
    write_table(rows, folder, "w2", "Bayesian linear regression (mCCAdL paper, Figure 1)", notes)
    write_table(curve_rows, folder, "w2_curves", "W2 against passes")
    (folder / "w2_curves.md").unlink()  # the curves are for plotting; the CSV is enough
    plot_curves(curves, iid_curve, budget["grid"], folder / "w2.png")
    return rows


if __name__ == "__main__":
    main(**parse_args(__doc__))
