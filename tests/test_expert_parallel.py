"""Expert parallelism (merak/expert_parallel): a tiny Qwen3-MoE and Mixtral at dp2 ep2 (2 ranks),
dp4 ep2, dp2 ep2 pp2 and dp2 ep2 tp2 (4 ranks) against the single-process model in fp32 (pooled
worker ep_parity.py): losses, router load-balancing losses, gradients and parameters after 3 SGD
or AdamW steps; and in one process the argument checks, which fail before any process group,
and the pieces of experts split over both ep and tp."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from dist_harness import assert_like_reference, check, scenario_result
from ep_parity import COMMON, OPTIMIZERS, SELF_CHECKED, SEQ, scenario_names
from torch import nn

import merak
from merak import rules
from merak.checkpoint.sharded import boxes
from merak.distributed.expert_groups import expert_rank_lists
from merak.engine.assemble import build_engine
from merak.engine.options import EngineOptions, PrecisionOptions
from merak.expert_parallel import experts_modules
from merak.expert_parallel.shard import ExpertSlice, check_divisible
from merak.rules import NotSupportedYetError
from merak.tensor_parallel.layers.megatron import ShardSpec
from merak.tensor_parallel.plans.options import TensorParallelOptions

WORKER = "ep_parity.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4)
# fp32; AdamW divides by the root of small second moments, which magnifies rounding
RTOL, ATOL, GRAD_ATOL_OF_MAX = 1e-4, 1e-5, 1e-4
# AdamW at tp2: an expert gradient entry of 4.0e-9 (below AdamW's eps, 1e-8) differs by 0.5%
# (2e-11) with the TP partial sums' order, which the first update, lr x g / (|g| + eps), turns
# into 1.1e-5 of one weight; every gradient is within 1.8e-7
ATOL_TP_ADAMW = 2e-5
# the families whose tensor-parallel plan splits each expert's intermediate dim over tp
# (moe_tp_experts); GPT-OSS's inferred plan keeps its experts whole on the tp ranks
EXPERTS_SPLIT_BY_TP = ("qwen3_moe", "mixtral")


@pytest.mark.parametrize("world_size,scenario", [(w, s) for w in WORLD_SIZES
                                                 for s in scenario_names(w)
                                                 if s not in SELF_CHECKED])
def test_expert_parallel_trains_like_the_model(launches, world_size, scenario):
    figures = scenario_result(*launches(world_size), scenario)
    atol = ATOL_TP_ADAMW if "tp2" in scenario and "adamw" in scenario else ATOL
    assert assert_like_reference(figures, rtol=RTOL, atol=atol,
                                 grad_atol_of_max=GRAD_ATOL_OF_MAX) > 0
    print(f"{scenario}: max abs diff {max(f['max_abs_diff'] for f in figures):.2g}")
    for rank, ours in enumerate(figures):
        counts = ours["expert_counts"]
        # (gate_up_proj, down_proj) x the rank's layers: 2, or 1 a stage at pp2; the coverage's
        # 4-layer configs: 4 MoE layers (DeepSeek-V3: 3), GPT-OSS's biases too
        family = scenario.split("-")[1]
        expected = {"olmoe": 8, "deepseek_v3": 6, "gpt_oss": 16, "llama4_text": 8}.get(
            family, 2 if "pp2" in scenario else 4)
        assert len(counts) == expected, f"rank {rank}: {counts}"
        split = ours["ep"] * (ours.get("tp", 1) if family in EXPERTS_SPLIT_BY_TP else 1)
        assert all(mine * split == whole for mine, whole in counts.values()), counts
        assert not ours.get("params_without_grad"), ours["params_without_grad"]
    if scenario.endswith("zero1"):  # dense state over the 4 replicas, experts' over edp (2)
        assert {f["optimizer"] for f in figures} == {"ExpertZero1"}, figures
        dense, experts = (sum(f["states"][i] for f in figures) for i in (0, 1))
        assert (dense, experts) == (figures[0]["params"][0], 2 * figures[0]["params"][1])
        assert all(0 < f["states"][1] < f["params"][1] for f in figures), figures
    if "-zero2" in scenario or "-zero3" in scenario:  # FSDP2: experts over edp, rest over dp
        replicas = int(scenario.split("-dp")[1].split("-")[0])
        assert all(f["zero_groups"] == {"dense": [replicas], "experts": [replicas // 2]}
                   for f in figures), [f["zero_groups"] for f in figures]
        optimizer = next(part for part in scenario.split("-") if part in OPTIMIZERS)
        assert {f["optimizer"] for f in figures} == {type(OPTIMIZERS[optimizer](
            [nn.Parameter(torch.zeros(1))])).__name__}, figures
    if scenario.startswith("hf-"):  # every routed pair computed once (dropless), 2 layers
        pairs = 4 * SEQ * COMMON["num_experts_per_tok"]  # each rank's rows x top-k
        received = [f["received"] for f in figures]
        assert [sum(layer) for layer in zip(*received)] == [pairs * world_size] * 2, received
        inner = scenario.rsplit("-", 1)[1]
        assert {f["inner"] for f in figures} == \
            {inner if inner in ("eager", "batched_mm") else "grouped_mm"}, figures
        if scenario.endswith("skewed"):  # all to ep rank 0's experts: ep rank 1 gets none
            assert all(r == [0, 0] for r in received[1::2]), received
    if "pp2" in scenario:  # each stage holds one of the 2 layers
        assert [f["experts_modules"] for f in figures] == \
            [["model.layers.0.mlp.experts"]] * 2 + [["model.layers.1.mlp.experts"]] * 2


@pytest.mark.parametrize("world_size,scenario", [(w, s) for w in WORLD_SIZES
                                                 for s in scenario_names(w) if s in SELF_CHECKED])
def test_expert_parallel_refusals_and_layout(launches, world_size, scenario):
    check(*launches(world_size), scenario)


@pytest.mark.parametrize("degrees,match", [
    ({"dp": 3, "ep": 2}, "ep=2 does not divide dp = 3.*e.g. ep=1"),
    ({"dp": 2, "cp": 3, "ep": 4}, r"dp \* cp = 2 \* 3 = 6.*e.g. ep=3"),
    ({"dp": 2, "ep": 0}, "ep must be positive"),
])
def test_ep_that_does_not_divide_the_replicas_fails_before_any_group(degrees, match):
    groups = _groups()
    with pytest.raises(ValueError, match=match):
        merak.init(tp=1, pp=1, **degrees)
    assert _groups() == groups, "a process group was made before the check"


def _groups() -> int:
    """How many process groups this process has (0 before torch.distributed starts)."""
    return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0


def test_ep_must_be_an_int():
    with pytest.raises(TypeError, match="ep must be a positive int"):
        merak.init(dp=2, tp=1, pp=1, ep=2.0)


def test_expert_groups_are_carved_from_the_replicas():
    # dp2 cp2 tp2 pp1, ep2: the replicas of tp rank 0 are ranks 0, 2, 4, 6 (tp innermost)
    ep_lists, edp_lists = expert_rank_lists(dp=2, tp=2, pp=1, cp=2, ep=2)
    assert ep_lists == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert edp_lists == [[0, 4], [2, 6], [1, 5], [3, 7]]
    ep_lists, edp_lists = expert_rank_lists(dp=4, tp=1, pp=2, cp=1, ep=4)  # one group a stage
    assert ep_lists == [[0, 1, 2, 3], [4, 5, 6, 7]] and edp_lists == [[r] for r in range(8)]


def test_experts_ep_does_not_divide_are_refused():
    model = tf.AutoModelForCausalLM.from_config(tf.Qwen3MoeConfig(
        **{**COMMON, "num_experts_per_tok": 1}, head_dim=8, num_experts=3,
        moe_intermediate_size=16))
    modules = experts_modules(model)
    assert sorted(modules) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    with pytest.raises(ValueError, match="has 3 experts, which ep=2 does not divide"):
        check_divisible(modules, 2)
    check_divisible(modules, 3)


def test_engine_options_ep_does_not_combine_with_yet():
    """`build_engine` asks the rules with its options and the context's layout."""
    ctx = SimpleNamespace(ep=2, tp=2, cp=1)
    with pytest.raises(NotSupportedYetError, match="EngineOptions.tp_overlapping_level=2 with"):
        build_engine(nn.Linear(2, 2), {}, ctx, EngineOptions(
            tensor_parallel=TensorParallelOptions(overlap_level=2)))
    for tp in (TensorParallelOptions(sequence_parallel=True), TensorParallelOptions(
            overlap_level=1)):  # (the MoE layers run whole on the tp ranks' sequences; once)
        assert rules.refusal(EngineOptions(tensor_parallel=tp).choices(ctx)) is None
    zero2 = EngineOptions(precision=PrecisionOptions(zero_stage=2))
    assert rules.refusal(zero2.choices(ctx)) is None  # ZeRO-2/3 shard the experts over edp
    assert rules.refusal(EngineOptions().choices(ctx)) is None
    assert rules.refusal(EngineOptions().choices(SimpleNamespace(ep=2, tp=1, cp=1))) is None
    assert rules.refusal(zero2.choices(SimpleNamespace(ep=1, tp=1, cp=1))) is None


