"""The model layer: forces, per-observation gradients and noise covariances of PyMC models."""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.special
import scipy.stats
from models import GaussianRegression
from pymc.logprob.basic import transformed_conditional_logp
from pymc.logprob.utils import CheckParameterValue
from python_backend import python_function

from pymc_sgmcmc import SGNHT, model_layer
from pymc_sgmcmc.model_layer import (
    ControlVariate,
    DenseCovariance,
    ModelError,
    NoiseCovariance,
    Preconditioner,
    SGModel,
    non_centred_products,
)
from pymc_sgmcmc.rewrite_cache import _graph_key, caching_rewrites


def compile_layer(sg: SGModel):
    force, noise = sg.force_and_noise(sg.theta, sg.indices)
    logp = sg.logp_at(sg.theta, sg.indices)
    outputs = [force, logp, sg.per_observation_gradients, noise.dense(), noise.trace()]
    return pytensor.function([sg.theta, *sg.indices], outputs, mode="FAST_COMPILE")


def test_force_scales_minibatch_by_n_over_N_exactly_once():
    problem = GaussianRegression.make(n_obs=400, dim=3, batch_size=40)
    with problem.model() as model:
        sg = SGModel(model, model.value_vars)
    fn = compile_layer(sg)
    rng = np.random.default_rng(1)
    theta = rng.standard_normal(3)
    idx = rng.integers(0, 400, size=40)
    force, logp, grads, cov, trace = fn(theta, idx)
    g = problem.per_observation_gradients(theta)[idx]
    expected = -theta / problem.prior_sd**2 + (400 / 40) * g.sum(0)
    np.testing.assert_allclose(force, expected, rtol=1e-10)
    np.testing.assert_allclose(grads, (400 / 40) * g, rtol=1e-10)
    # Sigma = (N^2/n) V with V the sample covariance of the unscaled g_i.
    np.testing.assert_allclose(cov, 400**2 / 40 * np.cov(g.T), rtol=1e-10)
    np.testing.assert_allclose(trace, np.trace(cov), rtol=1e-10)
    # The log-density estimate: log prior + (N/n) * batch log-likelihood.
    resid = problem.y[idx] - problem.X[idx] @ theta
    loglik = -0.5 * resid**2 - 0.5 * np.log(2 * np.pi)
    logprior = -0.5 * theta**2 / 100 - 0.5 * np.log(2 * np.pi * 100)
    np.testing.assert_allclose(logp, logprior.sum() + 10 * loglik.sum(), rtol=1e-10)


def test_control_variate_force_is_exact_at_the_anchor_and_unbiased_elsewhere():
    # Baker et al.'s F(anchor) + F~(theta) - F~(anchor): the full-data force at the anchor
    # for every minibatch; averaged over minibatches that partition the data, the full-data
    # force anywhere; its noise covariance the spread of g_i(theta) - g_i(anchor).
    problem = GaussianRegression.make(n_obs=400, dim=3, batch_size=40)
    with problem.model() as model:
        sg = SGModel(model, model.value_vars)
    rng = np.random.default_rng(2)
    anchor, theta = rng.standard_normal(3), rng.standard_normal(3)

    def exact_force(w):
        return -w / problem.prior_sd**2 + problem.per_observation_gradients(w).sum(0)

    np.testing.assert_allclose(sg.full_data_force(anchor), exact_force(anchor), rtol=1e-10)
    with GaussianRegression.make(n_obs=400, dim=3, batch_size=30).model() as uneven:
        # 400 rows in chunks of 30: the last chunk wraps around, its repeats dropped.
        force = SGModel(uneven, uneven.value_vars).full_data_force(anchor)
        np.testing.assert_allclose(force, exact_force(anchor), rtol=1e-10)
    control = ControlVariate(pt.vector("anchor"), pt.vector("anchor_force"))
    force, noise = sg.force_and_noise(sg.theta, sg.indices, control=control)
    inputs = [sg.theta, *sg.indices, control.anchor, control.anchor_force]
    fn = pytensor.function(inputs, [force, noise.dense()], mode="FAST_COMPILE")
    chunks = np.arange(400).reshape(10, 40)
    at_anchor = [fn(anchor, idx, anchor, exact_force(anchor))[0] for idx in chunks[:3]]
    np.testing.assert_allclose(at_anchor, [exact_force(anchor)] * 3, rtol=1e-10)
    forces, covs = zip(
        *(fn(theta, idx, anchor, exact_force(anchor)) for idx in chunks), strict=True
    )
    np.testing.assert_allclose(np.mean(forces, axis=0), exact_force(theta), rtol=1e-10)
    g = problem.per_observation_gradients(theta) - problem.per_observation_gradients(anchor)
    np.testing.assert_allclose(covs[0], 400**2 / 40 * np.cov(g[chunks[0]].T), rtol=1e-10)


def transformed_model(n_obs=60, batch=12, seed=3):
    """Several transformed free variables, two pm.Minibatch calls (different data sets, same
    batch size) and two observed variables sharing one of them."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_obs, 2))
    y = X @ [1.0, -1.0] + rng.standard_normal(n_obs)
    u = rng.standard_normal(n_obs)
    z = rng.standard_normal(2 * n_obs)
    with pm.Model() as model:
        X_mb, y_mb, u_mb = pm.Minibatch(X, y, u, batch_size=batch)
        z_mb = pm.Minibatch(z, batch_size=batch)
        sigma = pm.HalfNormal("sigma", 1.0)  # log
        p = pm.Beta("p", 2.0, 2.0)  # logodds
        cut = pm.Normal("cut", [-1.0, 1.0], 1.0, transform=pm.distributions.transforms.ordered)
        weights = pm.Dirichlet("weights", np.ones(3))  # simplex
        beta = pm.Normal("beta", 0.0, 1.0, shape=2)
        pm.Normal("y", X_mb @ beta, sigma, observed=y_mb, total_size=n_obs)
        pm.Normal("u", weights[0] - p + X_mb[:, 0], 1.0, observed=u_mb, total_size=n_obs)
        pm.Normal("z", cut[0] + cut[1] * weights[1], p, observed=z_mb, total_size=2 * n_obs)
    return model


def scaled_row_logps(sg: SGModel):
    """Reference for the rows of G, independent of the vectorised graph: row i's scaled term
    (N/n) log p(x_i) is the batch log-density of a batch repeating row i n times, minus the
    full-data part, divided by n."""
    fn = pytensor.function([sg.theta, *sg.indices], sg.logp - sg.fixed_logp, mode="FAST_COMPILE")

    def rows(theta, idx):
        n = sg.batch_size
        return np.array([fn(theta, *[np.full(n, k[i]) for k in idx]) / n for i in range(n)])

    return rows


def finite_difference_jacobian(f, theta, eps=1e-6):
    cols = []
    for j in range(theta.size):
        e = np.zeros_like(theta)
        e[j] = eps
        cols.append((f(theta + e) - f(theta - e)) / (2 * eps))
    return np.stack(cols, axis=-1)


def test_per_observation_gradients_match_finite_differences_with_transforms():
    model = transformed_model()
    sg = SGModel(model, model.value_vars)
    assert sg.dim == 1 + 1 + 2 + 2 + 2  # sigma, p, cut, weights (simplex: K-1), beta
    assert sorted(s.total_size for s in sg.sources) == [60, 120]
    sg.check_factorisation()
    fn = pytensor.function(
        [sg.theta, *sg.indices],
        [sg.per_observation_gradients, sg.force, sg.fixed_force],
        mode="FAST_COMPILE",
    )
    rng = np.random.default_rng(0)
    theta = sg.initial_theta + 0.3 * rng.standard_normal(sg.dim)
    idx = [rng.integers(0, s.total_size, 12) for s in sg.sources]
    grads, force, fixed = fn(theta, *idx)
    rows = scaled_row_logps(sg)
    reference = finite_difference_jacobian(lambda th: rows(th, idx), theta)
    np.testing.assert_allclose(grads, reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(force, fixed + grads.sum(0), rtol=1e-10)
    # The full-data part is the prior with its Jacobian terms: compare with PyMC's own.
    prior = model.compile_logp(vars=model.free_RVs)
    template = {v.name: model.initial_point()[v.name] for v in model.value_vars}
    reference_fixed = finite_difference_jacobian(
        lambda th: np.atleast_1d(prior(split_like(template, th))), theta
    )[0]
    np.testing.assert_allclose(fixed, reference_fixed, rtol=1e-5, atol=1e-6)


def _softmax_regression(likelihood: str, n_obs=40, dim=3, classes=4, batch=8, seed=5):
    """Multinomial logistic regression, the softmax written three ways. PyTensor 3 builds
    softmax / log_softmax as ``SymbolicOp``s typed for the batch they were first applied to,
    which once kept the batch size in the one-row graph (issue 5)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_obs, dim))
    y = rng.integers(0, classes, n_obs).astype("int32")
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=batch)
        W = pm.Normal("W", 0.0, 2.0, shape=(dim, classes))
        logits = X_mb @ W
        if likelihood == "logit_p":
            pm.Categorical("y", logit_p=logits, observed=y_mb, total_size=n_obs)
        elif likelihood == "p":
            pm.Categorical(
                "y", p=pt.special.softmax(logits, axis=-1), observed=y_mb, total_size=n_obs
            )
        else:

            def logp(value, eta):
                log_p = pt.special.log_softmax(eta, axis=-1)
                return pt.take_along_axis(log_p, value[:, None], axis=-1)[:, 0]

            pm.CustomDist(
                "y",
                logits,
                logp=logp,
                signature="(k)->()",
                dtype="int32",
                observed=y_mb,
                total_size=n_obs,
            )
    return model, X, y


