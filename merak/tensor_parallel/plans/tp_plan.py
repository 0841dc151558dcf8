"""Tensor-parallel plans: which modules of a model are column/row parallel, what else changes.

A pattern matches a module's qualified name when it equals it, is a dotted suffix of it
(``self_attn.q_proj`` matches ``model.layers.3.self_attn.q_proj``) or matches it as a glob
(``*.layers.*.mlp.up_proj``). Plans apply to the modules inside the repeated blocks; the
embedding and LM head are handled by ``parallel_vocab``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from merak.distributed.parallel_context import get_context

# The plan `set_tp_layer_lists` recorded, with the device mesh of the job it was recorded for
# (the default context's then): part of the state `merak.init()` sets up, keyed to its mesh.
_recorded: tuple[object, TPPlan] | None = None


def matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


@dataclass(frozen=True)
class TPPlan:
    """How to shard one model family. `fused` gives the sizes of the parts of a fused output
    dimension (each part is split separately, e.g. q, k, v); `divide` lists attributes, per
    module pattern, holding counts of heads or features that become per-rank counts;
    `head_sharded` lists parameters split along a head dimension; `partial_grad` lists
    replicated parameters that see only this rank's heads (their gradients are summed over TP);
    `sp_gather` lists the modules whose first input is gathered along the sequence with
    sequence parallelism (None: sequence parallelism not supported for this family);
    `own_config` gives matching modules a private copy of the config with those attributes
    divided (for forwards that read head counts from ``self.config``); `unsupported` returns a
    reason when a config variant cannot be sharded.

    The fields after `source` carry transformers' plan styles
    (`merak.tensor_parallel.plans.hf_styles` says which style gives which): `gather_output` column
    layers whose output is all-gathered; `split_input` row layers fed the full input (each slices
    its part); `packed` column layers or parameters whose split dimension packs that many equal
    parts (each split apart); `param_shards` bare parameters split along their output (``"out"``:
    dim ``ndim - 2``, 0 for a vector) or input (``"in"``: the last) dim; `partial_sum` modules whose
    output is a per-rank partial sum (sharded experts: floating inputs all-reduced in backward,
    output summed); `scaled_identity` identity experts inside those (input divided by tp);
    `rope_grad` MLA ``kv_a_proj`` layers (gradient of the last ``qk_rope_head_dim`` features
    summed); `vocab_parallel` / `embedding_dim` embeddings inside the blocks split by rows /
    features; `divide_heads` divides the head counts (`HEAD_ATTRS`) of every module holding a
    column-parallel layer whose output stays sharded, and of its private config; `divisible` more
    config attributes tp must divide; `hf_styles` the (pattern, style) entries it came from.

    The fields after `hf_styles` come with plans inferred from the traced blocks
    (`merak.tensor_parallel.apply.infer`): `fused` may give the sizes themselves, and `head_sharded`
    a (dim, period) pair: each period of that many elements along the dim is split apart;
    `split_inputs` block inputs sliced per rank the same way, as (argument path in
    ``(args, kwargs)``, dim, period) entries per block pattern (BLOOM's ALiBi biases, one per
    head); `notes` why layers stay replicated; `check` asks for the proof before training (each
    rank's sharded block against the unsharded one, `merak.tensor_parallel.tracing.proof`)."""

    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    fused: dict[str, Callable[[object], tuple[int, ...]] | tuple[int, ...]] = field(
        default_factory=dict)
    divide: dict[str, tuple[str, ...]] = field(default_factory=dict)
    divide_anywhere: tuple[str, ...] = ()
    head_sharded: dict[str, int | tuple[int, int]] = field(default_factory=dict)
    io_mapping: tuple[tuple[int, int, str], ...] = ()
    partial_grad: tuple[str, ...] = ()
    sp_gather: tuple[str, ...] | None = None
    embeddings: tuple[str, ...] = ()
    lm_head: tuple[str, ...] = ()
    own_config: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unsupported: Callable[[object], str | None] | None = None
    source: str = "table"
    gather_output: tuple[str, ...] = ()
    split_input: tuple[str, ...] = ()
    packed: dict[str, int] = field(default_factory=dict)
    param_shards: dict[str, str] = field(default_factory=dict)
    partial_sum: tuple[str, ...] = ()
    scaled_identity: tuple[str, ...] = ()
    rope_grad: tuple[str, ...] = ()
    vocab_parallel: tuple[str, ...] = ()
    embedding_dim: tuple[str, ...] = ()
    divide_heads: bool = False
    divisible: tuple[str, ...] = ()
    hf_styles: tuple[tuple[str, str], ...] = ()
    split_inputs: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    check: bool = False

    def style(self, name: str, module: nn.Module) -> str | None:
        """'column', 'row' or None for the module `name`."""
        if any(matches(name, p) for p in self.column):
            return "column"
        if any(matches(name, p) for p in self.row):
            return "row"
        weight = getattr(module, "weight", None)
        if self.io_mapping and isinstance(module, nn.Linear) and weight is not None:
            for i, o, style in self.io_mapping:
                if module.in_features * o == module.out_features * i:
                    return "column" if style == "col" else "row"
        return None


def _llama_like(extra_partial: tuple[str, ...] = ()) -> TPPlan:
    return TPPlan(
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                "mlp.up_proj"),
        row=("self_attn.o_proj", "mlp.down_proj"),
        partial_grad=extra_partial, sp_gather=("self_attn", "mlp"),
        embeddings=("model.embed_tokens",), lm_head=("lm_head",))


