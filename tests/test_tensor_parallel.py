"""Tensor parallelism: parity of tp alone (2 and 4 ranks, every family in the plan table),
sequence parallelism, vocab-parallel embedding and loss, TP dropout streams, sharded checkpoint
loading, a custom plan, and dp x tp x pp on 8 ranks; plus plan validation in one process."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from dist_harness import assert_like_reference, scenario_result
from hf_models import CustomMLP
from tp_models import HF_PLAN_FAMILIES, TP_FAMILIES
from tp_parity import DROPOUT, GENERATION, HOST_OBJECTS, WRONG_PLANS, scenario_names

import merak
import merak.engine.parallelize
from merak.distributed.parallel_context import get_context
from merak.tensor_parallel.apply.choice import _from_config_plan, plan_for
from merak.tensor_parallel.layers.megatron import ShardSpec, shard_parameter
from merak.tensor_parallel.layers.wrappers import PartialSum, RopeGradReduce
from merak.tensor_parallel.plans.hf_styles import STYLE_MEANINGS, plan_fields_from_hf
from merak.tensor_parallel.plans.tp_plan import (
    FAMILY_PLANS,
    TPPlan,
    clear_registered_plan,
    registered_plan,
)
from merak.tensor_parallel.tracing.diagnose import explain_tp_failure

WORKER = "tp_parity.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4, 8)
# losses, outputs and parameters: torch.testing.assert_close(ours, reference, rtol=RTOL,
# atol=ATOL); gradients with atol + GRAD_ATOL_OF_MAX x the reference gradient's largest entry
RTOL, ATOL, GRAD_ATOL_OF_MAX = 1e-4, 1e-5, 1e-4


@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in scenario_names(w)
                          if s not in {DROPOUT, WRONG_PLANS} | GENERATION | HOST_OBJECTS])
def test_tensor_parallel_trains_like_the_model(launches, world_size, scenario):
    figures = scenario_result(*launches(world_size), scenario)
    assert assert_like_reference(figures, rtol=RTOL, atol=ATOL,
                                 grad_atol_of_max=GRAD_ATOL_OF_MAX) > 0
    for rank, ours in enumerate(figures):
        if "params" in ours:  # a training run: every parameter of the stage got a gradient
            assert ours["params"] and ours["params_without_grad"] == [], f"rank {rank}: {ours}"
        if "sharded_params" in ours:
            assert ours["sharded_params"] > 0, f"rank {rank}: no parameter was sharded"
        if "plan_source" in ours:  # a family sharded by its config's base_model_tp_plan
            assert ours["plan_source"] == "base_model_tp_plan", f"rank {rank}: {ours}"
            assert ours["misshapen"] == [], \
                f"rank {rank}: shards not shaped as the plan slices them: {ours['misshapen']}"
            assert ours["stray_grads"] == [], \
                f"rank {rank}: gradients the unsharded model's lack: {ours['stray_grads']}"
        if "adapters" in ours:  # LoRA: this rank's stage holds adapters (and only they train)
            assert ours["adapters"] > 0, f"rank {rank}: no adapter"
        if "tied" in ours:  # a full checkpoint loaded into this rank's shards
            assert ours["tied"], f"rank {rank}: the tie was lost"
            assert ours["rank_params"] < 0.75 * ours["total_params"], f"rank {rank}: {ours}"


@pytest.mark.parametrize("world_size,scenario", [(w, s) for w in WORLD_SIZES
                                                 for s in scenario_names(w) if s in GENERATION])
def test_pipelined_generation_matches_hf_generate(launches, world_size, scenario):
    """Greedy tokens equal HF generate's on every rank; after the prefill, each hidden-state
    transfer carries one position (the KV cache); sampling follows the seed, alike on every
    rank."""
    for rank, ours in enumerate(scenario_result(*launches(world_size), scenario)):
        assert ours["tokens"] == ours["hf_tokens"], f"rank {rank}: {ours}"
        if "positions_sent" in ours:
            sent = ours["positions_sent"]
            assert sent[0] == ours["prompt_width"] and set(sent[1:]) == {1}, \
                f"rank {rank}: transfers carried {sent} positions (no KV cache?)"
        assert ours["same_seed_same"] and ours["other_seed_differs"], f"rank {rank}: {ours}"
        assert ours["ranks_sampled_alike"], f"rank {rank}: ranks sampled differently"


@pytest.mark.parametrize("world_size", [2])
def test_tp_dropout_draws_agree_on_replicated_activations_only(world_size, launches):
    """Draws on replicated activations (GPT-2's dropout after the row-parallel projection, and
    after the attention block) are alike on every TP rank; draws inside a column-parallel layer
    differ between them."""
    for rank, seen in enumerate(scenario_result(*launches(world_size), DROPOUT)):
        assert seen["replicated_alike"], f"rank {rank}: replicated draws differ between TP ranks"
        assert seen["outside_alike"], f"rank {rank}: draws after the block differ between ranks"
        assert not seen["inside_alike"], \
            f"rank {rank}: draws between column- and row-parallel layers are alike on TP ranks"


@pytest.mark.parametrize("world_size", [2])
def test_planted_wrong_plans_are_refused_naming_the_module(world_size, launches):
    """BioGPT's row-parallel fc2 marked column and OpenAI-GPT's fused q/k/v split as one part:
    inferred plans (to be proven) refused by merak.parallelize and by the proof alone."""
    for rank, families in enumerate(scenario_result(*launches(world_size), WRONG_PLANS)):
        assert sorted(families) == ["biogpt", "openai-gpt"], f"rank {rank}: {families}"
        for name, seen in families.items():
            where = f"rank {rank}, {name}"
            assert seen["check"] and seen["source"] == "inferred", f"{where}: {seen}"
            module = seen["module"]
            for step in ("parallelize", "proof"):
                refusal = seen[step]
                assert refusal is not None, f"{where}: {step} let the wrong plan through"
                assert f"{module} " in refusal or f"{module}." in refusal, \
                    f"{where}: {step}'s refusal does not name {module}: {refusal}"
            assert "never used" in seen["parallelize"], f"{where}: {seen['parallelize']}"


def _ctx(tp: int, rank: int = 0):
    return SimpleNamespace(tp=tp, tp_rank=rank, tp_group=None)


def test_every_table_family_is_exercised():
    assert set(TP_FAMILIES) <= set(FAMILY_PLANS)
    assert {"llama", "gpt2", "qwen2", "bert", "t5", "opt", "mistral"} <= set(TP_FAMILIES)


@pytest.mark.parametrize("overrides,message", [
    ({"num_attention_heads": 2, "num_key_value_heads": 2}, "tp=4 must divide num_attention_heads"),
    ({"num_key_value_heads": 2}, "tp=4 must divide num_key_value_heads"),
    ({"intermediate_size": 130}, "tp=4 must divide intermediate_size"),
])
def test_tp_must_divide_heads_and_sizes(overrides, message):
    config = tf.LlamaConfig(**{"hidden_size": 64, "intermediate_size": 128,
                               "num_attention_heads": 8, "num_key_value_heads": 4,
                               "num_hidden_layers": 2, "vocab_size": 128, **overrides})
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=message):
        merak.apply_tensor_parallel(model, _ctx(4))


def test_parallel_vocab_needs_a_divisible_vocabulary():
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
            num_hidden_layers=2, vocab_size=130))
    merak.apply_tensor_parallel(model, _ctx(4))  # fine without parallel_vocab
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(model.config)
    with pytest.raises(ValueError, match="vocab_size"):
        merak.apply_tensor_parallel(model, _ctx(4), parallel_vocab=True)


def test_a_model_without_a_plan_is_told_about_set_tp_layer_lists():
    with pytest.raises(ValueError, match="set_tp_layer_lists"):
        merak.apply_tensor_parallel(CustomMLP(), _ctx(2))


def test_unsupported_variants_say_so():
    with merak.init_empty_weights():
        falcon = tf.AutoModelForCausalLM.from_config(tf.FalconConfig(
            hidden_size=64, num_attention_heads=8, num_hidden_layers=2, vocab_size=128,
            multi_query=True, new_decoder_architecture=False))
    with pytest.warns(UserWarning, match="multi_query Falcon .* not supported yet"):
        merak.apply_tensor_parallel(falcon, _ctx(2))  # the inferred plan instead
    assert falcon.merak_tp.plan.source == "inferred" and \
        falcon.merak_tp.plan.notes[0].startswith("the family's plan (table) cannot shard")
    assert "transformer.h.0.mlp.dense_h_to_4h" in falcon.merak_tp.converted  # one K/V head:
    assert "transformer.h.0.self_attention.query_key_value" not in falcon.merak_tp.converted
    with merak.init_empty_weights():
        gpt2 = TP_FAMILIES["gpt2"]()
    with pytest.raises(ValueError, match="sequence_parallel is not supported yet"):
        merak.apply_tensor_parallel(gpt2, _ctx(2), sequence_parallel=True)
    with pytest.raises(ValueError, match="needs tp > 1"):
        merak.apply_tensor_parallel(gpt2, _ctx(1), sequence_parallel=True)
    with pytest.raises(ValueError, match="parallel_vocab found none"):
        merak.apply_tensor_parallel(CustomMLP(), _ctx(2), parallel_vocab=True,
                                    plan=TPPlan(column=("fc1",), row=("fc2",)))


def test_an_explicit_plan_wins_over_the_registered_one(monkeypatch):
    """Plan lookup: the explicit plan, else the one `set_tp_layer_lists` recorded on the
    job (keyed to its device mesh), else the family's; `parallelize` hands `tp_plan` through."""
    ctx = merak.init(dp=1, tp=1, pp=1)
    try:
        registered = merak.set_tp_layer_lists(col_para_list=["nothing"])  # matches no module
        default = get_context()
        assert default is ctx and not hasattr(default, "tp_plan")  # the context holds none
        assert registered_plan(ctx) is registered
        with pytest.raises(dataclasses.FrozenInstanceError):
            default.dp = 2
        explicit = TPPlan(column=("fc1",), row=("fc2",), source="explicit")
        assert plan_for(CustomMLP(), default) is registered
        assert plan_for(CustomMLP(), ctx) is registered  # a context taken before the call
        assert plan_for(CustomMLP(), default, explicit) is explicit
        assert plan_for(CustomMLP(), default, {"row_para_list": ["fc2"]}).row == ("fc2",)
        with merak.init_empty_weights():
            llama = TP_FAMILIES["llama"]()
        assert plan_for(llama, default) is registered  # over the family's
        assert plan_for(llama, _ctx(2)) is FAMILY_PLANS["llama"]  # not that job's context

        tp2 = SimpleNamespace(tp=2, tp_rank=0, tp_group=None, mesh=ctx.mesh)
        assert merak.apply_tensor_parallel(CustomMLP(), tp2, plan=explicit).merak_tp.plan \
            is explicit
        with pytest.raises(ValueError, match="matched no module"):  # the registered plan
            merak.apply_tensor_parallel(CustomMLP(), tp2)
        with pytest.raises(ValueError, match="tp plan key 'rows'"):  # checked even at tp=1
            merak.parallelize(CustomMLP(), {}, ctx, plan={"rows": ["fc2"]})
        seen = {}

        def fake_apply(model, context, options):
            seen.update(options=options, context=context)
            raise InterruptedError

        monkeypatch.setattr(merak.engine.parallelize, "apply_tensor_parallel", fake_apply)
        with pytest.raises(InterruptedError):
            merak.parallelize(CustomMLP(), {}, default, plan=explicit)
        assert seen["options"].plan is explicit and seen["context"] is default
    finally:
        clear_registered_plan()