@pytest.mark.parametrize("likelihood", ["logit_p", "p", "custom_log_softmax"])
def test_categorical_likelihood_per_observation_gradients(likelihood):
    n_obs, dim, classes, batch = 40, 3, 4, 8
    model, X, y = _softmax_regression(likelihood, n_obs, dim, classes, batch)
    sg = SGModel(model, model.value_vars)
    fn = compile_layer(sg)
    rng = np.random.default_rng(2)
    theta = rng.standard_normal(dim * classes)
    idx = rng.integers(0, n_obs, batch)
    force, logp, grads, _, _ = fn(theta, idx)
    # Row i's scaled term (N/n) log softmax(x_i W)[y_i] has gradient
    # (N/n) x_i (onehot(y_i) - softmax(x_i W)) with respect to W, raveled row-major.
    W = theta.reshape(dim, classes)
    logits = X[idx] @ W
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    residual = np.eye(classes)[y[idx]] - probs
    expected = (n_obs / batch) * np.einsum("id,ik->idk", X[idx], residual).reshape(batch, -1)
    np.testing.assert_allclose(grads, expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(force, -theta / 4.0 + expected.sum(0), rtol=1e-10)
    loglik = np.log(probs[np.arange(batch), y[idx]]).sum()
    logprior = (-0.5 * theta**2 / 4.0 - 0.5 * np.log(2 * np.pi * 4.0)).sum()
    # log(softmax) as PyMC's Categorical takes it loses a few more digits than the gradients.
    np.testing.assert_allclose(logp, logprior + (n_obs / batch) * loglik, rtol=1e-8)
    # And independently of the closed form: finite differences of the row log-densities.
    reference = finite_difference_jacobian(lambda th: scaled_row_logps(sg)(th, [idx]), theta)
    np.testing.assert_allclose(grads, reference, rtol=1e-5, atol=1e-6)


def test_normal_mixture_likelihood_per_observation_gradients():
    # pm.NormalMixture is a SymbolicRandomVariable whose components' shapes follow the batch;
    # the one-row graph must rebuild it for one row instead of forcing the batch's shape on it.
    n_obs, batch, weights = 60, 6, np.array([1 / 3, 2 / 3])
    y = np.random.default_rng(4).standard_normal(n_obs)
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 10.0, shape=2)
        y_mb = pm.Minibatch(y, batch_size=batch)
        pm.NormalMixture("y", w=weights, mu=mu, sigma=1.0, observed=y_mb, total_size=n_obs)
    sg = SGModel(model, model.value_vars)
    force, logp, grads, _, _ = compile_layer(sg)(
        theta := np.array([-0.7, 0.4]), idx := np.arange(6)
    )
    # d/d mu_k of log sum_j w_j N(y | mu_j, 1) = r_k (y - mu_k), r the responsibilities.
    dens = weights * np.exp(-0.5 * (y[idx, None] - theta) ** 2)
    resp = dens / dens.sum(1, keepdims=True)
    expected = (n_obs / batch) * resp * (y[idx, None] - theta)
    np.testing.assert_allclose(grads, expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(force, -theta / 100.0 + expected.sum(0), rtol=1e-10)
    loglik = np.log(dens.sum(1) / np.sqrt(2 * np.pi)).sum()
    logprior = (-0.5 * theta**2 / 100.0 - 0.5 * np.log(2 * np.pi * 100.0)).sum()
    # PyMC's mixture log-density (a logsumexp) agrees to 7e-10 relative, not to the last digit.
    np.testing.assert_allclose(logp, logprior + (n_obs / batch) * loglik, rtol=1e-8)


def test_zero_inflated_likelihood_per_observation_gradients():
    # pm.ZeroInflatedPoisson is a mixture whose DiracDelta(0) component takes its size from
    # the batch's shape: the one-row graph must give one row's term, not n copies of it.
    n_obs, batch = 60, 6
    rng = np.random.default_rng(6)
    counts = np.where(rng.random(n_obs) < 0.3, 0, rng.poisson(3.0, n_obs)).astype(np.int32)
    with pm.Model() as model:
        psi = pm.Beta("psi", 1.0, 1.0)
        mu = pm.Gamma("mu", 2.0, 1.0)
        c_mb = pm.Minibatch(counts, batch_size=batch)
        pm.ZeroInflatedPoisson("c", psi=psi, mu=mu, observed=c_mb, total_size=n_obs)
    sg = SGModel(model, model.value_vars)
    idx = np.array([9, 0, 10, 18, 12, 8])
    assert (counts[idx] == 0).any() and (counts[idx] > 0).any()
    _, _, grads, _, _ = compile_layer(sg)(theta := np.array([0.4, 0.9]), idx)
    # Coordinates logit(psi) and log(mu). A zero: log(1 - psi + psi e^-mu); a count c > 0:
    # log(psi) + c log(mu) - mu - log(c!).
    p, m, c = 1 / (1 + np.exp(-theta[0])), np.exp(theta[1]), counts[idx]
    zero = 1 - p + p * np.exp(-m)
    d_logit = np.where(c == 0, (np.exp(-m) - 1) * p * (1 - p) / zero, 1 - p)
    d_logmu = np.where(c == 0, -p * np.exp(-m) * m / zero, c - m)
    expected = (n_obs / batch) * np.stack([d_logit, d_logmu], axis=1)
    np.testing.assert_allclose(grads, expected, rtol=1e-10, atol=1e-12)


def test_multivariate_rows_per_observation_gradients():
    # pm.MvNormal rows: each observation is a row of 2 values with one joint density. PyMC
    # records total_size=(N, None) for it, which the one-row graph must carry over.
    n_obs, batch = 50, 5
    cov = np.array([[1.0, 0.5], [0.5, 2.0]])
    Y = np.random.default_rng(5).multivariate_normal([1.0, -1.0], cov, size=n_obs)
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 10.0, shape=2)
        Y_mb = pm.Minibatch(Y, batch_size=batch)
        pm.MvNormal("y", mu, cov, observed=Y_mb, total_size=n_obs)
    sg = SGModel(model, model.value_vars)
    force, logp, grads, _, _ = compile_layer(sg)(
        theta := np.array([0.3, -0.2]), idx := np.array([4, 0, 17, 4, 33])
    )
    # d/d mu of log N(y_i | mu, C) = C^-1 (y_i - mu), scaled by N/n.
    expected = (n_obs / batch) * np.linalg.solve(cov, (Y[idx] - theta).T).T
    np.testing.assert_allclose(grads, expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(force, -theta / 100.0 + expected.sum(0), rtol=1e-10)
    resid = Y[idx] - theta
    quad = np.einsum("ij,ij->i", resid, np.linalg.solve(cov, resid.T).T)
    loglik = (-0.5 * quad - 0.5 * np.log(np.linalg.det(2 * np.pi * cov))).sum()
    logprior = (-0.5 * theta**2 / 100.0 - 0.5 * np.log(2 * np.pi * 100.0)).sum()
    # PyMC's density goes through a Cholesky factor: 3e-10 relative from this closed form.
    np.testing.assert_allclose(logp, logprior + (n_obs / batch) * loglik, rtol=1e-8)


def test_a_total_size_along_another_axis_than_the_rows_is_refused():
    # PyMC would scale a batch's log-density by the product over the axes given a total
    # size (total_size=(N, 6) for rows of 3 values: 2 N / n), but only the rows are
    # minibatched, and the layer applies N / n itself (an input of its graphs).
    Y = np.random.default_rng(3).normal(size=(40, 3))
    with pm.Model() as model:
        mu = pm.Normal("mu", 0.0, 10.0)
        pm.Normal("y", mu, 1.0, observed=pm.Minibatch(Y, batch_size=4), total_size=(40, 6))
    with pytest.raises(ModelError, match="total_size along more than its first axis"):
        SGModel(model, model.value_vars)


def _family_data():
    rng = np.random.default_rng(11)
    n_obs = 200
    x, positive = rng.standard_normal(n_obs), rng.gamma(2.0, 1.0, n_obs)
    counts = rng.poisson(2.0, n_obs).astype(np.int32)
    return dict(
        x=x,
        binary=(counts > 1).astype(np.int32),
        clipped=np.clip(x, -2.9, 2.9),
        censored=np.maximum(x, -1.0),
        positive=positive,
        unit=rng.beta(2.0, 3.0, n_obs),
        counts=counts,
        positive_counts=counts + 1,
        zero_inflated=np.where(rng.random(n_obs) < 0.3, 0, counts).astype(np.int32),
        hurdle=np.where(rng.random(n_obs) < 0.3, 0.0, positive),
        pairs=rng.standard_normal((n_obs, 2)),
        series=np.cumsum(rng.standard_normal((n_obs, 6)), axis=1),
        simplex=rng.dirichlet(np.ones(3), n_obs),
        multinomial=rng.multinomial(10, [0.2, 0.3, 0.5], n_obs).astype(np.int32),
    )


#: PyMC likelihood families of parameters a (real) and b (positive): their data and likelihood.
LIKELIHOOD_FAMILIES = {
    "Bernoulli": (
        ("x", "binary"),
        lambda a, b, x, c, **kw: pm.Bernoulli("y", logit_p=a + b * x, observed=c, **kw),
    ),
    "Poisson": (
        ("x", "counts"),
        lambda a, b, x, c, **kw: pm.Poisson("y", pt.exp(a + b * x), observed=c, **kw),
    ),
    "NegativeBinomial": (
        ("counts",),
        lambda a, b, c, **kw: pm.NegativeBinomial(
            "y", mu=pt.exp(a), alpha=b + 0.5, observed=c, **kw
        ),
    ),
    "Binomial": (
        ("counts",),
        lambda a, b, c, **kw: pm.Binomial("y", n=10, p=pm.math.sigmoid(a), observed=c, **kw),
    ),
    "Gamma": (
        ("positive",),
        lambda a, b, p, **kw: pm.Gamma("y", alpha=b + 1, beta=pt.exp(a), observed=p, **kw),
    ),
    "Beta": (
        ("unit",),
        lambda a, b, u, **kw: pm.Beta("y", alpha=b + 1, beta=pt.exp(a) + 1, observed=u, **kw),
    ),
    "LogNormal": (
        ("positive",),
        lambda a, b, p, **kw: pm.LogNormal("y", a, b + 0.5, observed=p, **kw),
    ),
    "Weibull": (
        ("positive",),
        lambda a, b, p, **kw: pm.Weibull("y", b + 1, pt.exp(a), observed=p, **kw),
    ),
    "ZeroInflatedNegativeBinomial": (
        ("zero_inflated",),
        lambda a, b, c, **kw: pm.ZeroInflatedNegativeBinomial(
            "y", psi=pm.math.sigmoid(a), mu=2.0, alpha=b + 0.5, observed=c, **kw
        ),
    ),
    "ZeroInflatedBinomial": (
        ("zero_inflated",),
        lambda a, b, c, **kw: pm.ZeroInflatedBinomial(
            "y", psi=pm.math.sigmoid(a), n=10, p=0.2 + 0.1 * pm.math.sigmoid(b), observed=c, **kw
        ),
    ),
    "HurdlePoisson": (
        ("zero_inflated",),
        lambda a, b, c, **kw: pm.HurdlePoisson(
            "y", psi=pm.math.sigmoid(a), mu=b + 1, observed=c, **kw
        ),
    ),
    "HurdlePoisson regression": (
        ("x", "zero_inflated"),
        lambda a, b, x, c, **kw: pm.HurdlePoisson(
            "y", psi=pm.math.sigmoid(a), mu=pt.exp(a + b * x), observed=c, **kw
        ),
    ),
    "HurdleGamma": (
        ("hurdle",),
        lambda a, b, p, **kw: pm.HurdleGamma(
            "y", psi=pm.math.sigmoid(a), alpha=b + 1, beta=1.0, observed=p, **kw
        ),
    ),
    "Mixture": (
        ("x",),
        lambda a, b, x, **kw: pm.Mixture(
            "y",
            w=[0.3, 0.7],
            comp_dists=[pm.Normal.dist(a, 1), pm.StudentT.dist(nu=4, mu=0, sigma=b + 0.5)],
            observed=x,
            **kw,
        ),
    ),
    "Truncated": (
        ("clipped",),
        lambda a, b, x, **kw: pm.Truncated(
            "y", pm.Normal.dist(a, b + 0.5), lower=-3, upper=3, observed=x, **kw
        ),
    ),
    "Truncated Poisson regression": (
        ("x", "positive_counts"),
        lambda a, b, x, c, **kw: pm.Truncated(
            "y", pm.Poisson.dist(pt.exp(a + b * x)), lower=1, observed=c, **kw
        ),
    ),
    "Censored": (
        ("censored",),
        lambda a, b, x, **kw: pm.Censored(
            "y", pm.Normal.dist(a, b + 0.5), lower=-1, upper=None, observed=x, **kw
        ),
    ),
    "MvNormal rows": (
        ("pairs",),
        lambda a, b, y, **kw: pm.MvNormal(
            "y", pt.stack([a, -a]), (b + 1) * np.eye(2), observed=y, **kw
        ),
    ),
    "MvStudentT rows": (
        ("pairs",),
        lambda a, b, y, **kw: pm.MvStudentT(
            "y", nu=5, mu=pt.stack([a, a]), scale=(b + 1) * np.eye(2), observed=y, **kw
        ),
    ),
    "AR rows": (
        ("series",),
        lambda a, b, y, **kw: pm.AR(
            "y", rho=pt.stack([a]), sigma=b + 0.5, init_dist=pm.Normal.dist(0, 2), observed=y, **kw
        ),
    ),
    "GaussianRandomWalk rows": (
        ("series",),
        lambda a, b, y, **kw: pm.GaussianRandomWalk(
            "y", mu=a, sigma=b + 0.5, init_dist=pm.Normal.dist(0, 2), observed=y, **kw
        ),
    ),
    "Dirichlet rows": (
        ("simplex",),
        lambda a, b, p, **kw: pm.Dirichlet(
            "y", pt.stack([b + 1, pt.exp(a), 1.0]), observed=p, **kw
        ),
    ),
    "Multinomial rows": (
        ("multinomial",),
        lambda a, b, m, **kw: pm.Multinomial(
            "y", n=10, p=pm.math.softmax(pt.stack([a, b, 0.0])), observed=m, **kw
        ),
    ),
}


@pytest.mark.parametrize("family", list(LIKELIHOOD_FAMILIES))
def test_per_observation_gradients_of_pymc_likelihood_families(family):
    # Every family's rows of G against finite differences of its row log-densities (each
    # taken from the batch graph on a batch repeating one row). Before the one-row graph
    # rebuilt PyMC's symbolic random variables, the zero-inflated and hurdle families were
    # rejected as not splitting per observation (their row terms came out n times over) and
    # the multivariate rows (total_size=(N, None)) raised a TypeError. A truncated
    # distribution whose parameters read the batch (a hurdle or truncated count regression)
    # failed to compile until pm.Truncated was rebuilt too, and independent time series as
    # rows (pm.AR, pm.GaussianRandomWalk) until their rebuild was given the op's settings
    # and the walk's batch shape.
    keys, likelihood = LIKELIHOOD_FAMILIES[family]
    data = _family_data()
    n_obs, batch = len(data["x"]), 8
    with pm.Model() as model:
        a = pm.Normal("a", 0.0, 1.0)
        b = pm.HalfNormal("b", 1.0)
        rows = pm.Minibatch(*(data[k] for k in keys), batch_size=batch)
        rows = rows if isinstance(rows, list | tuple) else [rows]
        likelihood(a, b, *rows, total_size=n_obs)
    sg = SGModel(model, model.value_vars)
    sg.check_factorisation()
    rng = np.random.default_rng(3)
    theta = sg.initial_theta + 0.2 * rng.standard_normal(sg.dim)
    idx = [rng.integers(0, n_obs, batch)]
    fn = pytensor.function(
        [sg.theta, *sg.indices], sg.per_observation_gradients, mode="FAST_COMPILE"
    )
    reference = finite_difference_jacobian(lambda th: scaled_row_logps(sg)(th, idx), theta)
    np.testing.assert_allclose(
        fn(theta, *idx), reference, rtol=1e-5, atol=1e-6 * np.abs(reference).max()
    )


def split_like(point, theta):
    out, start = {}, 0
    for name, value in point.items():
        size = np.size(value)
        out[name] = theta[start : start + size].reshape(np.shape(value))
        start += size
    return out


def test_full_batch_model_has_exact_force_and_no_noise():
    problem = GaussianRegression.make(n_obs=50, dim=2, batch_size=None)
    with problem.model() as model:
        sg = SGModel(model, model.value_vars)
    assert not sg.has_minibatch and sg.per_observation_gradients is None
    force, noise = sg.force_and_noise(sg.theta, [])
    fn = pytensor.function([sg.theta], [force, noise.trace()], mode="FAST_COMPILE")
    theta = np.array([0.3, -0.2])
    f, trace = fn(theta)
    expected = -theta / 100 + problem.per_observation_gradients(theta).sum(0)
    np.testing.assert_allclose(f, expected, rtol=1e-10)
    assert trace == 0


def test_pm_data_minibatch_reads_the_shared_data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(30)
    with pm.Model() as model:
        data = pm.Data("x", x)
        x_mb = pm.Minibatch(data, batch_size=5)
        mu = pm.Normal("mu", 0, 1)
        pm.Normal("obs", mu, 1, observed=x_mb, total_size=30)
    sg = SGModel(model, model.value_vars)
    fn = pytensor.function([sg.theta, *sg.indices], sg.force, mode="FAST_COMPILE")
    idx = np.arange(5)
    np.testing.assert_allclose(fn(np.array([0.1]), idx), -0.1 + 6 * (x[:5] - 0.1).sum())
    data.set_value(x + 1)
    np.testing.assert_allclose(fn(np.array([0.1]), idx), -0.1 + 6 * (x[:5] + 0.9).sum())
    sg.check_data_rows()  # new values, the same N rows: fine


def test_minibatch_arrays_are_not_copied():
    # The step reads the arrays given to pm.Minibatch where they are: a copy would double
    # the memory of the large data sets SG-MCMC is for (P4, 381 MiB: 1,027 MiB peak after
    # building SGLD with the copy, 638 without).
    X, y = _regression(1000)
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=10)
        w = pm.Normal("w", shape=2)
        pm.Normal("y", X_mb @ w, 1.0, observed=y_mb, total_size=len(y))
    sg = SGModel(model, model.value_vars)
    (source,) = sg.sources
    for constant, shared in zip(source.data, source.shared_data, strict=True):
        assert np.shares_memory(constant.data, shared.get_value(borrow=True))


