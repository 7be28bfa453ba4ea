"""CCAdL paper section 4.3 / mCCAdL paper section 3.3: the discriminative restricted Boltzmann
machine (DRBM) on ``letter`` and ``connect-4``.

A DRBM (Larochelle & Bengio 2008) with H hidden units, weights W (F x H), class weights
U (H x C), hidden biases c and class biases d gives the class probabilities in closed form:
the hidden units marginalise out of exp(-F(x, y)), whose free energy is

    -F(x, y) = d_y + sum_j softplus(c_j + U_jy + x . W_:j),

and p(y | x) = softmax_y(-F(x, y)). The example writes it as an ordinary PyMC model: a
``pm.Categorical`` with ``logit_p = -F(X_mb, .)`` on ``pm.Minibatch`` data, ``total_size = N``,
priors N(0, 1) on every parameter (the papers do not state theirs). ``letter``: 10,500
training / 5,000 test rows, 16 features, 26 classes, 100 hidden units (D = 4,326);
``connect-4``: 54,046 / 13,511 rows, 126 features, 3 classes, 20 hidden units (D = 2,603): the
papers' Table 2. Minibatches of n = 1,000 (the mCCAdL paper's n; the CCAdL paper's 500-1,000).

Every sampler starts from the same point (W, U ~ N(0, 0.1^2), seeded; c = d = 0: at W = 0 the
hidden units are interchangeable) and runs a fixed number of passes over the training data at
one step size and friction per data set, without warm-up adaptation (the papers' unit-mass
schemes). The example records

* the test error of the posterior predictive mean (class probabilities averaged over the draws,
  the first 20 % of the draws so far discarded as burn-in, as in the papers) against passes:
  the papers' Figure 3 (CCAdL) and Figure 4 (mCCAdL);
* the posterior expected log loss (each draw's mean test log loss, averaged over the draws after
  the 20 % burn-in): the mCCAdL paper's Table 3;
* the number of diverging draws (a run that diverged gets NaN, the papers' convention).

Run: ``.venv/bin/python examples/drbm.py [--quick] [--output-dir DIR]``; the figure alone is
redrawn from the CSV files by ``plot_curves(folder)``.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pymc as pm
import pytensor.tensor as pt
from _common import parse_args, passes, results_dir, sample, save_figure, write_table
from _data import load

from pymc_sgmcmc import NOGIN, SGHMC, SGLD, SGNHT, CCAdL, MCCAdL

NAME = "drbm"
BATCH = 1_000
PRIOR_SD = 1.0
INIT_SD = 0.1
SAMPLERS = ["SGLD", "SGHMC", "SGNHT", "CCAdL", "mCCAdL", "NOGIN"]


@dataclass(frozen=True)
class Setting:
    """One data set's experiment: its folder in ``../shared/data``, hidden units, step size h,
    friction A (SGLD runs with epsilon = h^2 and has no A: it runs in the A = 1 settings only)
    and passes over the training data per run (NOGIN: half, see :func:`settings`)."""

    dataset: str
    hidden: int
    h: float
    friction: float
    passes: int


#: letter: h = 2e-2, A = 1, the smallest step size of the mCCAdL paper's Figure 4 / Table 3;
#: with the largest curvature lambda_max ~ 1.1e4 of this model at the start, h * sqrt(lambda_max)
#: ~ 2 (the edge of the Euler schemes' stability). connect-4: the CCAdL paper gives its step
#: sizes only in Figure 3; h = 3e-3 puts h * sqrt(lambda_max) at ~ 1 (lambda_max ~ 1.1e5 at the
#: start; at h = 1e-3 one pass did not yet leave the majority-class answer). Letter at both of
#: the paper's frictions and 100 passes (at 20 every curve was still falling steeply);
#: connect-4 at A = 1 and 20 passes.
SETTINGS = [
    Setting("letter", 100, 2e-2, 1.0, 100),
    Setting("letter", 100, 2e-2, 10.0, 100),
    Setting("connect4", 20, 3e-3, 1.0, 20),
]
#: mCCAdL paper, Table 3, letter, h = 2e-2: posterior expected log loss (A = 1, A = 10).
PAPER_LOG_LOSS = {
    ("letter", 1.0): {"SGHMC": 1.5244, "SGNHT": 0.4269, "CCAdL": np.nan, "mCCAdL": 0.4320},
    ("letter", 10.0): {"SGHMC": 0.3299, "SGNHT": 0.3029, "CCAdL": np.nan, "mCCAdL": 0.2656},
}


def load_dataset(name: str) -> dict[str, np.ndarray]:
    """Features as float64 (letter is already scaled to [-1, 1]; connect-4 is 0/1), labels as
    int32 class indices (``pm.Categorical`` observes int32)."""
    data = load(name)
    return {
        "X": data["X_train"].astype(np.float64),
        "y": data["y_train"].astype(np.int32),
        "X_test": data["X_test"].astype(np.float64),
        "y_test": data["y_test"].astype(np.int32),
    }


def negative_free_energy(x, W, U, c, d, softplus: Callable = pt.softplus):
    """-F(x, y) for every class y, shape (rows, C): d_y + sum_j softplus(c_j + U_jy + x W_:j).

    Works on PyTensor tensors (the model) and, with ``softplus=np.logaddexp(0, .)``, on NumPy
    arrays (the test-set predictions).
    """
    hidden = x @ W + c  # (rows, H)
    return d + softplus(hidden[:, :, None] + U[None, :, :]).sum(axis=1)


def build_model(X: np.ndarray, y: np.ndarray, hidden: int) -> pm.Model:
    """The DRBM as a PyMC model: exact class marginalisation, one Categorical term per row."""
    n_obs, n_features = X.shape
    classes = int(y.max()) + 1
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=BATCH)
        W = pm.Normal("W", 0.0, PRIOR_SD, shape=(n_features, hidden))
        U = pm.Normal("U", 0.0, PRIOR_SD, shape=(hidden, classes))
        c = pm.Normal("c", 0.0, PRIOR_SD, shape=hidden)
        d = pm.Normal("d", 0.0, PRIOR_SD, shape=classes)
        logits = negative_free_energy(X_mb, W, U, c, d)
        pm.Categorical("y", logit_p=logits, observed=y_mb, total_size=n_obs)
    return model


def initial_values(n_features: int, hidden: int, classes: int, seed: int) -> dict:
    """Small random weights: at W = U = 0 all hidden units would get the same gradient."""
    rng = np.random.default_rng(seed)
    return {
        "W": INIT_SD * rng.standard_normal((n_features, hidden)),
        "U": INIT_SD * rng.standard_normal((hidden, classes)),
        "c": np.zeros(hidden),
        "d": np.zeros(classes),
    }


def step_factory(sampler: str, h: float, friction: float, thin: int) -> Callable[[], Any]:
    """The six samplers at one (h, A). SGHMC with B-hat = 0 and SGNHT in Ding et al.'s Euler
    form (the papers' baselines); CCAdL with the diagonal covariance (the CCAdL paper's choice
    for the DRBM); mCCAdL with the diagonal covariance too: its C step then works on a
    diagonal, one O(nD) pass per step, whereas the low-rank form needed s * m = 18 * 30
    covariance-vector products per step at h = 2e-2 on letter with the Taylor C step of the
    time (seconds per step here; the Lanczos product that replaced it takes 17 on average,
    at most 28, over the first 300 steps, about 0.5 s per step with D = 4,326 and n = 1,000;
    the mCCAdL paper used the full covariance); NOGIN with conjugate gradients (its Woodbury solve
    forms an n x n = 1000 x 1000 system every step)."""
    # The papers' unit-mass schemes: no preconditioner adapted during tune.
    common = {"thin": thin, "adapt_preconditioner": False, "block_steps": 1_000}
    makers = {
        "SGLD": lambda: SGLD(step_size=h * h, **common),
        "SGHMC": lambda: SGHMC(step_size=h, friction=friction, **common),
        "SGNHT": lambda: SGNHT(step_size=h, friction=friction, splitting="euler", **common),
        # The paper's estimate of the noise at every step (the default takes one every 10).
        "CCAdL": lambda: CCAdL(
            step_size=h, friction=friction, covariance="diag", averaging_interval=1, **common
        ),
        "mCCAdL": lambda: MCCAdL(step_size=h, friction=friction, covariance="diag", **common),
        "NOGIN": lambda: NOGIN(step_size=h, friction=friction, solver="cg", **common),
    }
    return makers[sampler]


def class_probabilities(params: dict[str, np.ndarray], X: np.ndarray) -> np.ndarray:
    """p(y | x) for every test row (rows x C) at one draw of the parameters."""
    logits = negative_free_energy(
        X, params["W"], params["U"], params["c"], params["d"], softplus=_np_softplus
    )
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    return probs / probs.sum(axis=1, keepdims=True)


def _np_softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def evaluate(draws: dict[str, np.ndarray], X: np.ndarray, y: np.ndarray, checkpoints: np.ndarray):
    """Test error of the predictive mean after ``t`` draws (for each t in ``checkpoints``,
    averaging draws ``t // 5 .. t - 1``: a 20 % burn-in of the run so far), and each draw's
    mean test log loss.

    One pass over the draws: running sums of the class probabilities are kept only at the
    draw counts the curve needs (t and t // 5).
    """
    n_draws = len(next(iter(draws.values())))
    needed = set(int(t) for t in checkpoints) | {int(t) // 5 for t in checkpoints}
    total = np.zeros((len(y), draws["U"].shape[-1]))  # U is H x C
    sums = {0: total.copy()}
    losses = np.empty(n_draws)
    for k in range(n_draws):
        probs = class_probabilities({name: value[k] for name, value in draws.items()}, X)
        losses[k] = -np.mean(np.log(probs[np.arange(len(y)), y]))
        total += probs
        if k + 1 in needed:
            sums[k + 1] = total.copy()
    errors = []
    for t in checkpoints:
        start = int(t) // 5
        mean_probs = (sums[int(t)] - sums[start]) / (int(t) - start)
        errors.append(float(np.mean(mean_probs.argmax(axis=1) != y)))
    return np.array(errors), losses


def run_cell(setting: Setting, model, data, init, sampler: str, budget, seed: int):
    """One (data set, sampler) run: its table row and its test-error curve against passes."""
    n_obs, thin = len(data["y"]), budget["thin"][setting.dataset]
    n_passes = budget["passes"] or setting.passes
    n_passes = max(1, round(n_passes * budget["passes_factor"].get(sampler, 1.0)))
    n_draws = round(n_passes * n_obs / BATCH) // thin
    make_step = step_factory(sampler, setting.h, setting.friction, thin)
    run = sample(model, make_step, draws=n_draws, tune=0, seed=seed, initvals=init)
    draws = {name: run.draws(name)[0] for name in ("W", "U", "c", "d")}
    checkpoints = np.unique(np.geomspace(1, n_draws, 30).astype(int))
    errors, losses = evaluate(draws, data["X_test"], data["y_test"], checkpoints)
    diverged = bool(run.stat("diverging")[0].any())
    row = {
        "dataset": setting.dataset,
        "sampler": sampler,
        "h": setting.h if sampler != "SGLD" else setting.h**2,
        "A": setting.friction if sampler != "SGLD" else np.nan,
        "passes": n_passes,
        "draws": n_draws,
        # A run that diverged is the papers' NaN: its draws are restarts, not samples.
        "test_error": errors[-1] if not diverged else np.nan,
        "expected_log_loss": float(losses[n_draws // 5 :].mean()) if not diverged else np.nan,
        "paper_log_loss": PAPER_LOG_LOSS.get((setting.dataset, setting.friction), {}).get(
            sampler, np.nan
        ),
        "divergences": run.divergences,
        "seconds": run.seconds,
    }
    return row, passes(checkpoints * thin, BATCH, n_obs), errors


def settings(quick: bool) -> dict[str, Any]:
    """Budgets. Full: each setting's passes (letter 100 = 1,050 steps, connect-4 20 = 1,081
    steps), NOGIN half of them (its conjugate-gradient O step costs about ten times a step of
    the others). Quick: 1 pass on letter at A = 1, SGNHT and CCAdL (the CI check that a
    Categorical DRBM samples, per-observation gradients included; CCAdL's explicit damping
    diverges on connect-4 at h = 3e-3, see examples/README.md)."""
    if quick:
        return {
            "passes": 1,
            "passes_factor": {},
            "thin": {"letter": 1},
            "samplers": ["SGNHT", "CCAdL"],
            "settings": SETTINGS[:1],
        }
    return {
        "passes": None,  # each setting's own
        "passes_factor": {"NOGIN": 0.5},
        "thin": {"letter": 2, "connect4": 10},
        "samplers": SAMPLERS,
        "settings": SETTINGS,
    }


def plot_curves(folder: Path) -> Path:
    """Test error of the predictive mean against passes, one panel per data set (the papers'
    Figure 3 / Figure 4), from the ``test_error.csv`` and ``test_error_curves.csv`` in
    ``folder``; a run that diverged is drawn dotted (its draws are restarts from its last sane
    draw, not samples)."""
    table = _read_csv(folder / "test_error.csv")
    curves = _read_csv(folder / "test_error_curves.csv")
    diverged = {
        (r["dataset"], _friction(r), r["sampler"]) for r in table if int(r["divergences"]) > 0
    }
    panels = [s for s in SETTINGS if any(_same_setting(r, s) for r in table)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    colours = dict(zip(SAMPLERS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, setting in zip(axes[0], panels, strict=True):
        key = (setting.dataset, setting.friction)
        for sampler in dict.fromkeys(r["sampler"] for r in table if _same_setting(r, setting)):
            points = [r for r in curves if _same_setting(r, setting) and r["sampler"] == sampler]
            x = [float(r["passes"]) for r in points]
            errors = [float(r["test_error"]) for r in points]
            bad = (*key, sampler) in diverged
            label = f"{sampler} (diverged)" if bad else sampler
            style = ":" if bad else "-"
            ax.semilogx(x, errors, style, color=colours[sampler], label=label)
        ax.set_title(
            f"{setting.dataset}, H = {setting.hidden}, h = {setting.h:g}, A = {setting.friction:g}"
        )
        ax.set_xlabel("passes over the training data")
        ax.set_ylabel("test error of the predictive mean")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, folder / "test_error.png")


def _friction(row: dict[str, str]) -> float:
    """A CSV row's friction; SGLD's (nan: it has none) is drawn in the A = 1 panel."""
    return float(row["A"]) if row["A"] not in ("", "nan") else 1.0


def _same_setting(row: dict[str, str], setting: Setting) -> bool:
    """Whether a CSV row (table or curve) belongs to ``setting``."""
    return row["dataset"] == setting.dataset and _friction(row) == setting.friction


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def write_results(rows: list[dict], curve_rows: list[dict], budget: dict, folder: Path) -> None:
    """Write ``test_error.md``/``.csv`` and ``test_error_curves.csv`` from the runs so far."""
    fewer = ", ".join(f"{k}: x{v:g}" for k, v in budget["passes_factor"].items())
    notes = (
        "passes per run as listed" + (f" ({fewer})" if fewer else "") + ", from the "
        f"same seeded start, n = {BATCH}, one chain, no warm-up adaptation. test_error: of the "
        "predictive mean over the last 80 % of the draws; expected_log_loss: mean over those "
        "draws of each draw's mean test log loss (NaN: the run diverged); paper_log_loss: the "
        "mCCAdL paper's Table 3 (letter, h = 2e-2); SGLD's h is its epsilon = h^2; seconds "
        "include compilation."
    )
    write_table(rows, folder, "test_error", "Discriminative RBM: test error and log loss", notes)
    write_table(curve_rows, folder, "test_error_curves", "Test error against passes")
    (folder / "test_error_curves.md").unlink()  # the curves are for plotting; the CSV is enough


def main(quick: bool = False, output_dir: str | Path | None = None) -> list[dict]:
    """Run the experiment; write ``test_error.md``/``.csv``, ``test_error_curves.csv`` and
    ``test_error.png``."""
    folder = results_dir(NAME, output_dir)
    budget = settings(quick)
    rows, curve_rows = [], []
    for setting in budget["settings"]:
        data = load_dataset(setting.dataset)
        model = build_model(data["X"], data["y"], setting.hidden)
        classes = int(data["y"].max()) + 1
        init = initial_values(data["X"].shape[1], setting.hidden, classes, seed=2015)
        for k, sampler in enumerate(budget["samplers"]):
            if sampler == "SGLD" and setting.friction != 1.0:
                continue  # SGLD has no friction: one run per data set
            row, x, errors = run_cell(setting, model, data, init, sampler, budget, seed=30 + k)
            rows.append(row)
            curve_rows += [
                {
                    "dataset": setting.dataset,
                    "A": setting.friction,
                    "sampler": sampler,
                    "passes": p,
                    "test_error": e,
                }
                for p, e in zip(x, errors, strict=True)
            ]
            print(", ".join(f"{key}={value}" for key, value in row.items()), flush=True)
            write_results(rows, curve_rows, budget, folder)  # after every run: long jobs
    plot_curves(folder)
    return rows


if __name__ == "__main__":
    main(**parse_args(__doc__))
