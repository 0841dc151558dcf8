"""The strategy search (merak.strategy) in one process: model sizes, the candidates it
enumerates, its memory and time predictions' directions, its errors, and offline planning
through `merak plan --cluster` for published configurations."""

from __future__ import annotations

import json

import pytest
import transformers as tf

from merak.cli import main as merak_main
from merak.rules import Choices
from merak.schedule.registry import SCHEDULES
from merak.strategy.candidate import Candidate
from merak.strategy.cluster import GIB, Cluster, cluster
from merak.strategy.costs import analytic_costs, state_bytes
from merak.strategy.predict import Predictor
from merak.strategy.search import candidates, layouts, read_strategy_plan, search
from merak.strategy.shape import ModelShape

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)


def tiny_llama(**extra) -> tf.LlamaConfig:
    return tf.LlamaConfig(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=160,
                                    num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2), **extra})


@pytest.mark.parametrize("config", [tiny_llama(), tiny_llama(tie_word_embeddings=True),
                                    tf.MistralConfig(vocab_size=300, hidden_size=96,
                                                     intermediate_size=200, num_hidden_layers=3,
                                                     num_attention_heads=6,
                                                     num_key_value_heads=3)])
def test_shape_counts_every_parameter_of_the_hf_model(config):
    model = tf.AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_config(config).params == sum(p.numel() for p in model.parameters())


def test_llama3_8b_has_its_published_size():
    assert ModelShape.from_config(tf.LlamaConfig(**LLAMA3_8B)).params == 8_030_261_248


def test_candidates_respect_the_sizes():
    shape = ModelShape.from_config(tiny_llama())  # 4 heads, 2 kv heads, 4 blocks
    assert sorted(layouts(shape, 8)) == sorted([(8, 1, 1), (4, 1, 2), (2, 1, 4), (4, 2, 1),
                                                (2, 2, 2), (1, 2, 4)])
    found = list(candidates(shape, 8, 16, 128))
    assert found
    for c in found:
        assert c.dp * c.tp * c.pp == 8 and c.dp * c.micro_batch * c.microbatches == 16
        assert not c.sequence_parallel or c.tp > 1
        assert c.zero == 0 or c.dp > 1
        assert c.zero < 2 or not SCHEDULES[c.schedule].splits_backward  # as MerakArguments
        assert c.recompute != "off" or not SCHEDULES[c.schedule].needs_recompute
        assert c.pp > 1 or c.schedule == "1f1b"
        assert c.chunks == (2 if SCHEDULES[c.schedule].several_stages_per_rank else 1)
    assert {c.schedule for c in found} == set(SCHEDULES)
    # sequence parallelism: a twin of every tp > 1 candidate, where tp divides the sequence
    split = [c for c in found if c.sequence_parallel]
    assert {Candidate(**{**c.__dict__, "sequence_parallel": False}) for c in split} == \
        {c for c in found if c.tp > 1 and not c.sequence_parallel}
    assert not any(c.sequence_parallel for c in candidates(shape, 8, 16, 127))
    assert not any(c.sequence_parallel for c in candidates(shape, 8, 16, 128,
                                                           sequence_parallel=(False,)))


def test_predictions_move_the_right_way():
    shape = ModelShape.from_config(tf.LlamaConfig(**LLAMA3_8B))
    h100 = cluster("h100")
    costs = {m: analytic_costs(shape, h100, m, 4096) for m in (1, 2)}
    predict = Predictor(shape, costs, h100, memory_bytes=10**15).predict
    base = Candidate(dp=2, tp=2, pp=2, micro_batch=1, microbatches=16, schedule="1f1b")
    off, full = predict(base), predict(Candidate(**{**base.__dict__, "recompute": "full"}))
    assert full.peak_bytes < off.peak_bytes and full.step_s > off.step_s  # memory for time
    gpipe = predict(Candidate(**{**base.__dict__, "schedule": "ds_default"}))
    assert gpipe.activation_bytes[0] > off.activation_bytes[0]  # all 16 in flight, not 2
    zeros = [predict(Candidate(**{**base.__dict__, "zero": z})).state_bytes[0] for z in range(4)]
    assert zeros[1] < zeros[0] and zeros[3] < zeros[2]
    assert state_bytes(1000, 0, 4, 10) == 16000 and state_bytes(1000, 1, 4, 10) == 10000
    wider = predict(Candidate(**{**base.__dict__, "micro_batch": 2, "microbatches": 8}))
    assert wider.activation_bytes[1] > off.activation_bytes[1]


