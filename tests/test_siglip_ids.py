"""The sigmoid (SigLIP) loss with ids (issue 56): ``cal_siglip_loss(..., q_ids=, k_ids=)``, every column with the
row's id a positive, on every backend against a float64 truth built without infcl (materialized logits,
``-logsigmoid(z * L)`` with z from the ids: helpers.support.siglip_truth).

Loss and the gradients of image, text, scale and bias; several positives per row, rows with none, Bk > Bq,
every reduction with non-unit and negative upstream gradients, logits up to |1e4|, NaN, id views, unique ids
(the labels' loss), validation and the drop-in. The ring: test_siglip_ids_ring.py.
"""

import pytest
import torch

from helpers.support import (
    TOLERANCE,
    assert_close_verbose,
    assert_no_worse,
    grads_of_inputs,
    interpreting_triton,
    siglip_magnitudes,
    siglip_truth,
    tiled_backends,
)
from infcl import InfSigLipLoss, cal_siglip_loss
from infcl.backends import unavailable_reason
from infcl.backends.torch_tiles import TorchTilesBackend

GRAD_NAMES = ("loss", "dimage", "dtext", "dscale", "dbias")
# (Bq, Bk, D, classes): ids drawn from ``classes`` values, so rows have several positives (and, with more
# classes than rows, some none).
CASES = (
    (1, 1, 1, 1),
    (13, 29, 3, 4),  # crosses 5 x 7 tiles both ways; Bk > Bq
    (129, 129, 40, 7),
    (33, 257, 1000, 5),
    (40, 40, 8, 200),  # most rows without a positive
    (300, 300, 64, 300),
)
REDUCTIONS = ("mean", "sum", "none")
TRITON = interpreting_triton() and unavailable_reason("triton", torch.device("cpu")) is None
BACKENDS = ("reference", *tiled_backends(), "torch-small-tiles")


@pytest.fixture
def backend_name(request):
    name = request.param
    if name == "torch-small-tiles":
        return TorchTilesBackend(5, 7)  # the torch tiles at these sizes, passed by the call
    return name


def make_case(bq, bk, d, classes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed + 31 * bq + bk)
    image = torch.randn(bq, d, generator=gen, dtype=torch.float64) / d**0.5
    text = torch.randn(bk, d, generator=gen, dtype=torch.float64) / d**0.5
    q_ids = torch.randint(0, classes, (bq,), generator=gen)
    k_ids = torch.randint(0, classes, (bk,), generator=gen)
    return image.to(dtype), text.to(dtype), q_ids, k_ids


def params(dtype, scale=10.0, bias=-10.0):
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.tensor(scale, dtype=pdtype), torch.tensor(bias, dtype=pdtype)


def upstream_for(reduction, bq):
    gen = torch.Generator().manual_seed(5)
    if reduction == "none":
        return torch.rand(bq, generator=gen, dtype=torch.float64) * 2 - 0.5  # mixed signs, non-unit
    return torch.tensor(-0.7 if reduction == "mean" else 1.3, dtype=torch.float64)


def run(backend, image, text, q_ids, k_ids, scale, bias, reduction, upstream):
    """(ours, truth, magnitudes) of (loss, dimage, dtext, dscale, dbias); the truth in float64, without infcl."""
    ours = grads_of_inputs(
        lambda i, t, s, b: cal_siglip_loss(i, t, s, b, q_ids=q_ids, k_ids=k_ids, reduction=reduction, backend=backend),
        (image, text, scale, bias),
        upstream,
    )
    ids = (q_ids, k_ids)
    truth = grads_of_inputs(
        lambda i, t, s, b: siglip_truth(i, t, s, b, reduction=reduction, ids=ids),
        (image.double(), text.double(), scale.double(), bias.double()),
        upstream,
    )
    return ours, truth, siglip_magnitudes(image, text, scale, bias, None, reduction, upstream, ids)


def assert_all_close(ours, truth, magnitudes, dtype, what):
    atol, rtol = TOLERANCE[dtype]
    for name, got, want, size in zip(GRAD_NAMES, ours, truth, magnitudes):
        assert_close_verbose(got, want, atol, rtol, f"{what} {name}", magnitude=size)


