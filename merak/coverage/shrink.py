"""Shrink any causal-LM family's default config to a few-layer, narrow model, generically.

The sizes are set by attribute *name* (the spellings transformers' configs use for layers,
width, heads, experts, ...), passed to the config's constructor so that values derived from
them (layer type lists, head dimensions) are derived again. Nothing is family-specific: a
family whose config ignores these names stays large, and `build_small` refuses it by counting
its parameters on the meta device before anything is allocated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import transformers as tf
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

LAYERS, WIDTH, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, EXPERTS, TOP_K, SEQ = \
    4, 64, 128, 4, 2, 16, 256, 4, 2, 16
MAX_PARAMETERS = 5_000_000

LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_blocks",
               "decoder_layers", "num_decoder_layers", "num_encoder_layers", "encoder_layers")
EXPERT_NAMES = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                "num_routed_experts", "n_experts")
_HEAD_NAMES = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
               "encoder_attention_heads")
_KV_NAMES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
             "num_key_value_groups")
_TOP_K_NAMES = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k",
                "num_selected_experts", "experts_per_token")
# attribute name -> its small value
_SIZES = {
    **dict.fromkeys(LAYER_NAMES, LAYERS),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "dim",
                     "hidden_dim", "word_embed_proj_dim", "model_dim", "emb_dim"), WIDTH),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size",
                     "mlp_dim", "decoder_ffn_dim", "encoder_ffn_dim", "inner_hidden_size",
                     "dense_intermediate_size"), FFN),
    **dict.fromkeys(_HEAD_NAMES, HEADS),
    **dict.fromkeys(_KV_NAMES, KV_HEADS),
    **dict.fromkeys(("head_dim", "kv_channels", "d_kv", "attention_head_dim", "head_size",
                     "v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
                     "rotary_dim"), HEAD_DIM),
    **dict.fromkeys(EXPERT_NAMES, EXPERTS),
    **dict.fromkeys(_TOP_K_NAMES, TOP_K),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size",
                     "expert_intermediate_size", "moe_ffn_hidden_size"), 32),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads", "linear_num_heads"), HEADS),
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input"), VOCAB),
}
_CAPS = {"max_position_embeddings": 512, "n_positions": 512, "n_ctx": 512,
         "sliding_window": 8, "attention_window": 8, "num_shared_experts": 1,
         "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
         "num_expert_group": 1}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
              "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")
_RANDOM = ("drop", "jitter", "noise")  # float attributes that make training random


def causal_lm_families() -> list[str]:
    """Every model type the installed transformers maps to a causal-LM class."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _representative(values: list) -> list:
    """`LAYERS` entries of a per-layer list, in order, with every distinct entry kept (a hybrid
    model's attention and linear-attention layers both stay)."""
    keys = [json.dumps(v, sort_keys=True, default=str) for v in values]
    first = {k: i for i, k in reversed(list(enumerate(keys)))}
    chosen = sorted(first.values())[:LAYERS]
    chosen += [i for i in range(len(values)) if i not in chosen][:LAYERS - len(chosen)]
    return [values[i] for i in sorted(chosen)]


def _small_values(defaults: dict) -> dict:
    layers = next((defaults[k] for k in LAYER_NAMES if isinstance(defaults.get(k), int)), None)
    new = {}
    for key, value in defaults.items():
        if isinstance(value, bool):
            continue
        if key in _SIZES and isinstance(value, int):
            new[key] = min(value, _SIZES[key]) if "vocab" not in key else _SIZES[key]
        elif key in _CAPS and isinstance(value, int) and value > _CAPS[key]:
            new[key] = _CAPS[key]
        elif key in _TOKEN_IDS and isinstance(value, int) and value >= VOCAB:
            new[key] = VOCAB - 1
        elif isinstance(value, float) and any(w in key for w in _RANDOM):
            new[key] = 0.0
        elif isinstance(value, list) and layers and len(value) == layers and layers > LAYERS:
            new[key] = _representative(value)  # per-layer lists (layer types, window sizes)
        elif isinstance(value, dict) and "model_type" in value:  # a sub-config (text_config)
            new[key] = {**value, **_small_values(value)}
        elif isinstance(value, dict) and value and layers and all(
                str(k).isdigit() for k in value):  # settings per layer index
            new[key] = {k: v for k, v in value.items() if int(k) < LAYERS}
    if isinstance(defaults.get("qk_head_dim"), int) and "qk_nope_head_dim" in new:  # MLA
        new["qk_head_dim"] = new["qk_nope_head_dim"] + new.get("qk_rope_head_dim", 0)
    if any(isinstance(defaults.get(k), int) for k in EXPERT_NAMES):
        new.update({k: TOP_K for k in _TOP_K_NAMES if k in defaults and defaults[k] is None})
    heads = [k for k in _HEAD_NAMES if isinstance(defaults.get(k), int)]
    for kv in _KV_NAMES:  # a config whose K/V heads equal its heads (MLA) keeps them equal
        if heads and defaults.get(kv) == defaults[heads[0]] and kv in new:
            new[kv] = new[heads[0]]
    if "output_router_logits" in defaults:
        new["output_router_logits"] = True  # the auxiliary loss is part of the loss
    if "use_cache" in defaults:
        new["use_cache"] = False
    return new


def small_config(model_type: str):
    """The family's default config with every size `_SIZES` knows made small."""
    defaults = tf.AutoConfig.for_model(model_type).to_dict()
    return tf.AutoConfig.for_model(model_type, **_small_values(defaults))


@dataclass
class SmallModel:
    model_type: str
    config: object
    parameters: int
    build: object  # () -> the model, real weights, seeded


class TooLargeError(ValueError):
    """A shrunken config still has more than `MAX_PARAMETERS` parameters."""


def count_parameters(config) -> int:
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_small(model_type: str, seed: int = 0, limit: int = MAX_PARAMETERS) -> SmallModel:
    """A builder of the family's shrunken model; refuses (`TooLargeError`) a config whose model
    would stay above `limit` parameters, counted on the meta device first."""
    config = small_config(model_type)
    parameters = count_parameters(config)
    if parameters > limit:
        raise TooLargeError(f"{parameters / 1e6:.1f} M parameters after shrinking (limit "
                            f"{limit / 1e6:.0f} M): its config ignores the generic size names")

    def build():
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config)
        return model

    return SmallModel(model_type, config, parameters, build)


def example_batch(rows: int = 2, seq: int = SEQ, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 1, (rows, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