def test_sequence_parallelism_splits_the_rest_of_a_blocks_activations():
    shape = ModelShape.from_config(tf.LlamaConfig(**LLAMA3_8B))
    h100 = cluster("h100")
    costs = {1: analytic_costs(shape, h100, 1, 8192)}
    predict = Predictor(shape, costs, h100, memory_bytes=10**15).predict
    base = Candidate(dp=1, tp=4, pp=2, micro_batch=1, microbatches=8)
    whole, split = predict(base), predict(Candidate(**{**base.__dict__,
                                                       "sequence_parallel": True}))
    assert split.state_bytes == whole.state_bytes  # the same weights
    # per block 10 + 24 w / tp becomes (10 + 24 w) / tp (w: the MLP's width factor)
    w = shape.intermediate / (4 * shape.hidden) * 1.5
    expected = (10 + (8 + 16 * w)) / 4 / (10 + (8 + 16 * w) / 4)
    assert shape.block_activation_bytes(1, 8192, 4, 2, True) / \
        shape.block_activation_bytes(1, 8192, 4, 2) == pytest.approx(expected)
    assert split.activation_bytes[0] < 0.8 * whole.activation_bytes[0]
    # a recomputed block keeps its input's sequence shard only
    full = [predict(Candidate(**{**base.__dict__, "recompute": "full",
                                 "sequence_parallel": sp})).activation_bytes[0]
            for sp in (False, True)]
    assert full[1] < 0.6 * full[0]
    assert "tp4+sp" in split.candidate.label


def test_sequence_parallelism_is_searched_only_where_the_job_can_split_the_sequence(tmp_path):
    from merak import MerakArguments
    from merak.strategy.search import sequence_parallel_choices
    from merak.trainer.auto_plan import sequence_parallel_settings

    assert sequence_parallel_choices(tiny_llama()) == (False, True)
    gpt2 = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4)
    assert sequence_parallel_choices(gpt2) == (False,)  # its TP plan names no sp_gather
    assert sequence_parallel_choices(tiny_llama(), {"col_para_list": ["mlp.up_proj"],
                                                    "row_para_list": ["mlp.down_proj"]}) \
        == (False,)
    args = MerakArguments(output_dir=str(tmp_path), auto_parallel=True)
    assert sequence_parallel_settings(args, tiny_llama(), None) == (False, True)
    shape = ModelShape.from_config(tiny_llama())
    small = Cluster(world_size=4, gpus_per_node=4, peak_flops=1e12, memory_bytes=GIB,
                    intra_bw=1e10, inter_bw=1e9)
    costs = {1: analytic_costs(shape, small, 1, 64)}
    plan = search(shape, costs, small, 8, 64, sequence_parallel=(False,))
    assert not any(p.candidate.sequence_parallel for p in plan.ranked + plan.dropped)
    plan = search(shape, costs, small, 8, 64)
    assert any(p.candidate.sequence_parallel for p in plan.ranked)
    # a LoRA job: merak.rules refuses sequence parallelism with adapters, so the search never
    # proposes it (the same rule MerakArguments applies)
    lora_job = Choices.from_arguments(MerakArguments(output_dir=str(tmp_path),
                                                     lora_config=_lora_file(tmp_path)))
    plan = search(shape, costs, small, 8, 64, job=lora_job)
    assert plan.ranked and not any(p.candidate.sequence_parallel
                                   for p in plan.ranked + plan.dropped)


def _lora_file(tmp_path) -> str:
    path = tmp_path / "lora.json"
    path.write_text(json.dumps({"r": 4, "target_modules": ["q_proj", "v_proj"]}))
    return str(path)


def test_the_planner_proposes_nothing_the_arguments_refuse(tmp_path):
    """One rule set: every candidate the search keeps for a job, set on that job's arguments,
    makes MerakArguments that build; the combinations it leaves out are refused by them."""
    from merak import MerakArguments


    shape = ModelShape.from_config(tiny_llama())
    for extra in ({}, {"lora_config": _lora_file(tmp_path)}, {"torch_compile": True},
                  {"auto_find_batch_size": True}, {"prescale_gradients": True}):
        job = Choices.from_arguments(MerakArguments(output_dir=str(tmp_path), **extra))
        kept = list(candidates(shape, 4, 8, 64, job=job))
        everything = list(candidates(shape, 4, 8, 64, job=Choices()))
        assert kept
        for c in everything:
            fields = dict(train_schedule=c.schedule, zero_stage=c.zero,
                          activation_checkpointing=c.recompute != "off",
                          sequence_parallel=c.sequence_parallel, **extra)
            if SCHEDULES[c.schedule].several_stages_per_rank:
                fields["num_model_chunks"] = c.chunks
            try:
                MerakArguments(output_dir=str(tmp_path), **fields)
                built = True
            except ValueError as error:  # NotSupportedYetError is one
                built, why = False, str(error)
            assert built == (c in kept), (c.label, extra, None if built else why)


