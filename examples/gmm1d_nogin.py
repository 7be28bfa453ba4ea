"""NOGIN paper section 5.1 / Figure 2: centres of a 1-D two-component Gaussian mixture.

Matthews & Weare, section 5.1: N = 1000 observations (``../shared/data/gmm1d``, the authors'
own data) from pi(y | mu1, mu2) proportional to exp(-(y - mu1)^2 / 2) + 2 exp(-(y - mu2)^2 / 2),
a flat (uniform, improper) prior on (mu1, mu2) as in the paper, and the authors' initial
condition. The posterior
is bimodal (two basins joined by a ridge). For SGLD, mSGLD, SGHMC, SGNHT, CCAdL and NOGIN (with
the paper's one-minibatch covariance estimate, and with the package's moving average of it) at
one step size and several batch sizes n, the example computes the mean squared error of the
posterior variance of (mu1, mu2) estimated from a run of a given number of epochs (passes over
the data), as the authors' code does: the sample variance over every window of that length in
the run, against the exact variance, averaged over windows and both coordinates.

The exact variances come from quadrature on a fine grid (the posterior is two-dimensional),
which has no Monte Carlo error; a long NUTS run on the full data checks them and is cached in
``reference.json`` so that reruns skip it. n = N is the full-data gradient (a model without
``pm.Minibatch``), the paper's "true gradient" column.

Run: ``.venv/bin/python examples/gmm1d_nogin.py [--quick] [--output-dir DIR]``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import arviz as az
import matplotlib.pyplot as plt
import numpy as np
import pymc as pm
from _common import OUTPUT_ROOT, parse_args, results_dir, sample, save_figure, write_table
from _data import load
from scipy.special import logsumexp

from pymc_sgmcmc import MSGLD, NOGIN, SGHMC, SGLD, SGNHT, CCAdL

NAME = "gmm1d_nogin"
WEIGHTS = np.array([1.0, 2.0]) / 3.0
#: Step size h of the momentum samplers (SGLD and mSGLD use epsilon = h^2) and friction. The
#: largest Hessian eigenvalue of -log p is about 550 at both modes, so h = 0.02 is h*omega = 0.47,
#: stable for every scheme with the full gradient (the paper picks h so that all schemes agree
#: at n = N; it does not print its value).
STEP, FRICTION = 0.02, 1.0
#: Tag of the model in the cached NUTS check (a cache made for another prior is recomputed).
PRIOR = "flat"
SAMPLERS = ["SGLD", "mSGLD", "SGHMC", "SGNHT", "CCAdL", "NOGIN", "NOGIN-avg"]
#: NOGIN-avg: NOGIN with the moving average of the minibatch covariance estimates
#: (``averaging``, weight 0.01 on the newest: about 200 minibatches), the package's option
#: closest to the paper's "weighted history" of earlier force terms.
NOGIN_AVERAGING = 0.01


def load_data() -> tuple[np.ndarray, np.ndarray]:
    """The authors' 1000 observations and their initial condition."""
    data = load("gmm1d")
    return data["y"], data["init"]


def build_model(y: np.ndarray, batch_size: int) -> pm.Model:
    """Mixture with known weights 1/3, 2/3 and unit variances; flat prior on the centres.
    ``batch_size == len(y)`` reads the full data (no ``pm.Minibatch``): exact gradients."""
    with pm.Model() as model:
        data = y if batch_size >= len(y) else pm.Minibatch(y, batch_size=batch_size)
        mu = pm.Flat("mu", shape=2)
        pm.NormalMixture("y", w=WEIGHTS, mu=mu, sigma=1.0, observed=data, total_size=len(y))
    return model


def exact_moments(y: np.ndarray, points: int = 201) -> dict[str, list[float]]:
    """Posterior mean and variance of (mu1, mu2) by quadrature on a grid covering every point
    within 200 nats of the mode (the density at the grid's edge is below 1e-40 of its peak).

    The rule on a uniform grid converges geometrically for a smooth density that vanishes at the
    edges: 151, 201, 301, 401 and 1,201 points per axis give the same means and variances to
    13 significant digits (measured 2026-11-28), so 201 points (a spacing of 0.0175, a tenth of
    the smaller posterior sd) cost 1.3 s where 1,201 cost 51 s."""
    grid = np.linspace(-1.5, 2.0, points)
    m1, m2 = np.meshgrid(grid, grid, indexing="ij")
    logw = np.log(WEIGHTS)
    logp = np.zeros_like(m1)  # the flat prior
    for value in y:
        logp += np.logaddexp(logw[0] - (value - m1) ** 2 / 2, logw[1] - (value - m2) ** 2 / 2)
    weights = np.exp(logp - logsumexp(logp))
    mean = [float((weights * m).sum()) for m in (m1, m2)]
    var = [float((weights * (m - c) ** 2).sum()) for m, c in zip((m1, m2), mean, strict=True)]
    return {"mean": mean, "var": var}


