"""Parallel chains (``pm.sample(cores > 1)``) that hand their draws over in batches.

PyMC runs each chain in a worker process that hands every draw to the main process through a
pipe, then waits until the main process has taken it (``pymc.sampling.parallel``): one
round trip, two process wake-ups, per draw. An SG draw is cheap -- a few integrator steps,
served from a compiled block -- so the chains spent most of their time in that hand-over:
with ``thin=10`` two chains on two cores delivered 1.0-1.2x the draws per second of one
chain, with ``thin=1`` 0.55x.

Here a worker computes draws for up to ``BATCH_SECONDS`` (at most as many as fit in its
shared buffer, ``BATCH_BYTES``), then hands them over together; while the main process
records a batch, the workers compute the next. After tuning a worker takes the rest of each
compiled block at once (``SGMCMC.step_run``: arrays of draws and stats, not a ``step`` call
and a stats dict per draw), and the main process writes each batch into PyMC's NumPy traces
at once (:mod:`pymc_sgmcmc.recording`) instead of PyMC's loop recording it draw by draw.
That leaves more of the two cores to the workers: with two chains of P1 SGLD at ``thin=1``
the main process spent 6-8 µs of CPU per draw against 16-23 µs with PyMC's loop
(``benchmarks/engine_results_cores_batch_recording.md``). A ``callback`` passed to
``pm.sample`` takes every draw, so with one (or another trace backend) the draws go through
PyMC's loop one by one.
Only the hand-over changes: every chain runs the same step method from the same generator
as with ``cores=1``, so the draws and stats are the same. So are the warnings: PyMC's workers
let a step's ``warnings.warn`` go to the worker's own stderr (or, under a
``warnings.catch_warnings`` of the caller's inherited by a forked worker, nowhere), so the
divergence warning with its step-size hint and the end-of-tuning drift warning never reached
a ``cores=2`` caller. A worker here records them and hands them over with the batch, and the
main process issues them again, through the caller's warning filters.

This module's ``ParallelSampler`` takes the place of ``pymc.sampling.parallel.ParallelSampler``
and its ``_mp_sample`` (which hands it the traces) that of ``pymc.sampling.mcmc._mp_sample``
when ``pymc_sgmcmc`` is imported (``pm.sample`` looks both up there and offers no other
hook); for any step method but an SG sampler they run PyMC's own code, unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import multiprocessing
import time
import warnings
from typing import Any

import numpy as np
import pymc.sampling.mcmc as mcmc
import pymc.sampling.parallel as ps
from pymc.blocking import DictToArrayBijection
from pymc.progress_bar import MCMCProgressBarManager, default_progress_theme
from pymc.util import get_state_from_generator

from pymc_sgmcmc import recording
from pymc_sgmcmc.base import SGMCMC, stat_rows

__all__ = ["BATCH_BYTES", "BATCH_SECONDS", "ParallelSampler", "install"]

#: A worker hands over the draws it computed in about this time (at least one draw): short
#: enough for a live progress bar and a prompt interrupt, long enough that the round trip
#: costs little (a P1 SGLD draw at thin = 10 takes ~0.25 ms: ~200 draws per batch).
BATCH_SECONDS = 0.05
#: Upper bound on one chain's shared buffer of draws (the batch holds fewer draws of a large
#: model).
BATCH_BYTES = 16 * 2**20


def batch_capacity(point: dict[str, np.ndarray]) -> int:
    """Draws of ``point``'s size that fit in one chain's buffer of :data:`BATCH_BYTES`."""
    point_bytes = sum(np.asarray(value).nbytes for value in point.values())
    return max(1, BATCH_BYTES // max(point_bytes, 1))


class _BatchProcess(ps._Process):
    """A chain's worker: PyMC's, but handing over a batch of draws per round trip.

    Messages: ``("writing_done", first_draw, count, stats, warnings)`` once the batch is in
    the shared buffer (slot k holds draw ``first_draw + k``), answered by
    ``("write_next",)``. ``stats`` holds the batch's runs of draws in order: a list of
    per-draw stats (PyMC's form, from :meth:`~pymc_sgmcmc.base.SGMCMC.step`) or a dict of
    per-draw columns (from :meth:`~pymc_sgmcmc.base.SGMCMC.step_run`); ``warnings`` those
    the chain raised since the last batch (:func:`_portable`)."""

    def _start_loop(self):
        total = self._draws + self._tune  # _draws excludes tuning, as in PyMC's loop
        with _recorded_warnings() as caught:
            self._step_method.setup_chain(self._rng, self._tune, self._draws)
        msg = self._recv_msg()
        if msg[0] == "abort":
            raise KeyboardInterrupt()
        if msg[0] != "start":
            raise ValueError("Unexpected msg " + msg[0])

        capacity = next(iter(self._point.values())).shape[0]
        point = {name: np.array(values[0]) for name, values in self._point.items()}  # the start
        draw = 0
        while draw < total:
            with _recorded_warnings() as batch_warnings:
                point, runs, count = self._compute_batch(point, draw, total, capacity)
            caught += batch_warnings

            msg = self._recv_msg()
            if msg[0] == "abort":
                raise KeyboardInterrupt()
            if msg[0] != "write_next":
                raise ValueError("Unknown message " + msg[0])
            k = 0
            for points, _ in runs:
                n = len(next(iter(points.values())))
                for name, values in points.items():
                    self._point[name][k : k + n] = values
                k += n
            batch_stats = [stats for _, stats in runs]
            self._msg_pipe.send(("writing_done", draw, count, batch_stats, _portable(caught)))
            caught = []
            draw += count

    def _compute_batch(self, point, draw: int, total: int, capacity: int):
        """Draws from ``draw`` on, for up to :data:`BATCH_SECONDS` and at most ``capacity``
        draws: the last point, the runs of draws (each variable's draws, their stats) and
        the number of draws."""
        runs, count, started = [], 0, time.perf_counter()
        while draw + count < total and count < capacity:
            if draw + count == self._tune:
                self._step_method.stop_tuning()
            # A zarr trace records draw by draw here, so the draws come one by one too.
            run = None
            if not self._zarr_recording:
                left = min(capacity - count, total - draw - count)
                run = self._step_method.step_run(point, left)
            if run is None:
                point, draw_stats = self._step_method.step(point)
                if self._zarr_recording:
                    in_warmup = draw + count < self._tune
                    self._zarr_chain.record(point, draw_stats, in_warmup=in_warmup)
                run = point, {name: v[None] for name, v in point.items()}, [draw_stats]
            point, points, stats = run
            runs.append((points, stats))
            count += len(next(iter(points.values())))
            if time.perf_counter() - started >= BATCH_SECONDS:
                break
        return point, runs, count


@contextlib.contextmanager
def _recorded_warnings():
    """Every warning raised in the block, recorded instead of shown (the caller's filters
    apply when the main process issues them again)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _portable(caught: list) -> list[tuple]:
    """Recorded warnings as picklable tuples: (message, category, filename, line number)."""
    return [(str(w.message), w.category, w.filename, w.lineno) for w in caught]


def _issue(portable: list[tuple]) -> None:
    """Issue a worker's recorded warnings in this process, at their original location."""
    for message, category, filename, lineno in portable:
        warnings.warn_explicit(message, category, filename, lineno, registry=_REGISTRY)


#: The registry of :func:`_issue`: a message already shown from one location is shown once,
#: as ``warnings.warn`` does for a sequential run's chains.
_REGISTRY: dict = {}


def _per_draw_stats(runs: list) -> list[list[dict]]:
    """Each draw's stats in PyMC's form (a list with one dict) from a batch's runs."""
    stats = []
    for run in runs:
        stats += [[row] for row in stat_rows(run)] if isinstance(run, dict) else run
    return stats


def _run_batch_process(*args):
    _BatchProcess(*args).run()


class _BatchProcessAdapter(ps.ProcessAdapter):
    """PyMC's handle on a chain's process, with a shared buffer of :func:`batch_capacity`
    draws instead of one point, and :class:`_BatchProcess` as the worker (the step method is
    pickled for every start method but fork, as PyMC does)."""

    def __init__(
        self,
        draws: int,
        tune: int,
        step_method,
        step_method_pickled,
        chain: int,
        rng: np.random.Generator,
        start: dict[str, np.ndarray],
        blas_cores,
        mp_ctx,
        zarr_chains=None,
        zarr_chains_pickled=None,
    ):
        self.chain = chain
        self._msg_pipe, remote_conn = mp_ctx.Pipe()
        capacity = batch_capacity(start)
        self._shared_point, self._point = {}, {}
        for name, shape, size, dtype in DictToArrayBijection.map(start).point_map_info:
            byte_size = capacity * size * dtype.itemsize
            if byte_size != ctypes.c_size_t(byte_size).value:
                raise ValueError(f"Variable {name} is too large")
            array = mp_ctx.RawArray("c", byte_size)
            self._shared_point[name] = (array, (capacity, *shape), dtype)
            self._point[name] = np.frombuffer(array, dtype).reshape((capacity, *shape))
            self._point[name][0] = start[name]
        self._readable = True
        self._num_samples = 0

        zarr_send = zarr_chains_pickled if zarr_chains_pickled is not None else zarr_chains
        self._process = mp_ctx.Process(
            daemon=True,
            name=f"worker_chain_{chain}",
            target=_run_batch_process,
            args=(
                f"worker_chain_{chain}",
                remote_conn,
                step_method if step_method_pickled is None else step_method_pickled,
                step_method_pickled is not None,
                self._shared_point,
                draws,
                tune,
                get_state_from_generator(rng),
                blas_cores,
                chain,
                mp_ctx.get_start_method(),
                zarr_send,
                zarr_chains_pickled is not None,
            ),
        )
        self._process.start()
        remote_conn.close()  # so that a dead worker shows as a closed pipe

    @staticmethod
    def recv_batch(processes) -> tuple[_BatchProcessAdapter, int, int, list]:
        """The next batch of any of ``processes``: the chain, its first draw's index, the
        number of draws and their stats' runs (:class:`_BatchProcess`'s message; the draws
        are in the chain's shared buffer)."""
        ready = ps.multiprocessing.connection.wait([proc._msg_pipe for proc in processes])
        proc = next(p for p in processes if p._msg_pipe is ready[0])
        msg = ready[0].recv()
        if msg[0] == "error":
            raise ps.ParallelSamplingError(
                f"Chain {proc.chain} failed with: {msg[1]}", proc.chain
            ) from msg[1]
        if msg[0] != "writing_done":
            raise ValueError("Sampler sent bad message.")
        _, first, count, runs, caught = msg
        _issue(caught)
        proc._readable = True
        proc._num_samples += count
        return proc, first, count, runs


class ParallelSampler(ps.ParallelSampler):
    """PyMC's parallel sampler; for an SG step method the chains hand over their draws in
    batches (see the module docstring). Every other step method runs PyMC's own code."""

    def __init__(self, *, step_method, **kwargs: Any):
        self._batched = isinstance(step_method, SGMCMC)
        if not self._batched:
            super().__init__(step_method=step_method, **kwargs)
            return
        self._init_batched(step_method=step_method, **kwargs)

    def _init_batched(
        self,
        *,
        draws: int,
        tune: int,
        chains: int,
        cores: int,
        rngs,
        start_points,
        step_method,
        progressbar=True,
        progressbar_theme=default_progress_theme,
        blas_cores=None,
        mp_ctx=None,
        zarr_chains=None,
    ):
        # As PyMC's ParallelSampler.__init__, with the batch adapters.
        if any(len(arg) != chains for arg in [rngs, start_points]):
            raise ValueError(f"Number of rngs and start_points must be {chains}.")
        if mp_ctx is None or isinstance(mp_ctx, str):
            mp_ctx = ps._initialize_multiprocessing_context(mp_ctx)
        mp_ctx = _without_fork_under_jax(step_method, mp_ctx)
        step_pickled = zarr_pickled = None
        self.zarr_recording = zarr_chains is not None
        if mp_ctx.get_start_method() != "fork":
            step_pickled = ps.cloudpickle.dumps(step_method, protocol=-1)
            if zarr_chains is not None:
                zarr_pickled = ps.cloudpickle.dumps(zarr_chains, protocol=-1)
        self._tune, self._total = tune, draws + tune
        self._traces = _BATCH_TRACES.get()
        self._samplers = [
            _BatchProcessAdapter(
                draws,
                tune,
                step_method,
                step_pickled,
                chain,
                rng,
                start,
                blas_cores,
                mp_ctx,
                zarr_chains=zarr_chains if zarr_pickled is None else None,
                zarr_chains_pickled=zarr_pickled,
            )
            for chain, rng, start in zip(range(chains), rngs, start_points, strict=True)
        ]
        self._inactive = self._samplers.copy()
        self._finished = []
        self._active = []
        self._max_active = cores
        self._in_context = False
        self._progress = MCMCProgressBarManager(
            step_method=step_method,
            chains=chains,
            draws=draws,
            tune=tune,
            progressbar=progressbar,
            progressbar_theme=progressbar_theme,
        )

    def __iter__(self):
        if not self._batched:
            yield from super().__iter__()
            return
        if not self._in_context:
            raise ValueError("Use ParallelSampler as context manager.")
        self._make_active()
        with self._progress:
            for proc, first, count, points, runs in self._batches():
                chain_done = first + count == self._total
                recorded = self._traces is not None
                if recorded:
                    recording.record_batch(self._traces[proc.chain], points, runs)
                    # The bar advances draw by draw, showing the batch's last stats.
                    stats = [recording.last_stats(runs)] * count
                else:
                    stats = _per_draw_stats(runs)
                for k in range(count):
                    draw, is_last = first + k, chain_done and k == count - 1
                    tuning = draw < self._tune
                    self._progress.update(
                        chain_idx=proc.chain,
                        is_last=is_last,
                        draw=draw,
                        tuning=tuning,
                        stats=stats[k],
                    )
                    if recorded:
                        continue
                    # values[k, ...] keeps a scalar variable's draw a 0-d array, as PyMC's
                    # own hand-over does: a NumPy scalar broke the trace's compiled function
                    # for Deterministics (numba types a float64 scalar apart from arrays).
                    point = {name: values[k, ...] for name, values in points.items()}
                    yield ps.Draw(proc.chain, is_last, draw, tuning, stats[k], point)

    def _batches(self):
        """Each batch as it arrives: the chain's adapter, its first draw's index, the number
        of draws, each variable's draws (copied out of the shared buffer) and the stats'
        runs (:class:`_BatchProcess`'s message). A chain's worker computes its next batch
        while this one is recorded."""
        while self._active:
            proc, first, count, runs = _BatchProcessAdapter.recv_batch(self._active)
            # Copied out before the worker may overwrite the buffer with its next batch.
            points = {name: v[:count].copy() for name, v in proc.shared_point_view.items()}
            if first + count == self._total:
                proc.join()
                self._active.remove(proc)
                self._finished.append(proc)
                self._make_active()
            else:
                proc.write_next()
            yield proc, first, count, points, runs


def _without_fork_under_jax(step_method: SGMCMC, mp_ctx):
    """``mp_ctx``, or forkserver (spawn where there is none) in place of fork for a step that
    compiles with JAX: forking a process in which JAX has started its threads can deadlock,
    so PyMC starts its own JAX mode's workers without fork
    (``_initialize_multiprocessing_context``). ``pm.sample`` chooses the start method from its
    own backend before it looks at the step, so on Linux a JAX step's workers got fork."""
    jax_step = step_method.static_shapes  # only JAX needs static shapes
    if not (jax_step and mp_ctx.get_start_method() == "fork"):
        return mp_ctx
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


#: The traces that the running ``pm.sample`` call's :class:`ParallelSampler` records its
#: batches into itself (:func:`_mp_sample`); None where PyMC's loop records each draw.
_BATCH_TRACES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "batch_traces", default=None
)

_PYMC_MP_SAMPLE = mcmc._mp_sample


def _mp_sample(*, step, traces, callback=None, **kwargs):
    """PyMC's ``_mp_sample``, whose loop records each draw the sampler yields
    (``trace.record``); where :func:`~pymc_sgmcmc.recording.records_in_batches` holds,
    :class:`ParallelSampler` records each batch itself
    (:func:`~pymc_sgmcmc.recording.record_batch`) and yields nothing. The same draws and
    stats land in the same places."""
    batched = recording.records_in_batches(step, traces, callback)
    token = _BATCH_TRACES.set(traces if batched else None)
    try:
        return _PYMC_MP_SAMPLE(step=step, traces=traces, callback=callback, **kwargs)
    finally:
        _BATCH_TRACES.reset(token)


def install() -> None:
    """Make ``pm.sample(cores > 1)`` use this module's ``ParallelSampler`` and record its
    batches (idempotent)."""
    ps.ParallelSampler = ParallelSampler
    mcmc._mp_sample = _mp_sample
