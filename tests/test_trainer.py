"""MerakTrainer against the single-process HF Trainer (8 ranks, dp=2 x tp=2 x pp=2); its HF
API, checkpoints and resharding; its hooks (fp16, LoRA, NEFTune, torch.compile) in one process
and on 2 ranks. `MerakArguments` alone: test_trainer_arguments.py."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_harness import (
    WORKERS,
    assert_like_reference,
    check,
    launch,
    launch_together,
    scenario_result,
)
from trainer_common import (
    DP2_PP2_RUNS,
    PP2_RUNS,
    PREDICTING,
    RESHARD_SOURCE,
    RUNS,
    RUNS_3D,
    STEPS,
    build,
)

from merak import MerakArguments


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer")
    reference = subprocess.run([sys.executable, str(WORKERS / "trainer_reference.py"), "--out",
                                str(out)], capture_output=True, text=True, timeout=600,
                               check=False)
    assert reference.returncode == 0, reference.stderr[-4000:]
    os.environ["MERAK_TRAINER_OUT"] = str(out)
    try:
        results, output = launch("trainer_parity.py", 8, out / "ranks")
    finally:
        del os.environ["MERAK_TRAINER_OUT"]
    return out, results, output


@pytest.mark.parametrize("run", sorted(RUNS_3D))
def test_merak_trainer_3d_matches_hf_trainer(runs, run):
    _matches_hf_trainer(runs[0], *runs[1:], run)
    # each rank's share of the Adam state (two tensors per parameter) and of the parameters
    # (returned by the worker): ZeRO-1 about half of the state at dp 2, ZeRO-2/3 1/dp of both
    for rank, held in enumerate(scenario_result(*runs[1:], f"trainer-{run}")):
        zero, share, params = held["zero_stage"], held["state_share"], held["params_held"]
        if zero == 1:
            assert 0.3 < share < 0.7, f"rank {rank}: ZeRO-1 kept {share:.2f} of the state"
        if zero >= 2:
            for what, value in (("optimizer state", share), ("parameters", params)):
                assert abs(value - 1 / held["dp"]) < 0.1, \
                    f"rank {rank}: ZeRO-{zero} kept {value:.2f} of the {what}"
        else:  # ZeRO-0 and -1 keep every parameter; ZeRO-0 the whole state too
            assert params == 1.0 and (zero == 1 or share == 1.0), f"rank {rank}: {held}"
        _ran_as_asked(f"rank {rank}", held)


def _ran_as_asked(where: str, held: dict) -> None:
    """A 3D run's logs (one per step, timed), ZeRO-2/3's reduce-scatters inside each chunk's
    last backward, auto_parallel's plan, the eval steps (24 of 32 rows: 2, then 1 with
    eval_iters=1), predict()'s loss, the freed sends and the generated tokens."""
    logs, steps = held["logs"], held["max_steps"]
    assert len(logs) == steps, f"{where}: {len(logs)} training logs"
    assert all(h["tokens_per_second"] > 0 and h["time_forward_ms"] > 0 for h in logs), where
    if held["zero_stage"] >= 2:
        reduced = held["reduced_in_last_backward"]
        assert len(reduced) == held["chunks"] * steps and all(reduced), f"{where}: {reduced}"
    if "planned" in held:
        plan = held["planned"]
        assert plan["chosen_dp"] == plan["dp"] and plan["measured"] == 2, f"{where}: {plan}"
    if "eval_steps" in held:
        assert held["eval_steps"] == [2, 1], f"{where}: eval steps {held['eval_steps']}"
    if "test_loss" in held:
        assert held["test_loss"] == held["eval_loss"], f"{where}: predict's loss differs"
    assert held.get("senders_freeing_nothing", []) == [], f"{where}: {held}"
    if held.get("generation"):  # (rank 0)
        made = held["generation"]
        assert not made["unexpected"] and set(made["missing"]) <= {"lm_head.weight"}, made
        assert made["tokens"] == made["hf_tokens"], f"{where}: {made}"


@pytest.mark.parametrize("run", DP2_PP2_RUNS)
def test_dp2_pp2_matches_hf_trainer(runs, reshards, run):
    _matches_hf_trainer(runs[0], *reshards, run)


