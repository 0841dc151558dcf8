"""MerakTrainer with expert parallelism (see test_expert_parallel_trainer): a tiny Qwen3-MoE and
Mixtral (2 layers, 4 experts, top-2, load-balancing loss on) written by `save_pretrained` (the
Hub's layout) and loaded under `init_empty_weights` train 4 steps at dp2 ep2 (2 ranks), dp2 ep2
pp2 or dp2 ep2 tp2 (4 ranks) on right-padded rows of lengths 5..12, saving a
checkpoint every 2 steps (and, trained only, dp2 ep2 tp2 with sequence parallelism, counting the
rows each router call saw); `save_model` writes the Hub layout with every expert and `merak
export` of the last checkpoint writes the same tensors. Then the checkpoint of step 2 resumes in
another layout (dp2 ep1 on 2 ranks; dp4 ep2 pp1 under ZeRO-1, dp4 ep2 tp1, and dp2 ep2 pp2
under ZeRO-1 from dp4 ep4, on 4; with MERAK_TEST_MATRIX=full dp4 ep4 pp2 on 8 resumes at dp4
ep2 pp2 under ZeRO-1), optimizer state included,
and trains steps 3 and 4 again, and both runs evaluate their final weights (the same loss at the
same dp: a step's eval loss holds each dp rank's load-balancing loss, see
docs/expert-parallel.md). The test runs single-process HF Trainer (`reference`) on the same
directory and rows and compares. DeepSeek-V3, OLMoE and GPT-OSS (`MORE`) train only, at dp2 ep2
(2 ranks); with MERAK_TEST_MATRIX=full they and Mixtral also train only at dp2 ep2 pp2 and dp2
ep2 tp2 (4 ranks; but GPT-OSS, with sequence parallelism too) and dp4 ep4 pp2 (8; every
config has 4 experts). Every run counts the bytes its rank's loader reads from the hub's files
(`ep_reads`): 1/ep of its stage's experts. On 4 ranks, `auto_run`:
MerakTrainer(auto_parallel=True) from merak.init(ep=2) plans the same Qwen3-MoE, writes
plan.json and trains the ep2 layout it chose; and ep_fp16's run: fp16 loss scaling at dp2 ep2
pp2 with an inf in one rank's expert gradient."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers as tf
from common import one_call_block_samples, out_dir, run_scenarios
from ep_parity import CONFIGS  # the tiny Qwen3-MoE and Mixtral (of this VOCAB)
from ep_reads import bytes_per_tensor, counting_reads, is_expert
from safetensors import safe_open

import merak
from merak.checkpoint.export import export_checkpoint
from merak.coverage.shrink import small_config
from merak.data_parallel.shards import is_sharded
from merak.expert_parallel import experts_modules
from merak.generation.generate import new_tokens
from merak.materialize.safetensors import read_header

VOCAB, SEQ, STEPS, SAVE_STEP, MICRO_BATCH, MICROBATCHES, SEED = 128, 12, 4, 2, 2, 2, 1234
DP = 2  # the rows of a step: MICRO_BATCH x MICROBATCHES x DP
# both trainers' fields (HF Trainer's micro-batch: one Merak rank's, DP x as many a step)
FIELDS = {"learning_rate": 1e-2, "logging_steps": 1, "seed": SEED, "max_grad_norm": 1.0,
          "train_sampling_strategy": "sequential", "report_to": "none", "disable_tqdm": True,
          "use_cpu": True, "per_device_train_batch_size": MICRO_BATCH,
          "per_device_eval_batch_size": MICRO_BATCH}
# three more families, trained only (no checkpoint, save or resume; the two above cover
# those): the coverage's small configs cut to 2 layers; DeepSeek-V3's first layer dense, its
# second with a shared expert and sigmoid routing limited to 1 of 2 groups of 2 experts;
# GPT-OSS's experts with per-expert biases and its own router
MORE = {"deepseek_v3": {"first_k_dense_replace": 1, "n_group": 2, "topk_group": 1},
        "olmoe": {}, "gpt_oss": {}}
SP_RUN = "trainer-qwen3_moe-dp2-ep2-tp2-sp"
OVERLAP_RUN = "trainer-qwen3_moe-dp2-ep2-tp2-overlap1"  # (MERAK_TEST_MATRIX=full)
# scenario -> (family, (dp, pp, ep, zero_stage, tp) trained, the same resumed or None[, more
# MerakArguments fields])
# (ZeRO-3 at dp2 ep2: the experts sharded over edp groups of one rank, the rest over both
# ranks, resumed at ep1 without ZeRO; tp2, resumed at dp4 ep2 under ZeRO-2: edp groups of 2)
RUNS = {2: {"trainer-qwen3_moe-dp2-ep2-zero3": ("qwen3_moe", (2, 1, 2, 3, 1), (2, 1, 1, 0, 1)),
            "trainer-mixtral-dp2-ep2": ("mixtral", (2, 1, 2, 0, 1), (2, 1, 1, 0, 1)),
            **{f"trainer-{family}-dp2-ep2": (family, (2, 1, 2, 0, 1), None) for family in MORE}},
        4: {"trainer-qwen3_moe-dp2-ep2-pp2": ("qwen3_moe", (2, 2, 2, 0, 1), (4, 1, 2, 1, 1)),
            # each expert split over tp too (Qwen3-MoE's plan: moe_tp_experts)
            "trainer-qwen3_moe-dp2-ep2-tp2": ("qwen3_moe", (2, 1, 2, 0, 2), (4, 1, 2, 2, 1)),
            # with sequence parallelism: the MoE blocks run whole on the tp ranks' sequences
            SP_RUN: ("qwen3_moe", (2, 1, 2, 0, 2), None, {"sequence_parallel": True}),
            # one expert per rank over an ep group of 4, resumed at dp2 ep2 pp2 under ZeRO-1
            "trainer-qwen3_moe-dp4-ep4": ("qwen3_moe", (4, 1, 4, 0, 1), (2, 2, 2, 1, 1))}}
if os.environ.get("MERAK_TEST_MATRIX") == "full":
    # the same at pp=2 over 8 ranks, resumed at ep=2 under ZeRO-1
    RUNS[8] = {"trainer-qwen3_moe-dp4-ep4-pp2": ("qwen3_moe", (4, 2, 4, 0, 1), (4, 2, 2, 1, 1))}
    # Mixtral and the three more, trained only: at pp2 and at tp2 (4 ranks), and at dp4 ep4
    # pp2 (8 ranks: one of the 4 experts a rank; DeepSeek-V3's 2 groups of 2 experts then
    # span 2 ranks each, its dense first layer the first stage's)
    RUNS[4].update({f"trainer-{family}-dp2-ep2-{kind}": (family, layout, None)
                    for family in ("mixtral", *MORE)
                    for kind, layout in (("pp2", (2, 2, 2, 0, 1)), ("tp2", (2, 1, 2, 0, 2)))})
    RUNS[8].update({f"trainer-{family}-dp4-ep4-pp2": (family, (4, 2, 4, 0, 1), None)
                    for family in ("mixtral", *MORE)})
    # TP overlap level 1: the attention's TP layers all-reduce per sub-batch of rows
    RUNS[4][OVERLAP_RUN] = ("qwen3_moe", (2, 1, 2, 0, 2), None, {"tp_overlapping_level": 1})
    # sequence parallelism (GPT-OSS's inferred TP plan has none: refused)
    RUNS[4].update({f"trainer-{f}-dp2-ep2-tp2-sp": (f, (2, 1, 2, 0, 2), None, {
        "sequence_parallel": True}) for f in ("mixtral", "deepseek_v3", "olmoe")})


def config(family: str):
    """The family's tiny config (see CONFIGS and MORE), load-balancing loss on."""
    if family in CONFIGS:
        return CONFIGS[family]()
    made = small_config(family)
    made.num_hidden_layers = 2
    if getattr(made, "layer_types", None):
        made.layer_types = made.layer_types[:2]
    for key, value in {**MORE[family], "output_router_logits": True,
                       "router_aux_loss_coef": 0.1}.items():
        setattr(made, key, value)
    return made


