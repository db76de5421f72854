"""transformers' ``Trainer`` (on Accelerate) training a ``CLIPModel`` with infcl's loss, optionally under GradCache.

    torchrun --nproc_per_node 2 examples/hf_trainer_clip.py [--gradcache-chunk 4] [--steps 4]
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer_clip.py [...]   # the same, CPUs included
    python examples/hf_trainer_clip.py                 # one process: the ring of one rank

The model is transformers' own ``CLIPModel`` from a tiny config (random init, nothing downloaded), the data random
images and token ids. :class:`InfCLTrainer` is the whole integration: its ``compute_loss`` embeds the local batch
and calls ``cal_inf_loss(..., symmetric=True)``, whose ring over the default process group (the one Accelerate
started) gives every rank's rows the whole global batch, so after DDP's gradient averaging every rank holds the
gradient of the global-batch CLIP loss, as CLIPModel's own materialized loss on that batch gives it.

With ``gradcache_chunk=c`` the batch is embedded c rows at a time (:class:`infcl.GradCache`, the encoders'
memory that of c rows): ``compute_loss`` embeds every chunk without a graph, computes the loss and its gradient
to the embeddings (the cache), and returns the loss detached with a hook; the Trainer's own backward (its
gradient-accumulation scaling and fp16 loss scale included) runs the hook, which re-embeds each chunk and
back-propagates the cached gradients, with DDP's gradient reduction once, on the last chunk.
"""

import argparse
import os
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import CLIPConfig, CLIPModel, Trainer, TrainingArguments

from infcl import GradCache, cal_inf_loss

IMAGE_SIZE, TEXT_LEN, VOCAB = 16, 8, 64


def tiny_clip_config() -> CLIPConfig:
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    return CLIPConfig(
        text_config=dict(vocab_size=VOCAB, max_position_embeddings=TEXT_LEN, **tower),
        vision_config=dict(image_size=IMAGE_SIZE, patch_size=8, **tower),
        projection_dim=16,
    )


class CLIPTowers(nn.Module):
    """A CLIPModel whose forward returns the normalized embeddings of whichever inputs it is given
    (``image_embeds`` for ``pixel_values``, ``text_embeds`` for ``input_ids``) and ``logit_scale`` (exponentiated):
    no logits, so no B x B block. The scale comes out of ``forward`` so that DDP sees it used there."""

    def __init__(self, clip: CLIPModel):
        super().__init__()
        self.clip = clip

    def forward(self, pixel_values=None, input_ids=None, attention_mask=None) -> Dict[str, torch.Tensor]:
        out = {"logit_scale": self.clip.logit_scale.exp()}
        if pixel_values is not None:
            image = self.clip.get_image_features(pixel_values=pixel_values).pooler_output
            out["image_embeds"] = F.normalize(image, dim=-1)
        if input_ids is not None:
            text = self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask).pooler_output
            out["text_embeds"] = F.normalize(text, dim=-1)
        return out


def tower_embedding(out: Dict[str, torch.Tensor]) -> torch.Tensor:
    """GradCache's representation: the embedding a single-tower call returns."""
    (embeds,) = (v for k, v in out.items() if k != "logit_scale")
    return embeds


