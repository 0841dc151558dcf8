"""MerakTrainer against the single-process HF Trainer (8 ranks, dp=2 x tp=2 x pp=2), and
MerakArguments validation."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_harness import WORKERS, check, launch, launch_together, scenario_result
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
from transformers import HfArgumentParser

from merak import MerakArguments, NotSupportedYetError


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


def test_arguments_parse_from_the_command_line():
    (args,) = HfArgumentParser(MerakArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--train_schedule", "ds_default", "--parallel_vocab",
         "--custom_partition", "0", "2", "4", "--partition_method", "custom"])
    assert args.train_schedule == "ds_default" and args.parallel_vocab
    assert args.custom_partition == [0, 2, 4]
    (args,) = HfArgumentParser(MerakArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--tp_plan",
         '{"col_para_list": ["fc1"], "input_output_mapping": [[2, 1, "row"]]}'])
    assert args.tp_plan.column == ("fc1",) and args.tp_plan.io_mapping == ((2, 1, "row"),)
    json.loads(args.to_json_string())  # still serializable (for the report_to loggers)


def test_every_merak_field_parses_from_the_command_line_and_has_help(capsys):
    """HfArgumentParser with another dataclass beside MerakArguments (as HF's example scripts
    do): list fields take several values, and --help lists every Merak field with its help."""
    import dataclasses
    from dataclasses import dataclass, field

    from transformers import TrainingArguments

    @dataclass
    class ModelArguments:
        config_name: str = field(default="tiny-llama", metadata={"help": "config directory"})

    parser = HfArgumentParser((ModelArguments, MerakArguments))
    model_args, args = parser.parse_args_into_dataclasses(
        ["--config_name", "cfg", "--output_dir", "out", "--activation_checkpointing",
         "--activation_checkpoint_ratio", "0.5", "0.25", "--split_method", "layer_split",
         "--custom_split_points", "model.layers.1", "model.layers.3", "--input_names",
         "input_ids", "attention_mask", "--eval_iters", "3", "--no_tie_modules",
         "--zero_stage", "1", "--sequence_dim", "0", "--gradient_predivide_factor", "2.0",
         "--num_model_chunks", "2", "--train_schedule", "1f1b", "--no_save_rng", "true"])
    assert model_args.config_name == "cfg"
    assert args.activation_checkpoint_ratio == [0.5, 0.25]
    assert args.custom_split_points == ["model.layers.1", "model.layers.3"]
    assert args.input_names == ["input_ids", "attention_mask"]
    assert (args.eval_iters, args.no_tie_modules, args.zero_stage, args.sequence_dim,
            args.gradient_predivide_factor, args.no_save_rng) == (3, True, 1, 0, 2.0, True)
    (budget,) = HfArgumentParser(MerakArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--activation_checkpointing", "--activation_memory_budget",
         "64", "32"])
    assert budget.activation_memory_budget == [64.0, 32.0]
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    for f in dataclasses.fields(MerakArguments):
        if f.name in inherited:
            continue
        assert f"--{f.name}" in text, f.name
        assert f.metadata.get("help"), f"{f.name} has no help text"
        words = re.sub(r"\s+", " ", f.metadata["help"])[:40]
        assert words in text, (f.name, words)
        assert re.match(r"\[Merak [a-zA-Z0-9 ]+\] ", f.metadata["help"]), f.name  # its group


@pytest.mark.parametrize("kwargs,message", [
    ({"train_schedule": "2f2b"}, "train_schedule='2f2b' is not one of"),
    ({"partition_method": "random"}, "partition_method='random' is not one of"),
    ({"trace_method": "jit"}, "trace_method='jit' is not one of"),
    ({"zero_stage": 4}, "zero_stage=4 is not one of"),
    ({"partition_method": "custom"}, "needs custom_partition"),
    ({"split_method": "layer_split"}, "needs custom_split_points"),
    ({"eval_iters": 0}, r"eval_iters=0: .* must be an integer >= 1; .*set it to 1 or more"),
    ({"sequence_dim": 2}, "sequence_dim must be 0 or 1"),
    ({"loss_scale": 128.0}, "only applies with fp16"),
    ({"fp16": True, "bf16": True}, "choose one of fp16 and bf16"),
    ({"prescale_gradients": True, "gradient_predivide_factor": 2.0}, "do not also set"),
    ({"energy_gpu": "amd"}, "energy_gpu='amd' is not one of"),
    ({"energy_plan": "plan.json"}, "energy_plan needs a GPU to control: set energy_gpu"),
    ({"energy_gpu": "simulated", "energy_plan": "p.json", "pfo_server_url": "http://x"},
     "choose one of"),
    ({"simulated_gpu": "{}"}, "only applies with energy_gpu='simulated'"),
    ({"energy_mode": "auto"}, "energy_mode needs a GPU to control"),
    ({"energy_gpu": "simulated", "energy_mode": "manual"}, "energy_mode='manual' is not one of"),
    ({"energy_gpu": "simulated", "energy_mode": "auto", "energy_plan": "p.json"},
     "choose one of"),
    ({"energy_max_slowdown": -0.1}, r"energy_max_slowdown must lie in \[0, 1\)"),
    ({"energy_replan_margin": 0.0}, "energy_replan_margin must be positive"),
    ({"checkpoint_num_layers": 2}, "checkpoint_num_layers only applies with activation_"),
    ({"num_model_chunks": 3}, "num_model_chunks only applies with"),
    ({"train_schedule": "interleaved_1f1b", "num_model_chunks": 1}, "must be >= 2"),
    ({"activation_checkpoint_ratio": [0.5]}, "only applies with activation_checkpointing"),
    ({"train_schedule": "shifted_critical_path"}, "set activation_checkpointing=True"),
    ({"activation_checkpointing": True, "activation_checkpoint_ratio": [1.5]}, r"in \[0, 1\]"),
    ({"activation_checkpointing": True, "activation_memory_budget": [0.0]}, "holds 0.0: .* > 0"),
    ({"activation_checkpointing": True, "activation_checkpoint_ratio": [0.5],
      "activation_memory_budget": [10.0]}, "not both"),
    ({"tp_plan": {"col_para_list": ["fc1"], "rows": ["fc2"]}},
     r"MerakArguments.tp_plan: tp plan key 'rows' is not one of \['col_para_list'"),
    ({"tp_plan": {"col_para_list": "fc1"}}, "tp_plan: col_para_list must be a list"),
    ({"tp_plan": {"input_output_mapping": [[1, 4]]}}, "tp_plan: input_output_mapping entries"),
    ({"tp_plan": {"tp_attr_list": ["num_heads"]}}, "tp_plan: .* nothing would be split"),
    ({"tp_plan": "{not json"}, "tp_plan='{not json' is not a JSON object"),
    ({"tp_plan": ["fc1"]}, "tp_plan: a tp plan is a merak.TPPlan or a dict"),
    ({"lora_config": "missing.json"}, "lora_config: no such file missing.json"),
    ({"out_seq_length": 0}, "out_seq_length=0: .* must be an integer >= 1"),
    ({"temperature": -0.5}, "temperature=-0.5: .* must be a number >= 0"),
    ({"text_generation": True, "sequence_parallel": True}, "text_generation runs without"),
    ({"lora_config": '{"r": 4, "rank": 8}'}, "its keys must be peft LoraConfig fields"),
    ({"lora_config": "{r: 4}"}, "is not valid JSON"),
    ({"zero_stage": 2, "zero_reduce_bucket_size": 1000}, "the block is the bucket"),
    ({"zero_allow_untested_optimizer": True}, "only applies with zero_stage 2 or 3"),
    ({"zero_stage": 3, "zero_allgather_bucket_size": 10}, "the block is the bucket"),
    # CUDA graphs (their replays reuse buffers live micro-batches and recomputation still need)
    ({"torch_compile_mode": "reduce-overhead"},
     r"torch_compile_mode='reduce-overhead' is not supported \(it captures CUDA graphs.*"
     r"\['default', 'max-autotune-no-cudagraphs'\]"),
    ({"torch_compile": True, "torch_compile_mode": "max-autotune"}, "captures CUDA graphs"),
    ({"torch_compile_mode": "fast"}, "torch.compile has no such mode"),
])
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MerakArguments(output_dir="out", **kwargs)


@pytest.mark.parametrize("kwargs", [
    {"zero_stage": 3, "train_schedule": "zero_bubble"},
    {"zero_stage": 2, "prescale_gradients": True}, {"zero_stage": 3, "auto_find_batch_size": True},
    {"zero_stage": 3, "torch_compile": True},
    {"bf16_full_eval": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"context_fn": "f"}},
])
def test_features_not_landed_say_so(kwargs):
    with pytest.raises(NotSupportedYetError, match="not supported yet"):
        MerakArguments(output_dir="out", **kwargs)


def test_every_inherited_field_is_honoured_or_refused_with_its_reason():
    """hf_fields: each HF field MerakTrainer does not honour has a reason, given when it is set
    (docs/arguments.md lists the same fields)."""
    import dataclasses

    from transformers import TrainingArguments

    from merak.trainer.hf_fields import HONOURED, REFUSED

    own = {f.name for f in dataclasses.fields(MerakArguments)}
    inherited = [f for f in dataclasses.fields(TrainingArguments) if f.init]
    unexplained = [f.name for f in inherited if f.name not in HONOURED and f.name not in REFUSED
                   and f.name != "activation_checkpointing"]  # redefined as a Merak field
    assert not unexplained, unexplained
    assert not set(REFUSED) & HONOURED and set(REFUSED) <= own
    for name, value in (("accelerator_config", {"split_batches": True}),
                        ("deepspeed", "ds.json"), ("use_liger_kernel", True)):
        with pytest.raises(NotSupportedYetError, match=re.escape(REFUSED[name][:40])):
            MerakArguments(output_dir="out", **{name: value})
    page = (Path(__file__).parents[1] / "docs" / "arguments.md").read_text()
    missing = [name for name in REFUSED if f"`{name}`" not in page]
    assert not missing, f"docs/arguments.md does not list {missing}"


def test_zero_2_3_refuse_an_optimizer_that_is_not_element_wise():
    from transformers.optimization import Adafactor

    from merak.data_parallel.zero import check_optimizer

    params = [torch.nn.Parameter(torch.ones(4, 4))]
    check_optimizer(torch.optim.AdamW(params), allow_untested=False)
    with pytest.raises(ValueError, match="Adafactor is not one of .* zero_allow_untested"):
        check_optimizer(Adafactor(params, lr=1e-3, relative_step=False), allow_untested=False)
    check_optimizer(Adafactor(params, lr=1e-3, relative_step=False), allow_untested=True)


def test_ddp_bucket_cap_mb_is_the_dp_gradient_bucket():
    assert MerakArguments(output_dir="out", ddp_bucket_cap_mb=2).gradient_bucket_bytes == 2 * 2**20
    assert MerakArguments(output_dir="out", zero_reduce_bucket_size=1000).gradient_bucket_bytes \
        == 4000
    with pytest.raises(ValueError, match="not both"):
        MerakArguments(output_dir="out", ddp_bucket_cap_mb=2, zero_reduce_bucket_size=1000)


# Merak fields MerakTrainer honours (each changes what parallelize / the interpreter / the data
# or the logs do); every other Merak field must refuse a non-default value
WORKING = {"train_schedule", "partition_method", "split_method", "custom_split_points",
           "custom_partition", "trace_method", "input_names", "no_tie_modules",
           "wall_clock_breakdown", "zero_reduce_bucket_size", "parallel_vocab",
           "sequence_parallel", "sequence_dim", "eval_iters", "zero_stage",
           "prescale_gradients", "gradient_predivide_factor", "save", "save_async", "finetune",
           "no_save_rng", "no_save_optim", "no_load_rng", "no_load_optim", "loss_scale",
           "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
           "min_loss_scale",
           "energy_gpu", "simulated_gpu", "energy_profile", "energy_plan", "pfo_server_url",
           "energy_mode", "energy_max_slowdown", "energy_replan_margin",
           "activation_checkpointing", "checkpoint_num_layers", "activation_checkpoint_ratio",
           "activation_memory_budget", "tp_overlapping_level", "num_model_chunks", "tp_plan",
           "lora_config", "adapter_name", "text_generation", "out_seq_length", "temperature",
           "zero_allow_untested_optimizer", "dealloc_pipeoutput",
           "cp_mode", "recompute_in_backward",  # test_context_parallel_trainer.py
           "auto_parallel", "plan", "plan_memory_gib", "plan_dry_runs",  # test_plan.py
           "zero_allgather_bucket_size"}  # the last refused with the reason (FSDP2's unit)


def _other_value(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return "[0.5]" if value is None else value + "x"


def test_every_other_merak_field_refuses_a_non_default_value():
    import dataclasses

    from transformers import TrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    defaults = MerakArguments(output_dir="out")
    for f in dataclasses.fields(MerakArguments):
        if f.name in WORKING or f.name in inherited:
            continue
        value = _other_value(getattr(defaults, f.name))
        with pytest.raises(NotSupportedYetError):
            MerakArguments(output_dir="out", **{f.name: value})


@pytest.mark.parametrize("scenario", ["kill-and-resume", "kill-and-resume-zero3-fp16"])
def test_kill_during_a_save_then_resume_continues_the_same_loss_curve(four_ranks, scenario):
    results, output = four_ranks
    check(results["trainer_resume.py"], output, scenario)


def test_hf_trainer_api_save_model_metrics_and_a_partial_eval_batch(runs):
    """save_model() on dp2 x tp2 x pp2 writes an HF directory (equal to `merak export` of the
    checkpoint of the same step, checked in the worker); HF Trainer evaluating that directory
    on the same 21 rows (a partial last batch, another batch size) gives Merak's eval loss and
    compute_metrics over preprocess_logits_for_metrics."""
    import transformers as tf
    from trainer_common import dataset, token_accuracy

    out, results, output = runs
    check(results, output, "hf-api")
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
    check(*reshards, scenario)


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


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The one 2-rank launch (dp1 x tp1 x pp2; tp2 for neftune): trainer_fp16.py's scenarios."""
    out = tmp_path_factory.mktemp("two-ranks")
    os.environ["MERAK_TRAINER_OUT"] = str(out)
    try:
        return (out, *launch("trainer_fp16.py", 2, out / "ranks"))
    finally:
        del os.environ["MERAK_TRAINER_OUT"]