def test_a_step_refuses_data_whose_number_of_rows_changed():
    # Indices are drawn from range(N) of the data the step was built for: after pm.set_data
    # with fewer rows they would run past the end (an IndexError deep in the block before).
    from pymc_sgmcmc import SGLD

    x = np.random.default_rng(0).standard_normal(30)
    with pm.Model():
        data = pm.Data("x", x)
        mu = pm.Normal("mu", 0, 1)
        pm.Normal("obs", mu, 1, observed=pm.Minibatch(data, batch_size=5), total_size=30)
        step = SGLD(step_size=1e-3)
        pm.set_data({"x": x[:20]})
        with pytest.raises(
            ModelError, match=r"'x' now have 20 rows, but the step was built for N=30"
        ):
            pm.sample(step=step, draws=5, tune=0, chains=1, progressbar=False)


def test_flat_prior_has_no_prior_force():
    # pm.Flat's log-density is constant: its gradient is disconnected, i.e. zero.
    rng = np.random.default_rng(1)
    x = rng.standard_normal(40)
    with pm.Model() as model:
        x_mb = pm.Minibatch(x, batch_size=8)
        mu = pm.Flat("mu")
        pm.Normal("obs", mu, 1, observed=x_mb, total_size=40)
    sg = SGModel(model, model.value_vars)
    fn = pytensor.function([sg.theta, *sg.indices], sg.force, mode="FAST_COMPILE")
    idx = np.arange(8)
    np.testing.assert_allclose(fn(np.array([0.2]), idx), 5 * (x[:8] - 0.2).sum())


