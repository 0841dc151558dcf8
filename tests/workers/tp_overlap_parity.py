"""Sub-pipelined TP (`set_tp_overlap`) at tp=2: levels 1 and 2 against level 0 on the same
weights, 3 SGD steps (the loss and every gradient of each step), on tiny Llama and GPT-2 models;
through `merak.parallelize` and the 1f1b interpreter too; dropout draws unchanged at level 1; and
the run-time error for a micro-batch the sub-batches do not divide. The parity scenarios return
each level's figures next to level 0's (`Compared`), which test_tp_overlap compares."""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
import transformers as tf
from common import Compared, GradSnapshot, run_scenarios
from hf_models import VOCAB
from tp_models import TP_FAMILIES, tp_batch

import merak
from merak.materialize.meta import materialize_
from merak.tensor_parallel.overlap import levels as overlap
from merak.tensor_parallel.overlap.interleaver import Interleaver
from merak.tensor_parallel.overlap.levels import set_tp_overlap

STEPS, ROWS, LR, SEED = 3, 4, 0.05, 1234


def batch_of(family: str, step: int, rows: int) -> dict:
    # no KV cache (as merak's trainer and pipeline split call models): a block handed a cache
    # runs whole, since sub-batches cannot share one
    return {**tp_batch(family, step, rows), "use_cache": False}


@contextmanager
def counting():
    """Counts the level-2 block calls that interleaved sub-batches and the TP layer calls that
    took the sub-pipelined path, to show that the levels really ran."""
    counts = Counter()
    run, switch = Interleaver.run, Interleaver.switch
    column, row = overlap.LayerOverlap.column, overlap.LayerOverlap.row

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    def yielded(interleaver):
        counts["yields"] += interleaver.running()  # a sub-batch handed over the baton
        return switch(interleaver)

    Interleaver.run, Interleaver.switch = counted("interleaved blocks", run), yielded
    overlap.LayerOverlap.column = counted("column", column)
    overlap.LayerOverlap.row = counted("row", row)
    try:
        yield counts
    finally:
        Interleaver.run, Interleaver.switch = run, switch
        overlap.LayerOverlap.column, overlap.LayerOverlap.row = column, row


def build(make, ctx, **tp_options):
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        model = make()
    merak.apply_tensor_parallel(model, ctx, **tp_options)
    materialize_(model)
    return model.train()


def loss_and_grads(model, batch: dict, level: int, num_sub_batches: int = 2, dim: int = 0,
                   saved_tensor_hooks: bool = False):
    """Loss and gradients of one forward + backward at `level`, and what ran (`run_record`:
    its test checks that the level really took its path: level 2 interleaves every block's
    sub-batches, and they yield at the row layers, except under saved-tensor hooks, where
    blocks run whole with level-1 layers)."""
    set_tp_overlap(model, level, num_sub_batches, dim=dim)
    model.zero_grad(set_to_none=True)
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) \
        if saved_tensor_hooks else nullcontext()
    with counting() as counts:
        with hooks:
            loss = model(**batch).loss
        loss.backward()
    blocks = len(model.get_submodule("model.layers" if hasattr(model, "model")
                                     else "transformer.h"))
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, \
        run_record(counts, level=level, blocks=blocks, saved_tensor_hooks=saved_tensor_hooks)


def run_record(counts: Counter, **what) -> dict:
    """A run's calls as `counting` counted them (every count, 0 where none), with `what`."""
    names = ("interleaved blocks", "yields", "row", "column")
    return {**what, "counts": {name: counts[name] for name in names}}


def levels_match(family: str, levels=(1, 2), num_sub_batches: int = 2, rows: int = ROWS,
                 dim: int = 0, saved_tensor_hooks: bool = False, **tp_options) -> dict:
    """Each step: loss and gradients at level 0, then at each level on the same weights; the
    SGD step uses level 0's gradients."""
    ctx = merak.init(dp=1, tp=2, pp=1)
    model = build(TP_FAMILIES[family], ctx, **tp_options)
    optimizer, compared = torch.optim.SGD(model.parameters(), lr=LR), Compared()
    runs, grads_apart = [], []  # every run's record; parameters with a gradient at one level only
    for step in range(STEPS):
        batch = batch_of(family, step, rows)
        loss, grads, run = loss_and_grads(model, batch, 0)
        runs.append(run)
        for level in levels:
            other_loss, other_grads, run = loss_and_grads(model, batch, level, num_sub_batches,
                                                          dim, saved_tensor_hooks)
            runs.append(run)
            compared.value(f"step {step} level {level} loss", other_loss, loss)
            grads_apart += sorted(other_grads.keys() ^ grads.keys())
            for name in grads.keys() & other_grads.keys():
                compared.value(f"step {step} level {level} grad of {name}", other_grads[name],
                               grads[name])
        set_tp_overlap(model, 0)
        for name, param in model.named_parameters():
            param.grad = grads[name]
        optimizer.step()
    return compared.figures(runs=runs, grads_apart=grads_apart)


