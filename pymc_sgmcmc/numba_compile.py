"""Shorter numba compilations of the samplers' blocks.

numba compiles a block when it first runs it, and links every function a function calls into
the caller's code, where LLVM optimises and emits it again: each level of nesting compiles
all the code below it once more.

:func:`lean_cache_wrappers` (while a block's function is built): PyTensor wraps the numba
function of every op it can cache in a one-line function that numba caches under the op's
key, one more level per op. The wrappers of the *leaf* ops stay, so a changed model reuses
the compiled ops it shares with one compiled before; those of the ops that hold a whole
inner graph (the scan, its inner function graph, lazy branches) go, and the outermost
function graph is cached as itself under PyTensor's key for it, without a wrapper. P1 SGLD,
step construction to the first draw, three alternated runs each, with the lazy log-density
branch of :mod:`pymc_sgmcmc.base`: empty compile directory 16.4 s (15.7-17.2) -> 12.9 s
(12.7-13.1); after another model's blocks compiled (a changed prior scale) 9.7 s -> 7.6 s;
warm unchanged (1.1-1.3 s). A later set, the machine slower: 16.1 -> 14.5 s (medians),
9.6 -> 7.6 s, 1.3 -> 1.2 s. Without any wrapper the empty directory took 12.1 s but the
changed model 11.4 s: nothing below the top was reusable.

The functions of those ops -- the scan's loop, its step (the inner function graph), a lazy
branch and the graphs of its two sides -- are then inlined into their callers
(:func:`_inlined`: numba inlines their IR before typing them), so that each is no level of
its own whose linked code LLVM optimises and emits once more: a block is one function around
its leaf ops' and kernels'. Step construction to the first draw on P1 with every cache empty,
alternated on a host about twice as slow as the one above (2026-12-03): SGLD 19.1 / 20.1 s
against 21.2 / 23.0 s (warm unchanged, 2.4-2.5 s), mCCAdL 34.9 against 38.1 s, NOGIN 26.9
against 31.9 s, SGNHT 25.2 against 26.3 s, CCAdL 22.8 against 26.6 s; the same draws, and the
blocks' steps as fast. Numba cannot inline a call with more than 30 arguments
(:data:`_MAX_INLINED_ARGUMENTS`), so a scan and its step that take more (a model with a few
free variables, each prior's numbers an input of the loop; mCCAdL's block with
``covariance="full"``) take them as tuples of at most 30 (:func:`_with_packed_arguments`).

A leaf op's wrapper, too, no longer calls the op's function but inlines it
(:func:`_leaf_with_its_function_inlined`): the wrapper, cached under the op's key as before, is
the op's only compiled function. With PyTensor's wrapper numba compiled the op's function and
then the wrapper, whose linked copy of it LLVM optimised and emitted once more. Both processes
started together on the host's two cores, every cache empty (2026-12-03, the same slow host),
step construction to the first draw on P1: SGLD 0.7 s shorter on average (5 of 6 pairs),
NOGIN 1.3 s (0.2-3.3 s, 4 pairs), mCCAdL 2.6 s (2.3-3.0 s, 4 pairs) of 20-38 s; the same
draws, and the steps as fast.

PyTensor's numba ``scan`` ends with an epilogue that puts a circular buffer's rows in order
(for an output whose buffer holds fewer rows than the loop has steps) and cuts a ``while``
loop's outputs to the steps it ran. A block's traces have a buffer of exactly its (constant)
number of steps and the host reads only the steps it asked for, so for the block's scan (and
only there: :func:`_traces_fill_their_storage` checks it, nested loops keep theirs)
:func:`_scan_source` drops the epilogue, whose array slicing and ``np.concatenate`` numba
compiled for each trace: P1 SGLD, step construction to the first draw with every cache
empty, 11.37 / 11.34 s against 12.29 / 12.24 s (alternated, 2026-11-25). A lazy branch's
condition (a 0-d array) is read with ``item()`` (:func:`_funcify_lazy_ifelse`): numba's
``bool()`` of an array compiled its size check and a ``take`` for 0.3 s.

Every array assignment ``a[i] = b`` in the
compiled code -- PyTensor's ``scan`` stores each step's outputs that way -- carries the
formatting of a detailed shape-mismatch message (f-strings, ``str`` of integer tuples), and
compiling that formatting cost 3-4 s of a cold start (P1 SGLD, step construction to the first
draw with an empty compile directory: 20.4 / 19.7 s -> 15.7 / 17.1 s, alternated).
:func:`plain_assignment_errors` swaps in the plain message of numba's generic target while a
block is compiled. The blocks' shapes are static and checked when their graph is built, so
such an error would be an internal bug, not the user's: it needs no shapes in the message.

PyTensor's numba ``scan`` keeps each untraced state in a local variable that every iteration
rebinds to the step's output. A state enters the loop as a C-contiguous array, but the step
may return it with another numba type: a scalar computed from ``p . p`` (a thermostat, a
Lanczos coefficient) comes back as a 0-d strided view (layout "A"), and so do some vectors.
numba's type inference then unifies the variable's type (``C | A -> A``) and compiles the
whole step function again for the new argument types, once per state whose type changes.
:func:`lean_cache_wrappers` therefore passes every untraced state of a scan through
:func:`stable_state`, which gives it one type (a writable C-contiguous array; no copy unless
it is a non-contiguous view). The blocks of SGNHT, mSGLD, CCAdL and mCCAdL compiled their step
twice, mCCAdL's Lanczos loop its step four times; now once each. Step construction to the first
draw on P1 with every cache empty, alternated (2026-11-25 UTC): SGNHT 19.9-26.5 s against
22.8-28.4 s (faster in each of four pairs), mCCAdL 54.1-61.1 s against 57.3-67.2 s (three of
four pairs), the other samplers within the machine's drift. Since the step is inlined into
the loop (above), this matters for a step that takes too many arguments to inline.

PyTensor's last numba rewrites (``scalarize``, after the elementwise fusion) compute an
elementwise operation on length-1 vectors as one on scalars, and read each such vector as
``ScalarFromTensor(Squeeze(x))``. Where the vector was ``ExpandDims`` of a 0-d input (a
thermostat, a step size of the loop), a pair of views that undo each other is left in the
step: ``Squeeze(ExpandDims(x))``, three in the blocks of SGNHT and mCCAdL, each a numba call
per step, for which numba compiled five functions of their own (the ``Squeeze`` to 0-d, a
strided view's three, a ``ScalarFromTensor`` of the view's type).
:func:`drop_inverse_dimshuffles`, registered after those rewrites under :data:`TAG` and
included for numba (:func:`with_inverse_dimshuffles_dropped`), reads ``x`` itself. SGNHT
on P1, step construction to the first draw with every cache empty: 105 numba functions
compiled instead of 110, 17.1 / 17.5 / 15.5 s against 17.7 / 17.5 / 16.1 s (alternated on
a slow hour of the 2-core AMD host, 2026-12-06); mCCAdL 163 functions instead of 168 (its
cold start's spread, 25-30 s, hides the change). All seven samplers drew the same bits on a
D = 5 regression; on the random-intercepts funnel of the tests mCCAdL's chain differs in the
last bit from its 462nd draw on (the code numba generates around the views changed).

numba caches a compiled function with the code of every function it calls linked in as a
weak copy, which LLVM optimises again inside the caller. In the process that compiles a
block, calls that were not inlined go to the callees' own definitions, compiled first; a
process that loads the block from the cache runs the re-optimised copies. Under
PyTensor's fast-math flags, whose ``reassoc`` lets LLVM reorder sums differently in each
context, the two then round differently: SGLD on the D = 100 regression drew another chain
(last-place differences, amplified by the chain) in a process that compiled the block than
in every later one that loaded it, and ``cores=2`` (workers loading the block the main
process compiled) disagreed with ``cores=1`` whenever the cache was cold.
:func:`deterministic_fastmath` compiles the package's functions with the same flags less
``reassoc`` (:data:`FASTMATH`; no slower on the benchmark's problems: their sums over the
minibatch rows run in the fused kernels), and so do the loops of PyTensor's elemwise, fused
elemwise (with their reductions), blockwise and random-variable overloads, which take their
flags elsewhere (:data:`_OVERLOAD_MODULES`). Those kept ``reassoc`` until 2026-11-27: the
log-likelihood's fused sum over the rows then rounded differently in a worker than in the main
process on an AVX2 host, in ``minibatch_logp``'s last place (block steps on P1, P3 and the
covariance samplers at D = 100 timed within this host's +-5 % noise either way, six
alternated in-process pairs). Those kernels (:mod:`pymc_sgmcmc.gather_dot`) keep
numba's full fast math for their dot products, with loop lengths the optimiser cannot prove
constant (``_opaque``): vectorised alike wherever they are optimised.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import re
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numba
import numba.np.arrayobj as arrayobj
import numpy as np
import pytensor.link.numba.dispatch.basic as numba_dispatch
import pytensor.link.numba.dispatch.blockwise as numba_blockwise
import pytensor.link.numba.dispatch.elemwise as numba_elemwise
import pytensor.link.numba.dispatch.random as numba_random
import pytensor.link.numba.dispatch.scan as numba_scan
import pytensor.link.numba.dispatch.vectorize_codegen as numba_vectorize
import pytensor.link.utils as link_utils
from numba.core import types as nbtypes
from numba.extending import overload
from pytensor.compile import optdb
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.mode import Mode
from pytensor.conditional.op import LazyIfElse
from pytensor.configdefaults import config
from pytensor.graph.basic import Constant
from pytensor.graph.fg import AbstractFunctionGraph
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.link.numba.cache import CACHED_SRC_FUNCTIONS, compile_numba_function_src
from pytensor.link.numba.linker import NumbaLinker
from pytensor.scan.op import Scan
from pytensor.tensor.elemwise import DimShuffle

from pymc_sgmcmc.gather_dot import including_for_linker

__all__ = [
    "FASTMATH",
    "TAG",
    "deterministic_fastmath",
    "drop_inverse_dimshuffles",
    "interrupts_as_such",
    "lean_cache_wrappers",
    "plain_assignment_errors",
    "stable_state",
    "with_inverse_dimshuffles_dropped",
]

TAG = "sgmcmc_inverse_dimshuffles"

#: Ops whose numba function runs a whole inner graph: the largest code, so the costliest to
#: compile again in a wrapper, and (their inner graph being the model's) rarely reused.
_CONTAINERS = (Scan, AbstractFunctionGraph, OpFromGraph, LazyIfElse)


def _raise_shape_mismatch(src_shapes, index_shape):
    """Stands in for ``numba.np.arrayobj.raise_with_shape_context`` (a stub as that one)."""
    raise NotImplementedError


@overload(_raise_shape_mismatch)
def _plain_shape_mismatch(src_shapes, index_shape):
    def impl(src_shapes, index_shape):
        raise ValueError("cannot assign slice from input of different size")

    return impl


@contextmanager
def plain_assignment_errors() -> Iterator[None]:
    """numba functions compiled in this context raise a plain message for a shape mismatch
    in an array assignment (numba looks the raising function up when it compiles one)."""
    detailed = arrayobj.raise_with_shape_context
    arrayobj.raise_with_shape_context = _raise_shape_mismatch
    try:
        yield
    finally:
        arrayobj.raise_with_shape_context = detailed


@contextmanager
def interrupts_as_such() -> Iterator[None]:
    """Re-raise a Ctrl-C that numba wrapped in a ``SystemError`` as the ``KeyboardInterrupt``
    it was. A compiled block runs no Python code until it returns, so Python raises a
    pending ``KeyboardInterrupt`` in the first Python function that numba calls, which is
    the one that hands it the array class when it boxes the block's outputs;
    numba then reports "returned a result with an exception set", once per level of
    nesting. ``pm.sample`` catches a ``KeyboardInterrupt`` and returns the draws so far (a
    worker of ``cores > 1`` stops its chain); it does not catch a ``SystemError``."""
    try:
        yield
    except SystemError as error:
        cause: BaseException | None = error
        while cause is not None:
            if isinstance(cause, KeyboardInterrupt):
                raise KeyboardInterrupt from error
            cause = cause.__cause__ or cause.__context__
        raise


def stable_state(x):
    """``x`` itself; in numba code, an array as a writable C-contiguous one (itself when it
    is one, else a copy; an array that numba only types as "A" is checked when it runs and
    copied only if it is not contiguous), any other value as itself."""
    return x


@overload(stable_state)
def _stable_state(x):
    if not isinstance(x, nbtypes.Array) or (x.layout == "C" and x.mutable):
        return lambda x: x
    if x.ndim == 0:  # np.ascontiguousarray would return a 1-element vector
        return lambda x: np.asarray(x[()])
    if not x.mutable:
        return lambda x: np.ascontiguousarray(x).copy()
    return lambda x: np.ascontiguousarray(x)


#: An untraced state's variable in the source of PyTensor's numba ``scan``: its initial
#: value (the input or a copy of it) and its rebinding to the step's output.
_UNTRACED_STATE = re.compile(r"^(\s*)(outer_in_\d+_untraced_sit_sot_storage) = (.+)$", re.M)
#: The storage epilogue after the loop of PyTensor's numba ``scan``: from the first ``if``
#: after the loop's last statement to the ``return``.
_EPILOGUE = re.compile(r"(\n        i \+= 1\n)\n    if .*?\n(    return )", re.S)
#: A step's output stored into its trace (``..._storage[i % n] = inner_out_k``).
_TRACE_STORE = re.compile(r"^(\s*\w+_storage\[[^\n]*\] = )inner_out_(\d+)$", re.M)
#: Salts the scan's cache key: its source now differs from the one PyTensor keys it by, and
#: its step is inlined (3; retires the blocks cached with the step as a function of its own;
#: 4: scalar outputs read with ``[()]``; 5: more than 30 arguments passed as tuples).
_SCAN_SOURCE_VERSION = "inlined-5"
#: The name of the scan of a sampler's block (:mod:`pymc_sgmcmc.base`).
BLOCK_SCAN_NAME = "sgmcmc_block"


def _scan_source(src: str, drop_epilogue: bool, scalar_outputs: frozenset[int]) -> str:
    """The source of PyTensor's numba ``scan`` with every untraced state passed through
    :func:`stable_state`, each 0-d output of the step (``scalar_outputs``, by position) read
    as ``x[()]`` where it is stored into its trace, and, if ``drop_epilogue``, without the
    storage epilogue after the loop (module docstring; :func:`_traces_fill_their_storage`
    says when that is exact).

    Stored as it is, a 0-d array is cast to the trace's element type by numba's
    ``array0d_to_scalar``, which compiles ``a.take(0)`` twice per trace: 4 compilations in
    SGLD's block on P1 (its sanity flag and log-density traces), more for a sampler with
    scalar stats. ``x[()]`` reads the element directly: SGLD's cold first draw on P1 took
    0.3-2.5 s less (1.4 s on average; three runs of about 17 s, each started together with
    the old code's on a slow host, 2026-12-03)."""
    src = _UNTRACED_STATE.sub(r"\1\2 = stable_state(\3)", src)

    def read_scalar(store: re.Match) -> str:
        k = int(store.group(2))
        return f"{store.group(1)}inner_out_{k}[()]" if k in scalar_outputs else store.group(0)

    src = _TRACE_STORE.sub(read_scalar, src)
    return _EPILOGUE.sub(r"\1\n\2", src, count=1) if drop_epilogue else src


def _traces_fill_their_storage(op: Scan, node) -> bool:
    """Whether every traced output of a scan node is a per-step output (no state whose past
    values the step reads) stored in a buffer of exactly ``n_steps`` rows, ``n_steps``
    being a constant. The storage then never wraps around, and the epilogue only cuts a
    ``while`` loop's outputs to the steps it ran: rows the block's host never reads."""
    info = op.info
    n_steps = node.inputs[0]
    if info.n_mit_mot or info.n_mit_sot or info.n_sit_sot or not isinstance(n_steps, Constant):
        return False
    lengths = op.outer_nitsot(node.inputs)
    return all(isinstance(v, Constant) and v.data == n_steps.data for v in lengths)


#: PyTensor's compiler of generated source, which :func:`_scan_source_rewrite` wraps.
_compile_numba_function_src = numba_scan.compile_numba_function_src


@contextmanager
def _scan_source_rewrite(
    drop_epilogue: bool, step_arguments: int, scalar_outputs: frozenset[int]
) -> Iterator[None]:
    """The scan funcified in this context gets :func:`_scan_source`'s source, and its step
    function (called with ``step_arguments`` arguments) is inlined. A scan in its inner graph
    (funcified first, in its own context) gets its own rewrite, not this one's on top: a
    nested loop's epilogue (a ``while`` loop's outputs cut to the steps it ran) stays."""
    outer = numba_scan.compile_numba_function_src

    def compile_rewritten(src, name, global_env, *args, **kwargs):
        if name != "scan":
            return _compile_numba_function_src(src, name, global_env, *args, **kwargs)
        src = _scan_source(src, drop_epilogue, scalar_outputs)
        step = _inlined(global_env["scan_inner_func"], step_arguments)
        global_env = {**global_env, "stable_state": stable_state, "scan_inner_func": step}
        src, packed = _with_packed_arguments(src, name, global_env)
        fn = _compile_numba_function_src(src, name, global_env, *args, **kwargs)
        if packed:
            _PACKED.add(fn)
        return fn

    numba_scan.compile_numba_function_src = compile_rewritten
    try:
        yield
    finally:
        numba_scan.compile_numba_function_src = outer


def _funcify_scan(op, node, **kwargs) -> tuple[Callable, str | None]:
    drop_epilogue = op.name == BLOCK_SCAN_NAME and _traces_fill_their_storage(op, node)
    # PyTensor's scan calls its step with one argument per input of the inner graph.
    scalar_outputs = frozenset(k for k, v in enumerate(op.fgraph.outputs) if v.type.ndim == 0)
    with _scan_source_rewrite(drop_epilogue, len(op.fgraph.inputs), scalar_outputs):
        fn, key = numba_dispatch.numba_funcify_and_cache_key(op, node=node, **kwargs)
    if key is not None:
        salt = f"{_SCAN_SOURCE_VERSION}|epilogue={not drop_epilogue}"
        key = hashlib.sha256(f"{key}|{salt}".encode()).hexdigest()
    return fn, key


def _truth(x):
    """``bool(x)`` for a boolean scalar or 0-d array."""
    return bool(x)


@overload(_truth)
def _truth_of_element(x):
    # numba's bool() of an array (a size check and an element read) compiled for 0.3 s.
    if isinstance(x, nbtypes.Array):
        return lambda x: x.item()
    return lambda x: bool(x)


#: CPython compiles a call with more arguments than this into ``CALL_FUNCTION_EX`` on a tuple
#: of them (``STACK_USE_GUIDELINE`` in its compiler), a call that numba does not inline
#: ("Calling a closure with *args is unsupported").
_MAX_INLINED_ARGUMENTS = 30


def _call_arguments(op, node) -> int | None:
    """How many arguments its caller passes to ``op``'s numba function if PyTensor generates
    that function from the op's inner graph (a scan, a lazy branch, a plain ``OpFromGraph``
    such as a branch's graph); ``None`` for other ops. The subclasses of ``OpFromGraph`` that
    PyTensor's rewrites make (``FusedElemwise``, ``ScalarizedJoin``, ...) are kernels, not
    graphs, and stay calls: inlined too, they took nothing measurable off SGLD's cold start
    (``docs/performance.md``)."""
    if isinstance(op, Scan):
        return len(node.inputs)
    if isinstance(op, LazyIfElse):
        return 1 + len(op.true_branch.fgraph.inputs)
    if type(op) is OpFromGraph:
        return len(op.fgraph.inputs)
    return None


def _inlined(fn: Callable, arguments: int | None) -> Callable:
    """The numba function ``fn`` of an op (one that holds an inner graph, or a leaf op inside
    its caching wrapper), called with ``arguments`` arguments, to be compiled as part of its
    caller: numba inlines its IR before typing (``inline="always"``) instead of compiling it
    as a function of its own, which LLVM would optimise and emit again in each caller above
    it (module docstring). ``fn`` itself if it is called with too many arguments to inline
    and does not take them as tuples (:func:`_with_packed_arguments`; or ``arguments`` is
    ``None``), is no numba dispatcher, or takes ``*args`` (numba's
    inliner does not: "Stararg not supported in inliner", as in PyTensor's ``CheckAndRaise``
    and ``Join``)."""
    if arguments is None or not isinstance(fn, numba.core.dispatcher.Dispatcher):
        return fn
    if arguments > _MAX_INLINED_ARGUMENTS and not _takes_tuples(fn):
        return fn
    if fn.py_func.__code__.co_flags & inspect.CO_VARARGS:
        return fn
    if fn.targetoptions.get("inline") == "always":
        return fn
    # njit sets nopython itself, and warns if it is passed.
    options = {k: v for k, v in fn.targetoptions.items() if k != "nopython"}
    return numba.njit(fn.py_func, **options, inline="always")


#: The generated functions (a scan, a scan's step) whose more than
#: :data:`_MAX_INLINED_ARGUMENTS` arguments are passed as tuples (:func:`_with_packed_arguments`).
_PACKED: weakref.WeakSet[Callable] = weakref.WeakSet()
#: The generated functions that :func:`_with_packed_arguments` may give tuple arguments: those
#: called only from generated code of this module's contexts. A block's outermost function
#: graph (``numba_funcified_fgraph``) is called from Python with its inputs one by one.
_PACKABLE = frozenset({"scan", "numba_scan"})


def _takes_tuples(fn) -> bool:
    """Whether ``fn`` (a Python function or its numba dispatcher) takes its arguments as
    tuples (:func:`_with_packed_arguments`)."""
    fn = getattr(fn, "py_func", fn)
    return isinstance(fn, types.FunctionType) and fn in _PACKED


def _argument_chunks(items: list) -> list[list]:
    size = _MAX_INLINED_ARGUMENTS
    return [items[k : k + size] for k in range(0, len(items), size)]


def _with_packed_arguments(src: str, name: str, global_env: dict) -> tuple[str, bool]:
    """``src`` with more than :data:`_MAX_INLINED_ARGUMENTS` arguments passed as tuples of
    at most that many, and whether function ``name`` itself now takes them so.

    A call with more arguments is a ``CALL_FUNCTION_EX`` on one tuple, which numba does not
    inline (:data:`_MAX_INLINED_ARGUMENTS`), so the loop and its step were functions of their
    own, linked code that LLVM optimised and emitted again: a regression with ten free
    variables, each prior's two numbers an input, has 45 arguments in SGLD's loop and 56 in
    mCCAdL's. The definition of ``name`` (a scan or its step, :data:`_PACKABLE`) unpacks the
    tuples, and every call to a function that takes them (:data:`_PACKED`, named in
    ``global_env``) builds them. Sources with no such call or definition stay as they are."""
    packed_callees = {key for key, value in global_env.items() if _takes_tuples(value)}
    if not packed_callees and name not in _PACKABLE:
        return src, False  # most sources (leaf ops, scalar composites): nothing to parse
    tree = ast.parse(src)
    changed = packed = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in packed_callees and not node.keywords:
                node.args = [ast.Tuple(chunk, ast.Load()) for chunk in _argument_chunks(node.args)]
                changed = True
        elif (
            isinstance(node, ast.FunctionDef)
            and node.name == name
            and name in _PACKABLE
            and len(node.args.args) > _MAX_INLINED_ARGUMENTS
            and not (node.args.vararg or node.args.kwarg or node.args.defaults)
        ):
            chunks = _argument_chunks([a.arg for a in node.args.args])
            node.args.args = [ast.arg(f"_arguments_{k}") for k in range(len(chunks))]
            unpack = [f"{', '.join(chunk)}, = _arguments_{k}" for k, chunk in enumerate(chunks)]
            node.body[:0] = ast.parse("\n".join(unpack)).body
            changed = packed = True
    return (ast.unparse(ast.fix_missing_locations(tree)) if changed else src), packed


def _compile_with_packed_arguments(src, name, global_env=None, local_env=None):
    """PyTensor's ``compile_function_src`` (which compiles the source of each function graph)
    with :func:`_with_packed_arguments`'s calls and definition."""
    src, packed = _with_packed_arguments(src, name, global_env or {})
    fn = _compile_function_src(src, name, global_env, local_env)
    if packed:
        _PACKED.add(fn)
    return fn


#: PyTensor's compiler of a function graph's source, which :func:`lean_cache_wrappers` wraps.
_compile_function_src = link_utils.compile_function_src


#: :func:`_funcify_lazy_ifelse`'s function, its arguments (``{args}``) named one by one.
_LAZY_IFELSE = """
def lazy_ifelse(condition, {args}):
    if _truth(condition):
        return true_fn({args})
    return false_fn({args})
"""


def _funcify_lazy_ifelse(op: LazyIfElse, **kwargs) -> tuple[Callable, str | None]:
    """PyTensor's numba function of a lazy branch (``numba_funcify_LazyIfElse``), with the
    condition read by :func:`_truth` and the arguments named one by one: numba inlines no
    call with ``*args`` (:func:`_inlined`)."""
    ensure_cache = numba_dispatch.numba_funcify_ensure_cache
    true_fn, true_key = ensure_cache(op.true_branch, **kwargs)
    false_fn, false_key = ensure_cache(op.false_branch, **kwargs)
    args = ", ".join(f"a{k}" for k in range(len(op.true_branch.fgraph.inputs)))
    env = {"_truth": _truth, "true_fn": true_fn, "false_fn": false_fn}
    exec(_LAZY_IFELSE.format(args=args), env)
    lazy_ifelse = numba_dispatch.numba_njit(env["lazy_ifelse"])

    key = None
    if true_key is not None and false_key is not None:
        # Version 2: the branches inlined.
        key = str(("LazyIfElse-sgmcmc", 2, true_key, false_key))
        key = hashlib.sha256(key.encode()).hexdigest()
    return lazy_ifelse, key


def _cached_as_itself(fn, key: str) -> Callable:
    """The numba function ``fn`` of a function graph, cached under ``key`` by PyTensor's
    cache locator. Its code is given the file name ``<string>``: PyTensor writes each graph's
    source to a new temporary file, whose name is part of numba's cache entry, so the entry
    would never be found again. ``__name__`` in its globals names a module for numba to
    rebuild the function's environment from when it loads the entry."""
    py = fn.py_func
    code = py.__code__.replace(co_filename="<string>")
    env = {"__name__": __name__, **py.__globals__}
    copy = types.FunctionType(code, env, py.__name__, py.__defaults__, py.__closure__)
    CACHED_SRC_FUNCTIONS[copy] = f"{key}_fastmath{int(config.numba__fastmath)}_sgmcmc"
    return numba_dispatch.numba_njit(copy)


#: The caching wrapper of a leaf op (:func:`_leaf_with_its_function_inlined`), its arguments
#: (``{args}``) named one by one: PyTensor's passes ``*args``, a call numba does not inline.
_LEAF_WRAPPER = """
def {name}({args}):
    return jitable_func({args})
"""


def _leaf_wrappable(node) -> bool:
    """Whether :func:`_leaf_with_its_function_inlined` serves the op of ``node``: with numba's
    cache on (else PyTensor adds no wrapper) and few enough arguments to inline."""
    return config.numba__cache and node is not None and len(node.inputs) <= _MAX_INLINED_ARGUMENTS


def _leaf_with_its_function_inlined(op, node, **kwargs) -> tuple[Callable, str | None]:
    """PyTensor's caching wrapper of a leaf op (``numba_funcify_ensure_cache``), with the op's
    numba function inlined into it (module docstring): the wrapper, cached under the op's key,
    is then the op's only compiled function. It takes the op's function's options (fast-math
    flags, error model), whose code it now is."""
    fn, key = numba_dispatch.numba_funcify_and_cache_key(op, node=node, **kwargs)
    if key is None:
        return fn, None
    inner = _inlined(fn, len(node.inputs))
    name = fn.__name__ if fn.__name__.isidentifier() else "leaf_op"
    args = ", ".join(f"a{k}" for k in range(len(node.inputs)))
    wrapper = compile_numba_function_src(
        _LEAF_WRAPPER.format(name=name, args=args),
        name,
        # A module name: numba pickles the globals of a function without one into its cache
        # entry, and cloudpickle looks such functions up in every module (which imported
        # arviz_plots through pymc.plots for 3-4 s).
        global_env={"__name__": __name__, "jitable_func": inner},
        cache_key=f"{key}_fastmath{int(config.numba__fastmath)}_sgmcmc_leaf",
    )
    if inner is fn:
        return numba_dispatch.numba_njit(wrapper, cache=True), key
    options = {k: v for k, v in fn.targetoptions.items() if k not in ("nopython", "inline")}
    return numba.njit(wrapper, **{**options, "cache": True}), key


@contextmanager
def lean_cache_wrappers() -> Iterator[None]:
    """PyTensor functions built in this context get numba caching wrappers on their leaf ops
    only, and their outermost function graph is cached without one (module docstring)."""
    ensure_cache = numba_dispatch.numba_funcify_ensure_cache
    depth = 0

    def funcify(op, node=None, **kwargs):
        nonlocal depth
        outermost = depth == 0
        depth += 1
        try:
            if isinstance(op, Scan):
                fn, key = _funcify_scan(op, node, **kwargs)
            elif isinstance(op, LazyIfElse):
                fn, key = _funcify_lazy_ifelse(op, **kwargs)
            elif isinstance(op, _CONTAINERS):
                fn, key = numba_dispatch.numba_funcify_and_cache_key(op, node=node, **kwargs)
            elif _leaf_wrappable(node):
                return _leaf_with_its_function_inlined(op, node, **kwargs)
            else:
                return ensure_cache(op, node=node, **kwargs)
            if not config.numba__cache:
                key = None
            if not outermost:
                return _inlined(fn, _call_arguments(op, node)), key
            if key is not None and isinstance(fn, numba.core.dispatcher.Dispatcher):
                return _cached_as_itself(fn, key), key
            return fn, key
        finally:
            depth -= 1

    numba_dispatch.numba_funcify_ensure_cache = funcify
    link_utils.compile_function_src = _compile_with_packed_arguments
    try:
        yield
    finally:
        numba_dispatch.numba_funcify_ensure_cache = ensure_cache
        link_utils.compile_function_src = _compile_function_src


#: LLVM fast-math flags of the numba code of the package's PyTensor functions: PyTensor's
#: default set (``numba_njit``) without ``reassoc`` (module docstring). ``contract`` (fused
#: multiply-add), ``arcp``, ``afn`` and ``nsz`` act on single operations.
FASTMATH = frozenset({"arcp", "contract", "afn", "nsz"})
#: Salts the cache keys of functions compiled with :data:`FASTMATH`: PyTensor keys its numba
#: cache by ``numba__fastmath`` (a bool), under which these flags would share entries with
#: the same ops compiled elsewhere with PyTensor's. The version retires entries compiled
#: before the fused-elemwise overloads lost ``reassoc`` too (2: :data:`_OVERLOAD_MODULES`).
_FASTMATH_SALT = "_sgmcmc2-" + "-".join(sorted(FASTMATH))

#: PyTensor modules whose ``@overload`` implementations (elemwise loops, fused elemwise
#: loops with their reductions, blockwise, random variables) take their fast-math flags
#: from ``vectorize_codegen._jit_options``, not from ``numba_njit``. A fused reduction
#: compiled with ``reassoc`` -- the minibatch log-likelihood's sum over rows -- summed in
#: another order in a process that loaded the block from numba's cache than in the one that
#: compiled it (``minibatch_logp`` differed in its last place on an AVX2 host).
_OVERLOAD_MODULES = (numba_elemwise, numba_blockwise, numba_random)


class _SaltedKeys(type(CACHED_SRC_FUNCTIONS)):
    """PyTensor's registry of cache keys, salting each key registered while it has this type."""

    def __setitem__(self, key, value):
        super().__setitem__(key, f"{value}{_FASTMATH_SALT}")


@contextmanager
def deterministic_fastmath() -> Iterator[None]:
    """numba functions that PyTensor creates in this context get :data:`FASTMATH` instead of
    PyTensor's default fast-math flags, and cache keys of their own."""
    njit = numba_dispatch._njit

    def without_reassoc(fastmath):
        reorders = isinstance(fastmath, set) and "reassoc" in fastmath
        return set(FASTMATH) if reorders else fastmath

    def njit_without_reassoc(*args, fastmath=None, **kwargs):
        return njit(*args, fastmath=without_reassoc(fastmath), **kwargs)

    def jit_options_without_reassoc() -> dict:
        options = jit_options()
        return {**options, "fastmath": without_reassoc(options["fastmath"])}

    registry_type = type(CACHED_SRC_FUNCTIONS)
    jit_options = numba_vectorize._jit_options
    numba_dispatch._njit = njit_without_reassoc
    for module in _OVERLOAD_MODULES:
        module._jit_options = jit_options_without_reassoc
    CACHED_SRC_FUNCTIONS.__class__ = _SaltedKeys
    try:
        yield
    finally:
        numba_dispatch._njit = njit
        for module in _OVERLOAD_MODULES:
            module._jit_options = jit_options
        CACHED_SRC_FUNCTIONS.__class__ = registry_type


@node_rewriter([DimShuffle])
def drop_inverse_dimshuffles(fgraph, node):
    """``DimShuffle(DimShuffle(x))`` that gives back ``x`` (``Squeeze(ExpandDims(x))``) ->
    ``x``. Other chains stay: merged, they would be DimShuffles of new kinds, which numba
    compiles each."""
    inner = node.inputs[0].owner
    if inner is None or not isinstance(inner.op, DimShuffle):
        return None
    source = inner.inputs[0]
    order = [axis if axis == "x" else inner.op.new_order[axis] for axis in node.op.new_order]
    if order != list(range(source.type.ndim)) or node.outputs[0].type != source.type:
        return None
    return [source]


# After PyTensor's numba rewrites that make the pairs (``scalarize``, in the FusedElemwise
# database at 100).
optdb.register("drop_inverse_dimshuffles", in2out(drop_inverse_dimshuffles), TAG, position=100.5)


def with_inverse_dimshuffles_dropped(mode) -> Mode | str | None:
    """``mode`` with :func:`drop_inverse_dimshuffles` included if its linker is numba's."""
    return including_for_linker(mode, NumbaLinker, TAG)