def nuts_check(y: np.ndarray, init: np.ndarray, draws: int, folder: Path) -> dict[str, Any]:
    """NUTS on the full data: variances with Monte Carlo standard errors, cached as
    ``reference.json`` (looked up in ``folder``, then in the committed example output)."""
    for path in (folder / "reference.json", OUTPUT_ROOT / NAME / "reference.json"):
        if path.exists():
            cached = json.loads(path.read_text())
            if cached.get("draws_per_chain", 0) >= draws and cached.get("prior") == PRIOR:
                return cached
    with build_model(y, len(y)):
        idata = pm.sample(
            draws=draws,
            tune=1000,
            chains=4,
            cores=1,
            random_seed=51,
            initvals={"mu": init},
            progressbar=False,
            compute_convergence_checks=False,
            nuts_sampler="pymc",  # the cached run's sampler, nutpie installed or not
        )
    mu = idata.posterior["mu"].values  # chains x draws x 2
    squares = (mu - mu.reshape(-1, 2).mean(0)) ** 2
    se = [
        float(squares[..., k].std() / np.sqrt(az.ess(squares[..., k], method="mean")))
        for k in range(2)
    ]
    result = {
        "prior": PRIOR,
        "draws_per_chain": draws,
        "chains": 4,
        "var": [float(v) for v in squares.reshape(-1, 2).mean(0)],
        "var_se": se,
        "divergences": int(idata.sample_stats["diverging"].sum()),
    }
    (folder / "reference.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def step_factory(sampler: str, thin: int) -> Callable[[], Any]:
    """The step objects; all but SGLD and SGNHT use the minibatch's covariance estimate, as in
    the paper (SGHMC through B-hat = h Sigma / 2)."""
    h, a = STEP, FRICTION
    # The papers' unit-mass schemes: no preconditioner adapted during tune.
    common = {"thin": thin, "adapt_preconditioner": False, "block_steps": 50_000}
    makers = {
        "SGLD": lambda: SGLD(step_size=h**2, **common),
        "mSGLD": lambda: MSGLD(step_size=h**2, **common),
        "SGHMC": lambda: SGHMC(step_size=h, friction=a, gradient_noise="estimate", **common),
        "SGNHT": lambda: SGNHT(step_size=h, friction=a, **common),
        # The paper's estimate of the noise at every step (the default takes one every 10).
        "CCAdL": lambda: CCAdL(step_size=h, friction=a, averaging_interval=1, **common),
        "NOGIN": lambda: NOGIN(step_size=h, friction=a, **common),
        "NOGIN-avg": lambda: NOGIN(step_size=h, friction=a, averaging=NOGIN_AVERAGING, **common),
    }
    return makers[sampler]


def windowed_variance_mse(
    draws: np.ndarray, exact_var: np.ndarray, windows: np.ndarray
) -> np.ndarray:
    """MSE of the sample variance over every window of each length in ``windows`` (draws),
    against ``exact_var``, averaged over the windows (stride: a tenth of the length) and the
    coordinates."""
    csum = np.vstack([np.zeros((1, draws.shape[1])), np.cumsum(draws, axis=0)])
    csq = np.vstack([np.zeros((1, draws.shape[1])), np.cumsum(draws**2, axis=0)])
    out = np.full(len(windows), np.nan)
    for k, length in enumerate(windows):
        starts = np.arange(0, len(draws) - length + 1, max(1, length // 10))
        if length < 2 or starts.size == 0:
            continue
        mean = (csum[starts + length] - csum[starts]) / length
        var = ((csq[starts + length] - csq[starts]) / length - mean**2) * length / (length - 1)
        out[k] = float(np.mean((var - exact_var) ** 2))
    return out


def settings(quick: bool, n_obs: int) -> dict[str, Any]:
    """Budgets. Full: the paper's 30,000 epochs for the seven samplers (``SAMPLERS``) and four
    batch sizes, about 20 minutes on the 2-core reference machine. Quick: 30 epochs."""
    if quick:
        return {"epochs": 30, "batches": [n_obs, 10], "samplers": ["SGLD", "NOGIN"], "nuts": 500}
    return {
        "epochs": 30_000,
        "batches": [n_obs, 100, 10, 5],
        "samplers": SAMPLERS,
        "nuts": 25_000,
    }


def run_one(y, init, sampler: str, batch: int, epochs: int, exact, windows_epochs, seed: int):
    """One (sampler, batch size) run: MSE curve against window length in epochs."""
    steps_per_epoch = len(y) // batch
    thin = max(1, steps_per_epoch // 10)
    draws_per_epoch = steps_per_epoch / thin
    total = int(epochs * draws_per_epoch)
    burn_in = total // 10
    run = sample(
        build_model(y, batch),
        step_factory(sampler, thin),
        draws=total - burn_in,
        tune=burn_in,
        seed=seed,
        initvals={"mu": init},
    )
    draws = run.draws("mu")[0]
    windows = np.maximum(np.round(windows_epochs * draws_per_epoch).astype(int), 2)
    mse = windowed_variance_mse(draws, np.asarray(exact["var"]), windows)
    ratios = draws.var(axis=0, ddof=1) / np.asarray(exact["var"])
    return mse, ratios, run


def plot_heatmaps(results, batches, windows_epochs, samplers, path: Path) -> Path:
    """The paper's Figure 2: log10 MSE of the variance per batch size (rows) and epochs
    (columns), one panel per sampler; white cells are runs that diverged. The colour scale
    stops at MSE = 1 (a variance off by about 100 % or more: SGHMC's blow-ups reach 1e9),
    so that it resolves the working samplers."""
    cols = min(3, len(samplers))
    rows = int(np.ceil(len(samplers) / cols))
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, layout="constrained"
    )
    finite = [np.log10(m) for r in results.values() for m in [r["mse"]] if np.isfinite(m).any()]
    vmin = min(np.nanmin(f) for f in finite)
    vmax = min(max(np.nanmax(f) for f in finite), max(0.0, vmin + 1.0))
    image = None
    for ax, sampler in zip(axes.flat, samplers, strict=False):
        grid = np.array([np.log10(results[(sampler, b)]["mse"]) for b in batches])
        image = ax.pcolormesh(
            np.arange(len(windows_epochs) + 1),
            np.arange(len(batches) + 1),
            np.ma.masked_invalid(grid),
            vmin=vmin,
            vmax=vmax,
            cmap="viridis",
        )
        ticks = np.linspace(0, len(windows_epochs) - 1, 4).astype(int)
        ax.set_xticks(ticks + 0.5, [f"{windows_epochs[t]:.3g}" for t in ticks])
        ax.set_yticks(np.arange(len(batches)) + 0.5, [str(b) for b in batches])
        ax.set_title(sampler)
        ax.set_xlabel("epochs")
        ax.set_ylabel("batch size n")
    for ax in axes.flat[len(samplers) :]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, label="log10 MSE of the variance", extend="max")
    return save_figure(fig, path)


def main(quick: bool = False, output_dir: str | Path | None = None) -> list[dict]:
    """Run the experiment; write ``mse.md``/``.csv``, ``mse_curves.csv``, ``mse_heatmap.png``
    and ``reference.json``."""
    folder = results_dir(NAME, output_dir)
    budget = settings(quick, 1000)
    y, init = load_data()
    exact = exact_moments(y)
    nuts = nuts_check(y, init, budget["nuts"], folder)
    epochs = budget["epochs"]
    windows_epochs = np.unique(np.geomspace(1, 0.9 * epochs, 16).round(1))
    results, rows, curves = {}, [], []
    for k, sampler in enumerate(budget["samplers"]):
        for batch in budget["batches"]:
            mse, ratios, run = run_one(y, init, sampler, batch, epochs, exact, windows_epochs, k)
            if run.divergences:
                mse = np.full_like(mse, np.nan)  # unstable: white, as in the paper
            results[(sampler, batch)] = {"mse": mse}
            row = {
                "sampler": sampler,
                "n": batch,
                f"mse_{windows_epochs[len(windows_epochs) // 2]:g}_epochs": mse[len(mse) // 2],
                f"mse_{windows_epochs[-1]:g}_epochs": mse[-1],
                "var_ratio_mu1": ratios[0],
                "var_ratio_mu2": ratios[1],
                "divergences": run.divergences,
                "seconds": run.seconds,
            }
            rows.append(row)
            curves += [
                {"sampler": sampler, "n": batch, "epochs": e, "mse": m}
                for e, m in zip(windows_epochs, mse, strict=True)
            ]
            print(", ".join(f"{key}={value}" for key, value in row.items()), flush=True)
    notes = (
        f"{epochs:,} epochs per run (the first 10 % burn-in), h = {STEP} (SGLD, mSGLD: "
        f"epsilon = h^2), friction {FRICTION}, one chain per cell. Exact posterior variances "
        f"(quadrature): mu1 {exact['var'][0]:.6f}, mu2 {exact['var'][1]:.6f}; NUTS check "
        f"({nuts['chains']} x {nuts['draws_per_chain']:,} draws): mu1 {nuts['var'][0]:.6f} "
        f"+- {nuts['var_se'][0]:.6f}, mu2 {nuts['var'][1]:.6f} +- {nuts['var_se'][1]:.6f}. "
        "mse_E_epochs: MSE of the variance estimated over windows of E epochs; var_ratio_*: "
        "whole-run sampled / exact variance. NaN: the run diverged."
    )
    write_table(rows, folder, "mse", "1-D Gaussian mixture (NOGIN paper, Figure 2)", notes)
    write_table(curves, folder, "mse_curves", "MSE of the variance against epochs")
    (folder / "mse_curves.md").unlink()  # the curves are for plotting; the CSV is enough
    plot_heatmaps(
        results, budget["batches"], windows_epochs, budget["samplers"], folder / "mse_heatmap.png"
    )
    return rows


if __name__ == "__main__":
    main(**parse_args(__doc__))