def test_fp16_overflow_skips_the_step_and_halves_the_scale(two_ranks):
    check(*two_ranks[1:], "fp16-overflow")


def test_lora_config_trains_like_peft_exports_and_generates(two_ranks):
    check(*two_ranks[1:], "lora-trainer")


def test_push_to_hub_uploads_the_gathered_model_and_checkpoints(two_ranks):
    check(*two_ranks[1:], "push-to-hub")


def test_ignore_data_skip_restarts_the_resumed_epoch(two_ranks):
    check(*two_ranks[1:], "ignore-data-skip")


def test_dataloader_workers_collate_the_same_batches(two_ranks):
    check(*two_ranks[1:], "dataloader-workers")


def test_compute_metrics_per_step_with_inputs_and_losses(two_ranks):
    check(*two_ranks[1:], "eval-metrics-inputs")


def test_auto_find_batch_size_halves_until_every_rank_fits(two_ranks):
    check(*two_ranks[1:], "auto-find-batch-size")


def test_torch_compile_compiles_the_blocks_with_eager_losses(two_ranks):
    check(*two_ranks[1:], "torch-compile-pp2")


def test_neftune_noise_matches_a_single_process_reference(two_ranks):
    check(*two_ranks[1:], "neftune-pp2")


def test_neftune_noise_is_the_same_on_the_tp_ranks(two_ranks):
    check(*two_ranks[1:], "neftune-tp2")


