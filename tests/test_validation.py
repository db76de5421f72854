"""Bad input raises a clear TypeError / ValueError naming the argument and the shapes."""

import pytest
import torch

from infcl import cal_inf_loss

Q = torch.randn(6, 4)
K = torch.randn(6, 4)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(q=Q.numpy(), k=K), TypeError, r"q must be a torch.Tensor"),
        (dict(q=Q, k=K.long()), TypeError, r"k must be a floating-point tensor.*int64"),
        (dict(q=Q[0], k=K), ValueError, r"q must be 2-d \[batch, dim\], got shape \[4\]"),
        (dict(q=Q, k=K[None]), ValueError, r"k must be 2-d.*\[1, 6, 4\]"),
        (dict(q=Q[:0], k=K), ValueError, r"q is an empty batch: shape \[0, 4\]"),
        (dict(q=Q[:, :0], k=K[:, :0]), ValueError, r"feature dimension 0"),
        (dict(q=Q, k=torch.randn(6, 5)), ValueError, r"same feature dimension: q \[6, 4\], k \[6, 5\]"),
        (dict(q=Q, k=K.double()), TypeError, r"same dtype: q torch.float32, k torch.float64"),
        (dict(q=Q, k=torch.randn(9, 4)), ValueError, r"labels=None means the diagonal.*q \[6, 4\], k \[9, 4\]"),
        (
            dict(q=Q, k=K, labels=torch.zeros(5, dtype=torch.long)),
            ValueError,
            r"labels must have shape \[Bq\] = \[6\], got \[5\]",
        ),
        (dict(q=Q, k=K, labels=torch.zeros(6)), TypeError, r"labels must be an integer tensor, got torch.float32"),
        (dict(q=Q, k=K, labels=[0, 1, 2, 3, 4, 5]), TypeError, r"labels must be None or an integer tensor, got list"),
        (
            dict(q=Q, k=K, labels=torch.tensor([0, 1, 2, 3, 4, 6])),
            ValueError,
            r"labels must be column indices in \[0, 6\).*\[0, 6\]",
        ),
        (
            dict(q=Q, k=K, labels=torch.tensor([-1, 1, 2, 3, 4, 5])),
            ValueError,
            r"labels must be column indices.*\[-1, 5\]",
        ),
        (
            dict(q=Q, k=torch.randn(9, 4), labels=torch.arange(6), symmetric=True),
            ValueError,
            r"symmetric=True needs as many q rows as k rows: q \[6, 4\], k \[9, 4\]",
        ),
        (dict(q=Q, k=K, labels=torch.tensor([0, 0, 2, 3, 4, 5]), symmetric=True), ValueError, r"permutation"),
        (dict(q=Q, k=K, symmetric=1), TypeError, r"symmetric must be a bool"),
        (dict(q=Q, k=K, reduction="avg"), ValueError, r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'"),
        (dict(q=Q, k=K, backend="cuda"), ValueError, r"backend must be one of .*got 'cuda'"),
        (dict(q=Q, k=K, scale="14"), TypeError, r"scale must be a float or a one-element floating tensor, got str"),
        (dict(q=Q, k=K, scale=True), TypeError, r"scale must be a float.*bool"),
        (
            dict(q=Q, k=K, scale=torch.ones(2)),
            ValueError,
            r"scale must be a 0-d or one-element tensor, got shape \[2\]",
        ),
        (dict(q=Q, k=K, scale=torch.tensor(3)), TypeError, r"scale must be a floating tensor, got torch.int64"),
        (dict(q=Q, k=K, head_dim="64"), TypeError, r"head_dim must be None or an int"),
    ],
)
def test_bad_input_is_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        cal_inf_loss(**kwargs)


def test_bad_env_backend_is_named(monkeypatch):
    monkeypatch.setenv("INFCL_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"INFCL_BACKEND must be one of .*got 'fast'"):
        cal_inf_loss(Q, K)


def test_unavailable_backend_says_why():
    # Triton needs a CUDA tensor (or the interpreter): on CPU without TRITON_INTERPRET it must say so.
    import os

    from infcl.backends import unavailable_reason

    why = unavailable_reason("triton", torch.device("cpu"))
    if why is None:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        pytest.skip("triton runs on CPU tensors under the interpreter here")
    with pytest.raises(RuntimeError, match="triton"):
        cal_inf_loss(Q, K, backend="triton")
