"""Stochastic-gradient MCMC for PyMC: ``pm.sample(step=SGLD(step_size=...))``."""

from pymc_sgmcmc import minibatch_outputs, parallel, recording
from pymc_sgmcmc.model_layer import ModelError
from pymc_sgmcmc.samplers import (
    MSGLD,
    NOGIN,
    SGHMC,
    SGLD,
    SGNHT,
    CCAdL,
    MCCAdL,
    PolynomialDecay,
)

__all__ = [
    "MSGLD",
    "NOGIN",
    "SGHMC",
    "SGLD",
    "SGNHT",
    "CCAdL",
    "MCCAdL",
    "ModelError",
    "PolynomialDecay",
]
__version__ = "0.1.0"

# pm.sample(cores > 1): SG chains hand their draws to the main process in batches.
parallel.install()
# pm.sample records an SG step's runs of draws at once (cores=1 and the parallel batches).
recording.install()
# Posterior predictive and pointwise log-likelihood on pm.Minibatch data warn.
minibatch_outputs.install()