def test_sqrt_of_shifted_covariance_is_exact_in_both_spaces():
    rng = np.random.default_rng(2)
    for n_rows, dim in [(20, 5), (5, 20)]:
        G = pt.matrix("G")
        v = pt.vector("v")
        cov = NoiseCovariance(G, dim, n_rows)
        root, min_eig = cov.sqrt_shifted_matvec(3.0, 0.01, v)
        fn = python_function([G, v], [root, min_eig, cov.dense(), cov.matvec(v)])
        g = rng.standard_normal((n_rows, dim)) * 4
        vec = rng.standard_normal(dim)
        r, m, dense, mv = fn(g, vec)
        sigma = n_rows / (n_rows - 1) * (g - g.mean(0)).T @ (g - g.mean(0))
        np.testing.assert_allclose(dense, sigma, rtol=1e-10)
        np.testing.assert_allclose(mv, sigma @ vec, rtol=1e-10)
        w, u = np.linalg.eigh(3.0 * np.eye(dim) - 0.01 * sigma)
        expected = u @ (np.sqrt(np.maximum(w, 0)) * (u.T @ vec))
        # The Gram route squares the condition number: agreement to ~1e-7 relative.
        np.testing.assert_allclose(r, expected, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(m, w.min(), rtol=1e-8)
        assert m < 0  # this noise is large enough to need clipping


def test_a_dense_preconditioner_maps_positions_forces_and_noise_consistently():
    # theta = R (s * phi): a force pulls back by the chain rule, S R^T F, and the noise
    # covariance of the low-rank rows and of a dense matrix alike to S R^T Sigma R S, on the
    # host (NumPy) and in the compiled graphs (the same expressions on symbolic inputs).
    rng = np.random.default_rng(3)
    dim, n_rows = 3, 7
    rotation = np.tril(rng.standard_normal((dim, dim))) + 3 * np.eye(dim)
    scale = rng.uniform(0.5, 2.0, dim)
    host = Preconditioner(scale, rotation)
    phi = rng.standard_normal(dim)
    np.testing.assert_allclose(host.to_phi(host.to_theta(phi)), phi, rtol=1e-12)
    a = rng.standard_normal((dim, dim))
    a = a @ a.T  # f(theta) = theta^T A theta / 2, whose gradient in phi is S R^T A R S phi
    jacobian = rotation @ np.diag(scale)
    expected = jacobian.T @ a @ jacobian @ phi
    np.testing.assert_allclose(host.pull_back(a @ host.to_theta(phi)), expected, rtol=1e-12)
    g = rng.standard_normal((n_rows, dim))
    np.testing.assert_allclose(host.pull_back(g), g @ jacobian, rtol=1e-12)

    G, S, R, M = pt.matrix("G"), pt.vector("s"), pt.matrix("R"), pt.matrix("M")
    v = pt.vector("v")
    graph = Preconditioner(S, R)
    rows, dense = NoiseCovariance(G, dim, n_rows), DenseCovariance(M, dim)
    # The low-rank rows stay the model's: their products, diagonal and trace map instead.
    in_phi = graph.covariance(rows)
    outputs = [graph.covariance(c).dense() for c in (rows, dense)]
    outputs += [in_phi.matvec(v), in_phi.matvec(v, True), in_phi.diagonal(), in_phi.trace()]
    fn = python_function([G, S, R, M, v], outputs)
    sigma = n_rows / (n_rows - 1) * np.cov(g.T, bias=True) * n_rows
    x = rng.standard_normal(dim)
    from_rows, from_dense, product, single, diagonal, trace = fn(g, scale, rotation, sigma, x)
    expected = jacobian.T @ sigma @ jacobian
    np.testing.assert_allclose(from_rows, expected, rtol=1e-10)
    np.testing.assert_allclose(from_dense, expected, rtol=1e-10)
    np.testing.assert_allclose(product, expected @ x, rtol=1e-10)
    np.testing.assert_allclose(single, expected @ x, rtol=1e-6)  # G read as float32
    np.testing.assert_allclose(diagonal, np.diag(expected), rtol=1e-10)
    np.testing.assert_allclose(trace, np.trace(expected), rtol=1e-10)


# --------------------------------------------------------------------------- bad models
def _regression(n=100):
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((n, 2)), rng.standard_normal(n)
    return X, y


def test_discrete_free_variable_is_rejected():
    with pm.Model() as model:
        k = pm.Poisson("k", 3.0)
        pm.Normal("obs", k, 1, observed=[1.0, 2.0])
    with pytest.raises(ModelError, match="free variable 'k' is discrete"):
        SGModel(model, model.value_vars)


def test_batch_larger_than_data_is_rejected():
    with pm.Model() as model:
        y = pm.Minibatch(np.zeros(10), batch_size=20)
        mu = pm.Normal("mu")
        pm.Normal("obs", mu, 1, observed=y, total_size=10)
    with pytest.raises(ModelError, match="batch_size=20 but the data have only N=10 rows"):
        SGModel(model, model.value_vars)


def test_minibatch_calls_of_different_sizes_are_rejected():
    with pm.Model() as model:
        y1 = pm.Minibatch(np.zeros(100), batch_size=10)
        y2 = pm.Minibatch(np.zeros(50), batch_size=5)
        mu = pm.Normal("mu")
        pm.Normal("a", mu, 1, observed=y1, total_size=100)
        pm.Normal("b", mu, 1, observed=y2, total_size=50)
    with pytest.raises(ModelError, match="must use the same batch_size"):
        SGModel(model, model.value_vars)


def test_separately_sliced_inputs_and_outputs_are_rejected():
    X, y = _regression()
    with pm.Model() as model:
        X_mb = pm.Minibatch(X, batch_size=10)
        y_mb = pm.Minibatch(y, batch_size=10)
        w = pm.Normal("w", shape=2)
        pm.Normal("y", X_mb @ w, 1, observed=y_mb, total_size=100)
    with pytest.raises(ModelError, match=r"'y' reads data from 2 separate pm.Minibatch"):
        SGModel(model, model.value_vars)


def test_missing_or_wrong_total_size_is_rejected():
    X, y = _regression()
    for total, message in [(None, "has no total_size"), (50, "total_size=50")]:
        with pm.Model() as model:
            X_mb, y_mb = pm.Minibatch(X, y, batch_size=10)
            w = pm.Normal("w", shape=2)
            with pytest.warns(UserWarning) if total is None else _nullcontext():
                pm.Normal("y", X_mb @ w, 1, observed=y_mb, total_size=total)
        with pytest.raises(ModelError, match=message):
            SGModel(model, model.value_vars)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


def test_likelihood_coupling_rows_is_rejected():
    X, y = _regression()
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=10)
        w = pm.Normal("w", shape=2)
        mu = X_mb @ w
        pm.Normal("y", mu - mu.mean(), 1, observed=y_mb, total_size=100)
    sg = SGModel(model, model.value_vars)
    with pytest.raises(ModelError, match="does not split into independent per-observation"):
        sg.check_factorisation()


