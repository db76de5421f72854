"""infcl: exact contrastive (InfoNCE / CLIP, and sigmoid / SigLIP) losses at memory linear in the batch.

    from infcl import cal_inf_loss, cal_siglip_loss
    loss = cal_inf_loss(image_feats, text_feats, scale=logit_scale.exp(), symmetric=True)
    loss = cal_siglip_loss(image_feats, text_feats, logit_scale.exp(), logit_bias)

``python -m infcl`` reports the versions and which backends run here; ``python -m infcl build`` compiles the
native CPU kernel ahead of time.
"""

from importlib import metadata

from . import versions  # noqa: F401 (first: on a torch older than the floor, one ImportError naming it)
from .api import cal_inf_loss, cal_inf_loss_reference
from .backends import BACKENDS
from .distill import InfDistillClipLoss, cal_distill_loss
from .gradcache import GradCache, RandContext, split_vlm_inputs
from .matryoshka import Matryoshka
from .maxsim import cal_maxsim_loss
from .metrics import retrieval_metrics
from .modules import InfCLIPLoss, InfSigLipLoss
from .siglip import cal_siglip_loss
from .stats import InfLossStats
from .topk import TopK, topk_scores

try:
    __version__ = metadata.version("infcl")  # the installed distribution's (setup.py's) version
except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH that was never installed
    __version__ = "0+unknown"

__all__ = [
    "cal_inf_loss",
    "cal_inf_loss_reference",
    "InfLossStats",
    "Matryoshka",
    "InfCLIPLoss",
    "cal_siglip_loss",
    "InfSigLipLoss",
    "cal_distill_loss",
    "InfDistillClipLoss",
    "cal_maxsim_loss",
    "retrieval_metrics",
    "topk_scores",
    "TopK",
    "BACKENDS",
    "GradCache",
    "RandContext",
    "split_vlm_inputs",
    "__version__",
]
