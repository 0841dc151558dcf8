"""Schedules with 2 stages per rank train an auto-split HF model exactly like the
single-process model: losses, every gradient and final weights. Interleaved 1F1B without
recomputation, with recomputation everywhere, with stage-aware recomputation (per-stage ratios
from measured activation bytes, each rank's stages fitted together), and (Llama) with 2 pp + 1
micro-batches, not a multiple of the ranks; ZB-V and DualPipeV (2 stages per rank in a V, the
turn handed off locally; GPT-2's tied embedding and head both on rank 0), ZB-V also with
recomputation; the eval loss equals the model's. The scenarios return their figures
(`trained_like`), which test_interleaved compares.

The scenarios that run forward-only programs (activation measurement, eval) run after the
others: one that deadlocks closes the process group, which fails every later scenario too."""

from __future__ import annotations

import os

import torch
import transformers as tf
from common import (
    Compared,
    GradSnapshot,
    keeps_groups,
    run_scenarios,
    train_reference,
    trained_like,
)
from hf_models import LLAMA_LIKE, VOCAB, batch

import merak
from merak.recompute.stage_aware import measure_kept, predict_peaks, stage_aware_ratios

STEPS, ROWS, LR, SEED, CHUNKS = 3, 2, 0.05, 1234, 2
FAMILY_NAMES = ("llama", "gpt2")
# name -> (interpreter options, blocks per virtual stage, micro-batches beyond 2 pp);
# "stage-aware": per-stage ratios from `stage_aware_ratios` with the first rank's stages
# recomputing FIRST_RATIO of their blocks (2 blocks per stage, so a stage can recompute half:
# the ratios then differ between stages); "odd-m": 2 pp + 1 micro-batches (Llama only)
VARIANTS = {"interleaved": ({}, 1, 0), "interleaved-recompute": ({"recompute_ratio": 1.0}, 1, 0),
            "interleaved-odd-m": ({}, 1, 1),
            "zbv": ({"schedule": "zbv"}, 1, 0),
            "zbv-recompute": ({"schedule": "zbv", "recompute_ratio": 1.0}, 1, 0),
            "dualpipev": ({"schedule": "dualpipev"}, 1, 0),
            "interleaved-stage-aware": ({"recompute_ratio": "stage-aware"}, 2, 0)}
FIRST_RATIO = 0.5
EVAL = "interleaved-eval"
V_SCHEDULES = ("zbv", "dualpipev")
LATE = ("interleaved-stage-aware", EVAL)


def make_model(family: str, num_layers: int):
    if family == "llama":
        config = tf.LlamaConfig(vocab_size=VOCAB, num_hidden_layers=num_layers, **LLAMA_LIKE)
    else:  # GPT-2 ties its embedding (chunk 0 of rank 0) and head (last chunk of the last rank)
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=num_layers, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                               eos_token_id=0)
    return tf.AutoModelForCausalLM.from_config(config)


def _order(world_size: int) -> list[tuple[str, str]]:
    """(family, variant) of every scenario: the training variants, then the `LATE` ones; both
    families at pp=2, Llama alone at pp=4 (the suite's time budget)."""
    early = [v for v in VARIANTS if v not in LATE]
    names = FAMILY_NAMES if world_size == 2 else FAMILY_NAMES[:1]
    return [(family, variant) for variant in (*early, *LATE) for family in names
            if family == "llama" or not variant.endswith("odd-m")]  # (its own builds)


def scenario_names(world_size: int) -> list[str]:
    return [f"{family}-pp{world_size}-{variant}" for family, variant in _order(world_size)]


