"""The one backend resolver: the backend names, the one "auto" table, the INFCL_BACKEND override, and the
backend object that runs a call.

- "reference": materializes the logits and uses autograd (the losses' tests and debugging; O(Bq * Bk)
  memory); the distillation loss, the retrieval ranks and the top-k search have none (their float64 truths live
  in the tests).
- "torch":     the tiled pure PyTorch (:mod:`.torch_tiles`), any device.
- "cpu":       the native C++ kernel (:mod:`.native`, csrc/), CPU tensors.
- "triton":    the fused Triton kernels (:mod:`.triton`, infcl/kernels/), CUDA tensors (or CPU tensors under
  TRITON_INTERPRET=1).
- "chunked":   the exact chunked route (:mod:`.chunked`: cuBLAS products with float32 scores, the Triton passes of
  infcl/kernels/chunked_softmax.py; docs/chunked.md), the softmax loss on CUDA tensors (CPU tensors for tests);
  it hands the sigmoid loss to the fused kernels, and the distillation loss and the ranks have none.

Each backend is one object with every API's block operations (:mod:`infcl.contract`): a folder per backend,
a file per loss inside. ``backend="auto"`` reads :data:`AUTO`; where the backend it names cannot run on a
device (triton missing, a ROCm GPU, an architecture with no compiled configs; the native kernel not built)
it runs the torch tiles, and warns once for a CUDA device, naming why. ``INFCL_BACKEND=<name>`` overrides
"auto" (never an explicit name). "auto" takes "chunked" only where :data:`CHUNKED_FROM`, a table of measured
times, says it is faster (:func:`measured_route`): the table is empty, so nowhere yet. Float64 blocks on a Triton
without a float64 ``tl.dot`` run on the torch tiles: the one rule is
:func:`infcl.backends.triton.options.on_torch_tiles`.

Every backend runs the mask options of ``cal_inf_loss`` (ids, ``multi_positive``, ``guide``;
:mod:`infcl.masks`); only a guide changes the choice (the "guided" row of :data:`AUTO`).
"""

import importlib
import os
import sys
import warnings
from typing import Dict, Tuple

import torch

BACKENDS = ("auto", "reference", "torch", "cpu", "triton", "chunked")
ENV_VAR = "INFCL_BACKEND"

# What "auto" runs, per call kind and device type, when that backend can run there (else the torch tiles;
# a device type not listed runs the torch tiles). "guided" is cal_inf_loss with a guide.
AUTO = {
    #             CPU tensors      CUDA tensors
    "softmax": {"cpu": "cpu", "cuda": "triton"},
    "sigmoid": {"cpu": "cpu", "cuda": "triton"},
    # The masked Triton forward with a guide stopped with an illegal memory access on an H200 (bf16 features,
    # D = 64; README, "On a GPU", tools/guided_fault_repro.py): off the default path until a GPU shows it fixed.
    "guided": {"cpu": "cpu", "cuda": "torch"},
    # The Triton kernels pass the interpreter tests and the compile gate, but no GPU has run them yet.
    "distill": {"cpu": "cpu", "cuda": "torch"},
    "rank": {"cpu": "cpu", "cuda": "torch"},
    "topk": {"cpu": "cpu", "cuda": "torch"},
    # The MaxSim loss runs on the torch tiles only, for now (no native or Triton kernel yet).
    "maxsim": {"cpu": "torch", "cuda": "torch"},
}
# The backend each device type runs best when it can (the one whose unavailability "auto" checks and reports).
NATIVE_TO = {"cpu": "cpu", "cuda": "triton"}
# Where AUTO holds back a backend that can run, the one warning it gives (the others hold back silently).
HELD_BACK = {
    "guided": "infcl: backend='auto' runs a guided loss on the torch tiles, not the Triton kernels "
    "(a known fault of the guided Triton kernel; pass backend='triton' to run it anyway)",
}
# The call kinds without a "reference" backend, and the public function each belongs to (for the error).
NO_REFERENCE = {
    "distill": "cal_distill_loss",
    "rank": "retrieval_metrics",
    "topk": "topk_scores",
    "maxsim": "cal_maxsim_loss",
}
# The call kinds without a "chunked" route (it is the softmax loss's; the sigmoid loss's hands its blocks to the
# fused kernels). INFCL_BACKEND=chunked runs them on their own "auto" choice.
NO_CHUNKED = {
    "distill": "cal_distill_loss",
    "rank": "retrieval_metrics",
    "topk": "topk_scores",
    "maxsim": "cal_maxsim_loss",
}
# The call kinds that some backends do not run yet, and those backends: an explicit one raises ValueError,
# INFCL_BACKEND naming one runs the kind's own "auto" choice.
NOT_YET = {"maxsim": ("cal_maxsim_loss", ("cpu", "triton"))}
# Where "auto" takes the chunked route instead of AUTO's "triton" for a plain softmax loss (no masks): (GPU family,
# dtype name) -> the smallest Bq from which a GPU measured the route's forward + backward faster than the fused
# kernels'; family as infcl.kernels.target's ARCH_FAMILIES keys, e.g. (90, "bfloat16"): 16384. ``python -m
# bench.gpu_ab`` measures it; an entry goes in by hand with the run's file named beside it. Empty: no GPU has run
# the route yet, so "auto" keeps AUTO's choice everywhere (docs/chunked.md).
CHUNKED_FROM: Dict[Tuple[int, str], int] = {}

# The backends beside the torch tiles live in their own packages, each exposing ``BACKEND`` and
# ``unavailable_reason(device)`` (None when usable on that device); imported only when asked for.
_PACKAGES = {
    "torch": "infcl.backends.torch_tiles",
    "cpu": "infcl.backends.native",
    "triton": "infcl.backends.triton",
    "chunked": "infcl.backends.chunked",
}