def test_set_tp_layer_lists_needs_a_context_and_names_bad_arguments(monkeypatch):
    from merak.distributed import parallel_context

    monkeypatch.setattr(parallel_context, "_default_context", None)
    with pytest.raises(RuntimeError, match="call merak.init.* or give the plan explicitly"):
        merak.set_tp_layer_lists(col_para_list=["fc1"])
    for kwargs, message in [({"col_para_list": "fc1"}, "col_para_list must be a list"),
                            ({"input_output_mapping": [(1, 4, "column")]}, "'col' or 'row'"),
                            ({"weight_change_list": [("bias", "0")]}, "weight_change_list"),
                            ({"tp_attr_list": ["num_heads"]}, "nothing would be split")]:
        with pytest.raises(ValueError, match=message):
            merak.set_tp_layer_lists(**kwargs)


def test_a_plan_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match="matched no module"):
        merak.apply_tensor_parallel(CustomMLP(), _ctx(2), plan=TPPlan(column=("nothing",)))


def test_fused_shards_take_each_part_separately():
    full = torch.arange(12.0).view(12, 1)  # parts q=[0..5], k=[6..8], v=[9..11]
    spec = ShardSpec(dim=0, rank=1, size=3, chunks=(6, 3, 3), full_shape=(12, 1))
    assert spec.take(full).flatten().tolist() == [2, 3, 7, 10]
    with pytest.raises(ValueError, match="tp=2"):
        shard_parameter(torch.nn.Parameter(torch.zeros(12, 1)), 0, 0, 2, chunks=(6, 3, 3))


