"""Covariance operators: the three forms, the damping solves and the exp(t Sigma) v product."""

import numpy as np
import pytensor.tensor as pt
import pytest
import scipy.linalg
from python_backend import python_function

from pymc_sgmcmc.model_layer import DenseCovariance, DiagonalCovariance, NoiseCovariance


def sample_covariance(g):
    n = g.shape[0]
    centred = g - g.mean(0)
    return n / (n - 1) * centred.T @ centred


@pytest.mark.parametrize("n_rows, dim", [(40, 6), (6, 40)])
def test_forms_agree_with_np_cov(n_rows, dim):
    rng = np.random.default_rng(0)
    G, v = pt.matrix("G"), pt.vector("v")
    cov = NoiseCovariance(G, dim, n_rows)
    outputs = []
    for form in ("lowrank", "full", "diag"):
        c = cov.as_form(form)
        outputs += [c.matvec(v), c.trace(), c.diagonal()]
    fn = python_function([G, v], outputs)
    g, vec = rng.standard_normal((n_rows, dim)), rng.standard_normal(dim)
    # Rows scaled by N/n: Sigma = (N^2/n) V = n np.cov(scaled rows).
    sigma = n_rows * np.cov(g.T)
    np.testing.assert_allclose(sigma, sample_covariance(g), rtol=1e-12, atol=1e-12)
    lr_mv, lr_tr, lr_diag, f_mv, f_tr, f_diag, d_mv, d_tr, d_diag = fn(g, vec)
    for mv, tr, diag in [(lr_mv, lr_tr, lr_diag), (f_mv, f_tr, f_diag)]:
        np.testing.assert_allclose(mv, sigma @ vec, rtol=1e-10)
        np.testing.assert_allclose(tr, np.trace(sigma), rtol=1e-10)
        np.testing.assert_allclose(diag, np.diag(sigma), rtol=1e-10)
    np.testing.assert_allclose(d_mv, np.diag(sigma) * vec, rtol=1e-10)
    np.testing.assert_allclose(d_tr, np.trace(sigma), rtol=1e-10)
    np.testing.assert_allclose(d_diag, np.diag(sigma), rtol=1e-10)


@pytest.mark.parametrize("n_rows, dim", [(40, 6), (6, 40)])
def test_preconditioned_estimate_is_s_sigma_s(n_rows, dim):
    # The column scale S (the diagonal preconditioner) and the centring are applied lazily, on
    # vectors; every form must still be S Sigma S of the rows. The rows' mean is 100 times
    # their spread (a chain far from the mode): the uncentred sums lose about 4 of float64's
    # 16 digits there, so 1e-9 relative is asserted.
    rng = np.random.default_rng(5)
    G, v, s = pt.matrix("G"), pt.vector("v"), pt.vector("s")
    cov = NoiseCovariance(G, dim, n_rows).scaled(s).scaled(2.0 * pt.ones(dim))
    alpha, b = 1.3, 0.02
    fn = python_function(
        [G, v, s],
        [
            cov.matvec(v),
            cov.trace(),
            cov.diagonal(),
            cov.dense(),
            cov.solve_shifted(alpha, b, v),
            cov.solve_shifted_cg(alpha, b, v, 60),
        ],
    )
    g = rng.standard_normal((n_rows, dim)) + 100.0 * rng.standard_normal(dim)
    scale, vec = rng.uniform(0.5, 2.0, dim), rng.standard_normal(dim)
    columns = np.diag(2.0 * scale)
    sigma = columns @ sample_covariance(g) @ columns
    mv, tr, diag, dense, direct, cg = fn(g, vec, scale)
    np.testing.assert_allclose(mv, sigma @ vec, rtol=1e-9)
    np.testing.assert_allclose(tr, np.trace(sigma), rtol=1e-9)
    np.testing.assert_allclose(diag, np.diag(sigma), rtol=1e-9)
    np.testing.assert_allclose(dense, sigma, rtol=1e-9, atol=1e-9 * np.abs(sigma).max())
    expected = np.linalg.solve(alpha * np.eye(dim) + b * sigma, vec)
    np.testing.assert_allclose(direct, expected, rtol=1e-9)
    np.testing.assert_allclose(cg, expected, rtol=1e-8)


