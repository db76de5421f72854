"""infcl: exact contrastive (InfoNCE / CLIP) losses at memory linear in the batch.

    from infcl import cal_inf_loss
    loss = cal_inf_loss(image_feats, text_feats, scale=logit_scale.exp(), symmetric=True)
"""

from .api import cal_inf_loss
from .backends import BACKENDS
from .gradcache import GradCache, RandContext, split_vlm_inputs
from .modules import InfCLIPLoss
from .reference import cal_inf_loss_reference

__version__ = "0.1.0"

__all__ = [
    "cal_inf_loss",
    "cal_inf_loss_reference",
    "InfCLIPLoss",
    "BACKENDS",
    "GradCache",
    "RandContext",
    "split_vlm_inputs",
    "__version__",
]
