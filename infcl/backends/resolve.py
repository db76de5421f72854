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
  infcl/kernels/chunked_softmax.py and chunked_sigmoid.py; docs/chunked.md), the softmax and sigmoid losses on
  CUDA tensors (CPU tensors for tests); the distillation loss and the ranks have none.

A call names a backend by its name, or by a backend object with its own options (``backend=
infcl.backends.ChunkedBackend(budget_mb=512)``, ``TritonBackend(tiling=...)``, ``TorchTilesBackend(tile_q=...)``):
the object runs the call as the name would, with its options. :func:`call_backend` is the one place a call's
backend is chosen, and where the environment is read, once per call (INFCL_BACKEND; the chunked route's
INFCL_CHUNK_BUDGET_MB through ``ChunkedBackend.for_call``).

Each backend is one object with every API's block operations (:mod:`infcl.contract`): a folder per backend,
a file per loss inside. ``backend="auto"`` reads :data:`AUTO`; where the backend it names cannot run on a
device (triton missing, a ROCm GPU, an architecture with no compiled configs; the native kernel not built)
it runs the torch tiles, and warns once for a CUDA device, naming why. ``INFCL_BACKEND=<name>`` overrides
"auto" (never an explicit name). "auto" takes "chunked" only where :data:`CHUNKED_FROM`, a table of measured
times, says it is faster (:func:`measured_route`): on Hopper (sm_90) in bfloat16 from Bq = 16384, for the softmax
and the sigmoid losses without mask options (an H100, 2026-12-06). Float64 blocks on a Triton
without a float64 ``tl.dot`` run on the torch tiles: the one rule is
:func:`infcl.backends.triton.options.on_torch_tiles`.