def rows(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """`count` rows right-padded to SEQ, lengths 5..12, attention_mask 0 and labels -100 on the
    pads."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (count, SEQ), generator=g)
    out = []
    for r in range(count):
        length = 5 + (5 * r) % (SEQ - 4)
        mask = (torch.arange(SEQ) < length).long()
        row = ids[r] * mask
        out.append({"input_ids": row, "attention_mask": mask,
                    "labels": row.masked_fill(mask == 0, -100)})
    return out


def train_set() -> list[dict]:
    return rows(STEPS * MICRO_BATCH * MICROBATCHES * DP, 7)


def eval_set() -> list[dict]:
    return rows(2 * MICRO_BATCH * DP, 8)


def save_hub(family: str, path: Path) -> None:
    """The seeded model, its weights moved off their initialization, as `save_pretrained`
    writes it (Mixtral's experts as the Hub's per-expert tensors)."""
    torch.manual_seed(SEED)
    model = tf.AutoModelForCausalLM.from_config(config(family))
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=g))
    model.save_pretrained(path)


def hub_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def hub_sizes(path: Path) -> dict[str, int]:
    """Checkpoint tensor name -> its bytes."""
    sizes = {}
    for file in Path(path).glob("*.safetensors"):
        _, header = read_header(file)
        sizes.update({n: i["data_offsets"][1] - i["data_offsets"][0] for n, i in header.items()})
    return sizes


def logged(trainer, keys: tuple[str, ...] = ("loss", "grad_norm")) -> dict[str, list[float]]:
    steps = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return {key: [h[key] for h in steps] for key in keys}


def _trainer(hub: Path, output: Path, layout: tuple[int, int, int, int], **fields):
    dp, pp, ep, zero, tp = layout
    merak.init(dp=dp, tp=tp, pp=pp, ep=ep)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_pretrained(hub)
    args = merak.MerakArguments(output_dir=str(output), max_steps=STEPS,
                                gradient_accumulation_steps=MICRO_BATCH * MICROBATCHES * DP
                                // (MICRO_BATCH * dp), zero_stage=zero, **FIELDS, **fields)
    return merak.MerakTrainer(model=model, args=args, train_dataset=train_set(),
                              eval_dataset=eval_set())


def run(family: str, trained: tuple[int, ...], resumed: tuple[int, ...] | None,
        fields: dict | None = None) -> dict:
    name = "-".join(map(str, trained)) + "".join(f"-{key}" for key in fields or ())
    root = out_dir() / f"trainer-{family}-{name}"
    hub = root / "hub"
    if dist.get_rank() == 0:
        save_hub(family, hub)
    dist.barrier()
    routed: list[int] = []  # the rows each router call of the rank's MoE layers saw

    def count_rows(module, args):
        if type(module).__name__.lower().endswith("topkrouter") and type(args[0]) is torch.Tensor:
            # (tokens: DeepSeek-V3's router takes [batch, seq, hidden]; not the split's traces)
            routed.append(args[0].numel() // args[0].shape[-1])

    hook = torch.nn.modules.module.register_module_forward_pre_hook(count_rows)
    with counting_reads() as log:  # what this rank's stage read from the hub's files
        trainer = _trainer(hub, root / "merak", trained, save_strategy="no" if resumed is None
                           else "steps", save_steps=SAVE_STEP, **fields or {})
        trainer.train()
    hook.remove()
    read, sizes = bytes_per_tensor(log), hub_sizes(hub)
    curve = logged(trainer)
    experts = [p for module in experts_modules(trainer.stage).values()
               for p in module.parameters(recurse=False)
               if getattr(p, "ep_shard", None) is not None]
    held = {f"{mname}.{name}": [p.numel(), math.prod(p.ep_shard.full_shape)]
            for mname, module in experts_modules(trainer.stage).items()
            for name, p in module.named_parameters(recurse=False)
            if getattr(p, "ep_shard", None) is not None}
    # ZeRO-2/3: the sizes of the groups sharding the experts and the other parameters
    zero_groups = {kind: sorted({p.device_mesh.size() for p in trainer.stage.parameters()
                                 if is_sharded(p) and getattr(p, "expert_parallel", False) == e})
                   for kind, e in (("dense", False), ("experts", True))}
    # bytes: of the hub's experts tensors read; of the whole experts tensors of the stage
    reads = {"experts": sum(n for name, n in read.items() if is_expert(name)),
             "stage_experts": sum(math.prod(p.ep_shard.full_shape) * p.element_size()
                                  for p in experts),
             "twice": sorted(name for name, n in read.items() if n > sizes[name])}
    if resumed is None:
        return {"curve": curve, "held": held, "hub": str(hub), "reads": reads,
                "zero_groups": zero_groups, "routed_rows": sorted(set(routed)),
                "sequence_parallel_blocks": sum(type(m).__name__.startswith("SequenceParallel")
                                                for m in trainer.stage.modules()),
                "overlapped_layers": sum("tp_overlap" in vars(m)
                                         for m in trainer.stage.modules()),
                "ep": trainer.ctx.ep, "tp": trainer.ctx.tp, "pp_rank": trainer.ctx.pp_rank}
    trainer.save_model(str(root / "saved"))
    evaluated = trainer.evaluate()["eval_loss"]
    same_export = None
    if dist.get_rank() == 0:
        saved = hub_tensors(root / "saved")
        exported = hub_tensors(export_checkpoint(root / "merak" / f"checkpoint-{STEPS}",
                                                 root / "exported"))
        same_export = sorted(exported) == sorted(saved) and all(
            torch.equal(exported[n], t) for n, t in saved.items())
    dist.barrier()
    again = _trainer(hub, root / "resumed", resumed, save_strategy="no")
    again.train(resume_from_checkpoint=str(root / "merak" / f"checkpoint-{SAVE_STEP}"))
    return {"curve": curve, "resumed": logged(again), "eval_loss": evaluated,
            "resumed_eval_loss": again.evaluate()["eval_loss"], "held": held,
            "dps": [trainer.ctx.dp, again.ctx.dp], "zero_groups": zero_groups,
            "optimizers": [type(t.optimizer).__name__ for t in (trainer, again)],
            "ep_rank": trainer.ctx.ep_rank if trainer.ctx.ep > 1 else 0, "reads": reads,
            "ep": trainer.ctx.ep, "tp": trainer.ctx.tp, "pp_rank": trainer.ctx.pp_rank,
            "saved": str(root / "saved"), "hub": str(hub), "same_export": same_export}


# MerakArguments(plan=...) choosing dp2 ep2 from merak.init's dp2 ep1 (`planned_run`)
PLANNED = "trainer-qwen3_moe-planned-dp2-ep2"


def planned_run() -> dict:
    """The tiny Qwen3-MoE from a job made at dp2 (ep1), trained by a plan file (what `merak
    plan` or auto_parallel writes) whose chosen layout is dp2 ep2: the trainer re-initializes
    at ep2; its curve and the share of each experts tensor it holds."""
    from merak.strategy.candidate import Candidate

    root = out_dir() / PLANNED
    hub, plan = root / "hub", root / "plan.json"
    chosen = Candidate(DP, 1, 1, MICRO_BATCH, MICROBATCHES, ep=2)
    if dist.get_rank() == 0:
        save_hub("qwen3_moe", hub)
        plan.write_text(json.dumps({"chosen": dataclasses.asdict(chosen),
                                    "global_batch": DP * MICRO_BATCH * MICROBATCHES}))
    dist.barrier()
    merak.init(dp=DP, tp=1, pp=1)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_pretrained(hub)
    fields = {**FIELDS, "per_device_train_batch_size": DP * MICRO_BATCH * MICROBATCHES}
    args = merak.MerakArguments(output_dir=str(root / "merak"), max_steps=STEPS,
                                save_strategy="no", plan=str(plan), **fields)
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set())
    trainer.train()
    held = [[p.numel(), math.prod(p.ep_shard.full_shape)] for p in trainer.stage.parameters()
            if getattr(p, "ep_shard", None) is not None]
    return {"curve": logged(trainer), "hub": str(hub), "held": held,
            "layout": [trainer.ctx.dp, trainer.ctx.ep, trainer.ctx.tp, trainer.ctx.pp]}


# MerakTrainer(auto_parallel=True) on 4 ranks from merak.init(ep=2): the planner measures the
# model, dry-runs its best predicted ep2 candidate and trains it (`auto_run`)
AUTO = "trainer-qwen3_moe-auto-ep2"


def auto_run() -> dict:
    """The tiny Qwen3-MoE from a job made by ``merak.init(ep=2)`` (every rank data-parallel,
    the ep degree the planner keeps), planned by ``auto_parallel`` with 1 dry run: its
    curve, the layout the trainer re-initialized at, the plan.json it wrote and the share of
    each experts tensor every rank holds."""
    root = out_dir() / AUTO
    hub = root / "hub"
    if dist.get_rank() == 0:
        save_hub("qwen3_moe", hub)
    dist.barrier()
    merak.init(ep=2)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_pretrained(hub)
    fields = {**FIELDS, "per_device_train_batch_size": DP * MICRO_BATCH * MICROBATCHES}
    args = merak.MerakArguments(output_dir=str(root / "merak"), max_steps=STEPS,
                                save_strategy="no", auto_parallel=True, plan_dry_runs=1,
                                **fields)
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set())
    # one call a block-cost sample (of about 0.1 s each: most of the plan's minute on 2 shared
    # cores); which ep2 layout wins is not the point, the test takes any
    with one_call_block_samples():
        trainer.train()
    held = [[p.numel(), math.prod(p.ep_shard.full_shape)] for p in trainer.stage.parameters()
            if getattr(p, "ep_shard", None) is not None]
    written = json.loads((root / "merak" / "plan.json").read_text())
    ctx = trainer.ctx
    return {"curve": logged(trainer), "hub": str(hub), "held": held,
            "plan": {key: written[key] for key in ("chosen", "measured", "ranked")},
            "layout": {"dp": ctx.dp, "ep": ctx.ep, "tp": ctx.tp, "pp": ctx.pp,
                       "micro_batch": args.per_device_train_batch_size,
                       "microbatches": args.gradient_accumulation_steps,
                       "pp_rank": ctx.pp_rank}}


def reference(hub: Path, out: Path, whole: bool = True, micro_batch: int = MICRO_BATCH
              ) -> tuple[dict[str, list[float]], float | None, dict | None]:
    """Single-process HF Trainer from `hub` on the same rows, a Merak rank's micro-batch each
    (`micro_batch` rows: the load-balancing loss is per micro-batch), as many as make a step's
    DP x MICRO_BATCH x MICROBATCHES rows: its logged losses and gradient norms, its eval loss
    and what its `save_model` writes. Run by the test, outside torchrun (under it, HF
    Trainer would join the job's process group)."""
    args = tf.TrainingArguments(output_dir=str(out), max_steps=STEPS, save_strategy="no",
                                gradient_accumulation_steps=DP * MICRO_BATCH * MICROBATCHES
                                // micro_batch,
                                **{**FIELDS, "per_device_train_batch_size": micro_batch})
    trainer = tf.Trainer(model=tf.AutoModelForCausalLM.from_pretrained(hub), args=args,
                         train_dataset=train_set(), eval_dataset=eval_set())
    trainer.train()
    if not whole:  # (the training curve only)
        return logged(trainer), None, None
    trainer.save_model(str(out / "final"))
    return logged(trainer), trainer.evaluate()["eval_loss"], hub_tensors(out / "final")


# TRL's SFTTrainer through MerakTrainer at dp2 ep2 (`sft_run`): scenario -> SFTConfig fields
# (router_aux_loss_coef=0: TRL then turns the router logits off, so the single-process
# reference's micro-batches, which hold both dp ranks' rows, give the same loss)
SFT_RUNS = {"sft-qwen3_moe-dp2-ep2": {"router_aux_loss_coef": 0.0}}


def sft_run(name: str, fields: dict) -> dict:
    """``class MerakSFTTrainer(MerakTrainer, SFTTrainer)`` on the tiny Qwen3-MoE of
    `sft_common` (built under `init_empty_weights`) at dp2 ep2: its logged metrics, the share
    of each experts tensor every rank holds, and greedy `generate` of `sft_common.prompts`
    after training."""
    import sft_common as sft
    import trl

    Config, MerakSFTTrainer = sft.merak_classes(trl.SFTConfig, trl.SFTTrainer)
    merak.init(dp=2, tp=1, pp=1, ep=2)
    with merak.init_empty_weights():
        model = sft.moe_model()
    args = Config(output_dir=str(out_dir() / name),
                  per_device_train_batch_size=sft.GLOBAL_MICRO_BATCH // 2, **sft.FIELDS,
                  **fields)
    trainer = MerakSFTTrainer(model=model, args=args, train_dataset=sft.dataset(),
                              processing_class=sft.tokenizer())
    trainer.train()
    held = {name: [p.numel(), math.prod(p.ep_shard.full_shape)]
            for name, p in trainer.stage.named_parameters()
            if getattr(p, "ep_shard", None) is not None}
    # greedy, after training: each dp rank decodes one prompt, in lockstep over the ep group
    generated = trainer.generate(sft.prompts(), max_new_tokens=sft.NEW_TOKENS)
    return {**sft.logged(trainer.state.log_history), "held": held, "generated": generated}


def sft_reference(fields: dict, out: Path) -> dict:
    """Plain single-process SFTTrainer on the same model and rows, its micro-batches the dp
    ranks' micro-batches together (`sft_common.reference_order`), and HF greedy `generate` of
    each prompt with the trained model; run by the test."""
    import sft_common as sft
    import trl

    args = trl.SFTConfig(output_dir=str(out),
                         per_device_train_batch_size=sft.GLOBAL_MICRO_BATCH,
                         **{**sft.FIELDS, **fields})
    trainer = trl.SFTTrainer(model=sft.moe_model(), args=args,
                             train_dataset=sft.dataset(sft.reference_order(2)),
                             processing_class=sft.tokenizer())
    trainer.train()
    model = trainer.model.eval()
    generated = []
    for ids in sft.prompts():  # greedy, as MerakTrainer.generate
        out = model.generate(torch.tensor([ids]), max_new_tokens=sft.NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
        generated.append(new_tokens(out[0, len(ids):], {model.generation_config.eos_token_id}))
    return {**sft.logged(trainer.state.log_history), "generated": generated}


def scenarios(world_size: int) -> dict:
    out = {name: (lambda spec=spec: run(*spec)) for name, spec in RUNS.get(world_size, {}).items()}
    if world_size == 2:
        out.update({name: (lambda name=name, fields=fields: sft_run(name, fields))
                    for name, fields in SFT_RUNS.items()})
        out[PLANNED] = planned_run
    if world_size == 4:
        from ep_fp16 import FP16_RUN, fp16_run  # (it imports this module)

        out[AUTO], out[FP16_RUN] = auto_run, fp16_run
    return out


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
