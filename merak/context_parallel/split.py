"""The load-balanced sequence split of context parallelism.

A row of ``S`` tokens is cut into ``2 * cp`` equal chunks; cp rank ``r`` holds chunk ``r`` and
its mirror ``2 * cp - 1 - r``, in that order. Under causal attention a chunk's work grows with
its index, so every rank gets the same work (chunks ``r`` and ``2cp-1-r`` sum to a constant).
The position ids follow their tokens (rotary embeddings are computed from them), and the labels
are shifted over the whole row BEFORE the split (``shift_labels``: the target of the last token
of a chunk is the first token of the next chunk, which another rank may hold), so no target is
lost at a boundary.

Refused, with the reason: a length not divisible by ``2 * cp``, padded rows (an
``attention_mask`` with zeros), and packed or padding-free rows (position ids that restart
within a row, or ``cu_seq_lens_*``): context parallelism splits one sequence per row.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
# values of packed / padding-free batches (HF's DataCollatorWithFlattening, TRL's packing)
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def check_splittable(seq_len: int, cp: int) -> None:
    """Raise a ValueError unless a row of `seq_len` tokens splits into ``2 * cp`` chunks."""
    if cp < 1:
        raise ValueError(f"context parallelism needs cp >= 1, got cp={cp}")
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism (cp={cp}) cuts each row into 2 * cp = {2 * cp} equal chunks "
            f"(each rank holds a chunk from the start and its mirror from the end), but the "
            f"sequence length {seq_len} is not divisible by {2 * cp}; pad or cut the rows to a "
            f"multiple of {2 * cp} tokens (e.g. {seq_len - seq_len % (2 * cp)} or "
            f"{seq_len + 2 * cp - seq_len % (2 * cp)})")


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) cp rank `rank` holds, in its local order."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def rank_positions(seq_len: int, cp: int, rank: int,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """The positions (in the whole row) of the tokens cp rank `rank` holds, in local order."""
    check_splittable(seq_len, cp)
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in chunk_ids(cp, rank)])


def gathered_positions(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """The positions of a row whose ranks' local tokens were concatenated in rank order."""
    return torch.cat([rank_positions(seq_len, cp, r, device) for r in range(cp)])


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF's shift of causal-LM labels (``labels[..., 1:]`` with `ignore_index` at the end): the
    target of each position, made on the whole row before it is split."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def _sequence_length(batch: dict[str, torch.Tensor]) -> int:
    for key in ("input_ids", "inputs_embeds", "labels"):
        if torch.is_tensor(batch.get(key)):
            return batch[key].shape[1]
    raise ValueError(f"context parallelism splits the sequence of input_ids (or inputs_embeds), "
                     f"but the batch has neither: {sorted(batch)}")


def check_unpadded(batch: dict[str, torch.Tensor]) -> None:
    """Refuse padded, packed and padding-free rows (see the module's docstring)."""
    packing = [k for k in PACKING_KEYS if k in batch]
    if packing:
        raise ValueError(f"context parallelism splits one sequence per row; packed or "
                         f"padding-free batches ({', '.join(packing)}) are refused: collate "
                         f"rows of one sequence each (no DataCollatorWithFlattening, no TRL "
                         f"packing / padding_free)")
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2 and not bool(mask.bool().all()):
        raise ValueError("context parallelism splits every row's sequence over the cp ranks "
                         "and refuses padding: the attention_mask has zeros (padded rows); "
                         "pack the text into full rows of equal length (e.g. group_texts) "
                         "instead of padding")
    positions = batch.get("position_ids")
    if torch.is_tensor(positions):
        expected = torch.arange(positions.shape[-1], device=positions.device)
        if not bool((positions == expected).all()):
            raise ValueError("context parallelism splits one sequence per row: position_ids "
                             "that are not 0..S-1 (packed or padding-free rows, or left "
                             "padding) are refused")


def split_batch(batch: dict[str, torch.Tensor], cp: int, rank: int) -> dict[str, torch.Tensor]:
    """cp rank `rank`'s share of a batch of whole rows: every tensor with the sequence along
    dim 1 cut to the rank's two chunks; ``position_ids`` added (the tokens' positions in the
    row); ``labels`` replaced by the rank's share of the shifted labels, also given as
    ``shift_labels`` (HF's causal-LM loss then shifts nothing); other values kept.

    Raises:
        ValueError: a length not divisible by ``2 * cp``, padding, packed rows.
    """
    seq_len = _sequence_length(batch)
    check_splittable(seq_len, cp)
    check_unpadded(batch)
    out = dict(batch)
    rows = next(batch[k] for k in ("input_ids", "inputs_embeds", "labels")
                if torch.is_tensor(batch.get(k))).shape[0]
    if "labels" in batch and "shift_labels" not in batch:
        out["shift_labels"] = shift_labels(batch["labels"])
    if "shift_labels" in out:
        out["labels"] = out["shift_labels"]
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq_len).unsqueeze(0).expand(rows, -1)
    for key, value in out.items():
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq_len:
            index = rank_positions(seq_len, cp, rank, value.device)
            out[key] = value.index_select(1, index)
    return out
