"""CCAdL: covariance-controlled adaptive Langevin (Shang, Zhu, Leimkuhler & Storkey 2015)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytensor.tensor as pt

from pymc_sgmcmc.base import SGMCMC, Thermostatted, positive
from pymc_sgmcmc.operators import drift, kinetic_temperature, thermostat

__all__ = ["CCAdL"]

#: Above this dimension the default covariance is the diagonal: forming the D x D estimate
#: costs O(n D^2) each time, about 10 gradient evaluations already at D = 100.
FULL_COVARIANCE_MAX_DIM = 50


class CCAdL(Thermostatted):
    r"""Covariance-controlled adaptive Langevin (Shang et al. 2015, Algorithm 1).

    SGNHT with an extra damping that removes the estimated minibatch-gradient noise
    (``ALGORITHMS.md`` section 5), discretised with the paper's Euler-type scheme:

    .. math::
        \theta_t &= \theta_{t-1} + h p_{t-1} \\
        \hat I_t &= (1 - \kappa_t)\hat I_{t-1} + \kappa_t \hat\Sigma(\theta_t) \\
        p_t &= p_{t-1} + h\tilde F(\theta_t) - \tfrac{h^2}{2}\hat I_t p_{t-1}
               - h\xi_{t-1} p_{t-1} + \sqrt{2Ah}\,R \\
        \xi_t &= \xi_{t-1} + \tfrac{h}{\mu}(p_t^\top p_t - D)

    with :math:`\hat\Sigma = \tfrac{N^2}{n} V` the covariance of the minibatch force estimated
    from the per-observation gradients of the same minibatch. The code groups the same updates
    so that the force of a stored draw is evaluated at it.

    Parameters
    ----------
    step_size : float, optional
        :math:`h`. Default: chosen during ``tune`` (see :class:`pymc_sgmcmc.base.SGMCMC`:
        ``h = c / omega_max`` of the preconditioned posterior, capped by the gradient-noise
        rule with this class's ``noise_tolerance``); then also in the preconditioned
        coordinates.
    friction : float, default 1.0
        :math:`A`, the injected-noise amplitude and :math:`\xi_0`.
    thermostat_mass : float, optional
        :math:`\mu`; default D (the papers' choice).
    covariance : {"full", "diag"}, optional
        Keep the full D x D moving average (the paper) or its diagonal. Default: "full" up to
        D = 50, "diag" above (the full estimate costs O(n D^2) each time it is taken).
    averaging : float, optional
        Weight :math:`\kappa` of the newest estimate. Default: :math:`\kappa_t = 1/t` (the
        paper; t counts the estimates since the chain's (re)start, one every
        ``averaging_interval`` steps, so the average restarts at the end of tuning). A fixed
        :math:`\kappa \in (0, 1]`: :math:`\kappa_t = \max(1/t, \kappa)`, the mean of the
        first :math:`1/\kappa` estimates, then an exponential moving average over about
        :math:`2/\kappa` minibatches (the same option as MCCAdL's and NOGIN's).
    averaging_interval : int, default 10
        Steps between the estimates the average takes: at the chain's (re)start and then
        every ``averaging_interval`` steps, in a lazy branch; the steps in between compute
        only the summed minibatch force, as SGNHT does. 1 is the paper's estimate at every
        step. With the paper's :math:`\kappa_t = 1/t` the default average is the mean of
        every tenth estimate instead of all: the same estimand, the noise averaged over the
        chain's positions, from ten times fewer minibatches (the thermostat absorbs what the
        average misses, Proposition 2). With a fixed ``averaging`` the average spans about
        ``2 * averaging_interval / averaging`` steps. The estimate costs O(n D^2) in the
        "full" form and for the diagonal in a dense preconditioner's coordinates, whose
        rotation mixes every coordinate's noise. CPU time per step / SGNHT's at n = 500,
        every step and every 10 (``benchmarks/ccadl_interval_results.md``): 6.94 and 1.89
        at D = 50 ("full"); 14.87 and 2.42 at D = 200 under a dense preconditioner
        ("diag"); 1.43 and 1.10 at D = 200 under a diagonal one. MNIST 7 vs 9 (D = 100, a
        dense preconditioner, 2 x 500 draws after 1,000 tuning draws): the same draws to
        within their Monte Carlo error (0.100-0.111 NUTS sd off, sd ratios 0.92-1.07) in
        31-39 s instead of 121-149 s.
    noise_shrinkage : {None, "auto"} or float, default None
        None uses the paper's estimate of :math:`\Sigma` from each minibatch. Otherwise that
        estimate (before the moving average) is shrunk towards the multiple of the identity
        with the same trace,
        :math:`(1-\rho)\hat\Sigma + \rho \operatorname{tr}(\hat\Sigma)/D\, I` (in the
        preconditioned coordinates), with :math:`\rho` Ledoit & Wolf's (2004) optimal
        intensity estimated from the per-observation gradients at the chain start, after
        every adaptation window and at the end of ``tune`` ("auto"; then fixed), or the
        given number in [0, 1]. It removes most of the variance inflation at large step
        sizes that comes from the sample covariance's eigenvalue spread (see
        ``benchmarks/noise_estimator_results_*.md``), at no extra cost per step.
    noise_shrinkage_target : {"identity", "diagonal"}, default "identity"
        What ``noise_shrinkage`` shrinks towards: the multiple of the identity with the same
        trace (Ledoit & Wolf 2004), or the estimate's own diagonal,
        :math:`(1-\rho)\hat\Sigma + \rho \operatorname{diag}\hat\Sigma` (Schäfer & Strimmer 2005:
        only the correlations are shrunk, so per-coordinate noise levels are kept; "auto"
        then estimates :math:`\rho` from the off-diagonal entries). Same cost per step.
    **kwargs
        ``thin``, ``block_steps``, ``mode``, ``compile_kwargs``, ``model``,
        ``divergence_threshold``: see :class:`pymc_sgmcmc.base.SGMCMC`.

    Notes
    -----
    ``tune`` draws adapt the kernel (step size if not given, diagonal preconditioner, thin;
    see :class:`pymc_sgmcmc.base.SGMCMC`); after tuning the kernel is fixed.
    At every chain (re)start, at each adaptation-window end and at the end of tuning, the
    momentum is drawn from :math:`N(0, I)`, :math:`\xi = A`, and the moving average restarts
    from the estimate at the current position. In the initial interval of an adapted warm-up
    :math:`\xi` is held at A (see :class:`~pymc_sgmcmc.base.Thermostatted`). The paper's
    Proposition 2: the dynamics preserve
    a distribution whose thermostat has mean A and whose kinetic temperature is 1.

    Sampler stats
    -------------
    step_size : float
        :math:`h`.
    <common stats>
    kinetic_temperature : float
        :math:`p^\top p / D`.
    thermostat : float
        :math:`\xi`.
    noise_trace : float
        :math:`\operatorname{tr}\hat\Sigma` of the draw's minibatch; with
        ``averaging_interval`` > 1, of the moving average at the draw.
    noise_shrinkage : float
        The shrinkage intensity :math:`\rho` in use (0 for the paper's estimate).
    """

    name = "ccadl"
    euler_friction = True  # Alg. 1: p <- p + h F - h xi p + sqrt(2 A h) R
    # First-order scheme; the explicit damping -h^2/2 Sigma p needs h sigma_max small.
    stability_constant = 0.3
    noise_tolerance = 0.5
    stats_dtypes_shapes = {
        **SGMCMC.common_stats,
        "kinetic_temperature": (np.float64, []),
        "thermostat": (np.float64, []),
        "noise_trace": (np.float64, []),
        **SGMCMC.noise_estimate_stats,
    }

    def __init__(
        self,
        vars=None,
        *,
        step_size: float | None = None,
        friction: float = 1.0,
        thermostat_mass: float | None = None,
        covariance: Literal["full", "diag"] | None = None,
        averaging: float | None = None,
        averaging_interval: int = 10,
        noise_shrinkage: float | Literal["auto"] | None = None,
        noise_shrinkage_target: Literal["identity", "diagonal"] = "identity",
        **kwargs,
    ):
        self._set_step_size(step_size)
        self._set_noise_shrinkage(noise_shrinkage, noise_shrinkage_target)
        self.friction = positive("friction", friction)
        if covariance not in (None, "full", "diag"):
            raise ValueError(f"covariance must be 'full' or 'diag', got {covariance!r}")
        self._set_averaging(averaging, averaging_interval)
        super().__init__(vars, **kwargs)
        if covariance is None:
            covariance = "full" if self.dim <= FULL_COVARIANCE_MAX_DIM else "diag"
        self.covariance = covariance
        self._set_thermostat_mass(thermostat_mass)

    @property
    def averages_noise(self) -> bool:
        return True  # averaging=None is the paper's kappa_t = 1/t

    def _estimate(self, theta, indices):
        """The minibatch estimate of Sigma at ``theta`` (shrunk with ``noise_shrinkage``)."""
        return self.noise_estimate(self.target.force_and_noise(theta, indices)[1])

    def initial_evaluation(self, theta, indices, noise, h):
        # The average starts as the estimate at the chain's (re)start (kappa_1 = 1), and the
        # next one is due averaging_interval steps later.
        force, sigma = self.target.force_and_noise(theta, indices)
        empty = self.noise_average_state(self.covariance)
        empty = {k: pt.as_tensor(np.asarray(v, dtype=theta.dtype)) for k, v in empty.items()}
        _, average = self.averaged_noise(empty, self.noise_estimate(sigma), self.covariance)
        if self.averages_periodically:
            average["noise_age"] = pt.as_tensor(np.asarray(1.0, dtype=theta.dtype))
        return {"force": force, **average}

    def _damping(self, average, p):
        return average @ p if self.covariance == "full" else average * p

    def integrate(self, state, indices, noise, h, noise_indices=None):
        p, xi, rate, a = state["momentum"], state["thermostat"], self.thermostat_rate, self.friction
        p_new = (
            p
            + h * state["force"]
            - (h**2 / 2.0) * self._damping(state["noise_average"], p)
            - h * xi * p
            + pt.sqrt(2.0 * a * h) * noise[0]
        )
        xi = thermostat(xi, p_new, h, rate)
        theta = drift(state["theta"], p_new, h)
        if self.averages_periodically:
            # The estimate every averaging_interval steps, from the force's rows through
            # inputs of their own (so that the lazy branch keeps the per-observation
            # gradients); the other steps evaluate only the summed force.
            force = self.target.force(theta, indices)
            average, _, carried = self.periodically_averaged_noise(
                state, lambda: self._estimate(theta, noise_indices), self.covariance, h, None
            )
            trace = average.trace()
        else:
            force, sigma = self.target.force_and_noise(theta, indices)
            sigma = self.noise_estimate(sigma)
            _, carried = self.averaged_noise(state, sigma, self.covariance)
            trace = sigma.trace()
        new = {"theta": theta, "momentum": p_new, "thermostat": xi, "force": force, **carried}
        stats = {
            "kinetic_temperature": kinetic_temperature(p_new),
            "thermostat": xi,
            "noise_trace": trace,
        }
        return self.carried(new, stats)
