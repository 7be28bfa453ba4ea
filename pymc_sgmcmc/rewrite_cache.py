"""Rewritten graphs kept on disk, so that a function compiled again skips PyTensor's rewrites.

PyTensor rewrites a function's graph every time the function is compiled, even when numba's
cache then loads the machine code: a sampler's block graph took 1.1 s (SGLD) and 2.1 s
(NOGIN) of rewriting on P1, its host-side helpers 0.5 s more, more than half of a warm first
draw (3.0 and 4.1 s on a slow host, 2026-12-03). :func:`caching_rewrites` gives a mode whose
functions keep their rewritten graph in PyTensor's compile directory
(:func:`rewrite_cache_dir`), under a key of

- the graph before rewriting, pickled in PyTensor's structural form (``FrozenFunctionGraph``:
  the function's inputs by position and type -- shared variables too, so a data set's values
  are never part of it), each op by its class and ``__props__`` and a scan by what
  ``Scan.__eq__`` compares (``_StructurePickler``), constants by type, data and name;
- what decides the rewrites: the mode's rewrite query and linker, every rewrite registered
  in PyTensor's database, PyTensor's configuration (its C-key options and the rewriting
  flags), and the versions of PyTensor, PyMC, NumPy and numba and this package's source.

A later compilation of the same graph, in this process or another, loads the rewritten graph
with the function's own input variables in place of the stored ones and hands it to
PyTensor's ``FunctionMaker`` as prepared (``no_fgraph_prep``, as ``Function.copy`` does);
PyTensor attaches again the ``DestroyHandler`` that runs each in-place op after the ops that
read what it overwrites. Anything that cannot be keyed, stored or loaded -- an op that does
not pickle, a graph with updates, a damaged file -- just compiles as before.

Step construction to the first draw on P1 with warm caches, old and new code run together on
that host (three pairs): SGLD 2.5-2.8 s -> 1.3-1.4 s, NOGIN 3.6-4.3 s -> 1.3-1.5 s, the same
draws bit for bit (``docs/performance.md``, "Rewritten graphs kept").
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import inspect
import io
import os
import pickle
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import pytensor
from pymc.model import modelcontext
from pymc.pytensorf import collect_default_updates
from pymc.pytensorf import compile as compile_pymc
from pytensor.compile import optdb
from pytensor.compile.maker import FunctionMaker
from pytensor.compile.mode import Mode, get_mode
from pytensor.graph.basic import Constant, NominalVariable, Variable
from pytensor.graph.fg import FrozenFunctionGraph, FunctionGraph
from pytensor.graph.op import Op
from pytensor.graph.rewriting.db import RewriteDatabase, RewriteDatabaseQuery
from pytensor.scalar.basic import ScalarOp
from pytensor.scan.op import Scan

__all__ = ["CachingRewritesMode", "caching_rewrites", "compile_pymc_function", "rewrite_cache_dir"]

#: Bumped when the stored form changes.
_FORMAT = "1"

#: PyTensor flags that change what the rewrites do but are not in its C key.
_REWRITE_FLAGS = (
    "floatX",
    "cast_policy",
    "optimizer_excluding",
    "optimizer_including",
    "optimizer_requiring",
    "tensor__local_elemwise_fusion",
    "compute_test_value",
)


def rewrite_cache_dir() -> Path:
    """Where the rewritten graphs are kept: beside PyTensor's own compiled modules."""
    return Path(pytensor.config.compiledir) / "sgmcmc_rewrites"


#: The distributions whose versions are in the key (their rewrites and ops).
_VERSIONED_DISTRIBUTIONS = ("pytensor", "pymc", "numpy", "numba")


@cache
def _source_fingerprint() -> str:
    """The versions the rewrites come from, and this package's own source (its rewrites)."""
    digest = hashlib.sha256()
    for dist in _VERSIONED_DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            digest.update(f"{dist}={importlib.metadata.version(dist)};".encode())
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _registered_rewrites(db: RewriteDatabase) -> list[str]:
    names = []
    for name in sorted(db._names):
        names.append(name)
        inner = db.__db__.get(name)
        for obj in inner or ():
            if isinstance(obj, RewriteDatabase):
                names.extend(f"{name}.{n}" for n in _registered_rewrites(obj))
    return names


