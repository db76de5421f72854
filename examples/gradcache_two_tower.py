"""Train a small two-tower model with GradCache + cal_inf_loss at a batch far larger than a chunk.

An image tower (a tiny CNN over synthetic 16x16 images) and a text tower (an EmbeddingBag over token
ids) learn a shared embedding with the symmetric CLIP loss and a learnable temperature. Each pair is
generated from one latent vector: the image is a fixed random map of it plus noise, the text is its
coordinates quantized into tokens, so the loss can fall well below log(batch).

    python examples/gradcache_two_tower.py                      # batch 4096, chunk 256, 5 steps
    python examples/gradcache_two_tower.py --compare-plain      # then one un-chunked step, for memory

Memory is reported as the process's RSS high-water mark (``ru_maxrss``) over the baseline taken
before the first step: on CPU that is what a chunk's activations add. ``--compare-plain`` runs one
ordinary full-batch step afterwards, whose activations are batch/chunk times larger.
"""

import argparse
import math
import resource
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from infcl import GradCache, cal_inf_loss

IMAGE_SIZE = 16
LATENT_DIM = 8
TOKEN_BINS = 16  # each latent coordinate is quantized into this many bins -> one token per coordinate
VOCAB = LATENT_DIM * TOKEN_BINS
EMBED_DIM = 64
INIT_LOG_SCALE = math.log(1 / 0.07)  # CLIP's initial temperature
KIB = 1024  # ru_maxrss is in KiB on Linux


class ImageTower(nn.Module):
    """[B, 3, 16, 16] -> [B, EMBED_DIM]: two conv blocks, global average pool, linear head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.GELU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.GELU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(16, EMBED_DIM))

    def forward(self, images):
        return self.head(self.features(images))


class TextTower(nn.Module):
    """[B, LATENT_DIM] token ids -> [B, EMBED_DIM]: mean EmbeddingBag and an MLP."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 128, mode="mean")
        self.mlp = nn.Sequential(nn.GELU(), nn.Dropout(0.1), nn.Linear(128, EMBED_DIM))

    def forward(self, tokens):
        return self.mlp(self.bag(tokens))


class ClipObjective(nn.Module):
    """Symmetric CLIP loss on normalized embeddings; the temperature is learned."""

    def __init__(self):
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(INIT_LOG_SCALE))

    def forward(self, image_emb, text_emb):
        image_emb, text_emb = F.normalize(image_emb, dim=-1), F.normalize(text_emb, dim=-1)
        return cal_inf_loss(image_emb, text_emb, scale=self.log_scale.exp(), symmetric=True)


def synthetic_pairs(batch, image_map, gen):
    """(images [B, 3, 16, 16], tokens [B, LATENT_DIM]) sharing one latent vector per pair."""
    latent = torch.randn(batch, LATENT_DIM, generator=gen)
    images = torch.tanh(latent @ image_map).view(batch, 3, IMAGE_SIZE, IMAGE_SIZE)
    images = images + 0.1 * torch.randn(images.shape, generator=gen)
    bins = ((torch.erf(latent / math.sqrt(2)) + 1) / 2 * TOKEN_BINS).long().clamp_(0, TOKEN_BINS - 1)
    tokens = bins + TOKEN_BINS * torch.arange(LATENT_DIM)
    return images, tokens


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / KIB


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-plain", action="store_true", help="finish with one un-chunked step")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    image_map = torch.randn(LATENT_DIM, 3 * IMAGE_SIZE * IMAGE_SIZE, generator=gen) / math.sqrt(LATENT_DIM)
    image_tower, text_tower, objective = ImageTower(), TextTower(), ClipObjective()
    params = [*image_tower.parameters(), *text_tower.parameters(), *objective.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    gc = GradCache([image_tower, text_tower], chunk_sizes=args.chunk, loss_fn=objective)

    batches = [synthetic_pairs(args.batch, image_map, gen) for _ in range(args.steps)]
    baseline = peak_rss_mib()
    print(f"batch {args.batch}, chunk {args.chunk}, {args.steps} steps; log(batch) = {math.log(args.batch):.3f}")
    start = time.perf_counter()
    losses = []
    bar = tqdm(batches, desc="GradCache steps", unit="step")
    for images, tokens in bar:
        optimizer.zero_grad(set_to_none=True)
        loss = gc.cache_step(images, tokens)  # .grad now holds the full-batch gradient
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", temp=f"{1 / objective.log_scale.exp().item():.4f}")
    elapsed = time.perf_counter() - start
    gc_peak = peak_rss_mib()
    print(f"loss per step: {' '.join(f'{x:.3f}' for x in losses)}")
    print(
        f"GradCache: {elapsed / args.steps:.2f} s/step, peak RSS {gc_peak:.0f} MiB "
        f"(+{gc_peak - baseline:.0f} MiB over the {baseline:.0f} MiB baseline)"
    )

    if args.compare_plain:
        images, tokens = batches[-1]
        optimizer.zero_grad(set_to_none=True)
        objective(image_tower(images), text_tower(tokens)).backward()
        plain_peak = peak_rss_mib()
        print(
            f"plain full-batch step: peak RSS {plain_peak:.0f} MiB (+{plain_peak - baseline:.0f} MiB over the baseline)"
        )


if __name__ == "__main__":
    main()
