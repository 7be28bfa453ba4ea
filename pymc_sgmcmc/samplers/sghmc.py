"""SGHMC: stochastic gradient Hamiltonian Monte Carlo (Chen, Fox & Guestrin 2014, Algorithm 2)."""

from __future__ import annotations

import warnings
from typing import Literal

import numpy as np
import pytensor.tensor as pt

from pymc_sgmcmc.base import SGMCMC, positive
from pymc_sgmcmc.model_layer import NoiseMoments
from pymc_sgmcmc.operators import drift, kick, kinetic_temperature

__all__ = ["SGHMC"]


class SGHMC(SGMCMC):
    r"""Stochastic gradient Hamiltonian Monte Carlo (Chen, Fox & Guestrin 2014, Algorithm 2).

    Symplectic Euler with friction (``ALGORITHMS.md`` section 3):

    .. math::
        \theta &\leftarrow \theta + h p \\
        p &\leftarrow p + h \tilde F(\theta) - h A p + \sqrt{2h}\,(A I - \hat B)^{1/2} R

    with the force at the *new* position. The code groups the same updates as "momentum, then
    position" so that the force of a stored draw is evaluated at that draw; the sequence of
    positions is identical.

    Parameters
    ----------
    step_size : float, optional
        :math:`h`. Default: chosen during ``tune`` (see :class:`pymc_sgmcmc.base.SGMCMC`:
        ``h = c / omega_max`` of the preconditioned posterior, capped by the gradient-noise
        rule with this class's ``noise_tolerance``); then also in the preconditioned
        coordinates.
    friction : float, default 1.0
        :math:`A` (the papers' effective friction; Chen et al. call it :math:`C`). 1 and 10 are
        the values of the CCAdL and mCCAdL experiments.
    gradient_noise : {"ignore", "estimate"}, default "ignore"
        :math:`\hat B = 0` (as in most of Chen et al.'s experiments) or
        :math:`\hat B = \tfrac{h}{2}\hat\Sigma`, with :math:`\hat\Sigma` the gradient-noise
        covariance estimated from the per-observation gradients of the same minibatch. The
        square root is exact (an eigen-decomposition in the smaller of the D and n spaces, so
        this option costs far more per step at large min(D, n)). Where :math:`A I - \hat B` is
        not positive semi-definite its negative eigenvalues are clipped to zero, the draw's
        ``noise_clipped`` stat is set and, where a kept draw (not a tuning draw) is clipped,
        a warning names the step size that avoids it.
    **kwargs
        ``thin``, ``block_steps``, ``mode``, ``compile_kwargs``, ``model``: see
        :class:`pymc_sgmcmc.base.SGMCMC`.

    Notes
    -----
    ``tune`` draws adapt the kernel (step size if not given, diagonal preconditioner, thin;
    see :class:`pymc_sgmcmc.base.SGMCMC`); after tuning the kernel is fixed.
    The momentum is drawn from :math:`N(0, I)` at every chain
    (re)start and at the end of tuning.

    Sampler stats
    -------------
    step_size : float
        :math:`h`.
    <common stats>
    kinetic_temperature : float
        :math:`p^\top p / D`; 1 on average at the target temperature.
    noise_clipped : bool
        Only meaningful with ``gradient_noise="estimate"``: :math:`A I - \hat B` had a negative
        eigenvalue at this draw's force evaluation.
    """

    name = "sghmc"
    # First-order scheme; with B-hat = 0 the gradient noise is not corrected at all.
    stability_constant = 0.3
    noise_tolerance = 0.05
    stats_dtypes_shapes = {
        **SGMCMC.common_stats,
        "kinetic_temperature": (np.float64, []),
        "noise_clipped": (bool, []),
    }

    def __init__(
        self,
        vars=None,
        *,
        step_size: float | None = None,
        friction: float = 1.0,
        gradient_noise: Literal["ignore", "estimate"] = "ignore",
        **kwargs,
    ):
        self._set_step_size(step_size)
        self.friction = positive("friction", friction)
        if gradient_noise not in ("ignore", "estimate"):
            raise ValueError(
                f"gradient_noise must be 'ignore' or 'estimate', got {gradient_noise!r}"
            )
        self.gradient_noise = gradient_noise
        super().__init__(vars, **kwargs)

    def noise_variance_factors(
        self, step_size: float, noise: NoiseMoments
    ) -> tuple[float, float] | None:
        # B-hat = 0: the kick's noise h^2 sigma^2 on top of the injected 2 A h, a kinetic
        # temperature of 1 + h sigma^2 / (2A). The estimate's clipping has its own warning.
        if self.gradient_noise == "estimate":
            return None
        return 1.0, 1.0 + step_size * noise.largest / (2.0 * self.friction)

    def initial_auxiliary(self, rng):
        return {"momentum": rng.standard_normal(self.dim)}

    def evaluate(self, theta, indices, noise, h):
        if self.gradient_noise == "ignore":
            force = self.target.force(theta, indices)
            scaled_noise, min_eig = pt.sqrt(self.friction) * noise[0], pt.constant(self.friction)
        else:
            # (A I - B)^{1/2} R with B = (h/2) Sigma is prepared where Sigma is known, for the
            # next step's momentum update.
            force, sigma = self.target.force_and_noise(theta, indices)
            scaled_noise, min_eig = sigma.sqrt_shifted_matvec(self.friction, 0.5 * h, noise[0])
        return {"force": force, "noise": scaled_noise, "noise_min_eig": min_eig}

    def integrate(self, state, indices, noise, h):
        p = kick(state["momentum"], state["force"], h)
        p = p - h * self.friction * state["momentum"] + pt.sqrt(2.0 * h) * state["noise"]
        theta = drift(state["theta"], p, h)
        new = {"theta": theta, "momentum": p, **self.evaluate(theta, indices, noise, h)}
        stats = {
            "kinetic_temperature": kinetic_temperature(p),
            "noise_clipped": new["noise_min_eig"] < 0,
        }
        return self.carried(new, stats)

    def _reset_chain(self, tune, draws):
        super()._reset_chain(tune, draws)
        self.warned_clipped = False

    def _fill_buffer(self, theta):
        # Only the kept draws' clipping is reported (a block never straddles the end of
        # tuning): the transient's step size, which is allowed to run hot, clipped at 58 of
        # 62 tuning draws on a regression whose kept draws never clipped, and the one warning
        # a chain gets named that step size and was then spent.
        tuning = self.tune and self.tune_left > 0
        super()._fill_buffer(theta)
        clipped = self.buffer["noise_clipped"]
        if clipped.any() and not self.warned_clipped and not tuning:
            self.warned_clipped = True
            warnings.warn(
                f"SGHMC: A*I - (h/2)*Sigma_hat was not positive semi-definite at "
                f"{int(clipped.sum())} of {clipped.size} draws (friction A={self.friction}, "
                f"step_size h={self.step_size}); its negative eigenvalues were clipped to zero, "
                "so the injected noise is too small there. Use a smaller step size or a larger "
                "friction so that h/2 * max eig(Sigma_hat) < A.",
                RuntimeWarning,
                stacklevel=3,
            )