def test_dry_runs_sample_the_layouts_predicted_near_the_best_first():
    from merak.dryrun.online import _distinct

    shape = ModelShape.from_config(tiny_llama())
    small = Cluster(world_size=4, gpus_per_node=4, peak_flops=1e12, memory_bytes=GIB,
                    intra_bw=1e10, inter_bw=1e9)
    costs = {m: analytic_costs(shape, small, m, 64) for m in (1, 2)}
    ranked = search(shape, costs, small, 8, 64).ranked

    def layout(p):
        return p.candidate.dp, p.candidate.tp, p.candidate.pp, p.candidate.sequence_parallel

    near = {layout(p) for p in ranked if p.step_s <= 1.5 * ranked[0].step_s}
    picked = _distinct(ranked, 5)
    assert picked[0] is ranked[0] and len(picked) == 5 and len(set(map(id, picked))) == 5
    assert {layout(p) for p in picked[:len(near)]} == near if len(near) <= 5 else \
        len({layout(p) for p in picked}) == 5
    # each layout's first pick is its best predicted candidate
    for p in picked[:min(len(near), 5)]:
        assert p is next(q for q in ranked if layout(q) == layout(p))
    # then each layout's best at each other micro-batch size predicted near the best
    def sized(p):
        return (*layout(p), p.candidate.micro_batch)

    firsts = list(dict.fromkeys(sized(p) for p in ranked if p.step_s <= 1.5 * ranked[0].step_s))
    assert len(firsts) > len(near)  # the check below has something to check
    many = [sized(p) for p in _distinct(ranked, len(firsts))]
    assert many == many[:len(near)] + [k for k in firsts if k not in many[:len(near)]]
    assert _distinct(ranked[:2], 5) == ranked[:2] and _distinct([], 3) == []


def test_the_vocabulary_and_the_optimizer_step_are_where_merak_puts_them():
    shape = ModelShape.from_config(tiny_llama())
    small = Cluster(world_size=2, gpus_per_node=2, peak_flops=1e12, memory_bytes=GIB,
                    intra_bw=1e10, inter_bw=1e9, memory_bw=1e9)
    costs = {1: analytic_costs(shape, small, 1, 64)}
    tp2 = Candidate(dp=1, tp=2, pp=1, micro_batch=1, microbatches=4)
    # without parallel_vocab each TP rank holds the embedding and head whole (as merak builds)
    whole = Predictor(shape, costs, small).predict(tp2).state_bytes[0]
    split = Predictor(shape, costs, small, parallel_vocab=True).predict(tp2).state_bytes[0]
    vocab = shape.embedding_params + shape.head_params - shape.hidden  # less the final norm
    assert whole == pytest.approx(16 * (shape.layers * shape.block_params / 2 + vocab
                                        + shape.hidden))
    assert whole - split == pytest.approx(16 * vocab / 2)
    # AdamW streams 28 bytes per parameter; ZeRO-1 steps a 1/dp share
    assert costs[1].optimizer_s_per_param == pytest.approx(28 / 1e9)
    dp2 = Candidate(dp=2, tp=1, pp=1, micro_batch=1, microbatches=2)
    predict = Predictor(shape, costs, small).predict
    zero0, zero1 = predict(dp2), predict(Candidate(**{**dp2.__dict__, "zero": 1}))
    step = costs[1].optimizer_s_per_param * shape.params
    assert zero0.tail_s >= step and zero1.tail_s < zero0.tail_s


def test_errors_name_the_problem():
    shape = ModelShape.from_config(tiny_llama())
    small = Cluster(world_size=4, gpus_per_node=4, peak_flops=1e12, memory_bytes=GIB,
                    intra_bw=1e10, inter_bw=1e9)
    costs = {m: analytic_costs(shape, small, m, 64) for m in (1, 2)}
    with pytest.raises(ValueError, match="least memory found is .* GiB \\(dp"):
        search(shape, costs, small, 8, 64, memory_bytes=1024)
    with pytest.raises(ValueError, match="divides no dp degree"):
        search(shape, costs, Cluster(**{**small.__dict__, "world_size": 7}), 6, 64)
    with pytest.raises(ValueError, match="memory limit must be positive"):
        search(shape, costs, small, 8, 64, memory_bytes=-1)
    with pytest.raises(ValueError, match="unknown cluster"):
        cluster("tpu-v9")
    with pytest.raises(ValueError, match="peak_flops must be a finite number > 0"):
        Cluster(world_size=4, gpus_per_node=4, peak_flops=0, memory_bytes=GIB, intra_bw=1,
                inter_bw=1)


