"""Benchmark suite: every sampler of the project inside ``pm.sample`` against same-run baselines.

Problems (``benchmarks/problems.py``): P1 Bayesian linear regression (N = 10,000, D = 100,
n = 500), P2 Normal-Gamma (N = 100, n = 10), P3 logistic regression (N = 50,000, D = 50,
n = 500), P4 logistic regression at scale (N = 1,000,000, D = 50, n = 1,000), MNIST 7 vs 9
logistic regression (seeded 100-dimensional random projection, n = 500).

Methods, all measured in the same process and run:

* the seven samplers of ``pymc_sgmcmc`` inside ``pm.sample`` (one chain, ``thin`` = 10), and
  SGLD with ``thin`` = 1 (every step through PyMC's trace) for its steps/s only; when named in
  ``--samplers``, also mCCAdL and NOGIN with a moving average of Sigma updated every 300
  steps (``mCCAdL-periodic``, ``NOGIN-periodic``) or with Sigma from a minibatch of its own
  (``mCCAdL-independent``, ``NOGIN-independent``);
* a hand-written NumPy SGLD (analytic gradients);
* BlackJAX SGLD and SGNHT in a ``jax.lax.scan`` over 1,000-step chunks with a hand-written
  log-density, minibatches drawn with replacement inside the scan, float64 (skipped with a
  note when ``blackjax``/``jax`` are not installed: ``pip install -e ".[bench]"``);
* NUTS (``pm.sample`` defaults: 1,000 tuning + 1,000 draws, here one chain) on the full
  data, twice: PyMC's own NUTS (``nuts_sampler="pymc"``) and nutpie, which ``pm.sample`` runs
  by default where it is installed (skipped with a note when it is not: ``pip install -e
  ".[bench]"``; nutpie reports no time per draw, so its draws are placed in time by their
  leapfrog steps). The "default NUTS" columns use nutpie's row where it ran. On P4 a full
  NUTS run takes tens of minutes: by default a short run measures the cost per tuning draw
  and per draw and the result is a labelled projection (``--nuts-p4`` runs the real thing).

Per method: time to first draw (step construction + ``pm.sample`` call to the first draw, the
package imported before: graph building, compilation and the first steps; for JAX the jit
compile plus the first chunk), steady-state steps/s (draws after the first block), and the time
to a result: the wall time until the draws estimate every posterior mean within 0.1 posterior
sd and every variance within 10 % in the root-mean-square over coordinates, measured at 40
checkpoints along the run on the second half of the draws so far (NUTS: all draws after
tuning), and required to hold at every later checkpoint. References: exact posteriors for P1
and P2; for P3 and MNIST a long NUTS run cached in ``benchmarks/cache/`` (gitignored); for P4
the Laplace approximation at the full-data MAP (checked against the NUTS reference on P3 in the
same run).

Step sizes come from the reference's largest posterior curvature lambda (unconstrained space):
SGLD-type eps = 0.5 / lambda (a quarter of the stability limit), momentum samplers
h = 0.1 / sqrt(lambda) with friction A = 1 (the papers' setting), all chains start at the
model's initial point (w = 0; gamma = 1, mu = 0).

Writes ``benchmarks/suite_results.md`` and ``.json``. Run: ``make bench-suite`` (or
``.venv/bin/python benchmarks/suite.py [--quick] [--problems P1 P3] [--nuts-p4]``).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import single_thread  # noqa: F401  (before NumPy: one thread per runtime)

# isort: split

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from compile_caches import compile_cache_env  # noqa: E402
from problems import PROBLEMS, Problem, Reference, make_problem, reference  # noqa: E402
from report import child_result, load_average, machine, script_parser, versions  # noqa: E402

SAMPLERS = ("SGLD", "mSGLD", "SGHMC", "SGNHT", "CCAdL", "mCCAdL", "NOGIN")
#: Options beyond the papers, run only when named in ``--samplers``: the moving average of
#: Sigma over about 20 minibatches, updated every 300 steps (``averaging_interval``), and
#: Sigma from rows drawn independently of the force's (``noise_minibatch``).
PERIODIC = {"averaging": 0.1, "averaging_interval": 300}
INDEPENDENT = {"noise_minibatch": "independent"}
VARIANTS = {
    f"{name}-{label}": (name, options)
    for name in ("mCCAdL", "NOGIN")
    for label, options in (("periodic", PERIODIC), ("independent", INDEPENDENT))
}
MEAN_TOL, VAR_TOL = 0.1, 0.1
CHECKPOINTS = 40
#: The clock of every timing: wall time, or with ``--clock cpu`` this process's CPU time
#: (all its threads), which other processes on a shared machine inflate much less (they
#: still compete for the caches and memory bandwidth). ``configure_clock`` sets it.
clock = time.perf_counter
CHUNK = 1000  # steps per compiled call of the baselines (the samplers' block_steps default)
NUTS_DEFAULT = (1000, 1000)  # pm.sample's default tune, draws


@dataclass
class Settings:
    """Hyperparameters of one problem, from its largest posterior curvature ``lam`` and the
    largest eigenvalue ``noise`` of the minibatch-force covariance at the posterior centre."""

    lam: float
    noise: float
    friction: float = 1.0

    @classmethod
    def of(cls, problem: Problem, cov_u: np.ndarray, centre: np.ndarray) -> Settings:
        """The settings of ``problem`` from its reference's covariance (unconstrained space)
        and centre, as :func:`problems.reference` returns them."""
        return cls(problem.curvature(cov_u), problem.noise_scale(centre))

    @property
    def eps(self) -> float:
        """SGLD-type step size (Welling & Teh convention: theta += eps/2 F + sqrt(eps) R).

        SGLD's stationary variance along an eigendirection is about
        (1 + eps * noise / 4) / (lam (1 - eps * lam / 4)): eps = 0.2 / (lam + noise) keeps the
        inflation near 5 %, inside the 10 % criterion."""
        return 0.2 / (self.lam + self.noise)

    @property
    def h(self) -> float:
        """Step size of the momentum samplers."""
        return 0.1 / np.sqrt(self.lam)


@dataclass
class Config:
    quick: bool
    problems: list[str]
    samplers: list[str]
    thin: int
    budget_s: float
    max_steps: int
    seed: int
    cold: str
    nuts_p4: bool
    baselines: list[str]
    nuts_references: bool
    p4_short: tuple[int, int]
    nuts: tuple[int, int]
    clock: str = "wall"
    #: "float32": our samplers on the model built in float32, the NumPy and BlackJAX
    #: baselines on float32 data and state (NUTS keeps PyMC's default float64).
    dtype: str = "float64"


@dataclass
class Result:
    """One row of the results: a method on a problem."""

    problem: str
    method: str
    group: str  # "ours", "ours-thin1", "numpy", "blackjax", "nuts", "nutpie"
    settings: str
    first_draw_s: float | None = None
    steps_per_s: float | None = None
    run_steps: int = 0
    run_s: float | None = None
    result_s: float | None = None
    result_steps: int | None = None
    mean_err: float | None = None
    var_err: float | None = None
    note: str = ""
    compile_cold_s: float | None = None
    compile_warm_s: float | None = None


# ---------------------------------------------------------------------- accuracy
def moment_errors(draws: np.ndarray, ref: Reference) -> tuple[float, float]:
    """RMS over coordinates of |mean - ref| / ref sd and of |var / ref var - 1|."""
    mean_err = np.sqrt(np.mean(((draws.mean(0) - ref.mean) / np.sqrt(ref.var)) ** 2))
    var_err = np.sqrt(np.mean((draws.var(0) / ref.var - 1.0) ** 2))
    return float(mean_err), float(var_err)


def time_to_result(
    draws: np.ndarray, times: np.ndarray, ref: Reference, discard_half: bool = True
) -> tuple[int | None, float, float]:
    """First checkpoint (number of draws) from which the criterion holds to the end of the run.

    ``times[k]`` is when draw k was available. At each of ``CHECKPOINTS`` evenly spaced draw
    counts k the estimate uses draws[k // 2 : k] (burn-in: the first half), or draws[:k]
    when ``discard_half`` is False (NUTS after tuning). Returns (k or None, final errors).
    """
    n = len(draws)
    counts = np.unique(np.linspace(n / CHECKPOINTS, n, CHECKPOINTS).astype(int))
    counts = counts[counts >= 4]
    ok = []
    for k in counts:
        window = draws[k // 2 : k] if discard_half else draws[:k]
        mean_err, var_err = moment_errors(window, ref)
        ok.append(mean_err <= MEAN_TOL and var_err <= VAR_TOL)
    final = moment_errors(draws[n // 2 :] if discard_half else draws, ref)
    if not ok or not ok[-1]:
        return None, *final
    first = len(ok) - 1
    while first > 0 and ok[first - 1]:
        first -= 1
    return int(counts[first]), *final


def fill_result(
    res: Result,
    draws: np.ndarray,
    times: np.ndarray,
    ref: Reference,
    steps_per_draw: int,
    offset: float,
    discard_half: bool = True,
) -> None:
    """Time to result (``offset`` + time of the checkpoint draw) and final errors."""
    k, res.mean_err, res.var_err = time_to_result(draws, times, ref, discard_half)
    if k is not None:
        res.result_steps = k * steps_per_draw
        res.result_s = offset + float(times[k - 1])


def steady_rate(times: np.ndarray, block_draws: int, steps_per_draw: int) -> float:
    """Steps/s after the first two blocks: draws 2 block_draws .. end were computed and served
    between the serving of draw 2 block_draws - 1 and of the last draw. The first block
    includes compilation and pm.sample's set-up; the second starts with the one-off check of a
    user-given step size against the curvature (``SGMCMC._check_user_step_size``, which
    compiles its Hessian-vector product: ~0.3 s, ten blocks' worth on P1)."""
    first = min(2 * block_draws, len(times) // 2) - 1
    if first < 0 or times[-1] <= times[first]:
        return len(times) * steps_per_draw / times[-1]
    return (len(times) - 1 - first) * steps_per_draw / (times[-1] - times[first])


# ---------------------------------------------------------------------- our samplers
def configure_clock(name: str) -> None:
    """``"wall"`` (default) or ``"cpu"`` (process CPU time) for every timing of the suite."""
    global clock
    clock = time.process_time if name == "cpu" else time.perf_counter


def block_draws(step, thin: int) -> int:
    """Stored draws per compiled block of ``step`` at this ``thin`` (the first block's draws
    include compilation and pm.sample's set-up; the steady rate starts after them)."""
    return max(1, step.block_steps // thin)


def make_step(name: str, s: Settings, thin: int):
    """One of the project's samplers; SGLD/mSGLD take eps, the others h and A."""
    import pymc_sgmcmc as sg

    name, options = VARIANTS.get(name, (name, {}))
    if name == "SGLD":
        return sg.SGLD(step_size=s.eps, thin=thin)
    if name == "mSGLD":
        return sg.MSGLD(step_size=s.eps, thin=thin)
    cls = {"SGHMC": sg.SGHMC, "SGNHT": sg.SGNHT, "CCAdL": sg.CCAdL}
    cls |= {"mCCAdL": sg.MCCAdL, "NOGIN": sg.NOGIN}
    return cls[name](step_size=s.h, friction=s.friction, thin=thin, **options)


def describe(name: str, s: Settings) -> str:
    if name in ("SGLD", "mSGLD", "NumPy SGLD", "BlackJAX SGLD"):
        return f"eps={s.eps:.2g}"
    if name in VARIANTS:
        options = VARIANTS[name][1]
        if "averaging" not in options:
            return f"h={s.h:.2g}, A={s.friction:g}, noise_minibatch={options['noise_minibatch']}"
        return (
            f"h={s.h:.2g}, A={s.friction:g}, averaging={options['averaging']:g} "
            f"every {options['averaging_interval']} steps"
        )
    return f"h={s.h:.2g}, A={s.friction:g}"


def sample_kwargs(problem: Problem, seed: int, times: list) -> dict:
    def record(trace, draw):
        times.append(clock())

    init = {"gamma": 1.0, "mu": 0.0} if problem.kind == "normal_gamma" else None
    init = init or {"w": problem.initial_point()}
    return dict(
        tune=0,
        chains=1,
        progressbar=False,
        compute_convergence_checks=False,
        random_seed=seed,
        callback=record,
        initvals=init,
    )


def first_draw(
    problem: Problem, name: str, s: Settings, thin: int, seed: int, dtype: str = "float64"
):
    """Build the step and draw once; returns (seconds, step, model). The clock starts after
    the imports, as a user's script imports the package before it builds a step: importing
    ``pymc_sgmcmc`` (which imports PyTensor's numba backend) took 0.6-0.8 s on a slow host."""
    import pymc as pm

    import pymc_sgmcmc  # noqa: F401

    times: list[float] = []
    model = problem.model(dtype=dtype)
    with model:
        start = clock()
        step = make_step(name, s, thin)
        pm.sample(draws=1, step=step, **sample_kwargs(problem, seed, times))
    return times[0] - start, step, model


def run_ours(problem: Problem, ref: Reference, name: str, s: Settings, cfg: Config) -> Result:
    """First draw, a one-block calibration run, then a run of about ``budget_s`` seconds."""
    import pymc as pm

    res = Result(problem.key, name, "ours", describe(name, s))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res.first_draw_s, step, model = first_draw(problem, name, s, cfg.thin, cfg.seed, cfg.dtype)
        # Three blocks: the rate of the third excludes the one-off work (see steady_rate).
        times: list[float] = []
        with model:
            pm.sample(
                draws=3 * block_draws(step, cfg.thin), step=step, **sample_kwargs(problem, 1, times)
            )
        rate = steady_rate(np.asarray(times), block_draws(step, cfg.thin), cfg.thin)
        steps = int(min(cfg.max_steps, max(rate * cfg.budget_s, 2 * CHUNK)))
        times.clear()
        with model, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            start = clock()
            idata = pm.sample(
                draws=steps // cfg.thin, step=step, **sample_kwargs(problem, cfg.seed, times)
            )
    t = np.asarray(times) - start
    res.run_steps, res.run_s = (steps // cfg.thin) * cfg.thin, float(t[-1])
    res.steps_per_s = steady_rate(t, block_draws(step, cfg.thin), cfg.thin)
    fill_result(res, problem.draws_from_idata(idata), t, ref, cfg.thin, res.first_draw_s)
    divergent = int(idata.sample_stats["diverging"].values.sum())
    notes = [f"{divergent} divergent draws"] if divergent else []
    res.note = "; ".join(notes + sampler_warnings(caught, type(step).__name__))
    return res


def sampler_warnings(caught: list, sampler: str) -> list[str]:
    """The timed run's warnings from the sampler (its messages start with its class name),
    each cut to its first clause: a run whose draws the sampler says are off is labelled."""
    notes = []
    for w in caught:
        text = str(w.message)
        if text.startswith(f"{sampler}: "):
            clause = re.split(r"[:;(]", text[len(sampler) + 2 :])[0].strip().rstrip(",.")
            notes.append(f"warned: {clause}")
    return list(dict.fromkeys(notes))


def run_sgld_thin1(problem: Problem, s: Settings, cfg: Config) -> Result:
    """SGLD with every step stored through PyMC's trace: steps/s only."""
    import pymc as pm

    res = Result(problem.key, "SGLD (thin=1)", "ours-thin1", describe("SGLD", s))
    res.first_draw_s, step, model = first_draw(problem, "SGLD", s, 1, cfg.seed, cfg.dtype)
    steps = int(min(cfg.max_steps, 50 * CHUNK if not cfg.quick else 5 * CHUNK))
    times: list[float] = []
    with model:
        start = clock()
        pm.sample(draws=steps, step=step, **sample_kwargs(problem, cfg.seed, times))
    t = np.asarray(times) - start
    res.run_steps, res.run_s = steps, float(t[-1])
    res.steps_per_s = steady_rate(t, block_draws(step, 1), 1)
    return res


def first_draw_subprocess(
    key: str, name: str, s: Settings, compiledir: str, dtype: str = "float64"
) -> float:
    """Time to first draw in a fresh process whose compile caches are in ``compiledir``
    (:func:`compile_caches.compile_cache_env`)."""
    arguments = [__file__, "--first-draw", key, name, str(s.lam), str(s.noise), dtype]
    return float(child_result(arguments, env=compile_cache_env(compiledir))["seconds"])


def compile_times(key: str, name: str, s: Settings, dtype: str) -> tuple[float, float]:
    """(cold, warm): empty compile caches, then the same ones again."""
    with tempfile.TemporaryDirectory() as tmp:
        cold = first_draw_subprocess(key, name, s, tmp, dtype)
        warm = first_draw_subprocess(key, name, s, tmp, dtype)
    return cold, warm


# ---------------------------------------------------------------------- baselines
def run_numpy_sgld(problem: Problem, ref: Reference, s: Settings, cfg: Config) -> Result:
    """Hand-written SGLD: theta += eps/2 F + sqrt(eps) R, batches with replacement."""
    res = Result(problem.key, "NumPy SGLD", "numpy", describe("SGLD", s))
    rng = np.random.default_rng(cfg.seed)
    problem = problem.astype(cfg.dtype)
    theta = problem.initial_point().astype(cfg.dtype)
    n_obs, n, dim, eps = problem.n_obs, problem.batch_size, problem.dim, float(s.eps)
    draws, times = [], []
    start = clock()
    steps = 0
    while steps < 3 * CHUNK or (steps < cfg.max_steps and times[-1] < cfg.budget_s):
        for i in range(CHUNK):
            force = problem.numpy_force(theta, rng.integers(0, n_obs, n))
            noise = rng.standard_normal(dim, dtype=cfg.dtype)
            theta = theta + 0.5 * eps * force + np.sqrt(eps) * noise
            if (i + 1) % cfg.thin == 0:
                draws.append(theta)
        steps += CHUNK
        times += [clock() - start] * (CHUNK // cfg.thin)
    t = np.asarray(times)
    res.first_draw_s, res.run_steps, res.run_s = float(t[0]), steps, float(t[-1])
    res.steps_per_s = steady_rate(t, CHUNK // cfg.thin, cfg.thin)
    fill_result(res, problem.to_reported(np.asarray(draws)), t, ref, cfg.thin, 0.0)
    return res


def bench_extra_missing(*modules: str) -> str | None:
    """None if the named modules of the ``bench`` extra import, else the reason."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            return f"{err.name} not installed (pip install -e '.[bench]')"
    return None


def run_blackjax(problem: Problem, ref: Reference, algo: str, s: Settings, cfg: Config) -> Result:
    """BlackJAX SGLD or SGNHT in a jitted ``lax.scan`` of CHUNK steps, called repeatedly.

    BlackJAX's SGLD step_size is eps/2 of the Welling & Teh convention; its SGNHT is the Euler
    scheme of Ding et al. with (step_size, alpha) = (h, A) and thermostat mass D, the same
    scheme as ``SGNHT(splitting="euler")`` (ours defaults to the symmetric BADODAB).
    """
    import jax

    # BlackJAX promotes a float32 position to float64 when JAX's 64-bit mode is on (its noise
    # is scaled by a float64 array): float32 runs turn the mode off.
    jax.config.update("jax_enable_x64", cfg.dtype == "float64")
    import blackjax
    import jax.numpy as jnp
    from blackjax.sgmcmc.gradients import grad_estimator

    name = f"BlackJAX {algo}"
    res = Result(problem.key, name, "blackjax", describe(name, s))
    problem = problem.astype(cfg.dtype)
    log_prior, log_lik = problem.jax_densities()
    grad_fn = grad_estimator(log_prior, log_lik, problem.n_obs)
    n_obs, n, thin = problem.n_obs, problem.batch_size, cfg.thin
    if algo == "SGLD":
        alg, step_size = blackjax.sgld(grad_fn), float(s.eps / 2)
    else:
        alg, step_size = blackjax.sgnht(grad_fn, alpha=s.friction), float(s.h)

    def position(state):
        return state if algo == "SGLD" else state.position

    def one_step(data, state, key):
        k_idx, k_step = jax.random.split(key)
        idx = jax.random.randint(k_idx, (n,), 0, n_obs)
        batch = jax.tree.map(lambda a: a[idx], data)
        state = alg.step(k_step, state, batch, step_size)
        return state, position(state)

    @jax.jit
    def run_chunk(state, key, data):
        keys = jax.random.split(key, CHUNK)
        state, pos = jax.lax.scan(lambda st, k: one_step(data, st, k), state, keys)
        return state, pos[thin - 1 :: thin]

    # The data are arguments, not closed-over constants: XLA would embed them in the program.
    data = jax.tree.map(jnp.asarray, problem.jax_data())
    key = jax.random.key(cfg.seed)
    start = clock()
    theta0 = jnp.asarray(problem.initial_point(), dtype=cfg.dtype)
    key, sub = jax.random.split(key)
    state = alg.init(theta0) if algo == "SGLD" else alg.init(theta0, sub)
    # Concrete leaves of the run's type (SGNHT's xi starts as a Python float): no retrace
    # after chunk 1.
    state = jax.tree.map(lambda v: jnp.asarray(v, dtype=cfg.dtype), state)
    draws, times = [], []
    steps = 0
    while steps < 3 * CHUNK or (steps < cfg.max_steps and times[-1] < cfg.budget_s):
        key, sub = jax.random.split(key)
        state, pos = run_chunk(state, sub, data)
        draws.append(np.asarray(pos))  # blocks until the chunk is done
        steps += CHUNK
        times += [clock() - start] * (CHUNK // thin)
    t = np.asarray(times)
    res.first_draw_s, res.run_steps, res.run_s = float(t[0]), steps, float(t[-1])
    res.steps_per_s = steady_rate(t, CHUNK // thin, thin)
    fill_result(res, problem.to_reported(np.concatenate(draws)), t, ref, thin, 0.0)
    res.note = "first draw = jit compile + first 1,000-step chunk"
    return res


def nuts_timed(problem: Problem, tune: int, draws: int, seed: int):
    """PyMC's own NUTS (``nuts_sampler="pymc"``) on the full data (one chain); wall time of
    every draw (tuning draws included) from the ``pm.sample`` call, recorded by a callback."""
    import pymc as pm

    times: list[float] = []

    def record(trace, draw):
        times.append(clock())

    with problem.model(minibatch=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = clock()
        idata = pm.sample(
            draws=draws,
            tune=tune,
            chains=1,
            random_seed=seed,
            progressbar=False,
            compute_convergence_checks=False,
            callback=record,
            nuts_sampler="pymc",
            discard_tuned_samples=False,  # the tuning draws' leapfrog steps, as nutpie's
        )
    return idata, np.asarray(times) - start, leapfrog_steps(idata)


def leapfrog_steps(idata) -> np.ndarray:
    """Leapfrog steps of chain 0's tuning draws, then of its draws."""
    groups = ("warmup_sample_stats", "sample_stats")
    return np.concatenate([idata[g]["n_steps"].values[0] for g in groups])


def nutpie_timed(problem: Problem, tune: int, draws: int, seed: int):
    """nutpie, which ``pm.sample`` runs for a NUTS-only model when it is installed, on the full
    data (one chain), with the calls and arguments ``pm.sample(nuts_sampler="nutpie")`` makes
    (``compile_pymc_model`` with the numba backend, then ``sample``).

    nutpie reports no time per draw, so draw k is placed at the compile time plus the sampling
    time in proportion to the leapfrog steps up to it (tuning included): on the full data a
    gradient costs the same everywhere, and nutpie's per-draw overhead is microseconds."""
    import nutpie

    model = problem.model(minibatch=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = clock()
        compiled = nutpie.compile_pymc_model(model, backend="numba")
        compiled_at = clock() - start
        idata = nutpie.sample(
            compiled,
            draws=draws,
            tune=tune,
            chains=1,
            cores=1,
            seed=seed,
            save_warmup=True,
            progress_bar=False,
        )
        total = clock() - start
    leapfrog = leapfrog_steps(idata)
    done = np.cumsum(leapfrog) / leapfrog.sum()
    return idata, compiled_at + (total - compiled_at) * done, leapfrog


#: The full-data NUTS baselines, by ``Result.group`` and ``--baselines`` name: PyMC's own NUTS,
#: and nutpie, which is PyMC's default NUTS where it is installed: (label, timed run).
NUTS_BASELINES = {
    "nuts": ("PyMC NUTS", nuts_timed),
    "nutpie": ("nutpie NUTS", nutpie_timed),
}


def run_nuts(
    problem: Problem, ref: Reference, tune: int, draws: int, seed: int, sampler: str = "nuts"
) -> Result:
    """NUTS timed to a result like the SG samplers (all post-tuning draws, no burn-in cut)."""
    label, timed = NUTS_BASELINES[sampler]
    res = Result(problem.key, label, sampler, f"tune={tune}, draws={draws}, 1 chain")
    idata, t, leapfrog_all = timed(problem, tune, draws, seed)
    res.first_draw_s, res.run_s = float(t[0]), float(t[-1])
    sampled = t[tune:]
    res.steps_per_s = (len(sampled) - 1) / (sampled[-1] - sampled[0])
    leapfrog = leapfrog_all[tune:]
    res.run_steps = int(leapfrog.sum())  # leapfrog steps after tuning
    res.note = f"draws/s in the steps/s column; {leapfrog.mean():.1f} leapfrog steps/draw"
    if sampler == "nutpie":
        res.note += "; draw times from leapfrog counts (nutpie_timed)"
    # Checkpoint k of the post-tuning draws is available at sampled[k - 1].
    fill_result(res, problem.draws_from_idata(idata), sampled, ref, 1, 0.0, discard_half=False)
    if res.result_steps is not None:
        res.note += f"; {res.result_steps} draws after tuning needed"
    return res


def run_nuts_projected(
    problem: Problem, ref: Reference, tune: int, draws: int, seed: int, sampler: str = "nuts"
) -> Result:
    """A short NUTS run, and from it a projection of ``pm.sample``'s default run.

    Projected time = time to first draw + 1,000 tuning draws at this run's cost per tuning
    draw + the draws the criterion needs at this run's cost per draw. Draws needed =
    200 / (ESS per draw): a variance estimate has relative error sqrt(2 / ESS) for a Gaussian
    posterior, 10 % at ESS = 200 (the mean criterion needs ESS = 100); ESS/draw is the median
    bulk ESS over coordinates of this run, capped at 1.
    """
    import arviz as az

    label, timed = NUTS_BASELINES[sampler]
    res = Result(problem.key, f"{label} (projected)", sampler, "")
    idata, t, leapfrog = timed(problem, tune, draws, seed)
    tune_cost = (t[tune - 1] - t[0]) / (tune - 1)
    draw_cost = (t[-1] - t[tune - 1]) / draws
    x = problem.draws_from_idata(idata)
    ess_per_draw = min(1.0, float(np.median(az.ess(x[None], method="bulk"))) / draws)
    needed = int(np.ceil(200 / ess_per_draw))
    res.first_draw_s, res.run_s = float(t[0]), float(t[-1])
    res.steps_per_s = 1.0 / draw_cost
    res.run_steps = int(leapfrog[tune:].sum())
    res.result_steps = needed
    res.result_s = float(t[0] + NUTS_DEFAULT[0] * tune_cost + needed * draw_cost)
    res.mean_err, res.var_err = moment_errors(x, ref)
    res.settings = f"measured: tune={tune}, draws={draws}, 1 chain"
    res.note = (
        f"PROJECTED, not run: {tune_cost:.2f} s per tuning draw x {NUTS_DEFAULT[0]} + "
        f"{needed} draws (ESS/draw {ess_per_draw:.2f}) x {draw_cost:.2f} s; "
        f"{leapfrog[:tune].mean():.1f} / {leapfrog[tune:].mean():.1f} leapfrog steps per "
        "tuning draw / draw; final errors are those of the short run; --nuts-p4 runs "
        "pm.sample's default"
    )
    return res


# ---------------------------------------------------------------------- machine
# ---------------------------------------------------------------------- orchestration
def compare(a: Reference, b: Reference) -> tuple[float, float]:
    """Moment errors of ``a`` measured against ``b`` (as for draws)."""
    mean_err = np.sqrt(np.mean(((a.mean - b.mean) / np.sqrt(b.var)) ** 2))
    return float(mean_err), float(np.sqrt(np.mean((a.var / b.var - 1.0) ** 2)))


def wants_compile_times(cfg: Config, problem_index: int, name: str) -> bool:
    """Cold/warm compile (fresh processes) for every sampler on the first problem and for
    SGLD on the others ("first"), everywhere ("all") or nowhere ("none")."""
    if cfg.cold == "all":
        return True
    return cfg.cold == "first" and (problem_index == 0 or name == "SGLD")


def bench_problem(key: str, index: int, cfg: Config) -> tuple[list[Result], dict]:
    """All methods on one problem."""
    problem = make_problem(key)
    ref, cov_u, centre, laplace = reference(problem, allow_nuts=cfg.nuts_references)
    s = Settings.of(problem, cov_u, centre)
    info = {
        "title": problem.title,
        "size": f"N = {problem.n_obs:,}, D = {problem.dim}, n = {problem.batch_size}",
        "reference": ref.source,
        "settings": (
            f"lambda_max = {s.lam:.4g}, largest gradient-noise eigenvalue {s.noise:.4g}: "
            f"eps = 0.2 / (lambda + noise) = {s.eps:.3g}; h = 0.1 / sqrt(lambda) = {s.h:.3g}, A = 1"
        ),
    }
    if laplace is not None and laplace is not ref:
        info["laplace_check"] = "Laplace vs reference: mean err {:.3f}, var err {:.3f}".format(
            *compare(laplace, ref)
        )
    print(f"\n== {problem.title}: {info['size']}; reference: {ref.source}", flush=True)
    print(f"   {info['settings']}", flush=True)
    rows: list[Result] = []

    def add(res: Result) -> None:
        rows.append(res)
        print("   " + console_row(res), flush=True)

    for name in cfg.samplers:
        res = run_ours(problem, ref, name, s, cfg)
        if wants_compile_times(cfg, index, name):
            res.compile_cold_s, res.compile_warm_s = compile_times(key, name, s, cfg.dtype)
        add(res)
    if "SGLD" in cfg.samplers:
        add(run_sgld_thin1(problem, s, cfg))
    if "numpy" in cfg.baselines:
        add(run_numpy_sgld(problem, ref, s, cfg))
    missing = bench_extra_missing("blackjax", "jax")
    if "blackjax" in cfg.baselines and missing is None:
        for algo in ("SGLD", "SGNHT"):
            add(run_blackjax(problem, ref, algo, s, cfg))
    elif "blackjax" in cfg.baselines:
        info["blackjax"] = f"BlackJAX baselines skipped: {missing}"
        print("   " + info["blackjax"], flush=True)
    for sampler in NUTS_BASELINES:
        if sampler not in cfg.baselines:
            continue
        if sampler == "nutpie" and (no_nutpie := bench_extra_missing("nutpie")) is not None:
            info["nutpie"] = f"nutpie baseline skipped: {no_nutpie}"
            print("   " + info["nutpie"], flush=True)
        elif key == "P4" and not cfg.nuts_p4:
            add(run_nuts_projected(problem, ref, *cfg.p4_short, seed=cfg.seed, sampler=sampler))
        else:
            add(run_nuts(problem, ref, *cfg.nuts, seed=cfg.seed, sampler=sampler))
    return rows, info


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def console_row(r: Result) -> str:
    result = "not reached" if r.result_s is None else f"{r.result_s:.1f} s"
    if r.group == "ours-thin1":
        result = "-"
    return (
        f"{r.method:<22} first draw {fmt(r.first_draw_s, '.1f')} s, "
        f"{fmt(r.steps_per_s, ',.0f')} steps/s, result {result}, "
        f"err {fmt(r.mean_err, '.3f')}/{fmt(r.var_err, '.3f')} {r.note}"
    )


def by_method(rows: list[Result]) -> dict[str, Result]:
    return {r.method: r for r in rows}


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def default_nuts(rows: list[Result]) -> Result | None:
    """The NUTS row ``pm.sample`` would run by default: nutpie's where it ran (PyMC's default
    NUTS when nutpie is installed), else PyMC's own."""
    by_group = {r.group: r for r in rows if r.group in NUTS_BASELINES}
    return by_group.get("nutpie", by_group.get("nuts"))


def problem_table(rows: list[Result]) -> list[str]:
    nuts = default_nuts(rows)
    lines = [
        "| method | settings | first draw (s) | compile cold / warm (s) | steps/s | "
        "time to result (s) | steps to result | default NUTS time / this | run (steps, s) | "
        "final mean / var err | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        compile_ = (
            "-" if r.compile_cold_s is None else f"{r.compile_cold_s:.1f} / {r.compile_warm_s:.1f}"
        )
        if r.result_s is None and r.group not in ("ours-thin1",):
            result = "not reached"
        else:
            result = fmt(r.result_s, ".1f")
        lines.append(
            f"| {r.method} | {r.settings} | {fmt(r.first_draw_s, '.1f')} | {compile_} | "
            f"{fmt(r.steps_per_s, ',.0f')} | {result} | {fmt(r.result_steps, ',')} | "
            f"{ratio(nuts.result_s if nuts else None, r.result_s)} | "
            f"{r.run_steps:,}, {fmt(r.run_s, '.1f')} | "
            f"{fmt(r.mean_err, '.3f')} / {fmt(r.var_err, '.3f')} | {r.note} |"
        )
    return lines


def ratio_table(all_rows: dict[str, list[Result]]) -> list[str]:
    lines = [
        "| problem | SGLD / BlackJAX SGLD | SGNHT / BlackJAX SGNHT | SGLD / NumPy SGLD | "
        "SGLD thin=1 / BlackJAX SGLD | SGLD time to result / BlackJAX SGLD's | "
        "PyMC NUTS time to result / fastest of ours (which) | nutpie's / fastest of ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, rows in all_rows.items():
        m = by_method(rows)

        def rate(name: str, m=m) -> float | None:
            return m[name].steps_per_s if name in m else None

        def ttr(name: str, m=m) -> float | None:
            return m[name].result_s if name in m else None

        ours = [r for r in rows if r.group == "ours" and r.result_s is not None]
        best = min(ours, key=lambda r: r.result_s) if ours else None

        def against_best(group: str, rows=rows, best=best) -> str:
            nuts = next((r for r in rows if r.group == group), None)
            if best is None or nuts is None or nuts.result_s is None:
                return "-"
            return f"{nuts.result_s / best.result_s:.2f} ({best.method})"

        lines.append(
            f"| {key} | {ratio(rate('SGLD'), rate('BlackJAX SGLD'))} | "
            f"{ratio(rate('SGNHT'), rate('BlackJAX SGNHT'))} | "
            f"{ratio(rate('SGLD'), rate('NumPy SGLD'))} | "
            f"{ratio(rate('SGLD (thin=1)'), rate('BlackJAX SGLD'))} | "
            f"{ratio(ttr('SGLD'), ttr('BlackJAX SGLD'))} | {against_best('nuts')} | "
            f"{against_best('nutpie')} |"
        )
    return lines


def busy_note(header: dict, cores: int) -> str:
    """Flags a run whose load average exceeded the core count: its timings are inflated. The
    averages that cover the run are the 1-minute one before it and all three after it (the 5-
    and 15-minute ones before it describe what ran earlier)."""
    before = [float(x) for x in header["load_before"].split(", ")][:1]
    after = [float(x) for x in header["load_after"].split(", ")]
    loads = before + after
    if max(loads) <= cores:
        return "- the machine was quiet (load average at most the core count)"
    return (
        f"- **the machine was busy (load average up to {max(loads):.1f} on {cores} cores): "
        "absolute timings are inflated and noisy; ratios measured close together are more "
        "robust than absolute numbers**"
    )


def write_report(cfg: Config, all_rows, infos, header: dict, path: Path) -> None:
    v, mach = header["versions"], header["machine"]
    lines = [
        "# Benchmark suite results (`make bench-suite`)",
        "",
        f"- date: {header['date']}; command: `{header['command']}`"
        + (
            " (**--quick smoke run: budgets too short for trustworthy numbers**)"
            if cfg.quick
            else ""
        ),
        f"- machine: {mach['cpu']}, {mach['cores']} cores, {mach['platform']}",
        f"- load average (1, 5, 15 min): before {header['load_before']}; "
        f"after {header['load_after']}",
        busy_note(header, int(mach["cores"])),
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- threads: {header['threads']}",
        f"- per method: a run of about {cfg.budget_s:g} s (at most {cfg.max_steps:,} steps), "
        f"thin = {cfg.thin}, one chain, seed {cfg.seed}",
        f"- precision: {cfg.dtype}"
        + (
            " (our samplers on the model built in float32; NumPy and BlackJAX baselines on "
            "float32 data and state; NUTS in PyMC's default float64)"
            if cfg.dtype == "float32"
            else ""
        ),
        "- clock: "
        + (
            "**CPU time of the benchmark process** (all its threads; every time in the tables "
            "is CPU seconds, which other processes on the machine inflate much less than wall "
            "time)"
            if cfg.clock == "cpu"
            else "wall time"
        ),
        "",
        "How to read: **steps/s** is steady state (after the first two blocks of 1,000 steps, "
        "every stored draw through PyMC's trace; NUTS: draws/s after tuning). **first draw** = "
        "step construction + `pm.sample` call to the first draw in this process (the package "
        "imported before the clock starts, as in a user's script), with the compile "
        "cache as found (JAX: jit compile + first 1,000-step chunk). **compile cold / warm** = "
        "the same in a fresh process with an empty PyTensor compile directory and an empty numba "
        "cache directory, then again with the ones it filled. **time to result** = first draw "
        "+ wall time until the draws "
        f"estimate the posterior means within {MEAN_TOL} posterior sd and the variances within "
        f"{VAR_TOL:.0%} (root mean square over coordinates), checked at {CHECKPOINTS} "
        "checkpoints on the second half of the draws so far (NUTS: all draws after tuning) and "
        "holding at every later checkpoint; 'not reached' = not within the run (the final "
        "errors column says how far). All chains start at the model's initial point.",
        "",
        "## Ratios (steps/s unless stated)",
        "",
        *ratio_table(all_rows),
        "",
    ]
    for key, rows in all_rows.items():
        info = infos[key]
        lines += [f"## {info['title']} ({info['size']})", ""]
        lines += [f"- reference: {info['reference']}", f"- step sizes: {info['settings']}"]
        lines += [f"- {info[k]}" for k in ("laplace_check", "blackjax", "nutpie") if k in info]
        lines += ["", *problem_table(rows), ""]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str]) -> tuple[Config, Path | None]:
    p = script_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="fast smoke run (short budgets)")
    p.add_argument("--problems", nargs="+", default=None, choices=PROBLEMS)
    p.add_argument("--samplers", nargs="+", default=None, choices=[*SAMPLERS, *VARIANTS])
    p.add_argument("--budget", type=float, default=None, help="seconds per sampling run")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--thin", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cold", choices=("none", "first", "all"), default=None)
    p.add_argument("--nuts-p4", action="store_true", help="run NUTS's default on P4 (~20+ min)")
    p.add_argument(
        "--baselines",
        nargs="*",
        default=["numpy", "blackjax", "nuts", "nutpie"],
        choices=["numpy", "blackjax", "nuts", "nutpie"],
        help="baselines to run (none: only our samplers)",
    )
    p.add_argument(
        "--no-nuts-references",
        action="store_true",
        help="logistic problems without a stored NUTS reference use the Laplace approximation "
        "instead of computing one (a few minutes each on a quiet machine)",
    )
    p.add_argument(
        "--p4-short",
        nargs=2,
        type=int,
        default=None,
        metavar=("TUNE", "DRAWS"),
        help="the short NUTS run behind P4's projection (default 50 50; --quick 10 10)",
    )
    p.add_argument("--output", type=Path, default=None, help="markdown file to write")
    p.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default="float64",
        help="float32: our samplers on the model built in float32 and the NumPy and BlackJAX "
        "baselines in float32 (NUTS stays float64)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time with the wall clock or this process's CPU time (steadier on a busy machine)",
    )
    a = p.parse_args(argv)
    quick = a.quick
    return Config(
        quick=quick,
        problems=a.problems or (["P1", "P2", "P3"] if quick else list(PROBLEMS)),
        samplers=a.samplers or (["SGLD", "SGNHT"] if quick else list(SAMPLERS)),
        thin=a.thin,
        budget_s=a.budget or (2.0 if quick else 20.0),
        max_steps=a.max_steps or (20_000 if quick else 1_000_000),
        seed=a.seed,
        cold=a.cold or ("none" if quick else "first"),
        nuts_p4=a.nuts_p4,
        baselines=a.baselines,
        nuts_references=not (quick or a.no_nuts_references),
        p4_short=tuple(a.p4_short) if a.p4_short else ((10, 10) if quick else (50, 50)),
        nuts=(200, 200) if quick else NUTS_DEFAULT,
        clock=a.clock,
        dtype=a.dtype,
    ), a.output


def quiet_pymc() -> None:
    """PyMC logs a few lines per pm.sample call: hundreds in this suite."""
    logging.getLogger("pymc").setLevel(logging.ERROR)


def main(argv: list[str]) -> None:
    cfg, output = parse_args(argv)
    configure_clock(cfg.clock)
    quiet_pymc()
    header = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": " ".join(["benchmarks/suite.py", *argv]),
        "machine": machine(),
        "versions": versions(),
        "load_before": load_average(),
        "threads": ", ".join(
            f"{v}={os.environ.get(v)}"
            for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "XLA_FLAGS")
        ),
    }
    print(f"load average before: {header['load_before']}", flush=True)
    all_rows, infos = {}, {}
    for index, key in enumerate(cfg.problems):
        all_rows[key], infos[key] = bench_problem(key, index, cfg)
    header["load_after"] = load_average()
    print(f"load average after: {header['load_after']}", flush=True)
    default = "suite_results_quick" if cfg.quick else "suite_results"
    path = output or HERE / f"{default}.md"
    write_report(cfg, all_rows, infos, header, path)
    raw = {
        "header": header,
        "config": asdict(cfg),
        "problems": infos,
        "results": {k: [asdict(r) for r in rows] for k, rows in all_rows.items()},
    }
    path.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    print("\n".join(ratio_table(all_rows)))
    print(f"wrote {path} and {path.with_suffix('.json')}")


def first_draw_main(key: str, name: str, lam: str, noise: str, dtype: str) -> None:
    """Child process of ``compile_times``: prints {"seconds": time to first draw}."""
    quiet_pymc()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        settings = Settings(float(lam), float(noise))
        seconds, _, _ = first_draw(make_problem(key), name, settings, 10, 0, dtype)
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--first-draw":
        first_draw_main(*sys.argv[2:])
    else:
        main(sys.argv[1:])
