"""The tiled pure-PyTorch backend (``backend="torch"``): runs anywhere torch runs (CPU, CUDA, MPS), no compiler
needed. A file per loss (:mod:`.softmax`, :mod:`.sigmoid`, :mod:`.distill`, :mod:`.rank`, :mod:`.topk`) on one
tile walk (:mod:`.walk`); :mod:`.backend` puts them together.

Extra memory: the float32 (float64) copies of q and k plus a few tiles, O((Bq + Bk) * D + tile_q * tile_k),
never O(Bq * Bk); no host synchronization on the softmax and sigmoid paths.
"""

from .backend import BACKEND, TORCH_TILES, TorchTilesBackend, unavailable_reason
from .walk import CPU_TILES, GPU_TILES

__all__ = ["BACKEND", "CPU_TILES", "GPU_TILES", "TORCH_TILES", "TorchTilesBackend", "unavailable_reason"]
