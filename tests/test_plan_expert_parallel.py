"""The strategy search with expert parallelism (merak.strategy, one process): an MoE model's
sizes, the ep degrees it searches, what ep changes in a prediction, and `merak plan` printing
ep for a published MoE configuration."""

from __future__ import annotations

import json

import pytest
import transformers as tf

from merak.cli import main as merak_main
from merak.rules import Choices, refusal
from merak.strategy.candidate import Candidate
from merak.strategy.cluster import cluster
from merak.strategy.costs import analytic_costs, state_bytes
from merak.strategy.predict import Predictor
from merak.strategy.search import candidates, read_strategy_plan
from merak.strategy.shape import ModelShape

# Qwen3-30B-A3B's published configuration
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, tie_word_embeddings=False)
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2)


@pytest.mark.parametrize("config", [
    tf.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=8, moe_intermediate_size=32),
    tf.MixtralConfig(**TINY, intermediate_size=48, num_local_experts=4)])
def test_an_moe_shape_counts_the_hf_models_parameters_and_its_experts(config):
    model = tf.AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.expert_params * shape.layers == experts
    norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("q_norm.weight",
                                                                           "k_norm.weight")))
    assert shape.params + norms == sum(p.numel() for p in model.parameters())


def test_qwen3_30b_a3b_has_its_published_sizes():
    shape = ModelShape.from_config(tf.Qwen3MoeConfig(**QWEN3_30B_A3B))
    assert 30.4e9 < shape.params < 30.6e9  # "30.5B in total"
    active = shape.params - shape.layers * shape.expert_params * (1 - 8 / 128)
    assert 3.2e9 < active < 3.4e9  # "3.3B activated"


def test_ep_degrees_divide_the_replicas_and_the_experts():
    moe = ModelShape.from_config(tf.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=8,
                                                   moe_intermediate_size=32))
    dense = ModelShape.from_config(tf.LlamaConfig(**{k: v for k, v in TINY.items()
                                                     if k != "num_experts_per_tok"}))
    found = list(candidates(moe, 8, 16, 128))
    assert {c.ep for c in found} == {1, 2, 4, 8}
    for c in found:
        assert (c.dp * c.cp) % c.ep == 0 and 8 % c.ep == 0
        if c.ep > 1:  # what the rules refuse with ep, the planner does not propose
            assert refusal(Choices().with_candidate(c)) is None
    assert any(c.ep > 1 and c.tp > 1 for c in found)  # tp and ep compose
    assert any(c.ep > 1 and c.tp > 1 and c.sequence_parallel for c in found)  # with sp too
    assert all({c.ep for c in found if c.zero == z} > {1} for z in (1, 2, 3))  # ZeRO too
    assert {c.ep for c in candidates(dense, 8, 16, 128)} == {1}
    assert {c.ep for c in candidates(moe, 8, 16, 128, expert_parallel=(1,))} == {1}
    assert refusal(Choices().with_candidate(Candidate(4, 1, 2, 1, 4, zero=2, ep=2))) is None
    # the trainer's automatic plan (a job whose layout is planned) may choose ep > 1
    assert refusal(Choices(planned=True).with_candidate(Candidate(4, 1, 2, 1, 4, ep=2))) is None


