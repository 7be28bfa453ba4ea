"""mCCAdL: modified covariance-controlled adaptive Langevin (Wei & Shang 2026, Algorithm 1)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytensor.tensor as pt

from pymc_sgmcmc.base import SGMCMC, Step, Thermostatted, positive
from pymc_sgmcmc.krylov import EXPM_TOLERANCE, reads_single_precision_rows
from pymc_sgmcmc.operators import (
    damping,
    drift,
    kick,
    kinetic_temperature,
    ornstein_uhlenbeck,
    thermostat,
)

__all__ = ["MCCAdL"]


class MCCAdL(Thermostatted):
    r"""Modified covariance-controlled adaptive Langevin (Wei & Shang 2026, Algorithm 1).

    The symmetric splitting BAODCDOAB of the CCAdL dynamics (``ALGORITHMS.md`` section 6):
    B(h/2) A(h/2) O(h/2) D(h/2) C(h) D(h/2) O(h/2) A(h/2) B(h/2), where C integrates
    :math:`dp = -\tfrac{h}{2}\Sigma(\theta) p\,dt` exactly over time h,
    :math:`p \leftarrow \exp(-\tfrac{h^2}{2}\Sigma)\,p`, with only :math:`\Sigma`-vector
    products: by the Lanczos process with a bound on its error rather than the paper's scaled
    Taylor polynomial (eqs. 18-22), whose choice of scaling needs an estimate of
    :math:`\|\Sigma\|`; the same product, to the same tolerance, from a third of the products
    at the papers' step sizes (see :func:`pymc_sgmcmc.krylov.lanczos_expm`).

    :math:`\Sigma` comes from the per-observation gradients of the minibatch of the step's
    force evaluation (eq. 15, no moving average; see ``noise_minibatch`` for the bias this
    brings at large steps), i.e. at the position where the step starts:
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
        O(D^2) per product) or its diagonal (whose exponential is exact and elementwise:
        ``expm_products`` 0).
    averaging : float, optional
        None (default, the paper): each step uses the estimate of :math:`\Sigma` from its own
        minibatch. A weight :math:`\kappa \in (0, 1]`: the step uses the moving average of the
        estimates so far with :math:`\kappa_t = \max(1/t, \kappa)` on the newest (t counts
        steps from the chain's (re)start), a window of about :math:`2/\kappa` minibatches.
        It removes the part of the variance inflation at large step sizes that comes from the
        sample covariance's eigenvalue spread without changing the estimate's shape, so it
        also holds on strongly anisotropic noise (MNIST 7/9 at h = 5e-3: variance ratio 1.02,
        1.04 with the paper's estimate). The rest of mCCAdL's inflation is a limit of its
        splitting, not of the estimate (the D = 100 regression at h = 5e-3: 1.55 with the
        average or with shrinkage, 1.85 with the paper's estimate; NOGIN there: 1.01;
        ``benchmarks/noise_estimator_results_*.md``). The
        average is kept in the ``covariance`` form, D x D for "lowrank" and "full" (O(n D^2)
        per step to update, O(D^2) per product: for D up to a few hundred), a vector for
        "diag".
    averaging_interval : int, default 1
        With ``averaging``: steps between updates of the moving average. With more than 1,
        a step that does not update it computes only the summed minibatch force, as SGNHT
        does, and its C step is one D x D product with :math:`\exp(-\tfrac{h^2}{2}\bar\Sigma)`,
        which the update forms (O(n D^2 + D^3), about 0.4 ms at D = 100, n = 500);
        ``expm_products`` is then 0. The average spans about
        ``2 * averaging_interval / averaging`` steps, over which the position must move
        little compared with the scale on which :math:`\Sigma(\theta)` changes. At D = 100,
        n = 500, h = 1e-3, every 300 steps (a third of the default ``thin`` there) it costs
        1.43-1.48 SGLD steps per step against 2.4-2.6 for the paper's estimate
        (``benchmarks/covariance_results_cost_amd_epyc_2026-11-26.md``;
        1.56 against 2.59 on the Intel Xeon of
        ``benchmarks/covariance_results_cost_xeon_2026-12-02.md``; 1.28-1.33 there since the
        steps keep the D x D matrices without copying them,
        :mod:`pymc_sgmcmc.kept_branches`), and gives the same variance ratio as the every-step
        average at h = 5e-3 (1.52 against 1.51).
    noise_minibatch : {"same", "independent"}, default "same"
        The rows :math:`\Sigma` is estimated from. "same" (the paper's eq. 15): the
        minibatch of the step's force, whose per-observation gradients give both. The
        estimate is then correlated with the force's noise :math:`\eta` through the third
        moment of the per-observation gradients, and the C step that follows the kick
        :math:`h\tilde F` removes :math:`\tfrac{h^3}{2} E[\hat\Sigma\eta]` from the momentum
        per step on average: the posterior mean moves by about
        :math:`-\tfrac{h^2}{2} C c_3`, C the posterior covariance,
        :math:`c_3 = \tfrac{N^3}{n^2} E[d\,\|d\|^2]` over the centred per-observation
        gradients d (the guide's "The same-minibatch estimate shifts the mean"). 2.7
        posterior sd on the logistic regression P3 (N/n = 100) at h = 1.2e-3, 0.57 at
        h = 5e-4; 0.04 on the Gaussian linear regression P1 at h = 9e-4; within the Monte
        Carlo error at the step size adapted by default
        (``benchmarks/same_minibatch_bias_results.md``). "independent": :math:`\Sigma` from
        a minibatch drawn for it alone, which removes the shift (0.04 sd there) for one more
        pass over a minibatch per step: 3.2 SGLD steps per step at D = 100 against 2.4
        (``benchmarks/covariance_results_cost_amd_epyc_2026-11-26.md``;
        3.57 against 2.59 on the Intel Xeon of
        ``benchmarks/covariance_results_cost_xeon_2026-12-02.md``). A periodic ``averaging``
        removes it too, at less cost, for D up to a few hundred.
    noise_shrinkage : {None, "auto"} or float, default None
        None uses the paper's estimate of :math:`\Sigma` from one minibatch. Otherwise the
        estimate is shrunk towards the multiple of the identity with the same trace,
        :math:`(1-\rho)\hat\Sigma + \rho \operatorname{tr}(\hat\Sigma)/D\, I` (in the
        preconditioned coordinates), with :math:`\rho` Ledoit & Wolf's (2004) optimal
        intensity estimated from the per-observation gradients at the chain start, after
        every adaptation window and at the end of ``tune`` ("auto"; then fixed), or the
        given number in [0, 1]. It removes the part of the variance inflation at large step
        sizes that comes from the sample covariance's eigenvalue spread, and makes the C step
        cheaper (its Lanczos product only sees (1 - rho) times the spread); the rest of
        mCCAdL's inflation at large h comes from the gradient noise h^2 Sigma per step
        outgrowing the unit momentum variance the C step can remove (see
        ``benchmarks/noise_estimator_results_*.md``).
    noise_shrinkage_target : {"identity", "diagonal"}, default "identity"
        What ``noise_shrinkage`` shrinks towards: the multiple of the identity with the same
        trace (Ledoit & Wolf 2004), or the estimate's own diagonal,
        :math:`(1-\rho)\hat\Sigma + \rho \operatorname{diag}\hat\Sigma` (Schäfer & Strimmer 2005:
        only the correlations are shrunk, so per-coordinate noise levels are kept; "auto"
        then estimates :math:`\rho` from the off-diagonal entries). Same cost per step.
    expm_tolerance : {"half", "single", "double"}, default "half"
        Bound on the error of the C step's product relative to :math:`\|p\|`: 2^-11, 2^-24
        or 2^-53. With :math:`\|\tfrac{h^2}{2}\Sigma\|` of order one, "half" (5e-4) is a
        perturbation of :math:`\Sigma` of about 5e-4 relative, orders of magnitude less than
        its estimation error from n rows (about :math:`\sqrt{D/n}` relative: 45 % at
        D = 100, n = 500). Measured on the D = 100 regression at h = 1e-3: 3 products and
        errors of at most 2e-4 for "half", 5-6 products and 5e-8 for "single". At "half" a
        float64 model's products read the per-observation gradients rounded to float32
        and sum them in float32, each entry centred first (the products' error about 3e-7
        relative near the posterior, 2e-6 with the gradients 100 sds from zero, where the
        rounding alone costs as much: :mod:`pymc_sgmcmc.gram_product`). That took 9 % off
        the step at D = 100 and 16 % at D = 1,000 with float64 sums, and the float32 sums
        a further 8 % at D = 100 (65 against 71 µs); "single" and "double" read the
        gradients in float64.
    expm_max_products : int, default 64
        At most this many :math:`\Sigma`-vector products per C step (Lanczos iterations). A
        step that reaches the cap without meeting the tolerance's bound is kept when the
        a-posteriori error estimate meets it, else treated as a divergence. Far enough from
        the cap at the papers' step sizes near the posterior (3 products at h = 1e-3, 11 at
        h = 5e-3 on the D = 100 regression) and in the transient from theta = 0 (about 30
        at h = 1e-3). With ``mode="JAX"`` the low-rank estimate's loop stops there too (a JAX
        while loop); the other forms of :math:`\Sigma` run a scan, whose length is fixed:
        every step runs this many iterations (those after the stop change nothing).
    **kwargs
        ``thin``, ``block_steps``, ``mode``, ``compile_kwargs``, ``model``,
        ``divergence_threshold``: see :class:`pymc_sgmcmc.base.SGMCMC`.

    Notes
    -----
    ``tune`` draws adapt the kernel (step size if not given, diagonal preconditioner, thin;
    see :class:`pymc_sgmcmc.base.SGMCMC`); after tuning the kernel is fixed.
    Momentum :math:`N(0, I)` and :math:`\xi = A` at every chain (re)start and at the end of
    tuning; in the initial interval of an adapted warm-up :math:`\xi` is held at A (see
    :class:`~pymc_sgmcmc.base.Thermostatted`). The C step costs ``expm_products``
    covariance-vector products, one pass each over the per-observation gradients
    (:class:`~pymc_sgmcmc.gram_product.CentredGramProduct`; the Lanczos process around them runs
    in one kernel, :class:`~pymc_sgmcmc.krylov.LowRankExpm`). At D = 100, n = 500 on the Intel
    Xeon each product costs about a quarter of an SGLD step, the Lanczos bookkeeping about
    0.2 of one, and writing the per-observation gradients 0.4
    (``benchmarks/product_floor_results.md``, 2026-12-05): 2.3x SGLD's step in all at
    h = 1e-3, three products (``benchmarks/criteria_results.md``; 2.4-2.6x on the AMD EPYC of
    ``benchmarks/covariance_results_cost_amd_epyc_2026-11-26.md``).

    Sampler stats
    -------------
    step_size : float
        :math:`h`.
    <common stats>
    kinetic_temperature : float
        :math:`p^\top p / D` at the draw.
    thermostat : float
        :math:`\xi` at the draw.
    noise_trace : float
        :math:`\operatorname{tr}\Sigma` at the draw's force evaluation (of the moving average
        with ``averaging``; from the independent rows with ``noise_minibatch="independent"``).
        Computed at the stored steps only, from the rows the low-rank kernels read: float32
        at the default tolerance, about 1e-7 relative
        (:data:`~pymc_sgmcmc.krylov.SINGLE_PRECISION_ROWS`).
    expm_products : int
        :math:`\Sigma`-vector products (Lanczos iterations) of the C step that followed the
        draw (0 with a diagonal :math:`\Sigma` or a periodically updated average, whose
        exponentials are exact).
    noise_shrinkage : float
        The shrinkage intensity :math:`\rho` in use (0 for the paper's estimate).
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
        "expm_products": (np.int64, []),
        **SGMCMC.noise_estimate_stats,
    }

    def __init__(
        self,
        vars=None,
        *,
        step_size: float | None = None,
        friction: float = 1.0,
        thermostat_mass: float | None = None,
        covariance: Literal["lowrank", "full", "diag"] = "lowrank",
        averaging: float | None = None,
        averaging_interval: int = 1,
        noise_minibatch: Literal["same", "independent"] = "same",
        noise_shrinkage: float | Literal["auto"] | None = None,
        noise_shrinkage_target: Literal["identity", "diagonal"] = "identity",
        expm_tolerance: Literal["half", "single", "double"] = "half",
        expm_max_products: int = 64,
        **kwargs,
    ):
        self._set_step_size(step_size)
        self._set_noise_shrinkage(noise_shrinkage, noise_shrinkage_target)
        self._set_averaging(averaging, averaging_interval)
        self._set_noise_minibatch(noise_minibatch)
        self.friction = positive("friction", friction)
        if covariance not in ("lowrank", "full", "diag"):
            raise ValueError(f"covariance must be 'lowrank', 'full' or 'diag', got {covariance!r}")
        self.covariance = covariance
        if expm_tolerance not in EXPM_TOLERANCE:
            raise ValueError(
                f"expm_tolerance must be 'half', 'single' or 'double', got {expm_tolerance!r}"
            )
        self.expm_tolerance = expm_tolerance
        if int(expm_max_products) != expm_max_products or expm_max_products < 1:
            raise ValueError(
                f"expm_max_products must be a positive integer, got {expm_max_products}"
            )
        self.expm_max_products = int(expm_max_products)
        super().__init__(vars, **kwargs)
        self._set_thermostat_mass(thermostat_mass)

    def same_minibatch_shift_share(self) -> float | None:
        """The C step damps the whole kick with Sigma-hat: all of the shift; the diagonal
        estimate carries only the small part of c3 on the diagonal (not checked)."""
        return None if self.covariance == "diag" else 1.0

    @property
    def _average_form(self) -> str:
        return "diag" if self.covariance == "diag" else "full"

    def initial_auxiliary(self, rng):
        return {**super().initial_auxiliary(rng), **self.noise_average_state(self._average_form)}

    def initial_evaluation(self, theta, indices, noise, h):
        return {}  # the force is evaluated at the top of each iteration

    def integrate(self, state, indices, noise, h, noise_indices=None):
        rate, a, half = self.thermostat_rate, self.friction, h / 2.0
        theta, xi = state["theta"], state["thermostat"]
        exp_damping = None  # exp(-h^2 Sigma / 2), made at each update of a periodic average
        if self.averages_periodically:
            force = self.target.force(theta, indices)
            sigma, exp_damping, average = self.periodically_averaged_noise(
                state,
                lambda: self.noise_estimate(self.target.force_and_noise(theta, noise_indices)[1]),
                self._average_form,
                h,
                lambda average, h: average.expm(-(h**2) / 2.0),
            )
        else:
            force, sigma = self.force_and_noise(theta, indices, noise_indices)
            sigma = self.noise_estimate(sigma.as_form(self.covariance))
            sigma, average = self.averaged_noise(state, sigma, self._average_form)
        p_draw = kick(state["momentum"], force, half)  # last B(h/2) of the previous step

        p = kick(p_draw, force, half)  # B(h/2), the same force
        theta_new = drift(theta, p, half)  # A(h/2)
        p = ornstein_uhlenbeck(p, xi, a, half, noise[0])  # O(h/2) with the old xi
        xi_new = thermostat(xi, p, half, rate)  # D(h/2)
        if exp_damping is None:
            p, products = sigma.expm_matvec(  # C(h); JAX: a fixed count unless low-rank
                -(h**2) / 2.0, p, self.expm_tolerance, self.expm_max_products, self.static_shapes
            )
        else:
            p, products = damping(p, exp_damping), pt.constant(0, dtype="int64")  # C(h)
        xi_new = thermostat(xi_new, p, half, rate)  # D(h/2)
        p = ornstein_uhlenbeck(p, xi_new, a, half, noise[1])  # O(h/2) with the new xi
        theta_new = drift(theta_new, p, half)  # A(h/2)

        stats = {
            "kinetic_temperature": kinetic_temperature(p_draw),
            "thermostat": xi,
            "expm_products": products,
        }
        new = {"theta": theta_new, "momentum": p, "thermostat": xi_new, **average}
        # tr Sigma only at the draws, from the rows the C step read: computed with the force,
        # in the loop that writes G, it cost every step a pass (about 5 % of it at D = 100).
        single = reads_single_precision_rows("expm", self.expm_tolerance)
        return Step(new, theta, stats, draw_stats={"noise_trace": sigma.trace(single)})
