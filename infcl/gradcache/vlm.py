"""Splitting Qwen-VL-style batches, whose ``pixel_values`` are patches rather than samples.

For Qwen2-VL / Qwen2.5-VL / Qwen3-VL the processor flattens every image into patches:

    input_ids, attention_mask:  [B, L]                  one row per sample
    pixel_values:               [total_patches, P]      the patches of all images, image after image
    image_grid_thw:             [num_images, 3]         (t, h, w) per image, in patch units

Image i owns ``t_i * h_i * w_i`` consecutive rows of ``pixel_values``, so a chunk of samples must take
the rows of exactly its images; cutting ``pixel_values`` on dim 0 by the chunk size would mix patches
of different images. Videos work the same with ``pixel_values_videos`` / ``video_grid_thw`` (and
Qwen2.5-VL's per-video ``second_per_grid_ts``).
"""

from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence

import torch

from .inputs import batch_size_of, chunk_lengths, input_tensors, split_by_lengths, split_inputs

# (patch rows key, grid key, keys with one entry per image/video), for images then videos.
_VISUAL_GROUPS = (
    ("pixel_values", "image_grid_thw", ()),
    ("pixel_values_videos", "video_grid_thw", ("second_per_grid_ts",)),
)
_GRID_COLUMNS = 3  # (t, h, w)


def _offsets(counts: Sequence[int]) -> List[int]:
    """[0, c0, c0+c1, ...]: prefix sums, so item i spans [off[i], off[i+1])."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def _per_sample_counts(grid_key: str, num_items: int, batch: int, per_sample: Optional[Sequence[int]], arg: str):
    """How many images (videos) each sample has: ``per_sample`` or, by default, one each."""
    if per_sample is None:
        if num_items != batch:
            raise ValueError(
                f"{grid_key} has {num_items} rows but the batch has {batch} samples; pass {arg}= "
                "(the number of images/videos of each sample) when samples do not have exactly one each"
            )
        return [1] * batch
    counts = [int(c) for c in per_sample]
    if len(counts) != batch or any(c < 0 for c in counts) or sum(counts) != num_items:
        raise ValueError(
            f"{arg} must have one non-negative count per sample ({batch}) summing to the {num_items} rows of "
            f"{grid_key}; got {counts}"
        )
    return counts


def split_vlm_inputs(
    batch: Any,
    chunk_size: int,
    *,
    images_per_sample: Optional[Sequence[int]] = None,
    videos_per_sample: Optional[Sequence[int]] = None,
) -> List[Any]:
    """Split a batch into chunks of ``chunk_size`` samples, keeping each image's patches together.

    Args:
        batch: a mapping (dict / ``BatchEncoding``). When it holds both ``pixel_values``
            [total_patches, ...] and ``image_grid_thw`` [num_images, 3] (or the video pair), patch
            rows are assigned to images by ``t * h * w`` and images to samples; every other tensor is
            split on dim 0 by samples. Anything else (text only, CLIP-style ``pixel_values`` [B, C, H, W]
            without a grid, a plain tensor) is split like :func:`infcl.gradcache.inputs.split_inputs`.
        chunk_size: samples per chunk; the last chunk may be smaller.
        images_per_sample / videos_per_sample: images (videos) of each sample, in order, when not
            exactly one each (text-only samples have 0). The batch size comes from the non-visual
            tensors (e.g. ``input_ids``), or is the number of images when there are none.

    Returns:
        A list of dicts with the batch's keys. Chunk c holds samples [c*chunk_size, ...) and the
        ``pixel_values`` rows of exactly their images, with the matching ``image_grid_thw`` rows.

    Raises:
        ValueError when a grid is not [N, 3], when ``pixel_values`` has a row count other than
        sum(t*h*w), or when images cannot be assigned to samples.
    """
    if not isinstance(batch, Mapping):
        return split_inputs(batch, chunk_size)
    groups = [
        (px, grid, extra)
        for px, grid, extra in _VISUAL_GROUPS
        if isinstance(batch.get(px), torch.Tensor) and isinstance(batch.get(grid), torch.Tensor)
    ]
    if not groups:
        return split_inputs(batch, chunk_size)

    visual_keys = {key for px, grid, extra in groups for key in (px, grid, *extra)}
    rest = {key: value for key, value in batch.items() if key not in visual_keys}
    if any(t.dim() > 0 for t in input_tensors(rest)):
        samples = batch_size_of(rest)
    else:
        samples = batch[groups[0][1]].shape[0]
    lengths = chunk_lengths(samples, chunk_size)
    sample_offsets = _offsets(lengths)
    chunks: List[Dict[str, Any]] = split_by_lengths(rest, lengths)

    per_sample_args = {
        "image_grid_thw": ("images_per_sample", images_per_sample),
        "video_grid_thw": ("videos_per_sample", videos_per_sample),
    }
    for px_key, grid_key, extra_keys in groups:
        pixels, grid = batch[px_key], batch[grid_key]
        if grid.dim() != 2 or grid.shape[1] != _GRID_COLUMNS:
            raise ValueError(f"{grid_key} must be [num_items, 3] (t, h, w), got {tuple(grid.shape)}")
        patches = grid.to(torch.int64).prod(dim=1).tolist()
        if pixels.dim() == 0 or pixels.shape[0] != sum(patches):
            raise ValueError(
                f"{px_key} has shape {tuple(pixels.shape)} but {grid_key} gives sum(t*h*w) = {sum(patches)} patch rows"
            )
        arg, per_sample = per_sample_args[grid_key]
        item_offsets = _offsets(_per_sample_counts(grid_key, len(patches), samples, per_sample, arg))
        patch_offsets = _offsets(patches)
        for c, chunk in enumerate(chunks):
            first, last = item_offsets[sample_offsets[c]], item_offsets[sample_offsets[c + 1]]
            chunk[px_key] = pixels[patch_offsets[first] : patch_offsets[last]]
            chunk[grid_key] = grid[first:last]
            for key in extra_keys:
                if key in batch:
                    chunk[key] = batch[key][first:last]
    return [{key: chunk[key] for key in batch if key in chunk} for chunk in chunks]