def _gpt2_qkv(config) -> tuple[int, ...]:
    return (config.n_embd,) * 3


def _phi3_qkv(config) -> tuple[int, ...]:
    head_dim = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    return (config.num_attention_heads * head_dim, kv, kv)


def _falcon_unsupported(config) -> str | None:
    if config.multi_query and not config.new_decoder_architecture:
        return ("multi_query Falcon (one K/V head shared by all heads) is not supported yet by "
                "tensor parallelism; use new_decoder_architecture=True or multi_query=False")
    if config.alibi:
        return "Falcon with alibi=True is not supported yet by tensor parallelism"
    return None


FAMILY_PLANS: dict[str, TPPlan] = {
    "llama": _llama_like(),
    "mistral": _llama_like(),
    "qwen2": _llama_like(),
    "qwen3": _llama_like(("self_attn.q_norm", "self_attn.k_norm")),
    "gemma": _llama_like(),
    "gemma2": _llama_like(),
    "gemma3_text": _llama_like(("self_attn.q_norm", "self_attn.k_norm")),
    "phi3": TPPlan(
        column=("self_attn.qkv_proj", "mlp.gate_up_proj"), row=("self_attn.o_proj",
                                                               "mlp.down_proj"),
        fused={"self_attn.qkv_proj": _phi3_qkv,
               "mlp.gate_up_proj": lambda c: (c.intermediate_size,) * 2},
        divide={"self_attn": ("num_key_value_heads",)},
        own_config={"self_attn": ("num_attention_heads", "num_key_value_heads")},
        sp_gather=("self_attn", "mlp"),
        embeddings=("model.embed_tokens",), lm_head=("lm_head",)),
    "gpt_neox": TPPlan(  # query_key_value is laid out per head: a plain split keeps whole heads
        column=("attention.query_key_value", "mlp.dense_h_to_4h"),
        row=("attention.dense", "mlp.dense_4h_to_h"),
        sp_gather=("attention", "mlp"), embeddings=("gpt_neox.embed_in",), lm_head=("lm_head",)),
    "falcon": TPPlan(  # query_key_value grouped per KV head (new arch) or per head: plain split
        column=("self_attention.query_key_value", "mlp.dense_h_to_4h"),
        row=("self_attention.dense", "mlp.dense_4h_to_h"),
        divide={"self_attention": ("num_heads", "num_kv_heads")}, unsupported=_falcon_unsupported,
        embeddings=("transformer.word_embeddings",), lm_head=("lm_head",)),
    "gpt2": TPPlan(
        column=("attn.c_attn", "mlp.c_fc"), row=("attn.c_proj", "mlp.c_proj"),
        fused={"attn.c_attn": _gpt2_qkv}, divide={"attn": ("split_size",)},
        embeddings=("transformer.wte",), lm_head=("lm_head",)),
    "opt": TPPlan(
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
        row=("self_attn.out_proj", "fc2"), divide={"self_attn": ("num_heads",)},
        embeddings=("model.decoder.embed_tokens",), lm_head=("lm_head",)),
    "bert": TPPlan(
        column=("attention.self.query", "attention.self.key", "attention.self.value",
                "intermediate.dense"),
        row=("attention.output.dense", "*.layer.*.output.dense"),
        embeddings=("bert.embeddings.word_embeddings",), lm_head=("cls.predictions.decoder",)),
    "t5": TPPlan(
        column=("SelfAttention.q", "SelfAttention.k", "SelfAttention.v", "EncDecAttention.q",
                "EncDecAttention.k", "EncDecAttention.v", "DenseReluDense.wi",
                "DenseReluDense.wi_0", "DenseReluDense.wi_1"),
        row=("SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo"),
        divide={"SelfAttention": ("n_heads", "inner_dim"),  # zero position_bias uses n_heads
                "EncDecAttention": ("n_heads", "inner_dim")},
        head_sharded={"relative_attention_bias.weight": 1},
        embeddings=("shared",), lm_head=("lm_head",)),
}