def test_ep_divides_the_expert_memory_and_adds_the_token_exchange():
    shape = ModelShape.from_config(tf.Qwen3MoeConfig(**QWEN3_30B_A3B))
    h100 = cluster("h100", 8)
    costs = {1: analytic_costs(shape, h100, 1, 4096)}
    predictor = Predictor(shape, costs, h100, memory_bytes=10**15)
    by_ep = {ep: predictor.predict(Candidate(8, 1, 1, 1, 4, ep=ep)) for ep in (1, 2, 8)}
    outside = 16 * (shape.params - shape.layers * shape.expert_params)  # weights, grads, Adam
    experts = 16 * shape.layers * shape.expert_params
    for ep, p in by_ep.items():
        assert p.fits, p.error
        assert p.state_bytes[0] == pytest.approx(outside + experts / ep)
    # at tp2 each rank holds 1/tp of its experts too (the plan splits their intermediate dim)
    by_tp = {ep: predictor.predict(Candidate(4, 2, 1, 1, 4, ep=ep)) for ep in (1, 2)}
    assert by_tp[1].state_bytes[0] - by_tp[2].state_bytes[0] == pytest.approx(experts / 2 / 2)
    # ZeRO-1: each part's Adam state over its own replicas (8, and 8 / ep for the experts)
    zero1 = predictor.predict(Candidate(8, 1, 1, 1, 4, zero=1, ep=2))
    assert zero1.state_bytes[0] == pytest.approx((8 + 8 / 8) * outside / 16
                                                 + (8 + 8 / 4) * experts / 2 / 16)
    # ZeRO-3: every state sharded over its own replicas (8, and 8 / ep for the experts), plus
    # the largest block's gathered weights and gradients; its gathers add time over ZeRO-1
    candidate = Candidate(8, 1, 1, 1, 4, zero=3, ep=2)
    zero3, largest = predictor.predict(candidate), predictor._block_params(candidate)
    assert zero3.state_bytes[0] == pytest.approx(
        state_bytes(outside / 16, 3, 8, largest) + state_bytes(experts / 2 / 16, 3, 4, largest))
    assert zero3.state_bytes[0] < zero1.state_bytes[0] and zero3.step_s > zero1.step_s
    # the same compute, plus the all-to-alls' time, which grows with the share sent away
    assert by_ep[1].pipeline_s < by_ep[2].pipeline_s < by_ep[8].pipeline_s
    uneven = Predictor(shape, costs, h100, memory_bytes=10**15, imbalance=1.5)
    assert uneven.predict(Candidate(8, 1, 1, 1, 4, ep=2)).step_s > by_ep[2].step_s
    assert uneven.predict(Candidate(8, 1, 1, 1, 4)).step_s == by_ep[1].step_s


def test_offline_plan_for_an_moe_prints_and_writes_ep(tmp_path, capsys):
    config_dir = tmp_path / "qwen3-moe"  # Qwen3-30B-A3B's block, 8 of them (a 5 B model)
    tf.Qwen3MoeConfig(**{**QWEN3_30B_A3B, "num_hidden_layers": 8}).save_pretrained(config_dir)
    out = tmp_path / "plan.json"
    args = ["plan", "--model", str(config_dir), "--cluster", "h100", "--world-size", "4",
            "--global-batch", "8", "--seq-len", "4096", "--micro-batch-sizes", "1",
            "--top", "60", "--out", str(out)]
    assert merak_main(args) == 0
    printed = capsys.readouterr().out
    assert "128 experts" in printed and "8 per token" in printed
    assert any(f" ep{ep} " in printed for ep in (2, 4))
    data = json.loads(out.read_text())
    assert max(row["ep"] for row in data["ranked"]) > 1
    chosen = read_strategy_plan(out)[0]
    assert (chosen.dp * chosen.cp) % chosen.ep == 0
    assert merak_main([*args[:-2], "--out", str(out), "--no-expert-parallel"]) == 0
    assert read_strategy_plan(out)[0].ep == 1
    assert " ep2 " not in capsys.readouterr().out


def test_auto_parallel_keeps_the_ep_merak_init_gave():
    """`MerakArguments(auto_parallel=True)` after ``merak.init(ep=2)`` searches ep2 only (every
    degree that divides after ``merak.init()``); a dense model with ep > 1 is refused by name
    before the planner measures anything."""
    from types import SimpleNamespace

    from merak.trainer.auto_plan import expert_parallel_degrees

    moe = tf.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=8, moe_intermediate_size=32)
    assert expert_parallel_degrees(moe, SimpleNamespace(ep=1)) is None
    assert expert_parallel_degrees(moe, SimpleNamespace(ep=2)) == (2,)
    shape = ModelShape.from_config(moe)
    searched = {c.ep for c in candidates(shape, 4, 8, 16, micro_batch_sizes=(2,),
                                         expert_parallel=(2,))}
    assert searched == {2}
    dense = tf.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"merak.init\(ep=2\) with auto_parallel: .*"
                                         r"LlamaConfig\) names no experts"):
        expert_parallel_degrees(dense, SimpleNamespace(ep=2))
