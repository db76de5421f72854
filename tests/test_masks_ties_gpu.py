"""Issue 31 on a real GPU (skipped without CUDA): the Triton guide thresholds tie the masked kernels' own
guide scores at every guide precision the kernels take (tf32 next to bfloat16 / float16 / tf32 float32
features, "ieee" next to float32 "ieee"), and id views give the contiguous ids' loss.
One command: ``python -m pytest tests/test_masks_ties_gpu.py -q``.
"""

import pytest
import torch
import torch.nn.functional as F

from helpers.support import masked_loss_truth
from infcl import cal_inf_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _duplicated(b, guide_dim, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, 64, generator=gen), dim=1)
    k = F.normalize(q + 0.3 * torch.randn(b, 64, generator=gen), dim=1)
    gq = F.normalize(torch.randn(b, guide_dim, generator=gen), dim=1)
    gk = F.normalize(gq + torch.randn(b, guide_dim, generator=gen), dim=1)
    for j in range(1, b, 7):  # columns duplicating another labelled column, across tiles
        src = (j * 31) % b
        k[j], gk[j], q[j], gq[j] = k[src], gk[src], q[src], gq[src]
    return [t.to("cuda") for t in (q.to(dtype), k.to(dtype))], (gq.cuda(), gk.cuda())


@pytest.mark.parametrize("tf32", (False, True))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("symmetric", (False, True))
def test_triton_guide_ties_match_reference(dtype, tf32, symmetric, float32_matmul):
    float32_matmul(tf32)
    (q, k), guide = _duplicated(1000, 384, 0, dtype)
    # The float64 truth of the rule on the CPU, its guide scores exactly rounded (tests/helpers/exact_scores.py):
    # a duplicate ties its threshold there whatever the BLAS (a float64 GEMM need not tie it).
    ours = cal_inf_loss(q, k, None, 10.0, symmetric=symmetric, guide=guide, reduction="none", backend="triton")
    cpu_guide = tuple(g.cpu() for g in guide)
    ref = masked_loss_truth(q.cpu(), k.cpu(), None, 10.0, symmetric=symmetric, reduction="none", guide=cpu_guide)
    # A dropped duplicate moves its row by ~log 2; rounding of features moves it by ~1e-2 at most in bf16.
    assert (ours.double().cpu() - ref).abs().max() < 0.1, (ours.double().cpu() - ref).abs().max()


def test_triton_id_views_on_gpu():
    (q, k), _ = _duplicated(300, 8, 1, torch.float32)
    meta = torch.zeros(300, 3, dtype=torch.long, device="cuda")
    meta[:, 1] = torch.arange(300, device="cuda") // 3
    ids = meta[:, 1]
    got = cal_inf_loss(q, k, q_ids=ids, k_ids=ids, backend="triton")
    want = cal_inf_loss(q, k, q_ids=ids.contiguous(), k_ids=ids.contiguous(), backend="triton")
    torch.testing.assert_close(got, want)