Every backend runs the mask options of ``cal_inf_loss`` (ids, ``multi_positive``, ``guide``;
:mod:`infcl.masks`); only a guide changes the choice (the "guided" row of :data:`AUTO`).
"""

import importlib
import os
from typing import Dict, Optional, Tuple

import torch

from .once import _WARNED, constant_for_compile, warn_once  # noqa: F401 (_WARNED: the tests clear it)

BACKENDS = ("auto", "reference", "torch", "cpu", "triton", "chunked")
# The backends a call may also name by an object with its own options (``backend=ChunkedBackend(budget_mb=512)``,
# ``TritonBackend(tiling=...)``, ``TorchTilesBackend(tile_q=...)``): every object's ``name`` is one of these.
OBJECT_BACKENDS = ("torch", "cpu", "triton", "chunked")
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
    # The MaxSim loss: the native kernel on CPU (docs/maxsim.md: 2 token products over the real tokens against the
    # torch tiles' 4 over padded ones); its Triton kernels pass the interpreter tests and the compile gate, but no GPU
    # has run them yet (backend="triton" runs them).
    "maxsim": {"cpu": "cpu", "cuda": "torch"},
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
# The call kinds without a "chunked" route (it is the softmax and sigmoid losses'). INFCL_BACKEND=chunked runs them
# on their own "auto" choice.
NO_CHUNKED = {
    "distill": "cal_distill_loss",
    "rank": "retrieval_metrics",
    "topk": "topk_scores",
    "maxsim": "cal_maxsim_loss",
}
# The call kinds that some backends do not run yet, and those backends: an explicit one raises ValueError,
# INFCL_BACKEND naming one runs the kind's own "auto" choice.
NOT_YET: Dict[str, Tuple[str, Tuple[str, ...]]] = {}  # every call kind runs on every backend it has
# Where "auto" takes the chunked route instead of AUTO's "triton" for a loss without mask options: call kind ->
# (GPU family, dtype name) -> the smallest Bq from which a GPU measured the route's forward + backward faster than
# the fused kernels'; family as infcl.kernels.target's ARCH_FAMILIES keys. ``python -m bench --preset gpu-first``
# measures it (its ``autotable`` step suggests the entry); an entry goes in by hand with the run's file named beside
# it. A family or dtype without an entry keeps AUTO's choice (docs/chunked.md).
CHUNKED_FROM: Dict[str, Dict[Tuple[int, str], int]] = {
    # One H100 SXM, torch 2.11, Triton 3.6, bf16, D = 512 (bench/results/gpu-first-h100.md): the route beat the
    # fused kernels at every B measured (16k, 32k, 64k): CLIP 5.0 / 16.1 / 65.4 ms against 13.7 / 43.6 / 169.0,
    # SigLIP 3.0 / 9.8 / 39.6 against 28.2 / 107.6 / 429.9. Smaller B was not measured (bench.chunked_sweep's
    # ``auto`` step measures 2k-8k).
    "softmax": {(90, "bfloat16"): 16384},
    "sigmoid": {(90, "bfloat16"): 16384},
}

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


def backend_name(backend) -> str:
    """The name the user's ``backend`` argument stands for: one of :data:`BACKENDS`, or a backend object's ``name``
    (an object of :data:`OBJECT_BACKENDS`' classes with its own options, e.g. ``ChunkedBackend(budget_mb=512)``)."""
    if isinstance(backend, str):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        return backend
    if getattr(backend, "name", None) not in OBJECT_BACKENDS:
        raise TypeError(
            f"backend must be one of {BACKENDS} or a backend object such as "
            f"infcl.backends.ChunkedBackend(budget_mb=512), got {type(backend).__name__}"
        )
    return backend.name


def _env_backend() -> str:
    """INFCL_BACKEND, validated (read once per call: :func:`call_backend`)."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env and env not in BACKENDS:
        raise ValueError(f"environment variable {ENV_VAR} must be one of {BACKENDS}, got {env!r}")
    return env


@constant_for_compile
def _resolve(backend: str, device: torch.device, kind: str, env: str) -> str:
    """:func:`resolve_backend` for the name ``backend`` with INFCL_BACKEND's value ``env`` ("" when unset)."""
    if backend == "reference" and kind in NO_REFERENCE:
        raise NotImplementedError(
            f"{NO_REFERENCE[kind]} has no backend='reference' (it would materialize the B x B scores); use "
            f"{_runnable(kind)}"
        )
    if backend == "chunked" and kind in NO_CHUNKED:
        raise ValueError(
            f"{NO_CHUNKED[kind]} has no backend='chunked' (the softmax and sigmoid losses' route); use "
            f"{_runnable(kind)}"
        )
    api, not_yet = NOT_YET.get(kind, ("", ()))
    if backend in not_yet:
        raise ValueError(f"{api} has no backend={backend!r} yet; use {_runnable(kind)}")
    if backend == "auto" and env:
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


def resolve_backend(backend, device: torch.device, kind: str = "softmax") -> str:
    """Turn the user's ``backend`` argument (a name or a backend object; and INFCL_BACKEND for "auto") into a
    concrete name for a call of ``kind`` (a key of :data:`AUTO`) on ``device``. An explicit backend that cannot
    run raises RuntimeError saying why; "reference" for a kind without one (:data:`NO_REFERENCE`) raises
    NotImplementedError."""
    name = backend_name(backend)
    return _resolve(name, device, kind, _env_backend() if name == "auto" else "")


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


def measured_route(name: str, kind: str, q: torch.Tensor, k: torch.Tensor, budget_mb: Optional[float] = None) -> str:
    """What "auto" runs for a call of ``kind`` on the blocks of ``q`` [Bq, D] and ``k`` [Bk, D], given ``name``,
    the resolver's answer for it: "chunked" where :data:`CHUNKED_FROM` measured the route faster than the fused
    kernels on this GPU family and dtype from this Bq on and the workspace budget (``budget_mb``: the chunked
    route's default, :meth:`ChunkedBackend.for_call`'s) fits it (:func:`infcl.backends.chunked.auto.measured_faster`),
    else ``name``. Only for ``backend="auto"`` without an INFCL_BACKEND override (:func:`call_backend` says when)."""
    table = CHUNKED_FROM.get(kind)
    if name != "triton" or not table:
        return name
    module, why = _backend_module("chunked")
    if why is not None:
        return name
    if budget_mb is None:
        budget_mb = module.BACKEND.for_call().budget_mb
    return "chunked" if module.measured_faster(q, k, table, budget_mb) else name


def backend_object(name: str):
    """The default backend object of ``name`` ("torch", "cpu", "triton", "chunked"): every API's block operations
    (:mod:`infcl.contract`)."""
    module, why = _backend_module(name)
    if module is None:
        raise RuntimeError(why)
    return module.BACKEND


def call_backend(backend, device: torch.device, kind: str, operands=None) -> Tuple[str, object]:
    """(name, backend object) that run one call of ``kind`` on ``device`` with the user's ``backend`` (a name or
    a backend object, :func:`backend_name`); the object is None for "reference". The environment is read here,
    once per call: INFCL_BACKEND for "auto", and each backend's own variables by its ``for_call()`` (the chunked
    route's INFCL_CHUNK_BUDGET_MB), whose result the call's blocks share. ``operands``: (q, k) where "auto" may
    take the chunked route (:func:`measured_route`: a loss without mask options)."""
    name = backend_name(backend)
    env = _env_backend() if name == "auto" else ""
    resolved = _resolve(name, device, kind, env)
    chosen = backend if not isinstance(backend, str) else None
    if name == "auto" and not env and operands is not None and resolved == "triton" and CHUNKED_FROM.get(kind):
        # only where the table can answer: a CPU call neither imports the route nor reads its environment
        default = backend_object("chunked").for_call()
        resolved = measured_route(resolved, kind, *operands, default.budget_mb)
        chosen = default if resolved == "chunked" else None
    if resolved == "reference":
        return resolved, None
    chosen = backend_object(resolved) if chosen is None else chosen
    for_call = getattr(chosen, "for_call", None)
    return resolved, chosen if for_call is None else for_call()


def backend_for(backend, device: torch.device, kind: str):
    """The backend object that runs a call of ``kind`` with the user's ``backend`` on ``device``
    (:func:`call_backend`)."""
    return call_backend(backend, device, kind)[1]