def test_torch_compile_and_neftune_fields_take_hf_defaults():
    args = MerakArguments(output_dir="out", torch_compile_mode="max-autotune-no-cudagraphs")
    assert args.torch_compile and args.torch_compile_backend == "inductor"
    args = MerakArguments(output_dir="out", torch_compile_backend="aot_eager")
    assert args.torch_compile and args.torch_compile_mode is None
    assert MerakArguments(output_dir="out", neftune_noise_alpha=5.0).neftune_noise_alpha == 5.0


def test_neftune_hook_noise_is_keyed_by_step_microbatch_and_dp_rank():
    """The noise of `merak.trainer.neftune`: HF's magnitude; the same for the same key (a
    recompute of the micro-batch), another for another dp rank, step or micro-batch; none in
    eval mode or without gradients."""
    import math

    import torch

    from merak.schedule.actions import Action, ActionKind
    from merak.trainer.neftune import NEFTune

    def noise(dp_rank=0, step=0, mb=0, kind=ActionKind.FORWARD, train=True, grad=True):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 8).train(train)
        hook = NEFTune(5.0, 42, dp_rank, lambda: step)
        assert hook.attach(embedding, embedding)
        hook.on_instruction_begin(kind.value, Action(kind, 0, mb))
        ids = torch.arange(6).view(2, 3)
        with torch.set_grad_enabled(grad):
            return (embedding(ids) - torch.nn.functional.embedding(ids, embedding.weight)).detach()

    first = noise()
    bound = 5.0 / math.sqrt(3 * 8)
    assert 0 < first.abs().max() <= bound and first.abs().max() > bound / 2
    assert torch.equal(first, noise(kind=ActionKind.RECOMPUTE))
    for other in ({"dp_rank": 1}, {"step": 1}, {"mb": 1}):
        assert not torch.equal(first, noise(**other)), other
    assert not noise(train=False).any() and not noise(grad=False).any()


