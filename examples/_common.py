"""Helpers shared by the paper-reproduction examples: output folders, tables, sampling runs,
autocorrelation times, Gaussian 2-Wasserstein distances and figures.

Every example calls :func:`sample` (``pm.sample`` with one SG step object, one chain by default,
no progress bar) and writes its results with :func:`write_table` and :func:`save_figure` into
``examples/output/<example>/`` unless the caller passes another folder.
"""

from __future__ import annotations

import argparse
import csv
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import arviz as az
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pymc as pm
from scipy import linalg

#: Where the committed results of the examples live.
OUTPUT_ROOT = Path(__file__).resolve().parent / "output"


def results_dir(name: str, override: str | Path | None = None) -> Path:
    """The folder an example writes to (created): ``override`` or ``examples/output/<name>``."""
    path = Path(override) if override is not None else OUTPUT_ROOT / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def parse_args(doc: str) -> dict[str, Any]:
    """The command line every example shares: ``--quick`` and ``--output-dir``."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny budget, same code path (used by the tests)"
    )
    parser.add_argument(
        "--output-dir", default=None, help="write here instead of under examples/output"
    )
    args = parser.parse_args()
    return {"quick": args.quick, "output_dir": args.output_dir}


@dataclass
class Run:
    """One ``pm.sample`` call: its draws (chains x draws x D, the model's ravel order), the
    sampler stats it recorded and its wall time (compilation included)."""

    idata: Any
    seconds: float

    def draws(self, name: str) -> np.ndarray:
        """Posterior draws of one variable, shape (chains, draws, ...)."""
        return np.asarray(self.idata.posterior[name].values)

    def stat(self, name: str) -> np.ndarray:
        return np.asarray(self.idata.sample_stats[name].values)

    @property
    def divergences(self) -> int:
        return int(self.stat("diverging").sum())


def sample(
    model: pm.Model,
    make_step: Callable[[], Any],
    *,
    draws: int,
    tune: int,
    seed: int,
    chains: int = 1,
    initvals: dict | None = None,
) -> Run:
    """Run ``pm.sample`` with the step object ``make_step()`` built inside ``model``.

    Sequential chains (``cores=1``): the SG samplers already run thousands of steps per compiled
    call, and the machine the examples are written for has two cores.
    """
    start = time.perf_counter()
    with model:
        step = make_step()
        idata = pm.sample(
            draws=draws,
            tune=tune,
            step=step,
            chains=chains,
            cores=1,
            random_seed=seed,
            initvals=initvals,
            progressbar=False,
            compute_convergence_checks=False,
        )
    return Run(idata, time.perf_counter() - start)


def integrated_autocorrelation_time(draws: np.ndarray, thin: int = 1) -> float:
    """Integrated autocorrelation time, in integrator steps, of a scalar chain.

    ``draws`` (chains x draws) are every ``thin``-th step; the time in steps is
    ``thin * n_draws / ESS`` with ArviZ's bulk ESS (Geyer's initial monotone sequence), which
    is accurate while ``thin`` is well below the time itself.
    """
    draws = np.atleast_2d(draws)
    ess = float(az.ess(draws, method="bulk"))
    return thin * draws.size / ess


def gaussian_w2(mean_a, cov_a, mean_b, cov_b) -> float:
    """2-Wasserstein distance between N(mean_a, cov_a) and N(mean_b, cov_b) (Givens & Shortt
    1984): |m_a - m_b|^2 + tr(A + B - 2 (B^1/2 A B^1/2)^1/2)."""
    root_b = linalg.sqrtm(cov_b)
    cross = linalg.sqrtm(root_b @ cov_a @ root_b)
    trace = np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(np.real(cross))
    return float(np.sqrt(max(np.sum((mean_a - mean_b) ** 2) + trace, 0.0)))


def format_value(value: Any, digits: int = 4) -> str:
    """Table cell: floats with ``digits`` significant digits, NaN and infinities spelled out."""
    if isinstance(value, float | np.floating):
        if np.isnan(value):
            return "NaN"
        if np.isinf(value):
            return "Inf" if value > 0 else "-Inf"
        return f"{value:.{digits}g}"
    return str(value)


def write_table(
    rows: Sequence[dict[str, Any]], folder: Path, stem: str, title: str, notes: str = ""
) -> Path:
    """Write ``rows`` (dicts with the same keys) as ``<stem>.md`` and ``<stem>.csv``."""
    columns = list(rows[0])
    lines = [f"# {title}", ""]
    if notes:
        lines += [notes.strip(), ""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + " --- |" * len(columns))
    for row in rows:
        lines.append("| " + " | ".join(format_value(row[c]) for c in columns) + " |")
    md = folder / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n")
    with (folder / f"{stem}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row[c] for c in columns})
    return md


def save_figure(fig: plt.Figure, path: Path, dpi: int = 90) -> Path:
    """Save a PNG small enough to commit (the examples keep them below 300 kB)."""
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def passes(steps: np.ndarray | int, batch_size: int, n_obs: int) -> np.ndarray:
    """Number of passes over the data (epochs) after ``steps`` minibatch gradient evaluations."""
    return np.asarray(steps) * batch_size / n_obs
