"""Main example: Bayesian logistic regression on a9a (UCI Adult) with NOGIN, inside pm.sample.

The model of Welling & Teh (2011, section 5.2): a Laplace prior on the 123 weights, here with
an unknown prior scale (a log-transformed free variable); minibatches of 500 of the 32,561
training rows through ``pm.Minibatch``. (No separate intercept: a9a's one-hot groups already sum
to one per row, so an intercept would be collinear with them.) Prints ``az.summary``, the test
accuracy of the posterior predictive, and saves a trace plot in ``examples/output/``.

The draws are compared with a NUTS reference on the full data (``benchmarks/a9a_reference.py``,
committed in ``benchmarks/references/a9a_nuts.npz``).

Run: ``make example`` (or ``.venv/bin/python examples/a9a_logistic_regression.py [--quick]
[--output-dir DIR]``); ``tests/test_examples.py`` runs the quick mode.
"""

from __future__ import annotations

import time
from pathlib import Path

import arviz as az
import matplotlib

matplotlib.use("Agg")
import numpy as np
import pymc as pm
from _common import OUTPUT_ROOT, parse_args
from _data import load

from pymc_sgmcmc import NOGIN

#: Rows per minibatch.
BATCH_SIZE = 500
#: The NUTS reference of this posterior (``benchmarks/a9a_reference.py``): per-coordinate
#: means, sds and Monte Carlo errors of nutpie's draws on the full data.
REFERENCE = Path(__file__).resolve().parents[1] / "benchmarks" / "references" / "a9a_nuts.npz"


def training_rows() -> tuple[np.ndarray, np.ndarray]:
    """a9a's 32,561 training rows: the 123 binary features and the labels, as floats."""
    data = load("a9a")
    return data["X_train"].astype(float), data["y_train"].astype(float)


def build_model(X: np.ndarray, y: np.ndarray, batch_size: int | None = BATCH_SIZE) -> pm.Model:
    """The model on minibatches of ``batch_size`` rows, or on the full data (``None``: the
    NUTS reference's)."""
    n_obs, n_features = X.shape
    with pm.Model(coords={"feature": np.arange(n_features)}) as model:
        X_mb, y_mb = (X, y) if batch_size is None else pm.Minibatch(X, y, batch_size=batch_size)
        scale = pm.HalfNormal("prior_scale", 1.0)
        w = pm.Laplace("w", 0.0, scale, dims="feature")
        pm.Bernoulli("y", logit_p=X_mb @ w, observed=y_mb, total_size=n_obs)
    return model


def sample(X: np.ndarray, y: np.ndarray, quick: bool = False) -> tuple[az.DataTree, NOGIN, float]:
    """NOGIN on the minibatch model: the draws, the step and the wall time of ``pm.sample``."""
    with build_model(X, y):
        # h = 3e-3 is about 1/sqrt(largest curvature) (~1e5 here, from the frequent indicators);
        # friction A = 1 as in the papers' experiments. The rare indicators make the posterior
        # ill-conditioned (curvatures spread over ~1e4) and the gradient noise uneven across
        # the weights (0 to ~1e5 in the preconditioned coordinates). NOGIN damps the noise by
        # its estimated covariance; SGNHT's thermostat absorbs only its average over the
        # weights and, at this step size, drew sds 0.19-0.62 of NOGIN's and a prior scale of
        # 0.32 against 0.45 (it warns so). The covariance is a moving average updated every
        # 300 steps (a window of about 6,000 steps, short next to the chain's time scales):
        # the run takes 24 s against SGNHT's 13 s, and draws what the papers' per-step
        # estimate draws to 0.04 sd here (355 s, run beside the test suite).
        step = NOGIN(step_size=3e-3, friction=1.0, thin=50, averaging=0.1, averaging_interval=300)
        start = time.perf_counter()
        idata = pm.sample(
            draws=200 if quick else 2000,
            tune=200 if quick else 1000,
            step=step,
            chains=2,
            random_seed=2011,
        )
        return idata, step, time.perf_counter() - start


def sample_with_control_variates(X: np.ndarray, y: np.ndarray) -> tuple[az.DataTree, NOGIN, float]:
    """NOGIN with control variates and the step size, preconditioner and ``thin`` adapted
    (``tune=1000``, 2 x 2,000 draws): the draws, the step and the wall time of ``pm.sample``.
    The gradient noise no longer caps the adapted step, so it takes a few times the example's
    time for about ten times its weakest ESS (``benchmarks/a9a_reference_results.md``)."""
    with build_model(X, y):
        step = NOGIN(averaging=0.1, averaging_interval=300, control_variates=True)
        start = time.perf_counter()
        idata = pm.sample(
            draws=2000, tune=1000, step=step, chains=2, random_seed=2011, progressbar=False
        )
        return idata, step, time.perf_counter() - start


