"""GradCache: contrastive training at a batch far larger than the encoder memory allows.

Call-compatible with luyug/GradCache (``GradCache(models, chunk_sizes, loss_fn, ...)``,
``cache_step(*model_inputs, no_sync_except_last=False, **loss_kwargs)``). One step is three phases:

1. ``forward_no_grad``: each model, in the order given, encodes its input chunk by chunk without a
   graph; the RNG state before each chunk is kept in a :class:`RandContext`. Memory: one chunk's
   forward plus the [B, D] representations.
2. ``build_cache``: the loss on the full batch of representations (with ``cal_inf_loss`` it never
   builds B x B), back-propagated to the representations only; their gradients are the cache. The
   loss function's own parameters (a learnable temperature) get their gradients here.
3. ``forward_backward``: each chunk is encoded again with a graph, its RNG replayed so dropout
   matches, and ``dot(reps, cached_grad)`` (float32) is back-propagated. Its parameter gradient is
   exactly the chunk's share of dL/dθ, since d/dθ <reps(θ), g> = g · dreps/dθ with g = dL/dreps.

After ``cache_step`` every parameter's ``.grad`` holds (accumulates into) the gradient of the loss of
the whole batch, as if one big forward/backward had run the same chunks in the same order.
"""

from contextlib import nullcontext
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .auto_chunk import auto_chunk_size
from .inputs import call_model, get_rep, input_tensors, split_inputs
from .precision import Precision, autocast_disabled
from .rand_context import RandContext, module_devices
from .sync import check_syncable, no_sync

AUTO = "auto"