EXACT = [
    pytest.param(
        case, dtype, REDUCTIONS[(i + j) % 3], id=f"{'x'.join(map(str, case))}-{dtype}-{REDUCTIONS[(i + j) % 3]}"
    )
    for i, case in enumerate(CASES)
    for j, dtype in enumerate((torch.float64, torch.float32))
]


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("case,dtype,reduction", EXACT)
def test_matches_float64_truth(backend_name, case, dtype, reduction):
    image, text, q_ids, k_ids = make_case(*case, dtype)
    scale, bias = params(dtype, *((10.0, -10.0) if case[0] % 2 else (14.3, -3.0)))
    ours, *truth = run(
        backend_name, image, text, q_ids, k_ids, scale, bias, reduction, upstream_for(reduction, case[0])
    )
    assert ours[0].dtype == dtype and ours[1].dtype == dtype
    assert_all_close(ours, *truth, dtype, f"{backend_name} {case} {dtype} {reduction}")


@pytest.mark.interpreter
@pytest.mark.skipif(not TRITON, reason="interpreted Triton")
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("case", ((13, 29, 3, 4), (40, 24, 33, 3)), ids=("13x29x3", "40x24x33"))
def test_triton_matches_float64_truth(case, dtype):
    """The Triton kernels' HAS_IDS path (interpreter): ragged row and column blocks, several positives."""
    image, text, q_ids, k_ids = make_case(*case, dtype)
    scale, bias = params(dtype)
    ours, *truth = run("triton", image, text, q_ids, k_ids, scale, bias, "none", upstream_for("none", case[0]))
    assert_all_close(ours, *truth, dtype, f"triton {case} {dtype}")


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_low_precision_no_worse_than_torch(backend_name, dtype):
    """16-bit features: no worse than torch's own materialized loss in that dtype (against float64)."""
    image, text, q_ids, k_ids = make_case(65, 97, 40, 6, dtype)
    scale, bias = params(dtype)
    upstream = upstream_for("mean", 65)
    ours, truth, _ = run(backend_name, image, text, q_ids, k_ids, scale, bias, "mean", upstream)
    ids = (q_ids, k_ids)
    vanilla = grads_of_inputs(
        lambda i, t, s, b: siglip_truth(i, t, s.to(dtype), b.to(dtype), ids=ids), (image, text, scale, bias), upstream
    )
    atol, rtol = TOLERANCE[dtype]
    for name, got, lowp, want in zip(GRAD_NAMES, ours, vanilla, truth):
        assert_no_worse(got, lowp, want, atol, rtol, f"{backend_name} {dtype} {name}")


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
def test_unique_ids_give_the_labels_loss(backend_name):
    """Ids that never repeat, each row's matching the column its label names: the loss with labels."""
    image, text, _, _ = make_case(29, 41, 6, 1, torch.float64)
    labels = torch.randperm(41, generator=torch.Generator().manual_seed(3))[:29]
    k_ids = torch.arange(41) + 100
    with_ids = grads_of_inputs(
        lambda i, t: cal_siglip_loss(i, t, 3.0, -2.0, q_ids=k_ids[labels], k_ids=k_ids, backend=backend_name),
        (image, text),
    )
    with_labels = grads_of_inputs(
        lambda i, t: cal_siglip_loss(i, t, 3.0, -2.0, labels, backend=backend_name), (image, text)
    )
    for name, got, want in zip(GRAD_NAMES, with_ids, with_labels):
        assert_close_verbose(got, want, *TOLERANCE[torch.float64], f"{backend_name} {name}")


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_logits_up_to_1e4_are_stable(backend_name, dtype):
    """Confident and confidently wrong entries alike: finite losses and gradients equal to the truth."""
    image, text, q_ids, k_ids = make_case(17, 23, 4, 3, torch.float64)
    image, text = (image / image.norm(dim=1, keepdim=True)).to(dtype), (text / text.norm(dim=1, keepdim=True)).to(dtype)
    scale, bias = params(dtype, 1e4, -5.0)
    ours, *truth = run(backend_name, image, text, q_ids, k_ids, scale, bias, "sum", None)
    assert all(torch.isfinite(t).all() for t in ours)
    assert_all_close(ours, *truth, dtype, f"{backend_name} 1e4 {dtype}")


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
def test_nan_in_nan_out(backend_name):
    image, text, q_ids, k_ids = make_case(9, 11, 5, 3, torch.float32)
    image[4, 2] = float("nan")
    rows = cal_siglip_loss(image, text, 2.0, -1.0, q_ids=q_ids, k_ids=k_ids, reduction="none", backend=backend_name)
    assert torch.isnan(rows[4]) and torch.isfinite(rows[torch.arange(9) != 4]).all()


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
def test_id_views_are_read_with_their_strides(backend_name):
    """Ids given as views (a column of a metadata table, every other entry, an expanded id) are the ids."""
    image, text, q_ids, k_ids = make_case(12, 14, 6, 4, torch.float64)
    meta_q = torch.stack((torch.zeros_like(q_ids), q_ids), dim=1)
    spread_k = torch.stack((k_ids, -torch.ones_like(k_ids)), dim=1).reshape(-1)[::2]
    got = cal_siglip_loss(image, text, 3.0, -1.0, q_ids=meta_q[:, 1], k_ids=spread_k, backend=backend_name)
    want = cal_siglip_loss(image, text, 3.0, -1.0, q_ids=q_ids.clone(), k_ids=k_ids.clone(), backend=backend_name)
    assert_close_verbose(got, want, *TOLERANCE[torch.float64], backend_name)
    one = torch.tensor([2]).expand(12)  # every row the same id: stride 0
    got = cal_siglip_loss(image, text, 3.0, -1.0, q_ids=one, k_ids=k_ids, backend=backend_name)
    want = siglip_truth(image, text, 3.0, -1.0, ids=(one.clone(), k_ids))
    assert_close_verbose(got, want, *TOLERANCE[torch.float64], f"{backend_name} expanded")


