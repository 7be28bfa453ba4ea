"""Rewritten graphs kept on disk (``pymc_sgmcmc.rewrite_cache``): a function compiled again,
in another process, skips PyTensor's rewrites and computes exactly what the function whose
graph was rewritten computed; a changed graph is rewritten afresh, a data set's values are
never stored, and a sampler's graphs are found again whatever the process compiled before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytensor.tensor as pt

from pymc_sgmcmc.rewrite_cache import _describe, _graph_key, caching_rewrites

_COUNT_REWRITES = """
import json, sys
import numpy as np, pytensor, pytensor.tensor as pt
from pymc_sgmcmc import rewrite_cache
from pymc_sgmcmc.rewrite_cache import caching_rewrites, rewrite_cache_dir

rewritten = []  # the rewrites of graphs the cache is asked for
maker = rewrite_cache._RewriteCachingMaker
prepare = maker.prepare_fgraph
def counted(*args, **kwargs):
    rewritten.append(1)
    return prepare(*args, **kwargs)
maker.prepare_fgraph = staticmethod(counted)
"""

_RUN = (
    _COUNT_REWRITES
    + """
scale = float(sys.argv[1])
x = pt.vector("x", shape=(4,))
data = pytensor.shared(np.linspace(-1.0, 1.0, 200_000).reshape(50_000, 4), name="data")
# Rewritten into something else: a stable log-sum-exp, log(exp(x)) -> x, fused elementwise
# ops, and (compiled) one that overwrites z in place after two reductions have read it.
z = (data[:5] @ x) * scale
outputs = [pt.log(pt.exp(z).sum()) + pt.log(pt.exp(x)).sum(), pt.exp(z) * z.sum()]
runs = {}
for mode in ["NUMBA", "FAST_COMPILE"]:
    rewritten.clear()
    fn = pytensor.function([x], outputs, mode=caching_rewrites(mode))
    runs[mode] = {
        "rewritten": len(rewritten),
        "values": [np.asarray(v).tolist() for v in fn(np.linspace(0.1, 0.4, 4))],
        "in_place": any(node.op.destroy_map for node in fn.maker.fgraph.apply_nodes),
    }
stored = sorted(rewrite_cache_dir().iterdir())
runs["files"] = [p.name for p in stored]
runs["largest"] = max(p.stat().st_size for p in stored)
print(json.dumps(runs))
"""
)


_COUNT_COMPILES = """
import numba.core.event
compiled = []  # the functions numba compiles (none when it loads them from its cache)
class Listener(numba.core.event.Listener):
    def on_start(self, event):
        pass
    def on_end(self, event):
        compiled.append(getattr(event.data["dispatcher"].py_func, "__qualname__", "?"))
numba.core.event.register("numba:compile", Listener())
"""

_SAMPLE = (
    _COUNT_REWRITES
    + _COUNT_COMPILES
    + """
import pymc as pm
from models import GaussianRegression
from pymc_sgmcmc import NOGIN
with GaussianRegression.make(n_obs=2000, dim=3, batch_size=100).model():
    idata = pm.sample(
        draws=10, tune=10, chains=1, step=NOGIN(), random_seed=3,
        progressbar=False, compute_convergence_checks=False,
    )
print(json.dumps({
    "rewritten": len(rewritten),
    "compiled": compiled,
    "files": sorted(p.name for p in rewrite_cache_dir().iterdir()),
    "draws": idata.posterior["w"].values.ravel().tolist(),
}))
"""
)


_CHANGED_NUMBERS = (
    _COUNT_REWRITES
    + _COUNT_COMPILES
    + """
import arviz as az
import pymc as pm
from models import GaussianRegression
from pymc_sgmcmc import SGLD

problem = GaussianRegression.make(
    n_obs=int(sys.argv[2]), dim=3, batch_size=int(sys.argv[3]), prior_sd=float(sys.argv[1])
)
with problem.model():
    idata = pm.sample(
        draws=300, tune=300, chains=1, step=SGLD(), random_seed=3,
        progressbar=False, compute_convergence_checks=False,
    )
