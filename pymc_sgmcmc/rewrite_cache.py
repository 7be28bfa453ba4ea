"""Rewritten graphs kept on disk, so that a function compiled again skips PyTensor's rewrites.

PyTensor rewrites a function's graph every time the function is compiled, even when numba's
cache then loads the machine code: a sampler's block graph took 1.1 s (SGLD) and 2.1 s
(NOGIN) of rewriting on P1, its host-side helpers 0.5 s more, more than half of a warm first
draw (3.0 and 4.1 s on a slow host, 2026-12-03). :func:`caching_rewrites` gives a mode whose
functions keep their rewritten graph in PyTensor's compile directory
(:func:`rewrite_cache_dir`), under a key of

- a description of the graph before rewriting (``_describe_graph``): the function's
  inputs by position and type -- shared variables too, so a data set's values are never part
  of it -- and its nodes in topological order, each op by its class and ``__props__``, a scan
  by what ``Scan.__eq__`` compares, constants by type, data and name (``_describe``);
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
import dataclasses
import hashlib
import importlib.metadata
import inspect
import os
import pickle
import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import BuiltinFunctionType, FunctionType

import numpy as np
import pytensor
from pymc.model import modelcontext
from pymc.pytensorf import collect_default_updates
from pymc.pytensorf import compile as compile_pymc
from pytensor.compile import optdb
from pytensor.compile.maker import FunctionMaker
from pytensor.compile.mode import Mode, get_mode
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.fg import FrozenFunctionGraph, FunctionGraph
from pytensor.graph.rewriting.db import RewriteDatabase, RewriteDatabaseQuery
from pytensor.graph.traversal import io_toposort
from pytensor.scalar.basic import ScalarOp
from pytensor.scan.op import Scan

__all__ = ["CachingRewritesMode", "caching_rewrites", "compile_pymc_function", "rewrite_cache_dir"]

#: Bumped when the stored form changes.
_FORMAT = "2"

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
def _source_hash(obj: type | FunctionType) -> str:
    """The source of a class or function from outside the versioned packages (a user's own
    op): an edited ``infer_shape`` would change the rewrites without changing the graph's
    description. One whose source cannot be read (defined in ``python -c``) raises, and its
    graphs are not kept."""
    module = (getattr(obj, "__module__", None) or "").split(".")[0]
    if module in _VERSIONED or isinstance(obj, BuiltinFunctionType) or module == "builtins":
        return ""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


class _Unkeyable(Exception):
    """A part of a graph with no description stable across processes: the function is
    compiled as before, without the cache."""


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _describe(obj):
    """``obj`` as nested tuples of strings, numbers, bytes and None, whose ``repr`` is the
    same in every process for equal values and different for values PyTensor tells apart.

    What PyTensor compares a graph's parts by: an op by its class and ``__props__`` (ops with
    equal props are merged by the rewrites), a scalar op without props by what its ``__eq__``
    compares, a scan by what ``Scan.__eq__`` compares, a type by its props, a constant by its
    type, data and name. Never an object's identity: the pickle of a graph this key used to
    be depended on it (a reference to an object met before, a full copy for an equal one),
    and PyTensor interns graph nodes process-wide, so which of the two a graph held depended
    on what the process had compiled before (311 of 690 graphs of the test suite got a new
    key in a second run). Nor an object's ``__dict__``, which also holds what compiling it
    cached on it."""
    if obj is None or isinstance(obj, bool | int | float | complex | str | bytes):
        return obj
    if isinstance(obj, np.ndarray | np.generic):
        if obj.dtype.hasobject:  # its bytes are the elements' addresses
            if obj.dtype != object:
                raise _Unkeyable(f"structured dtype {obj.dtype} holding objects")
            return ("objects", np.shape(obj), *map(_describe, np.ravel(obj)))
        digest = hashlib.sha256(np.ascontiguousarray(obj)).digest()
        return ("array", obj.dtype.str, np.shape(obj), digest)
    if isinstance(obj, np.dtype):
        return ("dtype", obj.str)
    if isinstance(obj, tuple | list):
        return (type(obj).__name__, *map(_describe, obj))
    if isinstance(obj, Mapping):
        items = ((_describe(k), _describe(v)) for k, v in obj.items())
        return ("mapping", *sorted(items, key=repr))
    if isinstance(obj, set | frozenset):
        return ("set", *sorted(map(_describe, obj), key=repr))
    if isinstance(obj, slice):
        return ("slice", _describe(obj.start), _describe(obj.stop), _describe(obj.step))
    if isinstance(obj, Constant):
        return ("constant", _describe(obj.type), _describe(obj.data), obj.name)
    if isinstance(obj, FunctionGraph | FrozenFunctionGraph):
        return _describe_graph(obj.inputs, obj.outputs)
    if isinstance(obj, Scan):
        attrs = ("info", "profile", "truncate_gradient", "name", "allow_gc", "fgraph", "mode")
        return ("scan", *(_describe(getattr(obj, a)) for a in attrs))
    if isinstance(obj, Mode):
        text = repr(obj)
        if " at 0x" in text:  # named by its address: no description stable across runs
            raise _Unkeyable(text)
        return ("mode", text)
    cls = type(obj)
    if getattr(cls, "__props__", None) is not None:
        props = (_describe(getattr(obj, p)) for p in cls.__props__)
        return ("props", _qualified(cls), _source_hash(cls), *props)
    if isinstance(obj, ScalarOp):  # ScalarOp.__eq__: the class and the output types' rule
        preference = _describe(getattr(obj, "output_types_preference", None))
        return ("scalar_op", _qualified(cls), _source_hash(cls), preference)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = (_describe(getattr(obj, f.name)) for f in dataclasses.fields(obj))
        return ("dataclass", _qualified(cls), *fields)
    if isinstance(obj, type | FunctionType | BuiltinFunctionType):
        return ("global", obj.__module__, obj.__qualname__, _source_hash(obj))
    raise _Unkeyable(_qualified(cls))


def _describe_graph(inputs, outputs) -> tuple:
    """A graph by its structure: its inputs by position and type, its nodes in topological
    order, each by its op, where its inputs come from and its outputs' types."""
    origins: dict[int, tuple] = {id(v): ("input", k) for k, v in enumerate(inputs)}

    def origin(var: Variable) -> tuple:
        if id(var) in origins:
            return origins[id(var)]
        if isinstance(var, Constant):
            return _describe(var)
        raise _Unkeyable(f"orphan {var}")

    nodes = []
    for j, node in enumerate(io_toposort(inputs, outputs)):
        sources = tuple(origin(v) for v in node.inputs)
        types = tuple(_describe(o.type) for o in node.outputs)
        nodes.append((_describe(node.op), sources, types))
        origins.update((id(o), ("node", j, k)) for k, o in enumerate(node.outputs))
    signature = tuple(_describe(v.type) for v in inputs)
    return ("graph", signature, tuple(nodes), tuple(origin(o) for o in outputs))