def _matches_hf_trainer(out: Path, results: dict, output: str, run: str) -> None:
    check(results, output, f"trainer-{run}")
    ours = json.loads((out / f"merak-{run}.json").read_text())
    theirs = json.loads((out / f"reference-{run}.json").read_text())
    assert len(ours["loss"]) == len(theirs["loss"]) == RUNS[run][1].get("max_steps", STEPS)
    # bf16 autocast rounds each matmul; tensor parallelism sums the halves in another order
    rel = 2e-3 if "bf16" in run else 1e-5
    for key in ("loss", "grad_norm", "learning_rate"):
        assert ours[key] == pytest.approx(theirs[key], rel=rel, abs=1e-6), key
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=rel)
    if run in PREDICTING:  # fp32 runs also compare predict() outputs
        for what in ("logits", "labels"):
            mine = np.load(out / f"merak-{run}-{what}.npy")
            reference = np.load(out / f"reference-{run}-{what}.npy")
            np.testing.assert_allclose(mine, reference, rtol=1e-4, atol=1e-5, err_msg=what)
    if run.endswith("hf-flow"):
        _same_flow(ours, theirs, rel)


def _same_flow(ours: dict, theirs: dict, rel: float) -> None:
    """HF's training flow: evaluations at the same steps with the same (label-smoothed) eval
    losses, the same best checkpoint chosen and the only one left, the same token counts, and
    the final eval loss that of the best checkpoint's weights, loaded back."""
    assert [s for s, _ in ours["evals"]] == [s for s, _ in theirs["evals"]] == [0, 6, 9, 10]
    assert [v for _, v in ours["evals"]] == pytest.approx([v for _, v in theirs["evals"]],
                                                          rel=rel)
    assert ours["best_checkpoint"] == theirs["best_checkpoint"] == "checkpoint-6"
    assert ours["best_global_step"] == theirs["best_global_step"] == 6
    assert ours["best_metric"] == pytest.approx(theirs["best_metric"], rel=rel)
    assert ours["checkpoints"] == theirs["checkpoints"] == ["checkpoint-6"]
    assert ours["tokens"] == theirs["tokens"] and ours["tokens_logged"] == theirs["tokens_logged"]
    assert ours["eval_loss"] == pytest.approx(ours["evals"][1][1], rel=1e-6)


@pytest.mark.parametrize("run", PP2_RUNS)
def test_dp1_tp1_pp2_matches_hf_trainer(runs, two_ranks, run):
    """Runs on a 2-stage pipeline, in the 2-rank launch: the HF flow (zero-bubble schedule,
    recomputation from gradient_checkpointing), stage-aware recomputation planned from
    activation_checkpoint_ratio, and zero-bubble with checkpoint_num_layers segments."""
    check(*two_ranks[1:], f"pp2-{run}")
    ours = json.loads((two_ranks[0] / f"merak-pp2-{run}.json").read_text())
    theirs = json.loads((runs[0] / f"reference-{run}.json").read_text())
    for key in ("loss", "grad_norm", "learning_rate"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5)
    if run.endswith("hf-flow"):
        _same_flow(ours, theirs, 1e-5)


def test_label_smoothing_over_vocab_parallel_logits(two_ranks):
    check(*two_ranks[1:], "label-smoothing-vocab-parallel")


@pytest.mark.parametrize("scenario", ["kill-and-resume", "kill-and-resume-zero3-fp16"])
def test_kill_during_a_save_then_resume_continues_the_same_loss_curve(four_ranks, scenario):
    """Killed while writing its step-6 checkpoint, a run resumes from step 3 (warning about the
    half-written one) and logs the uninterrupted run's losses at steps 4-6, its history kept;
    `finetune` starts a fresh run from the checkpoint."""
    results, output = four_ranks
    for rank, ours in enumerate(scenario_result(results["trainer_resume.py"], output, scenario)):
        where = f"rank {rank}: {ours}"
        plain, after = ours["uninterrupted"], ours["resumed"]
        assert all(math.isfinite(v) for v in plain.values()), where
        if ours["skipped_steps"] is not None:  # fp16: not every step overflowed
            assert ours["skipped_steps"] < 5, where
        assert ours["crashed"] and ours["left"] == ["checkpoint-3", "checkpoint-6.partial"], where
        assert any("half-written checkpoint" in w for w in ours["warnings"]), where
        assert sorted(after, key=int) == [str(step) for step in range(1, 7)], where  # history
        for step in ("4", "5", "6"):
            assert after[step] == plain[step], f"rank {rank}: step {step}"
        if scenario == "kill-and-resume":
            assert ours["finetuned_steps"] == [1], f"rank {rank}: finetune must start afresh"


