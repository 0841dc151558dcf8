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
        experts, experts_per_token, expert_intermediate, shared_intermediate: a mixture of
            experts (0 experts: dense): each block's MLP is `experts` routed experts of width
            `expert_intermediate`, `experts_per_token` of them run per token, plus shared
            experts of total width `shared_intermediate`. Every block is taken as MoE (a
            family's first dense blocks are not modelled).
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
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    head_size: int = 0  # a head's width where the config sets it apart from hidden / heads

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
        intermediate = field("intermediate_size", "n_inner", "ffn_dim",
                             default=4 * hidden) or 4 * hidden
        experts = field("num_experts", "num_local_experts", "n_routed_experts", default=0)
        moe = {}
        if experts:
            width = field("moe_intermediate_size", default=intermediate)
            shared = field("shared_expert_intermediate_size", default=0) or width * field(
                "n_shared_experts", "num_shared_experts", default=0)
            moe = {"experts": experts, "experts_per_token": field("num_experts_per_tok"),
                   "expert_intermediate": width, "shared_intermediate": shared}
        return cls(layers=field("num_hidden_layers", "n_layer"), hidden=hidden,
                   intermediate=intermediate,
                   heads=heads, kv_heads=field("num_key_value_heads", default=heads),
                   vocab=field("vocab_size"), gated_mlp=act in ("silu", "swiglu"),
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   name=getattr(config, "model_type", "model"),
                   head_size=getattr(config, "head_dim", None) or 0, **moe)

    # -- parameters ---------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def _mlp_params(self, width: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * width

    @property
    def _attention_params(self) -> int:
        q, kv = self.heads * self.head_dim, 2 * self.kv_heads * self.head_dim
        return self.hidden * (q + kv) + q * self.hidden

    @property
    def block_params(self) -> int:
        if not self.experts:
            return self._attention_params + self._mlp_params(self.intermediate) \
                + 2 * self.hidden  # two norms
        return self.block_params_outside_experts + self.expert_params

    @property
    def expert_params(self) -> int:
        """One block's routed experts (what expert parallelism splits; 0 when dense)."""
        return self.experts * self._mlp_params(self.expert_intermediate)

    @property
    def block_params_outside_experts(self) -> int:
        """One MoE block's attention, router, shared experts and norms."""
        return (self._attention_params + self.hidden * self.experts
                + self._mlp_params(self.shared_intermediate) + 2 * self.hidden)

    @property
    def mlp_width(self) -> int:
        """The MLP width one token runs through: the intermediate size when dense; its
        experts' and the shared experts' under MoE."""
        if not self.experts:
            return self.intermediate
        return self.experts_per_token * self.expert_intermediate + self.shared_intermediate

    def ep_degrees(self, replicas: int) -> list[int]:
        """Expert-parallel degrees: dividing the replicas of a stage (dp x cp) and the
        experts; [1] for a dense model."""
        if not self.experts:
            return [1]
        return [e for e in range(1, replicas + 1) if replicas % e == 0 and self.experts % e == 0]

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
        active = self._attention_params + self._mlp_params(self.mlp_width) \
            + self.hidden * self.experts  # (the router)
        return 2 * tokens * active + 4 * tokens * seq * self.hidden

    def expert_share(self, rows: int, seq: int) -> float:
        """The fraction of a block's forward FLOPs its routed experts take (0 when dense)."""
        if not self.experts:
            return 0.0
        routed = self.experts_per_token * self._mlp_params(self.expert_intermediate)
        return 2 * rows * seq * routed / self.block_flops(rows, seq)

    def exchange_bytes(self, rows: int, seq: int, dtype_bytes: int = 2) -> float:
        """The rows one block's token exchange moves each way for a micro-batch of `rows` x
        `seq` tokens: one hidden vector per (token, chosen expert) pair, before the share
        that stays on the rank."""
        return rows * seq * self.experts_per_token * self.hidden * dtype_bytes

    def head_flops(self, rows: int, seq: int) -> float:
        """Forward FLOPs of the LM head (the embedding is a lookup)."""
        return 2 * rows * seq * self.vocab * self.hidden

    def block_activation_bytes(self, rows: int, seq: int, tp: int = 1, dtype_bytes: int = 2,
                               sequence_parallel: bool = False) -> float:
        """What one block's forward keeps for backward (Korthikanti et al. 2022, with
        memory-efficient attention: no score matrix): ``s b h (10 + 24 / tp)`` bytes at 16-bit,
        the 24 being what tensor parallelism splits, and the 10 (norms, residuals, dropout
        masks) split too under sequence parallelism; scaled for the MLP's width and gating."""
        width = self.mlp_width / (4 * self.hidden) * (1.5 if self.gated_mlp else 1.0)
        split = 8 + 16 * width  # attention's q, k, v, output and dropout; the MLP's activations
        whole = 10 / tp if sequence_parallel else 10
        # under MoE the (token, expert) pairs' hidden vectors, three times: gathered in expert
        # order, arrived at (or staying on) their expert's rank, and their results back
        pairs = 3 * 2 * self.experts_per_token if self.experts else 0
        return rows * seq * self.hidden * (whole + pairs + split / tp) * dtype_bytes / 2

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
