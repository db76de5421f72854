"""GradCache under DeepSpeed ZeRO: the chunks' backward passes accumulate into one DeepSpeed step, reduced once.

``cache_step(..., no_sync_except_last=True)`` cannot serve DeepSpeed: ``engine.no_sync()`` asserts that it is
"incompatible with gradient partitioning logic of ZeRO stage 2/3", since ZeRO-2/3 reduce-scatter each gradient
from a hook as autograd produces it. DeepSpeed's own answer is ``engine.coalesce_grad_reduction()``: the
backward passes inside the block leave their gradients on the parameters (autograd accumulates them), and
leaving it runs ZeRO's own reduction once (its bucketed all-reduce or reduce-scatter into the gradient
partitions), as if one backward had produced the sum. :class:`DeepSpeedGradCache` runs one
GradCache step inside that block and sends each chunk's surrogate ``dot(reps, cached_gradient)`` through
``engine.backward(surrogate, scale_wrt_gas=False)`` (DeepSpeed's loss scaling and backward bookkeeping
apply; no division by the accumulation steps: the chunks' surrogates already sum to the step's gradient).
Communication is that of one plain ZeRO step, whatever the number of chunks::

    engine, *_ = deepspeed.initialize(model=two_tower, optimizer=..., config=config)  # ZeRO 1, 2 or 3
    gc = DeepSpeedGradCache(engine, [engine, engine], chunk_sizes=64, loss_fn=clip_loss)
    loss = gc.cache_step({"images": images}, {"texts": texts})  # gradients reduced once, into ZeRO's partitions
    engine.step()

This module is imported by name only (``from infcl.gradcache.deepspeed import DeepSpeedGradCache``); it never
imports ``deepspeed`` itself, so ``import infcl`` does not need it.
"""

from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from .grad_cache import GradCache

COALESCE = "coalesce_grad_reduction"


class DeepSpeedGradCache(GradCache):
    """:class:`infcl.GradCache` whose step is one DeepSpeed ZeRO step (module docstring).

    Args:
        engine: the ``deepspeed.DeepSpeedEngine`` (from ``deepspeed.initialize``) that owns every parameter
            the models train, with ``gradient_accumulation_steps`` 1 (one ``cache_step`` is one optimizer
            step; the chunks are the accumulation) and a DeepSpeed with ``engine.coalesce_grad_reduction``
            (0.19.8 has it).
        models: one per model input of :meth:`cache_step`, each the engine itself (its forward routes the
            input to a tower, e.g. by keyword: ``{"images": x}`` -> ``engine(images=x)``) or a submodule of
            ``engine.module``.
        chunk_sizes, loss_fn, split_input_fn, get_rep_fn, memory_budget, rep_field: as :class:`infcl.GradCache`.
            There is no ``fp16``/``bf16``/``scaler``: mixed precision is DeepSpeed's own config (``engine.backward``
            applies its loss scale to each chunk's surrogate; only float32 is tested).

    A parameter of ``loss_fn`` (a learnable temperature) that lives in ``engine.module`` gets its gradient in
    the cache phase, inside the same block, so it is reduced with the others.
    """

    def __init__(
        self,
        engine: Any,
        models: Sequence[nn.Module],
        chunk_sizes: Union[int, Sequence[int], str],
        loss_fn: Callable[..., torch.Tensor],
        split_input_fn: Optional[Callable[[Any, int], List[Any]]] = None,
        get_rep_fn: Optional[Callable[[Any], torch.Tensor]] = None,
        *,
        memory_budget: Optional[int] = None,
        rep_field: Optional[str] = None,
    ):
        super().__init__(
            models, chunk_sizes, loss_fn, split_input_fn, get_rep_fn, memory_budget=memory_budget, rep_field=rep_field
        )
        module = getattr(engine, "module", None)
        if not isinstance(module, nn.Module) or not hasattr(engine, "backward"):
            raise TypeError(f"engine must be a DeepSpeedEngine (deepspeed.initialize), got {type(engine).__name__}")
        if not hasattr(engine, COALESCE):
            raise TypeError(
                f"DeepSpeedGradCache needs engine.{COALESCE}(), which this DeepSpeed lacks (0.19.8 has it): without "
                "it ZeRO-2/3 reduce every chunk's gradients and engine.no_sync() refuses to defer them"
            )
        gas = engine.gradient_accumulation_steps()
        if gas != 1:
            raise ValueError(
                f"DeepSpeedGradCache needs gradient_accumulation_steps 1 (one cache_step is one engine.step(); "
                f"the chunks are the accumulation), got {gas}"
            )
        inside = {id(m) for m in module.modules()}
        outside = [
            f"models[{i}] is {type(m).__name__}"
            for i, m in enumerate(self.models)
            if m is not engine and id(m) not in inside
        ]
        if outside:
            raise ValueError(
                "every model must be the engine or a submodule of engine.module (DeepSpeed reduces only its own "
                "parameters' gradients); " + ", ".join(outside)
            )
        self.engine = engine

    def chunk_backward(self, surrogate: torch.Tensor) -> None:
        self.engine.backward(surrogate, scale_wrt_gas=False)

    def cache_step(self, *model_inputs, no_sync_except_last: bool = False, **loss_kwargs) -> torch.Tensor:
        """One GradCache step whose backward passes accumulate locally and are reduced once, when it returns;
        call ``engine.step()`` after it. Returns the detached loss."""
        if no_sync_except_last:
            raise ValueError(
                "no_sync_except_last is for DDP/FSDP; DeepSpeedGradCache always reduces once per step "
                f"(engine.{COALESCE})"
            )
        with getattr(self.engine, COALESCE)():
            return super().cache_step(*model_inputs, **loss_kwargs)