# attributes holding head counts: divided where a plan says `divide_heads`
HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
              "n_heads", "n_head", "n_kv_heads")

# config attributes tp must divide (whichever the config has)
DIVISIBLE_CONFIG_ATTRS = ("num_attention_heads", "num_key_value_heads", "hidden_size",
                          "intermediate_size", "ffn_dim", "d_ff", "n_inner")


# the arguments of `set_tp_layer_lists`: also the keys of a dict given as ``tp_plan``
LAYER_LIST_KEYS = ("col_para_list", "row_para_list", "input_output_mapping",
                   "weight_change_list", "tp_attr_list")


def _names(key: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) \
            or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{key} must be a list of module or attribute names, got {value!r}")
    return tuple(value)


def _entries(key: str, value: object, kinds: tuple[type, ...]) -> tuple[tuple, ...]:
    if value is None:
        return ()
    shape = "(" + ", ".join(k.__name__ for k in kinds) + ")"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{key} must be a list of {shape} entries, got {value!r}")
    entries = []
    for entry in value:
        if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) \
                or len(entry) != len(kinds) or any(
                    isinstance(v, bool) or not isinstance(v, k) for v, k in zip(entry, kinds)):
            raise ValueError(f"{key} entries are {shape}, got {entry!r}")
        entries.append(tuple(entry))
    return tuple(entries)


def tp_plan_from_layer_lists(col_para_list: Sequence[str] | None = None,
                             row_para_list: Sequence[str] | None = None,
                             input_output_mapping: Sequence[tuple[int, int, str]] | None = None,
                             weight_change_list: Sequence[tuple[str, int]] | None = None,
                             tp_attr_list: Sequence[str] | None = None) -> TPPlan:
    """The `TPPlan` that `set_tp_layer_lists` describes (its Args), validated, not recorded
    anywhere.

    Raises:
        ValueError: an argument of the wrong shape (the error names it), a style other than
            'col' or 'row', or nothing that would be split.
    """
    mapping = _entries("input_output_mapping", input_output_mapping, (int, int, str))
    for in_ratio, out_ratio, style in mapping:
        if style not in ("col", "row"):
            raise ValueError(f"input_output_mapping styles are 'col' or 'row', got {style!r}")
        if in_ratio <= 0 or out_ratio <= 0:
            raise ValueError(f"input_output_mapping ratios must be positive, got "
                             f"{(in_ratio, out_ratio, style)!r}")
    changes = _entries("weight_change_list", weight_change_list, (str, int))
    plan = TPPlan(column=_names("col_para_list", col_para_list),
                  row=_names("row_para_list", row_para_list), io_mapping=mapping,
                  head_sharded={(n if n.endswith((".weight", ".bias")) else n + ".weight"): d
                                for n, d in changes},
                  divide_anywhere=_names("tp_attr_list", tp_attr_list),
                  source="set_tp_layer_lists")
    if not (plan.column or plan.row or plan.io_mapping):
        raise ValueError("a set_tp_layer_lists plan needs col_para_list, row_para_list or "
                         "input_output_mapping: nothing would be split")
    return plan


