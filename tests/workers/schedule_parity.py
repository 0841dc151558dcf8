"""Every schedule, with and without recomputation, trains an auto-split HF model exactly like
the single-process model: the training scenarios return their figures (`trained_like`), which
test_schedule_recompute compares; the memory scenarios return the peaks, ratios and budgets it
checks."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers as tf
from common import (
    GradSnapshot,
    family_scenarios,
    run_scenarios,
    train_reference,
    trained_like,
)
from hf_models import FAMILIES, LLAMA_LIKE, VOCAB, batch

import merak
from merak.materialize.meta import materialize_
from merak.partition.auto import auto_split
from merak.recompute.stage_aware import (
    choose_ratios,
    measure_kept,
    predict_peaks,
    stage_aware_ratios,
)

STEPS, MICROBATCHES, ROWS, LR, SEED = 3, 4, 2, 0.05, 1234
FAMILY_NAMES = ("llama", "gpt2")


def families(world_size: int) -> tuple[str, ...]:
    """Both families at pp=2; Llama alone at pp=4 (GPT-2's tied embedding and head cross the
    pipeline at pp=2 already; the suite's time budget)."""
    return FAMILY_NAMES if world_size == 2 else FAMILY_NAMES[:1]

# name -> interpreter options
VARIANTS = {
    "1f1b": {"schedule": "1f1b"},
    "1f1b-recompute": {"schedule": "1f1b", "recompute_ratio": 1.0},
    # with dealloc_pipeoutput: sent activations' data freed, their graphs kept
    "1f1b-stage-aware-chunk2-dealloc": {"schedule": "1f1b", "recompute_ratio": "falling",
                                        "segment_size": 2, "dealloc_outputs": True},
    "ds_default-recompute": {"schedule": "ds_default", "recompute_ratio": 1.0},
    "pre_recompute_1f1b": {"schedule": "pre_recompute_1f1b", "recompute_ratio": 1.0},
    "last_no_recompute_1f1b": {"schedule": "last_no_recompute_1f1b", "recompute_ratio": 1.0},
    "shifted_critical_path": {"schedule": "shifted_critical_path", "recompute_ratio": 1.0},
    "zero_bubble": {"schedule": "zero_bubble"},
    "zero_bubble-recompute-dealloc": {"schedule": "zero_bubble", "recompute_ratio": 0.5,
                                      "dealloc_outputs": True},
}


def scenario_names(world_size: int) -> list[str]:
    return [f"{family}-pp{world_size}-{variant}" for family in families(world_size)
            for variant in VARIANTS] + [f"llama-pp{world_size}-stage-aware-memory",
                                        f"llama-pp{world_size}-dealloc-memory"]


class _Family:
    """One family's split, initial stage weights and single-process reference, built once."""

    def __init__(self, family: str, pp: int):
        self.family, self.ctx = family, merak.init(dp=1, tp=1, pp=pp)
        torch.manual_seed(SEED)
        with merak.init_empty_weights():
            model = FAMILIES[family]()
        self.split = auto_split(model, batch(family, 0, ROWS), pp)
        self.stage = merak.PipelineStage(self.split.container, self.split, self.ctx.pp_rank)
        materialize_(self.stage)
        self.initial = {k: v.clone() for k, v in self.stage.state_dict().items()}
        torch.manual_seed(SEED)
        reference = FAMILIES[family]()
        self.losses, self.grads, self.final = train_reference(
            reference, [batch(family, step, ROWS * MICROBATCHES) for step in range(STEPS)],
            LR)

    def check(self, variant: str) -> dict:
        """The training run's figures (`trained_like`), with ``recomputes``: whether this
        stage's program recomputes, and ``last_stage``."""
        options = dict(VARIANTS[variant])
        pp = self.ctx.pp
        if options.get("recompute_ratio") == "falling":  # stage-aware: later stages recompute less
            options["recompute_ratio"] = [1.0 - s / pp for s in range(pp)]
        self.stage.load_state_dict(self.initial)
        snapshot = GradSnapshot(self.stage)
        engine = merak.PipelineInterpreter(
            self.stage, self.ctx, torch.optim.SGD(self.stage.parameters(), lr=LR),
            num_microbatches=MICROBATCHES, hooks=[snapshot], **options)
        try:
            recomputes = any(a.kind.value == "recompute" for a in engine.program)
            losses = [engine.train_step(batch(self.family, step, ROWS * MICROBATCHES))
                      for step in range(STEPS)]
        finally:
            engine.remove_recomputation()
        figures = trained_like(losses, snapshot, self.stage, self.losses, self.grads, self.final)
        return {**figures, "recomputes": recomputes, "last_stage": self.ctx.is_last_pp_rank}


def stage_aware_memory() -> dict:
    """Stage-aware and budgeted recomputation over a 1F1B step: for each mode, the ratios, each
    stage's measured peak activation bytes and the simulator's prediction (its test checks
    they agree within 10%, that no stage peaks above the first, that the budgets are met), and
    the ``budget_bytes`` per stage."""
    pp, m = int(os.environ["WORLD_SIZE"]), 8
    ctx = merak.init(dp=1, tp=1, pp=pp)
    config = tf.LlamaConfig(vocab_size=VOCAB, num_hidden_layers=4 * pp, **LLAMA_LIKE)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(config)
    split = auto_split(model, batch("llama", 0, ROWS), pp)
    stage = merak.PipelineStage(split.container, split, ctx.pp_rank)
    materialize_(stage)
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=0.0),
                                       num_microbatches=m, measure_activations=True)
    data, edges = batch("llama", 0, ROWS * m), split.edges or None
    kept = measure_kept(engine, data, 1)
    least = predict_peaks("1f1b", pp, m, kept, [1.0] * pp, edges)
    most = predict_peaks("1f1b", pp, m, kept, [0.0] * pp, edges)
    budget = [(lo + hi) / 2 for lo, hi in zip(least, most)]
    report, seen = [], {"budget_bytes": budget}
    try:
        for mode in ("stage-aware", "budget"):
            ratios = stage_aware_ratios("1f1b", pp, m, kept, 0.5, edges) \
                if mode == "stage-aware" else choose_ratios("1f1b", pp, m, kept, budget, edges)
            engine.set_recomputation(ratios, 1)
            engine.train_step(data)
            measured = [0] * pp
            dist.all_gather_object(measured, engine.activation_peak)
            predicted = predict_peaks("1f1b", pp, m, kept, ratios, edges)
            report.append(f"{mode}: ratios {ratios} predicted {[int(p) for p in predicted]} "
                          f"measured {measured}")
            seen[mode] = {"ratios": list(ratios), "measured": measured,
                          "predicted": [float(p) for p in predicted]}
    finally:
        engine.remove_recomputation()
        if ctx.rank == 0:
            print("\n".join(report), flush=True)
    return seen


