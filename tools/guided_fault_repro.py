"""The guided Triton fault of the H200 run (README, "On a GPU"). Needs a CUDA GPU.

``python tools/guided_fault_repro.py kernel 1000 bfloat16`` faults in the masked forward kernel (run it under
compute-sanitizer); ``... kernel 1000 float32`` runs; ``torchscores`` in place of ``kernel`` takes the guide
thresholds from the torch tiles (it still faults); a fourth argument casts the guide to the features' dtype.
"""

import sys

import torch
import torch.nn.functional as F

from infcl import cal_inf_loss
from infcl.backends import triton_backend

if sys.argv[1] == "torchscores":
    tiles = triton_backend.TORCH_TILES
    triton_backend.TritonBackend.guide_label_scores = lambda self, *args: tiles.guide_label_scores(*args)
b, dtype, guide_cast = int(sys.argv[2]), getattr(torch, sys.argv[3]), len(sys.argv) > 4
gen = torch.Generator().manual_seed(0)
q = F.normalize(torch.randn(b, 64, generator=gen), dim=1)
k = F.normalize(q + 0.3 * torch.randn(b, 64, generator=gen), dim=1)
gq = F.normalize(torch.randn(b, 384, generator=gen), dim=1)
gk = F.normalize(gq + torch.randn(b, 384, generator=gen), dim=1)
q, k = q.to(dtype).cuda(), k.to(dtype).cuda()
gq, gk = ((g.to(dtype) if guide_cast else g).cuda() for g in (gq, gk))
out = cal_inf_loss(q, k, None, 10.0, reduction="none", backend="triton", guide=(gq, gk))
torch.cuda.synchronize()
print("OK", sys.argv[1:], float(out.sum()))