def test_hf_fields_with_their_hf_meaning():
    """gradient_checkpointing is Merak's recomputation (use_reentrant & co. accepted: there is
    no torch.utils.checkpoint); the other fields of HF's training flow are accepted as HF parses
    them."""
    args = MerakArguments(output_dir="out", gradient_checkpointing=True,
                          gradient_checkpointing_kwargs={"use_reentrant": False,
                                                         "preserve_rng_state": True})
    assert args.activation_checkpointing
    (parsed,) = HfArgumentParser(MerakArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--gradient_checkpointing", "--gradient_checkpointing_kwargs",
         '{"use_reentrant": true}', "--eval_strategy", "epoch", "--save_strategy", "epoch",
         "--load_best_model_at_end", "--metric_for_best_model", "loss", "--eval_on_start",
         "--label_smoothing_factor", "0.1", "--include_num_input_tokens_seen", "true",
         "--torch_empty_cache_steps", "4", "--full_determinism", "--eval_accumulation_steps",
         "2", "--eval_delay", "1"])
    assert parsed.activation_checkpointing and parsed.load_best_model_at_end
    with pytest.raises(ValueError, match="only applies with gradient_checkpointing=True"):
        MerakArguments(output_dir="out", gradient_checkpointing_kwargs={"use_reentrant": True})
    MerakArguments(output_dir="out", save_strategy="best", metric_for_best_model="loss",
                   eval_strategy="steps", eval_steps=2)


