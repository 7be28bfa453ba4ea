"""The PyMC adapter shared by every sampler: blocks of compiled steps served one draw at a time.

A sampler subclass only says how one integrator step transforms the state (its paper's
algorithm box, written with :mod:`pymc_sgmcmc.operators`). This class owns the rest of the PyMC
step-method contract (``PLATFORM_NOTES.md``):

* it compiles ``block_steps`` integrator steps into one PyTensor ``scan`` whose sequences are
  the minibatch indices, the Gaussian noise and the step sizes, all drawn here, in NumPy, from
  the chain's own generator: runs are reproducible whatever ``cores`` is, and every chain has
  its own minibatch stream; a block has one compiled length (``compiled_length``), so a
  shorter block runs padded (numba and C stop after its last real step, which a flag marks;
  JAX runs every padded step, flagged inactive, leaving the state unchanged), and a
  ``logp`` flag: the minibatch log-density at the draw is a lazy branch (``ifelse``) computed
  only at the steps the host reads (the stored draws and the runaway check's);
* ``astep`` hands out the stored draws of a block one by one (every ``thin``-th step), and
  ``step`` serves the point dict PyMC hands back without PyMC's per-draw dict / array
  round trip;
* a non-finite state, a position beyond ``divergence_threshold`` or a collapse of the
  minibatch log-density (with a momentum, of the log-density less the kinetic energy's excess)
  far below the chain's typical value, or, in the transient from a chain's start, kinetic
  energy grown beyond what the log-density and the gradient noise can supply flags
  ``diverging``;
  the chain restarts from its last sane draw (with
  fresh auxiliary variables) instead of producing garbage, and a warning says which step size to
  try;
* ``setup_chain`` reseeds and resets all per-chain state, kept in ``_state_class``.
"""

from __future__ import annotations

import functools
import textwrap
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import pytensor
import pytensor.tensor as pt
from pymc.blocking import RaveledVars
from pymc.exceptions import SamplingError
from pymc.model import modelcontext
from pymc.step_methods.arraystep import ArrayStepShared
from pymc.step_methods.compound import Competence, StepMethodState
from pymc.step_methods.state import dataclass_state
from pymc.util import get_value_vars_from_user_vars
from pytensor.compile.mode import get_mode
from pytensor.conditional.op import ifelse
from pytensor.link.jax.linker import JAXLinker
from pytensor.scan.utils import until
from pytensor.tensor.variable import TensorVariable
from rich.progress import TextColumn
from rich.table import Column
from scipy.stats import chi2

from pymc_sgmcmc.adaptation import (
    DENSE_MAX_DIM,
    MIN_TUNE_FOR_WINDOWS,
    ROTATION_GAIN,
    WindowVariance,
    adaptation_boundaries,
    is_positive_definite,
    measured_curvature,
    posterior_correlation,
    strong_correlations,
)
from pymc_sgmcmc.blas_threads import one_blas_thread
from pymc_sgmcmc.gather_dot import with_gather_dot
from pymc_sgmcmc.gram_product import with_covariance_kernels
from pymc_sgmcmc.jax_compile import DeviceData, for_jax, jax_has_float64
from pymc_sgmcmc.kept_branches import with_kept_branches
from pymc_sgmcmc.model_layer import (
    EXACT_CURVATURE_DIM,
    SHRINKAGE_TARGETS,
    ControlVariate,
    DenseCovariance,
    DiagonalCovariance,
    ModelError,
    NoiseMoments,
    PreconditionedTarget,
    Preconditioner,
    SGModel,
    building_graphs,
    moving_average,
    non_centred_products,
)
from pymc_sgmcmc.numba_compile import (
    BLOCK_SCAN_NAME,
    deterministic_fastmath,
    interrupts_as_such,
    lean_cache_wrappers,
    plain_assignment_errors,
    with_inverse_dimshuffles_dropped,
)
from pymc_sgmcmc.python_mode import has_scalar_loop, one_off_mode
from pymc_sgmcmc.rewrite_cache import compile_pymc_function
from pymc_sgmcmc.runaway import (
    STRIDE,
    TRANSIENT_START,
    TransientReference,
    checked_series,
    extreme_flags,
    first_reference,
    runaway_flags,
    running_medians,
    trailing_history,
    transient_heat_flags,
    updated_reference,
)

__all__ = ["SGMCMC", "SGMCMCState", "Step", "Thermostatted", "positive"]


#: The phases of :meth:`SGMCMC.adapted_step_size` whose kernel the stored draws keep (after
#: tuning, or from the start without windows): they meet the strict noise tolerance.
KEPT_PHASES = ("final", "start_kept")
#: The most integrator steps per stored draw that an adapted ``thin`` takes. Beyond it a draw
#: covers less than a relaxation time and successive draws are correlated; the end of tuning
#: says so (SGMCMC._warn_thin_capped), as NUTS reports reaching its maximum tree depth.
MAX_THIN = 1000
#: How many relaxation times beyond the cap the kept kernel's ``thin`` may fall short before
#: that warning. With draws ``thin = tau / r`` apart (relaxation time ``tau``) an AR(1) chain
#: keeps (1 - e^(-1/r)) / (1 + e^(-1/r)) effective draws per draw: 0.46 at r = 1 (the
#: default, one relaxation time), 0.45 at r = 1.02, 0.32 at r = 1.5. A softmax regression's
#: SGNHT run warned for r = 1.01-1.02 at a bulk ESS of 357-806 from 2,000 draws.
THIN_CAP_WARNING = 1.5
#: The thermostatted samplers warn when their kept draws' kinetic temperature is off 1 by more
#: than this (Thermostatted._warn_if_thermostat_relaxing): a 10 % error in the variance of a
#: coordinate the thermostat reaches, the accuracy the benchmarks ask for.
KINETIC_TEMPERATURE_TOLERANCE = 0.1
#: ... and by more than this many standard deviations of the chance departure of a thermostat
#: at its equilibrium (a short run's xi wanders).
RELAXATION_Z = 5.0
#: With the step size adapted, the kept draws' thermostat is reported when its time average
#: exceeds A by more than this many times A (``Thermostatted._warn_if_thermostat_absorbing``).
THERMOSTAT_EXCESS_WARNING = 1.0
#: A user's step size is reported when the gradient noise it leaves uncorrected makes the
#: draws' variance in some direction more than this fraction too large or too small, as
#: estimated at the first kept draw (``SGMCMC.noise_variance_factors``: SGLD, mSGLD and SGHMC
#: without its noise estimate correct none of it, SGNHT's thermostat only its average over
#: the coordinates; CCAdL, mCCAdL and NOGIN damp it by its estimated covariance). The largest
#: noise eigenvalue's estimate, from 16 pooled minibatches, over-states it by 1.03-1.56x
#: (``SGModel.gradient_noise``): 0.15 = 1.56 x 0.1 reports only chains whose variance there
#: is at least 10 % off, the accuracy the benchmarks ask for. (SGNHT's check reads the
#: diagonal, estimated without that bias from the same rows, against the same bound.)
NOISE_EXCESS_WARNING = 0.15
#: Posterior sd (root mean square over the coordinates) beyond which a user's step size is
#: reported for the mean shift of the papers' same-minibatch noise estimate: the benchmarks'
#: accuracy criterion for the means (``SGMCMC.same_minibatch_shift_share``).
SAME_MINIBATCH_SHIFT_WARNING = 0.1


class Step(NamedTuple):
    """What one integrator step returns (all PyTensor graphs)."""

    state: dict  # carried to the next step
    draw: TensorVariable  # the position stored for this step
    stats: dict  # sampler-specific scalar stats
    # Stats that cost a pass over the minibatch and that the step does not otherwise need:
    # computed only at the steps whose stats the host reads (a lazy branch, as the log-density).
    draw_stats: dict | None = None


#: Tuning draws at which the geometry is measured to choose a step size.
GEOMETRY_POINTS = 4
#: The largest error of the positions' temperature, ``h A / 2``, that the adapted step size of
#: a thermostat with Euler's friction allows (``Thermostatted.adapted_step_size``): 5 % of the
#: variance.
EULER_TEMPERATURE_TOLERANCE = 0.05
#: Distance from the mode, in posterior sd (root mean square over the coordinates), beyond
#: which a chain start whose kernel is kept, or the draws' control-variate anchor, is
#: reported: a posterior draw is at about 1 (chi with D degrees of freedom over sqrt(D)).
FAR_FROM_MODE_WARNING = 3.0
#: Distance from the control variates' anchor, in posterior widths (the last slow window's
#: spreads), beyond which a kept draw is flagged ``diverging``
#: (:meth:`SGMCMC._flag_far_from_anchor`). The control-variate noise grows with the square of
#: that distance, and the step size was chosen for its value at tuning draws within a few
#: widths. Sane chains reached 4.1-6.6 widths on the four adaptation models (NOGIN, MCCAdL,
#: SGNHT and SGLD, 2 x 3,000 draws), 4.6-8.9 on a logistic regression with a level of 10
#: rows (2 x 500) and 7.6-11.4 on a9a (NOGIN, two seeds, 2 x 2,000; a level of 7 rows, with
#: exponential tails, reached 9.9); a runaway MCCAdL chain, 281.
ANCHOR_DISTANCE_LIMIT = 30.0
#: Upper bound on the memory of one block's stored positions, to size blocks at large D.
_BLOCK_MEMORY_BYTES = 64 * 2**20


def positive(name: str, value: Any) -> float:
    """Validate a strictly positive, finite scalar parameter."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a positive number, got {value!r}") from None
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value


def _in_model_dtype(method):
    """Build a sampler's graphs under :func:`~pymc_sgmcmc.model_layer.building_graphs`:
    PyTensor's ``floatX`` set to the model's float type, and no creation traces."""

    @functools.wraps(method)
    def in_model_dtype(self, *args, **kwargs):
        if self.static_shapes:
            # PyTensor's JAX dispatch sets JAX's process-wide float64 switch from floatX when
            # first imported: imported here, under the user's floatX, not the model's.
            import pytensor.link.jax.dispatch  # noqa: F401
        with building_graphs(self.dtype):
            return method(self, *args, **kwargs)

    return in_model_dtype


@dataclass_state
class SGMCMCState(StepMethodState):
    tune: bool
    tune_left: int
    step_count: int
    divergences: int
    warned: bool
    far_warned: bool
    anchor_warned: bool
    short_tune: bool
    stability_check_due: bool
    chain_state: dict | None
    buffer: dict | None
    stat_rows: list | None
    cursor: int
    last_draw: np.ndarray | None
    chain_start: np.ndarray | None
    block_cap: int | None
    typical_logp: float | None
    anchor: np.ndarray
    anchor_force: np.ndarray
    anchor_due: bool
    logp_spreads: list[float]
    logp_history: np.ndarray
    transient_reference: TransientReference
    draws_left: int | None
    step_size: float | None
    scale: np.ndarray
    rotation: np.ndarray | None
    thin: int
    tune_drawn: int
    boundaries: list
    window: Any
    rotated_window: Any
    window_start: np.ndarray | None
    recent: list


#: The line of a sampler's "Sampler stats" docstring section that stands for the stats every
#: sampler records (:meth:`SGMCMC.__init_subclass__` writes them there, from
#: :func:`common_stats_doc`).
COMMON_STATS_MARK = "    <common stats>\n"


def common_stats_doc(momentum: bool) -> str:
    """The numpydoc entries of ``diverging``, ``divergences``, ``thin``, ``minibatch_logp``
    and ``dense_preconditioner``, with the divergence checks of a sampler with or without a
    momentum."""
    checks = (
        "a non-finite position, momentum or force, a position beyond ``divergence_threshold``, "
        "a collapse of the energy (the minibatch log-density less the kinetic energy's excess "
        "over ``D / 2``) or, in the transient from the chain's start, a kinetic energy grown "
        "beyond its sources"
        if momentum
        else "a non-finite position or force, a position beyond ``divergence_threshold``, or "
        "a collapse of the minibatch log-density"
    )
    diverging = (
        f"A step of the draw failed the divergence checks: {checks} (the README's "
        '"Divergences"). The draw repeats the last sane position and the chain restarted '
        "from it."
    )
    indent = " " * 8
    return f"""    diverging : bool
{textwrap.fill(diverging, 96, initial_indent=indent, subsequent_indent=indent)}
    divergences : int
        Number of diverging draws so far in this chain.
    thin : int
        Integrator steps per stored draw (chosen with the step size during ``tune`` when
        neither is given).
    minibatch_logp : float
        Unbiased minibatch estimate of the model log-density (``model.logp()``) at the draw:
        log prior plus N/n times the batch log-likelihood. The exact value is not reported
        because it costs a full pass over the data at every draw.
    dense_preconditioner : bool
        The draw's steps ran in the coordinates of a dense preconditioner: tuning found the
        posterior too correlated for a diagonal one (``adapt_preconditioner``).
