"""Small configs of each family, their inputs, and a custom MLP with repeated blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

VOCAB = 128


def _causal(config_cls, **kw):
    return lambda: tf.AutoModelForCausalLM.from_config(config_cls(vocab_size=VOCAB, **kw))


LLAMA_LIKE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2}
FAMILIES = {
    "llama": _causal(tf.LlamaConfig, num_hidden_layers=4, **LLAMA_LIKE),
    "qwen2": _causal(tf.Qwen2Config, num_hidden_layers=4, **LLAMA_LIKE),
    "mistral": _causal(tf.MistralConfig, num_hidden_layers=4, **LLAMA_LIKE),
    "gpt2": _causal(tf.GPT2Config, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "opt": _causal(tf.OPTConfig, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                   num_attention_heads=4, word_embed_proj_dim=64, dropout=0.0,
                   attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1),
    "bert": lambda: tf.AutoModelForMaskedLM.from_config(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
}


class MLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class CustomMLP(nn.Module):
    """A plain nn.Module: input projection, repeated blocks, classifier with its loss."""

    def __init__(self, in_dim: int = 12, width: int = 32, depth: int = 5, classes: int = 7):
        super().__init__()
        self.proj = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x, labels):
        h = self.proj(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


FAMILIES["mlp"] = CustomMLP


def batch(family: str, step: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if family == "mlp":
        return {"x": torch.randn(rows, 6, 12, generator=g),
                "labels": torch.randint(0, 7, (rows, 6), generator=g)}
    ids = torch.randint(2, VOCAB, (rows, 12), generator=g)
    if family == "t5":
        return {"input_ids": ids, "labels": torch.randint(2, VOCAB, (rows, 7), generator=g)}
    labels = ids.clone()
    if family == "bert":
        labels[:, ::2] = -100  # only some positions are predicted
    return {"input_ids": ids, "labels": labels}
