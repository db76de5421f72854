import os
import sys

import torch

# Without a GPU, test the Triton kernels through Triton's interpreter (CPU tensors). Triton 3.9 reads
# TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when infcl.kernels is first imported, so
# it must be set here, before any test module is collected. An explicit value is left alone.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Make `import support` work from any test module.
sys.path.insert(0, os.path.dirname(__file__))
