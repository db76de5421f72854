"""The one stable log-sum-exp merge used by every tile loop, ring step and backend.

Every place that combines two partial log-sum-exps (over disjoint column sets) calls
:func:`lse_merge`; nothing in infcl writes ``log(exp(a) + exp(b))`` by hand.
"""

import torch


def lse_merge(acc: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Return ``log(exp(acc) + exp(part))`` elementwise, in place into ``acc``.

    ``torch.logaddexp`` subtracts the larger operand before exponentiating, so the merge never
    overflows, ``-inf`` (an empty partial) is the identity, and a NaN in either side stays NaN.
    Shapes must match; ``acc`` is returned for chaining.
    """
    return torch.logaddexp(acc, part, out=acc)


def empty_lse(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An accumulator of ``n`` empty log-sum-exps (``-inf``: the identity of :func:`lse_merge`)."""
    return torch.full((n,), float("-inf"), dtype=dtype, device=device)
