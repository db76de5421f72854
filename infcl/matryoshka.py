"""Matryoshka prefixes (``cal_inf_loss(matryoshka=...)``): every prefix dimension's loss out of one tiled pass.

With prefix dimensions m_1 < ... < m_K (any order given; sorted here) and, for prefix k, the logits
S^k = scale * (a^k_i q_i[:m_k]) . (b^k_j k_j[:m_k]), where a^k_i = 1 / max(|q_i[:m_k]|, 1e-12) and likewise
b^k_j when the prefix is renormalized (``F.normalize``'s eps, as sentence-transformers' ``shrink``), else 1,
the loss is sum_k w_k * loss(S^k). The raw products R^k = q[:, :m_k] @ k[:, :m_k].T are running sums of one
product: R^k = R^(k-1) + q[:, m_(k-1):m_k] @ k[:, m_(k-1):m_k].T, so a tile walks D once forward; the
backward forms each prefix's dS^k in the tile and feeds segment s the sum of the W^k = dS^k * scale * a^k b^k
of the prefixes that hold it (one product per segment: D once again for dq and for dk). Renormalizing adds
the normalization's own gradient, -a_i^2 c_i q_i[:m] with c_i = sum_j dS_ij S_ij (a per-row sum formed in
the same tiles; columns alike), so nothing O(Bq * Bk) is ever held.
"""

import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from .contract import accum_dtype

NORM_EPS = 1e-12  # F.normalize's default eps: x / max(|x|, eps), as sentence-transformers' shrink


@dataclass(frozen=True)
class Matryoshka:
    """Prefix dimensions, their weights (None: 1 each) and whether each prefix is renormalized (one bool for
    all, or one per dimension). ``cal_inf_loss(matryoshka=Matryoshka((768, 512, 256, 128, 64)))``; a plain
    sequence of dims means weights 1 and renormalized prefixes (sentence-transformers' MatryoshkaLoss)."""

    dims: Tuple[int, ...]
    weights: Optional[Tuple[float, ...]] = None
    renormalize: Union[bool, Tuple[bool, ...]] = True


@dataclass(frozen=True)
class Prefixes:
    """A call's prefixes, checked, in increasing dimension: what the tiles walk (``order[k]``: the position in
    the user's ``dims`` of the k-th smallest)."""

    dims: Tuple[int, ...]  # increasing, distinct, in [1, D]
    renormalize: Tuple[bool, ...]
    weights: Tuple[float, ...]
    order: Tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.dims)

    def sign_only(self, k: int) -> bool:
        """Prefix k is one wide and renormalized: its logits are scale * sign(q_0) * sign(k_0), which do not move
        with the features, so its gradient of q and k is exactly 0 (autograd through ``F.normalize`` gives it
        only to rounding). The fused passes leave it out of the features' gradient instead of forming it as the
        difference of two equal sums of size |g| / |x_0| (the tangential product and the normalization's own
        term), which cancel only to their rounding. (Where |x_0| < eps, ``F.normalize``'s g / eps is 0 here.)"""
        return self.renormalize[k] and self.dims[k] == 1

    def segment(self, k: int) -> slice:
        """The feature columns prefix k adds to prefix k - 1."""
        return slice(self.dims[k - 1] if k else 0, self.dims[k])


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def make_prefixes(matryoshka, dim: int) -> Optional[Prefixes]:
    """``matryoshka`` (None, a :class:`Matryoshka` or a sequence of dims) checked against the features' width
    ``dim``: ValueError / TypeError naming the argument on bad dims, weights or flags."""
    if matryoshka is None:
        return None
    if not isinstance(matryoshka, Matryoshka):
        if isinstance(matryoshka, (str, bytes)) or not isinstance(matryoshka, Sequence):
            raise TypeError(
                f"matryoshka must be an infcl.Matryoshka or a sequence of dims, got {type(matryoshka).__name__}"
            )
        matryoshka = Matryoshka(tuple(matryoshka))
    dims = tuple(matryoshka.dims)
    if not dims:
        raise ValueError("matryoshka dims must name at least one dimension, got none")
    if not all(_is_int(d) for d in dims):
        raise TypeError(f"matryoshka dims must be integers, got {dims!r}")
    dims = tuple(int(d) for d in dims)
    if any(d < 1 or d > dim for d in dims):
        raise ValueError(f"matryoshka dims must be in [1, {dim}] (the features' width D = {dim}), got {dims}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"matryoshka dims must be distinct, got {dims}")
    weights = (1.0,) * len(dims) if matryoshka.weights is None else tuple(matryoshka.weights)
    if len(weights) != len(dims):
        raise ValueError(f"matryoshka weights must be one per dim: {len(weights)} weights for dims {dims}")
    if not all(isinstance(w, numbers.Real) and not isinstance(w, (bool, np.bool_)) for w in weights):
        raise TypeError(f"matryoshka weights must be real numbers, got {weights!r}")
    if not all(np.isfinite(float(w)) for w in weights):
        raise ValueError(f"matryoshka weights must be finite, got {weights}")
    renorm = matryoshka.renormalize
    flags = (renorm,) * len(dims) if isinstance(renorm, (bool, np.bool_)) else tuple(renorm)
    if len(flags) != len(dims) or not all(isinstance(f, (bool, np.bool_)) for f in flags):
        raise ValueError(f"matryoshka renormalize must be a bool or one bool per dim, got {renorm!r} for dims {dims}")
    order = tuple(sorted(range(len(dims)), key=lambda i: dims[i]))
    return Prefixes(
        dims=tuple(dims[i] for i in order),
        renormalize=tuple(bool(flags[i]) for i in order),
        weights=tuple(float(weights[i]) for i in order),
        order=order,
    )


def prefix_factors(x: torch.Tensor, prefixes: Prefixes) -> torch.Tensor:
    """``[K, n]`` each row's factor per prefix: 1 / max(|x[:m_k]|, eps) where renormalized, else 1, in x's
    dtype (the accumulation dtype), from running sums of squares over the segments."""
    out = x.new_ones(prefixes.count, x.shape[0])
    squares = x.new_zeros(x.shape[0])
    for k in range(prefixes.count):
        seg = x[:, prefixes.segment(k)]
        squares = squares + (seg * seg).sum(dim=1)
        if prefixes.renormalize[k]:
            out[k] = 1.0 / squares.sqrt().clamp_min(NORM_EPS)
    return out


def prefix_features(q: torch.Tensor, k: torch.Tensor, prefixes: Prefixes, i: int):
    """(q, k) of prefix i (increasing order) as plain tensors in the accumulation dtype: the first m columns,
    ``F.normalize``d where renormalized (the reference backend's materialized inputs)."""
    acc = accum_dtype(q.dtype)
    m = prefixes.dims[i]
    qm, km = q.to(acc)[:, :m], k.to(acc)[:, :m]
    if prefixes.renormalize[i]:
        qm, km = F.normalize(qm, dim=-1, eps=NORM_EPS), F.normalize(km, dim=-1, eps=NORM_EPS)
    return qm, km
