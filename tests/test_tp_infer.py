"""Tensor-parallel plans inferred from the traced blocks: what inference finds for
the families that have neither a hand plan nor a base_model_tp_plan, the plan printed as a
copyable TPPlan (`merak tp-plan`), and, on ranks, the same families trained through
MerakTrainer at dp1 x tp2 x pp1 and dp2 x tp2 x pp2 against single-process HF Trainer
(workers/tp_infer_trainer.py; all eight at both layouts with MERAK_TEST_MATRIX=full); their
sharded steps against the single-process model and the refusal of planted wrong plans are
tp_parity.py's (test_tensor_parallel)."""

from __future__ import annotations

import json

import pytest
from dist_harness import check
from tp_infer_trainer import FAMILIES, LAYOUTS, run_name
from tp_models import INFERRED, TP_FAMILIES, inferred_family

import merak
from merak.cli import main
from merak.coverage.trainer_check import reference, save_small
from merak.tensor_parallel.apply.choice import plan_for
from merak.tensor_parallel.apply.infer import format_plan, infer_plan
from merak.tensor_parallel.plans.tp_plan import FAMILY_PLANS, TPPlan

WORKER = "tp_infer_trainer.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = tuple(LAYOUTS)


def _inferred(name: str, tp: int = 2) -> TPPlan:
    with merak.init_empty_weights():
        model = inferred_family(name)()
    return infer_plan(model, tp)


def _rel(patterns) -> set[str]:
    return {p.split(".*.", 1)[-1] for p in patterns}


def test_every_family_of_the_issue_gets_an_inferred_plan():
    for name in INFERRED:
        with merak.init_empty_weights():
            model = inferred_family(name)()
        plan = plan_for(model)
        assert plan.source == "inferred" and plan.check, name
        assert plan.column and plan.row, name


def test_what_inference_finds_in_the_blocks():
    """Heads and activations place the columns and rows; fused parts, ALiBi inputs, head
    counts, per-head norms are found from the graph; MQA attention stays replicated."""
    mpt = _inferred("mpt")
    assert _rel(mpt.column) == {"attn.Wqkv", "ffn.up_proj"}
    assert _rel(mpt.row) == {"attn.out_proj", "ffn.down_proj"}
    assert mpt.fused == {"transformer.blocks.*.attn.Wqkv": (64, 64, 64)}  # chunk(3): q, k, v
    assert mpt.split_inputs == {"transformer.blocks.*": (("['position_bias']", 0, 4),)}
    assert mpt.divide == {"transformer.blocks.*.attn": ("n_heads",)}
    bloom = _inferred("bloom")  # (b, s, heads, 3, d): a plain split keeps whole heads
    assert not bloom.fused and bloom.split_inputs == {"transformer.h.*": (("['alibi']", 0, 4),)}
    stablelm = _inferred("stablelm")  # grouped K/V heads: both counts divided
    assert stablelm.divide == {"model.layers.*.self_attn": ("num_heads",
                                                            "num_key_value_heads")}
    persimmon = _inferred("persimmon")  # per-head norms see this rank's heads
    assert _rel(persimmon.partial_grad) == {"self_attn.q_layernorm", "self_attn.k_layernorm"}
    openai = _inferred("openai-gpt")  # Conv1D q/k/v split by split_size
    assert openai.fused == {"transformer.h.*.attn.c_attn": (64, 64, 64)}
    assert openai.divide == {"transformer.h.*.attn": ("n_head", "split_size")}
    bigcode = _inferred("gpt_bigcode")  # one K/V head: the attention stays whole
    assert _rel(bigcode.column) == {"mlp.c_fc"} and _rel(bigcode.row) == {"mlp.c_proj"}
    assert any("attn.c_attn stays replicated" in note for note in bigcode.notes)


def test_inference_finds_the_hand_written_gpt2_plan():
    with merak.init_empty_weights():
        model = TP_FAMILIES["gpt2"]()
    plan, hand = infer_plan(model, 2), FAMILY_PLANS["gpt2"]
    assert _rel(plan.column) == set(hand.column) and _rel(plan.row) == set(hand.row)
    assert plan.fused["transformer.h.*.attn.c_attn"] == hand.fused["attn.c_attn"](model.config)
    assert plan.divide == {"transformer.h.*.attn": hand.divide["attn"]}


def test_the_printed_plan_is_the_plan(capsys):
    """`merak tp-plan` prints a TPPlan expression that evaluates to the inferred plan."""
    plan = _inferred("bloom", tp=2)
    text = format_plan(plan)
    copied = eval(text, {"TPPlan": TPPlan})  # noqa: S307 - the printed plan, as a user copies it
    assert copied == TPPlan(**{**vars(plan), "notes": ()})
    assert main(["tp-plan", "bloom"]) == 0
    out = capsys.readouterr().out
    assert "inferred from the blocks" in out and "split_inputs=" in out
    assert main(["tp-plan", "llama"]) == 0
    assert "Merak's hand-written plan" in capsys.readouterr().out


def test_a_family_inference_cannot_place_is_refused_with_the_reasons():
    import transformers as tf

    from merak.coverage.shrink import small_config

    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(small_config("mamba"))
    with pytest.raises(ValueError, match="placed no layer of mamba.*in_proj stays replicated"
                                         ".*set_tp_layer_lists"):
        plan_for(model)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """HF Trainer's losses on one process, per family and dp, from the same checkpoint."""
    root = tmp_path_factory.mktemp("inferred-reference")
    found = {}
    for family in INFERRED:
        hub = save_small(family, str(root / family))
        for dp in sorted({LAYOUTS[w][0] for w in WORLD_SIZES if family in FAMILIES[w]}):
            found[family, dp] = reference(family, str(root / f"{family}-{dp}"), dp, hub)
    return found


@pytest.mark.parametrize("world_size,family",
                         [(w, f) for w in WORLD_SIZES for f in FAMILIES[w]])
def test_merak_trainer_matches_hf_trainer(launches, worker_pool, references, world_size, family):
    layout = LAYOUTS[world_size]
    results, output = launches(world_size)
    check(results, output, run_name(family, layout))
    ours = json.loads((worker_pool.out_dir(WORKER, world_size)
                       / f"{run_name(family, layout)}.json").read_text())
    theirs = references[family, layout[0]]
    assert len(ours) == len(theirs) == 5
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)
