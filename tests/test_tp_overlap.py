"""Sub-pipelined tensor parallelism (`set_tp_overlap`, ``tp_overlapping_level``): levels 1 and 2
against level 0 at tp=2 in one torchrun launch (workers/tp_overlap_parity.py); argument errors,
level 0 restoring the model, the block split and the coroutine scheduler in one process. The
worker returns each level's loss and gradients next to level 0's; they are compared here."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from dist_harness import assert_like_reference, scenario_result
from hf_models import CustomMLP, MLPBlock, batch
from tp_models import TP_FAMILIES
from tp_overlap_parity import REFUSALS, scenario_names

import merak
from merak.tensor_parallel.layers.megatron import RowParallel
from merak.tensor_parallel.overlap.interleaver import Interleaver
from merak.tensor_parallel.overlap.levels import set_tp_overlap
from merak.tensor_parallel.plans.tp_plan import TPPlan

# pooled: launches(world_size), see conftest.py
WORKER, WORLD_SIZES = "tp_overlap_parity.py", (2,)
# each level's loss and gradients against level 0's on the same weights:
# torch.testing.assert_close(level n, level 0, rtol=RTOL, atol=ATOL)
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("scenario", [s for s in scenario_names() if s not in REFUSALS])
def test_levels_1_and_2_train_like_level_0(launches, scenario):
    """Each level's loss and gradients equal level 0's, and each level took its path: level 2
    interleaves every block's sub-batches, which yield at the row layers (under saved-tensor
    hooks blocks run whole, with level-1 layers); levels 1 and 2 run the sub-pipelined column
    and row layers."""
    figures = scenario_result(*launches(2), scenario)
    assert assert_like_reference(figures, rtol=RTOL, atol=ATOL, grad_atol_of_max=0.0) > 0
    for rank, ours in enumerate(figures):
        assert ours.get("grads_apart", []) == [], \
            f"rank {rank}: parameters with a gradient at one level only: {ours['grads_apart']}"
        for run in ours.get("runs", []):
            level, counts = run["level"], run["counts"]
            where = f"rank {rank}, level {level}: {counts}"
            interleaved = run["blocks"] if level == 2 and not run["saved_tensor_hooks"] else 0
            assert counts["interleaved blocks"] == interleaved, where
            assert (counts["yields"] > 0) == (interleaved > 0), where
            assert (counts["row"] > 0) == (level > 0), where
            assert (counts["column"] > 0) == (level > 0), where
        for run in ours.get("interpreter_runs", []):
            level, counts = run["level"], run["counts"]
            where = f"rank {rank}, level {level} through the interpreter: {counts}"
            assert (counts["interleaved blocks"] > 0) == (level == 2), where
            assert (counts["yields"] > 0) == (level == 2), where


@pytest.mark.parametrize("scenario", REFUSALS)
def test_a_batch_the_sub_batches_do_not_divide_is_refused(launches, scenario):
    for rank, ours in enumerate(scenario_result(*launches(2), scenario)):
        refusal = ours["refusal"]
        assert refusal is not None, f"rank {rank}: a batch of 3 rows split in 2 sub-batches ran"
        assert "num_sub_batches=2" in refusal and "divisible by 2" in refusal, \
            f"rank {rank}: {refusal}"


def _ctx(tp: int):
    return SimpleNamespace(tp=tp, tp_rank=0, tp_group=None)  # no group: collectives are skipped


def _tp_model(family: str = "llama", materialize: bool = False, **tp_options):
    torch.manual_seed(0)
    with merak.init_empty_weights():
        model = TP_FAMILIES[family]()
    merak.apply_tensor_parallel(model, _ctx(2), **tp_options)
    if materialize:
        merak.materialize_(model)
    return model


@pytest.mark.parametrize("kwargs,message", [
    ({"level": 3}, "tp_overlapping_level must be one of"),
    ({"level": -1}, "tp_overlapping_level must be one of"),
    ({"level": 1, "num_sub_batches": 1}, "num_sub_batches .* must be an int >= 2"),
    ({"level": 2, "num_sub_batches": 2.0}, "num_sub_batches .* must be an int >= 2"),
    ({"level": 1, "dim": -1}, "dim=-1"),
    ({"level": 2, "dim": 1}, "level 2 splits whole sequences"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        set_tp_overlap(_tp_model(), **kwargs)


def test_models_it_cannot_overlap_say_why():
    with pytest.raises(ValueError, match="needs a tensor-parallel model"):
        set_tp_overlap(CustomMLP(), 1)
    set_tp_overlap(CustomMLP(), 0)  # level 0 on any model: nothing to do
    with pytest.raises(ValueError, match="do not support sequence parallelism"):
        set_tp_overlap(_tp_model(sequence_parallel=True), 1)
    with pytest.raises(ValueError, match="needs tp > 1"):
        merak.apply_tensor_parallel(CustomMLP(), _ctx(1), overlap_level=1)
    with merak.init_empty_weights():
        model = TP_FAMILIES["llama"]()
    for options, message in [({"overlap_level": 3}, "must be one of"),
                             ({"overlap_level": 1, "overlap_sub_batches": 1},
                              "must be an int >= 2"),
                             ({"overlap_level": 2, "sequence_parallel": True},
                              "do not support sequence parallelism")]:
        with pytest.raises(ValueError, match=message):  # before the model is converted
            merak.apply_tensor_parallel(model, _ctx(2), **options)
        assert getattr(model, "merak_tp", None) is None
    flat = MLPBlock(8)  # one block, not a list of them
    merak.apply_tensor_parallel(flat, _ctx(2), plan=TPPlan(column=("fc1",), row=("fc2",)))
    set_tp_overlap(flat, 1)
    with pytest.raises(ValueError, match="level 2 found no repeated block"):
        set_tp_overlap(flat, 2)


def test_level_0_restores_the_layers_and_blocks():
    model = _tp_model("gpt2", overlap_level=2, overlap_sub_batches=4)
    block = model.transformer.h[1]
    assert type(block).__name__ == "TPOverlapGPT2Block"
    assert isinstance(block, tf.models.gpt2.modeling_gpt2.GPT2Block)
    assert block.attn.c_proj.tp_overlap.interleaver is block.tp_overlap_block[2]
    set_tp_overlap(model, 1, 3)
    assert type(block) is tf.models.gpt2.modeling_gpt2.GPT2Block
    assert block.mlp.c_fc.tp_overlap.num_sub_batches == 3
    set_tp_overlap(model, 0)
    assert type(block) is tf.models.gpt2.modeling_gpt2.GPT2Block
    assert all("tp_overlap" not in vars(m) and "tp_overlap_block" not in vars(m)
               for m in model.modules())
    assert all(m.tp_overlap is None for m in model.modules() if isinstance(m, RowParallel))


def test_level_2_block_split_matches_the_whole_block():
    """Without a TP group nothing communicates, but each block still splits its batch into
    sub-batches run on the coroutine threads and merges their outputs: same loss and
    gradients as the whole block."""
    model = _tp_model("llama", materialize=True).train()
    inputs = {**batch("llama", 0, 4), "use_cache": False}
    results = []
    for level in (0, 2):
        set_tp_overlap(model, level)
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (split_loss, split_grads) = results
    torch.testing.assert_close(split_loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError,
                       match=r"block model.layers.0 into num_sub_batches=2 .* divisible"):
        model(**{**batch("llama", 0, 3), "use_cache": False})


def test_interleaver_alternates_sub_batches_and_reraises_their_errors():
    interleaver, order = Interleaver(), []

    def sub_batch(tag: str, fail: bool = False):
        for phase in ("attention", "mlp"):
            order.append((tag, phase, threading.current_thread() is threading.main_thread()))
            if fail and phase == "mlp":
                raise RuntimeError(f"{tag} failed")
            interleaver.switch()  # where a row layer's all-reduce is in flight
        return tag

    calls = [(("A",), {}), (("B",), {}), (("C",), {})]
    assert interleaver.run(sub_batch, calls, torch.device("cpu")) == ["A", "B", "C"]
    assert [(t, p) for t, p, _ in order] == [(t, p) for p in ("attention", "mlp")
                                              for t in "ABC"]
    assert [main for t, _, main in order if t == "A"] == [True, True]  # A runs on the caller
    assert not any(main for t, _, main in order if t != "A")
    order.clear()
    with pytest.raises(RuntimeError, match="B failed"):
        interleaver.run(sub_batch, [(("A",), {}), (("B",), {"fail": True})],
                        torch.device("cpu"))
    assert [(t, p) for t, p, _ in order] == [("A", "attention"), ("B", "attention"),
                                              ("A", "mlp"), ("B", "mlp")]
    interleaver.switch()  # outside a run: nothing to hand over
