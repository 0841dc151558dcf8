"""A small GPT built from a config: the model of the main job, the tests and the benchmarks.

Written as pieces with tensor interfaces (embedding, blocks, head-with-loss) so a manual pipeline
split is one list; `gpt_pieces` returns it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from merak.stages.split import Piece


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    max_positions: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    dropout: float = 0.0
    tie_word_embeddings: bool = True


class Embeddings(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_positions, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.hidden_size % config.num_heads:
            raise ValueError(f"hidden_size {config.hidden_size} is not divisible by num_heads "
                             f"{config.num_heads}")
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.ln_1 = nn.LayerNorm(config.hidden_size)
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln_2 = nn.LayerNorm(config.hidden_size)
        self.fc_in = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.fc_out = nn.Linear(4 * config.hidden_size, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq, width = hidden.shape
        q, k, v = self.qkv(self.ln_1(hidden)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        hidden = hidden + self.drop(self.proj(attn.transpose(1, 2).reshape(batch, seq, width)))
        return hidden + self.drop(self.fc_out(F.gelu(self.fc_in(self.ln_2(hidden)))))


class LMHead(nn.Module):
    """Final norm, vocabulary projection and the mean next-token cross-entropy."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(hidden))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = Embeddings(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.head = LMHead(config)
        if config.tie_word_embeddings:
            self.head.lm_head.weight = self.embed.wte.weight
        self.apply(_init_weights)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden, labels)


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialization: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def gpt_pieces(model: GPT) -> list[Piece]:
    """The GPT's data flow as pipeline pieces: embed, each block, head."""
    return ([Piece("embed", ["input_ids"], ["hidden"])]
            + [Piece(f"blocks.{i}", ["hidden"], ["hidden"]) for i in range(len(model.blocks))]
            + [Piece("head", ["hidden", "labels"], ["loss"])])
