"""TRL's DPOTrainer through MerakTrainer: ``class MerakDPOTrainer(MerakTrainer,
DPOTrainer)`` with ``@dataclass class C(MerakArguments, DPOConfig)`` and
``precompute_ref_log_probs=True`` (the reference log-probabilities are a pipelined evaluation
pass before training), on models built on the meta device, with and without LoRA through
DPOTrainer's ``peft_config``, at (1,2,2) and (2,1,2), in the pooled 4-rank launch of
workers/trainer_subclasses.py, against single-process DPOTrainer; what of DPO a pipeline cannot
run is refused by name."""

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


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize("scenario", [*dpo.LAYOUTS, *dpo.VARIANTS])
def test_trl_dpo_trainer_matches_single_process_dpo(launches, worker_pool, references,
                                                    scenario, tmp_path_factory):
    """Built on the meta device: precomputed references, LoRA (DPOTrainer's peft_config),
    DPOConfig's defaults (TRL's reference: a frozen copy loaded from the policy's path; ours:
    the pipeline's pass with the initial weights), LoRA without precomputing, IPO's loss."""
    _, lora, fields, pretrained = dpo.VARIANTS.get(scenario, (None, False, {}, False))
    key = json.dumps([lora, fields, pretrained])
    if key not in references:
        path = dpo.save_policy(tmp_path_factory.mktemp("policy")) if pretrained else None
        references[key] = dpo.single_process(lora, path, **fields)
    reference = references[key]
    results, output = launches(4)
    check(results, output, scenario)
    ours = json.loads((worker_pool.out_dir(WORKER, 4) / f"merak-{scenario}.json").read_text())
    for key in ("loss", "rewards/chosen", "rewards/rejected"):
        print(f"{scenario} {key}: merak {ours[key]} reference {reference[key]}")
    assert len(ours["loss"]) == len(reference["loss"]) == dpo.STEPS
    assert reference["rewards/margins"][-1] > 0.05  # it trained: the check can fail
    # a reward is beta x (log-prob - reference log-prob), a difference of sums of about a
    # hundred: within 1e-5 of those sums, not of the (near 0) difference
    logps = max(abs(v) for key in ("logps/chosen", "logps/rejected") for v in reference[key])
    rewards_abs = dpo.FIELDS["beta"] * 1e-5 * logps
    for key in dpo.LOGGED:  # step 1: policy == reference, the rewards are 0 in both
        loose = rewards_abs if key.startswith("rewards/") and key != "rewards/accuracies" \
            else 1e-7
        assert ours[key] == pytest.approx(reference[key], rel=1e-5, abs=loose), key


@pytest.mark.parametrize("scenario", list(dpo.EVALUATED))
def test_dpo_evaluation_matches_single_process_dpo(launches, worker_pool, scenario, tmp_path):
    """evaluate() on held-out rows after training: each micro-batch collated on its own (a
    prompt's chosen and rejected rows together), the evaluation set's reference
    log-probabilities from the pipelined pass before training (precomputed; LoRA with
    DPOConfig's defaults): the loss and DPO's metrics equal single-process
    DPOTrainer.evaluate's."""
    _, lora, fields, pretrained = dpo.EVALUATED[scenario]
    path = dpo.save_policy(tmp_path / "policy") if pretrained else None
    reference = dpo.single_process(lora, path, evaluate=True, **fields)
    results, output = launches(4)
    check(results, output, scenario)
    ours = json.loads((worker_pool.out_dir(WORKER, 4) / f"merak-{scenario}.json").read_text())
    assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5)  # training, as above
    theirs, mine = reference["eval"], ours["eval"]
    assert theirs["eval_rewards/margins"] > 0.01  # it trained: the check can fail
    logps = max(abs(theirs[k]) for k in ("eval_logps/chosen", "eval_logps/rejected"))
    dpo.evaluation_gaps(scenario, theirs, mine, {
        "eval_rewards/accuracies": 1e-7, "eval_rewards/": dpo.FIELDS["beta"] * 1e-5 * logps})


@pytest.mark.parametrize("scenario", list(dpo.REFERENCED))
def test_dpo_with_an_explicit_ref_model_matches_single_process_dpo(launches, worker_pool,
                                                                    scenario, tmp_path):
    """An explicit ref_model (other weights than the policy's), meta-built: its frozen replica,
    split and sharded as the policy, runs the reference pass before training (with
    sync_ref_model: before every step, mixed with the policy every 2 steps); every logged
    figure equals single-process DPOTrainer's given the same ref_model."""
    _, lora, fields, pretrained = dpo.REFERENCED[scenario]
    reference = dpo.single_process(lora, None, reference=dpo.save_reference(tmp_path / "ref"),
                                   **fields)
    results, output = launches(4)
    check(results, output, scenario)
    ours = json.loads((worker_pool.out_dir(WORKER, 4) / f"merak-{scenario}.json").read_text())
    compare_with_reference(scenario, ours, reference)
    # rank 0's replica: its stage's tp shard, fp32, under the whole reference's weights
    whole = sum(p.numel() * 4 for p in sft.model().parameters())
    print(f"{scenario} replica on rank 0: {ours['replica_bytes']} bytes of {whole}")
    assert 0 < ours["replica_bytes"] < whole


