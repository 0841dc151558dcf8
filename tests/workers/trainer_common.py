"""Shared by the MerakTrainer parity run and its single-process HF Trainer reference."""

from __future__ import annotations

import os

import torch
from hf_models import VOCAB
from tp_models import TP_FAMILIES, moe_model

STEPS, MICRO_BATCH, MICROBATCHES, DP, SEQ, SEED = 10, 2, 2, 2, 12, 1234
FAMILIES = ("llama", "gpt2")
FIVE = {"max_steps": 5}  # ZeRO runs: 5 steps (a reference of their own)
# the run whose step-4 checkpoint (dp2 x tp2 x pp2, 2 chunks per rank, ZeRO-3) trainer_reshard
# loads into other layouts; the step-5 loss it logged is what they must reproduce
RESHARD_SOURCE, RESHARD_SAVE_STEP = "llama-deep-interleaved-zero3", 4
# run -> (family, fields for both trainers, MerakArguments-only fields)
RUNS = {"llama": ("llama", {}, {}),
        "llama-zero1": ("llama", FIVE, {"zero_stage": 1, "prescale_gradients": True}),
        # recomputation through MerakArguments: stage-aware ratios planned from a measurement
        "llama-shifted-stage-aware": ("llama", {}, {
            "train_schedule": "shifted_critical_path", "activation_checkpointing": True,
            "activation_checkpoint_ratio": [0.5]}),
        "gpt2-zero-bubble-recompute": ("gpt2", {}, {
            "train_schedule": "zero_bubble", "activation_checkpointing": True,
            "checkpoint_num_layers": 2}),
        # ZeRO-2/3 through FSDP2: gradients (and parameters) sharded over dp
        "llama-zero3": ("llama", FIVE, {"zero_stage": 3, "activation_checkpointing": True}),
        "gpt2-zero3": ("gpt2", FIVE, {"zero_stage": 3}),  # embeddings tied across stages

        RESHARD_SOURCE: ("llama-deep", FIVE, {
            "train_schedule": "interleaved_1f1b", "num_model_chunks": 2, "zero_stage": 3,
            "save_steps": RESHARD_SAVE_STEP}),
        "llama-dp4-bf16-zero2": ("llama", {**FIVE, "bf16": True}, {"zero_stage": 2}),
        # at dp2 x pp2: ZeRO-2 under the interleaved schedule in bf16, sent activations freed
        "llama-deep-interleaved-zero2-bf16": ("llama-deep", {**FIVE, "bf16": True}, {
            "train_schedule": "interleaved_1f1b", "num_model_chunks": 2, "zero_stage": 2,
            "dealloc_pipeoutput": True}),
        # the strategy search chooses the layout, micro-batching, schedule, recomputation
        # and ZeRO stage (2 dry runs) for the reference's global batch; the loss curve is the
        # single-process one whatever it chose
        "llama-auto": ("llama", {}, {"auto_parallel": True, "plan_dry_runs": 2}),
        # HF's training flow in one run: evaluation every 3 steps from step 4 on and
        # at the last step (6, 9, 10) plus one at the start (which never counts as the best);
        # on this random data the eval loss rises after step 6, so the best (lowest) is step 6,
        # an early checkpoint: saved with save_strategy='best', the only one kept, and loaded
        # back at the end; label smoothing (also in the eval loss), HF's gradient checkpointing
        # spelling, token counting
        "llama-hf-flow": ("llama", {
            "eval_strategy": "steps", "eval_steps": 3, "eval_delay": 4, "eval_on_start": True,
            "save_strategy": "best", "save_total_limit": 1, "load_best_model_at_end": True,
            "metric_for_best_model": "loss", "greater_is_better": False,
            "label_smoothing_factor": 0.1, "gradient_checkpointing": True,
            "gradient_checkpointing_kwargs": {"use_reentrant": False},
            "include_num_input_tokens_seen": True, "eval_accumulation_steps": 1,
            "torch_empty_cache_steps": 2}, {})}
