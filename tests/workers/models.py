"""Test models: the GPT (tied embedding/head) and one with several tensors crossing stages and a
skip connection (stage 0 -> 2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from merak import Piece
from merak.models.gpt import GPT, GPTConfig, gpt_pieces


class TwoOut(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.a(h)), torch.sigmoid(self.b(h))


class Gate(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h, g):
        return self.lin(h * g)


class Merge(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(2 * width, width)

    def forward(self, h, skip):
        return torch.relu(self.lin(torch.cat([h, skip], dim=-1)))


class Out(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, 1)

    def forward(self, h, y):
        return F.mse_loss(self.lin(h).squeeze(-1), y)


class SkipNet(nn.Module):
    """inp -> a -> b (two outputs) -> c -> merge (with inp's output, a skip) -> out."""

    def __init__(self, in_dim: int = 12, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(in_dim, width)
        self.a = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.b = TwoOut(width)
        self.c = Gate(width)
        self.merge = Merge(width)
        self.out = Out(width)

    def forward(self, x, y):
        h0 = self.inp(x)
        h, g = self.b(self.a(h0))
        return self.out(self.merge(self.c(h, g), h0), y)


def skip_pieces() -> list[Piece]:
    return [Piece("inp", ["x"], ["h0"]), Piece("a", ["h0"], ["h"]), Piece("b", ["h"], ["h", "g"]),
            Piece("c", ["h", "g"], ["h"]), Piece("merge", ["h", "h0"], ["h"]),
            Piece("out", ["h", "y"], ["loss"])]


# pieces per stage: 4 stages put the skip 0 -> 2 and two tensors on 1 -> 2
SKIP_LAYOUT = {2: [3, 3], 4: [2, 1, 2, 1]}


def build(kind: str, seed: int = 1234):
    torch.manual_seed(seed)
    if kind == "gpt":
        model = GPT(GPTConfig(hidden_size=32, num_layers=4, num_heads=4, max_positions=16))
        return model, gpt_pieces(model)
    return SkipNet(), skip_pieces()


def global_batch(kind: str, step: int, size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    if kind == "gpt":
        ids = torch.randint(0, 256, (size, 9), generator=generator)
        return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    return {"x": torch.randn(size, 12, generator=generator),
            "y": torch.randn(size, generator=generator)}
