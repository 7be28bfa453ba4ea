"""SGLD: stochastic gradient Langevin dynamics (Welling & Teh 2011, eq. 4)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytensor.tensor as pt

from pymc_sgmcmc.base import KEPT_PHASES, SGMCMC, positive
from pymc_sgmcmc.model_layer import NoiseMoments

__all__ = ["SGLD", "PolynomialDecay", "langevin_relaxation_steps", "langevin_step_size"]


def langevin_step_size(sampler: SGMCMC, curvature: float, noise: float, phase: str) -> float:
    r"""epsilon = min(c / lambda_max, 4 alpha / sigma^2_max) for the overdamped samplers.

    For a Gaussian coordinate of precision lambda and force-noise variance sigma^2, SGLD's
    stationary variance is (1 + eps sigma^2 / 4) / (lambda (1 - eps lambda / 4)): the relative
    bias is eps lambda / 4 from the discretisation and eps sigma^2 / 4 from the gradient noise,
    Welling & Teh's sampling threshold. ``stability_constant`` c and ``noise_tolerance``
    alpha bound them for the kernel the draws keep (``phase="final"`` after tuning,
    ``"start_kept"`` from the start without windows); before that alpha is at least 1 (a
    variance within a factor 2 is enough to set the preconditioner).
    """
    eps = sampler.stability_constant / curvature
    if noise > 0:
        strict = phase in KEPT_PHASES
        alpha = sampler.noise_tolerance if strict else max(sampler.noise_tolerance, 1.0)
        eps = min(eps, 4.0 * alpha / noise)
    return eps


def langevin_relaxation_steps(step_size: float, variance: float = 1.0) -> int:
    """d theta = (1/2) grad log p dt + dW relaxes a direction of variance v at the rate
    1 / (2 v): in 2 v time units, and a step of size epsilon advances the time by epsilon."""
    return int(np.ceil(2.0 * variance / step_size))


@dataclass(frozen=True)
class PolynomialDecay:
    """Step sizes eps_t = a (b + t)^(-gamma) (Welling & Teh 2011, section 3).

    ``t`` counts integrator steps from 0 at the start of each chain, tuning steps included.
    ``gamma`` in (0.5, 1] satisfies the Robbins-Monro conditions sum eps_t = inf and
    sum eps_t^2 < inf.
    """

    a: float
    b: float = 1.0
    gamma: float = 0.55

    def __post_init__(self):
        positive("a", self.a)
        if not np.isfinite(self.b) or self.b < 0:
            raise ValueError(f"b must be non-negative, got {self.b}")
        if not 0.5 < self.gamma <= 1:
            raise ValueError(f"gamma must lie in (0.5, 1], got {self.gamma}")
        if self.b == 0:
            raise ValueError("b must be positive: eps_0 = a * b^(-gamma) is infinite for b = 0")

    def __call__(self, t: np.ndarray) -> np.ndarray:
        return self.a * (self.b + np.asarray(t, dtype=float)) ** (-self.gamma)


class SGLD(SGMCMC):
    r"""Stochastic gradient Langevin dynamics (Welling & Teh 2011).

    Each step, with the minibatch force :math:`\tilde F = \nabla \log p(\theta) +
    (N/n) \sum_{i \in B} \nabla \log p(x_i \mid \theta)`,

    .. math:: \theta \leftarrow \theta + \tfrac{\varepsilon}{2} \tilde F(\theta)
              + \sqrt{\varepsilon}\, R, \qquad R \sim N(0, I).

    Parameters
    ----------
    step_size : float or PolynomialDecay, optional
        Default: chosen during ``tune``,
        ``epsilon = min(c / lambda_max, 4 alpha / sigma^2_max)`` in the preconditioned
        coordinates (``pymc_sgmcmc.samplers.sgld.langevin_step_size``). Otherwise
        :math:`\varepsilon` in the convention above (BlackJAX's ``step_size`` is
        :math:`\varepsilon/2`). A :class:`PolynomialDecay` gives the paper's decreasing schedule
        :math:`\varepsilon_t = a (b + t)^{-\gamma}`; then posterior expectations are the
        step-weighted averages :math:`\sum_t \varepsilon_t f(\theta_t) / \sum_t \varepsilon_t`
        of the paper's section 4.2, with :math:`\varepsilon_t` read from the ``step_size`` stat.
    **kwargs
        ``thin``, ``block_steps``, ``mode``, ``compile_kwargs``, ``model``: see
        :class:`pymc_sgmcmc.base.SGMCMC`.

    Notes
    -----
    ``tune`` draws adapt the kernel (step size if not given, diagonal preconditioner, thin;
    see :class:`pymc_sgmcmc.base.SGMCMC`); after tuning the kernel is fixed.

    Sampler stats
    -------------
    step_size : float
        :math:`\varepsilon_t` of the step that produced the draw.
    <common stats>
    """

    name = "sgld"
    stats_dtypes_shapes = dict(SGMCMC.common_stats)

    stability_constant = 0.2
    noise_tolerance = 0.05

    def __init__(self, vars=None, *, step_size: float | PolynomialDecay | None = None, **kwargs):
        if isinstance(step_size, PolynomialDecay):
            self.schedule = step_size
            self._set_step_size(step_size.a)
        else:
            self.schedule = None
            self._set_step_size(step_size)
        super().__init__(vars, **kwargs)

    def step_sizes(self, steps: np.ndarray) -> np.ndarray:
        if self.schedule is None:
            return super().step_sizes(steps)
        return self.schedule(steps)

    def stable_step_size(self, curvature: float) -> float:
        # theta <- (I - eps H / 2) theta is stable for eps * lambda_max < 4; suggest half.
        return 2.0 / curvature

    def adapted_step_size(self, curvature: float, noise: float, phase: str) -> float:
        return langevin_step_size(self, curvature, noise, phase)

    def noise_variance_factors(
        self, step_size: float, noise: NoiseMoments
    ) -> tuple[float, float] | None:
        # 1 + eps sigma^2 / 4 (langevin_step_size). A schedule anneals it away, as the paper's
        # section 4.2 intends: its early draws are expected to be noise-dominated.
        return None if self.schedule is not None else (1.0, 1.0 + step_size * noise.largest / 4)

    def relaxation_steps(self, step_size: float, variance: float = 1.0) -> int:
        return langevin_relaxation_steps(step_size, variance)

    def integrate(self, state, indices, noise, h):
        theta = state["theta"] + 0.5 * h * state["force"] + pt.sqrt(h) * noise[0]
        return self.carried({"theta": theta, **self.evaluate(theta, indices, noise, h)})