def through_the_interpreter(family: str, level: int) -> dict:
    """merak.parallelize -> set_tp_overlap on the stage -> 1f1b interpreter, 2 micro-batches:
    losses and the gradients of each step match a level-0 stage built the same way."""
    ctx = merak.init(dp=1, tp=2, pp=1)
    runs, records = [], []
    for lvl in (0, level):
        torch.manual_seed(SEED)
        with merak.init_empty_weights():
            model = TP_FAMILIES[family]()
        stage = merak.parallelize(model, tp_batch(family, 0, ROWS), ctx)
        set_tp_overlap(stage, lvl)
        snapshot = GradSnapshot(stage)
        engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=LR),
                                           num_microbatches=2, schedule="1f1b",
                                           hooks=[snapshot])
        with counting() as counts:
            losses = [engine.train_step(tp_batch(family, s, 2 * ROWS)) for s in range(STEPS)]
        records.append(run_record(counts, level=lvl))
        runs.append((losses, snapshot.grads))
    (losses, grads), (other_losses, other_grads) = runs
    compared = Compared()
    compared.value("losses", other_losses, losses)
    for step in range(STEPS):
        for name, grad in grads[step].items():
            compared.value(f"step {step} grad of {name}", other_grads[step][name], grad)
    return compared.figures(interpreter_runs=records)


def dropout_unchanged_at_level1() -> dict:
    """Level 1 moves no random draw: with dropout on, its loss and gradients equal level 0's
    from the same generator states (the shared one and this rank's TP stream)."""
    ctx = merak.init(dp=1, tp=2, pp=1)
    config = tf.GPT2Config(n_embd=64, n_layer=2, n_head=8, vocab_size=VOCAB, resid_pdrop=0.2,
                           embd_pdrop=0.0, attn_pdrop=0.2, bos_token_id=0, eos_token_id=0)
    model = build(lambda: tf.GPT2LMHeadModel(config), ctx)
    batch = batch_of("gpt2", 0, ROWS)
    model(**batch)  # the TP stream exists from here on
    states = torch.get_rng_state(), model.merak_tp_rng.own
    results = []
    for level in (0, 1):
        torch.set_rng_state(states[0])
        model.merak_tp_rng.own = states[1]
        results.append(loss_and_grads(model, batch, level))
    (loss, grads, _), (other_loss, other_grads, _) = results
    compared = Compared()
    compared.value("loss with dropout", other_loss, loss)
    for name, grad in grads.items():
        compared.value(f"grad of {name} with dropout", other_grads[name], grad)
    return compared.figures(runs=[run for _, _, run in results])


def indivisible_batch_is_an_error(level: int) -> dict:
    """A batch of 3 rows split in 2 sub-batches: ``refusal``, the ValueError's message (None
    where the forward went through)."""
    ctx = merak.init(dp=1, tp=2, pp=1)
    model = build(TP_FAMILIES["llama"], ctx)
    set_tp_overlap(model, level)
    try:
        model(**batch_of("llama", 0, 3))
    except ValueError as error:
        return {"refusal": str(error)}
    return {"refusal": None}


SCENARIOS = {
    "llama-levels-1-2": lambda: levels_match("llama"),
    "gpt2-levels-1-2": lambda: levels_match("gpt2"),
    "llama-parallel-vocab-levels-1-2": lambda: levels_match("llama", parallel_vocab=True),
    "gpt2-4-sub-batches": lambda: levels_match("gpt2", num_sub_batches=4, rows=8),
    "llama-level1-sequence-sub-batches": lambda: levels_match("llama", levels=(1,),
                                                              num_sub_batches=3, dim=1),
    "gpt2-level2-under-saved-tensor-hooks": lambda: levels_match("gpt2", levels=(2,),
                                                                 saved_tensor_hooks=True),
    "gpt2-level2-interpreter": lambda: through_the_interpreter("gpt2", 2),
    "gpt2-level1-dropout-unchanged": dropout_unchanged_at_level1,
    "level1-indivisible-batch": lambda: indivisible_batch_is_an_error(1),
    "level2-indivisible-batch": lambda: indivisible_batch_is_an_error(2),
}


# the scenarios that return a refusal, not a comparison
REFUSALS = ("level1-indivisible-batch", "level2-indivisible-batch")


def scenario_names() -> list[str]:
    return list(SCENARIOS)


def scenarios(world_size: int) -> dict:
    assert world_size == 2, f"tp_overlap_parity runs on 2 ranks, not {world_size}"
    return SCENARIOS


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