def test_gpt2_fused_qkv_and_attributes_are_divided():
    with merak.init_empty_weights():
        model = TP_FAMILIES["gpt2"]()
    merak.apply_tensor_parallel(model, _ctx(2, rank=1))
    attn = model.transformer.h[0].attn
    assert attn.split_size == 32 and attn.c_attn.weight.shape == (64, 96)
    assert attn.c_attn.weight.tp_shard.chunks == (64, 64, 64)
    assert attn.c_proj.weight.shape == (32, 64) and attn.c_proj.bias.shape == (64,)
    assert model.merak_tp.size == 2 and "transformer.h.0.attn.c_attn" in model.merak_tp.converted


def _hf_model(name: str, **overrides):
    config = HF_PLAN_FAMILIES[name]().config
    for key, value in overrides.items():
        setattr(config, key, value)
    with merak.init_empty_weights():
        return tf.AutoModelForCausalLM.from_config(config)


def test_every_transformers_style_has_a_meaning_or_a_refusal():
    styles = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
              "packed_colwise", "packed_rowwise", "moe_tp_experts",
              "replicated_with_grad_allreduce", "embedding_rowwise", "embedding_colwise",
              "mla_kv_a_proj", "local_params", "replicate", "all_reduce", "moe_identity_expert")
    assert set(styles) <= set(STYLE_MEANINGS)
    fields = plan_fields_from_hf({f"layers.*.m{i}": s for i, s in enumerate(styles)}, "demo")
    assert fields["unsupported"] is None
    olmo2 = _from_config_plan(HF_PLAN_FAMILIES["olmo2"]().config)
    assert olmo2.source == "base_model_tp_plan" and "*.layers.*.self_attn.q_proj" in \
        olmo2.gather_output and olmo2.split_input == ("*.layers.*.self_attn.o_proj",)
    odd = SimpleNamespace(model_type="demo", base_model_tp_plan={
        "layers.*.q_proj": "colwise", "layers.*.o_proj": "rowwise",
        "layers.*.norm": "sequence_parallel"})
    with pytest.raises(ValueError, match="of 'demo' uses a .* style .*'sequence_parallel'"):
        merak.apply_tensor_parallel(
            SimpleNamespace(config=odd, merak_tp=None), _ctx(2))