def compare_with_reference(scenario: str, ours: dict, reference: dict) -> None:
    """Every figure an explicit ref_model's run logs, ours against single-process
    DPOTrainer's: 1e-5 relative (the rewards within 1e-5 of the log-probability sums)."""
    assert len(ours["loss"]) == len(reference["loss"]) == dpo.STEPS
    # the reference is not the initial policy: the rewards differ from 0 from the first step
    assert abs(reference["rewards/margins"][0]) > 0.01
    logps = max(abs(v) for key in ("logps/chosen", "logps/rejected") for v in reference[key])
    gaps = {}
    for key in dpo.LOGGED:
        loose = dpo.FIELDS["beta"] * 1e-5 * logps \
            if key.startswith("rewards/") and key != "rewards/accuracies" else 1e-7
        assert ours[key] == pytest.approx(reference[key], rel=1e-5, abs=loose), key
        gaps[key] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours[key],
                                                                       reference[key]))
    print(f"{scenario} loss: merak {ours['loss']} reference {reference['loss']}")
    print(f"{scenario} largest relative gaps: "
          + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))


@pytest.mark.parametrize("scenario", list(dpo.PLANNED))
def test_dpo_with_auto_parallel_plans_with_its_reference(launches, worker_pool, scenario,
                                                          tmp_path):
    """auto_parallel on a DPOTrainer with sync_ref_model: the trainer asks the strategy
    planner with its reference mode ("replica": the replica's forwards in every step, its
    weights on every rank), so every prediction of its plan is the one `merak plan --reference
    replica` makes from the same measured costs (and costs more time and memory than the plain
    one); the chosen layout trains at parity with single-process DPOTrainer."""
    import dataclasses

    from merak.strategy.candidate import Candidate
    from merak.strategy.cluster import Cluster
    from merak.strategy.costs import BlockCosts
    from merak.strategy.predict import Predictor
    from merak.strategy.reference import ReferenceCosts
    from merak.strategy.shape import ModelShape

    _, lora, fields, _ = dpo.PLANNED[scenario]
    reference = dpo.single_process(lora, None, reference=dpo.save_reference(tmp_path / "ref"),
                                   **fields)
    results, output = launches(4)
    check(results, output, scenario)
    out = worker_pool.out_dir(WORKER, 4)
    compare_with_reference(scenario, json.loads((out / f"merak-{scenario}.json").read_text()),
                           reference)
    plan = json.loads((out / scenario / "plan.json").read_text())
    costs = {int(m): BlockCosts(**c) for m, c in plan["costs"].items()}
    made = (ModelShape.from_config(sft.model().config), costs,
            Cluster.from_json(plan["cluster"]), plan["memory_bytes"])
    epochs = dpo.STEPS * dpo.GLOBAL_MICRO_BATCH * dpo.MICROBATCHES / dpo.ROWS  # 1.25
    offline = Predictor(*made, reference=ReferenceCosts("replica", epochs))
    plain = Predictor(*made)
    names = [f.name for f in dataclasses.fields(Candidate)]
    assert plan["ranked"] and plan["chosen"]
    for entry in plan["ranked"]:
        candidate = Candidate(**{n: entry[n] for n in names})
        ours, alone = offline.predict(candidate), plain.predict(candidate)
        assert entry["step_s"] == pytest.approx(ours.step_s, rel=1e-9), entry["label"]
        assert entry["peak_bytes"] == pytest.approx(ours.peak_bytes, rel=1e-9), entry["label"]
        assert entry["step_s"] > alone.step_s and entry["peak_bytes"] > alone.peak_bytes
    chosen = next(e for e in plan["ranked"] if e["label"] == Candidate(**plan["chosen"]).label)
    alone = plain.predict(Candidate(**plan["chosen"]))
    print(f"{scenario}: chosen {chosen['label']}, predicted step {chosen['step_s']:.4g} s and "
          f"peak {chosen['peak_bytes']:.4g} B with the replica, {alone.step_s:.4g} s and "
          f"{alone.peak_bytes:.4g} B without; measured {plan['measured']}")


def test_what_of_dpo_a_pipeline_cannot_run_is_refused_by_name():
    @dataclass
    class Config(MerakArguments, trl.DPOConfig):
        pass

    class MerakDPOTrainer(merak.MerakTrainer, trl.DPOTrainer):
        pass

    def build(model=None, **kwargs):
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in Config.__dataclass_fields__}
        return MerakDPOTrainer(model=model, args=Config("out", use_cpu=True, **fields),
                               **kwargs)

    with pytest.raises(NotSupportedYetError, match="sync_ref_model=True and no ref_model.*give "
                                                   "ref_model"):
        build(sync_ref_model=True)
    with pytest.raises(NotSupportedYetError, match="sync_ref_model=True and an eval_dataset"):
        build(ref_model=sft.model(), sync_ref_model=True, eval_dataset=dpo.dataset())
    with pytest.raises(NotSupportedYetError, match="DPOTrainer.training_step cannot run"):
        build(precompute_ref_log_probs=True, activation_offloading=True)
    with pytest.raises(NotSupportedYetError, match="already carries adapters.*peft_config"):
        build(precompute_ref_log_probs=True,
              lora_config='{"r": 4, "target_modules": ["q_proj"]}')


