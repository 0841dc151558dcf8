"""TRL's SFTTrainer through MerakTrainer: ``class MerakSFTTrainer(MerakTrainer,
SFTTrainer)`` with ``@dataclass class Config(MerakArguments, SFTConfig)`` on plain text rows
of varying length (padded per step) at (dp, tp, pp) = (1,2,2) and (2,1,2), without and with
LoRA adapters through SFTTrainer's own ``peft_config``, and at (2,2,2) through
``MerakArguments.lora_config`` (test_peft_adapters). SFTTrainer's
compute_loss runs on the last stage; each run writes its logged losses, grad norms and TRL's
metrics to ``merak-<scenario>.json`` for test_trainer_subclasses to compare with single-process
SFTTrainer."""

from __future__ import annotations

import json
import os

import dpo_common as dpo
import kto_common as kto
import sft_common as sft
import torch.distributed as dist
from common import out_dir, run_scenarios

import merak


def run(name: str, layout: tuple[int, int, int], peft_config=None, **fields) -> None:
    import trl

    Config, MerakSFTTrainer = sft.merak_classes(trl.SFTConfig, trl.SFTTrainer)
    dp, tp, pp = layout
    merak.init(dp=dp, tp=tp, pp=pp)
    with merak.init_empty_weights():
        model = sft.model()
    args = Config(output_dir=str(out_dir() / name),
                  per_device_train_batch_size=sft.GLOBAL_MICRO_BATCH // dp, **sft.FIELDS,
                  **fields)
    # each micro-batch holds the rows of the reference's (`sft.reference_order`): at dp 2 the
    # dp ranks' micro-batch i together, at dp 1 the rows put in that order
    order = None if dp == 2 else sft.reference_order(2)
    trainer = MerakSFTTrainer(model=model, args=args, train_dataset=sft.dataset(order),
                              processing_class=sft.tokenizer(), peft_config=peft_config)
    trainer.train()
    logged = sft.logged(trainer.state.log_history)
    if name in sft.GENERATE:  # greedy, with the trained adapters, one prompt at a time
        logged["generated"] = [trainer.generate([ids], max_new_tokens=sft.NEW_TOKENS)[0]
                               for ids in sft.prompts()]
    if dist.get_rank() == 0:
        (out_dir() / f"merak-{name}.json").write_text(json.dumps(logged))


def run_dpo(name: str, layout: tuple[int, int, int] | None, lora: bool = False, fields=None,
            pretrained: bool = False, evaluate: bool = False, reference: bool = False) -> None:
    """MerakDPOTrainer on a model built on the meta device (with `pretrained`, loaded with
    from_pretrained inside init_empty_weights): the reference log-probabilities are a pipelined
    evaluation pass before training, with and without precompute_ref_log_probs (with `lora`,
    LoRA adapters through DPOTrainer's peft_config, off in that pass; with `reference`, an
    explicit ref_model, dpo_common.save_reference's, meta-built too)."""
    import trl

    Config, MerakDPOTrainer = sft.merak_classes(trl.DPOConfig, trl.DPOTrainer)
    # no layout (auto_parallel): from pure data parallelism, a step's global batch given whole,
    # the rows in order (a DPO step's loss and metrics are means over its equal micro-batches)
    dp, tp, pp = layout or (1, 1, 1)
    merak.init() if layout is None else merak.init(dp=dp, tp=tp, pp=pp)
    args = Config(output_dir=str(out_dir() / name),
                  per_device_train_batch_size=dpo.GLOBAL_MICRO_BATCH // dp,
                  per_device_eval_batch_size=dpo.GLOBAL_MICRO_BATCH // dp,
                  **{**dpo.FIELDS, **(fields or {})})
    order = None if dp == 2 or layout is None else dpo.reference_order(2)
    path, reference_path = out_dir() / "dpo-policy", out_dir() / "dpo-reference"
    if pretrained and dist.get_rank() == 0 and not path.exists():
        dpo.save_policy(path)
    if reference and dist.get_rank() == 0 and not reference_path.exists():
        dpo.save_reference(reference_path)
    dist.barrier()
    with merak.init_empty_weights():
        model = dpo.policy(str(path) if pretrained else None)
        ref_model = dpo.policy(str(reference_path)) if reference else None
    trainer = MerakDPOTrainer(model=model, args=args, train_dataset=dpo.dataset(order),
                              ref_model=ref_model,
                              eval_dataset=dpo.eval_dataset() if evaluate else None,
                              processing_class=sft.tokenizer(),
                              peft_config=sft.peft_config(dpo.LORA_TARGETS) if lora else None)
    trainer.train()
    figures = dpo.logged(trainer.state.log_history)
    if reference:  # rank 0's replica (stage 0's first tp shard), held for the pass only
        figures["replica_bytes"] = trainer.reference_replica_bytes
    if evaluate:  # held-out rows, in steps of the dp ranks' micro-batches
        figures["eval"] = dpo.evaluated(trainer.evaluate())
    if dist.get_rank() == 0:
        (out_dir() / f"merak-{name}.json").write_text(json.dumps(figures))