def test_hf_trainer_api_save_model_metrics_and_a_partial_eval_batch(runs):
    """save_model() on dp2 x tp2 x pp2 writes an HF directory equal to `merak export` of the
    checkpoint of the same step, with save_state's, the metrics' and the model card's files;
    21 eval rows, 3 per dp rank, run 3 steps (the last partial), the logits over the whole
    vocabulary; HF Trainer evaluating that directory on the same 21 rows (a partial last batch,
    another batch size) gives Merak's eval loss and compute_metrics over
    preprocess_logits_for_metrics."""
    import transformers as tf
    from trainer_common import dataset, token_accuracy

    out, results, output = runs
    for rank, seen in enumerate(scenario_result(results, output, "hf-api")):
        assert (seen["process_index"], seen["world_size"]) == (rank, 8), f"rank {rank}: {seen}"
        assert seen["should_log"] == seen["should_save"] == (rank == 0), f"rank {rank}: {seen}"
        assert seen["eval_steps"] == 3, f"rank {rank}: {seen}"
        if seen["last_stage"]:
            assert seen["logits_widths"] == [seen["vocab"]], f"rank {rank}: {seen}"
        if rank == 0:
            assert {"trainer_state.json", "eval_results.json", "README.md", "model",
                    "checkpoint-2"} <= set(seen["files"]), seen["files"]
            assert seen["global_step"] == 2, seen
            assert seen["saved_names_apart"] == [], seen
            assert seen["saved_unlike_exported"] == [], seen
    ours = json.loads((out / "hf-api" / "merak-eval.json").read_text())
    model = tf.AutoModelForCausalLM.from_pretrained(out / "hf-api" / "model")
    args = tf.TrainingArguments(output_dir=str(out / "hf-api-reference"), report_to="none",
                                use_cpu=True, per_device_eval_batch_size=5)
    reference = tf.Trainer(model=model, args=args, eval_dataset=dataset(21, 9),
                           compute_metrics=token_accuracy,
                           preprocess_logits_for_metrics=lambda logits, _: logits.argmax(-1))
    theirs = reference.evaluate()
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5)
    assert ours["eval_rows"] == theirs["eval_rows"] == 21
    assert ours["eval_accuracy"] == pytest.approx(theirs["eval_accuracy"], abs=1e-9)


def test_no_private_hf_trainer_name_is_reused_with_another_meaning():
    """Every attribute MerakTrainer (or a mixin of it) defines that HF `Trainer` also has is a
    deliberate override with HF's meaning (HF's save_model calls self._save(output_dir))."""
    import inspect

    from transformers import Trainer

    import merak

    overrides = {"__init__", "__doc__", "__module__", "__firstlineno__", "__static_attributes__",
                 "__qualname__", "__dict__", "__weakref__", "train", "evaluate", "predict",
                 "is_world_process_zero", "is_local_process_zero", "_save", "create_model_card",
                 "log"}  # log: HF's, after the last stage's subclass metrics reached every rank
    ours = set()
    for cls in merak.MerakTrainer.__mro__:
        if cls is Trainer:
            break
        ours |= set(vars(cls))
    assert ours & set(dir(Trainer)) <= overrides, ours & set(dir(Trainer)) - overrides
    assert list(inspect.signature(merak.MerakTrainer._save).parameters) == [
        "self", "output_dir", "state_dict"]


@pytest.mark.parametrize("scenario", ["reshard-dp1-tp1-pp4", "reshard-dp4-tp1-pp1",
                                      "export-from_pretrained", "from_pretrained-on-meta"])
