"""mCCAdL: modified covariance-controlled adaptive Langevin (Wei & Shang 2026, Algorithm 1)."""

from __future__ import annotations

from typing import Literal

import numpy as np

from pymc_sgmcmc.base import SGMCMC, Step, Thermostatted, positive
from pymc_sgmcmc.operators import drift, kick, kinetic_temperature, ornstein_uhlenbeck, thermostat

__all__ = ["MCCAdL"]


class MCCAdL(Thermostatted):
    r"""Modified covariance-controlled adaptive Langevin (Wei & Shang 2026, Algorithm 1).

    The symmetric splitting BAODCDOAB of the CCAdL dynamics (``ALGORITHMS.md`` section 6):
    B(h/2) A(h/2) O(h/2) D(h/2) C(h) D(h/2) O(h/2) A(h/2) B(h/2), where C integrates
    :math:`dp = -\tfrac{h}{2}\Sigma(\theta) p\,dt` exactly over time h,
    :math:`p \leftarrow \exp(-\tfrac{h^2}{2}\Sigma)\,p`, by the shifted, scaled, truncated
    Taylor product of the paper's eqs. 18-22 with (s, m) from Al-Mohy & Higham's
    backward-error bounds and only :math:`\Sigma`-vector products (see
    :meth:`pymc_sgmcmc.model_layer.Covariance.expm_matvec`).

    :math:`\Sigma` comes from the per-observation gradients of the minibatch of the step's
    force evaluation (eq. 15, no moving average), i.e. at the position where the step starts:
    one gradient evaluation per step, the last B's force reused by the next step's first B.
    The code evaluates the force at the top of each loop iteration, finishes the previous step
    with its last B (that state is the stored draw) and runs the next step up to its last A.

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
    covariance : {"lowrank", "full", "diag"}, default "lowrank"
        Form of :math:`\Sigma` for the C step: products with the centred per-observation
        gradients (O(nD) each, never forming D x D), the D x D matrix (O(nD^2) to form, then
        O(D^2) per product) or its diagonal.
    **kwargs
        ``thin``, ``block_steps``, ``mode``, ``compile_kwargs``, ``model``,
        ``divergence_threshold``: see :class:`pymc_sgmcmc.base.SGMCMC`.

    Notes
    -----
    ``tune`` draws adapt the kernel (step size if not given, diagonal preconditioner, thin;
    see :class:`pymc_sgmcmc.base.SGMCMC`); after tuning the kernel is fixed.
    Momentum :math:`N(0, I)` and :math:`\xi = A` at every chain
    (re)start and at the end of tuning. The C step costs s·m covariance-vector products,
    about 8 power-iteration products and one force evaluation more per step than SGNHT.

    Sampler stats
    -------------
    step_size : float
        :math:`h`.
    diverging : bool
        The step left the finite numbers (or the position exceeded ``divergence_threshold``);
        the draw repeats the last sane position and the chain restarted from it.
    divergences : int
        Number of diverging draws so far in this chain.
    thin : int
        Integrator steps per stored draw (chosen with the step size during ``tune`` when
        neither is given).
    minibatch_logp : float
        Unbiased minibatch estimate of the model log-density at the draw.
    kinetic_temperature : float
        :math:`p^\top p / D` at the draw.
    thermostat : float
        :math:`\xi` at the draw.
    noise_trace : float
        :math:`\operatorname{tr}\Sigma` at the draw's force evaluation.
    expm_scaling : int
        s, the number of Taylor-polynomial applications in the C step that followed the draw.
    expm_degree : int
        m, the Taylor degree in that C step.
    """

    name = "mccadl"
    # The C step removes the gradient noise exactly, but only as well as Sigma is estimated
    # from the n rows of one minibatch.
    noise_tolerance = 0.25
    noise_vectors = 2
    stats_dtypes_shapes = {
        **SGMCMC.common_stats,
        "kinetic_temperature": (np.float64, []),
        "thermostat": (np.float64, []),
        "noise_trace": (np.float64, []),
        "expm_scaling": (np.int64, []),
        "expm_degree": (np.int64, []),
    }

    def __init__(
        self,
        vars=None,
        *,
        step_size: float | None = None,
        friction: float = 1.0,
        thermostat_mass: float | None = None,
        covariance: Literal["lowrank", "full", "diag"] = "lowrank",
        **kwargs,
    ):
        self._set_step_size(step_size)
        self.friction = positive("friction", friction)
        if covariance not in ("lowrank", "full", "diag"):
            raise ValueError(f"covariance must be 'lowrank', 'full' or 'diag', got {covariance!r}")
        self.covariance = covariance
        super().__init__(vars, **kwargs)
        self._set_thermostat_mass(thermostat_mass)

    def initial_evaluation(self, theta, indices, noise, h):
        return {}  # the force is evaluated at the top of each iteration

    def integrate(self, state, indices, noise, h):
        mu, a, half = self.thermostat_mass, self.friction, h / 2.0
        theta, xi = state["theta"], state["thermostat"]
        force, logp, sigma = self.target.force_logp_and_noise(theta, indices)
        sigma = sigma.as_form(self.covariance)
        p_draw = kick(state["momentum"], force, half)  # last B(h/2) of the previous step

        p = kick(p_draw, force, half)  # B(h/2), the same force
        theta_new = drift(theta, p, half)  # A(h/2)
        p = ornstein_uhlenbeck(p, xi, a, half, noise[0])  # O(h/2) with the old xi
        xi_new = thermostat(xi, p, half, mu)  # D(h/2)
        p, s, m = sigma.expm_matvec(-(h**2) / 2.0, p)  # C(h): exp(-(h^2/2) Sigma) p
        xi_new = thermostat(xi_new, p, half, mu)  # D(h/2)
        p = ornstein_uhlenbeck(p, xi_new, a, half, noise[1])  # O(h/2) with the new xi
        theta_new = drift(theta_new, p, half)  # A(h/2)

        stats = {
            "kinetic_temperature": kinetic_temperature(p_draw),
            "thermostat": xi,
            "noise_trace": sigma.trace(),
            "expm_scaling": s,
            "expm_degree": m,
        }
        new = {"theta": theta_new, "momentum": p, "thermostat": xi_new}
        return Step(new, theta, logp, stats)
