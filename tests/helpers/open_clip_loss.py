"""open_clip's own loss module (``open_clip/loss.py``), the reference the drop-in tests compare with.

``import open_clip`` pulls in its models, which need torchvision; README's Set up installs open_clip with
--no-deps, and the loss module needs only torch, so it is loaded from its file under another name.
(bench/open_clip_loss.py does the same for the benchmark; the tests keep their own so that no test needs bench.)
"""

import functools
import importlib.util
import os
from types import ModuleType
from typing import Optional


@functools.lru_cache(maxsize=None)
def load() -> Optional[ModuleType]:
    """open_clip's ``loss`` module (``ClipLoss``, ``SigLipLoss``, ``DistillClipLoss``, ...), or None without it."""
    spec = importlib.util.find_spec("open_clip")
    path = spec and spec.submodule_search_locations and os.path.join(spec.submodule_search_locations[0], "loss.py")
    if not path or not os.path.isfile(path):
        return None
    file_spec = importlib.util.spec_from_file_location("open_clip_reference_loss", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module
