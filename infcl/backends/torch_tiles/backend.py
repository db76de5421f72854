"""The torch-tiles backend object: every API's block operations (:mod:`infcl.contract`) on one set of tile sizes."""

from typing import Optional, Tuple

import torch

from .distill import DistillTiles
from .matryoshka import MatryoshkaTiles
from .maxsim import MaxSimTiles
from .rank import RankTiles
from .sigmoid import SigmoidTiles
from .softmax import SoftmaxTiles
from .topk import TopKTiles


class TorchTilesBackend(SoftmaxTiles, MatryoshkaTiles, SigmoidTiles, DistillTiles, RankTiles, TopKTiles, MaxSimTiles):
    """The tiled pure-PyTorch backend (``backend="torch"``): runs anywhere torch runs (CPU, CUDA, MPS), no
    compiler needed. ``tile_q`` x ``tile_k``: the tiles (None: the device kind's defaults, :mod:`.walk`);
    ``token_tiles``: the MaxSim loss's (query tokens, document tokens) per tile (None: its defaults, :mod:`.maxsim`)."""

    name = "torch"

    def __init__(
        self, tile_q: Optional[int] = None, tile_k: Optional[int] = None, token_tiles: Optional[Tuple[int, int]] = None
    ):
        super().__init__(tile_q, tile_k)
        self.token_tiles = token_tiles


TORCH_TILES = TorchTilesBackend()
BACKEND = TORCH_TILES


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None: the torch tiles run on every device."""
    return None