# The ZeRO grid: ZeRO-2 and -3 x (dp, tp, pp) in (2,1,2), (2,2,2), (4,1,2) x 1f1b and
# interleaved_1f1b x fp32 and bf16, 5 steps each against HF Trainer. The suite runs the
# combinations that cover every pair of those values (with the 4 the runs above make already):
# 4 of 20 (`pairwise`); MERAK_TEST_MATRIX=full runs all 20.
ZERO_LAYOUTS = {"dp2tp1pp2": (2, 1, 2), "dp2tp2pp2": (2, 2, 2), "dp4tp1pp2": (4, 1, 2)}
_MADE = {(3, "dp2tp2pp2", "1f1b", False), (3, "dp2tp2pp2", "interleaved_1f1b", False),
         (2, "dp4tp1pp2", "1f1b", True), (2, "dp2tp1pp2", "interleaved_1f1b", True)}


def pairwise(candidates: list[tuple], made: set[tuple]) -> list[tuple]:
    """Candidates (tuples of factor values) chosen greedily until, together with `made`, every
    pair of values of two factors that some candidate has appears in a chosen one."""
    def pairs(combo: tuple) -> set:
        return {(i, a, j, b) for i, a in enumerate(combo) for j, b in enumerate(combo) if i < j}

    wanted = set().union(*map(pairs, candidates)) - set().union(set(), *map(pairs, made))
    chosen = []
    while wanted:
        best = max(candidates, key=lambda combo: len(pairs(combo) & wanted))
        chosen.append(best)
        wanted -= pairs(best)
    return chosen


_GRID = [(zero, layout, schedule, bf16) for zero in (2, 3) for layout in ZERO_LAYOUTS
         for schedule in ("1f1b", "interleaved_1f1b") for bf16 in (False, True)
         if (zero, layout, schedule, bf16) not in _MADE]
ZERO_GRID = {
    f"grid-zero{zero}-{layout}-{schedule}-{'bf16' if bf16 else 'fp32'}": (
        "llama-deep" if schedule == "interleaved_1f1b" else "llama",
        {**FIVE, "bf16": True} if bf16 else FIVE,
        {"zero_stage": zero, "train_schedule": schedule,
         **({"num_model_chunks": 2} if schedule == "interleaved_1f1b" else {})})
    for zero, layout, schedule, bf16 in (
        _GRID if os.environ.get("MERAK_TEST_MATRIX") == "full" else pairwise(_GRID, _MADE))}
RUNS.update(ZERO_GRID)
# runs made on dp1 x tp1 x pp2 in test_trainer's 2-rank launch: HF's training flow, and
# recomputation choices and schedules, which the pipeline alone decides
PP2_RUNS = ("llama-hf-flow", "llama-shifted-stage-aware", "gpt2-zero-bubble-recompute")
# runs made on dp2 x tp1 x pp2 in test_trainer's 4-rank reshard launch
DP2_PP2_RUNS = ("gpt2-zero3", "llama-deep-interleaved-zero2-bf16", "llama-auto",
                *(run for run in ZERO_GRID if "-dp2tp1pp2-" in run))
# the rest on dp2 x tp2 x pp2 (or LAYOUTS) in the 8-rank launch
RUNS_3D = tuple(run for run in RUNS if run not in PP2_RUNS + DP2_PP2_RUNS)
# fp32 runs that also compare predict() outputs (GPT-2's under ZeRO-3: gathered per block)
PREDICTING = ("llama", "gpt2-zero3")
# (dp, tp, pp) of the runs that are not dp2 x tp2 x pp2
LAYOUTS = {"llama-dp4-bf16-zero2": (4, 1, 2), **{run: (2, 1, 2) for run in DP2_PP2_RUNS},
           **{run: ZERO_LAYOUTS[run.split("-")[2]] for run in ZERO_GRID}}
# HF fields shared by both runs (the reference uses per_device = MICRO_BATCH * DP)
COMMON = {"max_steps": STEPS, "learning_rate": 1e-3, "logging_steps": 1, "seed": SEED,
          "train_sampling_strategy": "sequential", "gradient_accumulation_steps": MICROBATCHES,
          "report_to": "none", "disable_tqdm": True, "use_cpu": True, "warmup_steps": 2,
          "max_grad_norm": 0.5}


