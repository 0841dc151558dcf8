"""Context parallelism (merak/context_parallel): cp=2 and cp=4, Ulysses and ring, on a tiny Llama
and Qwen2 (plus a Mistral's sliding window): loss and every gradient equal to the single-process
model in fp32 (pooled worker cp_parity.py, at world sizes 2 and 4); and in one process the
load-balanced split, its refusals, and the families whose attention cannot be wrapped."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from cp_parity import LAYOUT, NOT_COMPARED, RING_WINDOW, ULYSSES_HEADS, scenario_names
from dist_harness import assert_like_reference, scenario_result

import merak
from merak.context_parallel import rank_positions, shift_labels, split_batch, unsupported_reason

WORKER = "cp_parity.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4)
# the summed loss and every gradient, fp32: torch.testing.assert_close(ours, reference,
# rtol=RTOL, atol=ATOL)
RTOL, ATOL = 1e-5, 1e-5


@pytest.mark.parametrize("world_size,scenario", [(w, s) for w in WORLD_SIZES
                                                 for s in scenario_names(w)
                                                 if s not in NOT_COMPARED])
def test_context_parallel_trains_like_the_model(launches, world_size, scenario):
    figures = scenario_result(*launches(world_size), scenario)
    assert assert_like_reference(figures, rtol=RTOL, atol=ATOL, grad_atol_of_max=0.0) > 0
    for rank, ours in enumerate(figures):  # every layer's attention wrapped, in both steps
        assert ours["attention_calls"] == 2 * ours["layers"], f"rank {rank}: {ours}"


@pytest.mark.parametrize("world_size", [2])
def test_ring_attention_refuses_a_sliding_window_the_split_cuts(world_size, launches):
    for rank, ours in enumerate(scenario_result(*launches(world_size), RING_WINDOW)):
        refusal = ours["refusal"]
        assert refusal is not None, f"rank {rank}: ring attention ran a sliding window"
        assert "mistral" in refusal and "sliding-window" in refusal, f"rank {rank}: {refusal}"


@pytest.mark.parametrize("world_size", [4])
def test_ulysses_refuses_query_heads_cp_does_not_divide(world_size, launches):
    for rank, ours in enumerate(scenario_result(*launches(world_size), ULYSSES_HEADS)):
        refusal = ours["refusal"]
        assert refusal is not None, f"rank {rank}: Ulysses ran 6 query heads at cp=4"
        assert "llama" in refusal and "6 query heads" in refusal, f"rank {rank}: {refusal}"


@pytest.mark.parametrize("world_size", [4])
def test_the_pp_dp_cp_tp_rank_layout(world_size, launches):
    """tp innermost, then cp, dp, pp; cp ranks share their dp rank (the same rows) and
    gradients are reduced over dp x cp; with cp = 1 the (pp, dp, tp) layout as before."""
    for rank, seen in enumerate(scenario_result(*launches(world_size), LAYOUT)):
        assert seen["rank"] == rank
        dp_cp, tp_cp, dp_tp = seen["dp2cp2"], seen["tp2cp2"], seen["dp2tp2"]
        assert (dp_cp["dp_rank"], dp_cp["cp_rank"]) == divmod(rank, 2), dp_cp["describe"]
        assert dp_cp["cp_group"] == [rank - rank % 2, rank - rank % 2 + 1], dp_cp
        assert dp_cp["dp_group"] == [rank % 2, rank % 2 + 2], dp_cp
        assert dp_cp["replica_group"] == [0, 1, 2, 3] and dp_cp["replicas"] == 4, dp_cp
        assert dp_cp["rank_of_dp1_cp0"] == 2, dp_cp
        assert (tp_cp["cp_rank"], tp_cp["tp_rank"]) == divmod(rank, 2), tp_cp
        assert tp_cp["cp_group"] == [rank % 2, rank % 2 + 2], tp_cp
        assert tp_cp["replica_group"] == tp_cp["cp_group"] and "cp=" in tp_cp["describe"], tp_cp
        assert dp_tp["cp"] == 1 and dp_tp["cp_group_is_none"], dp_tp
        assert dp_tp["mesh_dims"] == ["pp", "dp", "tp"], dp_tp
        assert dp_tp["replica_group"] == dp_tp["dp_group"], dp_tp


def test_each_rank_holds_a_chunk_and_its_mirror():
    assert rank_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([rank_positions(24, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(24))


@pytest.mark.parametrize("cp", [2, 4])
def test_the_split_loses_no_target_and_positions_follow_tokens(cp):
    ids = torch.arange(2 * 16).reshape(2, 16)
    labels = ids.clone()
    labels[0, 3] = -100
    shares = [split_batch({"input_ids": ids, "labels": labels,
                           "attention_mask": torch.ones_like(ids)}, cp, r) for r in range(cp)]
    shifted = shift_labels(labels)
    for rank, share in enumerate(shares):
        positions = rank_positions(16, cp, rank)
        assert torch.equal(share["position_ids"][0], positions)
        assert torch.equal(share["input_ids"], ids[:, positions])
        assert torch.equal(share["labels"], shifted[:, positions])
        assert torch.equal(share["shift_labels"], share["labels"])
    # every token's target (the next token), on whichever rank holds the token
    targets = sum(int(s["labels"].ne(-100).sum()) for s in shares)
    assert targets == int(labels[:, 1:].ne(-100).sum())


def test_a_length_not_divisible_by_2cp_is_refused():
    with pytest.raises(ValueError, match="not divisible by 8"):
        split_batch({"input_ids": torch.zeros(1, 20, dtype=torch.long)}, 4, 0)


def test_padding_and_packing_are_refused():
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with pytest.raises(ValueError, match="refuses padding"):
        split_batch({"input_ids": ids, "attention_mask": mask}, 2, 0)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)
    with pytest.raises(ValueError, match="packed or padding-free"):
        split_batch({"input_ids": ids, "position_ids": packed}, 2, 0)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        split_batch({"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 8])}, 2, 0)


@pytest.mark.parametrize("model_type,reason", [
    ("bloom", "in its own code"),           # ALiBi, its own attention
    ("falcon", "in its own code"),
    ("mamba", "linear_attention layers"),   # a state-space mixer
    ("jamba", "linear_attention layers"),   # hybrid: mamba layers beside attention
])
def test_families_whose_attention_cannot_be_wrapped_are_named(model_type, reason):
    config = tf.AutoConfig.for_model(model_type)
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(config, name):
            setattr(config, name, 2)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(config)
    message = unsupported_reason(model, "ring")
    assert message is not None and model_type in message and reason in message, message


def test_llama_and_qwen2_can_be_wrapped():
    for config in (tf.LlamaConfig(num_hidden_layers=1), tf.Qwen2Config(num_hidden_layers=1)):
        with merak.init_empty_weights():
            model = tf.AutoModelForCausalLM.from_config(config)
        assert unsupported_reason(model, "ulysses") is None


# -- the planner (merak/strategy) ---------------------------------------------------------------
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)


def test_the_planner_searches_cp_where_ranks_sequence_and_heads_allow():
    from merak.strategy.search import candidates, context_parallel_degrees
    from merak.strategy.shape import ModelShape

    assert context_parallel_degrees(8, 131072) == (1, 2, 4, 8)
    assert context_parallel_degrees(8, 12) == (1, 2)  # 12 tokens: 2 x cp must divide them
    shape = ModelShape.from_config(tf.LlamaConfig(**LLAMA3_8B))
    found = list(candidates(shape, 8, 8, 4096, (1,), schedules=("1f1b",),
                            context_parallel=(1, 2, 4, 8)))
    assert {c.cp for c in found} == {1, 2, 4, 8}
    assert all(c.dp * c.tp * c.pp * c.cp == 8 for c in found)
    # Ulysses only where cp divides a TP rank's 8 key/value heads / tp
    assert all(c.cp_mode == "ring" or (8 // c.tp) % c.cp == 0 for c in found)
    assert any(c.cp_mode == "ulysses" for c in found)
    # ZeRO shards over dp x cp: a cp-only layout may use it
    assert any(c.dp == 1 and c.cp == 8 and c.zero == 3 for c in found)


def test_the_cost_model_divides_activations_and_adds_the_cp_exchange():
    from merak.strategy.candidate import Candidate
    from merak.strategy.cluster import cluster
    from merak.strategy.costs import analytic_costs
    from merak.strategy.predict import Predictor
    from merak.strategy.shape import ModelShape

    shape = ModelShape.from_config(tf.LlamaConfig(**LLAMA3_8B))
    where = cluster("h100", 8)
    predictor = Predictor(shape, {1: analytic_costs(shape, where, 1, 32768)}, where)
    base = Candidate(8, 1, 1, 1, 8, "1f1b", "full", 3)
    split = Candidate(4, 1, 1, 1, 16, "1f1b", "full", 3, cp=2)
    one, two = predictor.predict(base), predictor.predict(split)
    # per micro-batch: half the activations (one micro-batch in flight at pp 1)
    assert two.activation_bytes[0] == pytest.approx(one.activation_bytes[0] / 2, rel=0.01)
    assert two.state_bytes == pytest.approx(one.state_bytes)  # ZeRO-3 over dp x cp = 8 still
    forward, backward = predictor.context_parallel_s(split, predictor._rank_cost(
        split, predictor.costs[1]))
    assert 0 < forward < backward
    ulysses = Candidate(4, 1, 1, 1, 16, "1f1b", "full", 3, cp=2, cp_mode="ulysses")
    assert 0 < predictor.predict(ulysses).step_s < float("inf") and "cp2:ulysses" in ulysses.label


def test_merak_plan_fits_llama3_8b_at_128k_tokens_on_8_h100_with_cp(tmp_path, capsys):
    from merak.cli import main as merak_main
    from merak.strategy.cluster import cluster
    from merak.strategy.search import read_strategy_plan

    config_dir = tmp_path / "llama3-8b"
    tf.LlamaConfig(**LLAMA3_8B).save_pretrained(config_dir)
    out = tmp_path / "plan.json"
    assert merak_main(["plan", "--model", str(config_dir), "--cluster", "h100", "--gpus", "8",
                       "--global-batch", "8", "--seq-len", "131072", "--parallel-vocab",
                       "--micro-batch-sizes", "1", "--out", str(out)]) == 0
    chosen = read_strategy_plan(out)[0]
    assert chosen.cp > 1 and chosen.dp * chosen.tp * chosen.pp * chosen.cp == 8
    best = json.loads(out.read_text())["ranked"][0]
    assert best["peak_bytes"] <= cluster("h100").memory_bytes
    assert "chosen:" in capsys.readouterr().out
