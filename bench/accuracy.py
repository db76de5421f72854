"""The error of a ``python -m bench`` method's loss and gradients against the float64 truth on the benchmark's inputs
(the ``loss_rel_error`` / ``grad_rel_error`` columns of ``--preset gpu``), through the one harness
(:mod:`bench.errors`): relative 2-norm errors of the loss and of each of dq, dk and dscale; the grad column is the
largest of the three.
"""

from typing import Dict

import torch

from .errors import errors, grads
from .methods import METHODS, make_inputs


def errors_vs_float64(
    method: str, loss: str, batch: int, dim: int, dtype: torch.dtype, device: torch.device, symmetric: bool
) -> Dict[str, float]:
    """{"loss_rel_error", "grad_rel_error"} of ``method`` on the benchmark's inputs for this configuration."""
    q, k, scale = make_inputs(batch, dim, dtype, device)
    ours = grads(lambda q_, k_, s_: METHODS[method].loss_fn(loss)(q_, k_, s_, symmetric), q, k, scale)
    truth_loss = METHODS["torch"].loss_fn(loss)
    truth = grads(lambda q_, k_, s_: truth_loss(q_, k_, s_, symmetric), q.double(), k.double(), scale.double())
    rel = errors(ours, truth, ("loss", "dq", "dk", "dscale"))
    return {"loss_rel_error": rel["loss"], "grad_rel_error": max(rel["dq"], rel["dk"], rel["dscale"])}
