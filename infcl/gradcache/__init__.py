"""GradCache for the encoder side: a batch of any size on the memory of one chunk.

    from infcl import GradCache, cal_inf_loss
    gc = GradCache([image_encoder, text_encoder], chunk_sizes=256,
                   loss_fn=lambda i, t: cal_inf_loss(i, t, symmetric=True))
    loss = gc.cache_step(images, texts)   # .grad now holds the full-batch gradient

Modules: ``grad_cache`` (the three phases), ``inputs`` (splitting, model calls, representation
extraction), ``vlm`` (Qwen-VL patch-aware splitting), ``rand_context`` (RNG replay),
``precision`` (fp16/bf16 autocast and loss scaling), ``auto_chunk`` (``chunk_sizes="auto"``),
``sync`` (``no_sync_except_last`` for DDP, FSDP and FSDP2).
"""

from .grad_cache import GradCache
from .inputs import get_rep, split_inputs
from .rand_context import RandContext, module_devices
from .vlm import split_vlm_inputs

__all__ = ["GradCache", "RandContext", "module_devices", "split_inputs", "split_vlm_inputs", "get_rep"]
