"""Monte Carlo checks of draws against a Gaussian reference, with tolerances from the ESS."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import arviz as az
import numpy as np

#: Per-coordinate tolerance in Monte Carlo standard errors. With <= 8 coordinates and two
#: statistics each, the chance that a correct sampler fails a check is below 1e-3.
Z_TOLERANCE = 4.0


@dataclass
class GaussianCheck:
    """Whitened moments z = L^{-1}(theta - mean) of the draws, with Cov = L L^T the reference."""

    mean_z: np.ndarray  # per coordinate, ~0
    var_z: np.ndarray  # per coordinate, ~1
    ess_mean: np.ndarray
    ess_var: np.ndarray

    @property
    def mean_errors(self) -> np.ndarray:
        """|mean_z| in Monte Carlo standard errors (sd of z is 1)."""
        return np.abs(self.mean_z) * np.sqrt(self.ess_mean)

    @property
    def var_errors(self) -> np.ndarray:
        """|var_z - 1| in Monte Carlo standard errors (Var(z^2) = 2 for a Gaussian)."""
        return np.abs(self.var_z - 1) / np.sqrt(2 / self.ess_var)

    def passes(self, tolerance: float = Z_TOLERANCE) -> bool:
        return bool(self.mean_errors.max() < tolerance and self.var_errors.max() < tolerance)

    def describe(self) -> str:
        return (
            f"mean_z={np.round(self.mean_z, 4)} ({np.round(self.mean_errors, 2)} se), "
            f"var_z={np.round(self.var_z, 4)} ({np.round(self.var_errors, 2)} se), "
            f"ESS mean={np.round(self.ess_mean)}, ESS var={np.round(self.ess_var)}"
        )


def graph_nodes(fgraph) -> Iterator:
    """Every node of a function graph and of the graphs nested in its ops (a scan's step, a
    lazy branch's sides, a fused op's graph), which list them as ``inner_graphs``."""
    for node in fgraph.apply_nodes:
        yield node
        for inner in getattr(node.op, "inner_graphs", {}).values():
            yield from graph_nodes(inner)


def gaussian_check(draws: np.ndarray, mean: np.ndarray, cov: np.ndarray) -> GaussianCheck:
    """``draws``: (chain, draw, D) array."""
    chol = np.linalg.cholesky(cov)
    z = np.linalg.solve(chol, (draws - mean)[..., None])[..., 0]
    squares = z**2
    return GaussianCheck(
        mean_z=z.mean(axis=(0, 1)),
        var_z=squares.mean(axis=(0, 1)),
        ess_mean=np.array([az.ess(z[..., j]) for j in range(z.shape[-1])]),
        ess_var=np.array([az.ess(squares[..., j], method="mean") for j in range(z.shape[-1])]),
    )


def posterior_draws(idata, name: str) -> np.ndarray:
    values = idata.posterior[name].values
    return values.reshape(*values.shape[:2], -1)


def one_chain(problem, make_step, draws: int, seed: int):
    """The step built by ``make_step()`` in ``problem``'s model and the draws of ``w`` of one
    chain of ``draws`` draws without tuning."""
    import pymc as pm

    with problem.model():
        step = make_step()
        idata = pm.sample(
            draws=draws,
            tune=0,
            chains=1,
            step=step,
            random_seed=seed,
            progressbar=False,
            compute_convergence_checks=False,
        )
    return step, idata.posterior["w"].values[0]


def chain_from_the_mean(problem, step, draws: int, seed: int):
    """The InferenceData of one chain of ``draws`` draws of ``step``, without tuning, started at
    ``problem``'s exact posterior mean; call it inside the model the step was built in."""
    import pymc as pm

    return pm.sample(
        draws=draws,
        tune=0,
        step=step,
        chains=1,
        random_seed=seed,
        initvals={"w": problem.mean},
        progressbar=False,
        compute_convergence_checks=False,
    )