def dealloc_memory() -> dict:
    """dealloc_outputs (``dealloc_pipeoutput``) off and on over a 1F1B step: the stage's peak
    by the activation meter (which counts the outputs held for backward), whether its outputs
    were freeable, and the loss; ``hidden``, one micro-batch's sent activation in bytes (each
    stage but the last should keep at least that much less at its peak; the last, which sends
    nothing, the same, with the loss unchanged)."""
    pp, m = int(os.environ["WORLD_SIZE"]), 4
    ctx = merak.init(dp=1, tp=1, pp=pp)
    config = tf.LlamaConfig(vocab_size=VOCAB, num_hidden_layers=2 * pp, **LLAMA_LIKE)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(config)
    split = auto_split(model, batch("llama", 0, ROWS), pp)
    stage = merak.PipelineStage(split.container, split, ctx.pp_rank)
    materialize_(stage)
    data = batch("llama", 0, ROWS * m)
    peaks, losses, freeable = {}, {}, {}
    for dealloc in (False, True):
        engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=0.0),
                                           num_microbatches=m, measure_activations=True,
                                           dealloc_outputs=dealloc)
        losses[dealloc] = engine.train_step(data)
        peaks[dealloc] = engine.activation_peak
        freeable[dealloc] = bool(engine.runners[ctx.pp_rank].freeable)  # any output freed
    hidden = ROWS * data["input_ids"].shape[1] * config.hidden_size * 4  # one sent fp32 h
    if ctx.rank == 0:
        print(f"dealloc pp={pp}: stage 0 peak {peaks[False]} -> {peaks[True]} bytes "
              f"(one sent activation: {hidden})", flush=True)
    return {"last_stage": ctx.is_last_pp_rank, "hidden": hidden,
            **{f"{key}_{'on' if dealloc else 'off'}": values[dealloc]
               for key, values in (("peak", peaks), ("freeable", freeable), ("loss", losses))
               for dealloc in (False, True)}}


def scenarios(world: int) -> dict:
    table = family_scenarios(lambda f: _Family(f, world), families(world), VARIANTS, world)
    table[f"llama-pp{world}-stage-aware-memory"] = stage_aware_memory
    table[f"llama-pp{world}-dealloc-memory"] = dealloc_memory
    return table


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