class _Family:
    """One family's chunks, initial weights and single-process reference, built once per
    number of blocks per virtual stage."""

    def __init__(self, family: str, pp: int, blocks_per_stage: int, extra_microbatches: int,
                 schedule: str):
        self.family, self.ctx = family, merak.init(dp=1, tp=1, pp=pp)
        self.microbatches = 2 * pp + extra_microbatches
        num_layers = pp * CHUNKS * blocks_per_stage
        torch.manual_seed(SEED)
        with merak.init_empty_weights():
            model = make_model(family, num_layers)
        self.stage = merak.parallelize(model, batch(family, 0, ROWS), self.ctx,
                                       num_model_chunks=CHUNKS, schedule=schedule)
        self.initial = {k: v.clone() for k, v in self.stage.state_dict().items()}
        torch.manual_seed(SEED)
        reference = make_model(family, num_layers)
        self.losses, self.grads, self.final = train_reference(
            reference, [batch(family, step, ROWS * self.microbatches) for step in range(STEPS)],
            LR)
        reference.eval()
        with torch.no_grad():
            self.eval_loss = reference(**batch(family, 99, ROWS * self.microbatches)).loss.item()

    def _engine(self, hooks=(), schedule="interleaved_1f1b", **options
                ) -> merak.PipelineInterpreter:
        return merak.PipelineInterpreter(
            self.stage, self.ctx, torch.optim.SGD(self.stage.parameters(), lr=LR),
            num_microbatches=self.microbatches, schedule=schedule, hooks=hooks, **options)

    def _stage_aware(self, engine: merak.PipelineInterpreter) -> dict:
        """Per-stage ratios from this model's measured activation bytes, installed in
        `engine`: what its test checks they promise (``kept_blocks`` per stage, the
        ``ratios``, the predicted ``peaks`` per rank, and each stage's ``segment_blocks``)."""
        pp, m = self.ctx.pp, self.microbatches
        edges = engine.split.edges or None
        kept = measure_kept(engine, batch(self.family, 0, ROWS * m), 1)
        ratios = stage_aware_ratios("interleaved_1f1b", pp, m, kept, FIRST_RATIO, edges)
        peaks = predict_peaks("interleaved_1f1b", pp, m, kept, ratios, edges)
        if self.ctx.rank == 0:
            print(f"{self.family} pp{pp} stage-aware ratios {ratios}, predicted peaks "
                  f"{[int(p) for p in peaks]}", flush=True)
        engine.set_recomputation(ratios, 1)
        return {"kept_blocks": [k.num_blocks for k in kept], "ratios": list(ratios),
                "peaks": [float(p) for p in peaks],
                "segment_blocks": [len(sum(s, [])) for s in engine.segments]}

    def check(self, variant: str) -> dict:
        """The training run's figures (`trained_like`) and what the engine was: ``schedule``,
        this rank's ``runners`` (its stages), the stages whose programs recompute, and, with
        stage-aware recomputation, its ratios (``stage_aware``)."""
        options = dict(VARIANTS[variant][0])
        stage_aware = options.get("recompute_ratio") == "stage-aware"
        if stage_aware:
            del options["recompute_ratio"]  # set once measured
        self.stage.load_state_dict(self.initial)
        snapshot = GradSnapshot(self.stage)
        engine = self._engine(hooks=[snapshot], **options)
        try:
            seen = {"variant": variant, "pp": self.ctx.pp, "pp_rank": self.ctx.pp_rank,
                    "schedule": engine.schedule.name, "runners": sorted(engine.runners),
                    "stage_aware": self._stage_aware(engine) if stage_aware else None}
            seen["recomputing"] = sorted({a.stage_id for a in engine.program
                                          if a.kind is merak.ActionKind.RECOMPUTE})
            losses = [engine.train_step(batch(self.family, step, ROWS * self.microbatches))
                      for step in range(STEPS)]
        finally:
            engine.remove_recomputation()
        figures = trained_like(losses, snapshot, self.stage, self.losses, self.grads, self.final)
        return {**figures, **seen}

    def check_eval(self) -> dict:
        """The eval loss of the trained weights (the reference's final ones, which every
        training scenario reaches), without and with recomputation installed."""
        with torch.no_grad():
            for name, param in self.stage.named_parameters():
                param.copy_(self.final[name])
        compared = Compared()
        for options in ({}, {"recompute_ratio": 1.0}):
            engine = self._engine(**options)
            try:
                eval_loss = engine.eval_step(batch(self.family, 99, ROWS * self.microbatches))
            finally:
                engine.remove_recomputation()
            compared.value(f"eval loss {options}", eval_loss, self.eval_loss)
        return compared.figures()


def scenarios(world: int) -> dict:
    built: dict[tuple[str, int, int, str], _Family] = {}

    def scenario(family: str, variant: str):
        def run() -> dict:
            blocks, extra = VARIANTS[variant][1:] if variant in VARIANTS else (1, 0)
            # one build per placement: round-robin, or the V (both V schedules)
            schedule = "zbv" if variant.startswith(V_SCHEDULES) else "interleaved_1f1b"
            key = (family, blocks, extra, schedule)
            if key not in built:
                built[key] = _Family(family, world, blocks, extra, schedule)
            if variant == EVAL:
                return built[key].check_eval()
            return built[key].check(variant)
        return keeps_groups(run)  # (later variants reuse its build)

    return {f"{family}-pp{world}-{variant}": scenario(family, variant)
            for family, variant in _order(world)}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
