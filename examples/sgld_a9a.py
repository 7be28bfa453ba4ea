"""SGLD paper section 5.2 / Figure 3: Bayesian logistic regression on a9a with SGLD.

Welling & Teh (2011), section 5.2: p(y_i | x_i) = sigma(y_i beta^T x_i) with the bias absorbed
into beta through a constant -1 entry of x_i, a Laplace prior of scale 1 on every coordinate of
beta, minibatches of 10, and in each run a random 80 % of a9a's 32,561 rows for training and the
other 20 % for testing. The step sizes decrease as eps_t = a (b + t)^(-gamma) (the package's
``SGLD(step_size=PolynomialDecay(a, b, gamma))``). Against sweeps (passes) through the training
split the example records, for several seeded runs (split and chain):

* the log joint probability per training item, (log p(beta) + sum_i log p(y_i | x_i, beta)) / N,
  of every stored draw (the paper's Figure 3, left);
* the test accuracy of every stored draw (Figure 3, right);
* the test accuracy of the running posterior-mean prediction of section 4.2: the class
  probabilities averaged over the draws so far with weights eps_t, the first 20 % of those draws
  dropped as burn-in;
* as a reference, the maximum a posteriori (MAP) point of each split, found by L-BFGS-B on the
  full data: its log joint minus D / (2N) (the Gaussian approximation of the posterior mean of
  the log joint), or minus (D + Z) / (2N) with the Z coordinates that sit at the Laplace prior's
  kink counted as Laplace-distributed, is about where the per-draw log joint should level off.

Run: ``.venv/bin/python examples/sgld_a9a.py [--quick] [--output-dir DIR]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pymc as pm
from _common import parse_args, passes, results_dir, sample, save_figure, write_table
from _data import load
from scipy import optimize, sparse, special

from pymc_sgmcmc import SGLD, PolynomialDecay

NAME = "sgld_a9a"
BATCH = 10
TRAIN_FRACTION = 0.8
PRIOR_SCALE = 1.0
#: Fraction of the draws so far dropped before the step-size-weighted average (burn-in).
BURN_IN = 0.2
#: Step-size schedule eps_t = a (b + t)^(-gamma). The paper gives gamma = 0.55 (section 5.1) but
#: not a or b for a9a. The largest eigenvalue of the negative log posterior's Hessian at
#: beta = 0 is about 4.7e4 on a training split (deterministic stability limit eps < 8.5e-5);
#: eps_0 = 1e-5 and b = 1,000 steps (0.4 sweeps) make eps_t fall to 1.6e-6 after 10 sweeps and
#: 1.1e-6 after 20. Larger eps_0 (4e-5, 8e-5) reach the same accuracy but leave the per-draw log
#: joint noisier (hotter: the minibatch noise dominates); the README lists the schedules tried.
EPS_0, SCHEDULE_B, GAMMA = 1e-5, 1_000.0, 0.55
#: Sweeps at which the table reports the curves.
TABLE_SWEEPS = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0]


def schedule(eps_0: float = EPS_0, b: float = SCHEDULE_B, gamma: float = GAMMA) -> PolynomialDecay:
    """The polynomial decay with eps_0 = a b^(-gamma) at the first step."""
    return PolynomialDecay(a=eps_0 * b**gamma, b=b, gamma=gamma)


def load_pool() -> tuple[np.ndarray, np.ndarray]:
    """a9a's 32,561 LIBSVM training rows (the paper's data set) with the bias column -1 appended,
    and the labels in {0, 1}. (a9a's one-hot groups sum to one per row, so the bias is collinear
    with them; the Laplace prior keeps the posterior proper, and the paper includes it.)"""
    data = load("a9a")
    X = data["X_train"].astype(float)
    X = np.hstack([X, -np.ones((len(X), 1))])
    return X, data["y_train"].astype(float)


def split(n_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A random 80 / 20 split of the row numbers (training, test)."""
    order = np.random.default_rng(seed).permutation(n_rows)
    n_train = round(TRAIN_FRACTION * n_rows)
    return order[:n_train], order[n_train:]