class GradCache:
    """Gradient caching over one or more encoders.

    Args:
        models: list of encoders, one per model input of :meth:`cache_step`. The same module may
            appear several times (one encoder for queries and passages).
        chunk_sizes: samples per chunk: one int for all inputs, a list with one per input, or
            ``"auto"`` (the largest chunk whose activations fit ``memory_budget``, see
            :mod:`infcl.gradcache.auto_chunk`).
        loss_fn: ``loss_fn(*reps, **loss_kwargs) -> 0-d tensor``, reps in model order, each the
            concatenation of its chunks' representations. May be an ``nn.Module`` with parameters.
        split_input_fn: ``(model_input, chunk_size) -> list of chunks``; default
            :func:`infcl.gradcache.inputs.split_inputs` (use :func:`infcl.split_vlm_inputs` for Qwen-VL).
        get_rep_fn: ``model_output -> reps tensor``; default :func:`infcl.gradcache.inputs.get_rep`
            with ``rep_field``.
        fp16: run models and loss under float16 autocast; needs ``scaler`` (see
            :mod:`infcl.gradcache.precision`). The caller unscales and steps.
        scaler: a ``torch.amp.GradScaler`` for fp16.
        bf16: run models and loss under bfloat16 autocast (no scaler). Not in luyug's API.
        memory_budget: bytes of activations per chunk for ``chunk_sizes="auto"`` (default on CUDA:
            half the free memory; required elsewhere). Not in luyug's API.
        rep_field: the output field that holds the representation (e.g. ``"pooler_output"``,
            ``"text_embeds"``), for the default extraction; see :func:`infcl.gradcache.inputs.get_rep`
            for what is taken when it is None. Not in luyug's API.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        chunk_sizes: Union[int, Sequence[int], str],
        loss_fn: Callable[..., torch.Tensor],
        split_input_fn: Optional[Callable[[Any, int], List[Any]]] = None,
        get_rep_fn: Optional[Callable[[Any], torch.Tensor]] = None,
        fp16: bool = False,
        scaler=None,
        *,
        bf16: bool = False,
        memory_budget: Optional[int] = None,
        rep_field: Optional[str] = None,
    ):
        if isinstance(models, nn.Module) or not all(isinstance(m, nn.Module) for m in models):
            raise TypeError("models must be a list of nn.Module (one per model input of cache_step)")
        self.models = list(models)
        if not self.models:
            raise ValueError("models must not be empty")
        self.chunk_sizes = self._check_chunk_sizes(chunk_sizes)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self.split_input_fn = split_input_fn
        self.get_rep_fn = get_rep_fn
        self.precision = Precision(fp16, bf16, scaler)
        self.memory_budget = memory_budget
        self.rep_field = rep_field

    def _check_chunk_sizes(self, chunk_sizes) -> Union[str, List[int]]:
        if chunk_sizes == AUTO:
            return AUTO
        sizes = [chunk_sizes] * len(self.models) if isinstance(chunk_sizes, int) else list(chunk_sizes)
        if len(sizes) != len(self.models) or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in sizes):
            raise ValueError(
                f"chunk_sizes must be a positive int, 'auto', or one positive int per model ({len(self.models)}); "
                f"got {chunk_sizes!r}"
            )
        return sizes

    # ---- luyug-compatible hooks ------------------------------------------------------------------

    def __call__(self, *model_inputs, no_sync_except_last: bool = False, **loss_kwargs) -> torch.Tensor:
        return self.cache_step(*model_inputs, no_sync_except_last=no_sync_except_last, **loss_kwargs)

    def split_inputs(self, model_input: Any, chunk_size: int) -> List[Any]:
        split = self.split_input_fn if self.split_input_fn is not None else split_inputs
        return list(split(model_input, chunk_size))

    def get_input_tensors(self, model_input: Any) -> List[torch.Tensor]:
        """The tensors of one model input (chunk): their devices name the RNGs each chunk's
        :class:`RandContext` records, and the first one's device type picks the autocast device. Override
        it for an input type the default (:func:`infcl.gradcache.inputs.input_tensors`: tensors, lists,
        tuples and mappings, nested) cannot look into."""
        return input_tensors(model_input)

    def model_call(self, model: nn.Module, model_input: Any) -> Any:
        tensors = self.get_input_tensors(model_input)
        device_type = tensors[0].device.type if tensors else _param_device_type(model)
        with self.precision.forward_context(device_type):
            return call_model(model, model_input)

    def get_reps(self, model_out: Any) -> torch.Tensor:
        reps = self.get_rep_fn(model_out) if self.get_rep_fn is not None else get_rep(model_out, self.rep_field)
        if not isinstance(reps, torch.Tensor) or reps.dim() == 0:
            raise TypeError(f"a representation must be a tensor of at least 1 dim, got {_describe(reps)}")
        return reps

    def compute_loss(self, *reps: torch.Tensor, **loss_kwargs) -> torch.Tensor:
        return self.loss_fn(*reps, **loss_kwargs)

    # ---- the three phases ------------------------------------------------------------------------

    def forward_no_grad(self, model: nn.Module, model_inputs: List[Any]) -> Tuple[torch.Tensor, List[RandContext]]:
        """Phase 1 for one model: (reps of all chunks concatenated on dim 0, one RandContext per chunk)."""
        chunk_reps, rnd_states = self.forward_no_grad_chunks(model, model_inputs)
        return torch.cat(chunk_reps, dim=0), rnd_states

    def forward_no_grad_chunks(
        self, model: nn.Module, model_inputs: Iterable[Any]
    ) -> Tuple[List[torch.Tensor], List[RandContext]]:
        """Phase 1 for one model, chunk by chunk: ([reps of each chunk], one RandContext per chunk), for a
        caller that keeps the chunks apart (sentence-transformers' per-mini-batch embeddings)."""
        chunk_reps, rnd_states = [], []
        devices = module_devices(model)  # a model may move CPU inputs to its GPU: replay that RNG too
        with torch.no_grad():
            for chunk in model_inputs:
                rnd_states.append(RandContext(*self.get_input_tensors(chunk), devices=devices))
                chunk_reps.append(self.get_reps(self.model_call(model, chunk)).detach())
        # Under an outer autocast, torch 2.8 caches the low-precision weight copies made here, under no_grad, and
        # hands them to the gradient pass, whose weights then get no gradient: drop them (a later torch does not
        # cache casts without grad; clearing costs one cast per weight).
        torch.clear_autocast_cache()
        return chunk_reps, rnd_states

    def build_cache(self, *reps: torch.Tensor, **loss_kwargs) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Phase 2: ([dL/dreps per model], detached loss). Loss parameters get their .grad here.

        In fp16 mode the gradients are scaled by the scaler (see :mod:`infcl.gradcache.precision`).
        """
        leaves = [r.detach().requires_grad_() for r in reps]
        device_type = leaves[0].device.type
        with torch.enable_grad():
            with self.precision.forward_context(device_type):
                loss = self.compute_loss(*leaves, **loss_kwargs)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return a 0-d tensor, got {_describe(loss)}")
            self.precision.backward(loss, {r.device.type for r in leaves})
        cache = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        return cache, loss.detach()

    def forward_backward(
        self,
        model: nn.Module,
        model_inputs: List[Any],
        cached_gradients: Sequence[torch.Tensor],
        random_states: Sequence[RandContext],
        no_sync_except_last: bool = False,
        *,
        sync_last_chunk: bool = True,
    ) -> None:
        """Phase 3 for one model: re-encode each chunk with its RNG replayed, back-propagate
        ``dot(reps, cached_gradient)`` in float32.

        With ``no_sync_except_last`` (DDP, FSDP or FSDP2), every chunk runs with the model's gradient
        synchronization suspended (:func:`infcl.gradcache.sync.no_sync`) except the last one, and that
        one too unless ``sync_last_chunk`` (False when the same module is used again by a later input,
        which will sync for both).
        """
        if not (len(model_inputs) == len(cached_gradients) == len(random_states)):
            raise ValueError(
                f"forward_backward needs one cached gradient and RNG state per chunk: {len(model_inputs)} chunks, "
                f"{len(cached_gradients)} gradients, {len(random_states)} states"
            )
        last = len(model_inputs) - 1
        for i, (chunk, grad, state) in enumerate(zip(model_inputs, cached_gradients, random_states)):
            syncs = not no_sync_except_last or (i == last and sync_last_chunk)
            with nullcontext() if syncs else no_sync(model):
                with torch.enable_grad():
                    with state:
                        reps = self.get_reps(self.model_call(model, chunk))
                    if reps.shape != grad.shape:
                        raise ValueError(
                            f"chunk {i} gave reps of shape {tuple(reps.shape)} on the second pass but "
                            f"{tuple(grad.shape)} on the first: the model must be deterministic given the RNG"
                        )
                    if not reps.requires_grad:  # a frozen encoder: nothing to accumulate
                        continue
                    with autocast_disabled({reps.device.type}):
                        surrogate = torch.dot(reps.flatten().float(), grad.flatten().float())
                        self.chunk_backward(surrogate)

    def chunk_backward(self, surrogate: torch.Tensor) -> None:
        """Back-propagate one chunk's surrogate ``dot(reps, cached_gradient)`` (a 0-d float32 tensor) into the
        model's parameters. Override it where a training engine owns the backward
        (:class:`infcl.gradcache.deepspeed.DeepSpeedGradCache` sends it through ``engine.backward``)."""
        surrogate.backward()

    # ---- one step --------------------------------------------------------------------------------

    def cache_step(self, *model_inputs, no_sync_except_last: bool = False, **loss_kwargs) -> torch.Tensor:
        """One GradCache step over ``model_inputs`` (one per model). Returns the detached loss.

        Parameter gradients are accumulated into ``.grad`` (zero them before, step after). With
        ``no_sync_except_last=True`` every model must be ``DistributedDataParallel``,
        ``FullyShardedDataParallel`` or an FSDP2 module (``fully_shard``); gradients are all-reduced
        (reduce-scattered) once per distinct module, on its last chunk.
        """
        if len(model_inputs) != len(self.models):
            raise ValueError(f"cache_step got {len(model_inputs)} model inputs for {len(self.models)} models")
        if no_sync_except_last:
            check_syncable(self.models)
        chunk_sizes = self._resolve_chunk_sizes(model_inputs)
        chunked = [self.split_inputs(x, c) for x, c in zip(model_inputs, chunk_sizes)]

        all_reps, all_rows, all_states = [], [], []
        for model, chunks in zip(self.models, chunked):
            chunk_reps, states = self.forward_no_grad_chunks(model, chunks)
            all_reps.append(torch.cat(chunk_reps, dim=0))
            all_rows.append([r.shape[0] for r in chunk_reps])
            all_states.append(states)

        cache, loss = self.build_cache(*all_reps, **loss_kwargs)
        del all_reps

        for i, (model, chunks, grad, rows, states) in enumerate(zip(self.models, chunked, cache, all_rows, all_states)):
            reused_later = any(m is model for m in self.models[i + 1 :])
            self.forward_backward(
                model, chunks, grad.split(rows, dim=0), states, no_sync_except_last, sync_last_chunk=not reused_later
            )
        return loss

    def _resolve_chunk_sizes(self, model_inputs) -> List[int]:
        if self.chunk_sizes != AUTO:
            return self.chunk_sizes
        return [
            auto_chunk_size(
                model, x, self.split_inputs, self.model_call, self.memory_budget, f"models[{i}]", self.get_input_tensors
            )
            for i, (model, x) in enumerate(zip(self.models, model_inputs))
        ]


def _param_device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__