def _graph_key(inputs: list[Variable], outputs: list[Variable], mode: Mode) -> str | None:
    settings = _settings_fingerprint(mode)
    if settings is None:
        return None
    try:
        graph = repr(_describe_graph(inputs, outputs))
    except Exception:  # _Unkeyable, an unreadable class source, a very deep graph
        return None
    return hashlib.sha256(f"{settings}\n{graph}".encode()).hexdigest()


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


def _store(path: Path, fgraph: FunctionGraph) -> bool:
    """Keep ``fgraph`` at ``path``; whether it was kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.NamedTemporaryFile(dir=path.parent, delete=False)
    except OSError:  # no writable compile directory: nothing is kept
        return False
    try:
        with tmp:
            _InputsByPosition(tmp, list(fgraph.inputs)).dump(list(fgraph.outputs))
        os.replace(tmp.name, path)  # atomic: a reader sees the whole file or none
    except Exception:  # a graph that does not pickle is rewritten again next time
        with contextlib.suppress(OSError):
            os.unlink(tmp.name)
        return False
    return True


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
            loaded = _load(path, in_vars, out_vars)
            if loaded is not None:
                self._init_loaded(loaded, specs, outputs, mode, *args, **kwargs)
                return
        super().__init__(inputs, outputs, mode, *args, **kwargs)
        if path is not None and _store(path, self.fgraph):
            # Then made again from what was kept, as every later process makes it: a graph
            # loaded from the file can list independent nodes in another order than the
            # rewritten one did, and numba's cache key of a function graph follows that
            # order (PyTensor's ``numba_funcify_FunctionGraph``), so the process that
            # rewrote a graph cached its code under a key no later process looked up (the
            # second run of NOGIN on a D = 3 regression compiled 43 functions again: 16 s
            # instead of 5 s on the AMD host).
            loaded = _load(path, in_vars, out_vars)
            if loaded is not None:
                self._init_loaded(loaded, specs, outputs, mode, *args, **kwargs)

    def _init_loaded(self, fgraph: FunctionGraph, specs, outputs, mode, *args, **kwargs):
        """Make the function from a kept rewritten graph, ``fgraph`` (``FunctionMaker``'s own
        set-up, with the rewrites skipped; after a rewrite it replaces that set-up)."""
        # In-place ops are in the stored graph by design: PyTensor attaches the
        # DestroyHandler that orders them after every reader of what they overwrite.
        kwargs.update(fgraph=fgraph, no_fgraph_prep=True, accept_inplace=True)
        super().__init__(specs, outputs, mode, *args, **kwargs)


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
