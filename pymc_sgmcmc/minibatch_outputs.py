"""A warning where PyMC computes per-row outputs from ``pm.Minibatch`` data.

In the model a step samples, an observed variable is a random minibatch: each evaluation draws
other rows. PyMC's forward sampling (``pm.sample_posterior_predictive``,
``pm.sample_prior_predictive``) and pointwise log-likelihood (``pm.compute_log_likelihood``,
and ``pm.sample(idata_kwargs={"log_likelihood": True})``, which calls it) then return, at
each draw, values for another random batch: ``batch_size`` columns, none of which belongs to
one row, the log-likelihood scaled by ``total_size``. Nothing failed or warned, and ``az.loo``
on such a group gave an elpd of -26,486 where the model on the full data gives -7,028
(``docs/snippets/predictions.py``). These functions now warn, naming the variables, and say
what to do instead: build the model on the rows wanted (the full data, or the rows to
predict) and call them there.

``install`` wraps the two functions of PyMC that every one of those calls goes through
(``pymc.sampling.forward.compile_forward_sampling_function`` and
``pymc.stats.log_density.compute_log_density``, looked up in their modules at each call);
their results are unchanged.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import pymc
import pymc.sampling.forward as forward
import pymc.stats.log_density as log_density
from pymc.model.core import modelcontext
from pytensor.graph.basic import Variable

from pymc_sgmcmc.model_layer import _minibatch_nodes

__all__ = ["install", "reads_minibatch"]

#: What the warnings advise.
_INSTEAD = (
    "Build the model on the rows you want (the full data for LOO, the new rows for "
    "predictions) without pm.Minibatch and total_size, and call it with that model "
    "(`docs/getting_started.md`, 'Predictions and model comparison')."
)


def reads_minibatch(variables: Sequence[Variable]) -> list[str]:
    """Names of those of ``variables`` whose graph reads ``pm.Minibatch`` data."""
    return [str(v.name) for v in variables if _minibatch_nodes([v])]


#: The warnings name the first caller outside these packages: the user's call, whether of
#: ``pm.compute_log_likelihood`` or of ``pm.sample``, whose conversion of the trace calls it.
_INTERNAL = (str(Path(pymc.__file__).parent), str(Path(__file__).parent))


def _warn(message: str) -> None:
    warnings.warn(f"pymc_sgmcmc: {message} {_INSTEAD}", UserWarning, skip_file_prefixes=_INTERNAL)


def _warning_forward_sampling(function: Callable) -> Callable:
    @functools.wraps(function)
    def compile_forward_sampling_function(outputs, *args, **kwargs):
        names = reads_minibatch(outputs)
        if names:
            _warn(
                f"{names} read pm.Minibatch data: each draw is made for another random "
                "minibatch of rows, so the draws' columns belong to no row of the data."
            )
        return function(outputs, *args, **kwargs)

    compile_forward_sampling_function.__wrapped_by_sgmcmc__ = True
    return compile_forward_sampling_function


def _warning_log_likelihood(function: Callable) -> Callable:
    @functools.wraps(function)
    def compute_log_density(*args, kind="likelihood", model=None, var_names=None, **kwargs):
        if kind == "likelihood":
            try:
                observed = modelcontext(model).observed_RVs
            except TypeError:  # no model: PyMC's own error, below
                observed = []
            chosen = [rv for rv in observed if var_names is None or rv.name in var_names]
            names = reads_minibatch(chosen)
            if names:
                _warn(
                    f"the log-likelihood of {names} is computed on pm.Minibatch data: at each "
                    "draw that of another random minibatch, scaled by total_size, so its "
                    "columns belong to no row of the data and LOO or WAIC on it is meaningless."
                )
        return function(*args, kind=kind, model=model, var_names=var_names, **kwargs)

    compute_log_density.__wrapped_by_sgmcmc__ = True
    return compute_log_density


def install() -> None:
    """Wrap PyMC's forward sampling and log-density functions (idempotent)."""
    for module, name, wrap in (
        (forward, "compile_forward_sampling_function", _warning_forward_sampling),
        (log_density, "compute_log_density", _warning_log_likelihood),
    ):
        function = getattr(module, name)
        if not getattr(function, "__wrapped_by_sgmcmc__", False):
            setattr(module, name, wrap(function))
