"""Adapters wherever they come from: peft LoRA adapters that TRL's
``SFTTrainer(peft_config=...)`` adds to a meta model inside its ``__init__`` are initialized as
peft initializes them on the whole single-process model at that point, and trained at parity
at (1,2,2) and (2,1,2) (scenarios of the pooled 4-rank launch, workers/trainer_subclasses.py);
``lora_config`` adapters made after ``set_seed(args.seed)`` match peft even when that seed is
the one the model was built from, and train at parity at (2,2,2) (the pooled 8-rank launch);
adapters added outside Merak's record are refused by name."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import sft_common as sft
import torch
from dist_harness import check

import merak
from merak import lora
from merak.materialize.meta import materialize_

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

WORKER = "trainer_subclasses.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (4, 8)
# scenario -> (world size, targets): TRL's peft_config on 4 ranks, lora_config on 4 and 8
SCENARIOS = {**{name: (4, targets) for name, (_, targets) in sft.LORA_LAYOUTS.items()},
             **{name: (dp * tp * pp, targets)
                for name, ((dp, tp, pp), targets) in sft.LORA_CONFIG_LAYOUTS.items()}}


@dataclass
class Config(merak.MerakArguments, trl.SFTConfig):
    pass


class MerakSFTTrainer(merak.MerakTrainer, trl.SFTTrainer):
    pass


def _reference(targets, order=None, train: bool = True) -> trl.SFTTrainer:
    """Plain single-process SFTTrainer with the same peft_config."""
    args = trl.SFTConfig(output_dir="out", per_device_train_batch_size=sft.GLOBAL_MICRO_BATCH,
                         **sft.FIELDS)
    trainer = trl.SFTTrainer(model=sft.model(), args=args, train_dataset=sft.dataset(order),
                             processing_class=sft.tokenizer(),
                             peft_config=sft.peft_config(targets))
    if train:
        trainer.train()
    return trainer


@pytest.mark.parametrize(("world_size", "scenario"),
                         [(size, name) for name, (size, _) in SCENARIOS.items()])
def test_adapters_train_as_single_process_sft_with_peft_config(launches, worker_pool,
                                                               world_size, scenario):
    """TRL's peft_config at (1,2,2) and (2,1,2), and lora_config at (1,2,2) (then greedy
    generation) and (2,2,2), against
    single-process SFTTrainer with the same peft_config (both make the adapters right after
    set_seed(args.seed))."""
    results, output = launches(world_size)
    check(results, output, scenario)
    ours = json.loads((worker_pool.out_dir(WORKER, world_size) / f"merak-{scenario}.json"
                       ).read_text())
    targets = SCENARIOS[scenario][1]
    trained = _reference(targets, sft.reference_order(2))
    reference = sft.logged(trained.state.log_history)
    print(f"{scenario}: loss merak {ours['loss']} reference {reference['loss']}")
    assert len(ours["loss"]) == len(reference["loss"]) == sft.STEPS
    assert reference["loss"][0] != reference["loss"][-1]  # the adapters learned
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
        assert ours[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key
    if scenario in sft.GENERATE:  # greedy trainer.generate = HF generate of the trained model
        model = trained.model.eval()
        with torch.no_grad():
            theirs = [model.generate(input_ids=torch.tensor([ids]), do_sample=False,
                                     max_new_tokens=sft.NEW_TOKENS, pad_token_id=0,
                                     eos_token_id=None)[0, len(ids):].tolist()
                      for ids in sft.prompts()]
        print(f"{scenario}: generated merak {ours['generated']} HF {theirs}")
        assert ours["generated"] == theirs


@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "v_proj")])
def test_trls_adapters_on_a_meta_model_are_peft_s_own(targets):
    """SFTTrainer's get_peft_model on a meta model (after its set_seed(args.seed), the seed the
    model was built from): materialized, every parameter equals single-process SFTTrainer's."""
    want = dict(_reference(targets, train=False).model.named_parameters())
    merak.init(dp=1, tp=1, pp=1)
    with merak.init_empty_weights():
        model = sft.model()
    trainer = MerakSFTTrainer(model=model, args=Config(output_dir="out", **sft.FIELDS),
                              train_dataset=sft.dataset(), processing_class=sft.tokenizer(),
                              peft_config=sft.peft_config(targets))
    materialize_(trainer.model)
    got = dict(trainer.model.named_parameters())
    assert set(got) == set(want)
    adapters = [n for n in got if ".lora_A." in n]
    assert len(adapters) == (14 if targets == "all-linear" else 4)
    for name, param in got.items():
        assert torch.equal(param, want[name]), name
    assert all(not torch.equal(got[n], torch.zeros_like(got[n])) for n in adapters)
    assert trainer._lora is not None  # saves write the adapter as peft does


def test_lora_config_after_a_reseed_to_the_build_seed_is_peft_s_own():
    """`lora_config` adapters are made right after set_seed(args.seed); with args.seed the seed
    the model was built from, the generator's state repeats the build's first one."""
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"])
    torch.manual_seed(sft.SEED)
    with merak.init_empty_weights():
        model = sft.model()
    model = lora.wrap(model, config, seed=sft.SEED)
    materialize_(model)
    reference = sft.model()
    torch.manual_seed(sft.SEED)
    want = dict(peft.get_peft_model(reference, config).named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, want[name]), name


def test_adapters_added_outside_the_record_are_refused():
    merak.init(dp=1, tp=1, pp=1)
    with merak.init_empty_weights():
        model = sft.model()
    model = peft.get_peft_model(model, sft.peft_config(("q_proj",)))
    with pytest.raises(ValueError, match=r"adapters \[.*lora_A\.default\.weight.*outside its "
                                         r"init record"):
        merak.MerakTrainer(model=model, args=merak.MerakArguments("out", use_cpu=True))