def run_kto(name: str, layout: tuple[int, int, int], lora: bool = False, fields=None,
            pretrained: bool = False, evaluate: bool = False, reference: bool = False) -> None:
    """MerakKTOTrainer on a model built on the meta device (with `pretrained`, loaded with
    from_pretrained inside init_empty_weights): each micro-batch's completions and mismatched KL
    completions run as rows of one pipeline forward; the reference log-probabilities of both are
    a pipelined evaluation pass before training (with `lora`, its adapters off; with
    `reference`, an explicit ref_model's replica, dpo_common.save_reference's, meta-built)."""
    import trl

    Config, MerakKTOTrainer = sft.merak_classes(trl.KTOConfig, trl.KTOTrainer)
    dp, tp, pp = layout
    merak.init(dp=dp, tp=tp, pp=pp)
    args = Config(output_dir=str(out_dir() / name),
                  per_device_train_batch_size=kto.MICRO_BATCH // dp,
                  per_device_eval_batch_size=kto.MICRO_BATCH // dp,
                  **{**kto.FIELDS, **(fields or {})})
    # (the policy and reference DPO's runs save)
    path, reference_path = out_dir() / "dpo-policy", out_dir() / "dpo-reference"
    if pretrained and dist.get_rank() == 0 and not path.exists():
        dpo.save_policy(path)
    if reference and dist.get_rank() == 0 and not reference_path.exists():
        dpo.save_reference(reference_path)
    dist.barrier()
    with merak.init_empty_weights():
        model = dpo.policy(str(path) if pretrained else None)
        ref_model = dpo.policy(str(reference_path)) if reference else None
    trainer = MerakKTOTrainer(model=model, args=args, train_dataset=kto.dataset(),
                              ref_model=ref_model,
                              eval_dataset=kto.eval_dataset() if evaluate else None,
                              processing_class=sft.tokenizer(),
                              peft_config=sft.peft_config(kto.LORA_TARGETS) if lora else None)
    trainer.train()
    figures = kto.logged(trainer.state.log_history)
    if evaluate:
        figures["eval"] = dpo.evaluated(trainer.evaluate())
    if dist.get_rank() == 0:
        (out_dir() / f"merak-{name}.json").write_text(json.dumps(figures))


def scenarios(world_size: int) -> dict:
    # lora_config's adapters, against single-process peft_config's
    configured = {name: (lambda name=name, layout=layout, targets=targets: run(
                      name, layout, lora_config=json.dumps(sft.lora_fields(targets))))
                  for name, (layout, targets) in sft.LORA_CONFIG_LAYOUTS.items()
                  if layout[0] * layout[1] * layout[2] == world_size}
    if world_size != 4:
        return configured
    plain = {name: (lambda name=name, layout=layout: run(name, layout))
             for name, layout in sft.LAYOUTS.items()}
    # TRL adds the adapters to the meta model inside its __init__ (peft_config)
    adapted = {name: (lambda name=name, layout=layout, targets=targets:
                      run(name, layout, sft.peft_config(targets)))
               for name, (layout, targets) in sft.LORA_LAYOUTS.items()}
    preference = {name: (lambda name=name, layout=layout: run_dpo(name, layout))
                  for name, layout in dpo.LAYOUTS.items()}
    preference.update({name: (lambda name=name, v=variant: run_dpo(name, *v))
                       for name, variant in dpo.VARIANTS.items()})
    preference.update({name: (lambda name=name, v=variant: run_dpo(name, *v, evaluate=True))
                       for name, variant in dpo.EVALUATED.items()})
    preference.update({name: (lambda name=name, v=variant: run_dpo(name, *v, reference=True))
                       for name, variant in dpo.REFERENCED.items()})
    preference.update({name: (lambda name=name, v=variant: run_dpo(name, *v, reference=True))
                       for name, variant in dpo.PLANNED.items()})
    preference.update({name: (lambda name=name, run=run: run_kto(name, *run))
                       for name, run in kto.RUNS.items()})
    preference.update({name: (lambda name=name, run=run: run_kto(name, *run, evaluate=True))
                       for name, run in kto.EVALUATED.items()})
    preference.update({name: (lambda name=name, run=run: run_kto(name, *run, reference=True))
                       for name, run in kto.REFERENCED.items()})
    variants = {name: (lambda name=name, layout=layout, fields=fields: run(name, layout, **fields))
                for name, (layout, fields) in sft.LOSS_TYPES.items()}  # loss_type="dft"
    return {**plain, **adapted, **preference, **variants, **configured}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
