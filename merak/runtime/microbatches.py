"""A step's micro-batches: cut from one collated batch, or collated one by one.

A training or evaluation step takes either one batch (a dict of tensors, every value cut along
dim 0 into equal micro-batches: `split_microbatches`) or the step's micro-batches themselves (a
sequence of dicts, one per micro-batch, each collated from its own rows as HF Trainer collates
each gradient-accumulation batch). The second keeps what a collator builds per batch: a
padding-free batch is one flattened row (`position_ids` restarting at each sequence, maybe
``cu_seq_lens_*``) that no cut along dim 0 can share out, and its micro-batches differ in length.
Micro-batches of different shapes run: the pipeline finds each shape's activation shapes
(`merak.runtime.shape_discovery`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

Batch = dict[str, torch.Tensor]


def split_microbatches(batch: Batch, num_microbatches: int, keys: Sequence[str]) -> list[Batch]:
    """Cut each of `keys` of `batch` along dim 0 into `num_microbatches` equal parts."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"the batch lacks {missing}, which this stage reads; it has "
                         f"{sorted(batch)}")
    parts: list[Batch] = [{} for _ in range(num_microbatches)]
    for key in keys:
        tensor = batch[key]
        if tensor.shape[0] % num_microbatches:
            flattened = " (a padding-free batch flattens its rows into one)" \
                if tensor.shape[0] == 1 else ""
            raise ValueError(f"batch[{key!r}] has {tensor.shape[0]} rows{flattened}, which do "
                             f"not split into {num_microbatches} equal micro-batches; pass the "
                             f"step's micro-batches instead, each collated from its own rows "
                             f"(a list of {num_microbatches} dicts, as MerakTrainer does), or "
                             f"make the per-rank batch size a multiple of the number of "
                             f"micro-batches")
        for mb, part in enumerate(tensor.chunk(num_microbatches)):
            parts[mb][key] = part
    return parts


def step_microbatches(batch: Batch | Sequence[Batch], num_microbatches: int,
                      keys: Sequence[str]) -> list[Batch]:
    """The step's micro-batches, holding `keys`: `batch` cut (a dict), or taken as they are (a
    sequence of `num_microbatches` dicts, whose values other than tensors, such as a
    padding-free batch's ``max_length_q``, reach a loss that reads them; a traced stage reads
    tensors only)."""
    if isinstance(batch, dict):
        return split_microbatches(batch, num_microbatches, keys)
    if len(batch) != num_microbatches:
        raise ValueError(f"the step has {len(batch)} micro-batches; the engine runs "
                         f"{num_microbatches} per step (gradient_accumulation_steps)")
    parts = []
    for mb, part in enumerate(batch):
        missing = [k for k in keys if k not in part]
        if missing:
            raise ValueError(f"micro-batch {mb} lacks {missing}, which this stage reads; it "
                             f"has {sorted(part)}")
        parts.append({k: part[k] for k in keys})
    return parts


def shape_code(microbatch: Batch) -> int:
    """A code of a micro-batch's input shapes and dtypes (equal codes: equal shapes)."""
    local = repr(sorted((k, tuple(t.shape), str(t.dtype)) if torch.is_tensor(t)
                        else (k, type(t).__name__) for k, t in microbatch.items()))
    return zlib.crc32(local.encode())


def shape_classes(codes: Sequence[Sequence[int]]) -> list[int]:
    """Each micro-batch's shape class, the first micro-batch of the same shapes, from
    `codes[rank][mb]` (every pipeline rank's codes of each micro-batch)."""
    columns = list(zip(*codes))
    first: dict[tuple, int] = {}
    return [first.setdefault(column, mb) for mb, column in enumerate(columns)]