def build_model(X: np.ndarray, y: np.ndarray) -> pm.Model:
    """The paper's model as an ordinary PyMC model on minibatches of 10 training rows."""
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=BATCH)
        beta = pm.Laplace("beta", 0.0, PRIOR_SCALE, shape=X.shape[1])
        pm.Bernoulli("y", logit_p=X_mb @ beta, observed=y_mb, total_size=len(y))
    return model


def log_joint(beta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Log joint probability per training item, log p(beta, y | X) / N, for each row of ``beta``
    (draws x D); the Laplace prior's normalising constant is included, as in ``model.logp()``."""
    beta = np.atleast_2d(beta)
    signed = (X @ beta.T) * np.where(y > 0.5, 1.0, -1.0)[:, None]  # rows x draws
    loglik = -np.logaddexp(0.0, -signed).sum(axis=0)
    logprior = -np.abs(beta).sum(axis=1) / PRIOR_SCALE - beta.shape[1] * np.log(2 * PRIOR_SCALE)
    return (loglik + logprior) / len(y)


def accuracy(beta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Test accuracy of the prediction sign(x^T beta) for each row of ``beta`` (draws x D)."""
    return np.mean((X @ np.atleast_2d(beta).T > 0) == (y[:, None] > 0.5), axis=0)


def weighted_running_prediction(
    beta: np.ndarray, eps: np.ndarray, X: np.ndarray, y: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy and mean log predictive density on (X, y) of the section 4.2 estimate after each
    draw k: p(y = 1 | x) = sum_t eps_t sigma(x^T beta_t) / sum_t eps_t over the draws
    t in [floor(BURN_IN * (k + 1)), k]."""
    prob = special.expit(X @ beta.T).astype(np.float32)  # rows x draws
    weighted = np.zeros((len(X), len(eps) + 1), dtype=np.float64)
    np.cumsum(prob * eps.astype(np.float32), axis=1, out=weighted[:, 1:])
    total = np.concatenate([[0.0], np.cumsum(eps)])
    end = np.arange(1, len(eps) + 1)
    start = np.floor(BURN_IN * end).astype(int)
    mean_prob = (weighted[:, end] - weighted[:, start]) / (total[end] - total[start])
    mean_prob = np.clip(mean_prob, 1e-12, 1 - 1e-12)
    positive = y[:, None] > 0.5
    acc = np.mean((mean_prob > 0.5) == positive, axis=0)
    logpred = np.mean(np.where(positive, np.log(mean_prob), np.log1p(-mean_prob)), axis=0)
    return acc, logpred


def map_point(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The MAP of the Laplace-prior logistic regression by L-BFGS-B on beta = u - v with
    u, v >= 0, which turns the non-smooth |beta| into the linear sum(u + v). The indicators are
    about 11 % non-zero, so a sparse X makes each of the few hundred iterations cheap."""
    sign = np.where(y > 0.5, 1.0, -1.0)
    X = sparse.csr_matrix(X)
    dim = X.shape[1]

    def objective(uv: np.ndarray) -> tuple[float, np.ndarray]:
        beta = uv[:dim] - uv[dim:]
        margin = sign * (X @ beta)
        value = np.logaddexp(0.0, -margin).sum() + uv.sum() / PRIOR_SCALE
        grad_beta = -X.T @ (sign * special.expit(-margin))
        grad = np.concatenate([grad_beta, -grad_beta]) + 1.0 / PRIOR_SCALE
        return value, grad

    bounds = [(0.0, None)] * (2 * dim)
    result = optimize.minimize(
        objective, np.zeros(2 * dim), jac=True, method="L-BFGS-B", bounds=bounds,
        options={"maxiter": 5_000, "ftol": 1e-10, "gtol": 1e-5},
    )  # fmt: skip
    return result.x[:dim] - result.x[dim:]


def settings(quick: bool) -> dict[str, Any]:
    """Budgets: 50 runs of 20 sweeps in full mode (the paper's number of runs), 2 runs of half
    a sweep in quick mode. Every 26th step is stored (about 100 draws per sweep)."""
    if quick:
        return {"runs": 2, "sweeps": 0.5, "thin": 26}
    return {"runs": 50, "sweeps": 20.0, "thin": 26}


def run_split(
    X: np.ndarray,
    y: np.ndarray,
    seed: int,
    budget: dict,
    step_schedule: PolynomialDecay | None = None,
) -> dict[str, np.ndarray]:
    """One run: a fresh split and SGLD chain from beta = 0; the curves at every stored draw.
    ``step_schedule`` defaults to :func:`schedule` (``scan_schedules`` passes others)."""
    step_schedule = schedule() if step_schedule is None else step_schedule
    train, test = split(len(y), seed)
    X_train, y_train, X_test, y_test = X[train], y[train], X[test], y[test]
    n_train, thin = len(train), budget["thin"]
    n_draws = int(np.ceil(budget["sweeps"] * n_train / BATCH / thin))
    model = build_model(X_train, y_train)

    def make_step() -> SGLD:
        # The paper's plain SGLD: no preconditioner, no tuning phase (tune=0 below). One
        # compiled block for the whole run: the package's runaway check flags ordinary
        # minibatch log-densities as divergences from the second block on when n = 10 (see
        # the README, "Package bugs"); within the first block it compares with the starting
        # point's log-density, whose margin is ten times larger. (The package caps a block at
        # 64 MiB of positions, 67,650 steps at D = 124: runs beyond about 26 sweeps would have
        # several blocks.)
        return SGLD(
            step_size=step_schedule,
            thin=thin,
            adapt_preconditioner=False,
            block_steps=n_draws * thin,
        )

    run = sample(model, make_step, draws=n_draws, tune=0, seed=seed)
    beta, eps = run.draws("beta")[0], run.stat("step_size")[0]
    mean_acc, mean_logpred = weighted_running_prediction(beta, eps, X_test, y_test)
    beta_map = map_point(X_train, y_train)
    lj = log_joint(beta, X_train, y_train)
    map_lj = float(log_joint(beta_map, X_train, y_train)[0])
    return {
        "sweeps": passes(thin * np.arange(1, n_draws + 1), BATCH, n_train),
        "log_joint": lj,
        "accuracy": accuracy(beta, X_test, y_test),
        "mean_accuracy": mean_acc,
        "mean_logpred": mean_logpred,
        "eps": eps,
        "map_log_joint": map_lj,
        # Coordinates at the Laplace prior's kink: L-BFGS-B leaves both u_j and v_j at 0.
        "map_zeros": int(np.sum(np.abs(beta_map) < 1e-6)),
        # Second half of the run: the per-draw log joint below the same split's MAP, averaged.
        "late_gap": float(np.mean(lj[len(lj) // 2 :]) - map_lj),
        "map_accuracy": float(accuracy(beta_map, X_test, y_test)[0]),
        "majority_accuracy": float(max(y_test.mean(), 1 - y_test.mean())),
        "dim": X.shape[1],
        "n_train": n_train,
        "divergences": run.divergences,
        "seconds": run.seconds,
    }


CURVES = ["log_joint", "accuracy", "mean_accuracy", "mean_logpred"]
#: The (eps_0, b) pairs tried before choosing the schedule; b = 12 makes eps_t fall by a factor
#: of 100 over 20 sweeps, like the paper's section 5.1 schedule over its run.
SCAN = [(1e-5, 1_000.0), (4e-5, 1_000.0), (8e-5, 1_000.0), (4e-5, 12.0)]


def scan_schedules(
    output_dir: str | Path | None = None, seed: int = 2011, sweeps: float = 10.0
) -> list[dict]:
    """The step-size schedules tried (``SCAN``), one run each on the same split and seed; writes
    ``schedules.md``/``.csv``. Not part of ``main``: run it from ``examples/`` with
    ``python -c "import sgld_a9a; sgld_a9a.scan_schedules()"``."""
    folder = results_dir(NAME, output_dir)
    X, y = load_pool()
    budget = {"runs": 1, "sweeps": sweeps, "thin": 26}
    rows = []
    for eps_0, b in SCAN:
        run = run_split(X, y, seed, budget, step_schedule=schedule(eps_0, b))
        row: dict[str, Any] = {"eps_0": eps_0, "b": b, "gamma": GAMMA}
        for target in (1.0, 5.0, sweeps):
            k = int(np.searchsorted(run["sweeps"], target + 1e-9)) - 1
            row[f"log_joint_{target:g}"] = float(run["log_joint"][k])
        row |= {
            "map_log_joint": run["map_log_joint"],
            "accuracy": float(run["accuracy"][-1]),
            "mean_accuracy": float(run["mean_accuracy"][-1]),
            "mean_logpred": float(run["mean_logpred"][-1]),
            "divergences": run["divergences"],
        }
        rows.append(row)
    notes = (
        f"One run per schedule eps_t = a (b + t)^(-gamma) with eps_0 = a b^(-gamma), split and "
        f"chain seed {seed}, {sweeps:g} sweeps; log_joint_S: per-draw log joint per training "
        f"item at S sweeps; accuracy, mean_accuracy, mean_logpred as in sweeps.md, at {sweeps:g} "
        "sweeps."
    )
    write_table(rows, folder, "schedules", "Step-size schedules tried", notes)
    return rows


def summary_rows(runs: list[dict], table_sweeps: list[float]) -> list[dict]:
    """Mean and standard deviation over the runs of each curve at the given sweeps (the last
    stored draw at or before each), plus the MAP reference and the runs' totals."""
    rows = []
    for target in table_sweeps:
        if target > runs[0]["sweeps"][-1] + 1e-9:
            continue
        k = int(np.searchsorted(runs[0]["sweeps"], target + 1e-9)) - 1
        row: dict[str, Any] = {"sweeps": round(float(runs[0]["sweeps"][k]), 3)}
        row["eps"] = float(runs[0]["eps"][k])
        for name in CURVES:
            values = np.array([r[name][k] for r in runs])
            row[f"{name}_mean"] = float(values.mean())
            row[f"{name}_sd"] = float(values.std(ddof=1)) if len(runs) > 1 else np.nan
        rows.append(row)
    return rows


def reference_row(runs: list[dict]) -> dict:
    """The MAP reference and totals, averaged over the runs' splits."""
    dim, n_train = runs[0]["dim"], runs[0]["n_train"]
    map_lj = np.array([r["map_log_joint"] for r in runs])
    gaps = np.array([r["late_gap"] for r in runs])
    return {
        "runs": len(runs),
        "map_log_joint": float(map_lj.mean()),
        "expected_log_joint_laplace": float(map_lj.mean() - dim / (2 * n_train)),
        "late_gap": float(gaps.mean()),
        # The runs are independent: the standard error of their mean is sd / sqrt(runs).
        "late_gap_se": float(gaps.std(ddof=1) / np.sqrt(len(runs))) if len(runs) > 1 else np.nan,
        "laplace_gap": -dim / (2 * n_train),
        "kink_gap": -(dim + float(np.mean([r["map_zeros"] for r in runs]))) / (2 * n_train),
        "map_zeros": float(np.mean([r["map_zeros"] for r in runs])),
        "map_accuracy": float(np.mean([r["map_accuracy"] for r in runs])),
        "majority_accuracy": float(np.mean([r["majority_accuracy"] for r in runs])),
        "divergences": int(sum(r["divergences"] for r in runs)),
        "seconds": float(sum(r["seconds"] for r in runs)),
    }


def plot_figure3(runs: list[dict], path: Path) -> Path:
    """The paper's Figure 3: log joint per item (left) and test accuracy (right) against sweeps,
    mean over runs with +-1 standard deviation dotted; the right panel adds the weighted
    posterior-mean prediction, and a red dashed line at the mean accuracy after 10 sweeps."""
    x = runs[0]["sweeps"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = [
        (axes[0], [("log_joint", "per draw", "C0")], "average log joint probability per item"),
        (
            axes[1],
            [("accuracy", "per draw", "C0"), ("mean_accuracy", "weighted mean prediction", "C2")],
            "accuracy on test set",
        ),
    ]
    for ax, curves, ylabel in panels:
        for name, label, colour in curves:
            values = np.array([r[name] for r in runs])
            mean, sd = values.mean(axis=0), values.std(axis=0)
            ax.semilogx(x, mean, color=colour, label=label)
            ax.semilogx(x, mean - sd, ":", color=colour, lw=0.8)
            ax.semilogx(x, mean + sd, ":", color=colour, lw=0.8)
        ax.set_xlabel("number of sweeps through the training data")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ref = reference_row(runs)
    axes[0].axhline(ref["expected_log_joint_laplace"], color="k", ls="--", lw=0.8,
                    label="MAP - D/(2N)")  # fmt: skip
    axes[0].set_ylim(ref["map_log_joint"] - 0.25, ref["map_log_joint"] + 0.02)
    axes[1].axhline(ref["majority_accuracy"], color="grey", ls="--", lw=0.8, label="majority class")
    if x[-1] >= 10:
        k = int(np.searchsorted(x, 10 + 1e-9)) - 1
        level = np.mean([r["accuracy"][k] for r in runs])
        axes[1].axhline(level, color="r", ls="--", lw=0.8, label="per-draw accuracy at 10 sweeps")
    axes[1].set_ylim(ref["majority_accuracy"] - 0.02, ref["map_accuracy"] + 0.02)
    for ax in axes:
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"SGLD on a9a, {len(runs)} runs (random 80/20 splits), batch size {BATCH}")
    fig.tight_layout()
    return save_figure(fig, path)


def main(quick: bool = False, output_dir: str | Path | None = None) -> list[dict]:
    """Run the experiment; write ``sweeps.md``/``.csv``, ``reference.md``/``.csv``,
    ``curves.csv`` and ``figure3.png``."""
    folder = results_dir(NAME, output_dir)
    budget = settings(quick)
    X, y = load_pool()
    runs = []
    for k in range(budget["runs"]):
        runs.append(run_split(X, y, seed=2011 + k, budget=budget))
        last = {name: round(float(runs[-1][name][-1]), 4) for name in CURVES}
        print(f"run {k}: {last}, {runs[-1]['seconds']:.1f} s", flush=True)
    rows = summary_rows(runs, TABLE_SWEEPS)
    write_results(rows, runs, budget, folder)
    plot_figure3(runs, folder / "figure3.png")
    return rows


def write_results(rows: list[dict], runs: list[dict], budget: dict, folder: Path) -> None:
    """The table at selected sweeps, the reference row and the mean curves (CSV)."""
    sched = schedule()
    notes = (
        f"{len(runs)} runs (seeded random 80/20 splits of a9a's 32,561 training rows, one SGLD "
        f"chain each from beta = 0), {budget['sweeps']:g} sweeps per run, batch "
        f"size {BATCH}, every {budget['thin']}th step stored; eps_t = {sched.a:.4g} "
        f"({sched.b:g} + t)^(-{sched.gamma}). Mean and standard deviation (sd) over the runs. "
        "log_joint: per training item, per draw; accuracy: test accuracy per draw; "
        "mean_accuracy, mean_logpred: test accuracy and mean log predictive density of the "
        f"eps-weighted average of the predictive probabilities over the draws so far (first "
        f"{BURN_IN:.0%} dropped); eps: the step size at that sweep."
    )
    write_table(rows, folder, "sweeps", "SGLD on a9a (Welling & Teh 2011, Figure 3)", notes)
    ref_notes = (
        "MAP by L-BFGS-B on each training split (mean over the splits); "
        "expected_log_joint_laplace = map_log_joint - D/(2N), the Laplace approximation of the "
        "posterior mean of the log joint per item; late_gap (standard error late_gap_se over the "
        "runs): per-draw log joint per item averaged over the second half of each run, minus "
        "the same split's MAP value, to compare with laplace_gap = -D/(2N) and with kink_gap = "
        "-(D + Z)/(2N), the Laplace approximation with the Z = map_zeros coordinates at the "
        "prior's kink (MAP exactly 0) counted as Laplace-distributed (a drop of 1 each in the "
        "log joint instead of 1/2); majority_accuracy: "
        "always predicting the more frequent test label; seconds: pm.sample wall time summed "
        "over the runs (compilation included)."
    )
    write_table([reference_row(runs)], folder, "reference", "Reference values", ref_notes)
    # Six significant digits keep the CSV small; the runs' spread is in the third.
    curve_rows = [
        {
            "sweeps": float(f"{s:.6g}"),
            **{name: float(f"{np.mean([r[name][k] for r in runs]):.6g}") for name in CURVES},
        }
        for k, s in enumerate(runs[0]["sweeps"])
    ]
    write_table(curve_rows, folder, "curves", "Mean curves over the runs")
    (folder / "curves.md").unlink()  # the curves are for plotting; the CSV is enough


if __name__ == "__main__":
    main(**parse_args(__doc__))
