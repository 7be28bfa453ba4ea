"""Covariance operators: the three forms, the damping solves and the exp(t Sigma) v product."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg

from pymc_sgmcmc.model_layer import NoiseCovariance


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
    fn = pytensor.function([G, v], outputs)
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
def test_damping_solves_match_dense_solve(n_rows, dim):
    # Woodbury (n < D), D x D (D <= n) and conjugate gradients against numpy.linalg.solve.
    rng = np.random.default_rng(1)
    G, v = pt.matrix("G"), pt.vector("v")
    cov = NoiseCovariance(G, dim, n_rows)
    alpha, b = 1.3, 0.02
    fn = pytensor.function(
        [G, v], [cov.solve_shifted(alpha, b, v), cov.solve_shifted_cg(alpha, b, v, 60)]
    )
    g, vec = 3 * rng.standard_normal((n_rows, dim)), rng.standard_normal(dim)
    expected = np.linalg.solve(alpha * np.eye(dim) + b * sample_covariance(g), vec)
    direct, cg = fn(g, vec)
    np.testing.assert_allclose(direct, expected, rtol=1e-9)
    np.testing.assert_allclose(cg, expected, rtol=1e-8)


@pytest.mark.parametrize("norm", [1e-6, 0.1, 1.0, 10.0, 100.0])
@pytest.mark.parametrize("n_rows, dim", [(30, 8), (5, 20)])
def test_expm_matvec_matches_scipy_expm(norm, n_rows, dim):
    # Relative error at the documented tolerance (double-precision backward error 2^-53,
    # amplified by the condition of exp on the spectrum: 1e-12 relative is asserted).
    rng = np.random.default_rng(2)
    G, v, scale = pt.matrix("G"), pt.vector("v"), pt.scalar("scale")
    cov = NoiseCovariance(G, dim, n_rows)
    result, s, m = cov.expm_matvec(scale, v)
    fn = pytensor.function([G, v, scale], [result, s, m])
    g, vec = rng.standard_normal((n_rows, dim)), rng.standard_normal(dim)
    sigma = sample_covariance(g)
    t = -norm / np.linalg.eigvalsh(sigma).max()  # ||t Sigma||_2 = norm
    out, s_val, m_val = fn(g, vec, t)
    expected = scipy.linalg.expm(t * sigma) @ vec
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14 * np.abs(vec).max())
    assert s_val >= 1 and 1 <= m_val <= 30
    # The cost follows the rule: at most that of ||M|| <= 1.5 |t| lambda_max (the estimate).
    from pymc_sgmcmc.model_layer import THETA_TAYLOR

    bound = 1.5 * norm
    degrees = np.arange(1, 31)
    assert s_val * m_val <= np.min(degrees * np.maximum(1, np.ceil(bound / THETA_TAYLOR)))
