"""Transformers' tensor-parallel plan styles (``config.base_model_tp_plan``) in Merak's terms.

A family whose config ships a ``base_model_tp_plan`` (``{"layers.*.self_attn.q_proj":
"colwise", ...}``) gets a `TPPlan` from it (`plan_from_hf_table`), so it runs at tp > 1 without
a hand-written entry in `FAMILY_PLANS`. Each transformers style becomes an arrangement of
Merak's Megatron-style layers with the same result (same loss and gradients as the unsharded
model; transformers' DTensor placements are not used):

==============================  ===============================================================
``colwise``                     column-parallel linear; its output stays sharded (this rank's
                                heads / features). On a bare parameter (3-D experts weight
                                ``[E, out, in]``, a per-head ``sinks`` or ``gate_bias``): split
                                along its output dim (``ndim - 2``, dim 0 for a vector).
``colwise_gather_output``       column-parallel linear whose output is all-gathered: what follows
                                (OLMo2's ``q_norm`` over the whole projection, the attention)
                                sees the full width, replicated on every rank. (alias
                                ``colwise_rep``)
``rowwise``                     row-parallel linear fed this rank's features, partial outputs
                                summed, bias added once. On a bare parameter: split along its
                                last (input) dim.
``rowwise_split_input``         row-parallel linear fed the full (replicated) input: it slices
                                its own input features (backward all-gathers). (alias
                                ``rowwise_rep``)
``packed_colwise``              column-parallel whose output packs two equal parts (fused
                                ``gate_up_proj``): each part is split separately; on a 3-D
                                experts weight ``[E, 2I, H]``: dim 1, gate and up halves apart.
``packed_rowwise``              a bare parameter packing two equal parts along its last dim
                                (Llama-4's experts ``gate_up_proj`` ``[E, H, 2I]``): each split.
``moe_tp_experts``              the experts module runs on its shards of every expert (weights
                                split along the intermediate dim by the entries above): its
                                floating inputs (hidden states, routing weights) enter with an
                                all-reduce in backward, its output is summed over the TP ranks.
``all_reduce``                  the same for another module whose parameters are split so that
                                its output is a per-rank partial sum (shared experts).
``moe_identity_expert``         an identity expert inside such a module: its input is divided by
                                tp, so the sum over ranks counts it once.
``replicated_with_grad_allreduce``  replicated norm that sees only this rank's heads (Qwen3's
                                ``q_norm``): its gradient is summed over TP. Only when the module
                                that holds it also holds a column-parallel layer whose output
                                stays sharded; after a gathered projection the norm sees
                                everything and its gradient is already complete.
``mla_kv_a_proj``               MLA's replicated ``kv_a_proj_with_mqa``: the last
                                ``qk_rope_head_dim`` features (the shared rotary key, used by this
                                rank's heads only) get their gradient all-reduced.
``embedding_rowwise``           vocab-parallel embedding (rows split, lookups summed); the
                                model's input embedding is only split with ``parallel_vocab``.
``embedding_colwise``           embedding split along its features, lookups all-gathered.
``local_params``, ``replicate`` nothing: Merak's parameters are plain local tensors already
                                (the parameters inside are split by their own entries), and a
                                replicated parameter stays whole.
==============================  ===============================================================

Any other style (``sequence_parallel``, a style of a later transformers) is refused with an
error naming it and the family. Entries outside the repeated blocks other than the embedding
(e.g. a multimodal projector) stay replicated, which is exact.
"""

from __future__ import annotations

from collections.abc import Mapping

# transformers style -> what Merak does with it (also the text `diagnose` shows)
STYLE_MEANINGS = {
    "colwise": "column-parallel, output sharded",
    "colwise_gather_output": "column-parallel, output all-gathered",
    "colwise_rep": "column-parallel, output all-gathered",
    "rowwise": "row-parallel, input sharded, output summed",
    "rowwise_split_input": "row-parallel, full input sliced per rank, output summed",
    "rowwise_rep": "row-parallel, full input sliced per rank, output summed",
    "packed_colwise": "column-parallel of two packed parts, each split",
    "packed_rowwise": "parameter split along its last dim, two packed parts each split",
    "moe_tp_experts": "experts split along the intermediate dim, output summed over TP",
    "all_reduce": "per-rank partial output summed over TP",
    "moe_identity_expert": "identity expert, input divided by tp",
    "replicated_with_grad_allreduce": "replicated, gradient summed over TP when it sees only "
                                      "this rank's heads",
    "mla_kv_a_proj": "replicated, rotary-key features' gradient summed over TP",
    "embedding_rowwise": "vocab-parallel embedding",
    "embedding_colwise": "embedding split along its features, output all-gathered",
    "local_params": "no-op (parameters are local tensors)",
    "replicate": "replicated",
}

