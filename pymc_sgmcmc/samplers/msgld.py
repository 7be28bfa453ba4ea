"""mSGLD: SGLD with its noise shrunk by the gradient-noise covariance (Vollmer et al. 2016)."""

from __future__ import annotations

import pytensor.tensor as pt

from pymc_sgmcmc.base import SGMCMC, Step
from pymc_sgmcmc.model_layer import NoiseMoments
from pymc_sgmcmc.samplers.sgld import langevin_relaxation_steps, langevin_step_size

__all__ = ["MSGLD"]


class MSGLD(SGMCMC):
    r"""Modified SGLD (Vollmer, Zygalakis & Teh 2016), fixed step size.

    The injected noise is shrunk so that injected plus minibatch-gradient noise has covariance
    :math:`\varepsilon I` to higher order (``ALGORITHMS.md`` section 2):

    .. math:: \theta \leftarrow \theta + \tfrac{\varepsilon}{2} \tilde F(\theta)
              + \sqrt{\varepsilon}\,\bigl(I - \tfrac{\varepsilon}{8} \Sigma(\theta)\bigr) R,

    the first-order form of :math:`\sqrt{\varepsilon}(I - \tfrac{\varepsilon}{4}\Sigma)^{1/2} R`.
    :math:`\Sigma(\theta)` is the covariance of the minibatch force estimated from the
    per-observation gradients of the same minibatch as :math:`\tilde F` and applied as an
    :math:`O(nD)` product, never as a :math:`D \times D` matrix. With full-batch gradients
    (no ``pm.Minibatch``) :math:`\Sigma = 0` and mSGLD is SGLD.

    Parameters
    ----------
    step_size : float, optional
        :math:`\varepsilon` (same convention as :class:`SGLD`). Default: chosen during
        ``tune``, ``epsilon = min(c / lambda_max, 4 alpha / sigma^2_max)`` in the
        preconditioned coordinates (see ``pymc_sgmcmc.samplers.sgld.langevin_step_size``).
    **kwargs
        ``thin``, ``block_steps``, ``mode``, ``compile_kwargs``, ``model``: see
        :class:`pymc_sgmcmc.base.SGMCMC`.

    Notes
    -----
    ``tune`` draws adapt the kernel (step size if not given, diagonal preconditioner, thin;
    see :class:`pymc_sgmcmc.base.SGMCMC`); after tuning the kernel is fixed. One step costs
    one minibatch force and its per-observation gradients: 1.4 SGLD steps on the benchmark
    suite's logistic regression, 1.8 on its linear regression, where SGLD's gradient is one pass
    over the minibatch rows (``benchmarks/suite_results_amd_epyc_2026-11-26.md``, 05:58 UTC).
    In a float64 model the product :math:`\Sigma R` reads the per-observation gradients rounded to
    float32 and sums them in float32 (:mod:`pymc_sgmcmc.gram_product`): the correction is a
    fraction :math:`\varepsilon \lambda_{\max}(\Sigma) / 8` of the noise, so the rounding
    (a few 1e-7 of :math:`\Sigma`) is far below anything a chain can show, and the rows cost
    half the memory traffic.

    Sampler stats
    -------------
    step_size : float
        :math:`\varepsilon`.
    <common stats>
    noise_trace : float
        :math:`\operatorname{tr}\Sigma(\theta)` at the draw: the size of the gradient noise.
        Computed at the stored steps only, from the float32 rows of the product (about 1e-7
        relative).
    """

    name = "msgld"
    # The noise shrinkage removes the eps sigma^2 / 4 bias to first order.
    stability_constant = 0.2
    noise_tolerance = 0.1
    stats_dtypes_shapes = {**SGMCMC.common_stats, "noise_trace": (float, [])}

    def __init__(self, vars=None, *, step_size: float | None = None, **kwargs):
        self._set_step_size(step_size)
        super().__init__(vars, **kwargs)

    def _evaluated(self, theta, indices, noise):
        # Sigma R is prepared where Sigma is known, for the next step's noise. From G in
        # float32, summed in float64: the correction (eps / 8) Sigma R is a fraction of the
        # noise, so rounding Sigma by ~1e-7 of itself changes nothing measurable, and G written
        # and read in half the bytes saved 8 % of a step (P1, D = 100).
        force, sigma = self.target.force_and_noise(theta, indices)
        sigma_noise = sigma.matvec(noise[0], single_precision_rows=True)
        return {"force": force, "noise": noise[0], "sigma_noise": sigma_noise}, sigma

    def evaluate(self, theta, indices, noise, h):
        return self._evaluated(theta, indices, noise)[0]

    def stable_step_size(self, curvature: float) -> float:
        # theta <- (I - eps H / 2) theta is stable for eps * lambda_max < 4; suggest half.
        return 2.0 / curvature

    def adapted_step_size(self, curvature: float, noise: float, phase: str) -> float:
        return langevin_step_size(self, curvature, noise, phase)

    def noise_variance_factors(
        self, step_size: float, noise: NoiseMoments
    ) -> tuple[float, float] | None:
        # Injected eps (1 - eps sigma^2 / 8)^2 plus the gradient's eps^2 sigma^2 / 4 is
        # eps (1 + (eps sigma^2 / 8)^2): the shrinkage removes the first-order excess only.
        return 1.0, 1.0 + (step_size * noise.largest / 8.0) ** 2

    def relaxation_steps(self, step_size: float, variance: float = 1.0) -> int:
        return langevin_relaxation_steps(step_size, variance)

    def integrate(self, state, indices, noise, h):
        shrunk_noise = state["noise"] - (h / 8.0) * state["sigma_noise"]
        theta = state["theta"] + 0.5 * h * state["force"] + pt.sqrt(h) * shrunk_noise
        evaluated, sigma = self._evaluated(theta, indices, noise)
        # tr Sigma only at the draws: with the force, it cost every step a pass over G.
        return Step({"theta": theta, **evaluated}, theta, {}, {"noise_trace": sigma.trace(True)})
