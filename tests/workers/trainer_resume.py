"""Kill-and-resume with MerakTrainer (GPT-2 with dropout; dp=1 x tp=2 x pp=2, and dp=2 x pp=2
with ZeRO-3 in fp16): a run that saves at step 3 and crashes while writing its step-6 checkpoint
resumes from step 3; the losses of both and of an uninterrupted run go to test_trainer, which
asserts steps 4-6 are the same."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from unittest import mock

import torch
import transformers as tf
from common import run_scenarios
from hf_models import VOCAB
from trainer_common import dataset

import merak

STEPS, SAVE, SEED = 6, 3, 77


def build():
    torch.manual_seed(SEED)
    return tf.AutoModelForCausalLM.from_config(tf.GPT2Config(
        n_embd=64, n_layer=2, n_head=8, vocab_size=VOCAB, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.1, bos_token_id=0, eos_token_id=0))


class SimulatedCrash(RuntimeError):
    pass


def trainer(output_dir: str, **kwargs) -> merak.MerakTrainer:
    with merak.init_empty_weights():
        model = build()
    options = {"max_steps": STEPS, "per_device_train_batch_size": 4 // merak.get_context().dp,
               "gradient_accumulation_steps": 2, "learning_rate": 1e-3, "logging_steps": 1,
               "seed": SEED, "report_to": "none", "disable_tqdm": True, "use_cpu": True}
    args = merak.MerakArguments(output_dir=output_dir, **{**options, **kwargs})
    return merak.MerakTrainer(model=model, args=args, train_dataset=dataset(4 * STEPS, 5))


def losses(t: merak.MerakTrainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}


def kill_and_resume(dp: int = 1, tp: int = 2, **fields) -> dict:
    """An uninterrupted run's losses; a run killed while writing its step-6 checkpoint (the
    checkpoint names it left, whether the crash happened); the resumed run's losses and
    warnings; a `finetune` run's logged steps (not with ZeRO fields)."""
    merak.init(dp=dp, tp=tp, pp=2)
    # one directory all ranks write into
    shared = Path(os.environ["MERAK_RESUME_DIR"]) / f"dp{dp}-tp{tp}"
    out = str(shared / "run")
    plain = trainer(str(shared / "plain"), save_strategy="no", **fields)
    plain.train()
    figures = {"uninterrupted": losses(plain),
               "skipped_steps": plain.engine.scaler.skipped_steps
               if plain.engine.scaler is not None else None}
    crashing = trainer(out, save_steps=SAVE, save_total_limit=1, **fields)
    real_save = torch.save

    def crash_on_second_save(obj, path, *a, **k):
        if f"checkpoint-{STEPS}" in str(path):
            Path(path).write_bytes(b"half")
            raise SimulatedCrash(f"killed while saving step {STEPS}")
        real_save(obj, path, *a, **k)

    figures["crashed"] = False
    with mock.patch("torch.save", crash_on_second_save):
        try:
            crashing.train()
        except SimulatedCrash:
            figures["crashed"] = True
    figures["left"] = sorted(p.name for p in Path(out).iterdir())
    resumed = trainer(out, save_strategy="no", **fields)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.train(resume_from_checkpoint=True)
    figures["warnings"] = [str(w.message) for w in caught]
    figures["resumed"] = losses(resumed)
    if not fields:  # (finetune is not ZeRO's business)
        finetuned = trainer(out, save_strategy="no", finetune=True, max_steps=1)
        finetuned.train(resume_from_checkpoint=str(Path(out) / f"checkpoint-{SAVE}"))
        figures["finetuned_steps"] = list(losses(finetuned))
    return figures


def scenarios(world_size: int) -> dict:
    assert world_size == 4, f"trainer_resume runs on 4 ranks, not {world_size}"
    return {"kill-and-resume": kill_and_resume,
            "kill-and-resume-zero3-fp16": lambda: kill_and_resume(
                dp=2, tp=1, zero_stage=3, fp16=True, initial_scale_power=12)}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