@pytest.mark.parametrize("likelihood", ["MvNormal", "AR", "GaussianRandomWalk"])
def test_joint_density_over_the_batch_is_rejected(likelihood):
    # A single time series read through pm.Minibatch once failed inside PyMC (a bare
    # AssertionError for the random walk, a TypeError for pm.AR) instead of saying why.
    X, y = _regression()
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=10)
        w = pm.Normal("w", shape=2)
        init = pm.Normal.dist(0.0, 10.0)
        if likelihood == "MvNormal":
            pm.MvNormal("y", X_mb @ w, np.eye(10), observed=y_mb, total_size=100)
        elif likelihood == "AR":
            pm.AR("y", rho=w, sigma=1.0, init_dist=init, observed=y_mb, total_size=100)
        else:
            pm.GaussianRandomWalk("y", mu=w[0], init_dist=init, observed=y_mb, total_size=100)
    with pytest.raises(ModelError, match=r"'y' \(\w+\) has one joint log-density for the whole"):
        SGModel(model, model.value_vars)


@pytest.mark.parametrize("rows", [100, 10], ids=["whole", "first rows"])
def test_observed_data_not_sliced_with_its_parameters_is_rejected(rows):
    # Only X through pm.Minibatch, y given whole (or its first n rows): the message once told
    # the user to drop a dims/shape they had not given.
    X, y = _regression()
    with pm.Model() as model:
        X_mb = pm.Minibatch(X, batch_size=10)
        w = pm.Normal("w", shape=2)
        pm.Normal("y", X_mb @ w, 1.0, observed=y[:rows], total_size=100)
    with pytest.raises(ModelError, match=r"its observed data \(shape .* pm\.Minibatch\(X, y"):
        SGModel(model, model.value_vars)


def test_potential_on_minibatch_data_is_rejected():
    X, y = _regression()
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=10)
        w = pm.Normal("w", shape=2)
        pm.Potential("lik", -((y_mb - X_mb @ w) ** 2).sum())
    with pytest.raises(ModelError, match=r"potential 'lik' reads pm\.Minibatch data"):
        SGModel(model, model.value_vars)


@pytest.mark.parametrize(
    ("form", "products"),
    [
        ("mu + tau * z", [("z", "tau")]),
        ("a = Deterministic(mu + z * tau)", [("z", "tau")]),
        ("a ~ N(mu, tau)", []),
        ("slopes z[g] * x", []),
        ("scalar tau * b", []),
        ("mu + exp(log_tau) * z", [("z", "exp(log_tau)")]),
        ("mu + tau * exp(z)", []),
        ("z * z", []),
    ],
)
def test_non_centred_products_are_those_of_a_standard_normal_vector_and_a_free_scale(
    form, products
):
    # What the warnings of a drifting chain name as a non-centred hierarchical model: a
    # free vector with a zero-location Normal prior multiplied, through indexing, by another
    # free variable or a positive function of one; not the centred form, a vector times
    # data, a function of the vector, the vector squared, or a scalar.
    rng = np.random.default_rng(0)
    g, x, y = np.repeat(np.arange(3), 10), rng.normal(size=30), rng.normal(size=30)
    with pm.Model() as model:
        g_mb, x_mb, y_mb = pm.Minibatch(g, x, y, batch_size=5)
        mu, tau = pm.Normal("mu", 0, 2), pm.HalfNormal("tau", 2)
        if form == "a ~ N(mu, tau)":
            mean = pm.Normal("a", mu, tau, shape=3)[g_mb]
        elif form == "slopes z[g] * x":
            mean = pm.Normal("z", 0, 1, shape=3)[g_mb] * x_mb
        elif form == "scalar tau * b":
            mean = tau * pm.Normal("b", 0, 1)
        elif form == "mu + tau * z":
            mean = (mu + tau * pm.Normal("z", 0, 1, shape=3))[g_mb]
        elif form == "mu + exp(log_tau) * z":
            log_tau = pm.Normal("log_tau", 0, 1)
            mean = (mu + pt.exp(log_tau) * pm.Normal("z", 0, 1, shape=3))[g_mb]
        elif form == "mu + tau * exp(z)":
            mean = (mu + tau * pt.exp(pm.Normal("z", 0, 1, shape=3)))[g_mb]
        elif form == "z * z":
            z = pm.Normal("z", 0, 1, shape=3)
            mean = (z * z)[g_mb]
        else:
            mean = pm.Deterministic("a", mu + pm.Normal("z", 0, 1, shape=3) * tau)[g_mb]
        pm.Normal("y", mean, 1, observed=y_mb, total_size=30)
    assert non_centred_products(model) == products


