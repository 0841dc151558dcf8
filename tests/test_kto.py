"""TRL's KTOTrainer through MerakTrainer: ``class MerakKTOTrainer(MerakTrainer, KTOTrainer)``
with ``@dataclass class C(MerakArguments, KTOConfig)`` on models built on the meta device at
(1,2,2), in the pooled 4-rank launch of workers/trainer_subclasses.py, against single-process
KTOTrainer: each micro-batch's completions and mismatched KL completions run as rows of one
pipeline forward (merak/trainer/joined_rows.py); the reference log-probabilities of both are a
pipelined evaluation pass before training (precomputed, KTOConfig's defaults, LoRA with its
adapters off, an explicit ref_model's replica) or, with sync_ref_model, the replica's pass
before each step; evaluate() on its eval_dataset. What of KTO a pipeline cannot run is refused by
name."""

from __future__ import annotations

import json
from dataclasses import dataclass

import dpo_common as dpo
import kto_common as kto
import pytest
import sft_common as sft
from dist_harness import check

import merak
from merak import MerakArguments, NotSupportedYetError

trl = pytest.importorskip("trl")

WORKER = "trainer_subclasses.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (4,)


@pytest.mark.parametrize("world_size", [4])
@pytest.mark.parametrize("scenario", list(kto.RUNS))
def test_trl_kto_trainer_matches_single_process_kto(launches, worker_pool, scenario,
                                                    world_size, tmp_path):
    _, lora, fields, pretrained = kto.RUNS[scenario]
    path = dpo.save_policy(tmp_path / "policy") if pretrained else None
    reference = kto.single_process(lora, path, **fields)
    results, output = launches(world_size)
    check(results, output, scenario)
    ours = json.loads((worker_pool.out_dir(WORKER, 4) / f"merak-{scenario}.json").read_text())
    # it trained, and (but for APO's loss) the KL estimate moved off 0: the check can fail
    assert abs(reference["loss"][-1] - reference["loss"][0]) > 1e-3
    assert reference["kl"][-1] > 0.05 or fields.get("loss_type") == "apo_zero_unpaired"
    compare(scenario, ours, reference)


@pytest.mark.parametrize("world_size", [4])
@pytest.mark.parametrize("scenario", list(kto.REFERENCED))
def test_kto_with_an_explicit_ref_model_matches_single_process_kto(launches, worker_pool,
                                                                    scenario, world_size,
                                                                    tmp_path):
    """An explicit ref_model (other weights than the policy's), meta-built: its frozen replica,
    split and sharded as the policy, runs the reference pass of the completions and the KL
    completions before training (with sync_ref_model: before every step, mixed with the policy
    every 2 steps); every logged figure equals single-process KTOTrainer's given the same
    ref_model."""
    _, lora, fields, _ = kto.REFERENCED[scenario]
    reference = kto.single_process(lora, None, reference=dpo.save_reference(tmp_path / "ref"),
                                   **fields)
    results, output = launches(world_size)
    check(results, output, scenario)
    ours = json.loads((worker_pool.out_dir(WORKER, 4) / f"merak-{scenario}.json").read_text())
    # the reference is not the initial policy: the rewards and the KL differ from 0 at step 1
    assert abs(reference["rewards/margins"][0]) > 0.01 and reference["kl"][0] > 0.05
    compare(scenario, ours, reference)


def compare(scenario: str, ours: dict, reference: dict) -> None:
    """Every figure KTO logs per step, ours against single-process KTOTrainer's: 1e-5
    relative, with the absolute bounds below; printed."""
    assert len(ours["loss"]) == len(reference["loss"]) == kto.STEPS
    # rewards and the KL estimate are differences of log-probability sums of about a hundred
    # (the policy's and the reference's): within 1e-5 of those sums, not of the difference
    logps = max(abs(v) for key in ("logps/chosen", "logps/rejected") for v in reference[key])
    # logits/*: the mean logit over the vocabulary and the completion tokens, near 0 (1e-3 with
    # LoRA's small steps): a mean of logits of size ~1 each rounded to ~1e-7, so 1e-6 absolute
    loose_of = {"kl": 1e-5 * logps, "rewards/": kto.FIELDS["beta"] * 1e-5 * logps,
                "logits/": 1e-6}
    gaps = {}
    for key in kto.LOGGED:  # step 1 without a ref_model: policy == reference, all 0
        loose = next((v for k, v in loose_of.items() if key.startswith(k)), 1e-7)
        assert ours[key] == pytest.approx(reference[key], rel=1e-5, abs=loose), key
        gaps[key] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours[key],
                                                                       reference[key]))
    print(f"{scenario} loss: merak {ours['loss']} reference {reference['loss']}")
    print(f"{scenario} kl: merak {ours['kl']} reference {reference['kl']}")
    print(f"{scenario} largest relative gaps: "
          + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))


@pytest.mark.parametrize("world_size", [4])
@pytest.mark.parametrize("scenario", list(kto.EVALUATED))
def test_kto_evaluation_matches_single_process_kto(launches, worker_pool, scenario, world_size):
    """evaluate() on held-out rows after training: each micro-batch collated on its own, its
    completions and KL completions joined, the evaluation set's reference log-probabilities
    from the pipelined pass before training: the loss and KTO's metrics equal single-process
    KTOTrainer.evaluate's."""
    _, lora, fields, _ = kto.EVALUATED[scenario]
    reference = kto.single_process(lora, None, evaluate=True, **fields)
    results, output = launches(world_size)
    check(results, output, scenario)
    ours = json.loads((worker_pool.out_dir(WORKER, 4) / f"merak-{scenario}.json").read_text())
    assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5)  # training, as above
    theirs, mine = reference["eval"], ours["eval"]
    assert theirs["eval_kl"] > 0.05  # it trained, and the KL rows count: the check can fail
    logps = max(abs(theirs[k]) for k in ("eval_logps/chosen", "eval_logps/rejected"))
    dpo.evaluation_gaps(scenario, theirs, mine, {  # as in training
        "eval_kl": 1e-5 * logps, "eval_rewards/": kto.FIELDS["beta"] * 1e-5 * logps,
        "eval_logits/": 1e-6})


def test_what_of_kto_a_pipeline_cannot_run_is_refused_by_name():
    """Before KTOTrainer's __init__ (nothing tokenized, no reference loaded)."""
    @dataclass
    class Config(MerakArguments, trl.KTOConfig):
        pass

    class MerakKTOTrainer(merak.MerakTrainer, trl.KTOTrainer):
        pass

    def build(model=None, **kwargs):
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in Config.__dataclass_fields__}
        return MerakKTOTrainer(model=model, args=Config("out", use_cpu=True, **fields),
                               **kwargs)

    with pytest.raises(NotSupportedYetError, match="MerakKTOTrainer with sync_ref_model=True"):
        build(sync_ref_model=True)
    with pytest.raises(NotSupportedYetError, match="sync_ref_model=True and an eval_dataset"):
        build(ref_model=sft.model(), sync_ref_model=True, eval_dataset=kto.dataset())
    with pytest.raises(NotSupportedYetError, match="KTOTrainer.training_step cannot run"):
        build(activation_offloading=True)
    with pytest.raises(NotSupportedYetError, match="already carries adapters.*peft_config"):
        build(lora_config='{"r": 4, "target_modules": ["q_proj"]}')