# config attributes that the expert / shared-expert intermediate split must divide
MOE_DIVISIBLE = ("moe_intermediate_size", "shared_expert_intermediate_size",
                 "expert_intermediate_size")


# entries missing from transformers' own plans, found by the tp=2 parity sweep: family -> entries
# added to (and overriding) its base_model_tp_plan
PLAN_FIXES: dict[str, dict[str, str]] = {
    # xIELU activation with learnable alpha_p / alpha_n, applied to this rank's MLP features
    **{family: {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}
       for family in ("apertus", "apertus1p5_text")},
    # per-head q/k norms (as Qwen3's) that see only this rank's heads
    "sarvam_moe": {"layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                   "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"},
    # the experts' gate_up_proj [E, 2I, H] is read as two halves (chunk(2)): plain colwise would
    # give rank 0 only gate rows
    **{family: {"layers.*.mlp.experts.gate_up_proj": "packed_colwise"}
       for family in ("inkling", "inkling_text", "inkling2", "inkling2_text")},
}

# families whose transformers plan runs with sequence parallelism (`sp_gather`: the modules
# whose input is gathered along the sequence), each proven at single-process parity; an MoE
# block among them runs whole on every TP rank (`merak.tensor_parallel.layers.sequence`), as
# does one whose split is gathered back inside it (OLMoE's attention) or not split at all
# (DeepSeek-V3's attention)
SEQUENCE_PARALLEL: dict[str, tuple[str, ...]] = {
    family: ("self_attn", "mlp") for family in ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3")}


def _pattern(key: str) -> str:
    """A plan key (``layers.*.self_attn.q_proj``, relative to the base model) as a Merak pattern
    matching the qualified name in the full model (a dotted suffix / glob)."""
    return key if "*" not in key else "*." + key


def plan_fields_from_hf(table: Mapping[str, str], family: str) -> dict | None:
    """The `TPPlan` keyword arguments for transformers' plan `table` of `family`; None when it
    splits nothing. Unknown styles become an ``unsupported`` reason naming style and family."""
    column, row, gather, split_input, partial_grad = [], [], [], [], []
    partial_sum, identity, rope, vocab, emb_dim, embeddings = [], [], [], [], [], []
    packed: dict[str, int] = {}
    params: dict[str, str] = {}
    refused, replicated = [], []
    table = {**table, **PLAN_FIXES.get(family, {})}
    for key, style in table.items():
        pattern = _pattern(key)
        if style in ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise"):
            column.append(pattern)
            if style in ("colwise_gather_output", "colwise_rep"):
                gather.append(pattern)
            else:
                params[pattern] = "out"
            if style == "packed_colwise":
                packed[pattern] = 2
        elif style in ("rowwise", "rowwise_split_input", "rowwise_rep"):
            row.append(pattern)
            if style == "rowwise":
                params[pattern] = "in"
            else:
                split_input.append(pattern)
        elif style == "packed_rowwise":
            params[pattern], packed[pattern] = "in", 2
        elif style in ("moe_tp_experts", "all_reduce"):
            partial_sum.append(pattern)
        elif style == "moe_identity_expert":
            identity.append(pattern)
        elif style == "replicated_with_grad_allreduce":
            partial_grad.append(pattern)
        elif style == "mla_kv_a_proj":
            rope.append(pattern)
        elif style == "embedding_rowwise":
            (vocab if "*" in key else embeddings).append(pattern)
        elif style == "embedding_colwise":
            emb_dim.append(pattern)
        elif style in ("local_params", "replicate"):
            replicated.append(key)
        else:
            refused.append(f"{key!r}: {style!r}")
    if not (column or row or params or vocab or emb_dim) and not refused:
        return None
    reason = (f"the base_model_tp_plan of {family!r} uses a tensor-parallel style Merak does not "
              f"support ({', '.join(refused)}); give a plan with merak.set_tp_layer_lists(...) "
              f"or MerakArguments(tp_plan=...), or use tp=1") if refused else None
    return dict(
        column=tuple(column), row=tuple(row), gather_output=tuple(gather),
        split_input=tuple(split_input), packed=packed, param_shards=params,
        partial_sum=tuple(partial_sum), scaled_identity=tuple(identity), rope_grad=tuple(rope),
        vocab_parallel=tuple(vocab), embedding_dim=tuple(emb_dim), partial_grad=tuple(partial_grad),
        embeddings=tuple(embeddings) or (() if "embed_tokens" in replicated else ("embed_tokens",)),
        lm_head=("lm_head",), sp_gather=SEQUENCE_PARALLEL.get(family),
        divide_heads=True, divisible=MOE_DIVISIBLE if partial_sum else (),
        unsupported=(lambda config: reason) if reason else None,
        hf_styles=tuple((_pattern(k), v) for k, v in table.items()),
        source="base_model_tp_plan")