@pytest.mark.parametrize("likelihood", ["OrderedLogistic", "OrderedProbit"])
def test_a_deterministic_on_minibatch_data_is_rejected_with_its_fix(likelihood):
    # pm.OrderedLogistic / pm.OrderedProbit add a Deterministic '<name>_probs' of the batch's
    # class probabilities by default: the error names the variable the user never wrote and
    # the argument that removes it; a Deterministic of the user's own, how to compute it.
    rng = np.random.default_rng(0)
    x, labels = rng.standard_normal(30), rng.integers(0, 3, 30).astype(np.int32)
    for compute_p in (True, False):
        with pm.Model() as model:
            x_mb, y_mb = pm.Minibatch(x, labels, batch_size=10)
            b = pm.Normal("b")
            cut = pm.Normal("cut", [-1.0, 1.0], 1.0, transform=pm.distributions.transforms.ordered)
            getattr(pm, likelihood)(
                "y", b * x_mb, cut, observed=y_mb, total_size=30, compute_p=compute_p
            )
        if compute_p:
            with pytest.raises(
                ModelError, match=r"'y_probs' is computed from .* pass compute_p=False\.$"
            ):
                SGModel(model, model.value_vars)
        else:
            SGModel(model, model.value_vars)
    with model:
        pm.Deterministic("eta", b * x_mb)
    with pytest.raises(ModelError, match=r"'eta' .* var_names=\['eta'\]\)\)\.$"):
        SGModel(model, model.value_vars)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ({"dims": "obs_id"}, r"dims=\('obs_id',\) \('obs_id' has 10 rows\)"),
        ({"dims": "all_rows"}, r"dims=\('all_rows',\) \('all_rows' has 100 rows\)"),
        ({"shape": 10}, r"shape \(10 rows\)"),
    ],
)
def test_an_observed_variable_with_fixed_rows_is_rejected(rows, message):
    # dims (or shape) fix the observed variable's length, where it must follow the batch:
    # PyMC sizes the log-density to that length, so the one-row graph of the per-observation
    # gradients counted its row 10 or 100 times (reported, wrongly, as a likelihood coupling
    # the rows).
    X, y = _regression()
    coords = {"obs_id": np.arange(10), "all_rows": np.arange(len(y)), "coef": ["a", "b"]}
    with pm.Model(coords=coords) as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=10)
        w = pm.Normal("w", dims="coef")  # dims on the free variables are fine
        pm.Normal("y", X_mb @ w, 1.0, observed=y_mb, total_size=len(y), **rows)
    with pytest.raises(ModelError, match=rf"'y' reads pm\.Minibatch data but its {message} fixes"):
        SGModel(model, model.value_vars)
    with pm.Model(coords=coords) as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=10)
        w = pm.Normal("w", dims="coef")
        pm.Normal("y", X_mb @ w, 1.0, observed=y_mb, total_size=len(y), shape=y_mb.shape)
    SGModel(model, model.value_vars)  # a shape that follows the batch is fine


def test_minibatch_data_with_nan_rows_are_rejected():
    # A NaN in a covariate makes every batch that draws its row diverge: named at once,
    # with the rows to drop, instead of divergences (or a factorisation error) later.
    X, y = _regression()
    X[[3, 7], 1] = np.nan
    X[9, 0] = np.inf
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=10)
        w = pm.Normal("w", shape=2)
        pm.Normal("y", X_mb @ w, 1.0, observed=y_mb, total_size=len(y))
    with pytest.raises(ModelError, match=r"NaN or Inf values in 3 of its .* rows \(rows 3, 7, 9\)"):
        SGModel(model, model.value_vars)


def test_a_likelihood_undefined_for_some_rows_is_rejected():
    # A log-exposure offset with zero exposures: finite data, but the force is not finite on
    # any batch that draws such a row.
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((200, 2)), rng.standard_normal(200)
    exposure = np.where(np.arange(200) % 2 == 0, 0.0, 1.0)
    with pm.Model() as model:
        X_mb, y_mb, e_mb = pm.Minibatch(X, y, exposure, batch_size=20)
        w = pm.Normal("w", shape=2)
        pm.Normal("y", X_mb @ w + pt.log(e_mb), 1.0, observed=y_mb, total_size=200)
    with pytest.raises(ModelError, match="not finite"):
        SGModel(model, model.value_vars).check_factorisation()


def test_subset_of_variables_is_rejected():
    with pm.Model() as model:
        a = pm.Normal("a")
        pm.Normal("b", a)
    with pytest.raises(ModelError, match=r"\['b'\] were left out"):
        SGModel(model, [model.rvs_to_values[a]])


def test_vars_take_random_variables_as_pymc_steps_do():
    # SGLD(vars=[w, sigma]) names the model's random variables, as for PyMC's own steps; a
    # subset is rejected by the random variable's name, not its transformed value's.
    from pymc_sgmcmc import SGLD

    X, y = _regression()
    with pm.Model():
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=10)
        w = pm.Normal("w", shape=2)
        sigma = pm.HalfNormal("sigma")
        pm.Normal("y", X_mb @ w, sigma, observed=y_mb, total_size=len(y))
        assert SGLD(vars=[w, sigma], step_size=1e-3).sg_model.dim == 3
        with pytest.raises(ModelError, match=r"\['sigma'\] were left out"):
            SGLD(vars=[w], step_size=1e-3)


def test_control_variates_need_one_number_of_rows():
    # Its two pm.Minibatch calls draw from 60 and 120 rows: no single full pass.
    from pymc_sgmcmc import SGLD

    with transformed_model():
        with pytest.raises(ModelError, match="same number of rows"):
            SGLD(step_size=1e-3, control_variates=True)


def test_step_size_noise_is_the_largest_eigenvalue_of_the_noise_covariance_not_its_sample_spread():
    """The step-size rule's sigma^2_max from 16 pooled minibatches against the exact largest
    eigenvalue of S Sigma S (population covariance over all N rows) at a posterior draw, on a
    regression with D / n = 0.2, where one minibatch's sample covariance spreads its spectrum
    (Marchenko-Pastur) and put it at about 2.5x. Theory for 16 x 500 pooled rows gives
    (1 + sqrt(100 / 8,000))^2 = 1.23x; 4 estimates averaged spread by about 0.03."""
    problem = GaussianRegression.make(n_obs=10_000, dim=100, batch_size=500, prior_sd=np.sqrt(10))
    with problem.model() as model:
        sg = SGModel(model, model.value_vars)
    rng = np.random.default_rng(0)
    sd = np.sqrt(np.diag(problem.cov))
    theta = problem.mean + sd * rng.standard_normal(100)
    g = problem.per_observation_gradients(theta) * sd  # preconditioned
    centred = g - g.mean(axis=0)
    # Sigma = (N^2 / n) Cov_pop(g_i), the covariance of the minibatch force.
    exact = np.linalg.eigvalsh(10_000**2 / 500 * (centred.T @ centred) / 10_000)[-1]
    estimates = [sg.gradient_noise([theta], Preconditioner(sd), rng).largest for _ in range(4)]
    assert 1.0 < np.mean(estimates) / exact < 1.4