def test_label_smoothed_loss_equals_hf_label_smoother():
    import torch
    from transformers import GPT2ForSequenceClassification, LlamaConfig, LlamaForCausalLM
    from transformers.trainer_pt_utils import LabelSmoother

    from merak.trainer.losses import LabelSmoothedLoss, shifts_labels

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=generator)
    labels = torch.randint(0, 11, (3, 7), generator=generator)
    labels[0, 2:5] = -100
    for shift in (True, False):
        expected = LabelSmoother(epsilon=0.1)({"logits": logits}, labels, shift_labels=shift)
        ours = LabelSmoothedLoss(0.1, shift_labels=shift)({"logits": logits}, labels)
        assert ours.item() == pytest.approx(expected.item(), rel=1e-6)
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=2)
    assert shifts_labels(LlamaForCausalLM(config))
    assert not shifts_labels(GPT2ForSequenceClassification.__new__(
        GPT2ForSequenceClassification))


@pytest.mark.parametrize("scale", [2.0 ** 12, 3.0])
def test_fused_unscale_matches_dividing_each_gradient_and_finds_overflow(scale):
    """The fp16 scaler's fused unscale-and-check (one kernel per device and dtype, no host
    sync per gradient) gives what dividing each gradient and testing it gave, and flags an inf
    or nan in any one of them."""
    from merak.engine.loss_scale import unscale_and_check

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(shape, generator=g) * scale for shape in ((7, 5), (13,), (2, 3, 4))]
    grads.append(torch.randn(6, generator=g).to(torch.bfloat16) * scale)  # another dtype group
    expected = [x / scale for x in grads]
    found = unscale_and_check(grads, scale, torch.device("cpu"))
    assert found.item() == 0.0
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-6 if got.dtype == torch.float32 else 1e-2,
                                   atol=0)
    for bad in (float("inf"), float("nan")):
        grads = [torch.ones(4), torch.ones(3, dtype=torch.bfloat16)]
        grads[1][2] = bad
        assert unscale_and_check(grads, scale, torch.device("cpu")).item() == 1.0