def test_config_plans_shard_experts_heads_and_norms():
    """Meta builds at tp=2 (rank 1): experts split along the intermediate dim (gate and up
    halves apart) and summed, OLMo2's gathered q/k/v and split-input o_proj, a partial gradient
    for Qwen3-MoE's per-head q_norm but not OLMo2's full-width one, MLA's rotary key."""
    mixtral = _hf_model("mixtral")
    merak.apply_tensor_parallel(mixtral, _ctx(2, rank=1))
    experts = mixtral.model.layers[0].mlp.experts
    assert isinstance(experts, PartialSum)
    assert experts.gate_up_proj.shape == (4, 128, 64)  # [E, 2 * 128 / 2, H]
    assert experts.gate_up_proj.tp_shard.chunks == (128, 128)
    assert experts.down_proj.shape == (4, 64, 64) and experts.down_proj.tp_shard.dim == 2
    assert "packed_colwise" in mixtral.merak_tp.style_of("model.layers.0.mlp.experts.gate_up_proj")

    olmo2 = _hf_model("olmo2")
    merak.apply_tensor_parallel(olmo2, _ctx(2, rank=1))
    attn = olmo2.model.layers[0].self_attn
    assert attn.q_proj.gather_output and not attn.o_proj.input_is_parallel
    assert not olmo2.model.layers[0].mlp.up_proj.gather_output
    assert not getattr(attn.q_norm.weight, "tp_partial_grad", False)

    moe = _hf_model("qwen3_moe")
    merak.apply_tensor_parallel(moe, _ctx(2))
    attn = moe.model.layers[0].self_attn
    assert attn.q_norm.weight.tp_partial_grad and attn.config.num_attention_heads == 4
    assert moe.config.num_attention_heads == 8  # the model's own config is untouched

    deepseek = _hf_model("deepseek_v2")
    merak.apply_tensor_parallel(deepseek, _ctx(2))
    attn = deepseek.model.layers[0].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa, RopeGradReduce)
    assert attn.kv_a_proj_with_mqa.rope_dim == 8 and attn.num_heads == 4