def test_merak_trainer_checks_the_rules_with_ep_before_building_anything(monkeypatch):
    """Arguments made before merak.init(ep=2) are checked again with the trainer's ep."""
    import merak.rules as rules_module
    import merak.trainer.trainer as trainer_module

    model = tf.AutoModelForCausalLM.from_config(tf.Qwen3MoeConfig(
        **{**COMMON, "num_experts_per_tok": 1}, head_dim=8, num_experts=2,
        moe_intermediate_size=16))
    args = merak.MerakArguments(output_dir="out", use_cpu=True, report_to="none",
                                auto_find_batch_size=True)
    context = SimpleNamespace(ep=2, tp=1, cp=1)
    monkeypatch.setattr(trainer_module, "get_context", lambda: context)
    monkeypatch.setattr(rules_module, "default_context", lambda: context)
    with pytest.raises(NotSupportedYetError,
                       match=r"auto_find_batch_size=True with expert parallelism \(ep=2\)"):
        merak.MerakTrainer(model=model, args=args)


@pytest.mark.parametrize("tp_dim,chunks", [(1, (6, 6)), (2, (12,))])
def test_experts_split_over_ep_and_tp_are_pieces_of_the_whole_tensor(tp_dim, chunks):
    """4 experts over ep=2, each split over tp=2 along dim 1 (a packed gate_up_proj: gate and
    up halves each split) or dim 2 (down_proj): every (ep, tp) rank's piece is its cut of the
    whole tensor, the pieces put it back together, and their checkpoint boxes tile it once."""
    whole = torch.arange(4 * 12 * 6, dtype=torch.float32).view(4, 12, 6)
    if tp_dim == 2:
        whole = whole.view(4, 6, 12)
    slices = []
    for ep_rank in range(2):
        for tp_rank in range(2):
            tp = ShardSpec(tp_dim, tp_rank, 2, chunks, (2, *whole.shape[1:]))
            slices.append(ExpertSlice(ep_rank, 2, tuple(whole.shape), tp=tp))
    pieces = [s.take(whole) for s in slices]
    assert [s.part for s in slices] == [0, 1, 2, 3] and slices[0].parts == 4
    assert all(p.numel() * 4 == whole.numel() for p in pieces)
    assert torch.equal(slices[0].assemble(pieces), whole)
    covered = torch.zeros_like(whole)
    for spec, piece in zip(slices, pieces):
        shape, found = boxes(piece, spec)
        assert shape == tuple(whole.shape) and len(found) == len(chunks)
        for box in found:
            at = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))
            mine = tuple(slice(o, o + n) for o, n in zip(box.local, box.sizes))
            assert torch.equal(piece[mine], whole[at])
            covered[at] += 1
    assert torch.equal(covered, torch.ones_like(whole))