def _query_description(query) -> str | None:
    if not isinstance(query, RewriteDatabaseQuery):
        return None
    parts = [
        sorted(query.include),
        sorted(query.require),
        sorted(query.exclude),
        sorted((k, _query_description(v)) for k, v in query.subquery.items()),
        query.position_cutoff,
        [str(r) for r in query.extra_rewrites],
    ]
    text = repr(parts)
    # A rewriter object of the caller's own, named by its address: no key stable across runs.
    return None if " at 0x" in text else text


def _settings_fingerprint(mode: Mode) -> str | None:
    query = _query_description(mode.provided_optimizer)
    if query is None:
        return None
    config = pytensor.config
    flags = ";".join(f"{f}={getattr(config, f, None)}" for f in _REWRITE_FLAGS)
    return "\n".join(
        [
            _FORMAT,
            _source_fingerprint(),
            query,
            f"{type(mode.linker).__module__}.{type(mode.linker).__qualname__}",
            config.get_config_hash(),
            flags,
            ",".join(_registered_rewrites(optdb)),
        ]
    )


#: Packages whose code is in the key already (:func:`_source_fingerprint`).
_VERSIONED = (*_VERSIONED_DISTRIBUTIONS, __name__.split(".")[0])


@cache
def _class_source(cls: type) -> str:
    """The source of an op class from outside the versioned packages (a user's own op): an
    edited ``infer_shape`` would change the rewrites without changing the graph's pickle. A
    class whose source cannot be read (defined in ``python -c``) raises, and its graphs are
    not kept."""
    if cls.__module__.split(".")[0] in _VERSIONED:
        return ""
    return hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()


def _structure(*parts):
    """Stands for an object in the key's pickle (which is hashed, never loaded)."""
    raise NotImplementedError


class _StructurePickler(pickle.Pickler):
    """Pickles a graph by what PyTensor compares it by.

    Ops by their class and ``__props__`` (PyTensor's own notion of an op's identity: ops
    with equal props are merged by the rewrites) and a scan by what ``Scan.__eq__`` compares
    (its info, inner graph, mode and options), not by their ``__dict__``, which also holds
    what compiling them once cached on them (a first compilation in this process and a
    load from numba's cache left different state, and a different key, on the same
    elementwise op); constants by their type, data and name, not their serial name."""

    def reducer_override(self, obj):
        if isinstance(obj, Scan):
            attrs = ("info", "profile", "truncate_gradient", "name", "allow_gc", "fgraph")
            mode = obj.mode if isinstance(obj.mode, str | None) else repr(obj.mode)
            return _structure, (type(obj), *(getattr(obj, a) for a in attrs), mode)
        if isinstance(obj, Op | ScalarOp) and getattr(type(obj), "__props__", None) is not None:
            props = (getattr(obj, p) for p in type(obj).__props__)
            return _structure, (type(obj), _class_source(type(obj)), *props)
        if isinstance(obj, Constant) and not isinstance(obj, NominalVariable):
            data = obj.data
            if isinstance(data, np.ndarray | np.generic):
                data = (
                    data.dtype.str,
                    data.shape,
                    hashlib.sha256(np.ascontiguousarray(data)).digest(),
                )
            return _structure, (obj.type, data, obj.name)
        return NotImplemented


def _graph_key(inputs: list[Variable], outputs: list[Variable], mode: Mode) -> str | None:
    settings = _settings_fingerprint(mode)
    if settings is None:
        return None
    buffer = io.BytesIO()
    try:
        _StructurePickler(buffer, protocol=5).dump(FrozenFunctionGraph.from_io(inputs, outputs))
    except Exception:  # an orphan variable, an op that does not pickle
        return None
    return hashlib.sha256(settings.encode() + buffer.getvalue()).hexdigest()


class _InputsByPosition(pickle.Pickler):
    def __init__(self, file, inputs: list[Variable]):
        super().__init__(file, protocol=5)
        self._positions = {id(v): k for k, v in enumerate(inputs)}

    def persistent_id(self, obj):
        if isinstance(obj, Variable):
            return self._positions.get(id(obj))
        return None


class _InputsFromPosition(pickle.Unpickler):
    def __init__(self, file, inputs: list[Variable]):
        super().__init__(file)
        self._inputs = inputs

    def persistent_load(self, pid):
        return self._inputs[pid]


