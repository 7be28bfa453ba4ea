"""NOGIN: the noisy gradient integrator (Matthews & Weare, Algorithm 1, ABOBA)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytensor.tensor as pt

from pymc_sgmcmc.base import SGMCMC, Step, positive
from pymc_sgmcmc.krylov import reads_single_precision_rows
from pymc_sgmcmc.operators import damping, drift, kick, kinetic_temperature

#: Largest min(D, n) for which ``solver="auto"`` forms the D x D (or n x n) system: above it,
#: conjugate gradients' few O(nD) products cost less than the O(n min(D, n)^2) system.
DIRECT_SOLVE_MAX_SIZE = 32
#: Conjugate-gradient iterations under JAX: a cap for the low-rank estimate's kernel (a JAX
#: while loop), all of them for the other forms (a scan); about 10 times the 5-8 a step at
#: h = 1e-3 needs on the D = 100 regression.
JAX_CG_ITERATIONS = 50

__all__ = ["NOGIN"]


class NOGIN(SGMCMC):
    r"""Noisy gradient integrator (Matthews & Weare, Algorithm 1).

    ABOBA for underdamped Langevin dynamics whose O step is damped by the gradient-noise
    covariance :math:`\Sigma` so that injected plus gradient noise balance the friction
    exactly (``ALGORITHMS.md`` section 7), with :math:`\lambda^2 = \tanh(\gamma h / 2)`:

    .. math::
        \theta &\leftarrow \theta + \tfrac{h}{2} p;\quad
            \tilde F, \Sigma \text{ at } \theta;\quad R \sim N(0, I) \\
        p &\leftarrow p + \tfrac{h}{2}\tilde F + \lambda R \\
        p &\leftarrow \bigl((1-\lambda^2) I - \tfrac{h^2}{4}\Sigma\bigr)
              \bigl((1+\lambda^2) I + \tfrac{h^2}{4}\Sigma\bigr)^{-1} p \\
        p &\leftarrow p + \tfrac{h}{2}\tilde F + \lambda R \quad (\text{the same } R) \\
        \theta &\leftarrow \theta + \tfrac{h}{2} p

    For a Gaussian target with Gaussian gradient noise the position marginal is exact at any
    noise level (the paper's Lemma 2); in general the bias is second order in h.

    Parameters
    ----------
    step_size : float, optional
        :math:`h`. Default: chosen during ``tune`` (see :class:`pymc_sgmcmc.base.SGMCMC`:
        ``h = c / omega_max`` of the preconditioned posterior, capped by the gradient-noise
        rule with this class's ``noise_tolerance``); then also in the preconditioned
        coordinates.
    friction : float, default 1.0
        :math:`\gamma > 0`.
    solver : {"auto", "direct", "cg"}, default "auto"
        How :math:`((1+\lambda^2) I + \tfrac{h^2}{4}\Sigma)^{-1} p` is computed. "direct":
        a D x D solve when D <= n, else Woodbury through the n x n system (either costs
        :math:`n \min(D, n)^2` to form); "cg": conjugate gradients with :math:`\Sigma`-vector
        products only (O(nD) each; in one numba kernel with the low-rank estimate,
        :class:`~pymc_sgmcmc.krylov.LowRankShiftedSolve`), stopped at relative residual
        ``cg_tolerance`` (at most 200 iterations; with ``mode="JAX"`` at most 50, and for
        the forms of :math:`\Sigma` other than the low-rank estimate always 50, the iterate
        frozen once converged). "auto" takes "direct" when :math:`\min(D, n) \le 32` and "cg"
        otherwise: at D = 100, n = 500 a CG step costs less than a fifth of a direct one (49
        against 271 µs, ``benchmarks/covariance_results_cost_amd_epyc_2026-11-26.md``;
        78 against 406 µs on the Intel Xeon of
        ``benchmarks/covariance_results_cost_xeon_2026-12-02.md``).
    cg_tolerance : float, default 1e-6
        Relative residual :math:`\|r\| / \|p\|` at which conjugate gradients stop (at least
        1e-5 for a float32 model, whose rounding leaves residuals of about 1e-6). The matrix
        is well conditioned (eigenvalues in :math:`[1+\lambda^2, 1+\lambda^2 +
        \tfrac{h^2}{4}\lambda_{max}(\Sigma)]`), so each iteration gains one to several
        digits; a relative error of 1e-6 in the damped momentum is far below that of
        :math:`\Sigma` itself, estimated from n rows (about :math:`\sqrt{D/n}`). Against 1e-10,
        the earlier default, it takes 20 % less time per step at D = 100, n = 500, h = 1e-3
        (117 against 147 µs, medians of six alternated runs; SGLD 19-21 µs) and 25 % less at
        h = 5e-3 (220 against 294 µs). From 1e-6 up, a float64 model's products read the
        per-observation gradients rounded to float32 and sum them in float32, each entry
        centred first (a slightly different estimate of :math:`\Sigma`, solved to the
        tolerance: the products' error is about 3e-7 relative near the posterior;
        :mod:`pymc_sgmcmc.gram_product`): with float64 sums 9 % off the step at D = 100 and
        19 % at D = 1,000, with float32 sums a further 11 % at D = 100 (77 against 87 µs).
        Below 1e-6 they read them in float64.
    noise_covariance : {"estimate", "exact"}, default "estimate"
        :math:`\Sigma` from the per-observation gradients of the same minibatch as
        :math:`\tilde F` (the paper's practical choice), or, as a testing device, the exact
        full-data covariance :math:`\tfrac{N^2}{n}\mathrm{Cov}_i\, g_i(\theta)`, which costs a
        pass over the data at every step (models with one ``pm.Minibatch`` call only).
    averaging : float, optional
        None (default, the paper): each step uses the estimate of :math:`\Sigma` from its own
        minibatch. A weight :math:`\kappa \in (0, 1]`: the step uses the moving average of the
        estimates so far with :math:`\kappa_t = \max(1/t, \kappa)` on the newest (t counts
        steps from the chain's (re)start), a window of about :math:`2/\kappa` minibatches.
        It removes most of the variance inflation at large step sizes that comes from the
        sample covariance's eigenvalue spread, without changing the estimate's shape, so it
        also holds on strongly anisotropic noise where ``noise_shrinkage`` does not: at
        h = 5e-3, :math:`\kappa` = 0.1, NOGIN's variance ratio 1.01 (W2 0.037) on the D = 100
        regression against 1.49 (0.049) with the paper's estimate, and 1.02 on MNIST 7/9
        against 0.81-0.83 with shrinkage (``benchmarks/noise_estimator_results_*.md``). The
        average is a D x D matrix: O(n D^2) per step to update and a D x D solve (or O(D^2)
        CG products), for D up to a few hundred.
    averaging_interval : int, default 1
        With ``averaging``: steps between updates of the moving average. With more than 1,
        a step that does not update it computes only the summed minibatch force, as SGLD
        does, and damps with one D x D product with
        :math:`((1+\lambda^2) I + \tfrac{h^2}{4}\bar\Sigma)^{-1}`, which the update forms
        (O(n D^2 + D^3), about 0.5 ms at D = 100, n = 500; ``solver`` is then unused). The
        average spans about ``2 * averaging_interval / averaging`` steps, over which the
        position must move little compared with the scale on which :math:`\Sigma(\theta)`
        changes. At D = 100, n = 500, h = 1e-3, every 300 steps (a third of the default
        ``thin`` there) it costs 1.31-1.34 SGLD steps per step against 2.9-3.0 for the paper's
        estimate by CG (``benchmarks/covariance_results_cost_amd_epyc_2026-11-26.md``;
        1.48 against 2.73 on the Intel Xeon of
        ``benchmarks/covariance_results_cost_xeon_2026-12-02.md``; 1.19-1.23 there since the
        steps keep the D x D matrices without copying them,
        :mod:`pymc_sgmcmc.kept_branches`), and at h = 5e-3 gives a variance ratio of 1.03
        against 1.01 for the every-step average and 1.49 for the paper's estimate.
    noise_minibatch : {"same", "independent"}, default "same"
        With "estimate" only: the rows :math:`\Sigma` is estimated from. "same" (the paper):
        the minibatch of the step's force. The estimate is then correlated with the force's
        noise through the third moment of the per-observation gradients, and the damping that
        follows the half kick removes a part of that noise's mean: the posterior mean moves by
        about :math:`-\tfrac{h^2}{4} C c_3`, half mCCAdL's shift (the guide's "The
        same-minibatch estimate shifts the mean"; Lemma 2 assumes the exact Sigma). 1.35
        posterior sd on the logistic regression P3 (N/n = 100) at h = 1.2e-3, 0.02 on the
        Gaussian linear regression P1 at h = 9e-4, within the Monte Carlo error at the step
        size adapted by default (``benchmarks/same_minibatch_bias_results.md``).
        "independent": :math:`\Sigma` from a minibatch drawn for it alone, which removes the
        shift (0.04 sd there) for one more pass over a minibatch per step: 3.5 SGLD steps per
        step at D = 100 against 2.9 by CG
        (``benchmarks/covariance_results_cost_amd_epyc_2026-11-26.md``;
        3.83 against 2.73 on the Intel Xeon of
        ``benchmarks/covariance_results_cost_xeon_2026-12-02.md``). A
        periodic ``averaging`` removes it too, at less cost, for D up to a few hundred.
    noise_shrinkage : {None, "auto"} or float, default None
        With "estimate" only. None uses the paper's estimate of :math:`\Sigma` from one
        minibatch. Otherwise the estimate is shrunk towards the multiple of the identity with
        the same trace,
        :math:`(1-\rho)\hat\Sigma + \rho \operatorname{tr}(\hat\Sigma)/D\, I` (in the
        preconditioned coordinates), with :math:`\rho` Ledoit & Wolf's (2004) optimal
        intensity estimated from the per-observation gradients at the chain start, after
        every adaptation window and at the end of ``tune`` ("auto"; then fixed), or the
        given number in [0, 1]. It removes most of the variance inflation at large step
        sizes that comes from the sample covariance's eigenvalue spread when the gradient
        noise is nearly isotropic (Ledoit-Wolf intensity near 1), at no extra cost per step.
        On strongly anisotropic noise it adds damping where there is little noise and
        under-disperses (MNIST 7/9, intensity 0.11: variance ratio 0.81-0.91 against
        1.02-1.03 without; see ``benchmarks/noise_estimator_results_*.md``).
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
    The momentum is drawn from :math:`N(0, I)` at every chain
    (re)start and at the end of tuning. One step costs one minibatch force with its
    per-observation gradients, plus the damping solve.

    Sampler stats
    -------------
    step_size : float
        :math:`h`.
    <common stats>
    kinetic_temperature : float
        :math:`p^\top p / D` at the end of the step.
    noise_trace : float
        :math:`\operatorname{tr}\Sigma` used in the step's damping (of the moving average
        with ``averaging``; from the independent rows with ``noise_minibatch="independent"``).
        Computed at the stored steps only, from the rows the low-rank kernels read: float32
        at the default tolerance, about 1e-7 relative
        (:data:`~pymc_sgmcmc.krylov.SINGLE_PRECISION_ROWS`).
    noise_shrinkage : float
        The shrinkage intensity :math:`\rho` in use (0 for the paper's estimate).
    """

    name = "nogin"
    # Exact for Gaussian noise of known covariance (Lemma 2), but Sigma is estimated from the
    # n rows of one minibatch.
    noise_tolerance = 0.25
    stats_dtypes_shapes = {
        **SGMCMC.common_stats,
        "kinetic_temperature": (np.float64, []),
        "noise_trace": (np.float64, []),
        **SGMCMC.noise_estimate_stats,
    }

    def __init__(
        self,
        vars=None,
        *,
        step_size: float | None = None,
        friction: float = 1.0,
        solver: Literal["auto", "direct", "cg"] = "auto",
        cg_tolerance: float = 1e-6,
        noise_covariance: Literal["estimate", "exact"] = "estimate",
        averaging: float | None = None,
        averaging_interval: int = 1,
        noise_minibatch: Literal["same", "independent"] = "same",
        noise_shrinkage: float | Literal["auto"] | None = None,
        noise_shrinkage_target: Literal["identity", "diagonal"] = "identity",
        **kwargs,
    ):
        self._set_step_size(step_size)
        self._set_noise_shrinkage(noise_shrinkage, noise_shrinkage_target)
        self._set_averaging(averaging, averaging_interval)
        self._set_noise_minibatch(noise_minibatch)
        self.friction = positive("friction", friction)
        if solver not in ("auto", "direct", "cg"):
            raise ValueError(f"solver must be 'auto', 'direct' or 'cg', got {solver!r}")
        if noise_covariance not in ("estimate", "exact"):
            raise ValueError(
                f"noise_covariance must be 'estimate' or 'exact', got {noise_covariance!r}"
            )
        if noise_covariance == "exact" and (
            (noise_shrinkage, averaging, noise_minibatch) != (None, None, "same")
        ):
            raise ValueError(
                "noise_shrinkage, averaging and noise_minibatch apply to the estimated "
                "covariance only"
            )
        if noise_covariance == "exact" and kwargs.get("control_variates"):
            # The exact Sigma is that of the plain minibatch force, not of the control variate.
            raise ValueError("noise_covariance='exact' cannot be combined with control_variates")
        self.solver = solver
        if not 0.0 < cg_tolerance < 1.0:
            raise ValueError(f"cg_tolerance must lie in (0, 1), got {cg_tolerance}")
        self.cg_tolerance = float(cg_tolerance)
        self.noise_covariance = noise_covariance
        super().__init__(vars, **kwargs)
        if noise_covariance == "exact":
            # Said when the step is built, not at the first block inside pm.sample.
            self.sg_model.check_exact_noise_covariance()

    def same_minibatch_shift_share(self) -> float | None:
        """NOGIN's damping sees half the kick: half of mCCAdL's shift. The exact Sigma
        (a testing device) has no correlation with the force's noise."""
        return None if self.noise_covariance == "exact" else 0.5

    def initial_auxiliary(self, rng):
        return {"momentum": rng.standard_normal(self.dim), **self.noise_average_state("full")}

    def initial_evaluation(self, theta, indices, noise, h):
        return {}  # the force is evaluated mid-step, nothing is carried

    def _covariance(self, theta, sigma):
        """The Sigma of the damping: from the minibatch estimate ``sigma``, or exact."""
        if self.noise_covariance == "exact":
            return self.target.exact_noise_covariance(theta)
        return self.noise_estimate(sigma)

    def _solver(self) -> str:
        if self.solver != "auto":
            return self.solver
        rows = self.sg_model.batch_size or 0  # no minibatch: Sigma = 0, both are trivial
        return "direct" if min(self.dim, rows) <= DIRECT_SOLVE_MAX_SIZE else "cg"

    def _damping_operator(self, sigma, h):
        """((1 + l2) I + b S)^{-1} for :meth:`_damp`, made once per update of a periodic
        average S."""
        lam2 = pt.tanh(self.friction * h / 2.0)
        return sigma.inverse_shifted(1.0 + lam2, h**2 / 4.0)

    def _damp(self, sigma, p, lam2, h, inverse=None):
        # ((1 - l2) I - b S)((1 + l2) I + b S)^{-1} p = 2 ((1 + l2) I + b S)^{-1} p - p.
        b = h**2 / 4.0
        if inverse is not None:  # made by the last update of a periodic average
            solved = damping(p, inverse)
        elif self._solver() == "cg":
            # JAX scans have no data-dependent length: a fixed count, frozen once converged
            # (the low-rank estimate's kernel stops early, capped at this count).
            fixed = {"iterations": JAX_CG_ITERATIONS, "fixed_count": True}
            solved = sigma.solve_shifted_cg(
                1.0 + lam2,
                b,
                p,
                tolerance=self.cg_tolerance,
                **(fixed if self.static_shapes else {}),
            )
        else:
            solved = sigma.solve_shifted(1.0 + lam2, b, p)
        return 2.0 * solved - p

    def integrate(self, state, indices, noise, h, noise_indices=None):
        lam2 = pt.tanh(self.friction * h / 2.0)
        lam, r = pt.sqrt(lam2), noise[0]
        theta = drift(state["theta"], state["momentum"], h / 2.0)  # A(h/2)
        inverse = None  # ((1 + l2) I + b S)^{-1}, made at each update of a periodic average
        if self.averages_periodically:
            force = self.target.force(theta, indices)
            sigma, inverse, average = self.periodically_averaged_noise(
                state,
                lambda: self._covariance(
                    theta, self.target.force_and_noise(theta, noise_indices)[1]
                ),
                "full",
                h,
                self._damping_operator,
            )
        else:
            force, sigma = self.force_and_noise(theta, indices, noise_indices)
            sigma, average = self.averaged_noise(state, self._covariance(theta, sigma), "full")
        p = kick(state["momentum"], force, h / 2.0) + lam * r  # B(h/2) + half the noise
        p = self._damp(sigma, p, lam2, h, inverse)  # O, damped by Sigma
        p = kick(p, force, h / 2.0) + lam * r  # B(h/2) + the same noise
        theta = drift(theta, p, h / 2.0)  # A(h/2)
        stats = {"kinetic_temperature": kinetic_temperature(p)}
        new = {"theta": theta, "momentum": p, **average}
        # tr Sigma only at the draws, from the rows the damping read (see MCCAdL.integrate).
        single = self._solver() == "cg" and reads_single_precision_rows("cg", self.cg_tolerance)
        return Step(new, theta, stats, draw_stats={"noise_trace": sigma.trace(single)})
