"""Model inputs for GradCache: splitting a batch into chunks, calling a model, extracting its reps.

A model input is a tensor, a list/tuple (called as ``model(*x)``), a mapping such as ``dict``,
``UserDict`` or HF ``BatchEncoding`` (called as ``model(**x)``), or a ``(args_list, kwargs_dict)``
pair (called as ``model(*args, **kwargs)``). Containers may nest. Splitting cuts every tensor of at
least one dimension along dim 0 and copies every other value (0-d tensors, strings, flags) into
each chunk; all those tensors must agree on dim 0, the batch size.
"""

from collections.abc import Mapping
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import nn


def chunk_lengths(total: int, chunk_size: int) -> List[int]:
    """[chunk_size, ..., chunk_size, remainder]: the rows of each chunk of a batch of ``total``."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    full, rest = divmod(total, chunk_size)
    return [chunk_size] * full + ([rest] if rest else [])


def tensor_leaves(x: Any, path: str = "input") -> Iterator[Tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in ``x``, depth first, with a readable path for error messages."""
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, Mapping):
        for key, value in x.items():
            yield from tensor_leaves(value, f"{path}[{key!r}]")
    elif isinstance(x, (list, tuple)):
        for i, value in enumerate(x):
            yield from tensor_leaves(value, f"{path}[{i}]")


def input_tensors(x: Any) -> List[torch.Tensor]:
    """Every tensor in a (nested) model input: what ``RandContext`` looks at for devices."""
    return [t for _, t in tensor_leaves(x)]


def batch_size_of(x: Any) -> int:
    """The common dim 0 of every tensor in ``x`` with at least one dimension.

    Raises ValueError naming each tensor's path and shape when they disagree, or when there is none.
    """
    sized = [(path, t) for path, t in tensor_leaves(x) if t.dim() > 0]
    if not sized:
        raise ValueError(f"cannot split a model input without a tensor of >= 1 dim (got {type(x).__name__})")
    sizes = {t.shape[0] for _, t in sized}
    if len(sizes) > 1:
        described = ", ".join(f"{path}: {tuple(t.shape)}" for path, t in sized)
        raise ValueError(
            "every tensor of a model input must have the batch size on dim 0 to be split, got "
            f"{described}; pass split_input_fn (e.g. infcl.split_vlm_inputs for Qwen-VL pixel_values)"
        )
    return sizes.pop()


def split_by_lengths(x: Any, lengths: List[int]) -> List[Any]:
    """``x`` cut into ``len(lengths)`` pieces: tensors by ``lengths`` on dim 0, other values copied."""
    n = len(lengths)
    if isinstance(x, torch.Tensor):
        return list(x.split(lengths, dim=0)) if x.dim() > 0 else [x] * n
    if isinstance(x, Mapping):
        pieces = {key: split_by_lengths(value, lengths) for key, value in x.items()}
        return [{key: parts[i] for key, parts in pieces.items()} for i in range(n)]
    if isinstance(x, (list, tuple)):
        columns = [split_by_lengths(value, lengths) for value in x]
        rebuild = list if isinstance(x, list) else tuple
        return [rebuild(col[i] for col in columns) for i in range(n)]
    return [x] * n


def split_inputs(model_input: Any, chunk_size: int) -> List[Any]:
    """Split a batch into chunks of ``chunk_size`` rows (the last may be smaller).

    Tensors with >= 1 dim are cut on dim 0 (views, no copy); mappings come back as plain dicts with
    the same keys; lists and tuples keep their type; any other value is shared by every chunk.
    """
    return split_by_lengths(model_input, chunk_lengths(batch_size_of(model_input), chunk_size))


def _is_args_kwargs(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], (list, tuple)) and isinstance(x[1], Mapping)


def call_model(model: nn.Module, model_input: Any) -> Any:
    """``model(x)`` for a tensor, ``model(**x)`` for a mapping, ``model(*a, **kw)`` for an (a, kw)
    pair, ``model(*x)`` for a list/tuple, and ``model(x)`` for anything else."""
    if isinstance(model_input, torch.Tensor):
        return model(model_input)
    if isinstance(model_input, Mapping):
        return model(**model_input)
    if _is_args_kwargs(model_input):
        return model(*model_input[0], **model_input[1])
    if isinstance(model_input, (list, tuple)):
        return model(*model_input)
    return model(model_input)


def _field(output: Any, name: str):
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def get_rep(output: Any, field: Optional[str] = None) -> torch.Tensor:
    """The representation in a model output: a [rows, D] (or any [rows, ...]) tensor.

    In this order:

    1. a tensor output is returned as is;
    2. ``field`` (when given): that key / attribute of the output, as is (e.g. ``"pooler_output"``,
       ``"text_embeds"``); TypeError if the output has no such tensor;
    3. ``sentence_embedding`` (sentence-transformers' pooled embedding);
    4. ``last_hidden_state[:, 0]`` (the first, CLS, token), even when the output also has a
       ``pooler_output``: BERT's pooler is the next-sentence-prediction head (a dense + tanh layer
       over that token), not a sentence embedding, so it is used only when named as ``field``;
    5. a tuple or list: its first element.

    Anything else (an output with only ``pooler_output``, say) raises TypeError: name the field or
    pass ``get_rep_fn`` to GradCache.
    """
    if isinstance(output, torch.Tensor):
        return output
    if field is not None:
        value = _field(output, field)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"rep_field={field!r}: the model output ({type(output).__name__}) has no tensor {field!r}")
        return value
    value = _field(output, "sentence_embedding")
    if isinstance(value, torch.Tensor):
        return value
    hidden = _field(output, "last_hidden_state")
    if isinstance(hidden, torch.Tensor):
        return hidden[:, 0]
    if isinstance(output, (list, tuple)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"cannot find a representation in a model output of type {type(output).__name__}: expected a tensor, "
        "a tuple whose first element is a tensor, or an object with sentence_embedding / last_hidden_state; "
        "name the field (GradCache(rep_field='pooler_output')) or pass get_rep_fn"
    )