def test_loss_fn_replaces_the_models_own_loss():
    """One process (dp = tp = pp = 1): a custom loss_fn is what the trainer minimizes."""
    from transformers import default_data_collator

    import merak
    from merak.trainer.model_setup import default_loss_fn

    merak.init(dp=1, tp=1, pp=1)
    with merak.init_empty_weights():
        model = build("llama")
    doubled = lambda outputs, labels: 2 * default_loss_fn(outputs, labels)
    args = MerakArguments(output_dir="out", max_steps=1, per_device_train_batch_size=4,
                          report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no",
                          train_sampling_strategy="sequential")
    from trainer_common import train_set

    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set(),
                                 loss_fn=doubled)
    trainer.train()
    reference = build("llama")
    batch = default_data_collator(train_set()[:4])
    expected = 2 * default_loss_fn(reference(input_ids=batch["input_ids"]), batch["labels"])
    assert trainer.state.log_history[0]["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert expected.item() == pytest.approx(2 * reference(**batch).loss.item(), rel=1e-5)


def test_an_explicit_tp_plan_reaches_parallelize(monkeypatch):
    """MerakArguments(tp_plan=dict) becomes a TPPlan, which MerakTrainer hands to
    parallelize over the one set_tp_layer_lists recorded."""
    import torch
    from trainer_common import train_set

    import merak
    import merak.engine.assemble as assemble_module
    from merak.tensor_parallel.plans.tp_plan import clear_registered_plan

    merak.init(dp=1, tp=1, pp=1)
    try:
        merak.set_tp_layer_lists(col_para_list=["registered"])
        args = MerakArguments(output_dir="out", max_steps=1, report_to="none", use_cpu=True,
                              tp_plan={"col_para_list": ["mlp.up_proj"],
                                       "row_para_list": ["mlp.down_proj"]})
        assert isinstance(args.tp_plan, merak.TPPlan)
        assert args.tp_plan.column == ("mlp.up_proj",)
        seen = {}

        def fake_parallelize(model, example, ctx, **options):
            seen.update(options)
            raise InterruptedError

        monkeypatch.setattr(assemble_module, "parallelize", fake_parallelize)
        with merak.init_empty_weights():
            model = build("llama")
        trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set())
        ids = torch.zeros(2, 8, dtype=torch.long)
        with pytest.raises(InterruptedError):
            trainer._assemble({"input_ids": ids, "labels": ids})
        assert seen["tensor_parallel"].plan is args.tp_plan
    finally:
        clear_registered_plan()


def test_checkpoint_flags_without_optimizer_or_rng(tmp_path):
    """save=True saves every save_steps; no_save_optim / no_save_rng leave those out, and
    resuming such a checkpoint needs no_load_optim (one process)."""
    import torch
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
    import torch
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
