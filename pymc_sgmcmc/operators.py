"""The splitting operators every integrator is built from (``ALGORITHMS.md``).

Each function builds a PyTensor graph for one exact sub-flow of the stochastic differential
equations, with unit mass (M = I) and unit temperature (beta = 1):

* ``A`` (:func:`drift`):       d theta = p dt
* ``B`` (:func:`kick`):        dp = F dt (the noisy force held fixed)
* ``O`` (:func:`ornstein_uhlenbeck`): dp = -xi p dt + sqrt(2 A) dW, solved exactly
* ``D`` (:func:`thermostat`):  d xi = mu^{-1} (p^T p - D) dt

A sampler composes them in the order of its paper's splitting; see :mod:`pymc_sgmcmc.samplers`.
"""

from __future__ import annotations

import pytensor.tensor as pt
from pytensor.tensor.variable import TensorVariable

from pymc_sgmcmc.krylov import inner

__all__ = [
    "damping",
    "drift",
    "kick",
    "kinetic_temperature",
    "ornstein_uhlenbeck",
    "thermostat",
]


def drift(theta: TensorVariable, p: TensorVariable, tau) -> TensorVariable:
    """A(tau): theta <- theta + tau p."""
    return theta + tau * p


def kick(p: TensorVariable, force: TensorVariable, tau) -> TensorVariable:
    """B(tau): p <- p + tau F."""
    return p + tau * force


def ornstein_uhlenbeck(
    p: TensorVariable, xi, noise_amplitude, tau, noise: TensorVariable
) -> TensorVariable:
    """O(tau), exact: p <- e^{-xi tau} p + sqrt(A (1 - e^{-2 xi tau}) / xi) R.

    ``noise_amplitude`` is A (the injected noise is sqrt(2A) dW). ``xi`` may be any real
    number (a thermostat can go negative); the variance factor (1 - e^{-2 xi tau}) / xi is
    positive for both signs and tends to 2 tau as xi -> 0, which is used below |xi tau| < 1e-8
    to avoid 0/0.
    """
    xi_tau = xi * tau
    small = pt.abs(xi_tau) < 1e-8
    safe_xi = pt.switch(small, 1.0, xi)
    variance_factor = pt.switch(small, 2.0 * tau, -pt.expm1(-2.0 * xi_tau) / safe_xi)
    return pt.exp(-xi_tau) * p + pt.sqrt(noise_amplitude * variance_factor) * noise


def damping(p: TensorVariable, operator: TensorVariable) -> TensorVariable:
    """p <- E p for a precomputed linear damping E of the momentum (a D x D matrix, or a
    vector for a diagonal E): the covariance damping of mCCAdL's C step, exp(-h^2 Sigma / 2),
    or of NOGIN's O step, made once for a periodically updated Sigma
    (:meth:`pymc_sgmcmc.base.SGMCMC.periodically_averaged_noise`)."""
    # p^T E rather than E p: E is symmetric, and numba compiles no extra BLAS wrapper for it.
    return pt.dot(p, operator) if operator.ndim == 2 else operator * p


def thermostat(xi, p: TensorVariable, tau, rate) -> TensorVariable:
    """D(tau): xi <- xi + (tau / mu) (p^T p - D), with ``rate`` = 1 / mu (0 holds xi)."""
    dim = p.shape[0].astype(p.dtype)
    return xi + (tau * rate) * (inner(p, p) - dim)


def kinetic_temperature(p: TensorVariable) -> TensorVariable:
    """p^T p / D: equals 1 on average at the target temperature (M = I, beta = 1)."""
    return inner(p, p) / p.shape[0].astype(p.dtype)
