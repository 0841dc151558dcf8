"""MoE checkpoints in the Hub's per-expert layout through MerakTrainer at dp1 x tp2 x pp2 and
(MERAK_TEST_MATRIX=full) dp2 x tp2 x pp2 (test_checkpoint_conversion): a Mixtral / Qwen3-MoE
(with MERAK_TEST_MATRIX=full also a Qwen2-MoE, OLMoE, PhiMoE and DeepSeek-V3) that
`save_pretrained` wrote is loaded
with `from_pretrained` on meta, each rank derives its own stage's fused experts from the
per-expert tensors; the logged losses equal single-process HF Trainer's on the same directory,
and both `save_model` and `merak export` of the step checkpoint write the per-expert tensors
that `save_pretrained` of HF's trained model writes (the test runs HF Trainer, `reference`,
and compares)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers as tf
from common import out_dir, run_scenarios
from safetensors import safe_open

import merak
from merak.checkpoint.export import export_checkpoint
from merak.coverage.shrink import VOCAB, small_config

STEPS, MICRO_BATCH, MICROBATCHES, SEQ, SEED = 2, 2, 2, 16, 1234
COMMON = {"max_steps": STEPS, "learning_rate": 1e-3, "logging_steps": 1, "seed": SEED,
          "train_sampling_strategy": "sequential", "gradient_accumulation_steps": MICROBATCHES,
          "report_to": "none", "disable_tqdm": True, "use_cpu": True, "save_strategy": "steps",
          "save_steps": STEPS}
FULL = os.environ.get("MERAK_TEST_MATRIX") == "full"
# the suite trains two families at dp1 (one 4-rank launch); the full run all six at dp1 and dp2
FAMILIES = ("mixtral", "qwen3_moe", *(("qwen2_moe", "olmoe", "phimoe", "deepseek_v3")
                                      if FULL else ()))
DP_OF_WORLD = {4: 1, 8: 2} if FULL else {4: 1}  # tp2 x pp2 x dp


def train_set(dp: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB - 1, (STEPS * MICRO_BATCH * MICROBATCHES * dp, SEQ),
                        generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def hub_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors files, by stored name."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def reference(hub: Path, out: Path, dp: int = 1
              ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """HF Trainer on one process from the same directory, in the same micro-batches (see
    merak.coverage.trainer_check.reference: its MoE loss depends on them; dp x gradient
    accumulation of them a step): its logged losses and the tensors its save_model
    (save_pretrained) writes. Run by the test, outside torchrun (under it, HF Trainer would join
    the job's process group)."""
    options = {**COMMON, "gradient_accumulation_steps": MICROBATCHES * dp}
    args = tf.TrainingArguments(output_dir=str(out), per_device_train_batch_size=MICRO_BATCH,
                                **options)
    trainer = tf.Trainer(model=tf.AutoModelForCausalLM.from_pretrained(hub), args=args,
                         train_dataset=train_set(dp))
    trainer.train()
    trainer.save_model(str(out / "final"))
    return losses(trainer), hub_tensors(out / "final")


def run(family: str, dp: int) -> None:
    ctx = merak.init(dp=dp, tp=2, pp=2)
    root = out_dir() / family
    hub = root / "hub"
    if ctx.rank == 0:
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(small_config(family)).save_pretrained(hub)
    dist.barrier()
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_pretrained(hub)
    args = merak.MerakArguments(output_dir=str(root / "merak"),
                                per_device_train_batch_size=MICRO_BATCH, **COMMON)
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set(dp))
    trainer.train()
    trainer.save_model(str(root / "saved"))
    if ctx.rank == 0:
        (root / "merak-losses.json").write_text(json.dumps(losses(trainer)))
        saved = hub_tensors(root / "saved")
        assert any(".experts.0." in n for n in saved), "save_model wrote fused experts"
        exported = export_checkpoint(root / "merak" / f"checkpoint-{STEPS}", root / "exported")
        exported = hub_tensors(exported)
        assert sorted(exported) == sorted(saved), sorted(set(exported) ^ set(saved))[:8]
        for name, tensor in saved.items():
            torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)
    dist.barrier()


def scenarios(world_size: int) -> dict:
    if world_size not in DP_OF_WORLD:
        return {}
    return {f"trainer-{family}": (lambda family=family: run(family, DP_OF_WORLD[world_size]))
            for family in FAMILIES}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