@pytest.mark.parametrize("n_rows, dim", [(40, 6), (6, 40)])
def test_damping_solves_match_dense_solve(n_rows, dim):
    # Woodbury (n < D), D x D (D <= n) and conjugate gradients against numpy.linalg.solve.
    rng = np.random.default_rng(1)
    G, v = pt.matrix("G"), pt.vector("v")
    cov = NoiseCovariance(G, dim, n_rows)
    alpha, b = 1.3, 0.02
    fn = python_function(
        [G, v], [cov.solve_shifted(alpha, b, v), cov.solve_shifted_cg(alpha, b, v, 60)]
    )
    g, vec = 3 * rng.standard_normal((n_rows, dim)), rng.standard_normal(dim)
    expected = np.linalg.solve(alpha * np.eye(dim) + b * sample_covariance(g), vec)
    direct, cg = fn(g, vec)
    np.testing.assert_allclose(direct, expected, rtol=1e-9)
    np.testing.assert_allclose(cg, expected, rtol=1e-8)


@pytest.mark.parametrize("tolerance", ["half", "single", "double"])
@pytest.mark.parametrize("n_rows, dim", [(30, 8), (5, 20), (500, 100)])
def test_expm_matvec_meets_its_error_bound(n_rows, dim, tolerance):
    # The Lanczos product stops where its bound on the error, relative to ||v||, meets the
    # tolerance u; checked against scipy's expm over ||t Sigma|| from 1e-6 to 100, for full
    # rank and rank-deficient (n < D: Lanczos breaks down, exactly, at the rank) estimates.
    # Rounding adds some 1e-15 relative, up to 1.5e-14 at ||t Sigma|| = 100 on the rank-4
    # estimate: "double" (2^-53) is checked at 100 eps, where expm_matvec documents that a
    # tolerance below rounding is met. The product count grows with the tolerance and the
    # norm, and stays far below the Taylor product's (9 at ||t Sigma|| = 0.4, D = 100).
    from pymc_sgmcmc.krylov import EXPM_TOLERANCE

    rng = np.random.default_rng(2)
    G, v, scale = pt.matrix("G"), pt.vector("v"), pt.scalar("scale")
    result, products = NoiseCovariance(G, dim, n_rows).expm_matvec(scale, v, tolerance, 200)
    fn = python_function([G, v, scale], [result, products])
    g, vec = rng.standard_normal((n_rows, dim)), rng.standard_normal(dim)
    sigma = sample_covariance(g)
    top = np.linalg.eigvalsh(sigma).max()
    counts = []
    for norm in [1e-6, 0.1, 0.4, 1.0, 10.0, 100.0]:
        t = -norm / top  # ||t Sigma||_2 = norm
        out, count = fn(g, vec, t)
        error = np.linalg.norm(out - scipy.linalg.expm(t * sigma) @ vec) / np.linalg.norm(vec)
        assert error <= max(EXPM_TOLERANCE[tolerance], 100 * np.finfo(float).eps), (norm, error)
        counts.append(int(count))
    assert counts == sorted(counts)  # more products for larger norms
    if (n_rows, dim, tolerance) == (500, 100, "half"):
        assert counts[2] <= 4  # ||t Sigma|| = 0.4, as at h = 1e-3 on the D = 100 regression


def test_expm_matvec_of_the_diagonal_form_is_exact():
    # The diagonal estimate's exponential is elementwise: exact, and no Sigma-products.
    rng = np.random.default_rng(3)
    G, v, scale = pt.matrix("G"), pt.vector("v"), pt.scalar("scale")
    result, products = NoiseCovariance(G, 8, 30).as_form("diag").expm_matvec(scale, v)
    g, vec = rng.standard_normal((30, 8)), rng.standard_normal(8)
    out, count = python_function([G, v, scale], [result, products])(g, vec, -0.7)
    expected = scipy.linalg.expm(-0.7 * np.diag(np.diag(sample_covariance(g)))) @ vec
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    assert count == 0