_LOADED = {}  # name -> (module or None, why not): imported once, so a compiled call only reads a dict


def _backend_module(name: str):
    if name not in _LOADED:
        try:
            _LOADED[name] = importlib.import_module(_PACKAGES[name]), None
        except ImportError as err:
            _LOADED[name] = None, f"backend {name!r} is not available: {err}"
    return _LOADED[name]


def unavailable_reason(name: str, device: torch.device):
    """None if backend ``name`` can run on ``device``, else a sentence saying why not."""
    if name in ("reference", "torch"):
        return None
    module, why = _backend_module(name)
    return why if module is None else module.unavailable_reason(device)


_WARNED = set()


def warn_once(message: str) -> None:
    """One warning per distinct message per process (the fallback is chosen at every call)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def constant_for_compile(fn):
    """torch.compile runs ``fn`` while tracing and keeps its result as a constant (no graph break on the
    imports, driver queries and warnings inside); eager calls are unchanged.

    ``torch.compiler.assume_constant_result`` only sets ``fn._dynamo_marked_constant`` (torch 2.4 to 2.13),
    but calling it imports torch._dynamo, which imports triton and costs about a second: importing infcl
    must load neither. So the mark is set directly unless dynamo is already loaded.
    """
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@constant_for_compile
def resolve_backend(backend, device: torch.device, kind: str = "softmax") -> str:
    """Turn the user's ``backend`` argument (and INFCL_BACKEND for "auto") into a concrete name for a call of
    ``kind`` (a key of :data:`AUTO`) on ``device``. An explicit backend that cannot run raises RuntimeError
    saying why; "reference" for a kind without one (:data:`NO_REFERENCE`) raises NotImplementedError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference" and kind in NO_REFERENCE:
        raise NotImplementedError(
            f"{NO_REFERENCE[kind]} has no backend='reference' (it would materialize the B x B scores); use "
            f"{_runnable(kind)}"
        )
    if backend == "chunked" and kind in NO_CHUNKED:
        raise ValueError(
            f"{NO_CHUNKED[kind]} has no backend='chunked' (the softmax loss's route); use {_runnable(kind)}"
        )
    api, not_yet = NOT_YET.get(kind, ("", ()))
    if backend in not_yet:
        raise ValueError(f"{api} has no backend={backend!r} yet; use {_runnable(kind)}")
    if backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            if env not in BACKENDS:
                raise ValueError(f"environment variable {ENV_VAR} must be one of {BACKENDS}, got {env!r}")
            backend = env
    if backend == "auto":
        return _auto(device, kind)
    if backend == "reference" and kind in NO_REFERENCE:
        return "torch"  # INFCL_BACKEND=reference: the torch tiles, which materialize nothing either
    if (backend == "chunked" and kind in NO_CHUNKED) or backend in not_yet:
        return _auto(device, kind)  # INFCL_BACKEND=chunked (or one not run yet): this API's own "auto" choice
    why = unavailable_reason(backend, device)
    if why is not None:
        raise RuntimeError(why)
    return backend


def _runnable(kind: str) -> str:
    """The backends a call of ``kind`` can be given, for an error message: "'auto', 'torch', 'cpu' or 'triton'"."""
    names = [f"'{name}'" for name in ("auto", "torch", "cpu", "triton") if name not in NOT_YET.get(kind, ("", ()))[1]]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _auto(device: torch.device, kind: str) -> str:
    """:data:`AUTO`'s choice for ``kind`` on ``device``, or the torch tiles where it cannot run."""
    best = NATIVE_TO.get(device.type)
    if best is None:
        return "torch"
    why = unavailable_reason(best, device)
    if why is None:
        choice = AUTO[kind][device.type]
        if choice != best and kind in HELD_BACK:
            warn_once(HELD_BACK[kind])
        return choice
    if best == "triton":
        warn_once(f"infcl: backend='auto' runs the torch tiles on {device.type} tensors, not the Triton kernels: {why}")
    return "torch"


def measured_route(name: str, kind: str, q: torch.Tensor, k: torch.Tensor) -> str:
    """What "auto" runs for a call of ``kind`` on the blocks of ``q`` [Bq, D] and ``k`` [Bk, D], given ``name``,
    :func:`resolve_backend`'s answer for it: "chunked" where :data:`CHUNKED_FROM` measured the route faster than
    the fused kernels on this GPU family and dtype from this Bq on and the workspace budget fits it
    (:func:`infcl.backends.chunked.auto.measured_faster`), else ``name``. Call it only for ``backend="auto"``;
    an INFCL_BACKEND override keeps its name."""
    if name != "triton" or kind != "softmax" or not CHUNKED_FROM or os.environ.get(ENV_VAR, "").strip():
        return name
    module, why = _backend_module("chunked")
    faster = why is None and module.measured_faster(q, k, CHUNKED_FROM, module.BACKEND.budget_mb)
    return "chunked" if faster else name


def backend_object(name: str):
    """The backend object of ``name`` ("torch", "cpu", "triton", "chunked"): every API's block operations
    (:mod:`infcl.contract`)."""
    module, why = _backend_module(name)
    if module is None:
        raise RuntimeError(why)
    return module.BACKEND


def backend_for(backend, device: torch.device, kind: str):
    """The backend object that runs a call of ``kind`` with the user's ``backend`` on ``device``
    (:func:`resolve_backend`, then :func:`backend_object`)."""
    return backend_object(resolve_backend(backend, device, kind))
