"""SGNHT / Adaptive Langevin (Ding et al. 2014; Leimkuhler & Shang 2016)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytensor.tensor as pt

from pymc_sgmcmc.base import SGMCMC, Thermostatted, positive
from pymc_sgmcmc.model_layer import NoiseMoments
from pymc_sgmcmc.operators import drift, kick, kinetic_temperature, ornstein_uhlenbeck, thermostat

__all__ = ["SGNHT"]

#: Minibatches whose gradient noise sets the thermostat's equilibrium start.
EQUILIBRIUM_MINIBATCHES = 16
#: The ratio E|F|^2 / tr(Sigma) of the minibatch force (over those minibatches) above which a
#: start counts as far out, where the thermostat starts at A instead. E|F|^2 = |E F|^2 +
#: tr(Sigma): the ratio is 1 at the posterior mean and 1 + about n/N at a posterior draw (the
#: force's mean square there is tr of the posterior precision, about N/n times smaller than
#: the noise's); far out the force points home and dominates. One minibatch's ratio measured
#: 5.2-12 at the initial points of four regressions (D = 2-100, N/n = 2-100), 0.55-1.0 at
#: their posterior means, and 3.4 at 10 posterior sd out on the D = 100 one, whose gradient
#: noise there is twice the bulk's.
FAR_START_RATIO = 3.0


def equilibrium_friction(friction, step_size, noise_trace, dim: int):
    """The thermostat's level where the kinetic temperature averages 1, A + h tr(Sigma) / (2D)
    (Ding et al. 2014, B = h Sigma / 2): the friction absorbs the gradient noise's average over
    the coordinates (NumPy values or PyTensor graphs alike)."""
    return friction + step_size * noise_trace / (2.0 * dim)


class SGNHT(Thermostatted):
    r"""Stochastic gradient Nosé-Hoover thermostat / Adaptive Langevin.

    The SDE (``ALGORITHMS.md`` section 4) :math:`d\theta = p\,dt`,
    :math:`dp = F\,dt - \xi p\,dt + \sqrt{2A}\,dW`,
    :math:`d\xi = \mu^{-1}(p^\top p - D)\,dt`: the thermostat :math:`\xi` absorbs the unknown
    minibatch-gradient noise.

    Parameters
    ----------
    step_size : float, optional
        :math:`h`. Default: chosen during ``tune`` (see :class:`pymc_sgmcmc.base.SGMCMC`:
        ``h = c / omega_max`` of the preconditioned posterior, capped by the gradient-noise
        rule with this class's ``noise_tolerance``); then also in the preconditioned
        coordinates.
    friction : float, default 1.0
        :math:`A`, the injected-noise amplitude (the thermostat starts at its equilibrium,
        :math:`A + h\,\mathrm{tr}\Sigma/(2D)`, except far out; the papers start it at A). 1
        and 10 are the values of the CCAdL and mCCAdL experiments.
    thermostat_mass : float, optional
        :math:`\mu`; default :math:`D`, the number of free parameters (the papers' choice).
    splitting : {"BADODAB", "euler"}, default "BADODAB"
        ``"BADODAB"``: the symmetric splitting of Leimkuhler & Shang,
        B(h/2) A(h/2) D(h/2) O(h) D(h/2) A(h/2) B(h/2), with the last B of a step and the
        first B of the next sharing one force (one gradient evaluation per step).
        ``"euler"``: Ding et al.'s scheme
        :math:`\theta \leftarrow \theta + hp;\ p \leftarrow p + h\tilde F(\theta) - h\xi p +
        \sqrt{2Ah}R;\ \xi \leftarrow \xi + (h/\mu)(p^\top p - D)`.
    **kwargs
        ``thin``, ``block_steps``, ``mode``, ``compile_kwargs``, ``model``: see
        :class:`pymc_sgmcmc.base.SGMCMC`.

    Notes
    -----
    At every chain (re)start, at each adaptation boundary and at the end of tuning, the
    momentum is drawn from :math:`N(0, I)` and :math:`\xi` starts at its equilibrium under
    isotropic noise, :math:`A + h\,\mathrm{tr}\Sigma/(2D)`, with :math:`\Sigma` at the
    current position averaged over 16 minibatches (one minibatch's estimate spreads by
    10-20 %, and the draws would run as much too hot or cold while :math:`\xi` relaxes).
    Far out, where the minibatch force's mean square exceeds 3 :math:`\mathrm{tr}\Sigma` (it
    points home and dominates its noise; with D near or above n the test can miss a far
    start, see the guide's "Thermostat warm-up"), the noise is no guide to the posterior's and
    :math:`\xi` starts at A, the papers' start: from above its level it would fall at most
    :math:`D/\mu` per unit time, holding the chain. In the initial interval of an adapted
    warm-up :math:`\xi` is held at A, so that a far start is reached quickly (see
    :class:`~pymc_sgmcmc.base.Thermostatted`). A ``RuntimeWarning`` after the last draw
    reports a thermostat still relaxing over the draws (their kinetic temperature, exact
    from :math:`\xi`'s net change, off 1 by more than 0.1): from a far start with ``tune=0``
    the climb from A to the posterior's level takes about that level's time units. With the
    step size adapted, another reports a thermostat whose average over the draws exceeds A
    by more than A: it absorbed heat that tuning never measured (a funnel's neck). With a
    ``step_size`` of your own, one at the first kept draw reports gradient noise that differs
    across the coordinates more than the thermostat, which absorbs its average, can follow:
    at :math:`\xi = A + h\,\mathrm{tr}\Sigma/(2D)` a coordinate of noise variance
    :math:`\Sigma_{jj}` runs at :math:`(A + h\Sigma_{jj}/2)/\xi`, and the warning gives the
    range when it leaves 0.85-1.15 (0.61-1.39 on the Normal-Gamma model at h = 0.00958).

    Sampler stats
    -------------
    step_size : float
        :math:`h`.
    <common stats>
    kinetic_temperature : float
        :math:`p^\top p / D`; 1 on average at the target temperature.
    thermostat : float
        :math:`\xi`; its long-run mean is A plus the share of friction the gradient noise needs
        (:math:`A + h\,\mathrm{tr}\Sigma / (2D)` for isotropic noise).
    """

    name = "sgnht"
    # The thermostat absorbs the trace of the gradient noise, not its anisotropy: a coordinate
    # without gradient noise then runs at temperature A / xi >= 1 / (1 + alpha). On the
    # hierarchical model of the slow tests its group mean and scale cooled about twice as much
    # as that (variances 0.85-0.98 of NUTS's at xi = 1.04, alpha = 0.05); 0.03 kept them
    # within 0.10 (guide, "The default").
    noise_tolerance = 0.03
    stats_dtypes_shapes = {
        **SGMCMC.common_stats,
        "kinetic_temperature": (np.float64, []),
        "thermostat": (np.float64, []),
    }

    def __init__(
        self,
        vars=None,
        *,
        step_size: float | None = None,
        friction: float = 1.0,
        thermostat_mass: float | None = None,
        splitting: Literal["BADODAB", "euler"] = "BADODAB",
        **kwargs,
    ):
        self._set_step_size(step_size)
        self.friction = positive("friction", friction)
        if splitting not in ("BADODAB", "euler"):
            raise ValueError(f"splitting must be 'BADODAB' or 'euler', got {splitting!r}")
        self.splitting = splitting
        super().__init__(vars, **kwargs)
        self._set_thermostat_mass(thermostat_mass)

    @property
    def euler_friction(self) -> bool:
        """Ding et al.'s scheme moves the momentum by Euler's friction (see
        ``Thermostatted.adapted_step_size``)."""
        return self.splitting == "euler"

    def noise_variance_factors(
        self, step_size: float, noise: NoiseMoments
    ) -> tuple[float, float] | None:
        # At the thermostat's level a coordinate whose noise variance is Sigma_jj runs at
        # (A + h Sigma_jj / 2) / xi (Ding et al. take the noise to be isotropic).
        diagonal = noise.diagonal
        level = equilibrium_friction(self.friction, step_size, float(np.sum(diagonal)), self.dim)
        temperatures = (self.friction + step_size * diagonal / 2.0) / level
        return float(temperatures.min()), float(temperatures.max())

    def noise_warning(self, low: float, high: float, noise: NoiseMoments) -> str:
        return (
            "the minibatch gradient noise differs across the coordinates more than the "
            "thermostat, which absorbs its average, can follow: the draws' variance is about "
            f"{low:.2g} to {high:.2g} times the posterior's from coordinate to coordinate (the "
            "noise's variance in the sampler's coordinates at the chain's position ranges "
            f"from {np.min(noise.diagonal):.3g} to {np.max(noise.diagonal):.3g})"
        )

    def initial_auxiliary(self, rng):
        return {"momentum": rng.standard_normal(self.dim)}

    def initial_evaluation(self, theta, indices, noise, h):
        # The thermostat starts at its equilibrium under isotropic gradient noise
        # (equilibrium_friction), from this minibatch
        # (_initial_state averages 16): from xi = A it would take about mu / (h tr Sigma)
        # time units to get there. (A one-row minibatch has no estimate: xi = A, Ding et
        # al.'s start.)
        force, sigma = self.target.force_and_noise(theta, indices, optional=True)
        xi = equilibrium_friction(self.friction, h, sigma.trace(), self.dim)
        return {"force": force, "thermostat": xi}

    def _initial_state(self, theta):
        state = super()._initial_state(theta)
        if self.transient:
            return state  # xi held at A (Thermostatted)
        # One minibatch's tr(Sigma) is a noisy estimate (the rows' gradients are
        # heavy-tailed), and xi relaxes from a wrong start over mu / (D |T - 1|) time units:
        # at a given step size the draws ran 10-15 % too hot or cold. Hence the average over
        # EQUILIBRIUM_MINIBATCHES minibatches, the others drawn from a spawned generator so
        # that the chain's own random stream is that of a one-minibatch start.
        extra = self.rng.spawn(1)[0]
        starts = [state] + [
            self._start_evaluation(state["theta"], extra)
            for _ in range(EQUILIBRIUM_MINIBATCHES - 1)
        ]
        excess = np.mean([s["thermostat"] for s in starts], dtype=float) - self.friction
        squared_force = np.mean([np.sum(np.square(s["force"], dtype=float)) for s in starts])
        noise_trace = 2.0 * self.dim * excess / self.step_size  # tr(Sigma), averaged
        far_out = squared_force > FAR_START_RATIO * noise_trace
        # Far out the noise is no guide to the bulk's, and a level above the bulk's holds the
        # chain (xi falls at most D / mu per unit time): the papers' xi = A, whose climb to
        # the bulk's level takes about that level's time units.
        level = self.friction if far_out else self.friction + excess
        state["thermostat"] = np.asarray(level, dtype=state["thermostat"].dtype)
        return state

    def integrate(self, state, indices, noise, h):
        step = self._badodab if self.splitting == "BADODAB" else self._euler
        new = step(state, indices, noise[0], h)
        stats = {
            "kinetic_temperature": kinetic_temperature(new["momentum"]),
            "thermostat": new["thermostat"],
        }
        return self.carried(new, stats)

    def _euler(self, state, indices, noise, h):
        # Ding et al. regrouped so that the force of a stored draw is evaluated at it:
        # p(F at theta), xi(new p), then theta(new p) and its force.
        p, xi, rate, a = state["momentum"], state["thermostat"], self.thermostat_rate, self.friction
        p_new = p + h * state["force"] - h * xi * p + pt.sqrt(2.0 * a * h) * noise
        xi = thermostat(xi, p_new, h, rate)
        theta = drift(state["theta"], p_new, h)
        return {
            "theta": theta,
            "momentum": p_new,
            "thermostat": xi,
            **self.evaluate(theta, indices, noise, h),
        }

    def _badodab(self, state, indices, noise, h):
        rate, a, half = self.thermostat_rate, self.friction, 0.5 * h
        p = kick(state["momentum"], state["force"], half)  # B(h/2), force shared with last step
        theta = drift(state["theta"], p, half)  # A(h/2)
        xi = thermostat(state["thermostat"], p, half, rate)  # D(h/2)
        p = ornstein_uhlenbeck(p, xi, a, h, noise)  # O(h)
        xi = thermostat(xi, p, half, rate)  # D(h/2)
        theta = drift(theta, p, half)  # A(h/2)
        evaluated = self.evaluate(theta, indices, noise, h)
        p = kick(p, evaluated["force"], half)  # B(h/2)
        return {"theta": theta, "momentum": p, "thermostat": xi, **evaluated}
