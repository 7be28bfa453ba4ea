"""One module per integrator, each reading like its paper's algorithm box."""

from pymc_sgmcmc.samplers.ccadl import CCAdL
from pymc_sgmcmc.samplers.mccadl import MCCAdL
from pymc_sgmcmc.samplers.msgld import MSGLD
from pymc_sgmcmc.samplers.nogin import NOGIN
from pymc_sgmcmc.samplers.sghmc import SGHMC
from pymc_sgmcmc.samplers.sgld import SGLD, PolynomialDecay
from pymc_sgmcmc.samplers.sgnht import SGNHT

__all__ = ["MSGLD", "NOGIN", "SGHMC", "SGLD", "SGNHT", "CCAdL", "MCCAdL", "PolynomialDecay"]
