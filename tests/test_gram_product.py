"""The fused product Gc^T Gc w of the noise covariance's low-rank path, and where it runs."""

import os
import subprocess
import sys

import numba
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import Mode
from pytensor.scan.op import Scan
from python_backend import python_function

from pymc_sgmcmc.gram_product import CentredGramProduct, _krylov_gram, with_covariance_kernels
from pymc_sgmcmc.model_layer import NoiseCovariance

FUSED = with_covariance_kernels("NUMBA")
PERFORM = Mode(linker="py", optimizer=None)


def op_names(fgraph) -> set[str]:
    """Names of the ops in ``fgraph`` and in the inner graphs of its loops."""
    names = set()
    for node in fgraph.apply_nodes:
        names.add(type(node.op).__name__)
        if isinstance(node.op, Scan):
            names |= op_names(node.op.fgraph)
    return names


def product_function(mode, dtype="float64"):
    g = pt.matrix("g", dtype=dtype)
    mean, w = pt.vector("m", dtype=dtype), pt.vector("w", dtype=dtype)
    return pytensor.function([g, mean, w], CentredGramProduct()(g, mean, w), mode=mode)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("n, dim", [(8, 5), (1, 4), (33, 10)])  # 4 rows at a time + rest
@pytest.mark.parametrize("mode", [FUSED, "FAST_RUN", PERFORM], ids=["numba", "c", "perform"])
def test_product_is_the_centred_gram_matrix_times_w(dtype, n, dim, mode):
    rng = np.random.default_rng(n)
    # Rows far from zero: the centring matters in the result.
    rows = (rng.standard_normal((n, dim)) + 3.0).astype(dtype)
    vector = rng.standard_normal(dim).astype(dtype)
    centred = rows.astype("float64") - rows.astype("float64").mean(0)
    expected = centred.T @ (centred @ vector.astype("float64"))
    result = product_function(mode, dtype)(rows, rows.mean(0), vector)
    assert result.dtype == dtype
    # The uncentred sums (both ways of computing it) round relative to the rows' size.
    scale = n * dim * np.abs(rows).max() ** 2 * np.abs(vector).max()
    np.testing.assert_allclose(result, expected, rtol=0, atol=scale * np.finfo(dtype).eps * 4)


@pytest.mark.parametrize("seed", [0, 1])
def test_float32_rows_of_a_float64_model_lose_no_more_than_their_own_rounding(seed):
    # The Krylov kernels' default: rows rounded to float32, mean and vector in float64, as
    # NoiseCovariance passes them. Far from the mode (rows 100 sds from zero) the rounding
    # of the rows is the error floor of any kernel that reads them; the float32 sums, each
    # entry centred first, add about eps32 to it (2.1e-6 against a floor of 2.1e-6 here).
    # Uncentred sums of the rounded rows (the kernel before 2026-12-02) gave 1.4e-5-2.5e-4.
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((64, 24)) + 100.0
    vector = rng.standard_normal(24)
    mean = rows.mean(0)
    exact = (rows - mean).T @ ((rows - mean) @ vector)
    rounded = rows.astype("float32")
    floor = (rounded - mean).T @ ((rounded - mean) @ vector) - exact
    g = pt.matrix("g", dtype="float32")
    m, w = pt.vector("m", dtype="float64"), pt.vector("w", dtype="float64")
    product = pytensor.function([g, m, w], CentredGramProduct()(g, m, w), mode=FUSED)
    error = np.linalg.norm(product(rounded, mean, vector) - exact)
    bound = 1.5 * np.linalg.norm(floor) + 8 * np.finfo("float32").eps * np.linalg.norm(exact)
    assert error <= bound


@numba.njit
def krylov_products(g, mean, vectors):
    """A Krylov kernel's products with the same rows, and whether each read the rows
    themselves (uncentred) rather than a centred copy."""
    out = np.empty(vectors.shape)
    uncentred = np.empty(vectors.shape[0], np.bool_)
    rows, centre = g, mean
    for k in range(vectors.shape[0]):
        rows, centre = _krylov_gram(rows, centre, vectors[k], out[k], k == 0)
        uncentred[k] = rows.shape == g.shape and np.all(rows == g) and np.all(centre == mean)
    return out, uncentred


@pytest.mark.parametrize(
    ("shift", "uncentred"), [(0.0, True), (0.5, True), (3.0, False), (100.0, False)]
)
def test_krylov_products_sum_uncentred_rows_only_where_the_mean_is_within_the_spread(
    shift, uncentred
):
    # Rows of unit spread per coordinate whose mean lies about `shift` sds out in each. The
    # first product sums the rows uncentred and their squares, from which the spread
    # follows; where the mean's norm is within the rows' root-mean-square distance from it
    # (shifts 0 and 0.5) every product sums the rows uncentred, and must then lose no more
    # than the centred sums' bound of the test above (they use 0.11-0.27 of it); at 3 and
    # 100 sds the first product is computed again, and the later ones read, from a centred
    # copy, and meet it too (0.10-0.52 of it). Uncentred, the products there would use up to
    # 3.4 and 813 times the bound.
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((64, 24)) + shift * rng.standard_normal(24)
    vectors = rng.standard_normal((3, 24))
    mean = rows.mean(0)
    rounded = rows.astype("float32")
    products, read_uncentred = krylov_products(rounded, mean, vectors)
    assert list(read_uncentred) == [uncentred] * 3
    for product, vector in zip(products, vectors, strict=True):
        exact = (rows - mean).T @ ((rows - mean) @ vector)
        floor = (rounded - mean).T @ ((rounded - mean) @ vector) - exact
        bound = 1.5 * np.linalg.norm(floor) + 8 * np.finfo("float32").eps * np.linalg.norm(exact)
        assert np.linalg.norm(product - exact) <= bound


