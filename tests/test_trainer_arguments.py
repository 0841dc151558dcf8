"""`MerakArguments` (merak/trainer/arguments.py): parsed from the command line, every field
with help, bad values and fields not landed named, HF's inherited fields honoured or refused
with their reason, in one process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser

from merak import MerakArguments, NotSupportedYetError


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
           "fp8", "fp8_exclude",  # test_fp8.py
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


def test_torch_compile_and_neftune_fields_take_hf_defaults():
    args = MerakArguments(output_dir="out", torch_compile_mode="max-autotune-no-cudagraphs")
    assert args.torch_compile and args.torch_compile_backend == "inductor"
    args = MerakArguments(output_dir="out", torch_compile_backend="aot_eager")
    assert args.torch_compile and args.torch_compile_mode is None
    assert MerakArguments(output_dir="out", neftune_noise_alpha=5.0).neftune_noise_alpha == 5.0


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
