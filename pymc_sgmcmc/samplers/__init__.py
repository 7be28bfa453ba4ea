"""One module per integrator, each reading like its paper's algorithm box."""

from pymc_sgmcmc.samplers.msgld import MSGLD
from pymc_sgmcmc.samplers.sghmc import SGHMC
from pymc_sgmcmc.samplers.sgld import SGLD, PolynomialDecay
from pymc_sgmcmc.samplers.sgnht import SGNHT

__all__ = ["MSGLD", "SGHMC", "SGLD", "SGNHT", "PolynomialDecay"]
