"""Tensors as users hold them: feature views with odd strides, ids as views of bigger tensors."""

import torch


def view_as(t, kind):
    """``t`` [n, d] as users hold it: "contiguous", "transposed" (column-major storage) or "strided" (every
    other row and an inner column range of a bigger zero-filled tensor)."""
    n, d = t.shape
    if kind == "transposed":
        return t.T.contiguous().T
    if kind == "strided":
        big = torch.zeros(2 * n + 1, d + 3, dtype=t.dtype)
        big[1::2, 2 : d + 2] = t
        return big[1::2, 2 : d + 2]
    return t


def ids_as(values, kind, dtype):
    """``values`` [n] (small non-negative ints) held as ``kind``: contiguous, a column of a metadata tensor,
    every other entry of a longer tensor, or an expanded single id (then all the same)."""
    n = values.shape[0]
    values = values.to(dtype)
    if kind == "meta":
        meta = torch.zeros(n, 3, dtype=dtype)
        meta[:, 1] = values
        return meta[:, 1]
    if kind == "strided":
        longer = torch.zeros(2 * n, dtype=dtype)
        longer[::2] = values
        return longer[::2]
    if kind == "expand":
        return values[:1].expand(n)
    return values