class InfCLTrainer(Trainer):
    """``Trainer`` whose loss is infcl's exact CLIP loss over the global batch (module docstring).

    ``gradcache_chunk``: embed at most this many rows at a time (None: the whole local batch at once).
    ``infcl_backend``: ``cal_inf_loss``'s ``backend``.
    """

    def __init__(self, *args, gradcache_chunk: Optional[int] = None, infcl_backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.gradcache_chunk, self.infcl_backend = gradcache_chunk, infcl_backend

    def clip_loss(self, image_embeds: torch.Tensor, text_embeds: torch.Tensor, logit_scale) -> torch.Tensor:
        return cal_inf_loss(image_embeds, text_embeds, scale=logit_scale, symmetric=True, backend=self.infcl_backend)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        images = {"pixel_values": inputs["pixel_values"]}
        texts = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        if self.gradcache_chunk is None or not torch.is_grad_enabled():
            out = model(**images, **texts)
            loss = self.clip_loss(out["image_embeds"], out["text_embeds"], out["logit_scale"])
            return (loss, out) if return_outputs else loss
        loss = self._cached_loss(model, images, texts)
        return (loss, {}) if return_outputs else loss

    def _cached_loss(self, model, images: dict, texts: dict) -> torch.Tensor:
        """GradCache phases 1 and 2 now, phase 3 in a hook on the returned (detached) loss.

        The loss's own parameter, ``logit_scale``, gets its gradient in phase 2, outside any DDP forward: on a
        detached copy, added to ``.grad`` in the hook with the upstream gradient and averaged over the ranks
        as DDP averages the towers' gradients."""
        logit_scale = self.accelerator.unwrap_model(model).clip.logit_scale
        scale_leaf = logit_scale.detach().requires_grad_()
        grad_cache = GradCache(
            [model, model],
            self.gradcache_chunk,
            lambda image, text: self.clip_loss(image, text, scale_leaf.exp()),
            get_rep_fn=tower_embedding,
        )
        chunks = [grad_cache.split_inputs(x, self.gradcache_chunk) for x in (images, texts)]
        reps, rows, states = [], [], []
        for tower_chunks in chunks:
            embeds, tower_states = grad_cache.forward_no_grad_chunks(model, tower_chunks)
            reps.append(torch.cat(embeds))
            rows.append([e.shape[0] for e in embeds])
            states.append(tower_states)
        cache, loss = grad_cache.build_cache(*reps)
        synced = dist.is_initialized() and dist.get_world_size() > 1
        loss = loss.requires_grad_()

        def replay(upstream: torch.Tensor) -> None:
            for i, (tower_chunks, grad, tower_rows, tower_states) in enumerate(zip(chunks, cache, rows, states)):
                grad_cache.forward_backward(
                    model,
                    tower_chunks,
                    (grad * upstream).split(tower_rows),
                    tower_states,
                    no_sync_except_last=synced,
                    sync_last_chunk=i == len(chunks) - 1,
                )
            scale_grad = scale_leaf.grad * upstream
            if synced:
                dist.all_reduce(scale_grad)
                scale_grad /= dist.get_world_size()
            logit_scale.grad = scale_grad if logit_scale.grad is None else logit_scale.grad + scale_grad

        loss.register_hook(replay)
        return loss


class RandomPairs(torch.utils.data.Dataset):
    """``size`` random (image, caption) pairs: pixel values, token ids and a padding mask, seeded."""

    def __init__(self, size: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.pixel_values = torch.randn(size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
        self.input_ids = torch.randint(1, VOCAB, (size, TEXT_LEN), generator=gen)
        lengths = torch.randint(2, TEXT_LEN + 1, (size,), generator=gen)
        self.attention_mask = (torch.arange(TEXT_LEN) < lengths[:, None]).long()
        # CLIP pools the text at its end-of-text token: the highest id in the row (eos_token_id=2 is not used
        # by this random vocabulary's pooling), put at the last real position.
        self.input_ids[torch.arange(size), lengths - 1] = VOCAB - 1

    def __len__(self) -> int:
        return self.pixel_values.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {
            "pixel_values": self.pixel_values[i],
            "input_ids": self.input_ids[i],
            "attention_mask": self.attention_mask[i],
        }


def training_arguments(output_dir: str, per_device_batch: int, steps: int, **overrides) -> TrainingArguments:
    # A ddp_backend makes Accelerate expect a process group: only under a launcher of several processes.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=per_device_batch,
        max_steps=steps,
        learning_rate=1e-3,
        use_cpu=True,
        ddp_backend="gloo" if distributed else None,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        remove_unused_columns=False,
        dataloader_drop_last=True,
        ddp_find_unused_parameters=True,
    )  # GradCache's chunks run one tower at a time
    settings.update(overrides)
    return TrainingArguments(**settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gradcache-chunk", type=int, default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--per-device-batch", type=int, default=8)
    parser.add_argument("--output-dir", default="/tmp/infcl-hf-trainer-clip")
    cli = parser.parse_args()
    torch.manual_seed(0)
    model = CLIPTowers(CLIPModel(tiny_clip_config()))
    args = training_arguments(cli.output_dir, cli.per_device_batch, cli.steps)
    dataset = RandomPairs(cli.per_device_batch * args.world_size * cli.steps)
    trainer = InfCLTrainer(model=model, args=args, train_dataset=dataset, gradcache_chunk=cli.gradcache_chunk)
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [round(log["loss"], 5) for log in trainer.state.log_history if "loss" in log]
        print(f"world size {args.world_size}, losses: {losses}")


if __name__ == "__main__":
    main()