def test_expm_matvec_at_the_cap_keeps_accurate_products_only():
    # At the cap the a-posteriori estimate decides: ||t Sigma|| = 1e4 leaves only the
    # smallest eigen-directions, which 40 products resolve (the bound alone would take
    # thousands); 3 products at ||t Sigma|| = 10 are far from the result and give NaN.
    rng = np.random.default_rng(4)
    G, v, scale = pt.matrix("G"), pt.vector("v"), pt.scalar("scale")
    cov = NoiseCovariance(G, 50, 200)
    fn = python_function(
        [G, v, scale], [cov.expm_matvec(scale, v, "half", cap)[0] for cap in (40, 3)]
    )
    g, vec = rng.standard_normal((200, 50)), rng.standard_normal(50)
    sigma = sample_covariance(g)
    top = np.linalg.eigvalsh(sigma).max()
    out, _ = fn(g, vec, -1e4 / top)
    expected = scipy.linalg.expm(-1e4 / top * sigma) @ vec
    assert np.linalg.norm(out - expected) <= 2.0**-11 * np.linalg.norm(vec)
    _, short = fn(g, vec, -10.0 / top)
    assert np.isnan(short).all()


@pytest.mark.parametrize("n_rows, dim", [(40, 6), (6, 40)])
def test_ledoit_wolf_statistics_match_their_definition(n_rows, dim):
    # Ledoit & Wolf (2004): beta^2 = (1/n^2) sum_i ||x_i x_i^T - S||_F^2, delta^2 = ||S - mu I||_F^2
    # with S the 1/n-normalised covariance of the centred rows, computed here term by term.
    from pymc_sgmcmc.model_layer import ledoit_wolf_statistics

    rng = np.random.default_rng(3)
    rows = rng.standard_normal((n_rows, dim)) * rng.uniform(0.5, 3.0, dim) + 7.0
    x = rows - rows.mean(0)
    s = x.T @ x / n_rows
    mu = np.trace(s) / dim
    beta2 = sum(np.sum((np.outer(xi, xi) - s) ** 2) for xi in x) / n_rows**2
    delta2 = np.sum((s - mu * np.eye(dim)) ** 2)
    np.testing.assert_allclose(ledoit_wolf_statistics(rows), (beta2, delta2), rtol=1e-10)
    # Invariant to a common scale of the rows, as the intensity beta^2 / delta^2 must be.
    scaled = ledoit_wolf_statistics(1e4 * rows)
    np.testing.assert_allclose(scaled[0] / scaled[1], beta2 / delta2, rtol=1e-10)
    # Diagonal target (Schafer & Strimmer 2005, target D): the same sums over the off-diagonal
    # entries only, the diagonal being the target's own.
    off = ~np.eye(dim, dtype=bool)
    beta2_off = sum(np.sum(((np.outer(xi, xi) - s) ** 2)[off]) for xi in x) / n_rows**2
    delta2_off = np.sum(s[off] ** 2)
    np.testing.assert_allclose(
        ledoit_wolf_statistics(rows, "diagonal"), (beta2_off, delta2_off), rtol=1e-10
    )


SHIFT = (1.3, 0.02)  # (a, b) of the shifted solves and square roots below


def shrunk_operations(n_rows: int, dim: int, target: str, extra=lambda shrunk, v: []):
    """Compiled (G, v, rho, t) -> every operation the integrators use on the low-rank form
    shrunk towards ``target``, then ``extra(shrunk, v)``: matvec, dense, diagonal, trace,
    the shifted solve (D x D when D <= n, Woodbury when n < D), CG, exp(t Sigma) v."""
    G, v, rho, t = pt.matrix("G"), pt.vector("v"), pt.scalar("rho"), pt.scalar("t")
    shrunk = NoiseCovariance(G, dim, n_rows).shrunk(rho, target)
    a, b = SHIFT
    expm, _ = shrunk.expm_matvec(t, v, "double")
    outputs = [
        shrunk.matvec(v),
        shrunk.dense(),
        shrunk.diagonal(),
        shrunk.trace(),
        shrunk.solve_shifted(a, b, v),
        shrunk.solve_shifted_cg(a, b, v, 60),
        expm,
        *extra(shrunk, v),
    ]
    return python_function([G, v, rho, t], outputs)