def test_a_checkpoint_loads_into_another_layout_and_exports_to_hf(runs, reshards, scenario):
    """The next step's loss after resuming in another layout, and the exported checkpoint's
    loss under `from_pretrained`, are the original run's; a from_pretrained model inside
    init_empty_weights holds no memory and trains from its own shards."""
    figures = scenario_result(*reshards, scenario)
    assert assert_like_reference(figures, rtol=1e-4, atol=1e-5, grad_atol_of_max=0.0) > 0
    for rank, ours in enumerate(figures):
        if scenario.startswith("reshard-"):
            dp, tp, pp = (int(part[2:]) for part in scenario.split("-")[1:])
            assert ours["layout"] == [dp, tp, pp], f"rank {rank}: {ours}"
        if scenario == "from_pretrained-on-meta":
            assert ours["loaded_on_meta"] and ours["layout"] == [1, 2, 2], f"rank {rank}"


@pytest.fixture(scope="module")
def four_ranks(runs, tmp_path_factory):
    """The one 4-rank launch: kill-and-resume (trainer_resume.py), and from the 8-rank launch's
    ZeRO-3 checkpoint resharding and export, with the dp2 x pp2 HF parity runs
    (trainer_reshard.py). Returns (worker -> results, output)."""
    out, results, _ = runs
    workers = ["trainer_resume.py"]
    if results.get(f"trainer-{RESHARD_SOURCE}") == []:  # else the reshard tests report why
        workers.append("trainer_reshard.py")
        build("llama").save_pretrained(out / "pretrained-llama")
    env = {"MERAK_TRAINER_OUT": str(out), "MERAK_PRETRAINED": str(out / "pretrained-llama"),
           "MERAK_RESUME_DIR": str(tmp_path_factory.mktemp("resume"))}
    os.environ.update(env)
    try:
        return launch_together(workers, 4, out / "four-ranks")
    finally:
        for name in env:
            del os.environ[name]


@pytest.fixture(scope="module")
def reshards(runs, four_ranks):
    check(*runs[1:], f"trainer-{RESHARD_SOURCE}")
    results, output = four_ranks
    return results["trainer_reshard.py"], output


def test_fp16_overflow_skips_the_step_and_halves_the_scale(two_ranks):
    """An inf in step 3's forward: every rank skips that step (parameters unchanged) and
    halves the scale (2**8 -> 2**7); the next step trains, with finite losses."""
    for rank, ours in enumerate(scenario_result(*two_ranks[1:], "fp16-overflow")):
        where = f"rank {rank}: {ours}"
        assert ours["steps"] == [1, 2, 3, 4, 5], where
        assert ours["loss_scale"] == [256.0, 256.0, 128.0, 128.0, 128.0], where
        assert ours["skipped_steps"][-1] == 1, where
        assert ours["changed"] == {"2": True, "3": False, "4": True, "5": True}, where
        assert all(math.isfinite(ours["loss"][i]) for i in (0, 1, 3, 4)), where


def test_torch_compile_compiles_the_blocks_with_eager_losses(two_ranks):
    """The compiled blocks train to the eager losses, with and without recomputation (which
    reruns the compiled blocks); the stage's state_dict keys are the eager ones."""
    for rank, ours in enumerate(scenario_result(*two_ranks[1:], "torch-compile-pp2")):
        for recompute in (False, True):
            run = ours[f"recompute={recompute}"]
            where = f"rank {rank}, recompute={recompute}: {run}"
            assert run["torch_compile"] and run["recomputes"] == recompute, where
            assert run["blocks"] and len(run["compiled"]) == run["blocks"], where
            assert run["keys"] == ours["eager_keys"], "compiling changed the state_dict keys"
            torch.testing.assert_close(torch.tensor(run["losses"]),
                                       torch.tensor(ours["eager_losses"]), rtol=1e-5, atol=0.0)


def test_neftune_noise_matches_a_single_process_reference(two_ranks):
    """The losses equal a single-process model's with the same noise (`merak.trainer.neftune`'s
    seeding, dp rank 0) on its embedding and differ from the noise-free ones; the eval loss has
    no noise."""
    for ours in scenario_result(*two_ranks[1:], "neftune-pp2"):
        losses = torch.tensor(ours["losses"])
        torch.testing.assert_close(losses, torch.tensor(ours["noised_reference"]), rtol=1e-4,
                                   atol=1e-5)
        assert (losses - torch.tensor(ours["clean_reference"])).abs().min() > 1e-3, ours
        torch.testing.assert_close(torch.tensor(ours["eval_loss"]),
                                   torch.tensor(ours["noised_reference_eval"]), rtol=1e-4,
                                   atol=1e-5)