def test_step_size_noise_pools_minibatches_within_the_memory_budget(monkeypatch):
    """At most NOISE_VALUES_BUDGET per-observation gradient values at once, and at least one
    minibatch at each point."""
    from pymc_sgmcmc import model_layer

    problem = GaussianRegression.make(n_obs=1000, dim=10, batch_size=50)
    with problem.model() as model:
        sg = SGModel(model, model.value_vars)
    calls = []
    noise_rows = sg._noise_rows
    monkeypatch.setattr(sg, "_noise_rows", lambda *a: calls.append(1) or noise_rows(*a))
    rng = np.random.default_rng(0)
    points = [problem.mean] * 4
    for budget, expected in [(2**24, 16), (8 * 50 * 10, 8), (50 * 10, 4)]:
        monkeypatch.setattr(model_layer, "NOISE_VALUES_BUDGET", budget)
        calls.clear()
        assert np.isfinite(sg.gradient_noise(points, Preconditioner(np.ones(10)), rng).largest)
        assert len(calls) == expected


def beta_regression_with_rows_outside_the_support(n_obs=2000, batch_size=100):
    rng = np.random.default_rng(10)
    X = rng.normal(size=(n_obs, 2))
    y = rng.beta(2.0, 3.0, size=n_obs)
    y[[7, 1500]] = [1.0, 0.0]  # outside the Beta's support for every parameter value
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=batch_size)
        w = pm.Normal("w", 0, 1, shape=2)
        phi = pm.Gamma("phi", 2, 0.1)
        mu = pm.math.invlogit(X_mb @ w)
        pm.Beta("y", mu * phi, (1 - mu) * phi, observed=y_mb, total_size=n_obs)
    return model


def test_rows_outside_the_likelihoods_support_are_found_in_one_pass():
    # 2 rows of 2,000: a random batch of 100 holds one with probability 0.1, so the
    # construction's check of one batch passes, and every step that draws one diverges.
    model = beta_regression_with_rows_outside_the_support()
    sg = SGModel(model, model.value_vars)
    np.testing.assert_array_equal(sg.undefined_rows(sg.initial_theta), [7, 1500])
    assert sg.undefined_rows(sg.initial_theta, limit=1).tolist() == [7]
    # One batch of all the rows: every chunk is non-finite, yet rows are the cause.
    model = beta_regression_with_rows_outside_the_support(n_obs=2000, batch_size=2000)
    sg = SGModel(model, model.value_vars)
    np.testing.assert_array_equal(sg.undefined_rows(sg.initial_theta), [7, 1500])


def test_a_chain_start_refuses_rows_outside_the_likelihoods_support():
    with beta_regression_with_rows_outside_the_support():
        with pytest.raises(ModelError, match=r"not finite .* on rows 7, 1500 of the pm.Minibatch"):
            pm.sample(step=SGNHT(), draws=10, tune=10, chains=1, progressbar=False)


def test_a_log_density_undefined_on_every_batch_is_not_blamed_on_rows():
    # A pm.Potential that is -inf at the start: every chunk of the pass is non-finite, and
    # naming rows 0-4 would send the user to the wrong place.
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((200, 2)), rng.standard_normal(200)
    with pm.Model() as model:
        X_mb, y_mb = pm.Minibatch(X, y, batch_size=20)
        w = pm.Normal("w", shape=2)
        pm.Potential("constraint", pt.switch(w[0] > 0.5, 0.0, -np.inf))
        pm.Normal("y", X_mb @ w, 1.0, observed=y_mb, total_size=200)
        sg = SGModel(model, model.value_vars)
    with pytest.raises(
        ModelError, match=r"on any minibatch of the data, nor on any row .* pm\.Potential"
    ):
        sg.undefined_rows(sg.initial_theta)
    assert len(sg.undefined_rows(np.array([1.0, 0.0]))) == 0


def test_the_distributions_numbers_are_inputs_of_the_graphs_not_constants():
    # Numbers given as a prior's parameters (w's integers 0 and 10, typed int8 by PyTensor, and
    # b's 0.0 and 2.5, float32) become shared variables in the model's precision, so that a
    # model differing only in them has the same graphs; the likelihoods' numbers (0.5, a
    # count) and a number inside an expression stay constants.
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((200, 2)), rng.standard_normal(200)
    k = rng.binomial(7, 0.3, size=200)
    with pm.Model() as model:
        Xb, yb = pm.Minibatch(X, y, batch_size=20)
        w = pm.Normal("w", 0, 10, shape=2)
        pm.Normal("y", Xb @ w, 0.5, observed=yb, total_size=200)
        b = pm.Normal("b", 0.0, 2.5)
        pm.Binomial("k", n=7, p=0.3 * pm.math.sigmoid(b), observed=k)
        sg = SGModel(model, model.value_vars)
    parameters = sg.shared_parameters.parameters
    assert sorted((p.get_value().item(), p.type.dtype) for p in parameters) == [
        (0.0, "float64"),
        (0.0, "float64"),
        (2.5, "float64"),
        (10.0, "float64"),
    ]
    graph = [sg.force, sg.logp, sg.per_observation_gradients]
    scalars = [
        c.data.item()
        for c in pytensor.graph.traversal.ancestors(graph)
        if isinstance(c, pt.TensorConstant) and c.data.size == 1
    ]
    assert 2.5 not in scalars and 10 not in scalars
    assert all(number in scalars for number in (0.5, 7, 0.3))
    # The values are the model's: w's force from w ~ N(0, 10^2) and y ~ N(X w, 0.5^2).
    fn = python_function([sg.theta, *sg.indices], sg.force)
    w, idx = np.array([0.3, -0.2]), rng.integers(0, 200, size=20)
    expected = -w / 100 + 10 * X[idx].T @ (y[idx] - X[idx] @ w) / 0.25
    np.testing.assert_allclose(fn(np.append(w, 0.1), idx)[:2], expected, rtol=1e-12)


def test_each_term_read_in_full_is_derived_once(monkeypatch):
    # The check that PyMC takes the priors' numbers shared derives the log-density terms that
    # the step keeps (the priors' and a fully observed variable's): deriving them again cost
    # 55-75 ms of a step's construction on P1-P3. The minibatch likelihood is derived twice,
    # for a batch of n rows and for one row, without PyMC's total_size wrapper (the layer
    # multiplies it by N/n itself, an input of the graphs).
    derived = []

    def recording(rvs, **kwargs):
        derived.extend(type(rv.owner.op).__name__ for rv in rvs)
        return transformed_conditional_logp(rvs, **kwargs)

    monkeypatch.setattr(model_layer, "transformed_conditional_logp", recording)
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((200, 2)), rng.standard_normal(200)
    with pm.Model() as model:
        Xb, yb = pm.Minibatch(X, y, batch_size=20)
        w = pm.Normal("w", 0, 10, shape=2)
        pm.Normal("y", Xb @ w, 0.5, observed=yb, total_size=200)
        b = pm.Laplace("b", 0.0, 2.5)
        k = rng.binomial(7, 0.4, size=50)
        pm.Binomial("k", n=7, p=pm.math.sigmoid(b), observed=k)
        sg = SGModel(model, model.value_vars)
    assert sorted(derived) == [
        "BinomialRV", "LaplaceRV", "NormalRV", "NormalRV", "NormalRV"
    ]  # fmt: skip
    assert len(sg.shared_parameters.parameters) == 4
    theta = np.array([0.3, -0.2, 0.4])  # w, b
    exact = (
        scipy.stats.norm.logpdf(theta[:2], 0, 10).sum()
        + scipy.stats.laplace.logpdf(theta[2], 0, 2.5)
        + scipy.stats.binom.logpmf(k, 7, scipy.special.expit(theta[2])).sum()
    )
    fixed_logp = python_function([sg.theta], sg.fixed_logp)(theta)
    np.testing.assert_allclose(fixed_logp, exact, rtol=1e-12)