def assert_operations_match_dense(outputs, dense, sigma, vec, t_val):
    """The shared outputs of :func:`shrunk_operations` against the dense shrunk matrix."""
    a, b = SHIFT
    mv, full, diag, tr, solved, cg, ex = outputs
    np.testing.assert_allclose(mv, dense @ vec, rtol=1e-10)
    np.testing.assert_allclose(full, dense, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(diag, np.diag(dense), rtol=1e-10)
    np.testing.assert_allclose(tr, np.trace(sigma), rtol=1e-10)
    shifted = a * np.eye(len(vec)) + b * dense
    np.testing.assert_allclose(solved, np.linalg.solve(shifted, vec), rtol=1e-9)
    # CG stops at a residual of 1e-10 ||v||: small entries carry that absolute error.
    expected = np.linalg.solve(shifted, vec)
    np.testing.assert_allclose(cg, expected, rtol=1e-8, atol=1e-9 * np.abs(expected).max())
    np.testing.assert_allclose(ex, scipy.linalg.expm(t_val * dense) @ vec, rtol=1e-11)


@pytest.mark.parametrize("n_rows, dim", [(40, 6), (6, 40)])
def test_diagonally_shrunk_covariance_operations_match_dense(n_rows, dim):
    # (1 - rho) Sigma + rho diag(Sigma) through every operation NOGIN and mCCAdL use, on the
    # low-rank form: D x D solve when D <= n, Woodbury with a diagonal shift when n < D.
    rng = np.random.default_rng(5)
    fn = shrunk_operations(n_rows, dim, "diagonal")
    # Columns of very different scales: the diagonal target keeps them, the identity would not.
    g = rng.standard_normal((n_rows, dim)) * np.geomspace(0.1, 3.0, dim)
    vec = rng.standard_normal(dim)
    sigma = sample_covariance(g)
    for intensity in (0.0, 0.3, 1.0):
        dense = (1 - intensity) * sigma + intensity * np.diag(np.diag(sigma))
        t_val = -2.0 / np.linalg.eigvalsh(dense).max()
        assert_operations_match_dense(fn(g, vec, intensity, t_val), dense, sigma, vec, t_val)
        np.testing.assert_allclose(np.diag(dense), np.diag(sigma), rtol=1e-10)


def test_woodbury_solve_takes_a_diagonal_shift():
    # (diag(alpha) + b Sigma)^{-1} v through the n x n system (n < D), against a dense solve.
    rng = np.random.default_rng(6)
    n_rows, dim = 7, 30
    G, v, alpha = pt.matrix("G"), pt.vector("v"), pt.vector("alpha")
    fn = python_function(
        [G, v, alpha], NoiseCovariance(G, dim, n_rows).solve_shifted(alpha, 0.1, v)
    )
    g, vec = rng.standard_normal((n_rows, dim)), rng.standard_normal(dim)
    alphas = rng.uniform(0.5, 5.0, dim)
    expected = np.linalg.solve(np.diag(alphas) + 0.1 * sample_covariance(g), vec)
    np.testing.assert_allclose(fn(g, vec, alphas), expected, rtol=1e-10)


@pytest.mark.parametrize("n_rows, dim", [(40, 6), (6, 40)])
def test_shrunk_covariance_operations_match_dense(n_rows, dim):
    # (1 - rho) Sigma + rho tr(Sigma)/D I through every operation the integrators use, on
    # the low-rank form (Woodbury when n < D, D x D solve otherwise).
    rng = np.random.default_rng(4)
    a, b = SHIFT
    fn = shrunk_operations(
        n_rows, dim, "identity", lambda shrunk, v: list(shrunk.sqrt_shifted_matvec(a, b, v))
    )
    # Rows small enough that a I - b Sigma stays positive definite (a real square root).
    g, vec = 0.3 * rng.standard_normal((n_rows, dim)), rng.standard_normal(dim)
    sigma = sample_covariance(g)
    for intensity in (0.0, 0.3, 1.0):
        dense = (1 - intensity) * sigma + intensity * np.trace(sigma) / dim * np.eye(dim)
        t_val = -2.0 / np.linalg.eigvalsh(dense).max()
        *outputs, rt, me = fn(g, vec, intensity, t_val)
        assert_operations_match_dense(outputs, dense, sigma, vec, t_val)
        assert np.linalg.eigvalsh(dense).min() >= intensity * np.trace(sigma) / dim - 1e-9
        eigvals = np.linalg.eigvalsh(a * np.eye(dim) - b * dense)
        assert eigvals.min() > 0
        expected_root = scipy.linalg.sqrtm(a * np.eye(dim) - b * dense).real @ vec
        np.testing.assert_allclose(rt, expected_root, rtol=1e-9)
        np.testing.assert_allclose(me, eigvals.min(), rtol=1e-9)


@pytest.mark.parametrize("target", [None, "identity", "diagonal"])
def test_products_and_trace_from_single_precision_rows_are_those_of_the_rounded_rows(target):
    # matvec and trace with single_precision_rows=True read G rounded to float32, as the
    # Krylov kernels do, and sum in float64, with the float64 mean m: the product is
    # n / (n - 1) G^T (G v - m . v) of the rounded rows, the trace n / (n - 1) (sum of their
    # squares - n |m|^2), as the float64 ones are computed from G; shrunk as usual (the
    # target from the float64 rows). About 1e-7 from the float64 results.
    rng = np.random.default_rng(8)
    n_rows, dim, rho = 50, 7, 0.3
    g, vec = rng.standard_normal((n_rows, dim)) + 0.5, rng.standard_normal(dim)
    G, v = pt.matrix("G"), pt.vector("v")
    cov = NoiseCovariance(G, dim, n_rows)
    if target is not None:
        cov = cov.shrunk(rho, target)
    fn = python_function(
        [G, v],
        [cov.matvec(v), cov.trace(), cov.matvec(v, True), cov.trace(single_precision_rows=True)],
    )
    exact_mv, exact_tr, single_mv, single_tr = fn(g, vec)
    sigma = sample_covariance(g)
    rounded = g.astype(np.float32).astype(np.float64)
    centred = rounded - g.mean(0)
    rounded_mv = n_rows / (n_rows - 1) * rounded.T @ (centred @ vec)
    squares = np.sum(rounded**2) - n_rows * np.sum(g.mean(0) ** 2)
    rounded_tr = n_rows / (n_rows - 1) * squares
    if target is not None:
        level = np.trace(sigma) / dim if target == "identity" else np.diag(sigma)
        rounded_mv = (1 - rho) * rounded_mv + rho * level * vec
        rounded_tr = (1 - rho) * rounded_tr + rho * np.trace(sigma)
    np.testing.assert_allclose(single_mv, rounded_mv, rtol=1e-12)
    np.testing.assert_allclose(single_tr, rounded_tr, rtol=1e-12)
    np.testing.assert_allclose(exact_tr, np.trace(sigma), rtol=1e-12)
    assert single_tr != exact_tr and abs(single_tr / exact_tr - 1) < 1e-6
    assert np.any(single_mv != exact_mv)
    assert np.linalg.norm(single_mv - exact_mv) < 1e-6 * np.linalg.norm(exact_mv)


def test_dense_functions_of_sigma_match_scipy():
    # The damping operators a periodic average makes: exp(t Sigma) for mCCAdL's C step and
    # (alpha I + b Sigma)^{-1} for NOGIN's O step, as D x D matrices and as diagonals.
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((30, 6)) * np.arange(1.0, 7.0)
    sigma = rows.T @ rows / 30
    dense = DenseCovariance(pt.constant(sigma), 6)
    np.testing.assert_allclose(dense.expm(-0.3).eval(), scipy.linalg.expm(-0.3 * sigma), rtol=1e-10)
    inverse = np.linalg.inv(1.5 * np.eye(6) + 0.2 * sigma)
    np.testing.assert_allclose(dense.inverse_shifted(1.5, 0.2).eval(), inverse, rtol=1e-10)
    diagonal = DiagonalCovariance(pt.constant(np.diag(sigma)), 6)
    np.testing.assert_allclose(diagonal.expm(-0.3).eval(), np.exp(-0.3 * np.diag(sigma)))
    np.testing.assert_allclose(
        diagonal.inverse_shifted(1.5, 0.2).eval(), 1.0 / (1.5 + 0.2 * np.diag(sigma))
    )
