"""Weak order of every integrator: bias of the posterior variance against the step size.

On the full-batch Gaussian regression of ``tests/weak_order.py`` (N = 100, D = 2, posterior
precision close to I, no ``pm.Minibatch``: the force is exact and only discretisation bias
remains), each sampler runs inside ``pm.sample`` at three or four step sizes. For each, the
relative variance bias b(h) = mean_j <z_j^2> - 1 of the whitened draws is measured with its
Monte Carlo standard error (ArviZ ESS), and the order is the slope of log|b| against log h by
weighted least squares (delta-method weights), with a parametric-bootstrap check of its error.
For the linear schemes the exact b(h) of the discrete recursion (discrete Lyapunov equation) is
printed beside the sampled one. A second table repeats the thermostatted schemes and NOGIN with
minibatches (n = 50 of N = 100), where gradient noise adds its own bias: there the noise is
large for the larger step sizes, so the fitted slopes are effective slopes, not orders.
Writes ``benchmarks/weak_order_results.md``.

Run: ``.venv/bin/python benchmarks/weak_order.py`` (about 15 minutes on 2 busy cores with a
warm compile cache, up to a minute more per sampler configuration when cold); ``--quick`` for
a smoke run with a tenth of the draws, or scheme names (``SGLD NOGIN``) to run only those
(neither writes the file).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))

from report import script_parser  # noqa: E402
from weak_order import (  # noqa: E402
    LINEAR_SCHEMES,
    DivergenceError,
    VarianceBias,
    fit_order,
    linear_scheme_bias,
    omega_max,
    sample_variance_bias,
    weak_order_problem,
)

from pymc_sgmcmc import MSGLD, NOGIN, SGHMC, SGLD, SGNHT, CCAdL, MCCAdL  # noqa: E402

#: Friction A (gamma for NOGIN) of every momentum sampler: about omega, so the variance mixes
#: in a few time units.
FRICTION = 1.0


@dataclass
class Scheme:
    """One sampler configuration and the step sizes it is measured at."""

    name: str
    make: Callable[[float, int], object]  # (step_size, thin) -> step method
    step_sizes: tuple[float, ...]
    draws: int  # per chain; 2 chains
    draw_time: float  # thin = ceil(draw_time / step size): every draw covers the same time
    expected: str  # the order expected, and why

    @property
    def langevin(self) -> bool:
        """SGLD-type: the step size is eps = h^2, its dimensionless form eps * omega^2."""
        return self.name.endswith("SGLD")

    def thin(self, step_size: float) -> int:
        return int(np.ceil(self.draw_time / step_size))


def momentum(cls, **kwargs) -> Callable[[float, int], object]:
    return lambda h, thin: cls(
        step_size=h, friction=FRICTION, thin=thin, adapt_preconditioner=False, **kwargs
    )


def langevin(cls) -> Callable[[float, int], object]:
    return lambda eps, thin: cls(step_size=eps, thin=thin, adapt_preconditioner=False)


EULER_H = (0.1, 0.15, 0.2, 0.25)  # h = 0.3 diverges (thermostat instability)
SYMMETRIC_H = (0.45, 0.6, 0.75, 0.9)
SCHEMES = [
    Scheme("SGNHT euler", momentum(SGNHT, splitting="euler"), EULER_H, 40_000, 2.0, "1"),
    Scheme("CCAdL", momentum(CCAdL), EULER_H, 40_000, 2.0, "1 (SGNHT euler: Sigma = 0)"),
    Scheme("mCCAdL", momentum(MCCAdL), SYMMETRIC_H, 40_000, 1.5, "2"),
    Scheme("SGNHT BADODAB", momentum(SGNHT), (0.3, 0.6, 0.9, 1.2), 40_000, 1.5, "2 (or less)"),
    Scheme("NOGIN", momentum(NOGIN), (0.3, 0.6, 0.9, 1.2), 20_000, 1.5, "b = 0 (Lemma 2)"),
    Scheme("SGHMC", momentum(SGHMC), (0.3, 0.4, 0.5, 0.6), 40_000, 2.0, "2 (Lyapunov)"),
    Scheme("SGLD", langevin(SGLD), (0.1, 0.2, 0.4, 0.8), 40_000, 2.0, "1 in eps"),
    Scheme("mSGLD", langevin(MSGLD), (0.1, 0.2, 0.4, 0.8), 40_000, 2.0, "1 in eps (SGLD)"),
]

#: Batch size of the second table: gradient noise E Sigma ~ 2.5 I, so h^2 Sigma ~ 0.2-2 over
#: the step sizes used (the noise is comparable to the injected 2 h A).
NOISY_BATCH = 50
#: h^2 lambda_max(E Sigma) <= 1.04 here; beyond (h = 0.9 gives 2.3) the next orders dominate.
NOISY_SYMMETRIC_H = (0.3, 0.4, 0.5, 0.6)
NOISY_SCHEMES = [
    Scheme("SGNHT euler", momentum(SGNHT, splitting="euler"), EULER_H, 40_000, 2.0, "1"),
    Scheme("CCAdL", momentum(CCAdL), EULER_H, 40_000, 2.0, "1"),
    Scheme("mCCAdL", momentum(MCCAdL), NOISY_SYMMETRIC_H, 40_000, 1.5, "2 (paper)"),
    Scheme("SGNHT BADODAB", momentum(SGNHT), NOISY_SYMMETRIC_H, 40_000, 1.5, "none known"),
    Scheme(
        "NOGIN exact Sigma",
        momentum(NOGIN, noise_covariance="exact"),
        (0.3, 0.6, 0.9, 1.2),
        20_000,
        1.5,
        "b = 0 (Lemma 2)",
    ),
    Scheme("NOGIN", momentum(NOGIN), (0.3, 0.6, 0.9, 1.2), 20_000, 1.5, "Sigma-hat bias"),
]


@dataclass
class Group:
    """One table: a problem (full batch or minibatched) and the schemes run on it."""

    title: str
    batch_size: int | None
    schemes: list[Scheme]
    asymptotic: bool  # whether the step sizes are small enough to read an order off the slope


GROUPS = [
    Group("Full batch (exact force, Sigma = 0)", None, SCHEMES, asymptotic=True),
    Group(
        f"With gradient noise: minibatches of n = {NOISY_BATCH} of N = 100 (drawn with "
        "replacement)",
        NOISY_BATCH,
        NOISY_SCHEMES,
        asymptotic=False,
    ),
]

#: A bias below this many standard errors is not fitted (its log has no useful error bar).
MIN_Z = 3.0


@dataclass
class Measured:
    """b(h) sampled, and the closed-form b(h) where the scheme is linear."""

    step_size: float
    sampled: VarianceBias | None  # None: the chain diverged at this step size
    exact: float | None


def measure(scheme: Scheme, problem, scale: float) -> list[Measured]:
    """b(h) at each step size of ``scheme``; ``scale`` multiplies the number of draws. The
    closed form (linear schemes) is for the full-batch problem only."""
    results = []
    base = scheme.name.split()[0]
    linear = base in LINEAR_SCHEMES and problem.batch_size is None
    for h in scheme.step_sizes:
        start = time.perf_counter()
        with warnings.catch_warnings():
            # PyMC's advice for short runs is noise here; divergences raise in the sampling.
            warnings.simplefilter("ignore")
            try:
                sampled = sample_variance_bias(
                    problem,
                    lambda step_size: scheme.make(step_size, scheme.thin(step_size)),
                    h,
                    draws=max(1000, round(scheme.draws * scale)),
                )
            except DivergenceError:
                sampled = None
        exact = linear_scheme_bias(base, problem, h, FRICTION) if linear else None
        seconds = time.perf_counter() - start
        if sampled is None:
            print(f"{scheme.name:14s} h={h:<5} diverged ({seconds:.0f} s)", flush=True)
        else:
            print(
                f"{scheme.name:14s} h={h:<5} b={sampled.bias:+.4f} se={sampled.se:.4f} "
                f"z={sampled.z:5.1f} ess={sampled.ess:7.0f} "
                f"exact={'-' if exact is None else f'{exact:+.4f}'} ({seconds:.0f} s)",
                flush=True,
            )
        results.append(Measured(h, sampled, exact))
    return results


def bias_rows(scheme: Scheme, results: list[Measured], omega: float) -> list[str]:
    rows = []
    for m in results:
        exact = "" if m.exact is None else f"{m.exact:+.4f}"
        scaled = m.step_size * omega**2 if scheme.langevin else m.step_size * omega
        head = f"| {scheme.name} | {m.step_size:g} | {scheme.thin(m.step_size)} | {scaled:.3f} | "
        r = m.sampled
        if r is None:
            rows.append(head + "diverged | | | | |")
        else:
            rows.append(head + f"{r.bias:+.4f} | {r.se:.4f} | {r.z:.1f} | {r.ess:,.0f} | {exact} |")
    return rows


def determined_order(fit) -> str:
    """The integer p that the slope rounds to, if its 4-se interval lies in (p - 1, p + 1)."""
    order = round(fit.slope)
    low, high = fit.interval()
    return str(order) if order - 1 < low and high < order + 1 else "no"


def order_row(scheme: Scheme, measured: list[Measured], asymptotic: bool) -> str:
    results = [m.sampled for m in measured if m.sampled is not None]
    if len(results) < 3:
        return (
            f"| {scheme.name} | not fitted: fewer than 3 step sizes without divergence "
            f"| | | | | {scheme.expected} |"
        )
    z_min = min(r.z for r in results)
    if z_min < MIN_Z:
        z_max = max(r.z for r in results)
        largest = max(abs(r.bias) for r in results)
        return (
            f"| {scheme.name} | not fitted: largest abs(b)/se = {z_max:.1f} "
            f"(largest abs(b) = {largest:.4f}) | | | | | {scheme.expected} |"
        )
    fit = fit_order(results)
    low, high = fit.interval()
    return (
        f"| {scheme.name} | {fit.slope:.2f} ± {fit.slope_se:.2f} | {fit.bootstrap_sd:.2f} | "
        f"[{low:.2f}, {high:.2f}] | {fit.chi2:.1f} (dof {len(results) - 2}) | "
        f"{determined_order(fit) if asymptotic else 'not read (effective slope)'} | "
        f"{scheme.expected} |"
    )


def group_lines(group: Group, measured: dict[str, list[Measured]], problem) -> list[str]:
    """The bias table and the order table of one group."""
    omega = omega_max(problem)
    lines = [
        f"## {group.title}",
        "",
        "| scheme | step size | thin | h·omega_max (eps·omega_max²) | b | se | abs(b)/se | ESS "
        "| exact b |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for scheme in group.schemes:
        if scheme.name in measured:
            lines += bias_rows(scheme, measured[scheme.name], omega)
    lines += [
        "",
        "| scheme | slope ± se (WLS) | bootstrap sd | 4-se interval | chi^2 | order determined "
        "| expected |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for scheme in group.schemes:
        if scheme.name in measured:
            lines.append(order_row(scheme, measured[scheme.name], group.asymptotic))
    return [*lines, ""]


def report(measured: dict, seconds: float) -> str:
    problem = weak_order_problem()
    omega = omega_max(problem)
    noisy = weak_order_problem(NOISY_BATCH)
    noise = noisy.expected_noise_covariance(noisy.mean, noisy.cov)
    lines = [
        "# Weak order: bias of the posterior variance against the step size",
        "",
        "Written by `benchmarks/weak_order.py` (method in its docstring and in "
        "`tests/weak_order.py`).",
        f"Target: Gaussian regression, N = 100, D = 2, posterior precision "
        f"eigenvalues {np.round(np.linalg.eigvalsh(problem.precision), 3).tolist()} "
        f"(omega_max = {omega:.3f}, stability limit 2/omega_max = {2 / omega:.2f}); "
        f"friction A = gamma = {FRICTION}, thermostat mass D; 2 chains started at the "
        "posterior mean, a tenth of the draws as burn-in.",
        "b = mean_j <z_j^2> - 1 for the whitened draws z; se from ArviZ's ESS of the series "
        "mean_j z_j^2; exact: the closed-form stationary b of the linear schemes (discrete "
        "Lyapunov, full batch). SGLD and mSGLD: the step size is eps (= h^2 of the momentum "
        "samplers).",
        "",
        "Order: slope of log|b| against log(step size), weighted least squares with weights "
        "from se(b)/|b|; bootstrap: sd of the slope over 4,000 parametric replicates "
        "b ~ N(b, se^2); 4-se interval with the larger of the two errors; chi^2 of the "
        "power-law fit; order determined: the integer p the slope rounds to when the "
        "4-se interval lies inside (p - 1, p + 1), i.e. both neighbouring orders are "
        "rejected (the criterion of `tests/test_weak_order.py`). Not fitted: a bias within "
        f"{MIN_Z:g} se of zero at some step size.",
        "",
        f"With gradient noise, E Sigma over the posterior has eigenvalues "
        f"{np.round(np.linalg.eigvalsh(noise), 2).tolist()}, so h^2 lambda_max(Sigma) runs "
        "from about 0.03 to 1 over the step sizes of the second table (4 at NOGIN's h = 1.2): "
        "the noise is not small there and the fitted slopes are effective slopes, from which "
        "no order is read.",
        "",
    ]
    for group in GROUPS:
        if group.title in measured:
            lines += group_lines(group, measured[group.title], weak_order_problem())
    lines += [
        f"Machine: {platform.machine()}, Python {platform.python_version()}; "
        f"total {seconds / 60:.1f} min.",
        "",
    ]
    return "\n".join(lines)


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """``--quick`` and scheme names, checked against the schemes of :data:`GROUPS`."""
    parser = script_parser(__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="a tenth of the draws (the file is not written)"
    )
    names = sorted({s.name for group in GROUPS for s in group.schemes})
    parser.add_argument(
        "schemes",
        nargs="*",
        choices=names,
        metavar="SCHEME",
        help=f"run only these schemes (the file is not written): {', '.join(names)}",
    )
    return parser.parse_intermixed_args(argv)


def main(argv: list[str]) -> None:
    """Measure b(h) for the chosen schemes (all by default) and print the tables."""
    arguments = parse_arguments(argv)
    quick, names = arguments.quick, arguments.schemes
    start = time.perf_counter()
    measured = {}
    for group in GROUPS:
        problem = weak_order_problem(group.batch_size)
        print(f"# {group.title}", flush=True)
        measured[group.title] = {
            s.name: measure(s, problem, 0.1 if quick else 1.0)
            for s in group.schemes
            if not names or s.name in names
        }
    text = report(measured, time.perf_counter() - start)
    print(text)
    if not quick and not names:
        (HERE / "weak_order_results.md").write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