def as_tp_plan(value: TPPlan | Mapping | None) -> TPPlan | None:
    """`value` as a `TPPlan`: None and plans as they are; a mapping whose keys are the arguments
    of `set_tp_layer_lists` (`LAYER_LIST_KEYS`) through `tp_plan_from_layer_lists`.

    Raises:
        ValueError: another type, a key that is not one of `LAYER_LIST_KEYS` (the error names
            it), or a value `tp_plan_from_layer_lists` rejects.
    """
    if value is None or isinstance(value, TPPlan):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"a tp plan is a merak.TPPlan or a dict with the keys "
                         f"{list(LAYER_LIST_KEYS)}, got {type(value).__name__}")
    for key in value:
        if key not in LAYER_LIST_KEYS:
            raise ValueError(f"tp plan key {key!r} is not one of {list(LAYER_LIST_KEYS)} (the "
                             f"arguments of merak.set_tp_layer_lists)")
    return tp_plan_from_layer_lists(**value)


def set_tp_layer_lists(col_para_list: Sequence[str] | None = None,
                       row_para_list: Sequence[str] | None = None,
                       input_output_mapping: Sequence[tuple[int, int, str]] | None = None,
                       weight_change_list: Sequence[tuple[str, int]] | None = None,
                       tp_attr_list: Sequence[str] | None = None) -> TPPlan:
    """Describe the tensor-parallel plan of a model that has none in `FAMILY_PLANS`.

    Args:
        col_para_list: names (or suffixes / globs) of linear layers made column-parallel.
        row_para_list: the same for row-parallel layers.
        input_output_mapping: ``(in, out, 'col' | 'row')``: a linear layer whose in:out feature
            ratio is in:out gets that style (e.g. ``(1, 4, 'col')``, ``(4, 1, 'row')``).
        weight_change_list: ``(name, dim)``: split the parameter `name` (or ``name.weight``)
            along `dim` across TP ranks (e.g. a per-head bias table).
        tp_attr_list: attribute names (e.g. ``num_heads``) divided by the TP degree in every
            module of the blocks that has them.

    Returns the plan; pass it as ``merak.parallelize(..., tp_plan=)`` or
    ``MerakArguments(tp_plan=)`` (a dict with these argument names as keys works there too).
    For old scripts that ignore it, the plan is also recorded for the job of the last
    `merak.init()` (its device mesh): it applies to that job when no plan is given explicitly,
    and a later `merak.init()` (a new mesh) leaves it behind.

    Raises:
        ValueError: see `tp_plan_from_layer_lists`.
        RuntimeError: `merak.init()` was not called yet.
    """
    plan = tp_plan_from_layer_lists(col_para_list, row_para_list, input_output_mapping,
                                    weight_change_list, tp_attr_list)
    global _recorded
    try:
        _recorded = (get_context().mesh, plan)
    except RuntimeError:
        raise RuntimeError(
            "merak.set_tp_layer_lists records its plan for the job of merak.init(): call "
            "merak.init(dp=, tp=, pp=) first, or give the plan explicitly "
            "(merak.parallelize(..., tp_plan=) / MerakArguments(tp_plan=))") from None
    return plan


def registered_plan(ctx: object) -> TPPlan | None:
    """The plan `set_tp_layer_lists` recorded for the job of `ctx` (the same device mesh as
    the default context it was recorded on), or None."""
    if _recorded is None:
        return None
    mesh, plan = _recorded
    return plan if getattr(ctx, "mesh", None) is mesh else None


def clear_registered_plan() -> None:
    """Forget the plan `set_tp_layer_lists` recorded (tests; a script that changes its mind)."""
    global _recorded
    _recorded = None


def plan_refusal(config, plan: TPPlan, tp: int, parallel_vocab: bool = False) -> str | None:
    """Why `plan` cannot shard a model of `config` over `tp` ranks: a size of the config tp
    does not divide (`DIVISIBLE_CONFIG_ATTRS` unless the plan is inferred or proven before use,
    which checks what it divides itself; ``plan.divisible``; the vocabulary with `parallel_vocab`),
    or a variant the plan does not support (``plan.unsupported``); None when it can."""
    if config is None:
        return None
    common = DIVISIBLE_CONFIG_ATTRS if not (plan.check or plan.source == "inferred") else ()
    for attr in common + plan.divisible + (("vocab_size",) if parallel_vocab else ()):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value % tp:
            return (f"tp={tp} must divide {attr}, but {type(config).__name__}.{attr} = {value}; "
                    f"choose a tp that divides it"
                    + ("" if attr != "vocab_size" else " or parallel_vocab=False"))
    return plan.unsupported(config) if plan.unsupported else None