def test_zero_refuses_a_module_holding_experts_and_other_parameters():
    """ZeRO-2/3 shard an experts module over the edp group: a module holding both kinds of
    parameter would put the others on the wrong group, so it is refused by name."""
    from merak.data_parallel.zero import expert_units

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].weight.expert_parallel = True
    with pytest.raises(ValueError, match=r"0 holds expert tensors \(weight\) and others \(bias\)"):
        expert_units(model)
    model[0].bias.expert_parallel = True
    assert expert_units(model) == [model[0]]


def test_sequence_parallelism_runs_the_moe_blocks_whole_and_refuses_a_split_inside_one():
    """Qwen3-MoE's, Mixtral's, OLMoE's and DeepSeek-V3's transformers plans gather their
    attention's and MLP's input (GPT-OSS's plan is inferred: refused at build); an MLP holding
    the experts summed over TP runs whole, as does one TP leaves unsplit, and a layer inside one
    that would reduce-scatter the sequence is refused by name."""
    from merak.tensor_parallel.layers.sequence import enable_sequence_parallel, whole_modules
    from merak.tensor_parallel.plans.hf_styles import plan_fields_from_hf

    for config, family in ((tf.Qwen3MoeConfig, "qwen3_moe"), (tf.MixtralConfig, "mixtral"),
                           (tf.OlmoeConfig, "olmoe"), (tf.DeepseekV3Config, "deepseek_v3")):
        assert plan_fields_from_hf(config.base_model_tp_plan, family)["sp_gather"] == (
            "self_attn", "mlp"), family
    # (GPT-OSS's transformers plan splits nothing: its TP plan is inferred, with no sp_gather)
    assert plan_fields_from_hf(tf.GptOssConfig.base_model_tp_plan, "gpt_oss") is None

    def block() -> nn.Module:
        made = nn.Module()
        made.self_attn, made.mlp = nn.Linear(4, 4), nn.Module()
        made.mlp.experts, made.mlp.down = nn.Linear(4, 4), nn.Linear(4, 4)
        return made

    model, blocks = nn.Module(), ["layers.0", "layers.1"]
    model.layers = nn.ModuleList([block(), block()])
    whole = whole_modules(model, blocks, ("self_attn", "mlp"), {"layers.1.mlp.experts"})
    assert whole == ["layers.1.mlp"]
    # (DeepSeek-V3's attention: its plan splits nothing in it, so nothing would reduce-scatter)
    assert whole_modules(model, blocks, ("self_attn", "mlp"), {"layers.1.mlp.experts"},
                         {"layers.0.mlp.down", "layers.1.mlp.experts", "layers.1.self_attn"}
                         ) == ["layers.0.self_attn", "layers.1.mlp"]
    model.layers[1].mlp.down.sequence_parallel = True
    with pytest.raises(ValueError, match=r"runs layers.1.mlp whole .*\['layers.1.mlp.down'\]"):
        enable_sequence_parallel(model, blocks, ("self_attn", "mlp"), None, 1, tuple(whole))


def test_sequence_parallelism_without_an_entry_is_refused_naming_the_fix():
    """A transformers plan whose family has no SEQUENCE_PARALLEL entry (PhiMoE's) is refused
    before anything is split or any TP group used, naming the fix."""
    from merak.tensor_parallel.apply.convert import convert
    from merak.tensor_parallel.plans.hf_styles import plan_fields_from_hf
    from merak.tensor_parallel.plans.tp_plan import TPPlan

    plan = TPPlan(**plan_fields_from_hf(tf.PhimoeConfig.base_model_tp_plan, "phimoe"))
    model = nn.Sequential(nn.Linear(2, 2))
    ctx = SimpleNamespace(tp=2, tp_rank=0, tp_group=None)  # no group: none may be used
    with pytest.raises(ValueError, match=r"Sequential .*base_model_tp_plan.*SEQUENCE_PARALLEL "
                       r"of merak/tensor_parallel/plans/hf_styles.py.*sequence_parallel=False"):
        convert(model, ctx, plan, sequence_parallel=True)
    assert [type(m) for m in model.modules()] == [nn.Sequential, nn.Linear]  # untouched
