"""open_clip's loss module (``open_clip/loss.py``), loaded by file for the tests and the benchmark.

``import open_clip`` pulls in its models, which need torchvision (and more); the loss module needs only
torch, so it is loaded from its file under another name. Returns None when open_clip is not installed.
"""

import functools
import importlib.util
import os
from types import ModuleType
from typing import Optional

MODULE_NAME = "open_clip_loss"


@functools.lru_cache(maxsize=None)
def load() -> Optional[ModuleType]:
    """open_clip's ``loss`` module (``ClipLoss``, ``SigLipLoss``, ...), or None without open_clip."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "loss.py")
    if not os.path.isfile(path):
        return None
    file_spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module