def _store(path: Path, fgraph: FunctionGraph) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.NamedTemporaryFile(dir=path.parent, delete=False)
    except OSError:  # no writable compile directory: nothing is kept
        return
    try:
        with tmp:
            _InputsByPosition(tmp, list(fgraph.inputs)).dump(list(fgraph.outputs))
        os.replace(tmp.name, path)  # atomic: a reader sees the whole file or none
    except Exception:  # a graph that does not pickle is rewritten again next time
        with contextlib.suppress(OSError):
            os.unlink(tmp.name)


def _load(path: Path, inputs: list[Variable], outputs: list[Variable]) -> FunctionGraph | None:
    try:
        with path.open("rb") as f:
            rewritten = _InputsFromPosition(f, inputs).load()
    except Exception:  # none yet, damaged, or written by code this key did not see
        return None
    if len(rewritten) != len(outputs) or any(
        r.type != o.type for r, o in zip(rewritten, outputs, strict=True)
    ):
        return None
    return FunctionGraph(inputs, rewritten, update_mapping={}, clone=False)


class _RewriteCachingMaker(FunctionMaker):
    """PyTensor's ``FunctionMaker``, which takes a stored rewritten graph where there is
    one and stores the one it rewrote where there was none."""

    def __init__(self, inputs, outputs, mode=None, *args, **kwargs):
        path = None
        if kwargs.get("fgraph") is None and not kwargs.get("no_fgraph_prep"):
            specs = [self.wrap_in(i) for i in inputs]
            in_vars = [s.variable for s in specs]
            outs = outputs if isinstance(outputs, list | tuple) else [outputs]
            out_vars = [getattr(o, "variable", o) for o in outs]
            if outputs is not None and not any(s.update is not None for s in specs):
                key = _graph_key(in_vars, out_vars, get_mode(mode))
                path = rewrite_cache_dir() / f"{key}.pkl" if key else None
        if path is not None:
            fgraph = _load(path, in_vars, out_vars)
            if fgraph is not None:
                # In-place ops are in the stored graph by design: PyTensor attaches the
                # DestroyHandler that orders them after every reader of what they overwrite.
                kwargs.update(fgraph=fgraph, no_fgraph_prep=True, accept_inplace=True)
                super().__init__(specs, outputs, mode, *args, **kwargs)
                return
        super().__init__(inputs, outputs, mode, *args, **kwargs)
        if path is not None:
            _store(path, self.fgraph)


class CachingRewritesMode(Mode):
    """A PyTensor ``Mode`` whose functions keep and reuse their rewritten graphs."""

    @property
    def function_maker(self):
        return _RewriteCachingMaker


def caching_rewrites(mode: Mode | str | None) -> CachingRewritesMode:
    """``mode`` (a name, a ``Mode`` or None for the default) with its rewritten graphs kept."""
    resolved = get_mode(mode)
    if isinstance(resolved, CachingRewritesMode):
        return resolved
    return CachingRewritesMode(linker=resolved.linker, optimizer=resolved.provided_optimizer)


def compile_pymc_function(inputs, outputs, mode=None, **kwargs):
    """``pymc.pytensorf.compile(inputs, outputs, random_seed=False, mode=mode, **kwargs)``,
    keeping its rewritten graph.

    PyMC's ``compile`` builds a plain ``Mode`` of its own, so it is followed here: the same
    two rewrites included (``random_make_inplace``, and the model's ``check_bounds`` choice of
    turning parameter checks into -inf or removing them). A graph with random variables,
    whose generators PyMC's ``compile`` updates, is compiled by it unchanged."""
    in_vars = [getattr(i, "variable", i) for i in inputs]
    out_list = outputs if isinstance(outputs, list | tuple) else [outputs]
    out_vars = [getattr(o, "variable", o) for o in out_list]
    if collect_default_updates(inputs=in_vars, outputs=out_vars):
        return compile_pymc(inputs, outputs, random_seed=False, mode=mode, **kwargs)
    try:
        check_bounds = modelcontext(None).check_bounds
    except TypeError:  # no model on the context stack
        check_bounds = True
    check_parameters = (
        "local_check_parameter_to_ninf_switch" if check_bounds else "local_remove_check_parameter"
    )
    resolved = get_mode(mode)
    query = resolved.provided_optimizer.including("random_make_inplace", check_parameters)
    caching = CachingRewritesMode(linker=resolved.linker, optimizer=query)
    return pytensor.function(inputs, outputs, mode=caching, **kwargs)
