"""Resume a dp2 x tp2 x pp2 ZeRO-3 checkpoint with 2 chunks per rank (trainer_parity's
RESHARD_SOURCE run) on 4 ranks as dp1 x tp1 x pp4 and dp4 x tp1 x pp1 under ZeRO-2: the next step's
loss against the one the original run logged; `merak export` of the same checkpoint loaded with
`from_pretrained`, its loss against that one too (test_trainer compares them). The same launch
makes trainer_parity's dp2 x pp2 runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import transformers as tf
from common import Compared, run_scenarios
from trainer_common import (
    COMMON,
    DP,
    MICRO_BATCH,
    RESHARD_SAVE_STEP,
    RESHARD_SOURCE,
    build_deep_llama,
    fine_tuning_set,
    train_set,
)

import merak
from merak.checkpoint.export import export_checkpoint

OUT = Path(os.environ["MERAK_TRAINER_OUT"])
CHECKPOINT = OUT / RESHARD_SOURCE / f"checkpoint-{RESHARD_SAVE_STEP}"
GLOBAL_BATCH = MICRO_BATCH * COMMON["gradient_accumulation_steps"] * DP


def expected_next_loss() -> float:
    return json.loads((OUT / f"merak-{RESHARD_SOURCE}.json").read_text())["loss"][
        RESHARD_SAVE_STEP]  # step RESHARD_SAVE_STEP + 1's


def resume(dp: int, pp: int, **fields) -> dict:
    ctx = merak.init(dp=dp, tp=1, pp=pp)
    with merak.init_empty_weights():
        model = build_deep_llama()
    options = {**COMMON, "max_steps": RESHARD_SAVE_STEP + 1,
               "gradient_accumulation_steps": GLOBAL_BATCH // (MICRO_BATCH * dp)}
    args = merak.MerakArguments(output_dir=str(OUT / f"resharded-dp{dp}-pp{pp}"),
                                per_device_train_batch_size=MICRO_BATCH, save_strategy="no",
                                no_load_optim=True, **options, **fields)
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=fine_tuning_set())
    trainer.train(resume_from_checkpoint=str(CHECKPOINT))
    logs = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    compared = Compared()
    compared.value(f"step {RESHARD_SAVE_STEP + 1} loss after resharding to dp{dp} pp{pp}",
                   logs[RESHARD_SAVE_STEP + 1], expected_next_loss())
    return compared.figures(layout=[ctx.dp, ctx.tp, ctx.pp])


def export_and_load() -> dict:
    ctx = merak.init(dp=1, tp=1, pp=4)
    compared = Compared()
    if ctx.rank == 0:  # (the others have nothing to compare)
        out = export_checkpoint(CHECKPOINT, OUT / "exported")
        model = tf.AutoModelForCausalLM.from_pretrained(out)
        start = RESHARD_SAVE_STEP * GLOBAL_BATCH
        batch = tf.default_data_collator(fine_tuning_set()[start:start + GLOBAL_BATCH])
        compared.value("exported model's loss", model(**batch).loss.item(),
                       expected_next_loss())
    return compared.figures()


def from_pretrained() -> dict:
    """A model loaded with from_pretrained inside init_empty_weights holds no memory; each rank
    loads its own shard when the trainer builds it: step 1's loss is the full model's."""
    ctx = merak.init(dp=1, tp=2, pp=2)
    path = os.environ["MERAK_PRETRAINED"]
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_pretrained(path)
    all_meta = all(p.is_meta for p in model.parameters())
    args = merak.MerakArguments(output_dir=str(OUT / "pretrained"),
                                per_device_train_batch_size=MICRO_BATCH, parallel_vocab=True,
                                **{**COMMON, "max_steps": 1})
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set())
    trainer.train()
    first = trainer.state.log_history[0]["loss"]
    full = tf.AutoModelForCausalLM.from_pretrained(path)
    batch = tf.default_data_collator(train_set()[:GLOBAL_BATCH // DP])
    compared = Compared()
    compared.value("step 1 loss", first, full(**batch).loss.item())
    return compared.figures(loaded_on_meta=all_meta, layout=[ctx.dp, ctx.tp, ctx.pp])


def scenarios(world_size: int) -> dict:
    import trainer_parity  # the HF Trainer parity runs at dp2 x pp2 share this launch
    from trainer_common import DP2_PP2_RUNS

    assert world_size == 4, f"trainer_reshard runs on 4 ranks, not {world_size}"
    return {**{f"trainer-{r}": (lambda r=r: trainer_parity.run(r)) for r in DP2_PP2_RUNS},
            "reshard-dp1-tp1-pp4": lambda: resume(1, 4),
            "reshard-dp4-tp1-pp1": lambda: resume(4, 1, zero_stage=2),
            "export-from_pretrained": export_and_load,
            "from_pretrained-on-meta": from_pretrained}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