def test_neftune_noise_is_the_same_on_the_tp_ranks(two_ranks):
    """At tp2 (vocab-parallel embedding) both TP ranks add the same noise, so their replicated
    parameters stay identical."""
    for rank, ours in enumerate(scenario_result(*two_ranks[1:], "neftune-tp2")):
        assert ours["kept"] == ours["expected_kept"] > 0, f"rank {rank}: {ours}"
        assert ours["same_noise"], f"rank {rank}: the TP ranks added different noise"
        assert ours["replicated"] and ours["replicated_differ"] == [], f"rank {rank}: {ours}"


def test_checkpoint_flags_without_optimizer_or_rng(tmp_path):
    """save=True saves every save_steps; no_save_optim / no_save_rng leave those out, and
    resuming such a checkpoint needs no_load_optim (one process)."""
    from trainer_common import train_set

    import merak

    merak.init(dp=1, tp=1, pp=1)

    def trainer(**kwargs):
        with merak.init_empty_weights():
            model = build("llama")
        args = MerakArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                              report_to="none", disable_tqdm=True, use_cpu=True,
                              save_strategy="no", save_steps=2, **kwargs)
        return merak.MerakTrainer(model=model, args=args, train_dataset=train_set())

    trainer(save=True, no_save_optim=True, no_save_rng=True, max_steps=2).train()
    state = torch.load(tmp_path / "checkpoint-2" / "rank0.pt", map_location="cpu",
                       weights_only=True)
    assert "rng" not in state and "scheduler" in state
    assert not (tmp_path / "checkpoint-2" / "optimizer").exists()
    with pytest.raises(FileNotFoundError, match="no_load_optim=True"):
        trainer(max_steps=3).train(resume_from_checkpoint=True)
    resumed = trainer(max_steps=3, no_load_optim=True, no_load_rng=True)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    # a checkpoint whose state would run code when unpickled is refused, and runs nothing
    marker = tmp_path / "pwned"
    torch.save({**state, "payload": _RunsCode(marker)}, tmp_path / "checkpoint-2" / "rank0.pt")
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load .*rank0\.pt.*"
                       r"weights_only=True.*GLOBAL exec"):
        trainer(max_steps=3, no_load_optim=True).train(resume_from_checkpoint=True)
    assert not marker.exists()


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_from_config_with_a_config_from_a_directory_is_initialized_not_loaded(tmp_path):
    """A config loaded from a directory sets name_or_path; from_config under
    init_empty_weights must still be initialized as the seeded full model (not taken for a
    pretrained model whose weights are missing); from_pretrained is what loads from disk."""
    import transformers as tf
    from trainer_common import SEED, train_set

    import merak
    from merak.materialize.safetensors import pretrained_checkpoint

    merak.init(dp=1, tp=1, pp=1)
    build("llama").config.save_pretrained(tmp_path / "tiny-llama")
    config = tf.AutoConfig.from_pretrained(tmp_path / "tiny-llama")
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(config)
    assert model.name_or_path == str(tmp_path / "tiny-llama")
    assert pretrained_checkpoint(model) is None
    args = MerakArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none",
                          per_device_train_batch_size=4, disable_tqdm=True, use_cpu=True,
                          save_strategy="no", train_sampling_strategy="sequential")
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set())
    trainer.train()
    torch.manual_seed(SEED)
    reference = tf.AutoModelForCausalLM.from_config(config)
    batch = tf.default_data_collator(train_set()[:4])
    assert trainer.state.log_history[0]["loss"] == pytest.approx(
        reference(**batch).loss.item(), rel=1e-5)
    reference.save_pretrained(tmp_path / "pretrained")
    with merak.init_empty_weights():
        loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained")
    assert pretrained_checkpoint(loaded) == str(tmp_path / "pretrained")