#: Runs in a process with an empty numba cache: a kernel loaded from the cache types none of
#: its callees, whose signatures then stay empty.
LITERAL_SIGNATURES = """
import numba, numpy as np
from numba.core import types
from pymc_sgmcmc.gram_product import _gram_uncentred_sums, _krylov_gram, _uncentred_gram_single

@numba.njit
def products(g, mean, vectors):
    out = np.empty(vectors.shape)
    rows, centre = g, mean
    for k in range(vectors.shape[0]):
        rows, centre = _krylov_gram(rows, centre, vectors[k], out[k], k == 0)
    return out

rng = np.random.default_rng(5)
for shift in (0.0, 100.0):  # the rows themselves, then a centred copy
    rows = (rng.standard_normal((16, 6)) + shift).astype("float32")
    products(rows, rows.astype("float64").mean(0), rng.standard_normal((3, 6)))
# The Krylov loops with two caps each, as two ops' kernels: their caps reach the loops as
# plain integers, not literals, and their small operands as writable C-contiguous arrays
# (a graph's constant is read-only; a strided view here): one compiled loop for all.
from pymc_sgmcmc.krylov import LowRankExpm, LowRankShiftedSolve, _lanczos_expm, _shifted_cg
from pymc_sgmcmc.krylov import _numba_lanczos_expm, _numba_shifted_cg
g, v = rng.standard_normal((16, 6)).astype("float32"), rng.standard_normal(6)
mean, gain = g.astype("float64").mean(0), np.array(0.1)
constant = np.ones(6)
constant.flags.writeable = False
for cap, ones, centre in [(64, np.ones(6), mean), (3, constant, np.repeat(mean, 2)[::2])]:
    _numba_lanczos_expm(LowRankExpm("half", cap), None)[0](
        g, centre, ones, gain, ones, np.array(0.2), v
    )
    _numba_shifted_cg(LowRankShiftedSolve(1e-6, cap), None)[0](g, centre, ones, gain, ones, v)
kernels = (_uncentred_gram_single, _gram_uncentred_sums, _lanczos_expm, _shifted_cg)
for kernel in kernels:
    assert len(kernel.signatures) == 1, (kernel, kernel.signatures)
    for signature in kernel.signatures:
        print(sum(isinstance(a, types.Literal) for a in signature))
"""


def test_krylov_products_compile_their_loop_once_whatever_the_flag(tmp_path):
    # The first product sums the rows' squares and the later ones do not, through one
    # runtime flag. Passed as a constant True or False, the flag is a literal type to numba,
    # which then compiled the product loop once for each value (until 2026-12-06: about 1 s
    # of numba in mCCAdL's and NOGIN's first draw with empty caches). Likewise the Lanczos
    # and conjugate-gradient loops for each cap on their products, and for each read-only
    # flag and layout of their operators' vectors (until 2026-12-07, stop 101: 37 and 19
    # compiled loops in a run of the default tests, about 1-4 s each).
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-c", LITERAL_SIGNATURES], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0"] * 4  # one signature each, no literal argument


def test_krylov_products_of_float64_rows_are_the_uncentred_float64_sums():
    rng = np.random.default_rng(4)
    rows, vectors = rng.standard_normal((33, 10)) + 3.0, rng.standard_normal((2, 10))
    mean = rows.mean(0)
    products, read_uncentred = krylov_products(rows, mean, vectors)
    assert read_uncentred.all()
    expected = ((rows - mean) @ vectors.T).T @ (rows - mean)
    np.testing.assert_allclose(products, expected, rtol=1e-12)


@pytest.mark.parametrize("mode", [FUSED, PERFORM], ids=["numba", "perform"])
def test_mismatched_shapes_raise(mode):
    with pytest.raises(ValueError, match="shapes do not match"):
        product_function(mode)(np.ones((5, 3)), np.ones(3), np.ones(4))


def test_only_the_samplers_numba_mode_runs_the_kernel_also_inside_loops():
    # Products inside a loop, as in mCCAdL's Lanczos and NOGIN's CG loops: the kernel where
    # numba has it; PyTensor's two products in the loop's graph elsewhere (here the Python
    # backend; C and JAX are expanded by the same rewrite), with the same result.
    rng = np.random.default_rng(0)
    gradients, v = pt.matrix("G", shape=(9, 4)), pt.vector("v", shape=(4,))
    sigma = NoiseCovariance(gradients, 4, 9)
    powers = pytensor.scan(
        lambda x: sigma.matvec(x) / 10.0, outputs_info=[v], n_steps=3, return_updates=False
    )
    rows, vector = rng.standard_normal((9, 4)), rng.standard_normal(4)
    fused = pytensor.function([gradients, v], powers, mode=FUSED)
    plain = python_function([gradients, v], powers)
    assert "CentredGramProduct" in op_names(fused.maker.fgraph)
    assert "CentredGramProduct" not in op_names(plain.maker.fgraph)
    centred = rows - rows.mean(0)
    matrix = 9 / 8 * centred.T @ centred / 10.0
    expected = [np.linalg.matrix_power(matrix, k) @ vector for k in (1, 2, 3)]
    np.testing.assert_allclose(fused(rows, vector), expected, rtol=1e-12)
    np.testing.assert_allclose(plain(rows, vector), expected, rtol=1e-12)
