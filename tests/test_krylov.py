"""The fused Krylov kernels of the low-rank covariance (Lanczos exp(t Sigma) v, conjugate
gradients), against their graphs."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg
from checks import one_chain
from models import GaussianRegression
from pytensor.compile.mode import Mode
from pytensor.scan.op import Scan
from python_backend import python_function
from test_gram_product import op_names

from pymc_sgmcmc import MCCAdL, base
from pymc_sgmcmc.gram_product import with_covariance_kernels
from pymc_sgmcmc.krylov import (
    EXPM_TOLERANCE,
    SINGLE_PRECISION_ROWS,
    LowRankExpm,
    LowRankShiftedSolve,
)
from pymc_sgmcmc.model_layer import NoiseCovariance

FUSED = with_covariance_kernels("NUMBA")
PERFORM = Mode(linker="py", optimizer=None)
N_ROWS, DIM = 40, 9


FORMS = [
    "plain",
    "preconditioned",
    "shrunk to the identity",
    "shrunk to the diagonal",
    "dense preconditioner",
    "dense preconditioner, shrunk to the diagonal",
]
#: A dense preconditioner's rotation R (lower-triangular), for M = R S. Near the identity, so
#: that (alpha I + b Sigma) stays about as well conditioned as with the scales alone (6.6
#: against 5.1): the conjugate gradients run all D = 9 iterations on it, and with
#: off-diagonal entries of 0.3 (condition 13) the kernels, the graph and a NumPy transcription
#: differed among themselves by about 1e-12, above these tests' rounding tolerance. The
#: products' own errors (M for M^T, say) would be of the order of 0.1.
ROTATION = np.eye(DIM) + 0.1 * np.tril(np.random.default_rng(7).standard_normal((DIM, DIM)))


def forms(gradients, columns, intensity):
    """Every form of the low-rank estimate that the samplers pass to the C step."""
    plain = NoiseCovariance(gradients, DIM, N_ROWS)
    rotated = plain.rotated(pt.constant(ROTATION)).scaled(columns)
    return {
        "plain": plain,
        "preconditioned": plain.scaled(columns),
        "shrunk to the identity": plain.scaled(columns).shrunk(intensity, "identity"),
        "shrunk to the diagonal": plain.shrunk(intensity, "diagonal"),
        "dense preconditioner": rotated,
        "dense preconditioner, shrunk to the diagonal": rotated.shrunk(intensity, "diagonal"),
    }


def expm_functions(form: str, caps=(64,), dtype: str = "float64", tolerance="half"):
    """:func:`kernel_and_graph_functions` of one form's product with each cap on its count, in
    one function (one numba compilation); each returns exp(t Sigma) v and the products for
    each cap in turn, then Sigma as a dense matrix."""
    gradients, v = pt.matrix("G", dtype=dtype), pt.vector("v", dtype=dtype)
    columns, intensity, t = pt.vector("s", dtype=dtype), pt.scalar("rho"), pt.scalar("t")
    sigma = forms(gradients, columns, intensity)[form]
    outputs = [x for cap in caps for x in sigma.expm_matvec(t, v, tolerance, cap)]
    inputs = [gradients, v, columns, intensity, t]
    return kernel_and_graph_functions(inputs, [*outputs, sigma.dense()])


def kernel_and_graph_functions(inputs, outputs):
    """(the samplers' numba mode, running the fused kernel; the kernel's Python perform; the
    expanded graph in Python's backend)."""
    fused = pytensor.function(inputs, outputs, mode=FUSED, on_unused_input="ignore")
    perform, graph = (
        python_function(inputs, outputs, mode=mode, on_unused_input="ignore")
        for mode in (PERFORM, "FAST_COMPILE")
    )
    return fused, perform, graph


def example(rng, dtype="float64", offset=2.0):
    # Rows far from zero by default, so that the centring matters.
    rows = (rng.standard_normal((N_ROWS, DIM)) + offset).astype(dtype)
    return rows, rng.standard_normal(DIM).astype(dtype), rng.uniform(0.5, 2.0, DIM).astype(dtype)


#: How closely the kernels follow the graph: to float64 rounding where both read the rows in
#: float64 ("single"); where they read them rounded to float32 ("half", the default) the
#: kernel sums them in float32 and the graph in float64, and each product differs by a few
#: float32 rounding units (about 3e-7 relative at D = 100, n = 500). Here the results differ
#: by at most 0.4 units of ||v||; the 4 allowed are 2e-3 of the tolerance 2^-11.
AGREEMENT = {"single": 1e-13, "half": 4 * np.finfo(np.float32).eps}


@pytest.mark.parametrize("tolerance", ["half", "single"])
@pytest.mark.parametrize("form", FORMS)
def test_kernel_runs_the_graphs_algorithm_step_for_step(form, tolerance):
    # At ||t Sigma|| = 0.4 (3 products at h = 1e-3 on the D = 100 regression) and 5, with
    # and without reaching a cap of 3 products: the same count, results that agree to
    # rounding, and NaN in both where the a-posteriori check rejects the capped product.
    rng = np.random.default_rng(1)
    rows, vector, columns = example(rng)
    caps = (64, 3)
    fused, perform, graph = expm_functions(form, caps, tolerance=tolerance)
    dense = graph(rows, vector, columns, 0.3, 0.0)[-1]
    top = np.linalg.eigvalsh(dense).max()
    for norm in (0.4, 5.0):
        t = -norm / top
        graphs = graph(rows, vector, columns, 0.3, t)
        kernels = [kernel(rows, vector, columns, 0.3, t) for kernel in (fused, perform)]
        for i in range(len(caps)):
            expected, count = graphs[2 * i : 2 * i + 2]
            for outputs in kernels:
                result, products = outputs[2 * i : 2 * i + 2]
                assert products == count
                if np.isnan(expected).all():
                    assert np.isnan(result).all()
                    continue
                atol = AGREEMENT[tolerance] * np.linalg.norm(vector)
                np.testing.assert_allclose(result, expected, rtol=0, atol=atol)
                error = np.linalg.norm(result - scipy.linalg.expm(t * dense) @ vector)
                assert error <= EXPM_TOLERANCE[tolerance] * np.linalg.norm(vector)
    assert np.isnan(expected).all()  # 3 products at ||t Sigma|| = 5 fall short


@pytest.mark.parametrize("form", FORMS)
def test_cg_kernel_runs_the_graphs_algorithm_step_for_step(form):
    # NOGIN's solve (alpha I + b Sigma)^{-1} v: to its tolerance (1e-10 ||v|| on the
    # residual), and capped at 2 iterations, short of it: the same iterate as the graph's.
    gradients, v = pt.matrix("G"), pt.vector("v")
    columns, intensity = pt.vector("s"), pt.scalar("rho")
    sigma = forms(gradients, columns, intensity)[form]
    outputs = [sigma.solve_shifted_cg(1.3, 0.05, v, cap) for cap in (60, 2)] + [sigma.dense()]
    inputs = [gradients, v, columns, intensity]
    fused, perform, graph = kernel_and_graph_functions(inputs, outputs)
    rows, vector, scales = example(np.random.default_rng(4))
    *expected, dense = graph(rows, vector, scales, 0.3)
    exact = np.linalg.solve(1.3 * np.eye(DIM) + 0.05 * dense, vector)
    np.testing.assert_allclose(expected[0], exact, rtol=0, atol=1e-9 * np.linalg.norm(vector))
    assert np.linalg.norm(expected[1] - exact) > 1e-3 * np.linalg.norm(vector)  # capped
    for kernel in (fused, perform):
        *result, _ = kernel(rows, vector, scales, 0.3)
        np.testing.assert_allclose(result, expected, rtol=0, atol=1e-13)


def test_kernel_in_single_precision():
    # Same dtype out; the kernel sums its vector products in double precision, the graph in
    # single: they agree to some float32 rounding units of ||v||.
    rng = np.random.default_rng(2)
    rows, vector, columns = example(rng, "float32")
    fused, _, graph = expm_functions("preconditioned", dtype="float32")
    top = np.linalg.eigvalsh(graph(rows, vector, columns, 0.0, 0.0)[2]).max()
    result, products, _ = fused(rows, vector, columns, 0.0, -0.4 / top)
    expected, count, _ = graph(rows, vector, columns, 0.0, -0.4 / top)
    assert result.dtype == np.float32
    assert products == count
    scale = np.linalg.norm(vector) * np.finfo(np.float32).eps
    np.testing.assert_allclose(result, expected, rtol=0, atol=100 * scale)


def kernel_rows(fgraph) -> list[str]:
    """The dtypes of the rows that the graph's low-rank kernels read (in loops too)."""
    dtypes = []
    for node in fgraph.apply_nodes:
        if isinstance(node.op, (LowRankExpm, LowRankShiftedSolve)):
            dtypes.append(node.inputs[0].type.dtype)
        if isinstance(node.op, Scan):
            dtypes += kernel_rows(node.op.fgraph)
    return dtypes


def test_float64_kernels_read_float32_rows_only_at_loose_tolerances():
    # The defaults (Lanczos "half", CG 1e-6, NOGIN's) read G in float32; a tighter request
    # keeps it in float64. The result stays float64 either way.
    gradients, v = pt.matrix("G"), pt.vector("v")
    sigma = NoiseCovariance(gradients, DIM, N_ROWS)
    assert SINGLE_PRECISION_ROWS == {"expm": ("half",), "cg": 1e-6}
    cases = [
        (sigma.expm_matvec(-0.1, v, "half")[0], "float32"),
        (sigma.expm_matvec(-0.1, v, "single")[0], "float64"),
        (sigma.solve_shifted_cg(1.3, 0.05, v, tolerance=1e-6), "float32"),
        (sigma.solve_shifted_cg(1.3, 0.05, v, tolerance=1e-8), "float64"),
        (sigma.shrunk(0.3).expm_matvec(-0.1, v, "half")[0], "float32"),
    ]
    for result, rows in cases:
        fn = pytensor.function([gradients, v], result, mode=FUSED)
        assert kernel_rows(fn.maker.fgraph) == [rows]
        assert fn.maker.fgraph.outputs[0].type.dtype == "float64"


# Rows 2 sds from zero in every coordinate: numba's products read a centred copy of the rows;
# at zero, the rows themselves, uncentred (gram_product._krylov_gram).
@pytest.mark.parametrize("offset", [2.0, 0.0])
@pytest.mark.parametrize("mode", [FUSED, PERFORM], ids=["numba", "perform"])
def test_float32_rows_are_summed_in_single_precision(mode, offset):
    # Rows given as float32 to a float64 kernel: the float64 kernel on those rows widened
    # (the widening is exact), up to the products' float32 sums (0.06 and 0.15 float32
    # rounding units of ||v|| here at offset 2, 0.11 and 0.06 at 0, and residuals of the
    # solve 1.3e-7 and 6.4e-8; AGREEMENT allows 4); the same number of Lanczos
    # products; and still within the Lanczos bound of exp(t Sigma) v for the unrounded
    # Sigma, and within the CG tolerance plus the rows' rounding of the solve.
    rng = np.random.default_rng(5)
    rows, vector, columns = example(rng, offset=offset)
    g, v = pt.matrix("G", dtype="float32"), pt.vector("v")
    m, s, d = pt.vector("m"), pt.vector("s"), pt.vector("d")
    t = pt.scalar("t")
    result, count = LowRankExpm("half")(g, m, s, 0.7, d, t, v)
    solved = LowRankShiftedSolve(1e-6, 60)(g, m, s, 0.05, d + 1.3, v)
    assert result.type.dtype == solved.type.dtype == "float64"
    fn = pytensor.function([g, m, s, d, t, v], [result, count, solved], mode=mode)
    wide = pytensor.function(
        [g, m, s, d, t, v],
        [
            *LowRankExpm("half")(g.astype("float64"), m, s, 0.7, d, t, v),
            LowRankShiftedSolve(1e-6, 60)(g.astype("float64"), m, s, 0.05, d + 1.3, v),
        ],
        mode=mode,
    )
    mean, shift = rows.mean(0), rng.uniform(0.0, 0.5, DIM)
    centred = columns * (rows - mean)
    dense = 0.7 * centred.T @ centred + np.diag(shift)
    t_value = 0.4 / np.linalg.eigvalsh(dense).max()  # the kernel's t: exp(-t Sigma) v
    args = (rows.astype(np.float32), mean, columns, shift, t_value, vector)
    single, products, solution = fn(*args)
    expected, expected_products, expected_solution = wide(*args)
    assert products == expected_products
    atol = AGREEMENT["half"] * np.linalg.norm(vector)
    np.testing.assert_allclose(single, expected, rtol=0, atol=atol)
    np.testing.assert_allclose(solution, expected_solution, rtol=0, atol=atol)
    exact = scipy.linalg.expm(-t_value * dense) @ vector
    assert np.linalg.norm(single - exact) <= EXPM_TOLERANCE["half"] * np.linalg.norm(vector)
    system = np.diag(1.3 + shift) + 0.05 * centred.T @ centred
    residual = np.linalg.norm(system @ solution - vector) / np.linalg.norm(vector)
    assert residual <= 2e-6  # the tolerance, plus the rows' rounding (about 1e-7)


@pytest.mark.parametrize("mode", [FUSED, PERFORM], ids=["numba", "perform"])
def test_zero_vector_gives_zero_after_one_product(mode):
    gradients, v = pt.matrix("G"), pt.vector("v")
    result, count = NoiseCovariance(gradients, DIM, N_ROWS).expm_matvec(-0.1, v)
    fn = pytensor.function([gradients, v], [result, count], mode=mode)
    out, products = fn(np.ones((N_ROWS, DIM)), np.zeros(DIM))
    np.testing.assert_array_equal(out, np.zeros(DIM))
    assert products == 1


@pytest.mark.parametrize("kernel", ["expm", "solve"])
@pytest.mark.parametrize("mode", [FUSED, PERFORM], ids=["numba", "perform"])
def test_mismatched_shapes_raise(mode, kernel):
    g, m, s, d, v = (pt.matrix("g"), *(pt.vector(x) for x in "msdv"))
    if kernel == "expm":
        out = LowRankExpm()(g, m, s, 1.0, d, 0.1, v)
    else:
        out = LowRankShiftedSolve(1e-10, 20)(g, m, s, 1.0, d, v)
    fn = pytensor.function([g, m, s, d, v], out, mode=mode)
    with pytest.raises(ValueError, match="shapes do not match"):
        fn(np.ones((5, 3)), np.ones(3), np.ones(3), np.zeros(3), np.ones(4))


def test_only_the_samplers_numba_mode_runs_the_kernel():
    # Elsewhere (C here; Python and JAX through the same rewrite) the Lanczos loop is built
    # as a graph, whose products are in turn expanded into PyTensor's own.
    gradients, v = pt.matrix("G"), pt.vector("v")
    result, _ = NoiseCovariance(gradients, DIM, N_ROWS).expm_matvec(-0.1, v)
    fused = pytensor.function([gradients, v], result, mode=FUSED)
    plain = pytensor.function([gradients, v], result, mode="FAST_RUN")
    assert "LowRankExpm" in op_names(fused.maker.fgraph)
    names = op_names(plain.maker.fgraph)
    assert not {"LowRankExpm", "CentredGramProduct"} & names
    assert "Scan" in names
    rows, vector, _ = example(np.random.default_rng(3))
    # At the default tolerance both read the rows in float32; the kernel sums them so.
    atol = AGREEMENT["half"] * np.linalg.norm(vector)
    np.testing.assert_allclose(fused(rows, vector), plain(rows, vector), rtol=0, atol=atol)


@pytest.mark.slow
def test_mccadl_chain_is_the_same_with_and_without_the_fused_kernels(monkeypatch):
    # Slow: two mCCAdL blocks compiled cold, 35 s. The fused kernels are the Gram product and
    # the Lanczos process around it (:mod:`pymc_sgmcmc.krylov`).
    problem = GaussianRegression.make(n_obs=500, dim=6, batch_size=50)

    def draws():
        return one_chain(problem, lambda: MCCAdL(step_size=5e-3, thin=5), draws=200, seed=4)

    kernels = {"CentredGramProduct", "LowRankExpm"}
    step, fused = draws()
    block = step._block_function()[0].maker.fgraph
    assert "LowRankExpm" in op_names(block)  # runs the other
    assert kernel_rows(block) == ["float32"]  # at the default tolerance, "half"
    monkeypatch.setattr(base, "with_covariance_kernels", lambda mode: mode)
    step, plain = draws()
    assert not kernels & op_names(step._block_function()[0].maker.fgraph)
    # Rounding differences, not amplified by the chain: the kernel sums the float32 rows in
    # float32, the graph in float64 (products about 3e-7 apart, relative). The draws
    # differed by at most 5e-8, with posterior sds of 0.04-0.25; 1e-6 is 2.5e-5 sd.
    np.testing.assert_allclose(fused, plain, rtol=0, atol=1e-6)