# the schedule grid: each schedule family through MerakTrainer at (dp, tp, pp) in (1,1,2),
# (1,2,4), (2,1,2) and (2,2,2), on the NCCL-contract backend and on plain gloo
# (test_trainer_matrix.py); HF references of their own (`trainer_reference.py --matrix`)
MATRIX_STEPS = 4
MATRIX_REFERENCES = {"matrix": ("llama-deep", {"max_steps": MATRIX_STEPS}, {}),
                     "matrix8": ("llama-deep8", {"max_steps": MATRIX_STEPS}, {}),
                     # a Mixtral (router auxiliary loss on): its loss depends on the
                     # micro-batches, so its reference steps in Merak's, dp x m of them, each
                     # of 8 / (dp m) rows (sequential: dp rank d's are rows 4d..4d+3); at dp 2
                     # each dp rank's share of an evaluation batch has its own router loss,
                     # so only the training is compared there (test_trainer_matrix)
                     # 6 sequences a step, so interleaved 1F1B runs m = 3 (pp 2) or 6 (pp 4)
                     # micro-batches, no multiple of pp
                     "matrix6": ("llama-deep", {"max_steps": MATRIX_STEPS,
                                                "per_device_train_batch_size": 3}, {}),
                     "matrix6-8": ("llama-deep8", {"max_steps": MATRIX_STEPS,
                                                   "per_device_train_batch_size": 3}, {}),
                     "matrix-moe": ("mixtral-deep", {"max_steps": MATRIX_STEPS}, {}),
                     "matrix-moe8": ("mixtral-deep8", {"max_steps": MATRIX_STEPS}, {}),
                     "matrix-moe-dp2": ("mixtral-deep", {
                         "max_steps": MATRIX_STEPS, "gradient_accumulation_steps": 4,
                         "per_device_train_batch_size": MICRO_BATCH}, {})}
MATRIX_SCHEDULES = {"1f1b": {}, "interleaved_1f1b": {"num_model_chunks": 2},
                    "zero_bubble": {},
                    "shifted_critical_path": {"activation_checkpointing": True},
                    "zbv": {}, "dualpipev": {}}
# the V schedules also train a Mixtral (an MoE family) at every layout
MATRIX_MOE_SCHEDULES = ("zbv", "dualpipev")
# the suite runs the 2-rank layout (dp > 1 on padded rows is RUNS' job, in test_trainer);
# MERAK_TEST_MATRIX=full adds the 4- and 8-rank ones (each rank traces the model, ~11
# CPU-seconds a run: 8 ranks on 2 cores cost ~6 minutes a backend)
MATRIX_LAYOUTS = {2: [(1, 1, 2)]}
if os.environ.get("MERAK_TEST_MATRIX") == "full":
    MATRIX_LAYOUTS.update({4: [(2, 1, 2)], 8: [(1, 2, 4), (2, 2, 2)]})


def matrix_runs(world_size: int) -> dict[str, tuple[str, tuple[int, int, int], dict]]:
    """``matrix-dp1tp2pp4-zero_bubble`` -> (reference run, layout, MerakArguments fields)."""
    runs = {}
    for dp, tp, pp in MATRIX_LAYOUTS.get(world_size, []):
        for schedule, fields in MATRIX_SCHEDULES.items():
            reference, extra = "matrix", {}
            if schedule == "interleaved_1f1b" and pp == 4:  # 8 stages of one layer, in 4
                # micro-batches (the reference's global batch, 4 of 2 rows)
                reference, extra = "matrix8", {"gradient_accumulation_steps": 4}
            if schedule in ("zbv", "dualpipev") and pp == 4:  # 8 stages in a V, 2 micro-batches
                reference = "matrix8"
            runs[f"matrix-dp{dp}tp{tp}pp{pp}-{schedule}"] = (
                reference, (dp, tp, pp), {"train_schedule": schedule, **fields, **extra})
        m = 3 if pp == 2 else 6  # interleaved 1F1B with m not a multiple of pp
        runs[f"matrix-dp{dp}tp{tp}pp{pp}-interleaved_1f1b-m{m}"] = (
            "matrix6" if pp == 2 else "matrix6-8", (dp, tp, pp),
            {"train_schedule": "interleaved_1f1b", "num_model_chunks": 2,
             "gradient_accumulation_steps": m})
        for schedule in MATRIX_MOE_SCHEDULES:
            reference = "matrix-moe8" if pp == 4 else "matrix-moe-dp2" if dp == 2 \
                else "matrix-moe"
            runs[f"matrix-dp{dp}tp{tp}pp{pp}-{schedule}-moe"] = (
                reference, (dp, tp, pp), {"train_schedule": schedule,
                                          "gradient_accumulation_steps": MICROBATCHES})
    return runs


