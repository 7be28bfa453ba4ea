"""A hierarchical model: centred against non-centred (the guide's "Hierarchical models").

Varying intercepts over 20 groups of about 250 observations each (N = 5,000, n = 200 per
minibatch), a_g ~ N(mu, tau). The reference is PyMC's NUTS on the full data (centred, 2 x 2,000
draws). Each stochastic-gradient run is SGNHT with its defaults (1,000 tuning draws, step size,
preconditioner and thin adapted) and 2 x 1,000 stored draws, on the non-centred form
(a = mu + tau z, z ~ N(0, 1)) and on the centred one. Prints, for mu and tau, the posterior
mean and sd, the bulk ESS and R-hat, and the stored draws' thin.
Run (the output is committed beside this file):
``.venv/bin/python docs/snippets/hierarchical.py > docs/snippets/hierarchical_output.txt``
"""

import warnings

import arviz as az
import numpy as np
import pymc as pm

from pymc_sgmcmc import SGNHT

rng = np.random.default_rng(0)
N, G = 5_000, 20
group = rng.integers(0, G, N)
y = rng.normal(0.0, 1.0, G)[group] + rng.normal(0.0, 0.5, N)


def varying_intercepts(centred: bool, batch_size: int | None) -> pm.Model:
    """a_g ~ N(mu, tau) directly (centred) or as mu + tau z_g (non-centred)."""
    with pm.Model() as model:
        g, obs = (group, y) if batch_size is None else pm.Minibatch(group, y, batch_size=batch_size)
        mu = pm.Normal("mu", 0.0, 5.0)
        tau = pm.HalfNormal("tau", 2.0)
        if centred:
            a = pm.Normal("a", mu, tau, shape=G)
        else:
            z = pm.Normal("z", 0.0, 1.0, shape=G)
            a = pm.Deterministic("a", mu + tau * z)
        sigma = pm.HalfNormal("sigma", 1.0)
        total_size = None if batch_size is None else N
        pm.Normal("y", a[g], sigma, observed=obs, total_size=total_size)
    return model


def report(label: str, idata) -> None:
    summary = az.summary(idata, var_names=["mu", "tau"])
    thin = idata.sample_stats["thin"].values[:, -1] if "thin" in idata.sample_stats else "-"
    print(f"{label}  (thin {thin})")
    print(summary[["mean", "sd", "ess_bulk", "r_hat"]].to_string(), "\n")


with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # PyMC's R-hat and ESS warnings: the table shows them
    with varying_intercepts(centred=True, batch_size=None):
        reference = pm.sample(2000, chains=2, cores=1, random_seed=1, progressbar=False)
    report("NUTS, centred, full data", reference)
    for centred in (False, True):
        with varying_intercepts(centred, batch_size=200):
            idata = pm.sample(step=SGNHT(), chains=2, cores=1, random_seed=3, progressbar=False)
        report(f"SGNHT, {'centred' if centred else 'non-centred'}, n = 200", idata)
