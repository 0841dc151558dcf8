"""Small configs of every family in the TP plan table: 8 heads and 4 KV heads (where the family
has grouped-query attention), so tp=2 and tp=4 both divide them; dropout off."""

from __future__ import annotations

import transformers as tf
from hf_models import VOCAB, batch

LAYERS = 2
ATTN = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 8,
        "num_key_value_heads": 4, "num_hidden_layers": LAYERS, "vocab_size": VOCAB}


def _causal(config_cls, **kw):
    return lambda: tf.AutoModelForCausalLM.from_config(config_cls(**kw))


TP_FAMILIES = {
    "llama": _causal(tf.LlamaConfig, **ATTN),
    "mistral": _causal(tf.MistralConfig, **ATTN),
    "qwen2": _causal(tf.Qwen2Config, **ATTN),
    "qwen3": _causal(tf.Qwen3Config, head_dim=8, **ATTN),
    "gemma": _causal(tf.GemmaConfig, head_dim=8, pad_token_id=0, **ATTN),
    "phi3": _causal(tf.Phi3Config, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **ATTN),
    "gpt_neox": _causal(tf.GPTNeoXConfig, hidden_size=64, intermediate_size=128,
                        num_attention_heads=8, num_hidden_layers=LAYERS, vocab_size=VOCAB,
                        hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                        eos_token_id=0),
    "falcon": _causal(tf.FalconConfig, hidden_size=64, num_attention_heads=8, num_kv_heads=4,
                      new_decoder_architecture=True, num_hidden_layers=LAYERS,
                      vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                      bos_token_id=0, eos_token_id=0),
    "gpt2": _causal(tf.GPT2Config, n_embd=64, n_layer=LAYERS, n_head=8, vocab_size=VOCAB,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                    eos_token_id=0),
    "opt": _causal(tf.OPTConfig, hidden_size=64, ffn_dim=128, num_hidden_layers=LAYERS,
                   num_attention_heads=8, word_embed_proj_dim=64, vocab_size=VOCAB, dropout=0.0,
                   attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1),
    "bert": lambda: tf.AutoModelForMaskedLM.from_config(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=8,
        intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=8, d_ff=128, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=8, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0)),
}


def tp_batch(family: str, step: int, rows: int):
    kind = family if family in ("bert", "t5") else "llama"
    return batch(kind, step, rows)


# families without a FAMILY_PLANS entry whose config ships a base_model_tp_plan: together they use
# colwise_gather_output / rowwise_split_input (olmo2), packed_colwise experts + moe_tp_experts
# (mixtral, qwen3_moe), replicated_with_grad_allreduce (qwen3_moe, exaone4) and mla_kv_a_proj
# (deepseek_v2)
_MOE = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "router_jitter_noise": 0.0,
        "output_router_logits": True}


def _hf(model_type: str, **overrides):
    def build():
        base = tf.AutoConfig.for_model(model_type)
        kw = {k: v for k, v in {**ATTN, "head_dim": 8, "pad_token_id": 0, "bos_token_id": 1,
                                "eos_token_id": 2, **_MOE, **overrides}.items()
              if hasattr(base, k) or k in overrides}
        return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(model_type, **kw))
    return build


def moe_model(model_type: str, layers: int):
    """A small model of an MoE family (router auxiliary loss on) with `layers` layers."""
    return _hf(model_type, num_hidden_layers=layers)()


HF_PLAN_FAMILIES = {
    "olmo2": _hf("olmo2"),
    "mixtral": _hf("mixtral"),
    "qwen3_moe": _hf("qwen3_moe", decoder_sparse_step=1, mlp_only_layers=[1]),
    "exaone4": _hf("exaone4", sliding_window=4),
    "deepseek_v2": _hf("deepseek_v2", num_key_value_heads=8, q_lora_rank=16, kv_lora_rank=16,
                       qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1,
                       first_k_dense_replace=1, n_group=1, topk_group=1),
}


# families with neither a FAMILY_PLANS entry nor a base_model_tp_plan, sharded by the
# plan inferred from their blocks; configs shrunk as `merak coverage` shrinks them (4 layers,
# width 64, 4 heads, dropout off): ALiBi inputs (bloom, mpt), fused q/k/v (mpt's chunk,
# persimmon's and bloom's per-head layout, openai-gpt's Conv1D split), grouped K/V heads
# (stablelm), per-head norms (persimmon), one K/V head left replicated (gpt_bigcode)
INFERRED = ("stablelm", "persimmon", "biogpt", "mpt", "bloom", "xglm", "gpt_bigcode",
            "openai-gpt")


def inferred_family(name: str):
    from merak.coverage.shrink import small_config

    config = small_config(name)
    return lambda: tf.AutoModelForCausalLM.from_config(config)