def _graph_key_of(sg: SGModel) -> str | None:
    """The rewritten-graph cache's key of the layer's log-density and force graphs."""
    inputs = [sg.theta, *sg.shared_parameters.parameters]
    return _graph_key(inputs, [sg.logp, sg.force], caching_rewrites("NUMBA"))


@pytest.mark.parametrize("floatX", ["float64", "float32"])
def test_a_priors_numbers_of_any_type_give_one_graph(floatX):
    # PyTensor types 10 int8, 10.0 float32 and 0.3 float64: each was another graph, compiled
    # again when a user changed the number. Promoted to the model's precision (float32 where
    # floatX is float32 and the number fits it), they give one graph key: the rewritten-graph
    # cache and numba's cache serve every such model the first one's blocks.
    def key(location, scale) -> tuple[str, list[str]]:
        with pytensor.config.change_flags(floatX=floatX), pm.Model() as model:
            pm.Normal("w", location, scale, shape=3)
            sg = SGModel(model, model.value_vars)
        graph_key = _graph_key_of(sg)
        assert graph_key is not None
        return graph_key, [p.type.dtype for p in sg.shared_parameters.parameters]

    numbers = [(0, 10), (0.0, 10.0), (0.0, 0.5), (0.0, 0.3)]
    if floatX == "float64":
        numbers += [(np.int64(0), np.float32(2.0)), (0.0, np.float64(0.3))]
    keys = [key(*pair) for pair in numbers]
    assert all(k == keys[0] for k in keys), keys
    assert keys[0][1] == [floatX, floatX]
    if floatX == "float32":
        # An int64 or a float64, which PyMC computes with in float64, stays float64.
        assert key(np.int64(0), np.float64(0.3))[1] == ["float64", "float64"]


def test_a_priors_parameter_computed_from_numbers_is_shared_as_its_value():
    # pm.Exponential("s", lam) has the parameter scale = 1 / lam, an expression of a constant;
    # pm.Normal(tau=...) has sigma = tau ** -0.5. Their values are shared as the numbers are,
    # so lam = 1, 3 or 0.5 is one graph. The value is PyMC's (1 / 3 computed in float32, the
    # type of the reciprocal of an int8), the density computed from it in float64.
    def exponential(lam) -> SGModel:
        with pm.Model() as model:
            pm.Exponential("s", lam, shape=2)
            return SGModel(model, model.value_vars)

    models = {lam: exponential(lam) for lam in (1, 3, 0.5)}
    key_1, key_3, key_half = (_graph_key_of(models[lam]) for lam in (1, 3, 0.5))
    assert key_1 is not None
    assert key_1 == key_3 == key_half
    sg = models[3]
    (scale,) = sg.shared_parameters.parameters
    assert scale.get_value().tolist() == [float(np.float32(1 / 3))]
    fn = python_function([sg.theta], sg.logp)
    theta = np.array([-0.5, 1.2])  # log s
    s = np.exp(theta)
    exact = scipy.stats.expon.logpdf(s, scale=float(np.float32(1 / 3))).sum() + theta.sum()
    np.testing.assert_allclose(fn(theta), exact, rtol=1e-12)
    with pm.Model() as model:
        pm.Normal("w", 0, tau=4)
        sg = SGModel(model, model.value_vars)
    assert [p.get_value().item() for p in sg.shared_parameters.parameters] == [0.0, 0.5]


def _logp_and_force_against_pymc(model: pm.Model, sg: SGModel, rtol: float = 1e-10) -> None:
    """The layer's log-density and force (no minibatch: the exact ones) equal PyMC's at the
    initial point and two points around it."""
    fn = python_function([sg.theta], [sg.logp, sg.force])
    with pytensor.config.change_flags(cxx=""):  # PyMC's, in Python too (python_function)
        logp = model.compile_logp(mode="FAST_COMPILE")
        dlogp = model.compile_dlogp(mode="FAST_COMPILE")
    point = {v.name: model.initial_point()[v.name] for v in model.value_vars}
    rng = np.random.default_rng(1)
    for shift in (0.0, 0.2, -0.3):
        theta = sg.initial_theta + shift * rng.standard_normal(sg.dim)
        ours_logp, ours_force = fn(theta)
        at = split_like(point, theta)
        np.testing.assert_allclose(ours_logp, logp(at), rtol=rtol)
        np.testing.assert_allclose(ours_force, dlogp(at), rtol=rtol, atol=1e-12)


def test_a_distribution_that_needs_its_numbers_as_constants_keeps_them():
    # pm.Interpolated's log-density reads its points' values (it raised an AttributeError on a
    # shared variable: the sampler could not take such a prior), pm.StickBreakingWeights's K,
    # pm.ZeroSumNormal's and pm.LKJCholeskyCov's sizes fix shapes, and this CustomDist's logp
    # uses its n as a length. Each keeps its numbers as constants while the Normal beside it
    # shares its own, and the log-density and force are PyMC's.
    def custom_logp(value, n):
        return -0.5 * value**2 * pt.ones(n).sum()  # an integer n only

    with pm.Model() as model:
        pm.Normal("w", 0.0, 0.3, shape=2)  # float64 numbers: PyMC computes in float64 too
        pm.Interpolated("s", np.array([0.0, 1.0, 2.0, 3.0]), np.array([1.0, 2.0, 2.0, 1.0]))
        pm.StickBreakingWeights("sb", 2.0, 4)
        pm.ZeroSumNormal("z", 2.0, shape=4)
        pm.LKJCholeskyCov("chol", n=3, eta=2.0, sd_dist=pm.Exponential.dist(1.0))
        pm.CustomDist("c", 3, logp=custom_logp)
        sg = SGModel(model, model.value_vars)
    values = sorted(p.get_value().item() for p in sg.shared_parameters.parameters)
    assert values == [0.0, 0.3]
    _logp_and_force_against_pymc(model, sg)


def test_integer_priors_numbers_do_not_overflow():
    # PyTensor types 100 as int8 and PyMC sums alpha + beta in that type: pm.Beta("p", 100,
    # 100)'s log-density is NaN in PyMC 6.4 (200 wraps to -56). The model layer computes with
    # the numbers promoted to float64: the exact density, with the logit transform's Jacobian.
    with pm.Model() as model:
        pm.Beta("p", 100, 100)
        sg = SGModel(model, model.value_vars)
    fn = python_function([sg.theta], sg.logp)
    for x in (-0.2, 0.0, 0.3):
        p = 1 / (1 + np.exp(-x))
        exact = scipy.stats.beta.logpdf(p, 100, 100) + np.log(p * (1 - p))
        np.testing.assert_allclose(fn(np.array([x])), exact, rtol=1e-12)


def test_a_parameter_check_that_holds_is_dropped_and_one_that_fails_stays():
    # With the numbers shared, PyTensor no longer folds the log-density's check of them
    # (sigma > 0) away; the model layer does, for the values it holds.
    def checks(sigma: float) -> tuple[list, SGModel]:
        with pm.Model() as model:
            pm.Normal("w", 0.0, sigma)
            sg = SGModel(model, model.value_vars)
        graph = [sg.logp, sg.force]
        nodes = pytensor.graph.traversal.toposort(graph)
        return [n for n in nodes if isinstance(n.op, CheckParameterValue)], sg

    held, sg = checks(2.0)
    assert not held
    fn = python_function([sg.theta], sg.logp)
    np.testing.assert_allclose(fn(np.array([1.0])), -0.125 - np.log(2 * np.sqrt(2 * np.pi)))
    failed, _ = checks(-2.0)
    assert failed and all(n.op.msg == "sigma > 0" for n in failed)


def test_the_steps_graphs_carry_no_creation_trace_and_the_models_keep_theirs():
    # Recording eight frames per new variable was a fifth of a step's construction; the
    # model's variables, created by the user, keep their traces for PyTensor's messages.
    limit = pytensor.config.traceback__limit
    with pm.Model() as model:
        w = pm.Normal("w", 0.0, 2.0)
        sg = SGModel(model, model.value_vars)
    assert limit > 0 and pytensor.config.traceback__limit == limit
    assert w.tag.trace
    assert not sg.logp.tag.trace and not sg.force.tag.trace
