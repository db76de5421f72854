"""The error of a method's loss and gradients against a float64 truth on the same inputs.

The truth is infcl's tiled PyTorch backend (``METHODS["torch"]``, either loss) run in float64 on the same device
(exact to ~1e-13 against
the materialized float64 loss, which tests/ check, and never O(B^2) in memory, so it reaches the batch
sizes where the float64 vanilla loss would need hundreds of GB). Errors are relative in the 2-norm:
``|x - x_true| / |x_true|`` for the loss and for each of dq, dk and dscale; the grad column is the
largest of the three.
"""

from typing import Dict

import torch

from .methods import METHODS, make_inputs


def _grads(loss_fn, q, k, scale):
    q, k, scale = (t.detach().requires_grad_(True) for t in (q, k, scale))
    loss = loss_fn(q, k, scale)
    loss.backward()
    return loss.detach(), q.grad, k.grad, scale.grad


def _relative(value: torch.Tensor, truth: torch.Tensor) -> float:
    return float((value.double() - truth).norm() / truth.norm().clamp_min(1e-300))


def errors_vs_float64(
    method: str, loss: str, batch: int, dim: int, dtype: torch.dtype, device: torch.device, symmetric: bool
) -> Dict[str, float]:
    """{"loss_rel_error", "grad_rel_error"} of ``method`` on the benchmark's inputs for this configuration."""
    q, k, scale = make_inputs(batch, dim, dtype, device)
    ours = _grads(lambda q_, k_, s_: METHODS[method].loss_fn(loss)(q_, k_, s_, symmetric), q, k, scale)
    truth_loss = METHODS["torch"].loss_fn(loss)
    truth = _grads(lambda q_, k_, s_: truth_loss(q_, k_, s_, symmetric), q.double(), k.double(), scale.double())
    rel = [_relative(a, e) for a, e in zip(ours, truth)]
    return {"loss_rel_error": rel[0], "grad_rel_error": max(rel[1:])}
