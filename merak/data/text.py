"""Real text that needs no download: the Python standard library's own source, as bytes.

Byte-level tokens (vocabulary 256) and next-token labels; each data-parallel rank reads its own
shard of every global batch.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_source_bytes(max_bytes: int = 4 * 2**20) -> torch.Tensor:
    """Up to `max_bytes` of the stdlib's ``*.py`` files (sorted by path) as a uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python source found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class TokenBatches:
    """Random windows of `seq_len + 1` tokens, split into ``input_ids`` and ``labels``.

    The global batch of step `step` is the same on every rank (seeded by step); dp rank r takes
    rows ``[r * B, (r + 1) * B)`` of it, with B = global_batch_size / dp.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch_size: int,
                 seed: int = 0):
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"{tokens.numel()} tokens are too few for seq_len={seq_len}")
        self.tokens = tokens.long()
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1,
                               (self.global_batch_size,), generator=generator)
        windows = torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()])
        return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}

    def shard(self, step: int, dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
        if self.global_batch_size % dp:
            raise ValueError(f"global batch size {self.global_batch_size} does not divide by "
                             f"dp={dp}")
        rows = self.global_batch_size // dp
        return {k: v[dp_rank * rows:(dp_rank + 1) * rows]
                for k, v in self.global_batch(step).items()}



class ByteWindows(torch.utils.data.Dataset):
    """`num_samples` windows of `seq_len` byte tokens at seeded random offsets, as HF causal-LM
    items (``labels`` = ``input_ids``; the model shifts them)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, num_samples: int, seed: int = 0):
        if tokens.numel() <= seq_len:
            raise ValueError(f"{tokens.numel()} tokens are too few for seq_len={seq_len}")
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, tokens.numel() - seq_len, (num_samples,),
                                    generator=generator).tolist()
        self.tokens, self.seq_len = tokens.long(), seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.tokens[self.starts[index]:self.starts[index] + self.seq_len]
        return {"input_ids": window, "labels": window.clone()}