def test_a_memory_limit_moves_the_choice_to_less_memory():
    shape = ModelShape.from_config(tf.LlamaConfig(**LLAMA3_8B))
    h100 = cluster("h100")
    costs = {m: analytic_costs(shape, h100, m, 8192) for m in (1, 2)}
    roomy = search(shape, costs, h100, 16, 8192)
    tight = search(shape, costs, h100, 16, 8192, memory_bytes=40 * GIB)
    assert roomy.ranked[0].peak_bytes <= h100.memory_bytes
    assert tight.ranked[0].peak_bytes <= 40 * GIB < roomy.ranked[0].peak_bytes
    assert all(p.peak_bytes <= 40 * GIB for p in tight.ranked)
    assert tight.dropped and all(p.error for p in tight.dropped)


def test_offline_plan_command_for_llama3_8b_on_8_h100(tmp_path, capsys):
    config_dir = tmp_path / "llama3-8b"
    tf.LlamaConfig(**LLAMA3_8B).save_pretrained(config_dir)
    out = tmp_path / "plan.json"
    assert merak_main(["plan", "--model", str(config_dir), "--cluster", "h100",
                       "--world-size", "8", "--global-batch", "32", "--seq-len", "8192",
                       "--micro-batch-sizes", "1,2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chosen:" in printed and "<==" in printed
    chosen = read_strategy_plan(out)[0]
    assert chosen.dp * chosen.tp * chosen.pp * chosen.cp == 8
    data = json.loads(out.read_text())
    assert data["ranked"][0]["peak_bytes"] <= cluster("h100").memory_bytes
    assert data["ranked"][0]["mfu"] > 0.2


def test_plan_json_round_trips_into_init_degrees(tmp_path):
    from merak.strategy.init import degrees_from_plan

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"chosen": Candidate(2, 1, 2, 1, 4).__dict__,
                                "chosen_ratios": [0.0, 0.0]}))
    assert degrees_from_plan(path) == (2, 1, 2, 1, 1)
    path.write_text(json.dumps({"chosen": None}))
    with pytest.raises(ValueError, match="no chosen plan"):
        degrees_from_plan(path)


def test_merak_arguments_of_the_planner_refuse_what_they_cannot_do(tmp_path):
    from merak import MerakArguments

    def bad(match: str, **fields):
        with pytest.raises(ValueError, match=match):
            MerakArguments(output_dir=str(tmp_path), **fields)

    bad("not both", auto_parallel=True, plan="plan.json")
    bad("train_schedule is chosen by the plan", auto_parallel=True, train_schedule="zero_bubble")
    bad("zero_stage is chosen by the plan", plan="plan.json", zero_stage=1)
    bad("activation_checkpointing is chosen", auto_parallel=True, activation_checkpointing=True)
    bad("sequence_parallel is chosen by the plan", auto_parallel=True, sequence_parallel=True)
    bad("plan_memory_gib only applies with auto_parallel", plan_memory_gib=2.0)
    bad("plan_dry_runs only applies", plan_dry_runs=5)
    bad("plan_dry_runs=0: .* must be an integer >= 1", auto_parallel=True, plan_dry_runs=0)
    args = MerakArguments(output_dir=str(tmp_path), auto_parallel=True, plan_dry_runs=2,
                          plan_memory_gib=1.5)
    assert args.auto_parallel and args.plan_dry_runs == 2


def test_a_plan_file_sets_the_trainer_arguments(tmp_path):
    from merak import MerakArguments
    from merak.trainer.auto_plan import _set_arguments

    args = MerakArguments(output_dir=str(tmp_path), plan="plan.json")
    _set_arguments(args, Candidate(1, 1, 2, 2, 8, "interleaved_1f1b", "budget", 0, 2),
                   [0.5, 0.25, 0.0, 0.0])
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 8)
    assert (args.train_schedule, args.num_model_chunks, args.zero_stage) == \
        ("interleaved_1f1b", 2, 0)
    assert args.activation_checkpointing and args.activation_checkpoint_ratio == \
        [0.5, 0.25, 0.0, 0.0]
    assert not args.sequence_parallel
    _set_arguments(args, Candidate(1, 2, 2, 2, 8, "1f1b", sequence_parallel=True), None)
    assert args.sequence_parallel and not args.activation_checkpointing