def flow_summary(trainer) -> dict:
    """What test_trainer compares for a run with HF's training flow (either trainer)."""
    import os

    state = trainer.state
    return {"evals": [[h["step"], h["eval_loss"]] for h in state.log_history
                      if "eval_loss" in h],
            "best_metric": state.best_metric, "best_global_step": state.best_global_step,
            "best_checkpoint": os.path.basename(state.best_model_checkpoint or ""),
            "tokens": state.num_input_tokens_seen,
            "tokens_logged": [h.get("num_input_tokens_seen") for h in state.log_history
                              if "loss" in h],
            "checkpoints": sorted(n for n in os.listdir(trainer.args.output_dir)
                                  if n.startswith("checkpoint-"))}


def dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def padded_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Fine-tuning rows: each of its own length (SEQ/3 .. SEQ tokens), right-padded with id 0
    to SEQ, the padding masked out of attention and labelled -100, so the micro-batches of a
    step hold different numbers of target tokens (HF's token-weighted loss differs from the
    mean of micro-batch means)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(SEQ // 3, SEQ + 1, (n,), generator=g)
    rows = []
    for row, length in zip(ids, lengths):
        mask = (torch.arange(SEQ) < length).long()
        row = row * mask
        rows.append({"input_ids": row, "attention_mask": mask,
                     "labels": row.masked_fill(mask == 0, -100)})
    return rows


def train_set():
    return dataset(STEPS * MICRO_BATCH * MICROBATCHES * DP, 7)


def fine_tuning_set():
    """The parity runs' training rows (RUNS and the matrix): padded, of varying length."""
    return padded_rows(STEPS * MICRO_BATCH * MICROBATCHES * DP, 7)


def fine_tuning_eval_set(padded: bool = False):
    """Evaluation and prediction rows for runs trained on `fine_tuning_set`: padded ones (the
    matrix, whose evaluation batches are HF's: its token-weighted eval loss depends on them), or
    full-length ones with an attention mask (RUNS, which evaluate in other batches)."""
    if padded:
        return padded_rows(3 * MICRO_BATCH * MICROBATCHES * DP, 8)
    return [{**row, "attention_mask": torch.ones_like(row["input_ids"])} for row in eval_set()]


def eval_set():
    return dataset(3 * MICRO_BATCH * MICROBATCHES * DP, 8)


def build(family: str):
    """A model of `family` (``llama-deep``: `build_deep_llama`; ``llama-deep8``: 8 layers;
    ``llama-deep-kv2``: 2 key/value heads; ``mixtral-deep``, ``mixtral-deep8``: a small Mixtral
    of 4 and 8 layers)."""
    if family == "llama-deep":
        return build_deep_llama()
    if family == "llama-deep8":
        return build_deep_llama(8)
    if family == "llama-deep-kv2":
        return build_deep_llama(key_value_heads=2)
    if family.startswith("mixtral-deep"):
        torch.manual_seed(SEED)
        return moe_model("mixtral", 8 if family.endswith("8") else 4)
    torch.manual_seed(SEED)
    model = TP_FAMILIES[family]()
    # GPT2LMHeadModel's name matches no HF loss type, so HF Trainer would count position 0's
    # label too and scale its loss by (S-1)/S; name it so the reference computes the true mean
    model.loss_type = "ForCausalLM"
    return model


def build_deep_llama(layers: int = 4, key_value_heads: int | None = None):
    """4 layers, so the checkpoint can be resharded onto 4 pipeline stages (8: 2 model chunks
    on each of 4 pipeline ranks); `key_value_heads` in place of ATTN's."""
    import transformers as tf
    from tp_models import ATTN

    torch.manual_seed(SEED)
    kv = {"num_key_value_heads": key_value_heads} if key_value_heads else {}
    return tf.AutoModelForCausalLM.from_config(
        tf.LlamaConfig(**{**ATTN, "num_hidden_layers": layers, **kv}))



def token_accuracy(prediction) -> dict[str, float]:
    """compute_metrics over argmax predictions (preprocess_logits_for_metrics): next-token
    accuracy, as HF's run_clm computes it."""

    predicted, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
    mask = labels != -100
    return {"accuracy": float((predicted[mask] == labels[mask]).mean()),
            "rows": float(len(prediction.label_ids))}