#: The moments compared with the reference.
MOMENTS = ("mean", "sd")


def coordinates(idata: az.DataTree) -> np.ndarray:
    """The draws of the prior scale and the weights, shape (chains, draws, 1 + features)."""
    post = idata.posterior
    return np.concatenate([post["prior_scale"].values[..., None], post["w"].values], axis=-1)


def moments(draws: np.ndarray) -> dict[str, np.ndarray]:
    """Per coordinate of ``draws`` (chains, draws, K): mean, sd, their Monte Carlo errors
    and the bulk effective sample size."""
    return {
        "mean": draws.mean(axis=(0, 1)),
        "sd": draws.std(axis=(0, 1), ddof=1),
        "mcse_mean": np.asarray(az.mcse(draws)),
        "mcse_sd": np.asarray(az.mcse(draws, method="sd")),
        "ess_bulk": np.asarray(az.ess(draws)),
    }


def against_reference(idata: az.DataTree) -> dict[str, float] | None:
    """The draws' means and sds against the NUTS reference (None without one): the largest
    |z| of the differences over both Monte Carlo errors, and the sd ratios' range."""
    if not REFERENCE.exists():
        return None
    ref, ours = np.load(REFERENCE), moments(coordinates(idata))
    z = {
        m: (ours[m] - ref[m]) / np.hypot(ours[f"mcse_{m}"], ref[f"mcse_{m}"])
        for m in ("mean", "sd")
    }
    ratio = ours["sd"] / ref["sd"]
    return {
        "max_abs_z_mean": float(np.abs(z["mean"]).max()),
        "max_abs_z_sd": float(np.abs(z["sd"]).max()),
        "sd_ratio_min": float(ratio.min()),
        "sd_ratio_median": float(np.median(ratio)),
        "sd_ratio_max": float(ratio.max()),
    }


def main(quick: bool = False, output_dir: str | Path | None = None) -> dict[str, float]:
    """Sample, print the summaries and save the trace plot in ``output_dir`` (default
    ``examples/output``); returns the test accuracy, the divergence count and the wall time."""
    test = load("a9a")
    X_test, y_test = test["X_test"].astype(float), test["y_test"]
    n_features = X_test.shape[1]
    idata, step, elapsed = sample(*training_rows(), quick=quick)

    print(az.summary(idata, var_names=["prior_scale"]))
    print(az.summary(idata, var_names=["w"]).head(8))
    draws = idata.posterior
    w_draws = draws["w"].values.reshape(-1, n_features)
    prob = 1.0 / (1.0 + np.exp(-(X_test @ w_draws.T)))
    accuracy = float(np.mean((prob.mean(axis=1) > 0.5) == y_test))
    divergences = int(idata.sample_stats["diverging"].sum())
    steps = (idata.posterior.sizes["draw"] + idata.attrs.get("tuning_steps", 0)) * step.thin
    print(f"\ntest accuracy of the posterior predictive: {accuracy:.4f}")
    print(f"divergences: {divergences}")
    comparison = against_reference(idata)
    if comparison is not None:
        c = comparison
        print(
            "against NUTS (nutpie on the full data, benchmarks/a9a_reference_results.md), "
            f"over the {n_features + 1} coordinates: largest |z| of a mean difference "
            f"{c['max_abs_z_mean']:.2f}, of an sd difference {c['max_abs_z_sd']:.2f}; sd ratios "
            f"{c['sd_ratio_min']:.2f}-{c['sd_ratio_max']:.2f} (median {c['sd_ratio_median']:.2f})"
        )
    print(f"pm.sample wall time (compile included): {elapsed:.1f} s for 2 chains x {steps} steps")

    out = Path(output_dir) if output_dir is not None else OUTPUT_ROOT
    out.mkdir(parents=True, exist_ok=True)
    plot = az.plot_trace_dist(idata, var_names=["prior_scale", "w"], coords={"feature": [0, 1, 2]})
    plot.savefig(out / "a9a_trace.png")
    print(f"trace plot: {out / 'a9a_trace.png'}")
    return {"accuracy": accuracy, "divergences": divergences, "seconds": elapsed}


if __name__ == "__main__":
    main(**parse_args(__doc__))