print(json.dumps({
    "rewritten": len(rewritten),
    "compiled": compiled,
    "mean": idata.posterior["w"].values[0].mean(axis=0).tolist(),
    "sd": idata.posterior["w"].values[0].std(axis=0, ddof=1).tolist(),
    "ess": [float(e) for e in az.ess(idata, var_names=["w"])["w"].values],
    "exact_mean": problem.mean.tolist(),
    "exact_sd": np.sqrt(np.diag(problem.cov)).tolist(),
}))
"""
)


def _run(compiledir, script: str, *args: str) -> dict:
    flags = ",".join(
        f for f in [os.environ.get("PYTENSOR_FLAGS", ""), f"base_compiledir={compiledir}"] if f
    )
    env = {
        **os.environ,
        "PYTENSOR_FLAGS": flags,
        "NUMBA_CACHE_DIR": str(compiledir / "nb"),
        # tests/models.py for the sampler's run
        "PYTHONPATH": os.pathsep.join(
            p for p in [str(Path(__file__).parent), os.environ.get("PYTHONPATH")] if p
        ),
    }
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_graph_compiled_again_in_another_process_is_not_rewritten_again(tmp_path):
    # Compiled (numba) and PyTensor's Python mode (the helpers run once per chain).
    modes = ["NUMBA", "FAST_COMPILE"]
    first = _run(tmp_path, _RUN, "1.0")
    assert [first[m]["rewritten"] for m in modes] == [1, 1]
    assert len(first["files"]) == 2
    # The 1.6 MB data set is an input, not part of the stored graphs.
    assert first["largest"] < 100_000
    # The compiled graph holds an in-place op, which must run after the reductions that read
    # what it overwrites: PyTensor orders it so again when the graph is loaded (its
    # DestroyHandler); otherwise the values below would differ.
    assert first["NUMBA"]["in_place"]

    again = _run(tmp_path, _RUN, "1.0")
    assert again["files"] == first["files"]
    for mode in modes:
        assert again[mode]["rewritten"] == 0
        assert again[mode]["values"] == first[mode]["values"]  # bit for bit
        assert again[mode]["in_place"] == first[mode]["in_place"]

    # A changed constant is another graph: rewritten and stored under a key of its own.
    changed = _run(tmp_path, _RUN, "2.0")
    assert [changed[m]["rewritten"] for m in modes] == [1, 1]
    assert len(changed["files"]) == 4
    assert all(changed[m]["values"] != first[m]["values"] for m in modes)


def test_a_samplers_graphs_are_found_again_by_a_process_that_compiled_nothing_before(tmp_path):
    # The first process rewrites every graph after compiling others, the second loads each
    # one first thing: PyTensor interns graph nodes process-wide, so the two build their
    # graphs from differently shared objects, which must not change a key (a key that did
    # missed 1 of these 7 graphs, and 311 of 690 in the test suite).
    first = _run(tmp_path, _SAMPLE)
    assert first["rewritten"] == len(first["files"]) > 3
    again = _run(tmp_path, _SAMPLE)
    assert again["rewritten"] == 0
    assert again["files"] == first["files"]
    assert again["draws"] == first["draws"]
    # ... and numba's code for them too: the first process compiles the graphs as it kept
    # them, so that numba caches each under the key the second looks up (NOGIN's block listed
    # two independent nodes in the other order, and the second process compiled 40 functions
    # again). Left: PyTensor's look-ups of the BLAS and LAPACK routines, which numba never
    # caches.
    assert first["compiled"]
    assert [f for f in again["compiled"] if not _is_pointer_lookup(f)] == []


def _is_pointer_lookup(qualname: str) -> bool:
    return qualname.split(".")[-1].startswith("get_") and qualname.endswith("_pointer")


def _object_array(last: int) -> np.ndarray:
    values = np.empty(2, dtype=object)
    values[:] = [[1, last], "x"]  # a new list each time, at a new address
    return values


def test_keys_follow_values_not_objects():
    def graph(last: float):
        x = pt.vector("x", shape=(3,))
        return [x], [pt.exp(x) * pt.constant(np.array([1.0, 2.0, last]))]

    mode = caching_rewrites("NUMBA")
    assert _graph_key(*graph(3.0), mode) == _graph_key(*graph(3.0), mode)  # built apart
    assert _graph_key(*graph(3.0), mode) != _graph_key(*graph(4.0), mode)
    # An object array's bytes are its elements' addresses: it is described by its elements.
    described = [repr(_describe(_object_array(last))) for last in (2, 2, 3)]
    assert described[0] == described[1] != described[2]


def _second_run_compiles_nothing(tmp_path, first_args, second_args) -> tuple[dict, dict]:
    """Two runs of the same model with other numbers in fresh processes sharing one compile
    directory: the first compiles, the second neither rewrites a graph nor compiles."""
    first = _run(tmp_path, _CHANGED_NUMBERS, *first_args)
    assert first["rewritten"] > 3 and first["compiled"]
    second = _run(tmp_path, _CHANGED_NUMBERS, *second_args)
    assert second["rewritten"] == 0
    assert second["compiled"] == []
    return first, second


def _means_near_the_exact_posterior(run: dict) -> np.ndarray:
    """The exact posterior sds of ``run``, whose draws' mean is within 0.5 of them of the
    exact mean in every coordinate."""
    sd = np.array(run["exact_sd"])
    error = np.abs(np.subtract(run["mean"], run["exact_mean"]))
    assert np.all(error < 0.5 * sd), (error / sd, run["ess"])
    return sd


def _spread_near_the_exact_posterior(run: dict) -> np.ndarray:
    """:func:`_means_near_the_exact_posterior`, and the draws' sds within 30 % of the exact
    ones in every coordinate."""
    sd = _means_near_the_exact_posterior(run)
    ratio = np.array(run["sd"]) / sd
    assert np.all(np.abs(ratio - 1) < 0.3), (ratio, run["ess"])
    return sd


def test_a_model_that_differs_only_in_its_priors_numbers_compiles_nothing_again(tmp_path):
    # A prior's scale changed between two runs, from 10.0 (PyTensor types it float32) to 0.0078
    # (float64): the prior's numbers are inputs of the compiled graphs, in the model's
    # precision (``model_layer.share_parameters``), so the second run neither rewrites a graph
    # nor has numba compile a function. Before, it rewrote the 6 graphs and numba compiled the
    # blocks again (5 s of P1's first draw).
    first, changed = _second_run_compiles_nothing(
        tmp_path, ("10.0", "2000", "100"), ("0.0078", "2000", "100")
    )
    # ... and its draws follow the new numbers, not the compiled ones: the new prior moves the
    # exact posterior mean 165 of its sds (in the first coordinate) from the first model's.
    # 300 draws of SGLD's default, ESS 98-199 per coordinate (Monte Carlo standard error
    # under 0.11 posterior sd): within 0.5 sd of the exact mean in each, about 5 standard
    # errors, which leaves room for SGLD's discretisation bias (measured: 0.03-0.05 sd).
    sd = _means_near_the_exact_posterior(changed)
    shift = np.abs(np.subtract(changed["exact_mean"], first["exact_mean"]))
    assert shift[0] > 100 * sd[0]


def test_a_model_on_another_number_of_rows_compiles_nothing_again(tmp_path):
    # The same model on 2,000 rows, then on 200: the N/n factor of the minibatch likelihood
    # is an input of the compiled graphs (``model_layer.SGModel._size_factor``), so the second
    # run neither rewrites a graph nor has numba compile a function. Before, N was a constant of
    # the graphs and the blocks were compiled again (4.5 s of P1's first draw).
    first, changed = _second_run_compiles_nothing(
        tmp_path, ("10.0", "2000", "100"), ("10.0", "200", "100")
    )
    # ... and its draws are those of the posterior of 200 rows, whose sds are about 3.2 times
    # those of 2,000 rows: a factor left at 2,000 / 100 would draw them 3.2 times too narrow
    # around a mean 10 times too confident. 300 draws of SGLD's default (ESS about 100-200,
    # the test above): the mean within 0.5 posterior sd in each coordinate and the sds within
    # 30 % (the sd of a variance estimate from 100 independent draws is 14 %).
    sd = _spread_near_the_exact_posterior(changed)
    assert np.all(sd > 2.5 * np.array(first["exact_sd"]))


def test_a_model_with_another_batch_size_compiles_nothing_again(tmp_path):
    # The same model on minibatches of 100 rows, then of 40: the minibatch's row indices are
    # an input of open length and its N/n factor an input, so the second run neither
    # rewrites a graph nor has numba compile a function. Before, the batch size was the
    # static length of the indices: the graphs were rewritten again and part of the blocks
    # compiled again (mCCAdL on this model: 39 functions, 12.2 s against 2.6 s).
    _, changed = _second_run_compiles_nothing(
        tmp_path, ("10.0", "2000", "100"), ("10.0", "2000", "40")
    )
    # ... and its draws are the posterior's: N/n = 50 scales the 40 rows' likelihood; the
    # factor of 100 rows (20) would draw sds 1.6 times the posterior's. Tolerances as above.
    _spread_near_the_exact_posterior(changed)