def test_what_of_dpo_evaluation_a_pipeline_cannot_run_is_refused_by_name():
    """Before the pipeline is built (one process, dp1 x tp1 x pp1): a set DPOTrainer was not
    given (TRL did not tokenize it, no reference pass covers it), predictions, and a set that
    does not fill whole evaluation steps."""
    Config, MerakDPOTrainer = sft.merak_classes(trl.DPOConfig, trl.DPOTrainer)
    merak.init(dp=1, tp=1, pp=1)

    def build(eval_rows: int, **fields):
        args = Config("out", per_device_train_batch_size=4, per_device_eval_batch_size=4,
                      **{**dpo.FIELDS, **fields})
        return MerakDPOTrainer(model=sft.model(), args=args, train_dataset=dpo.dataset(),
                               eval_dataset=dpo.dataset(first=dpo.ROWS, rows=eval_rows),
                               processing_class=sft.tokenizer())

    trainer = build(8)
    with pytest.raises(NotSupportedYetError, match=r"evaluate\(dataset\) on a set.*eval_dataset"):
        trainer.evaluate(dpo.eval_dataset())
    with pytest.raises(NotSupportedYetError, match=r"predict\(\) and compute_metrics"):
        trainer.predict(trainer.eval_dataset)
    with pytest.raises(NotSupportedYetError, match="10 items do not fill whole evaluation "
                                                   "steps of 4.*multiple of 4"):
        build(10).evaluate()


def test_the_trainer_hands_the_planner_where_it_runs_the_reference(monkeypatch):
    """What auto_parallel asks the strategy planner with (merak/trainer/auto_plan.py), one
    process, each setup's trainer made (nothing built): the pass before training for
    precomputed references, DPOConfig's defaults, LoRA and an explicit ref_model (its replica
    is freed before the first step); the replica in every step with sync_ref_model; KTO's as
    DPO's; nothing for a trainer without a reference. The epochs: max_steps global batches over
    the training rows. With auto_parallel, apply_strategy_plan hands it to the online planner.
    """
    import merak.dryrun.online as online
    from merak.trainer.auto_plan import apply_strategy_plan, reference_costs

    merak.init(dp=1, tp=1, pp=1)
    configs = {}

    def made(trainer_cls, config_cls, rows, ref_model=None, peft=None, **fields):
        if trainer_cls not in configs:
            configs[trainer_cls] = sft.merak_classes(config_cls, trainer_cls)
        Config, Trainer = configs[trainer_cls]
        args = Config("out", per_device_train_batch_size=4, **{**dpo.FIELDS, **fields})
        trainer = Trainer(model=sft.model(), args=args, train_dataset=rows,
                          processing_class=sft.tokenizer(), ref_model=ref_model,
                          peft_config=peft)
        costs = reference_costs(trainer)
        if args.auto_parallel:  # what apply_strategy_plan asks the online planner with
            asked = {}

            def plan_online(*_, **keywords):
                asked.update(keywords)
                raise InterruptedError  # (the plan itself: tests/workers' dpo-sync-auto)

            monkeypatch.setattr(online, "plan_online", plan_online)
            with pytest.raises(InterruptedError):
                apply_strategy_plan(trainer, trainer._example(trainer.train_dataset, 1))
            assert (asked["reference"].mode, asked["reference"].epochs) == \
                (costs.mode, costs.epochs)
        return costs.mode, costs.epochs

    epochs = dpo.STEPS * 4 * dpo.MICROBATCHES / dpo.ROWS
    dpo_rows, kto_rows = dpo.dataset(), kto.dataset()
    per_step = {"precompute_ref_log_probs": False}
    for setup, expected in [
            ({}, "before"), (per_step, "before"),
            ({**per_step, "peft": sft.peft_config("all-linear")}, "before"),
            ({**per_step, "ref_model": sft.model()}, "before"),
            ({**per_step, "ref_model": sft.model(), "sync_ref_model": True}, "replica"),
            ({**per_step, "ref_model": sft.model(), "sync_ref_model": True,
              "auto_parallel": True}, "replica")]:
        assert made(trl.DPOTrainer, trl.DPOConfig, dpo_rows, **setup) == (expected, epochs), \
            setup
    assert made(trl.KTOTrainer, trl.KTOConfig, kto_rows, **per_step,
                ref_model=sft.model(), sync_ref_model=True) == ("replica", epochs)
    Config, Trainer = sft.merak_classes(trl.SFTConfig, trl.SFTTrainer)
    plain = Trainer(model=sft.model(), args=Config("out", **sft.FIELDS),
                    train_dataset=sft.dataset(), processing_class=sft.tokenizer())
    assert reference_costs(plain) is None