"""


class SGMCMC(ArrayStepShared):
    """Base class of the stochastic-gradient samplers (not used directly).

    Its parameters are common to every sampler.

    Parameters
    ----------
    vars : list, optional
        The model's free random variables (or their value variables), as for PyMC's steps;
        must be all of them (the default): every free variable moves in the same integrator
        step.
    thin : int, optional
        Integrator steps per stored draw. The stats of a stored draw are those of its last step.
        Default: 1 when ``step_size`` is given; when the step size is adapted, the number of
        steps in one relaxation time of the dynamics in the preconditioned coordinates
        (``max(A, 1/A) / h`` for the momentum samplers, ``2 / epsilon`` for SGLD and mSGLD,
        at most 1000, with a warning at the end of tuning when the cap binds), re-chosen with
        the step size during ``tune``, so that the default ``draws`` give a useful effective
        sample size. The draws' ``thin`` covers the posterior's widest direction: where the
        Hessian at the last tuning draw (up to 256 coordinates) correlates the preconditioned
        coordinates, its correlation matrix's largest eigenvalue v makes it
        ``max(A v, 1/A) / h`` and ``2 v / epsilon``.
    adapt_preconditioner : {True, "diag", False}, default True
        Estimate a diagonal preconditioner (mass matrix M = diag(sd^-2), sd the standard
        deviations of the tuning draws) during ``tune``, in Stan's doubling windows; every
        operator then runs in the coordinates theta / sd. With a user-given ``step_size`` the
        sd are normalised to a largest value of 1, so that the step size keeps its meaning
        in the widest coordinate and no coordinate becomes harder to integrate. With the
        step size and ``thin`` adapted, a coordinate still travelling over a window (the
        means of its two halves more than ``adaptation.DRIFT_THRESHOLD`` within-half sd
        apart) keeps its previous sd.

        ``True`` also makes the preconditioner dense where a diagonal one cannot follow the
        posterior (with the step size adapted, and up to 256 coordinates): at the end of each
        slow window, where the correlation matrix of the Hessian of -log p at the window's
        last draw (4 minibatches) has a condition number of 4 or more and its Cholesky factor
        conditions the Hessians at the window's first and last draws at least 4 times
        better than the diagonal scales, the coordinates become theta = R (sd * phi), with
        R R^T that Hessian's inverse (Cholesky), and later windows adapt sd in them. It costs
        one more compilation of the sampler's block, and O(D^2) per step. A regression on
        calendar years (intercept and slope correlated at -0.99998) was drawn 7-12 posterior
        sd off by every sampler with a diagonal preconditioner, and within 0.1 sd with the
        dense one; a random intercept with 99 groups (D = 100) 0.2-1.5 sd off (sd ratios
        0.09-0.57), and within 0.1 sd; MNIST 7 vs 9 (D = 100, no coordinate correlated
        with the others beyond R = 0.956) 0.94 sd off by SGLD (ESS 4), and 0.16 sd.
        ``"diag"`` keeps the preconditioner diagonal; ``False`` does not adapt it.
    control_variates : bool, default False
        Use the control-variate force of Baker et al. (2019), F(anchor) + F~(theta) -
        F~(anchor) (both minibatch forces on the same rows; F(anchor) exact, from one pass
        over the data): unbiased, with a gradient noise that shrinks as the chain nears the
        anchor instead of staying at the data's spread, so that with large N / n the step
        size is no longer held down by the noise. Costs a second minibatch gradient per
        step (with a likelihood linear in the data through a predictor, both gradients in
        one pass over the rows on numba) and a pass over the data whenever the anchor
        moves: to the chain's position at its start and at the end of every adaptation
        window, then fixed after tuning (pick enough ``tune`` for the chain to reach the
        posterior). Ignored without
        ``pm.Minibatch``. Kept draws more than 30 posterior widths
        (``base.ANCHOR_DISTANCE_LIMIT``) from the anchor in some coordinate are flagged
        ``diverging``, with a warning: the noise grows with the square of that distance.
        A chain gets there by running away, as on coordinates that rest on a few rows (a
        rare level; the guide's "Large N"), or from an anchor set before it reached the
        posterior.
    block_steps : int, default 1000
        Integrator steps compiled into one call; draws are served from the block. Only speed
        depends on it (fewer Python round trips), not the draws.
    model : pm.Model, optional
    mode : str or pytensor.compile.Mode, optional
        PyTensor compilation mode; the default is PyTensor's (numba in PyTensor 3).
    compile_kwargs : dict, optional
        Extra keyword arguments for :func:`pytensor.function` (``pm.sample`` does not pass its
        own ``compile_kwargs`` to a user-built step).
    divergence_threshold : float, default 1e10
        A step whose position has a coordinate beyond this magnitude (in the unconstrained
        space), or any non-finite state, is divergent; so is a runaway, a step from which the
        running median of the minibatch log-density falls far below the chain's typical value
        (:mod:`pymc_sgmcmc.runaway`). An unstable step size makes the chain grow geometrically
        or drift away; these catch it long before floating-point overflow. Raise the
        threshold for models whose parameters are legitimately that large.
    rng : RandomGenerator, optional
        Replaced per chain by ``pm.sample``'s ``random_seed``.

    Warns
    -----
    RuntimeWarning
        When the chain was still travelling in the last adaptation window, with the step
        size and ``thin`` adapted (give ``tune`` more draws or start nearer the posterior);
        when a user's ``step_size`` is beyond the linear-stability limit at the first kept
        draw, or makes the gradient noise it leaves uncorrected (SGLD, mSGLD, SGHMC without
        its noise estimate: all of it; SGNHT: its spread across the coordinates) put the
        draws' variance more than 15 % off in some direction there
        (``noise_variance_factors``); when steps diverge (once, with the step size to try);
        when a kept draw with control variates lies more than 30 posterior widths from
        their anchor (once; those draws are flagged ``diverging``).

    Notes
    -----
    Precision follows the model: one built under ``pytensor.config.floatX = "float32"``
    (with float32 data: PyMC does not accept a cast of float64 arrays as observed data) is
    sampled in float32 -- position, momentum, noise and every array of the step -- and its
    draws are float32; the sampler stats stay float64. A float32 step reads half the bytes and
    fills twice the SIMD lanes (about 1.5x the steps per second of float64 on the benchmark's
    regressions), and is what accelerators run fastest (``mode="JAX"``). Its 7 significant
    digits suffice while a step's move is well above 1e-7 of the position itself.
    """

    name: ClassVar[str] = "sgmcmc"
    default_blocked = True
    #: ``pm.sample(tune=None)`` asks the step for its tuning length: 1,000 tuning draws (at the
    #: adapted ``thin``), with which every sampler met the accuracy of
    #: ``benchmarks/adaptation_results.md`` on all four test models.
    default_tune_steps: ClassVar[int] = 1000
    _state_class = SGMCMCState
    #: Number of standard-normal D-vectors each integrator step consumes (``noise[0]``,
    #: ``noise[1]``, ... of :meth:`integrate`).
    noise_vectors: ClassVar[int] = 1
    #: Stats every sampler reports; subclasses add their own.
    common_stats: ClassVar[dict] = {
        "step_size": (np.float64, []),
        "diverging": (bool, []),
        "divergences": (np.int64, []),
        "thin": (np.int64, []),
        "minibatch_logp": (np.float64, []),
        "dense_preconditioner": (bool, []),
    }

    def __init_subclass__(cls, **kwargs):
        """A sampler's docstring gets the common stats' entries (:data:`COMMON_STATS_MARK`),
        written once for every sampler: seven copies had drifted apart."""
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and COMMON_STATS_MARK in cls.__doc__:
            momentum = "kinetic_temperature" in cls.stats_dtypes_shapes
            cls.__doc__ = cls.__doc__.replace(COMMON_STATS_MARK, common_stats_doc(momentum))

    def __init__(
        self,
        vars=None,
        *,
        thin: int | None = None,
        adapt_preconditioner: bool | str = True,
        control_variates: bool = False,
        block_steps: int = 1000,
        model=None,
        mode=None,
        compile_kwargs: dict | None = None,
        divergence_threshold: float = 1e10,
        rng=None,
        blocked: bool = True,
    ):
        model = modelcontext(model)
        # PyMC's steps take random variables or their value variables (pm.sample hands the
        # latter to a step it builds itself); the model layer works on value variables.
        vars = model.value_vars if vars is None else get_value_vars_from_user_vars(vars, model)
        self.sg_model = SGModel(model, vars)  # rejects anything but all value variables
        vars = self.sg_model.value_vars  # in the model's order, as PyMC ravels points
        if thin is not None and not (np.isfinite(thin) and int(thin) == thin and thin >= 1):
            raise ValueError(f"thin must be a positive integer, got {thin}")
        if int(block_steps) != block_steps or block_steps < 1:
            raise ValueError(f"block_steps must be a positive integer, got {block_steps}")
        self.user_thin = None if thin is None else int(thin)
        if isinstance(adapt_preconditioner, str) and adapt_preconditioner != "diag":
            raise ValueError(
                f"adapt_preconditioner must be True, False or 'diag', got {adapt_preconditioner!r}"
            )
        self.adapt_preconditioner = bool(adapt_preconditioner)
        # Whether a slow window's end may make the preconditioner dense (:meth:`_choose_rotation`).
        self.may_rotate = self.adapt_preconditioner and adapt_preconditioner != "diag"
        self.control_variates = bool(control_variates) and self.sg_model.has_minibatch
        if self.control_variates:
            self.sg_model.total_rows  # noqa: B018  (raises unless one N for a full pass)
        self.divergence_threshold = positive("divergence_threshold", divergence_threshold)
        self.mode = mode
        self.compile_kwargs = dict(compile_kwargs or {})
        # Before the factorisation check, which compiles the force (a ScalarLoop in numba).
        if self.static_shapes and has_scalar_loop(self.sg_model.force):
            raise ModelError(
                "mode='JAX' cannot compile this model's force: its gradient holds a "
                "ScalarLoop (PyTensor's series for the derivative of an incomplete beta or "
                "gamma function in its shape parameter, such as a censored or truncated "
                "Student-t's CDF in a free nu), which PyTensor's JAX backend does not "
                "implement. Use the default backend (no mode), or give that parameter a "
                "fixed value."
            )
        self.sg_model.check_factorisation()
        self.dim = self.sg_model.dim
        self.dtype = self.sg_model.dtype
        max_steps = max(1, _BLOCK_MEMORY_BYTES // (8 * self.dim))
        self.block_steps = min(int(block_steps), max_steps)
        self._compiled: dict[bool, _Compiled] = {}
        # JAX: the data the blocks read, kept on the device (jax_compile.DeviceData).
        self._device_data: DeviceData | None = None
        super().__init__(vars, {}, blocked=blocked, rng=rng)
        self._reset_chain(tune=0, draws=None)

    # ------------------------------------------------------------------ integrator interface
    #: Step-size rule constants (see :meth:`adapted_step_size`), chosen per integrator.
    stability_constant: ClassVar[float] = 0.5
    noise_tolerance: ClassVar[float] = 0.5

    #: The covariance-controlled samplers' noise-estimate option (see
    #: :meth:`_set_noise_shrinkage`); None everywhere else.
    noise_shrinkage: float | str | None = None
    noise_shrinkage_target: str = "identity"
    #: The stat of the samplers with that option: the intensity is fixed per block, so it is
    #: recorded from Python rather than emitted by every step of the compiled block.
    noise_estimate_stats: ClassVar[dict] = {"noise_shrinkage": (np.float64, [])}

    def _set_noise_shrinkage(self, value: float | str | None, target: str = "identity") -> None:
        """None: the papers' estimate; "auto": the intensity that minimises the expected
        Frobenius error, chosen during tuning; a number in [0, 1]: that fixed intensity.
        ``target``: "identity" (a multiple of I) or "diagonal" (the estimate's diagonal)."""
        if target not in SHRINKAGE_TARGETS:
            raise ValueError(
                f"noise_shrinkage_target must be one of {SHRINKAGE_TARGETS}, got {target!r}"
            )
        self.noise_shrinkage_target = target
        if value is not None and value != "auto":
            if isinstance(value, str) or not 0.0 <= float(value) <= 1.0:
                raise ValueError(
                    f"noise_shrinkage must be None, 'auto' or a number in [0, 1], got {value!r}"
                )
            value = float(value)
        self.noise_shrinkage = value

    #: Weight of the newest minibatch estimate in a moving average of Sigma (see
    #: :meth:`averaged_noise`); None: each step uses its own minibatch's estimate.
    averaging: float | None = None
    #: Integrator steps between updates of that average (see
    #: :meth:`periodically_averaged_noise`); 1: every step.
    averaging_interval: int = 1

    def _set_averaging(self, value: float | None, interval: int = 1) -> None:
        if value is not None and not 0.0 < value <= 1.0:
            raise ValueError(f"averaging must be None or lie in (0, 1], got {value}")
        if int(interval) != interval or interval < 1:
            raise ValueError(f"averaging_interval must be a positive integer, got {interval}")
        self.averaging = value
        if interval > 1 and not self.averages_noise:
            raise ValueError(
                "averaging_interval needs averaging: without a moving average each step uses "
                "its own minibatch's estimate"
            )
        self.averaging_interval = int(interval)

    @property
    def averages_noise(self) -> bool:
        """Whether the steps use a moving average of Sigma (:meth:`averaged_noise`): with
        ``averaging`` set (mCCAdL, NOGIN); always for CCAdL, whose ``averaging=None`` is the
        paper's kappa_t = 1/t."""
        return self.averaging is not None

    #: Which rows Sigma-hat comes from: "same", the force's minibatch (the papers), or
    #: "independent", a minibatch of its own (:meth:`force_and_noise`).
    noise_minibatch: str = "same"

    def _set_noise_minibatch(self, value: str) -> None:
        if value not in ("same", "independent"):
            raise ValueError(f"noise_minibatch must be 'same' or 'independent', got {value!r}")
        self.noise_minibatch = value

    def force_and_noise(self, theta, indices, noise_indices=None) -> tuple[TensorVariable, Any]:
        """The minibatch force and the estimate of its noise covariance, from the same rows
        (``noise_minibatch="same"``, the papers' eq. 15) or from the rows ``noise_indices``,
        drawn independently of the force's (``"independent"``).

        From the same rows the estimate is correlated with the force's noise, which shifts
        the posterior mean by O(h^2) (the ``noise_minibatch`` parameter of MCCAdL and NOGIN,
        and the guide's "The same-minibatch estimate shifts the mean"). Independent rows
        remove the shift at the price of a second pass over a minibatch: the summed force on
        its rows, the per-observation gradients on the others."""
        if self.noise_minibatch == "independent":
            _, sigma = self.target.force_and_noise(theta, noise_indices)
            return self.target.force(theta, indices), sigma
        return self.target.force_and_noise(theta, indices)

    @property
    def separate_noise_indices(self) -> bool:
        """Whether :meth:`integrate` gets ``noise_indices``: the force's rows again, for the
        update of a periodic average, or rows of their own (``noise_minibatch``)."""
        return self.averages_periodically or self.noise_minibatch == "independent"

    @property
    def averages_periodically(self) -> bool:
        """Whether the moving average of Sigma is updated only every ``averaging_interval``
        steps (:meth:`periodically_averaged_noise`)."""
        return self.averages_noise and self.averaging_interval > 1

    def noise_average_state(self, form: str) -> dict[str, np.ndarray]:
        """The moving average's carried state at a chain (re)start (empty without one): a
        count and the D x D ("full") or length-D ("diag") average, restarted with the chain;
        with a periodic update also the steps since the last one, the damping operator it
        made and the step size it was made for (:meth:`periodically_averaged_noise`)."""
        if not self.averages_noise:
            return {}
        shape = (self.dim, self.dim) if form == "full" else (self.dim,)
        state = {"noise_count": np.array(0.0), "noise_average": np.zeros(shape)}
        if self.averages_periodically:
            state["noise_age"] = np.array(0.0)
            state["noise_operator"] = np.zeros(shape)
            state["noise_operator_step"] = np.array(0.0)
        return state

    def averaged_noise(self, state: dict, sigma, form: str) -> tuple[Any, dict]:
        """The covariance a step uses with ``averaging`` set: the moving average
        (:func:`~pymc_sgmcmc.model_layer.moving_average`, kappa_t = max(1/t, averaging)) of
        the minibatch estimates of the steps so far, in the ``form`` "full" or "diag", and
        the state to carry. Averaging over about 2 / kappa minibatches removes most of the
        estimate's sampling spread while keeping its shape, which Ledoit-Wolf shrinkage
        does not (``benchmarks/noise_estimator_results_*.md``); the position moves little
        over that window. Without a moving average (:attr:`averages_noise`): ``sigma``
        itself and no state."""
        if not self.averages_noise:
            return sigma, {}
        count = state["noise_count"] + 1.0
        estimate = sigma.dense() if form == "full" else sigma.diagonal()
        average = moving_average(state["noise_average"], count, estimate, self.averaging)
        return self._average_covariance(average, form), {
            "noise_count": count,
            "noise_average": average,
        }

    def _average_covariance(self, average, form: str):
        """The covariance held by a moving average of the ``form`` "full" or "diag"."""
        return (DenseCovariance if form == "full" else DiagonalCovariance)(average, self.dim)

    def periodically_averaged_noise(
        self,
        state: dict,
        estimate: Callable[[], Any],
        form: str,
        h: TensorVariable,
        operator: Callable[[Any, TensorVariable], TensorVariable] | None,
    ) -> tuple[Any, TensorVariable | None, dict]:
        """The covariance a step uses with ``averaging_interval`` > 1, the damping operator
        made from it, and the state to carry.

        The moving average of :meth:`averaged_noise` takes a new minibatch estimate
        (``estimate()``, from the per-observation gradients) at the first step of a chain
        (re)start and then every ``averaging_interval`` steps, in a lazy branch that also
        makes the integrator's damping operator from it, ``operator(average, h)``: a D x D
        matrix for ``form="full"`` (O(D^3): an exponential or an inverse, 0.05-0.2 ms at
        D = 100, after the O(n D^2) estimate), a vector of diagonal factors for "diag". The
        steps in between compute neither per-observation gradients nor any O(n D) product,
        only the summed force, and apply the operator in one O(D^2) product. A step size
        other than the operator's (a restart with a new one, a schedule) also updates it.
        ``operator=None``: the integrator applies the average itself (CCAdL's explicit
        damping), and no operator is kept. The average spans about
        ``2 * averaging_interval / averaging`` steps: the position
        must move little over that window (Sigma(theta) changes over the posterior's width,
        which a chain crosses in about one relaxation time, the default ``thin``)."""
        count, age = state["noise_count"], state["noise_age"]
        due = pt.eq(count, 0.0) | pt.ge(age, self.averaging_interval)
        averaged, average = self.averaged_noise(state, estimate(), form)
        names = ["noise_count", "noise_average"]
        updated = [average["noise_count"], average["noise_average"]]
        if operator is not None:
            h = pt.as_tensor(h).astype(state["noise_operator_step"].dtype)
            due = due | pt.neq(h, state["noise_operator_step"])
            names += ["noise_operator", "noise_operator_step"]
            updated += [operator(averaged, h), h]
        kept = [state[name] for name in names]
        new = dict(zip(names, ifelse(due, updated, kept), strict=True))
        new["noise_age"] = pt.switch(due, 1.0, age + 1.0)
        covariance = self._average_covariance(new["noise_average"], form)
        return covariance, new.get("noise_operator"), new

    def noise_estimate(self, sigma):
        """The covariance the integrator uses: the minibatch estimate ``sigma``, shrunk
        towards ``noise_shrinkage_target`` when ``noise_shrinkage`` is set."""
        if self.noise_shrinkage is None:
            return sigma
        return sigma.shrunk(self.target.shrinkage, self.noise_shrinkage_target)

    def _set_step_size(self, step_size: float | None) -> None:
        """``None``: adapt during ``tune``; otherwise the user's fixed step size."""
        self.user_step_size = None if step_size is None else positive("step_size", step_size)

    def step_sizes(self, steps: np.ndarray) -> np.ndarray:
        """Step size of each global step index (constant unless a sampler has a schedule)."""
        return np.full(steps.shape, self.step_size)

    def adapted_step_size(self, curvature: float, noise: float, phase: str) -> float:
        r"""The step size for a preconditioned Hessian of largest eigenvalue ``curvature``
        (:math:`\omega_{max}^2`) and a minibatch-force covariance of largest eigenvalue
        ``noise`` (:math:`\sigma^2_{max}`), both in the preconditioned coordinates.

        Momentum integrators: :math:`h = c/\omega_{max}` (the splittings are stable for
        :math:`h\omega < 2`; ``stability_constant`` c keeps the discretisation bias small),
        and, for the kernel kept after tuning (``phase="final"``), at most
        :math:`2A\alpha/\sigma^2_{max}`: the per-step gradient-noise variance
        :math:`h^2\sigma^2` is at most the fraction :math:`\alpha` (``noise_tolerance``) of the
        injected :math:`2Ah` -- the analogue of Welling & Teh's sampling threshold. In the
        intermediate windows (``"tuning"``) :math:`\alpha` is at least 1 (the draws only need
        the right scale); in the ``"transient"`` from the starting point only
        :math:`h\sigma_{max} \le 1/2` is kept, so that one kick's noise cannot overwhelm the
        friction (the thermostat of SGNHT runs away beyond it). A kernel chosen at the start
        and kept for the draws (``"start_kept"``: fewer than 20 tuning draws, no windows)
        meets both the transient's and the final rule.
        """
        h = self.stability_constant / np.sqrt(curvature)
        if noise <= 0:
            return h
        if phase in ("transient", "start_kept"):
            h = min(h, 0.5 / np.sqrt(noise))
        if phase == "transient":
            return h
        strict = phase in KEPT_PHASES
        tolerance = self.noise_tolerance if strict else max(self.noise_tolerance, 1.0)
        return min(h, 2.0 * self.friction * tolerance / noise)

    def relaxation_steps(self, step_size: float, variance: float = 1.0) -> int:
        """Integrator steps in one relaxation time of a direction of the given ``variance``
        in the preconditioned coordinates (1: a coordinate of the preconditioner's unit
        width): the default ``thin`` when the step size is adapted. Underdamped Langevin with
        friction A relaxes a mode of variance v (frequency v^-1/2) at the rate
        (A - sqrt(A^2 - 4/v)) / 2 when A^2 v > 4 (about 1 / (A v)) and A / 2 below: in about
        max(A v, 1/A) time units."""
        return int(np.ceil(max(self.friction * variance, 1.0 / self.friction) / step_size))

    def initial_auxiliary(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Values of the auxiliary variables (momentum, thermostat...) at a chain (re)start."""
        return {}

    def evaluate(self, theta, indices, noise, h) -> dict[str, TensorVariable]:
        """Quantities computed at a new position with one minibatch: here the force F.

        ``theta`` is the position in the preconditioned coordinates, and so are the force and
        covariance of :attr:`target`. Samplers whose noise depends on the gradient-noise
        covariance at the position (mSGLD, SGHMC with B-hat) also prepare it here, from
        ``noise``, for the next step (of size ``h``).
        """
        return {"force": self.target.force(theta, indices)}

    def initial_evaluation(self, theta, indices, noise, h) -> dict[str, TensorVariable]:
        """Evaluated quantities carried in the state from one step to the next (the force of
        "first same as last" schemes). A chain (re)start computes them at its position."""
        return self.evaluate(theta, indices, noise, h)

    def integrate(self, state, indices, noise, h, noise_indices=None) -> Step:
        """One integrator step from ``state`` (a dict of graphs). ``noise``: a list of
        :attr:`noise_vectors` standard-normal D-vectors. ``noise_indices``: the
        rows of Sigma-hat, through inputs of their own, given only when
        :attr:`separate_noise_indices`: the step's minibatch again, for the update of a
        periodic average of Sigma (:meth:`periodically_averaged_noise`), or rows drawn
        independently of the force's (``noise_minibatch="independent"``)."""
        raise NotImplementedError

    def carried(self, state: dict, stats: dict | None = None) -> Step:
        """The usual result: the stored draw is the new state's position."""
        return Step(state, state["theta"], stats or {})

    def stable_step_size(self, curvature: float) -> float:
        """Half the linear-stability limit for a Gaussian of largest Hessian eigenvalue
        ``curvature``: h^2 lambda < 4 for the second-order (momentum) integrators."""
        return 1.0 / np.sqrt(curvature)

    def noise_variance_factors(
        self, step_size: float, noise: NoiseMoments
    ) -> tuple[float, float] | None:
        """The smallest and largest factors by which the gradient noise that this integrator
        leaves uncorrected, of the moments ``noise`` (preconditioned coordinates), multiplies
        the draws' variance over the directions or coordinates, at ``step_size``; None where
        the integrator damps the noise by its estimated covariance or reports it itself
        (SGHMC's noise estimate). For the user step-size check (:data:`NOISE_EXCESS_WARNING`).
        """
        return None

    def same_minibatch_shift_share(self) -> float | None:
        """The share of the mean shift -(h^2 / 2) C c3 that the noise damping applies when it
        estimates Sigma from the force's own rows (:meth:`force_and_noise`) at every step: 1
        for mCCAdL's C step, 1/2 for NOGIN's damping, which sees half the kick; None where
        the integrator damps with no such estimate. For the user step-size check
        (:meth:`_check_same_minibatch_shift`)."""
        return None

    def noise_warning(self, low: float, high: float, noise: NoiseMoments) -> str:
        """What the user step-size check says the noise does to the draws (the samplers
        that correct none of it; SGNHT says what its thermostat leaves)."""
        return (
            "the minibatch gradient noise, which this sampler does not correct, makes the "
            f"draws' variance about {high:.3g} times the posterior's in the noisiest direction "
            f"(largest eigenvalue {noise.largest:.3g} of the minibatch force's covariance in "
            "the sampler's coordinates, at the chain's position)"
        )

    def step_size_hint(self, theta: np.ndarray, failed: float) -> float:
        """A step size to suggest after a divergence at step size ``failed``: the stability
        limit from the curvature at ``theta``, and at most half of ``failed``."""
        # A spawned generator: the hint must not change the chain's random stream.
        curvature = self.sg_model.largest_curvature(
            theta, self.preconditioner, self.rng.spawn(1)[0]
        )
        if not np.isfinite(curvature) or curvature <= 0:
            return 0.5 * failed
        return min(self.stable_step_size(curvature), 0.5 * failed)

    # ------------------------------------------------------------------ compilation
    @property
    def static_shapes(self) -> bool:
        """Whether the compilation mode needs every array shape fixed when it compiles (JAX:
        ``jax.jit`` traces with concrete shapes, so a block's scan must have a static length
        and its inner loops a fixed count)."""
        mode = self.compile_kwargs.get("mode", self.mode)  # as _compile passes it on
        return isinstance(get_mode(mode).linker, JAXLinker)

    @_in_model_dtype
    def _compile(self) -> None:
        """The graphs of the current kind of preconditioner (diagonal or dense), and the
        chain-start function; the blocks are compiled on first use (:meth:`_block_function`)."""
        ml = self.sg_model
        theta = pt.vector("theta", shape=(self.dim,))
        indices = [
            pt.vector(f"index_{k}", dtype="int64", shape=i.type.shape)
            for k, i in enumerate(ml.indices)
        ]
        noise = [pt.vector(f"noise_{k}", shape=(self.dim,)) for k in range(self.noise_vectors)]
        scale = pt.vector("scale", shape=(self.dim,))
        rotation = [pt.matrix("rotation", shape=(self.dim, self.dim))] if self.dense else []
        shrinkage = pt.scalar("noise_shrinkage")
        anchor = pt.vector("anchor", shape=(self.dim,))
        anchor_force = pt.vector("anchor_force", shape=(self.dim,))
        # Inputs that change between blocks without recompiling.
        kernel = [scale, *rotation, shrinkage, anchor, anchor_force, *self.sampler_kernel_inputs()]
        h0 = pt.scalar("h")
        control = ControlVariate(anchor, anchor_force) if self.control_variates else None
        preconditioner = Preconditioner(scale, *rotation)
        compiled = _Compiled(PreconditionedTarget(ml, preconditioner, shrinkage, control))
        self._compiled[self.dense] = compiled  # the graphs below read its target
        evaluated = self.initial_evaluation(theta, indices, noise, h0)
        kwargs = {"mode": self.mode, **self.compile_kwargs, "on_unused_input": "ignore"}
        init_fn = None
        if evaluated:
            # Run at a chain start only; ~3 s of a cold start if compiled with numba.
            init_fn = self._function(
                [theta, *indices, *noise, h0, *kernel],
                list(evaluated.values()),
                {**kwargs, "mode": one_off_mode(list(evaluated.values()))},
            )

        aux = self.initial_auxiliary(np.random.default_rng(0))
        names = ["theta", *evaluated, *aux]
        state0 = {"theta": theta}
        for name, var in evaluated.items():
            state0[name] = var.type(name)
        for name, value in aux.items():
            state0[name] = pt.tensor(name, shape=np.shape(value))
        compiled.block_graph_inputs = ([state0[n] for n in names], kernel, kwargs)
        compiled.functions = (init_fn, names, list(evaluated))

    @property
    def block_length(self) -> int:
        """Steps in a full block: the stored draws of ``block_steps`` steps, ``thin`` each."""
        return max(1, self.block_steps // self.thin) * self.thin

    @property
    def compiled_length(self) -> int:
        """Steps the block function is compiled for; a block of fewer runs padded.

        numba and C stop after the last real step, so one length, ``max(block_steps, thin)``,
        serves every ``thin`` up to ``block_steps``: the adaptation's changes of ``thin`` in
        ``tune`` cost neither a compilation each nor a padded step. Compiled per
        ``block_length`` instead, a
        default SGNHT run compiled its block 4-11 times (one per value of ``thin`` in
        ``tune``). JAX runs every padded step, so its blocks are compiled per
        ``block_length``."""
        return self.block_length if self.static_shapes else max(self.block_steps, self.thin)

    @_in_model_dtype
    def _block_function(self):
        """The compiled block of :attr:`compiled_length` steps and the names of its integrator
        stats; built on first use.

        A shorter block runs padded, and the host discards the padded steps' outputs. With
        dynamic shapes (numba, C) the loop is a ``while`` scan whose flag says whether the
        next step is a real one: it stops after the last, so the padding costs nothing and
        no step's state needs masking. Masked, a D x D state (a periodic average of Sigma and
        the damping matrix made from it) cost every step an elementwise pass over each:
        0.2-1.6 µs of mCCAdL's and NOGIN's 31-35 µs steps at D = 100 (two alternated runs).
        JAX runs every step, with an ``active`` flag: an inactive step leaves the state
        unchanged. A fixed length keeps the shape arithmetic out of the compiled function:
        with a length known only when it runs, PyTensor computes the loop's count from the
        sequences' shapes and slices each of them to it, six more ops that numba compiled for
        1.0-1.5 s of a cold start (P1 SGLD)."""
        names = self.functions[1]  # compiles the rest first
        length = self.compiled_length
        if length in self._block_functions:
            return self._block_functions[length]
        states0, kernel, kwargs = self._current.block_graph_inputs
        index_seqs = [
            pt.matrix(f"indices_{k}", dtype="int64", shape=(length, i.type.shape[0]))
            for k, i in enumerate(self.sg_model.indices)
        ]
        # A sequence per noise vector: the scan then hands each step D-vectors, where the
        # step of one (length, vectors, D) sequence was a (vectors, D) matrix whose rows the
        # integrators took with a Squeeze, which numba compiled for 0.3 s of a cold start.
        noise_seqs = [
            pt.matrix(f"noise_seq_{k}", shape=(length, self.dim)) for k in range(self.noise_vectors)
        ]
        h_seq = pt.vector("h_seq", shape=(length,))
        # Dynamic shapes: whether the next step is a real one; static: whether this one is.
        active_seq = pt.vector("active_seq", dtype="bool", shape=(length,))
        logp_seq = pt.vector("logp_seq", dtype="bool", shape=(length,))
        stored_seq = pt.vector("stored_seq", dtype="bool", shape=(length,))
        # The same minibatch indices again, for the log-density: through a separate input
        # PyTensor cannot merge the log-density's products with the force's at the same point
        # (SGLD's force at the draw), which would make every step compute them for the lazy
        # branch and keep the force from its fused single pass (``fuse_glm_products``).
        logp_index_seqs = [
            pt.matrix(f"logp_{s.name}", dtype="int64", shape=s.type.shape) for s in index_seqs
        ]
        # And the rows of Sigma-hat: a third copy for the lazy branch that updates a periodic
        # average of Sigma (:meth:`periodically_averaged_noise`), for the same reason (through
        # the force's indices, its per-observation gradients cost 2 µs of every NOGIN step at
        # D = 100), or rows of their own (``noise_minibatch="independent"``).
        noise_index_seqs = (
            [pt.matrix(f"noise_{s.name}", dtype="int64", shape=s.type.shape) for s in index_seqs]
            if self.separate_noise_indices
            else []
        )
        index_seqs_all = [*index_seqs, *logp_index_seqs, *noise_index_seqs]
        n_idx, n_all = len(index_seqs), len(index_seqs_all)
        stat_names: list[str] = []

        # JAX in a float32 process has no float64 (``jax_compile.jax_has_float64``): a cast to
        # it would be truncated to float32, with a warning at every block's first trace.
        record_dtype = (
            "float64" if not self.static_shapes or jax_has_float64() else pytensor.config.floatX
        )

        def one_step(*args):
            idx_t, logp_idx_t = list(args[:n_idx]), list(args[n_idx : 2 * n_idx])
            noise_idx = {"noise_indices": list(args[2 * n_idx : n_all])} if noise_index_seqs else {}
            n_noise = n_all + len(noise_seqs)
            noise_t = list(args[n_all:n_noise])
            h_t, active_t, logp_t, stored_t = args[n_noise : n_noise + 4]
            state = dict(zip(names, args[n_noise + 4 :], strict=True))
            step = self.integrate(state, idx_t, noise_t, h_t, **noise_idx)
            draw_stats = step.draw_stats or {}
            stat_names[:] = [*step.stats, *draw_stats]
            new = [step.state[n] for n in names]
            draw = self.target.position(step.draw)
            # A matrix state (a moving average of Sigma, a damping matrix made from it) enters
            # the momentum of the step that makes it or of the next, whose check catches a
            # non-finite one before a draw depends on it: checking the 2 x 10^4 entries of
            # two such states cost NOGIN 4.5 µs per step at D = 100 (a periodic average).
            checked = [v for v in new if v.ndim <= 1]
            # Scalar ANDs, which fuse into one scalar function: pt.all of the list joined
            # the flags into a vector first (an ExpandDims per flag, a Join, an All), each
            # more code for numba to compile.
            finite = [pt.all(pt.isfinite(v)) for v in [*checked, draw]]
            sane = functools.reduce(pt.and_, finite) & (
                pt.max(pt.abs(draw)) < self.divergence_threshold
            )
            # The minibatch log-density only at the steps the host reads it at
            # (:meth:`_logp_steps`), with the step's minibatch: a lazy branch, so the other
            # steps skip it. Computed in every step it cost as much as the rest of a
            # logistic-regression step (an exp and a log1p per row, which the gradient does
            # not need); a second scan over those steps cost ~2 s of a cold compile.
            # Recorded in one type (both branches must have one), float64 also for a float32
            # model where the backend has it (``record_dtype``).
            nan = pt.constant(np.nan, dtype=record_dtype)
            logp = self.sg_model.logp_at(draw, logp_idx_t).astype(record_dtype)
            logp = ifelse(logp_t, logp, nan)
            # The step's draw stats at the stored steps only, in a branch of their own: the
            # runaway check reads the log-density every STRIDE steps whatever the thin, and a
            # stat sharing its branch was computed as often (a dense preconditioner's trace
            # of Sigma, O(n D^2), cost mSGLD 0.3 of its step at D = 50 with thin = 100).
            draw_values = [pt.as_tensor(v).astype(record_dtype) for v in draw_stats.values()]
            if draw_values:
                draw_values = list(ifelse(stored_t, draw_values, [nan] * len(draw_values)))
            stat_values = [pt.as_tensor(v).astype(record_dtype) for v in step.stats.values()]
            if not self.static_shapes:
                outputs = [*new, draw, sane, logp, *stat_values, *draw_values]
                return outputs, until(~active_t)  # after the block's last real step
            # JAX runs the padded steps: only the state is masked, the traced outputs of
            # inactive steps are discarded.
            new = [pt.switch(active_t, v, state[n]) for n, v in zip(names, new, strict=True)]
            return [*new, draw, sane, logp, *stat_values, *draw_values]

        n_stats = len(self._integrator_stat_names())
        outputs = pytensor.scan(
            one_step,
            sequences=[*index_seqs_all, *noise_seqs, h_seq, active_seq, logp_seq, stored_seq],
            outputs_info=[*states0] + [None] * (3 + n_stats),
            name=BLOCK_SCAN_NAME,
            return_updates=False,
        )
        states, traces = outputs[: len(names)], outputs[len(names) :]
        final_and_traces = [*(s[-1] for s in states), *traces]
        if self.static_shapes:
            if self._device_data is None:
                self._device_data = DeviceData(final_and_traces)
            kwargs = {**kwargs, "givens": self._device_data.givens}
        block_fn = self._function(
            [
                *states0,
                *index_seqs_all,
                *noise_seqs,
                h_seq,
                active_seq,
                logp_seq,
                stored_seq,
                *kernel,
            ],
            final_and_traces,
            kwargs,
        )
        self._block_functions[length] = (block_fn, stat_names)
        return block_fn, stat_names

    def _function(self, inputs, outputs, kwargs):
        # PyMC's compile turns the logp's parameter checks into -inf instead of exceptions, so
        # that a run-away chain is caught as a divergence.
        # The host passes float64 arrays to a float32 model's functions (one cast per block).
        kwargs = {
            **kwargs,
            "mode": for_jax(
                with_kept_branches(
                    with_inverse_dimshuffles_dropped(
                        with_covariance_kernels(with_gather_dot(kwargs.get("mode")))
                    )
                )
            ),
            "allow_input_downcast": True,
        }
        # Fast math without reassociation: the same draws whether this process compiled the
        # block or loaded it from numba's cache (``numba_compile``).
        try:
            with self.sg_model.model, lean_cache_wrappers(), deterministic_fastmath():
                return compile_pymc_function(inputs, outputs, **kwargs)
        except NotImplementedError as err:
            if not self.static_shapes:
                raise
            # An op of the model that PyTensor's JAX backend has no implementation of (a
            # ScalarLoop is refused when the step is built); without this, PyTensor's error
            # surfaced from deep in the first block's compilation, or from a worker process.
            raise ModelError(
                f"mode='JAX' cannot compile this model's sampler block: {err}. PyTensor's JAX "
                "backend has no implementation of an op the model uses; use the default "
                "backend (no mode)."
            ) from err

    @property
    def _noise_estimate_stat_names(self) -> list[str]:
        return [k for k in self.noise_estimate_stats if k in self.stats_dtypes_shapes]

    def _integrator_stat_names(self) -> list[str]:
        block_stats = {**self.common_stats, **self.noise_estimate_stats}
        return [k for k in self.stats_dtypes_shapes if k not in block_stats]

    @property
    def dense(self) -> bool:
        """Whether the preconditioner has a rotation (:meth:`_choose_rotation`)."""
        return self.rotation is not None

    @property
    def preconditioner(self) -> Preconditioner:
        """The sampler's coordinates: theta = rotation (scale * phi)."""
        return Preconditioner(self.scale, self.rotation)

    @property
    def _current(self) -> _Compiled:
        """The graphs and functions of the current kind of preconditioner."""
        if self.dense not in self._compiled:
            self._compile()
        return self._compiled[self.dense]

    @property
    def target(self) -> PreconditionedTarget:
        return self._current.target

    @property
    def functions(self):
        return self._current.functions

    @property
    def _block_functions(self) -> dict:
        return self._current.block_functions

    def __getstate__(self):
        # Compiled functions are rebuilt lazily in each worker process (cores > 1).
        state = self.__dict__.copy()
        state["_compiled"] = {}
        state["_device_data"] = None
        return state

    # ------------------------------------------------------------------ PyMC contract
    @staticmethod
    def _progressbar_config(n_chains=1):
        columns = [
            TextColumn("{task.fields[divergences]}", table_column=Column("Divergences", ratio=1)),
            TextColumn("{task.fields[step_size]:0.2g}", table_column=Column("Step size", ratio=1)),
        ]
        return columns, {"divergences": [0] * n_chains, "step_size": [0] * n_chains}

    @staticmethod
    def _make_progressbar_update_functions():
        def update_stats(stats):
            return {
                "divergences": stats["divergences"],
                "step_size": stats["step_size"],
                "failing": stats["divergences"] > 0,
            }

        return (update_stats,)

    @staticmethod
    def competence(var, has_grad):
        # Never chosen automatically: an SG sampler is always the user's explicit choice.
        return Competence.COMPATIBLE

    def setup_chain(self, rng, tune: int, draws: int) -> None:
        self.sg_model.check_data_rows()
        super().setup_chain(rng, tune, draws)
        self._reset_chain(tune=tune, draws=tune + draws)

    def _reset_chain(self, tune: int, draws: int | None) -> None:
        self.tune = tune > 0
        self.tune_left = tune
        self.step_count = 0
        self.divergences = 0
        self.warned = False
        self.far_warned = False
        self.anchor_warned = False
        self.short_tune = tune < MIN_TUNE_FOR_WINDOWS  # no window, nor a burn-in to speak of
        self.stability_check_due = self.user_step_size is not None
        self.chain_state = None
        self.buffer = None
        self.stat_rows = None
        self.cursor = 0
        self.last_draw = None
        self._served: _Served | None = None
        self.chain_start = None
        self.draws_left = draws
        self.block_cap = None
        self.typical_logp = None
        self.anchor = np.zeros(self.dim)
        self.anchor_force = np.zeros(self.dim)
        self.anchor_due = self.control_variates
        self.logp_spreads = []
        self.logp_history = np.zeros(0)
        self.transient_reference = TRANSIENT_START
        self.step_size = self.user_step_size
        self.scale = np.ones(self.dim)
        self.rotation = None  # a dense preconditioner's (:meth:`_choose_rotation`)
        # Coordinates whose scale a window's spread has set (not the start's curvature).
        self.scale_measured = np.zeros(self.dim, dtype=bool)
        # The marginal sds in theta that the last slow window measured (None before one).
        self.measured_widths: np.ndarray | None = None
        self.shrinkage = 0.0 if self.noise_shrinkage in (None, "auto") else self.noise_shrinkage
        self.shrinkage_due = True
        self.thin = 1 if self.user_thin is None else self.user_thin
        self.tune_drawn = 0
        self.transient = False  # the initial interval with an adapted step size
        self.noise_limited = False  # the gradient noise, not the curvature, set the step size
        adapting = self.adapt_preconditioner or self.user_step_size is None
        self.boundaries = adaptation_boundaries(tune) if adapting else []
        self.window = self._new_window()
        self.rotated_window = self._new_window()
        self.window_start = None  # the first draw of the current window
        self.slow_windows = 0  # slow windows ended
        self.recent = []
        # (draw, Hessian of -log p there in theta): one Hessian per draw for the rotation's
        # choice, the widest direction and the warnings' note (:meth:`_curvature_at`).
        self._hessian_at: tuple[np.ndarray, np.ndarray] | None = None
        # Variance of the posterior's widest direction in the kept kernel's coordinates,
        # whose relaxation time sets the adapted thin (:meth:`_widest_variance`).
        self.widest_variance = 1.0

    def reset_tuning(self) -> None:
        """Adaptation restarts with each chain (``setup_chain``); nothing to do here."""

    def stop_tuning(self) -> None:
        """End of burn-in: the next draw restarts the auxiliary variables (momentum, thermostat)
        from their initial distribution at the current position.

        From a start far in the tails the excess potential energy heats the momentum and drives
        a thermostat far above its equilibrium, from which it decays at a rate of at most D/mu
        per unit time; burn-in brings the position in, and the restart removes that memory.
        """
        if self.tune:
            self.chain_state = None
            self.buffer = None
            self.shrinkage_due = True
            self.anchor_due = self.control_variates
        self.tune = False

    def step(self, point: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[dict]]:
        """The next draw as a point dict (PyMC's step-method entry point).

        PyMC's ``ArrayStepShared.step`` ravels the point into one array, calls :meth:`astep`
        and splits the draw into a new dict, 2-3 µs of Python per draw: a sixth of a P2 draw
        at ``thin=1`` inside ``pm.sample`` (13.1 against 10.9 µs;
        ``benchmarks/engine.py per-draw``). PyMC's sampling loop
        hands back the very dict this step returned while the chain goes on; then the draw
        it holds is the one served last and the new dict holds views of the next buffered
        draw, with the same values and dtypes. Any other point (a chain start, a point built
        elsewhere) takes PyMC's path.
        """
        served = self._served
        if served is None or point is not served.point or served.raveled.data is not self.last_draw:
            new_point, stats = super().step(point)
            info = tuple((name, v.shape, v.size, v.dtype) for name, v in new_point.items())
            self._served = _Served(new_point, RaveledVars(self.last_draw, info))
            return new_point, stats
        raveled, stats = self.astep(served.raveled)
        new_point = _point_views(raveled.data, raveled.point_map_info)
        self._served = _Served(new_point, raveled)
        return new_point, stats

    def _check_rows_defined(self, theta: np.ndarray) -> None:
        """Refuse data rows on which the log-density at the chain's start is not finite (one
        pass over the data: 3 ms on P1, 0.5 s at N = 10^6). A Beta observation of exactly 0
        or 1, or a value below a truncation bound, is outside the likelihood's support for
        every parameter value: with one such row of 5,000, SGNHT's adaptation halved the
        step size to 1.7e-18 and all 300 draws diverged at the starting point. PyMC's NUTS on
        the full data refuses such a model at its start."""
        limit = 5  # rows named
        rows = self.sg_model.undefined_rows(theta, limit)
        if not len(rows):
            return
        names = ", ".join(name for s in self.sg_model.sources for name in s.data_names)
        shown = ("row " if len(rows) == 1 else "rows ") + ", ".join(map(str, rows))
        shown += " and perhaps more" if len(rows) == limit else ""
        raise ModelError(
            f"{type(self).__name__}: the log-density is not finite (NaN or -inf) at the "
            f"chain's start on {shown} of the pm.Minibatch data ({names}): a value "
            "outside the likelihood's support (a Beta observation of 0 or 1, a value beyond a "
            "truncation bound, the log of a zero exposure) or a covariate the model cannot "
            "take. Every batch that draws such a row diverges: drop or correct those rows."
        )

    def _stat_columns(self, draws: slice) -> dict[str, np.ndarray]:
        """Each sampler stat's values at the buffered ``draws``."""
        return {name: values[draws] for name, values in self.buffer.items() if name != "theta"}

    def astep(self, q0: RaveledVars) -> tuple[RaveledVars, list[dict[str, Any]]]:
        theta = q0.data
        if self.last_draw is None or not _same_point(theta, self.last_draw):
            # Chain start, or another step method moved the point: (re)start from it.
            _check_finite_start(q0, type(self).__name__)
            self._check_rows_defined(theta)
            self.chain_state = None
            self.buffer = None
            self.chain_start = None  # the fill below starts the chain here
        if self.buffer is None or self.cursor >= len(self.buffer["theta"]):
            self._fill_buffer(theta)
        if self.stat_rows is None:
            self.stat_rows = stat_rows(self._stat_columns(slice(None)))
        # The chain moves past one draw; step_run's counterpart moves past a run of them.
        # Inline, not shared: these lines run for every draw PyMC's loop steps, and the
        # helper calls cost 4 % of a P2 draw at thin=1 (benchmarks/engine.py per-draw).
        i = self.cursor
        self.cursor += 1
        draw = self.last_draw = self.buffer["theta"][i]
        stats = self.stat_rows[i]  # served once: PyMC's trace copies the values
        self.divergences = stats["divergences"]
        if self.draws_left is not None:
            self.draws_left -= 1
        self.tune_left -= 1
        if self.tune:
            self._record_tuning_draw(draw, stats)
        return RaveledVars(draw, q0.point_map_info), [stats]

    def step_run(
        self, point: dict[str, np.ndarray], max_draws: int
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]] | None:
        """Up to ``max_draws`` next draws at once: the rest of the buffered block (the next
        block once this one is used up), with the draws and stats that as many :meth:`step`
        calls would give, as arrays.

        For ``pymc_sgmcmc.parallel``'s workers, which hand draws over in batches anyway:
        :meth:`step`'s per-draw Python (the call, the point dict, a stats dict per draw)
        costs a third to a half of a P1 SGLD step, paid on the core the main process needs
        for recording the draws. None where a draw needs :meth:`step`: while tuning (each
        draw feeds the adaptation) and at a point this step did not serve last (a chain
        start).

        Returns
        -------
        point : dict
            The last draw, as :meth:`step` returns it (hand it back for the next draws).
        points : dict
            Each variable's draws, stacked along a new first axis.
        stats : dict
            Each sampler stat's values, one per draw (those of :meth:`step`'s stats dicts).
        """
        served = self._served  # as in step(): the point served last, the chain not moved
        if self.tune or served is None or point is not served.point:
            return None
        if served.raveled.data is not self.last_draw:
            return None
        if self.buffer is None or self.cursor >= len(self.buffer["theta"]):
            self._fill_buffer(self.last_draw)
        # The chain moves past the run (astep's counterpart moves past one draw).
        run = slice(self.cursor, min(self.cursor + max_draws, len(self.buffer["theta"])))
        draws = run.stop - run.start
        self.cursor = run.stop
        self.last_draw = self.buffer["theta"][run.stop - 1]
        self.divergences = self.buffer["divergences"].item(run.stop - 1)
        if self.draws_left is not None:
            self.draws_left -= draws
        self.tune_left -= draws
        info = served.raveled.point_map_info
        raveled = RaveledVars(self.last_draw, info)
        new_point = _point_views(self.last_draw, info)
        self._served = _Served(new_point, raveled)
        return new_point, _point_views(self.buffer["theta"][run], info), self._stat_columns(run)

    # ------------------------------------------------------------------ adaptation
    @property
    def adapts_step_size(self) -> bool:
        return self.user_step_size is None

    def _record_tuning_draw(self, draw: np.ndarray, stats: dict) -> None:
        self.tune_drawn += 1
        if not stats["diverging"]:
            self.window.add(draw)
            if self.dense:
                self.rotated_window.add(np.linalg.solve(self.rotation, draw))
            self.recent = [*self.recent[1 - GEOMETRY_POINTS :], draw]
        if self.boundaries and self.tune_drawn == self.boundaries[0][0]:
            _, slow_window = self.boundaries.pop(0)
            self._adapt(draw, slow_window)

    @one_blas_thread
    def _adapt(self, theta: np.ndarray, slow_window: bool) -> None:
        """End of an adaptation window: new control-variate anchor, new preconditioner (slow
        windows), new step size, and a restart of the integrator state at ``theta`` in the new
        coordinates."""
        if self.control_variates:
            self._set_anchor(theta)
        self.transient = False
        # Draws stored once per relaxation time (adapted step size and thin) calibrate the
        # drift check of a slow window (adaptation.DRIFT_THRESHOLD); a user's choice need not.
        checked = slow_window and self.adapts_step_size and self.user_thin is None
        drifting = self.window.drifting() if checked else np.zeros(self.dim, dtype=bool)
        if checked and not self.boundaries:
            self._warn_if_drifting()
        if slow_window and self.adapt_preconditioner:
            if self.dense:
                # The spreads of R^-1 theta for the dense preconditioner, and those of theta
                # (from the marginal sds it implies) for a diagonal one to compare it with.
                window = self.rotated_window
                keep = window.drifting() if checked else None
                scale = window.standard_deviations(self.scale, keep=keep)
                marginal = np.sqrt(np.sum(self.preconditioner.matrix() ** 2, axis=1))
                diagonal = self.window.standard_deviations(marginal, keep=drifting)
            else:
                scale = self.window.standard_deviations(self.scale, keep=drifting)
                if drifting.any():
                    scale = self._widen_drifting(scale, theta, drifting & ~self.scale_measured)
                self.scale_measured |= ~drifting
                diagonal = scale
            # The widths, drift included: a drifting coordinate keeps its older scale (6.7x
            # narrower than its posterior sd in one a9a chain); never below the scale, where a
            # short window's spread can collapse.
            spread = self.window.variances()
            self.measured_widths = (
                diagonal if spread is None else np.fmax(diagonal, np.sqrt(spread))
            )
            # With an adapted step size the coordinates are theta / sd, in which a friction
            # of 1 is about critical damping and the step-size rule reads in units of the
            # posterior's width. A user's fixed step size is the step in the widest coordinate
            # (scales normalised to a largest value of 1): every other coordinate only becomes
            # easier to integrate.
            self.scale = scale if self.adapts_step_size else scale / np.max(scale)
            if self.may_rotate and self.adapts_step_size:
                self._choose_rotation(theta, diagonal)
        if self.adapts_step_size:
            # After the initial interval too the next window's draws set the preconditioner:
            # the transient's looser noise rule would let them run hot (SGHMC at N/n = 1,000:
            # kinetic temperature 3-30, a first preconditioner 3x too wide).
            phase = "tuning" if self.boundaries else "final"
            if phase == "final" and self.user_thin is None:
                self.widest_variance = self._widest_variance(theta)
            self._set_kernel(self._choose_step_size(theta, phase), phase)
            if phase == "final" and self.user_thin is not None:
                self._warn_if_tuning_shorter_than_relaxation()
        self.slow_windows += slow_window
        self.window = self._new_window()
        self.rotated_window = self._new_window()
        self.window_start = theta
        self.chain_state = None
        self.buffer = None
        self.shrinkage_due = True

    def _choose_rotation(self, theta: np.ndarray, diagonal: np.ndarray) -> None:
        """Make the preconditioner dense, or diagonal again, at a slow window's end.

        Dense where the posterior, as the Hessian at the window's last draw ``theta``
        describes it in the current coordinates phi, has a correlation matrix whose condition
        number is at least ``adaptation.ROTATION_GAIN``: no diagonal preconditioner changes
        it, and its narrowest direction sets the step size while its widest sets the
        relaxation time, so the chain takes that many more steps per independent draw. (A
        multiple correlation of a coordinate with the others of at least
        ``adaptation.STRONG_CORRELATION``, the gate until 2026-12-02, missed MNIST 7 vs 9 on
        100 random projections: R 0.956 at most, a condition number of 384, and SGLD's draws
        0.94 sd off at an ESS of 4 under the diagonal preconditioner; 0.16 sd, ESS 138 dense.)
        A dense preconditioner already made is refitted where the Hessian in its
        coordinates still correlates a coordinate at ``STRONG_CORRELATION``, and kept
        otherwise: later windows adapt its scales to the draws' spreads, which a refit at
        every window would discard. The new coordinates are
        psi = L^-1 phi, with L L^T the inverse of that Hessian (Cholesky), in which the
        Hessian is the identity: theta = R S L psi, so the rotation becomes R S L and the
        scales start at 1 (later windows adapt them to the spreads of R^-1 theta, as for a
        diagonal preconditioner).

        The curvature must be the posterior's, not one point's: the dense preconditioner is
        made only if it conditions the Hessians at the window's first and last draws (the
        larger of their condition numbers, largest over smallest eigenvalue) at least
        ``adaptation.ROTATION_GAIN`` times better than the diagonal one of the window's
        spreads (``diagonal``), and kept at later windows only while it conditions them
        better at all. A posterior whose curvature changes from draw to draw, as in a
        funnel, so keeps or returns to the diagonal one. Up to ``adaptation.DENSE_MAX_DIM``
        coordinates: one Hessian-vector product per coordinate on 4 minibatches, at each of
        the two draws.

        A regression on an uncentred covariate (calendar years: intercept and slope
        correlated at -0.99998) drew its means 7-12 posterior sd from NUTS's with every
        sampler under the diagonal preconditioner, however long the tuning.

        Where a Hessian is not positive definite, the draws of the window measure the
        curvature along its eigen-directions (:meth:`_window_covariance`,
        :func:`_posterior_curvature`), and the factor
        of that measured curvature (which holds the window's spreads) is refitted at every
        slow window, kept only where it conditions both measured curvatures better than the
        current factor and the diagonal scales, and where the step-size rule takes a step
        as many times longer under it (:meth:`_steps_further`). A logistic regression on
        two one-hot groups with a Laplace prior of free scale (the main example in
        miniature) drew its means up to 0.36 posterior sd off at an ESS of 5 with SGLD under
        the diagonal preconditioner, and within 0.06 at an ESS of 284 with it."""
        if not 2 <= self.dim <= DENSE_MAX_DIM or self.window_start is None:
            return
        rng = self.rng.spawn(1)[0]
        current = self.preconditioner.matrix()  # R S, theta = R S phi
        window = self._window_covariance()
        hessian = np.mean(self._curvature_at(theta, rng), axis=0)
        last, measured = _posterior_curvature(hessian, current, window)
        in_phi = current.T @ last @ current
        if measured:  # refitted at every window: it holds the window's spreads
            fit = True
        elif self.dense:  # refitted only where the current rotation leaves strong correlations
            fit = bool(strong_correlations(in_phi))
        else:
            fit = _correlation_condition(in_phi) >= ROTATION_GAIN
        if fit:  # (only where the Hessian is positive definite, or measured)
            dense = current @ _inverse_square_root(in_phi, cholesky=not measured)
        elif self.dense:
            dense = current
        else:
            return
        hessian = self.sg_model.curvature_matrix(self.window_start, rng)
        first, _ = _posterior_curvature(hessian, current, window)
        dense_condition = _condition_number(dense, first, last)
        if measured and self.dense:
            kept = _condition_number(current, first, last)
            if kept < dense_condition:
                dense, fit, dense_condition = current, False, kept
        diagonal_condition = _condition_number(np.diag(diagonal), first, last)
        needed = 1.0 if self.dense else ROTATION_GAIN
        better = np.isfinite(dense_condition) and dense_condition * needed <= diagonal_condition
        if better and measured:
            dense_steps = Preconditioner(np.ones(self.dim), dense)
            points = self.recent or [theta]
            better = self._steps_further(dense_steps, diagonal, points, rng, needed)
        if better:
            if fit:  # a new rotation (else the current one is kept)
                self.rotation, self.scale = dense, np.ones(self.dim)
        elif self.dense:
            self.rotation, self.scale = None, diagonal

    def _steps_further(
        self,
        dense: Preconditioner,
        diagonal: np.ndarray,
        points: list[np.ndarray],
        rng: np.random.Generator,
        needed: float,
    ) -> bool:
        """Whether the step-size rule, at ``points``, takes a step at least ``needed`` times
        as long under ``dense`` as under the diagonal preconditioner of scales ``diagonal``
        (both in units of the draws' spreads): the check of a dense preconditioner fitted to
        a measured curvature. The conditioning compared before it is that of the draws'
        spreads along the Hessian's eigen-directions, and where those directions are wrong
        the posterior is not conditioned as the spreads say. A Laplace likelihood's Hessian has no
        curvature in its location and large cross terms with its scale, eigenvalues of both
        signs: a factor fitted along them at the last slow window took SGNHT's kept step
        size to 4e-7, against 2e-3 under the diagonal scales, and capped its ``thin``."""
        steps = [
            self._step_size_under(candidate, points, rng, "tuning")
            for candidate in (dense, Preconditioner(diagonal))
        ]
        return steps[0] >= needed * steps[1]

    def _window_covariance(self) -> tuple[np.ndarray, int] | None:
        """The window's draws' covariance and count, for :func:`_posterior_curvature`; None
        at the first slow window, whose draws follow the initial interval and may still be
        travelling: a factor fitted there on a Laplace regression (its scale still 20
        posterior sd from its posterior) left one SGNHT chain's scale 6.1 posterior sd off,
        where the diagonal preconditioner drew it within 0.03."""
        return self.window.covariance() if self.slow_windows > 0 else None

    def _curvature_at(
        self, theta: np.ndarray, rng: np.random.Generator | None = None
    ) -> list[np.ndarray]:
        """Two independent estimates of the Hessian of -log p at the draw ``theta`` (2
        minibatches each from ``rng``, by default a stream spawned from the chain's), whose
        mean is the Hessian on 4; computed once per draw: a slow window's last draw serves
        the choice of rotation, the widest direction and the warnings' note."""
        cached = self._hessian_at
        if cached is None or cached[0] is not theta:
            rng = self.rng.spawn(1)[0] if rng is None else rng
            self._hessian_at = cached = (theta, self.sg_model.curvature_matrices(theta, rng))
        return cached[1]

    def _widest_variance(self, theta: np.ndarray) -> float:
        """How many times wider than the preconditioner's unit the posterior's widest
        direction is, in variance: the largest eigenvalue of the correlation matrix of the
        Gaussian whose precision is the Hessian at the last tuning draw ``theta``, in the
        kept kernel's coordinates (1 where no direction is wider than the coordinates).

        The preconditioner's scales are the spreads of the tuning draws in its coordinates,
        so its unit is the coordinates' marginal width, and a posterior that correlates
        them has a direction up to D times wider in variance, whose relaxation the adapted
        ``thin`` must cover. The Hessian's two independent halves (2 minibatches each) are
        cross-fitted, below. Only the Hessian's correlations are used, not its scale: the
        curvature can miss a likelihood without a second derivative (a Laplace one's is the
        prior's alone), and a chain that has not crossed the wide direction measured its
        spreads too narrow. A random intercept with 99 groups under the diagonal
        preconditioner has a direction 98 times wider than its coordinates (intercept and
        group effects correlated at -0.99): CCAdL's thin of one unit relaxation time (640
        steps) kept draws at an effective sample size of 4 of 1,000, 0.67 sd off with sd
        ratios of 0.23-0.28, without a warning. Up to ``adaptation.DENSE_MAX_DIM``
        coordinates; 1 where the Hessian is not positive definite, or the preconditioner
        not adapted."""
        if not 2 <= self.dim <= DENSE_MAX_DIM or not self.adapt_preconditioner:
            return 1.0
        coordinates = self.preconditioner.matrix()
        halves = [coordinates.T @ h @ coordinates for h in self._curvature_at(theta)]
        correlations = [posterior_correlation(h) for h in halves]
        if any(c is None for c in correlations):
            return 1.0
        # Cross-fitted: the widest direction of one estimate, its variance in the other. The
        # largest eigenvalue of one noisy estimate is biased upwards by its noise (a linear
        # regression with D = 100 and uncorrelated covariates, 2,000 rows: 1.59 against an
        # exact 1.20); along a direction chosen independently of the other's noise it is
        # not, and a direction that wide in the posterior is found by both.
        widest = [np.linalg.eigh(c)[1][:, -1] for c in correlations]
        crossed = [w @ c @ w for w, c in zip(widest, reversed(correlations), strict=True)]
        return max(1.0, float(np.mean(crossed)))

    def _widen_drifting(
        self, scale: np.ndarray, theta: np.ndarray, drifting: np.ndarray
    ) -> np.ndarray:
        """A coordinate that drifted over the window keeps its previous scale (its spread
        there is the distance travelled), unless the curvature at the window's last draw
        makes it wider (H_ii^{-1/2}, as at the chain start). The previous scale can be the
        start's curvature, which far from the posterior can be orders of magnitude too
        narrow, and a coordinate that moves by a fraction of its width per window never
        widens its own spread (up to ``EXACT_CURVATURE_DIM`` drifting coordinates, whose
        entries are computed exactly). In a regression (N = 10,000, D = 20) started with every
        coefficient at 100, sigma's scale from the start was 2.8e-5 against a posterior sd
        of log sigma of 0.007, and SGNHT kept sigma about 300 posterior sd above its
        posterior through tune=3000, at a force of -8,900 on log sigma.

        Only a scale still taken from the start's curvature is widened (``drifting`` holds
        no coordinate whose scale a window's spread has set): the curvature misses a
        likelihood without a second derivative almost everywhere, such as a Laplace one,
        where H_ii is the prior's alone. A Laplace regression's coefficients, their spread
        measured at 0.06-0.3 and drifting in a later window, were widened back to the prior
        sd of 5: the gradient noise in those coordinates then set the step size at 1.6e-8
        (against 2e-3) and the chain stayed where it was (s 0.895 against 0.714).

        Nor is a scale widened beyond the coordinate's spread over the window, the distance
        it travelled: where H_ii is almost zero at the draw, its inverse square root is no
        width. On the main example's model (a9a, a Laplace prior) with control variates, a
        rare one-hot level's weight drifted far into its rows' logistic tails (H_ii about
        1e-24), its scale went from 21 to 9e11, NOGIN's step size to 8e-8 and then 1e-13,
        and the draws' sds came out up to 175,000 times NUTS's."""
        coordinates = np.flatnonzero(drifting)
        if len(coordinates) > EXACT_CURVATURE_DIM:
            # Hutchinson's estimate of each entry is too noisy to widen a scale by.
            return scale
        entries = self.sg_model.curvature_entries(theta, self.rng, coordinates)
        usable = np.isfinite(entries) & (entries > 0)
        widened, coordinates = scale.copy(), coordinates[usable]
        width = 1.0 / np.sqrt(entries[usable])
        # No wider than the distance travelled (the window's spread): a coordinate with
        # almost no curvature at the draw is not that wide.
        width = np.minimum(width, np.sqrt(self.window.variances()[coordinates]))
        widened[coordinates] = np.maximum(scale[coordinates], width)
        return widened

    def _new_window(self) -> WindowVariance:
        """The draws' moments until the next window end (split in halves at its middle), with
        their covariance where the window may choose a dense preconditioner."""
        length = self.boundaries[0][0] - self.tune_drawn if self.boundaries else 0
        full = self.may_rotate and self.adapts_step_size and 2 <= self.dim <= DENSE_MAX_DIM
        return WindowVariance(self.dim, length, full)

    def _warn_if_tuning_shorter_than_relaxation(self) -> None:
        """With a ``thin`` of the user's, the drift check is off (its level assumes draws a
        relaxation time apart). Tuning that ran fewer integrator steps than one relaxation
        time at the kept step size cannot have left the chain's start behind, whatever the
        model: SGNHT with ``thin=10, tune=400`` on MvNormal rows with an LKJ prior ran 4,000
        steps of a 33,000-77,000-step relaxation time and drew means 25 posterior sd off."""
        tune = self.tune_drawn + self.tune_left
        steps, relaxation = tune * self.thin, self.relaxation_steps(self.step_size)
        if steps >= relaxation:
            return
        warnings.warn(
            f"{type(self).__name__}: tuning ran {steps} integrator steps (tune={tune} x "
            f"thin={self.thin}), {steps / relaxation:.2g} of one relaxation time at the "
            f"adapted step_size={self.step_size:.3g} ({relaxation} steps), so the step size "
            "and preconditioner were chosen before the chain could reach the posterior, and "
            "the draws may still be on their way. Leave thin unset while the step size is "
            "adapted (one relaxation time per draw), or raise tune to at least "
            f"{-(-relaxation // self.thin)}.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _coordinates(self) -> list[tuple[str, str]]:
        """Per coordinate of theta: its variable's name (``sigma``, not ``sigma_log__``) and
        a label for the coordinate itself (``b[3]``, ``W[1, 2]``, ``sigma``)."""
        served = self._served
        if served is None:
            return [("", f"theta[{k}]") for k in range(self.dim)]
        model = self.sg_model.model
        rv_names = {v.name: model.values_to_rvs[v].name for v in model.value_vars}
        coordinates = []
        for name, shape, size, _dtype in served.raveled.point_map_info:
            name = rv_names.get(name, name)
            for k in range(size):
                index = ", ".join(str(i) for i in np.unravel_index(k, shape)) if shape else ""
                coordinates.append((name, f"{name}[{index}]" if index else name))
        return coordinates

    @property
    def _preconditioner_kind(self) -> str:
        if self.dense:
            return "dense preconditioner (fitted to the Hessian at one tuning draw)"
        return "diagonal preconditioner"

    @property
    def _unfollowed(self) -> str:
        """What a preconditioner of this kind cannot follow, for the warnings; first the
        model's own non-centred products, where it has them."""
        if self.dense:
            causes = "a curvature that changes across the posterior, as in a funnel"
        else:
            causes = (
                "strongly correlated coordinates, or one that only the prior identifies, such "
                "as a softmax with free coefficients for every class (fix one class's at zero)"
            )
        pairs = non_centred_products(self.sg_model.model)
        if not pairs:
            return causes
        # Eight groups of 2,500 rows written as a = mu + tau * z drifted at the end of tune
        # with SGNHT's defaults on three seeds of three; centred, on none.
        products = ", ".join(f"{tau} * {z}" for z, tau in pairs)
        return (
            f"the model's non-centred {products}: where a hierarchical model's groups have "
            "enough rows to pin each a = mu + tau * z down, changing tau moves every z "
            "together, along a curved surface; write it in the centred form there, "
            "a = pm.Normal('a', mu, tau) (the guide's 'Hierarchical models'). Other "
            f"causes: {causes}"
        )

    def _correlation_note(self) -> str:
        """For the warnings at the end of tuning: the coordinates that the posterior, as the
        Hessian at the latest tuning draw describes it, correlates strongly with the others
        (``adaptation.strong_correlations``), a direction the diagonal preconditioner cannot
        follow, and the usual causes' fixes; up to ``adaptation.DENSE_MAX_DIM`` coordinates (one
        Hessian-vector product per coordinate on 4 minibatches, once per warning). A
        regression on an uncentred covariate (calendar years: intercept and slope
        correlated at -0.99998) drew its means 7-12 posterior sd from NUTS's with every
        sampler, and neither control variates nor a longer ``tune`` nor the ``thin`` the
        warning gave helped; centred, SGNHT and SGLD came within 0.08 sd."""
        if not self.recent or self.dim > DENSE_MAX_DIM or self.dim < 2 or self.dense:
            # A dense preconditioner already follows the correlations that the note names.
            return ""
        hessian = np.mean(self._curvature_at(self.recent[-1]), axis=0)
        found = strong_correlations(hessian)
        if not found:
            return ""
        labels = [label for _name, label in self._coordinates()]
        named = "; ".join(
            f"{labels[i]!r} R = {big_r:.5g} (most with {labels[j]!r}, r = {r:.3g})"
            for i, big_r, j, r in found
        )
        return (
            " The posterior, as the Hessian at the latest tuning draw describes it, "
            "correlates these coordinates with the others together (multiple correlation "
            f"R): {named}. The diagonal preconditioner cannot follow so correlated a "
            "posterior: its long direction takes many relaxation times of the narrow one to "
            "cross, whatever the step size, so neither more tuning nor control variates fix "
            "it. An intercept and the "
            "coefficients of covariates far from zero on average: centre the covariates "
            "(x - x.mean()) or standardise them; nearly collinear covariates: combine or "
            "drop one; otherwise reparametrise the model."
        )

    def _warn_if_drifting(self) -> None:
        """Warn when the last slow window's draws were still travelling: the kernel kept for
        the draws is then chosen on the way to the posterior, and the first draws may still
        be on their way. The level is one that a chain sampling over the window exceeds in
        any coordinate in about ``adaptation.DRIFT_WARNING_FALSE_ALARMS`` (1 %) of runs,
        whatever the window's length and the model's dimension."""
        drifting = self.window.drift_warning()
        if not drifting.any():
            return
        threshold = self.window.drift_warning_threshold()
        coordinates = zip(self._coordinates(), drifting, strict=True)
        names = list(dict.fromkeys(name for (name, _), moved in coordinates if moved))
        where = f" ({', '.join(repr(n) for n in names)})" if names and names[0] else ""
        warnings.warn(
            f"{type(self).__name__}: the chain was still drifting at the end of tuning: "
            f"{int(drifting.sum())} of {self.dim} coordinates{where} moved by more than "
            f"{threshold:.2g} of their spreads between the two halves of the last "
            "adaptation window. The step size and preconditioner were chosen on the way to "
            "the posterior and the first draws may still be travelling: increase tune or "
            "start nearer the posterior (initvals). If thin was capped as well, the posterior "
            f"may have a direction that the {self._preconditioner_kind} cannot follow, far "
            f"wider than the narrowest that sets the step size: {self._unfollowed}."
            f"{self._correlation_note()}",
            RuntimeWarning,
            stacklevel=2,
        )

    def _initial_kernel(self, theta: np.ndarray) -> None:
        """Chain start with an adapted step size. Before any draws, the preconditioner is
        the curvature of each coordinate at the start, scale_i = H_ii^{-1/2} (the posterior
        sd of a Gaussian with a diagonal precision), so that the friction and the step size
        are measured against coordinates of about unit width from the first step.
        Coordinates with no positive curvature there get the median of the others. Without
        adaptation windows (``tune`` below 20) the draws keep this kernel, so it also meets
        the final noise rule: with the transient's alone, SGHMC's draws had standard
        deviations 1.6-1.7x the posterior's at N / n = 200."""
        if self.adapt_preconditioner:
            scale = self._curvature_scale(theta, self.rng)
            if scale is not None:
                self.scale = scale
        phase = "transient" if self.boundaries else "start_kept"
        self.transient = phase == "transient"
        self._set_kernel(self._choose_step_size(theta, phase), phase)

    def _curvature_scale(self, theta: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
        """H_ii^{-1/2} at ``theta``, the posterior sd of each coordinate if the others were
        held fixed; coordinates with no positive curvature (or a negative Hutchinson estimate
        above D = 64) get the median of the others. None if no coordinate has any."""
        diagonal = self.sg_model.curvature_diagonal(theta, rng)
        usable = np.isfinite(diagonal) & (diagonal > 0)
        if not usable.any():
            return None
        return 1.0 / np.sqrt(np.where(usable, diagonal, np.median(diagonal[usable])))

    def _choose_step_size(self, theta: np.ndarray, phase: str) -> float:
        """The step size from the geometry at the last few tuning draws (or at ``theta`` at
        the chain start): the largest curvature, for stability, and the noise averaged over
        the points, for accuracy -- the gradient noise varies with the position, more than
        the curvature."""
        points = self.recent or [theta]
        curvature, noise = self._geometry(points, self.preconditioner, self.rng)
        if not np.isfinite(curvature) or curvature <= 0:
            # Not finite here (e.g. at a boundary of the support): a cautious halving.
            return 0.5 * self.step_size if self.step_size else 1e-3
        step_size = self.adapted_step_size(curvature, noise, phase)
        # Which bound set it decides what a capped thin's warning advises.
        self.noise_limited = step_size < self.adapted_step_size(curvature, 0.0, phase)
        return step_size

    def _step_size_under(
        self,
        preconditioner: Preconditioner,
        points: list[np.ndarray],
        rng: np.random.Generator,
        phase: str,
    ) -> float:
        """The step size the rule would take under ``preconditioner`` at ``points`` (0 where
        the curvature is not finite and positive there)."""
        curvature, noise = self._geometry(points, preconditioner, rng)
        if not np.isfinite(curvature) or curvature <= 0:
            return 0.0
        return self.adapted_step_size(curvature, noise, phase)

    def _geometry(
        self, points: list[np.ndarray], preconditioner: Preconditioner, rng: np.random.Generator
    ) -> tuple[float, float]:
        """The largest curvature over ``points`` and the largest gradient-noise variance
        averaged over them (0 where not finite), in the coordinates of ``preconditioner``."""
        sg_model = self.sg_model
        curvature = np.max([sg_model.largest_curvature(x, preconditioner, rng) for x in points])
        if not np.isfinite(curvature) or curvature <= 0:
            return float(curvature), 0.0
        noise = sg_model.gradient_noise(
            points, preconditioner, rng, anchor=self._geometry_anchor
        ).largest
        return float(curvature), float(noise) if np.isfinite(noise) else 0.0

    @property
    def _kernel(self) -> tuple:
        """Values of the compiled functions' kernel inputs: preconditioner (scale, and the
        rotation of a dense one), noise shrinkage,
        control-variate anchor and its exact force (zeros, unused, without), then the
        sampler's own (:meth:`sampler_kernel_values`)."""
        rotation = [self.rotation] if self.dense else []
        common = (self.scale, *rotation, self.shrinkage, self.anchor, self.anchor_force)
        return (*common, *self.sampler_kernel_values())

    def sampler_kernel_inputs(self) -> list[TensorVariable]:
        """A sampler's own scalar inputs that change between blocks without recompiling
        (created while compiling; :meth:`sampler_kernel_values` gives their values)."""
        return []

    def sampler_kernel_values(self) -> tuple:
        """Values of :meth:`sampler_kernel_inputs` for the next block."""
        return ()

    @property
    def _geometry_anchor(self) -> np.ndarray | None:
        """The anchor whose control-variate noise the step size is chosen for, if any."""
        return self.anchor if self.control_variates else None

    def _set_anchor(self, theta: np.ndarray) -> None:
        """Move the control variates' anchor to ``theta``: one pass over the data."""
        self.anchor = np.array(theta, dtype=float)
        self.anchor_force = self.sg_model.full_data_force(self.anchor)
        self.anchor_due = False

    def _warn_if_far_from_mode(self, theta: np.ndarray, case: str) -> None:
        """Report a point that no adaptation window follows, far from the mode: the start of
        a chain whose kernel is chosen there and kept (``case="kernel"``, ``tune`` below 20),
        the control variates' anchor (``"anchor"``: the chain's start then, or its last
        tuning draw), or the start of a chain with a given step size whose draws begin there
        (``"way in"``, ``tune`` below 20).

        The kernel is chosen for the curvature and gradient noise at the start: SGHMC with
        ``tune=0`` from a ``pm.find_MAP()`` of a minibatch model, 370 posterior sd out in
        the noise scale, drew that scale's sd 19.5 times the posterior's, silently. The
        control-variate noise grows with the distance from the anchor, and the step size is
        chosen for the noise near it: SGHMC and mSGLD with ``tune=0`` from 169 posterior sd
        out drew sds 10-28 times the posterior's. With a given step size nothing is chosen
        at the start, but nothing discards the way in either: NOGIN at the benchmarks' h from
        w = 0 on a logistic regression of 10^6 rows ended 9.2 posterior sd off after 146,000
        steps, still on its way, and no other check spoke.

        The distance from the mode in posterior sd, per coordinate, is about the Newton step
        ``F_i / sqrt(H_ii)`` (exact force, curvature from 4 minibatches), with unit variance
        at a posterior draw (for a Gaussian posterior, whatever its correlations: Var F_i =
        (H Sigma H)_ii = H_ii). Not the posterior's marginal sd times F_i: its variance,
        Sigma_ii H_ii, grows with the correlations (about 20 at rho = 0.95), and an anchor at
        a posterior draw of a logistic regression with such covariates was reported 3.2-3.7
        sd out. After a slow window, the marginal sds it measured bound H_ii^(-1/2) (for a
        Gaussian it is at most that), which is no width where H_ii is almost zero: a Laplace
        prior off its kink, a rare one-hot level far in its rows' logistic tails. The main
        example's model with control variates had its anchor, a tuning draw, reported 7e7
        sd out."""
        anchored = case == "anchor" or (case == "kernel" and self.control_variates)
        force = self.anchor_force if anchored else self.sg_model.exact_force(theta)
        rng = self.rng.spawn(1)[0]  # the chain's own stream stays as it would be
        scale = self._curvature_scale(theta, rng)
        if force is None or scale is None:
            return
        if self.measured_widths is not None:
            scale = np.minimum(scale, self.measured_widths)
        distance = float(np.sqrt(np.mean((scale * force) ** 2)))
        if not np.isfinite(distance) or distance <= FAR_FROM_MODE_WARNING:
            return
        self.far_warned = True
        if case == "kernel":
            where = "the chain starts"
            chosen = ["the step size"] + ["preconditioner"] * self.adapt_preconditioner
            chosen += ["thin"] * (self.user_thin is None)
            chosen += ["the control variates' anchor"] * anchored
            listed = " and ".join([", ".join(chosen[:-1]), chosen[-1]] if chosen[1:] else chosen)
            why = (
                f"and with tune below 20 no adaptation window follows: {listed} "
                "were chosen for the geometry there and are kept for the draws, which also "
                "include the way in, so the draws can be far too wide or off. Tune for at "
                "least 150 draws"
            )
        elif case == "way in":
            where = "the chain starts"
            why = (
                "and with tune below 20 its draws begin there: they include its way in, "
                "however long it takes at the step size given, and their means and spreads "
                "can be far off, with no step flagged `diverging`. Tune for at least 150 "
                "draws (discarded)"
            )
        else:
            where = "the control variates' anchor is"
            why = (
                "and no adaptation window follows to move it closer and choose the step size "
                "there. The control-variate force's noise grows with the distance from the "
                "anchor and the step size allows only for the noise near it, so the draws can "
                "be too wide. Tune for at least 150 draws (the anchor follows the chain to the "
                "posterior)"
            )
        warnings.warn(
            f"{type(self).__name__}: {where} about {distance:.3g} posterior sd from the mode "
            "(root mean square over the coordinates, from the exact force and curvature "
            f"there), {why} or start at the mode (initvals=pm.find_MAP() on "
            "the model built on the full data: on a pm.Minibatch model it optimises a "
            "different random minibatch at each evaluation).",
            RuntimeWarning,
            stacklevel=2,
        )

    def _check_user_step_size(self, theta: np.ndarray) -> None:
        """Warn when a user's step size is beyond the linear-stability limit (twice
        :meth:`stable_step_size`) at ``theta`` (the first kept draw after tuning, in the final
        coordinates, or the end of the first block without tuning). Such a chain need not
        overflow: strong damping (NOGIN's noise solve, a hot thermostat) can turn the
        instability into a slow drift that no divergence check flags until the draws are far
        out in the tails (a logistic regression with N = 10^6 rows drifted to 140 posterior sd
        without one flagged step). A spawned generator keeps the chain's own random stream as
        it would be without the check."""
        self.stability_check_due = False
        if self.short_tune and not self.far_warned:
            self._warn_if_far_from_mode(self.chain_start, "way in")
        rng = self.rng.spawn(1)[0]
        curvature = self.sg_model.largest_curvature(theta, self.preconditioner, rng)
        if not np.isfinite(curvature) or curvature <= 0:
            return
        limit = 2.0 * self.stable_step_size(curvature)
        h = float(self.step_sizes(np.array([self.step_count]))[0])  # a schedule's current value
        self._check_user_step_size_noise(theta, h, curvature, rng)
        self._check_same_minibatch_shift(theta, h, rng)
        if h > limit:
            warnings.warn(
                f"{type(self).__name__}: step_size={h:.3g} is beyond the "
                f"linear-stability limit {limit:.3g} at the chain's position "
                f"(largest curvature {curvature:.3g} of -log p in the sampler's coordinates). "
                "Its draws cannot be trusted even where no step is flagged `diverging`: the "
                f"chain can drift away from the posterior; try step_size="
                f"{self.stable_step_size(curvature):.3g} or smaller, or leave step_size unset to "
                "have it chosen during tuning.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _check_user_step_size_noise(
        self, theta: np.ndarray, h: float, curvature: float, rng: np.random.Generator
    ) -> None:
        """Warn when a user's step size ``h`` leaves so much gradient noise uncorrected that
        the draws are too wide or too narrow (:meth:`noise_variance_factors` beyond
        :data:`NOISE_EXCESS_WARNING`), as neither a divergence nor any other check shows:
        SGHMC at the papers' h = 1.2e-3 on the benchmarks' logistic regression P3
        (N / n = 100) ran at a kinetic temperature of 604, its means 27 posterior sd off,
        without a warning. ``rng``: the check's spawned generator (the chain's own stream
        stays as it would be)."""
        if self.noise_variance_factors(h, NoiseMoments(1.0, np.ones(self.dim))) is None:
            return  # it needs no estimate of the noise (whatever its moments)
        noise = self.sg_model.gradient_noise(
            [theta], self.preconditioner, rng, anchor=self._geometry_anchor
        )
        if not (np.isfinite(noise.largest) and np.isfinite(noise.diagonal).all()):
            return
        low, high = self.noise_variance_factors(h, noise)
        if max(high - 1.0, 1.0 - low) <= NOISE_EXCESS_WARNING:
            return
        suggested = self.adapted_step_size(curvature, noise.largest, "final")
        warnings.warn(
            f"{type(self).__name__}: at step_size={h:.3g} {self.noise_warning(low, high, noise)}"
            ", and no divergence shows it. Try "
            f"step_size={suggested:.3g} (the rule tuning applies), leave step_size unset to "
            "have it chosen during tuning, or use a sampler that damps the noise by its "
            "estimated covariance (mCCAdL, NOGIN).",
            RuntimeWarning,
            stacklevel=2,
        )

    def _check_same_minibatch_shift(
        self, theta: np.ndarray, h: float, rng: np.random.Generator
    ) -> None:
        """Warn when a user's step size ``h`` lets the papers' same-minibatch noise estimate
        shift the posterior means by more than :data:`SAME_MINIBATCH_SHIFT_WARNING` posterior
        sd: mCCAdL at h = 1.2e-3 on the benchmarks' logistic regression P3 (N / n = 100)
        drew its means 2.7 sd off (NOGIN 1.35), with no warning. The shift is the first-order
        delta = -s (h^2 / 2) C c3 (``s``: :meth:`same_minibatch_shift_share` times the
        shrinkage's 1 - rho; not checked with independent rows, nor with an average of the
        estimate, which dilutes the correlation by an amount this formula does not give),
        with c3 from the third moment of 16 pooled minibatches' per-observation gradients
        (:meth:`SGModel.noise_third_moment`) and C the inverse of the Hessian at ``theta``
        from 4 minibatches, both in the sampler's coordinates. It must stand out of the
        estimate's own noise, which is then subtracted from its mean square: a symmetric
        likelihood (c3 = 0) stays silent. It over-states the shift where the damping
        saturates (h^2 lambda_max(Sigma) / 2 near 1 and above: 0.82 and 0.46 of it measured
        at 0.53 and 1.5). Up to ``adaptation.DENSE_MAX_DIM`` coordinates, and where that
        Hessian is positive definite."""
        share = self.same_minibatch_shift_share()
        same = self.noise_minibatch == "same" and not self.averages_noise
        if not (share and same) or self.dim > DENSE_MAX_DIM:
            return
        share *= 1.0 - self.shrinkage
        moment = self.sg_model.noise_third_moment(
            theta, self.preconditioner, rng, anchor=self._geometry_anchor
        )
        if moment is None:
            return
        c3, c3_error = moment
        to_theta = self.preconditioner.matrix()
        hessian = to_theta.T @ self.sg_model.curvature_matrix(theta, rng) @ to_theta
        try:
            covariance = np.linalg.inv(np.linalg.cholesky(hessian))
        except np.linalg.LinAlgError:
            return  # no Gaussian approximation here to take C from
        covariance = covariance.T @ covariance  # C = H^-1 from the Cholesky factor
        sd = np.sqrt(np.diag(covariance))
        in_sd = share * h**2 / 2.0 * covariance / sd[:, None]  # c3 -> delta / sd
        square = float(np.mean((in_sd @ c3) ** 2))
        chance = float(np.mean((in_sd**2) @ (c3_error**2)))  # the estimate's noise in it
        # Silent unless the estimate stands out of its own noise (a noise-only estimate's
        # mean square is about chance * chi2_D / D; third moments are heavy-tailed, hence at
        # least 4): on a Gaussian regression at its mean with N / n = 500 and n = 20, the
        # noise alone made the estimate 90-660 sd, at 0.5-1.1 times its chance level; the
        # shifts measured on logistic regressions stood at 3.4-7 times it.
        significant = square > max(4.0, chi2.ppf(0.999, self.dim) / self.dim) * chance
        excess = square - chance
        if not (significant and excess > SAME_MINIBATCH_SHIFT_WARNING**2):
            return
        rms = np.sqrt(excess)
        smaller = h * np.sqrt(0.5 * SAME_MINIBATCH_SHIFT_WARNING / rms)
        warnings.warn(
            f"{type(self).__name__}: at step_size={h:.3g} the noise covariance estimated "
            "from the force's own minibatch (the papers' estimate) is correlated with the "
            f"force's noise and shifts the draws' means by about {rms:.2g} posterior sd (root "
            "mean square over the coordinates, from the third moment of the per-observation "
            "gradients at the chain's position; a first-order estimate, which over-states "
            "large shifts), and no divergence shows it. Use noise_minibatch='independent', "
            "averaging=0.1 with averaging_interval=300, step_size="
            f"{smaller:.3g} (the shift grows as the step size squared), or leave step_size "
            "unset to have it chosen during tuning.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _estimate_shrinkage(self, theta: np.ndarray) -> None:
        """The intensity for ``noise_shrinkage="auto"``, from minibatch gradients at
        the last tuning draws (or at ``theta`` at a chain start), in the current coordinates:
        re-estimated after every adaptation window and at the end of tuning, then fixed."""
        points = self.recent or [theta]
        self.shrinkage = self.sg_model.shrinkage_intensity(
            points,
            self.preconditioner,
            self.rng,
            target=self.noise_shrinkage_target,
            anchor=self._geometry_anchor,
        )
        self.shrinkage_due = False

    def _set_kernel(self, step_size: float, phase: str | None = None) -> None:
        """Set the step size and, unless the user gave one, ``thin``: one relaxation time of
        the posterior's widest direction (:attr:`widest_variance`, measured at the end of
        tuning), at most ``MAX_THIN`` steps. ``phase`` names a kernel chosen by the step-size
        rule; the one the draws keep warns when the cap shortened ``thin``."""
        self.step_size = float(step_size)
        if self.user_thin is None:
            relaxation = self.relaxation_steps(self.step_size, self.widest_variance)
            self.thin = int(np.clip(relaxation, 1, MAX_THIN))
            far_start = phase == "start_kept" and self.far_warned  # said why, and what to do
            if phase in KEPT_PHASES and relaxation > THIN_CAP_WARNING * MAX_THIN and not far_start:
                self._warn_thin_capped(relaxation)

    def _warn_thin_capped(self, relaxation: int) -> None:
        """The kept kernel's ``thin`` is shorter than a relaxation time: say by how much, what
        ``thin`` would give draws about one relaxation time apart, and what would allow a
        larger step size. Where the gradient noise set it, control variates (NOGIN and
        mCCAdL on a 20,000-row logistic regression: 19-25 s against 176-276 s with
        ``thin`` capped, the same accuracy) or a larger minibatch; where the curvature did,
        neither: the preconditioned posterior is far narrower in one direction than in
        another. Where the posterior's widest direction lengthened the relaxation time, what
        follows it: a dense preconditioner, or a reparametrisation."""
        unit = self.relaxation_steps(self.step_size)
        wide = relaxation > THIN_CAP_WARNING * unit  # the widest direction's doing
        if wide and unit <= THIN_CAP_WARNING * MAX_THIN:
            remedy = ""  # the step size alone would not have capped thin
        elif not self.noise_limited:
            remedy = (
                "The curvature, not the gradient noise, limits this step size: the "
                "posterior is far narrower in some direction than the "
                f"{self._preconditioner_kind} expects: {self._unfollowed}. Neither a larger "
                "minibatch nor control variates would allow a larger one."
            )
        elif self.control_variates:
            remedy = (
                "The gradient noise limits this step size: a larger minibatch allows a larger one."
            )
        else:
            remedy = (
                "The gradient noise limits this step size: control_variates=True (one pass "
                "over the data per anchor; the noise shrinks near the posterior when N is "
                "much larger than the minibatch) or a larger minibatch allows a larger one."
            )
        if wide:
            remedy = f"{remedy} {self._widest_direction_remedy(relaxation / unit)}".strip()
        warnings.warn(
            f"{type(self).__name__}: thin was capped at {MAX_THIN} steps per draw, "
            f"{relaxation / MAX_THIN:.3g} times fewer than one relaxation time at the adapted "
            f"step_size={self.step_size:.3g} ({relaxation} steps). Successive draws are "
            "correlated and the effective sample size will be well below the number of "
            f"draws. Pass thin={relaxation} for draws about one relaxation time apart (a run "
            f"{relaxation / MAX_THIN:.3g} times as long), or take more draws. {remedy}"
            f"{self._correlation_note()}",
            RuntimeWarning,
            stacklevel=2,
        )

    def _widest_direction_remedy(self, slower: float) -> str:
        """What the capped-``thin`` warning says of a posterior direction far wider than the
        preconditioner's coordinates, which relaxes ``slower`` times more slowly than they do."""
        if self.may_rotate or self.dense or self.dim > DENSE_MAX_DIM:
            follow = (
                f"The {self._preconditioner_kind} cannot follow {self._unfollowed}: "
                "reparametrise the model."
            )
        else:
            follow = (
                "A dense preconditioner follows it: adapt_preconditioner=True (the default) "
                "makes one where the Hessian's correlation matrix has a condition number of "
                f"{ROTATION_GAIN:g} or more and the dense one conditions the posterior better; "
                "or reparametrise the model."
            )
        return (
            f"The posterior's widest direction is {self.widest_variance:.3g} times wider in "
            f"variance than the {self._preconditioner_kind}'s coordinates (the correlations "
            "of the Hessian at the last tuning draw) and relaxes "
            f"{slower:.3g} times more slowly than they do. {follow}"
        )

    # ------------------------------------------------------------------ blocks
    def _initial_state(self, theta: np.ndarray) -> dict[str, np.ndarray]:
        names = self.functions[1]
        state = {"theta": np.asarray(self.preconditioner.to_phi(theta), dtype=self.dtype)}
        state.update(self._start_evaluation(state["theta"]))
        state.update(self.initial_auxiliary(self.rng))
        return {n: state[n] for n in names}

    def _start_evaluation(
        self, theta: np.ndarray, rng: np.random.Generator | None = None
    ) -> dict[str, np.ndarray]:
        """:meth:`initial_evaluation` at ``theta`` (preconditioned coordinates) with a fresh
        minibatch and noise from ``rng``, by default the chain's stream."""
        init_fn, _, evaluated = self.functions
        if init_fn is None:
            return {}
        rng = self.rng if rng is None else rng
        indices = [i[0] for i in self.sg_model.draw_indices(rng, 1)]
        noise = rng.standard_normal((self.noise_vectors, self.dim), dtype=self.dtype)
        values = init_fn(theta, *indices, *noise, self.step_size, *self._kernel)
        return dict(zip(evaluated, values, strict=True))

    @one_blas_thread
    def _fill_buffer(self, theta: np.ndarray) -> None:
        if self.chain_start is None:  # a chain's (re)start, also when filled without astep
            self.chain_start = np.array(theta)
        names = self.functions[1]
        anchored = self.anchor_due
        if anchored:
            self._set_anchor(theta)
        kernel_from_start = self.step_size is None and not self.boundaries
        if (anchored or kernel_from_start) and not self.boundaries and not self.far_warned:
            case = "kernel" if kernel_from_start else "anchor"
            self._warn_if_far_from_mode(theta, case)  # no window will move it
        if self.step_size is None:
            self._initial_kernel(theta)
        # After tuning at the first kept draw; without tuning after the first block, once the
        # chain has left its starting point (often far out, with a far larger curvature).
        warmed_up = self.tune_drawn > 0 or self.chain_state is not None
        if self.stability_check_due and not self.tune and warmed_up:
            self._check_user_step_size(theta)
        if self.chain_state is None:
            if self.shrinkage_due and self.noise_shrinkage == "auto":
                self._estimate_shrinkage(theta)
            self.chain_state = self._initial_state(theta)
        n_draws = self.block_length // self.thin
        if self.draws_left is not None and self.draws_left > 0:
            n_draws = min(n_draws, self.draws_left)
        if self.tune and self.tune_left > 0:
            n_draws = min(n_draws, self.tune_left)  # a block never straddles the end of tuning
            if self.boundaries:  # nor an adaptation boundary
                n_draws = min(n_draws, self.boundaries[0][0] - self.tune_drawn)
        if self.block_cap is not None:
            n_draws = min(n_draws, self.block_cap)  # short blocks after a divergence
        n_steps = n_draws * self.thin
        step_index = self.step_count + np.arange(n_steps)
        h = np.asarray(self.step_sizes(step_index), dtype=self.dtype)
        indices = self.sg_model.draw_indices(self.rng, n_steps)
        noise = self.rng.standard_normal((n_steps, self.noise_vectors, self.dim), dtype=self.dtype)
        length = self.compiled_length  # shorter blocks are padded
        block_fn, stat_names = self._block_function()
        checked, stored_steps = self._logp_steps(n_steps)
        wanted, stored_flags = np.zeros(n_steps, dtype=bool), np.zeros(n_steps, dtype=bool)
        wanted[checked] = wanted[stored_steps] = stored_flags[stored_steps] = True
        # The rows of Sigma-hat (see _block_function). Independent ones are drawn after the
        # force's rows and the noise, which then stay those of noise_minibatch="same".
        noise_rows = []
        if self.noise_minibatch == "independent":
            noise_rows = self.sg_model.draw_indices(self.rng, n_steps)
        elif self.averages_periodically:
            noise_rows = indices
        # Static shapes: each step active; dynamic: the loop goes on after it (_block_function).
        active = np.arange(n_steps) < (n_steps if self.static_shapes else n_steps - 1)
        # Each noise vector's sequence (:meth:`_block_function`), cut from one array drawn as
        # before the sequences were split: a seed gives the same noise as then.
        noise = [np.ascontiguousarray(noise[:, k]) for k in range(self.noise_vectors)]
        sequences = _padded(
            [*indices, *indices, *noise_rows, *noise, h], [active, wanted, stored_flags], length
        )
        if self._device_data is not None:
            self._device_data.refresh()
        start = self.chain_state
        # numba compiles the block at its first call; Ctrl-C while it runs reaches us wrapped.
        with plain_assignment_errors(), interrupts_as_such():
            out = block_fn(*(start[n] for n in names), *sequences, *self._kernel)
        # JAX returns read-only views of its buffers, which PyMC's trace cannot take.
        out = [o if o.flags.writeable else np.array(o) for o in map(np.asarray, out)]
        final = out[: len(names)]
        # Padded steps are not read.
        thetas, sane, logps, *stats = (trace[:n_steps] for trace in out[len(names) :])
        stored_logps = logps[stored_steps]
        # The momentum samplers' check follows the energy (``runaway.checked_series``).
        traces = dict(zip(stat_names, stats, strict=True))
        temperatures = traces.get("kinetic_temperature")
        series = checked_series(logps, temperatures, self.dim)
        checked_values = series[checked]
        stored = slice(self.thin - 1, None, self.thin)
        buffer = {
            "theta": thetas[stored],
            "step_size": h[stored],
            "minibatch_logp": stored_logps,
            "diverging": np.zeros(n_draws, dtype=bool),
            "thin": np.full(n_draws, self.thin, dtype=np.int64),
            "dense_preconditioner": np.full(n_draws, self.dense),
            **{name: np.full(n_draws, self.shrinkage) for name in self._noise_estimate_stat_names},
            **{name: values[stored] for name, values in zip(stat_names, stats, strict=True)},
        }
        for name in self._integrator_stat_names():
            buffer[name] = buffer[name].astype(self.stats_dtypes_shapes[name][0])
        medians = running_medians(checked_values, self.logp_history)
        flags = runaway_flags(checked_values, medians, self.typical_logp, self.logp_spreads)
        if self.transient and temperatures is not None:
            heat_flags, transient_reference = transient_heat_flags(
                logps[checked],
                temperatures[checked],
                self.dim,
                self.step_size,
                self.friction,
                self.transient_reference,
            )
            flags |= heat_flags
        sane[checked[flags]] = False
        sane[stored_steps[~np.isfinite(stored_logps)]] = False
        typical = self.typical_logp if self.typical_logp is not None else checked_values[0]
        if self.thin > STRIDE and np.isfinite(typical):  # else runaway_flags read them
            extreme = extreme_flags(series[stored_steps], typical, self.logp_spreads)
            sane[stored_steps[extreme]] = False
        if sane.all():
            self.chain_state = dict(zip(names, final, strict=True))
            self.step_count += n_steps
            self.typical_logp = updated_reference(
                self.typical_logp, self.logp_spreads, checked_values, medians
            )
            self.logp_history = trailing_history(self.logp_history, checked_values)
            if self.transient and temperatures is not None:
                self.transient_reference = transient_reference
            if self.block_cap is not None:
                self.block_cap = (
                    None
                    if 2 * self.block_cap * self.thin >= self.block_steps
                    else (2 * self.block_cap)
                )
            if not self.tune:
                last = self.draws_left is not None and n_draws >= self.draws_left
                self._kept_block(start, h, traces, last)
        else:
            bad = int(np.argmin(sane))
            self.block_cap = max(1, bad // self.thin)
            buffer = self._truncate_at_divergence(buffer, theta, bad)
            if self.typical_logp is None:
                # No sane block yet: the restarted block's first step would be its own
                # reference, however far it had run away (runaway.first_reference).
                restart = buffer["theta"][-1]
                self.typical_logp = first_reference(
                    checked_values[checked < bad],
                    lambda: self.sg_model.minibatch_logp(restart, self.rng.spawn(1)[0]),
                )
        self._flag_far_from_anchor(buffer)
        # The count of divergent draws so far, at each draw (the buffer is served in order).
        buffer["divergences"] = self.divergences + np.cumsum(buffer["diverging"], dtype=np.int64)
        self.buffer = buffer
        self.stat_rows = None  # built at the first draw step() serves from this block
        self.cursor = 0

    def _kept_block(
        self,
        start: dict[str, np.ndarray],
        h: np.ndarray,
        traces: dict[str, np.ndarray],
        last: bool,
    ) -> None:
        """A block of kept draws (after tuning) ran without divergence from the integrator
        state ``start`` to ``self.chain_state`` with the step sizes ``h`` and the per-step
        stats ``traces``; ``last``: it holds the chain's last draw. For checks over the kept
        draws."""

    def _logp_steps(self, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The steps of a block at which the runaway check reads the minibatch log-density
        (every ``min(thin, runaway.STRIDE)``-th) and those of the stored draws (the same array
        when ``thin <= runaway.STRIDE``)."""
        stored = np.arange(self.thin - 1, n_steps, self.thin)
        if self.thin <= STRIDE:
            return stored, stored
        return np.arange(STRIDE - 1, n_steps, STRIDE), stored

    def _flag_far_from_anchor(self, buffer: dict) -> None:
        """Flag ``diverging`` the kept draws of ``buffer`` that lie more than
        :data:`ANCHOR_DISTANCE_LIMIT` posterior widths (the last slow window's spreads) from
        the control variates' anchor in some coordinate, and warn once.

        The control-variate noise grows with the square of the distance from the anchor, so
        that far out the kernel chosen near it no longer holds. Where a coordinate rests on a
        few rows, the covariance samplers' same-minibatch estimate damps the very kicks that
        hold it: MCCAdL on a logistic regression whose level has 10 of 4,000 rows (n = 100)
        drifted steadily from its anchor to 280 widths, at no divergence and with a
        minibatch log-density whose median never saw those rows (:mod:`pymc_sgmcmc.runaway`
        follows the median)."""
        if self.tune or not self.control_variates or self.measured_widths is None:
            return
        distances = np.abs(buffer["theta"] - self.anchor) / self.measured_widths
        far = np.max(distances, axis=1) > ANCHOR_DISTANCE_LIMIT
        if not far.any():
            return
        buffer["diverging"] |= far
        if self.anchor_warned:
            return
        self.anchor_warned = True
        first = int(np.argmax(far))
        coordinate = self._coordinates()[int(np.argmax(distances[first]))][1]
        warnings.warn(
            f"{type(self).__name__}: a draw lies {np.max(distances[first]):.0f} posterior widths "
            f"(the last adaptation window's spreads) from the control variates' anchor in "
            f"{coordinate}. Their noise grows with the square of that distance, far beyond what "
            "the step size was chosen for, and draws that far out are not a posterior: those "
            f"beyond {ANCHOR_DISTANCE_LIMIT:g} widths are flagged `diverging`. A chain runs away "
            "like this where a coordinate rests on a few rows of the data (a rare level): "
            "sample without control_variates, or merge such levels. Or tuning ended before the "
            "chain reached the posterior (the drift warning says so): increase tune.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _truncate_at_divergence(self, buffer: dict, start: np.ndarray, bad_step: int) -> dict:
        """Keep the draws before the first divergent step; the next draw repeats the last
        sane position with ``diverging=True``, and the chain restarts from there."""
        j = bad_step // self.thin
        last = buffer["theta"][j - 1] if j > 0 else np.array(start)
        h_bad = float(buffer["step_size"][j])
        kept = {name: values[: j + 1].copy() for name, values in buffer.items()}
        kept["theta"][j] = last
        kept["diverging"][j] = True
        for name, values in kept.items():
            if values.dtype.kind == "f" and name not in ("theta", "step_size"):
                values[j] = np.nan
        self.step_count += (j + 1) * self.thin
        self.chain_state = None  # restart from `last` with fresh auxiliary variables
        # The restarted chain's first steps are judged on their own, not diluted by the
        # window of sane steps before (a short block after a divergence would hide in it).
        self.logp_history = np.zeros(0)
        self.transient_reference = TRANSIENT_START  # fresh momentum: nothing carried
        if self.tune and self.adapts_step_size:
            # Part of finding the step size: halve it; tuning draws are discarded anyway.
            self._set_kernel(0.5 * h_bad)
        elif not self.warned:
            self.warned = True
            warnings.warn(
                f"{type(self).__name__} diverged (non-finite position, momentum or force, "
                f"|position| > {self.divergence_threshold:g}, or a collapse of the minibatch "
                "log-density, or of the energy) at "
                f"step {self.step_count} with step_size={h_bad:.3g}. The chain restarts from its "
                "last sane draw and the draw is flagged `diverging`; try "
                f"step_size={self.step_size_hint(self.chain_start, h_bad):.3g} or smaller (the "
                "stability limit from the curvature of the log-density at the chain's starting "
                "point, and at most half the step size that diverged).",
                RuntimeWarning,
                stacklevel=2,
            )
        return kept


def _correlation_condition(precision: np.ndarray) -> float:
    """The condition number of the correlation matrix of the Gaussian with this precision
    (that of the precision rescaled to a unit diagonal): what a diagonal preconditioner,
    whatever its scales, leaves of it. 0 unless finite and positive definite."""
    if not np.all(np.isfinite(precision)) or np.any(np.diag(precision) <= 0):
        return 0.0
    inverse_sd = 1.0 / np.sqrt(np.diag(precision))
    eigenvalues = np.linalg.eigvalsh(precision * np.outer(inverse_sd, inverse_sd))
    return float(eigenvalues[-1] / eigenvalues[0]) if eigenvalues[0] > 0 else 0.0


def _posterior_curvature(
    hessian: np.ndarray, coordinates: np.ndarray, window: tuple[np.ndarray, int] | None
) -> tuple[np.ndarray, bool]:
    """The curvature for the choice of rotation, and whether the draws measured it:
    ``hessian`` itself where it is positive definite (or without a ``window``), else the
    curvature that the window's draws (covariance and count) measure along its
    eigen-directions in the coordinates phi of theta = ``coordinates`` phi
    (``adaptation.measured_curvature``). Non-finite entries (a window that ran away) measure
    nothing: ``hessian`` is returned, and no rotation is fitted to it."""
    finite = window is not None and all(
        np.all(np.isfinite(m)) for m in (hessian, coordinates, window[0])
    )
    if not finite or is_positive_definite(hessian):
        return hessian, False
    return measured_curvature(hessian, coordinates, *window), True


def _inverse_square_root(matrix: np.ndarray, cholesky: bool) -> np.ndarray:
    """A factor F of the inverse of a positive definite ``matrix`` (F F^T = matrix^-1): its
    Cholesky factor, lower-triangular, or V diag(1/sqrt(lambda)) from its eigen-decomposition,
    which a matrix condition to 10^7 or more (a measured curvature's narrow directions) keeps
    positive definite where the inverse's rounding does not."""
    if cholesky:
        return np.linalg.cholesky(np.linalg.inv(matrix))
    eigenvalues, vectors = np.linalg.eigh(matrix)
    return vectors / np.sqrt(eigenvalues)


def _condition_number(coordinates: np.ndarray, *hessians: np.ndarray) -> float:
    """The largest condition number (largest over smallest eigenvalue) of the ``hessians`` in
    the coordinates phi of theta = ``coordinates`` phi: inf unless all are finite and
    positive definite there."""
    worst = 0.0
    for hessian in hessians:
        if not np.all(np.isfinite(hessian)):
            return np.inf
        eigenvalues = np.linalg.eigvalsh(coordinates.T @ hessian @ coordinates)
        if eigenvalues[0] <= 0:
            return np.inf
        worst = max(worst, eigenvalues[-1] / eigenvalues[0])
    return float(worst)


@dataclass
class _Compiled:
    """The graphs and compiled functions of one kind of preconditioner (diagonal or dense),
    whose inputs differ: its target, the chain-start function with the state's names, and
    the blocks by compiled length."""

    target: PreconditionedTarget
    functions: tuple | None = None
    block_graph_inputs: tuple | None = None
    block_functions: dict = field(default_factory=dict)


class _Served(NamedTuple):
    """The point dict :meth:`SGMCMC.step` returned last and the same draw raveled."""

    point: dict[str, np.ndarray]
    raveled: RaveledVars


def _check_finite_start(q0: RaveledVars, sampler: str) -> None:
    """Refuse a chain start with NaN or Inf values (an ``initvals`` entry, or a value outside
    a variable's support, which its transform maps to NaN): every step from there is
    non-finite, and each draw would be flagged ``diverging`` at a step size that tuning
    halves towards zero. PyMC's NUTS refuses it as a bad initial energy."""
    if np.isfinite(q0.data).all():
        return
    point = _point_views(q0.data, q0.point_map_info)
    names = [name for name, value in point.items() if not np.isfinite(value).all()]
    raise SamplingError(
        f"{sampler}: the chain's starting point is not finite (NaN or Inf) in {names} (the "
        "model's value variables: transformed where a variable has bounds). Check the "
        "initvals given to pm.sample, and that each lies inside its variable's support."
    )


def _point_views(data: np.ndarray, point_map_info: tuple) -> dict[str, np.ndarray]:
    """``DictToArrayBijection.rmap`` without its copies: each variable a view of the raveled
    draw ``data`` (a copy only where its dtype differs); of each draw, stacked along the
    first axis, for draws stacked as the rows of ``data``."""
    point, start, leading = {}, 0, data.shape[:-1]
    for name, shape, size, dtype in point_map_info:
        end = start + size
        # A plain slice for one draw: this runs for every draw PyMC's loop steps.
        value = (data[:, start:end] if leading else data[start:end]).reshape(leading + shape)
        point[name] = value if value.dtype == dtype else value.astype(dtype)
        start = end
    return point


def _same_point(theta: np.ndarray, last: np.ndarray) -> bool:
    """Whether PyMC hands back the draw served last (the chain goes on) rather than a point
    another step method moved. :meth:`SGMCMC.step` hands back the served array itself;
    otherwise comparing the bytes takes 0.2 us against np.array_equal's 2 us per draw, and
    array_equal decides only when they differ (another dtype, -0.0)."""
    return theta is last or theta.tobytes() == last.tobytes() or np.array_equal(theta, last)


def stat_rows(columns: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """One dict of Python scalars per draw from the stats' columns, built for many draws at
    once (``tolist``), not per draw: NumPy scalars would cost more to make, and PyMC's trace
    converts the values anyway."""
    names = list(columns)
    rows = zip(*(columns[name].tolist() for name in names), strict=True)
    return [dict(zip(names, row, strict=True)) for row in rows]


def _padded(
    sequences: list[np.ndarray], flags: list[np.ndarray], length: int | None
) -> list[np.ndarray]:
    """The per-step sequences and flags of a block extended to ``length`` steps (unchanged
    for None): the padding repeats the last step's values (finite, so the padded steps
    compute what a real step would) and sets its flags (``active``, ``logp``, ``stored``) to
    False."""
    n_steps = len(flags[0])
    if length is None or length == n_steps:
        return [*sequences, *flags]
    extra = length - n_steps
    padded = [np.concatenate([s, np.repeat(s[-1:], extra, axis=0)]) for s in sequences]
    return [*padded, *(np.concatenate([f, np.zeros(extra, dtype=bool)]) for f in flags)]


class Thermostatted(SGMCMC):
    """Base of the samplers with momentum and a Nosé-Hoover thermostat (SGNHT, CCAdL, mCCAdL).

    At a chain (re)start the momentum is drawn from N(0, I) and xi = A (the papers' xi_0);
    the thermostat mass defaults to D (the papers' mu).

    The integrators read the thermostat's rate 1/mu from a kernel input,
    ``thermostat_rate``. In the initial interval of an adapted warm-up (the
    ``"transient"`` from the starting point) it is 0 and xi is held at A: the dynamics are
    Langevin with friction A, as SGHMC's. With the thermostat running, the potential energy
    released on the way in heats the momentum, xi grows until the kinetic energy is back at
    D / 2, and the chain then slides at about one posterior sd per unit time, a transit that
    grows linearly with the starting distance instead of logarithmically. The windows that
    set the preconditioner and step size, and the draws, run the papers' dynamics, restarted
    at each window's start.

    After the last draw the kinetic temperature of the kept draws is checked
    (``kept_kinetic_temperature()``): every thermostat step moves xi by
    (tau / mu)(p^T p - D), so xi's net change gives it exactly. A thermostat still relaxing
    (started far from its equilibrium, which it leaves from above at most D / mu per unit
    time) leaves the draws too cold or too hot, and a ``RuntimeWarning`` says so. With the
    step size adapted, a ``RuntimeWarning`` also reports xi averaging more than 2A over the
    draws (``_warn_if_thermostat_absorbing``)."""

    friction: float
    #: Whether the friction and its noise are Euler's ``-h xi p`` and ``sqrt(2 A h) R`` (CCAdL's
    #: Alg. 1, SGNHT's ``splitting="euler"``) rather than an exact Ornstein-Uhlenbeck step.
    euler_friction: bool = False

    def adapted_step_size(self, curvature: float, noise: float, phase: str) -> float:
        """The base rule, and with Euler's friction at most
        ``2 * EULER_TEMPERATURE_TOLERANCE / A``. Euler's friction and noise hold ``p . p / D``
        at ``A / (xi (1 - h xi / 2))``; the thermostat keeps that at 1 by settling at
        ``xi (1 - h xi / 2) = A``, and the positions then sample at the temperature
        ``A / xi``, about ``1 - h A / 2``. Where the curvature alone limits the step (control
        variates: h = 0.28 on a 10,000-row linear regression) the draws' sds were 0.87-0.93 of
        the posterior's for CCAdL and 0.89-0.92 for Euler SGNHT; CCAdL's 0.92-0.99 at
        h = 0.14, 0.98-1.00 at 0.07, 0.94-1.00 at this cap's 0.1."""
        h = super().adapted_step_size(curvature, noise, phase)
        if self.euler_friction:
            h = min(h, 2.0 * EULER_TEMPERATURE_TOLERANCE / self.friction)
        return h

    def _set_thermostat_mass(self, mass: float | None) -> None:
        self.thermostat_mass = positive("thermostat_mass", self.dim if mass is None else mass)

    def sampler_kernel_inputs(self):
        self.thermostat_rate = pt.scalar("thermostat_rate")
        return [self.thermostat_rate]

    def sampler_kernel_values(self):
        return (0.0 if self.transient else 1.0 / self.thermostat_mass,)

    def _initial_state(self, theta: np.ndarray) -> dict[str, np.ndarray]:
        state = super()._initial_state(theta)
        if self.transient:
            # Not SGNHT's equilibrium start A + h tr(Sigma) / (2D): far out the gradient
            # noise is large (xi = 4 at 100 sd on a logistic regression with N/n = 200), and a
            # friction that high would slow the transit as much as the thermostat does.
            state["thermostat"] = np.asarray(self.friction, dtype=state["thermostat"].dtype)
        return state

    def initial_auxiliary(self, rng):
        return {"momentum": rng.standard_normal(self.dim), "thermostat": np.array(self.friction)}

    def _reset_chain(self, tune: int, draws: int | None) -> None:
        super()._reset_chain(tune, draws)
        # xi at the first kept draw's block, its net change over the kept blocks, their time.
        self.kept_thermostat = (None, 0.0, 0.0)
        self.kept_friction_integral = 0.0  # of xi over the kept blocks' time

    def _kept_block(self, start, h, traces, last):
        first, change, time = self.kept_thermostat
        xi_start = float(start["thermostat"])
        change += float(self.chain_state["thermostat"]) - xi_start
        duration = float(np.sum(h))
        self.kept_thermostat = (xi_start if first is None else first, change, time + duration)
        self.kept_friction_integral += float(np.dot(traces["thermostat"], h))
        if last and not self._warn_if_thermostat_relaxing():
            self._warn_if_thermostat_absorbing()

    def kept_kinetic_temperature(self) -> float:
        """The kinetic temperature p^T p / D averaged over the kept draws' thermostat steps:
        every step moves xi by (tau / mu)(p^T p - D) with its taus summing to h, so the
        average is exactly 1 + mu (net change of xi) / (D time), whatever the splitting; 1
        on average when the thermostat is at its equilibrium."""
        _, change, time = self.kept_thermostat
        return 1.0 + self.thermostat_mass * change / (self.dim * time) if time > 0 else 1.0

    def _warn_if_thermostat_relaxing(self) -> bool:
        """Warn when the kept draws' kinetic temperature is off 1 by more than
        ``KINETIC_TEMPERATURE_TOLERANCE`` and by more than xi's equilibrium fluctuation
        explains: the thermostat was still relaxing, and the draws are too cold or too hot.
        At its equilibrium xi has sd 1/sqrt(mu) (the invariant density's factor
        exp(-mu (xi - A)^2 / 2), Shang et al. 2015, Proposition 2), so its net change over a
        run has sd sqrt(2 / mu). Returns whether it warned."""
        first, change, time = self.kept_thermostat
        if time <= 0:
            return False
        temperature = self.kept_kinetic_temperature()
        chance = RELAXATION_Z * np.sqrt(2.0 * self.thermostat_mass) / (self.dim * time)
        if abs(temperature - 1.0) <= max(KINETIC_TEMPERATURE_TOLERANCE, chance):
            return False
        state = "cold" if temperature < 1.0 else "hot"
        warnings.warn(
            f"{type(self).__name__}: the kinetic temperature averaged {temperature:.3g} over "
            f"the draws instead of 1: the thermostat was still relaxing (xi moved by "
            f"{change:+.4g} from {first:.4g} over {time:.3g} units of time, at (T - 1) D/mu "
            f"per unit time: from above at most D/mu), so the draws are too {state} (at that "
            f"temperature their spread would be about {np.sqrt(max(temperature, 0.0)):.2g} "
            "times the posterior's, and a chain still on its way to the posterior is further "
            "off). Let "
            "tune run (xi restarts at its equilibrium at each adaptation window's end, and "
            "with the step size adapted the gradient noise it absorbs stays small), start "
            "nearer the posterior, or take a smaller step_size.",
            RuntimeWarning,
            stacklevel=2,
        )
        return True

    def _warn_if_thermostat_absorbing(self) -> None:
        """Warn when, with the step size adapted, xi averaged over the kept draws' time more
        than ``THERMOSTAT_EXCESS_WARNING`` times A above A (and more than
        ``RELAXATION_Z`` of its equilibrium sd 1/sqrt(mu) above it, Shang et al. 2015,
        Proposition 2). At the adapted kernel the heat xi absorbs beyond A (the gradient
        noise the step leaves, at most about ``noise_tolerance`` A; Euler's friction, hA/2 of
        A) is a small fraction of A. Far above it, the noise or the curvature where the chain
        went is well beyond what tuning measured, and the step size is too large there:
        a thermostat that reached 12-21 in a funnel's neck (a centred random-intercept model
        whose group scale piles up at 0) left mCCAdL's sds 0.3-0.6 of the posterior's while
        the relaxation check, which reads the temperature at the thermostat's own steps,
        saw 1.02."""
        time = self.kept_thermostat[2]
        if self.user_step_size is not None or time <= 0:
            return
        mean_xi = self.kept_friction_integral / time
        allowed = max(
            THERMOSTAT_EXCESS_WARNING * self.friction,
            RELAXATION_Z / np.sqrt(self.thermostat_mass),
        )
        if mean_xi - self.friction <= allowed:
            return
        warnings.warn(
            f"{type(self).__name__}: the thermostat's friction xi averaged {mean_xi:.3g} over "
            f"the draws, {mean_xi / self.friction:.3g} times the friction A = "
            f"{self.friction:g} it stays near at the step size adapted in tune: it absorbed "
            "the heat of gradient noise or curvature far beyond what tuning measured, and at "
            f"step_size={self.step_size:.3g} the draws are not the posterior's (too narrow or "
            "too wide). A common cause is a funnel: a hierarchical scale near 0 in the "
            "centred form (write it non-centred, mu + tau * z, when the groups' data do not "
            "pin their means down). Otherwise pass a smaller step_size, or let tune run "
            "longer.",
            RuntimeWarning,
            stacklevel=2,
        )
