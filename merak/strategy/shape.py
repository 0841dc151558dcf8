"""What the planner needs to know of a decoder-only transformer: sizes, parameters, FLOPs and
activation bytes per block, read from its Hugging Face config.

Offline plans compute block costs from these counts; measured plans time the blocks and use the
counts only to scale (tensor-parallel shares, other micro-batch sizes).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes.

    Attributes:
        layers, hidden, intermediate, heads, kv_heads, vocab: the config's sizes.
        gated_mlp: the MLP has three matrices (SwiGLU: Llama, Mistral, Qwen) rather than two.
        tied: the LM head shares the input embedding's weight.
        name: the model type, for reports.
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    gated_mlp: bool = True
    tied: bool = False
    name: str = "model"

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From an HF `PretrainedConfig` (Llama-style field names, GPT-2's as fall-backs)."""
        def field(*names, default=None):
            for name in names:
                value = getattr(config, name, None)
                if value is not None:
                    return value
            if default is None:
                raise ValueError(f"{type(config).__name__} has none of {names}: the planner "
                                 f"needs a decoder-only transformer's sizes")
            return default

        hidden = field("hidden_size", "n_embd", "d_model")
        heads = field("num_attention_heads", "n_head")
        act = str(field("hidden_act", "activation_function", default="silu"))
        return cls(layers=field("num_hidden_layers", "n_layer"), hidden=hidden,
                   intermediate=field("intermediate_size", "n_inner", "ffn_dim",
                                      default=4 * hidden) or 4 * hidden,
                   heads=heads, kv_heads=field("num_key_value_heads", default=heads),
                   vocab=field("vocab_size"), gated_mlp=act in ("silu", "swiglu"),
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   name=getattr(config, "model_type", "model"))

    # -- parameters ---------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def block_params(self) -> int:
        kv = 2 * self.kv_heads * self.head_dim
        attention = self.hidden * (self.hidden + kv) + self.hidden * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return attention + mlp + 2 * self.hidden  # two norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The LM head and final norm (the head's weight is the embedding's when tied)."""
        return (0 if self.tied else self.vocab * self.hidden) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.embedding_params + self.head_params

    # -- one micro-batch of `rows` sequences of `seq` tokens ----------------------------------
    def block_flops(self, rows: int, seq: int) -> float:
        """Forward FLOPs of one block: its matmuls plus attention's scores and values."""
        tokens = rows * seq
        return 2 * tokens * (self.block_params - 2 * self.hidden) + 4 * tokens * seq * self.hidden

    def head_flops(self, rows: int, seq: int) -> float:
        """Forward FLOPs of the LM head (the embedding is a lookup)."""
        return 2 * rows * seq * self.vocab * self.hidden

    def block_activation_bytes(self, rows: int, seq: int, tp: int = 1, dtype_bytes: int = 2,
                               sequence_parallel: bool = False) -> float:
        """What one block's forward keeps for backward (Korthikanti et al. 2022, with
        memory-efficient attention: no score matrix): ``s b h (10 + 24 / tp)`` bytes at 16-bit,
        the 24 being what tensor parallelism splits, and the 10 (norms, residuals, dropout
        masks) split too under sequence parallelism; scaled for the MLP's width and gating."""
        width = self.intermediate / (4 * self.hidden) * (1.5 if self.gated_mlp else 1.0)
        split = 8 + 16 * width  # attention's q, k, v, output and dropout; the MLP's activations
        whole = 10 / tp if sequence_parallel else 10
        return rows * seq * self.hidden * (whole + split / tp) * dtype_bytes / 2

    def boundary_bytes(self, rows: int, seq: int, dtype_bytes: int = 2) -> float:
        """One block's input (what a recomputed block keeps; a pipeline message)."""
        return rows * seq * self.hidden * dtype_bytes

    def head_activation_bytes(self, rows: int, seq: int) -> float:
        """The last stage's logits and their log-softmax in fp32 (whole on every TP rank: a
        vocab-parallel head gathers its logits for the model's own loss)."""
        return 2 * rows * seq * self.vocab * 4

    def flops_per_token(self, seq: int) -> float:
        """Forward and backward FLOPs of one token (3x the forward: matmuls and attention)."""
        return 3 * (self.layers * self.block_flops(1, seq) + self.head_flops(1, seq)) / seq

    def tp_degrees(self, world_size: int) -> list[int]:
        """Tensor-parallel degrees this model allows: dividing the heads, the key-value heads
        and the world."""
        return [t for t in range(1, world_size + 1)
                if world_size % t == 0 and self.heads % t == 0 and self.kv_heads % t == 0]