def test_moe_sizes_must_divide():
    model = _hf_model("qwen3_moe", moe_intermediate_size=30)
    with pytest.raises(ValueError, match="tp=4 must divide moe_intermediate_size"):
        merak.apply_tensor_parallel(model, _ctx(4))


def test_a_shape_error_after_tp_names_the_module_and_style():
    """OLMo2 sharded the naive way (every colwise* as plain column-parallel): the shape error
    of its full-width q_norm is reported as a TP problem naming the module and the style, with
    how to override, not as a capture problem."""
    from merak.partition.auto import _capture_hint

    build = HF_PLAN_FAMILIES["olmo2"]
    table = {k: "colwise" if v.startswith("colwise") else "rowwise"
             for k, v in build().config.base_model_tp_plan.items()}
    naive = TPPlan(**plan_fields_from_hf(table, "olmo2"))
    model = merak.apply_tensor_parallel(build(), _ctx(2), plan=naive)  # no group: no comms
    with pytest.raises(RuntimeError, match="must match the size") as caught:
        model(input_ids=torch.randint(0, 128, (2, 6)))
    message = explain_tp_failure(model, caught.value)
    assert "model.layers.0.self_attn.q_norm (Olmo2RMSNorm)" in message
    assert "model.layers.0.self_attn.q_proj: colwise (column-parallel, output sharded) (plan: " \
           "base_model_tp_plan)" in message
    assert "the config's base_model_tp_plan" in message
    assert "merak.set_tp_layer_lists(" in message and "tp_plan=" in message
    assert "use_cache" not in message
    assert _capture_hint(model, "export", caught.value) == message
    assert explain_tp_failure(model, RuntimeError("CUDA out of memory")) is None
    assert explain_tp_failure(build(), caught.value) is None  # not tensor-parallel
    assert "use_cache" in _capture_hint(build(), "export", caught.value)


class _FakeCudaGenerator:
    """The current CUDA device's default generator, as torch.cuda's RNG functions see it."""

    def __init__(self, monkeypatch):
        self.state = torch.tensor([7], dtype=torch.uint8)
        for name, fn in (("is_available", lambda: True), ("is_initialized", lambda: True),
                         ("get_rng_state", lambda device="cuda": self.state.clone()),
                         ("set_rng_state", self._set), ("manual_seed", self._seed),
                         ("manual_seed_all", self._seed)):
            monkeypatch.setattr(torch.cuda, name, fn)

    def _set(self, state, device="cuda"):
        self.state = state.clone()

    def _seed(self, seed):
        self.state = torch.tensor([seed % 256], dtype=torch.uint8)


def test_tp_rng_swaps_the_cuda_generator_too_on_shadowed_modules(monkeypatch):
    """A TP region entered by a module on the meta device (generation shadows the layers other
    stages hold) seeds this rank's stream into the CUDA generator as well: leaving must put
    back both the CPU and the CUDA state, or pipeline ranks sample different tokens."""
    from merak.tensor_parallel.layers.rng import install_tp_rng

    cuda = _FakeCudaGenerator(monkeypatch)
    column, row = torch.nn.Linear(4, 4, device="meta"), torch.nn.Linear(4, 4, device="meta")
    holder = torch.nn.Module()
    install_tp_rng(holder, [column], [row], [], tp_rank=1, sequence_parallel=False)
    torch.manual_seed(3)
    cuda.state = torch.tensor([7], dtype=torch.uint8)
    cpu_before = torch.get_rng_state()
    seen = []
    row.register_forward_pre_hook(lambda m, a: seen.append(cuda.state.clone()), prepend=True)
    for _ in range(2):
        row(column(torch.zeros(2, 4, device="meta")))
        assert torch.equal(cuda.state, torch.tensor([7], dtype=torch.uint8))
        assert torch.equal(torch.get_rng_state(), cpu_before)
    own_seed = (3 + 2718 + 1) % 256
    assert [s.item() for s in seen] == [own_seed, own_seed]  # inside: this rank's stream
    assert holder.merak_tp_rng.own[1] is not None  # saved with it, resumed next time