def test_module_takes_ids():
    """InfSigLipLoss(...)(..., q_ids=, k_ids=) is cal_siglip_loss with the ids; the mean over the local rows."""
    image, text, q_ids, k_ids = make_case(10, 10, 8, 3, torch.float64)
    got = InfSigLipLoss()(image, text, 10.0, -10.0, q_ids=q_ids, k_ids=k_ids)
    want = siglip_truth(image, text, 10.0, -10.0, ids=(q_ids, k_ids))
    assert_close_verbose(got, want, *TOLERANCE[torch.float64], "InfSigLipLoss")
    out = InfSigLipLoss()(image, text, 10.0, -10.0, output_dict=True, q_ids=q_ids, k_ids=k_ids)
    assert torch.equal(out["contrastive_loss"], got)


IMAGE, TEXT = torch.randn(6, 4), torch.randn(7, 4)
IDS6, IDS7 = torch.arange(6), torch.arange(7)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(q_ids=IDS6), ValueError, "q_ids was given without k_ids"),
        (dict(k_ids=IDS7), ValueError, "k_ids was given without q_ids"),
        (dict(q_ids=IDS6, k_ids=IDS7, labels=torch.arange(6)), ValueError, "labels and q_ids/k_ids"),
        (dict(q_ids=IDS6.float(), k_ids=IDS7), TypeError, "q_ids must be an integer tensor"),
        (dict(q_ids=IDS7, k_ids=IDS7), ValueError, r"q_ids must have shape \[6\]"),
        (dict(q_ids=IDS6, k_ids=IDS6), ValueError, r"k_ids must have shape \[7\]"),
        (dict(q_ids=[0] * 6, k_ids=IDS7), TypeError, "q_ids must be None or an integer tensor"),
    ],
)
def test_bad_ids_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        cal_siglip_loss(IMAGE, TEXT, 1.0, 0.0, **kwargs)


def test_ids_allow_uneven_batches_without_labels():
    """With ids no positive is found by the diagonal, so Bq != Bk needs no labels."""
    loss = cal_siglip_loss(IMAGE, TEXT, 1.0, 0.0, q_ids=IDS6, k_ids=IDS7, reduction="sum")
    assert_close_verbose(
        loss, siglip_truth(IMAGE, TEXT, 1.0, 0.0, reduction="sum", ids=(IDS6, IDS7)), *TOLERANCE[torch.float32]
    )


@pytest.mark.skipif(unavailable_reason("cpu", torch.device("cpu")) is not None, reason="native kernel unavailable")
def test_native_ops_with_ids_pass_opcheck():
    """The native sigmoid ops' schemas with the optional ids (torch.library.opcheck)."""
    gen = torch.Generator().manual_seed(4)
    image, text = torch.randn(5, 3, generator=gen), torch.randn(7, 3, generator=gen)
    pos, q_ids, k_ids = (
        torch.full((5,), -1),
        torch.randint(0, 3, (5,), generator=gen),
        torch.randint(0, 3, (7,), generator=gen),
    )
    torch.library.opcheck(torch.ops.infcl.sigmoid_forward_block.default, (image, text, 10.0, pos, -10.0, q_ids, k_ids))
    args = (
        image,
        text,
        10.0,
        pos,
        -10.0,
        torch.randn(5, generator=gen),
        torch.zeros(5, 3),
        torch.zeros(7, 3),
        q_ids,
        k_ids,
    )
    torch.library.opcheck(torch.ops.infcl.sigmoid_backward_block.default, args)
