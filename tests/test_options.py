"""Options objects (`merak/options.py`): each entry point takes its layer's options object whole
or its fields by name, refuses unknown names with the object's fields, and `EngineOptions`
groups what `MerakArguments` says by concern."""

from __future__ import annotations

import pytest
import torch
from hf_models import CustomMLP, batch

import merak
from merak.options import given
from merak.partition.options import SplitOptions
from merak.runtime.options import RuntimeOptions
from merak.tensor_parallel.plans.options import TensorParallelOptions
from merak.trainer.arguments import MerakArguments


def test_an_object_and_fields_by_name_make_one_options_object():
    whole = SplitOptions(trace_method="fx", partition_method="parameters")
    assert given(SplitOptions, whole, {}, "f") is whole
    assert given(SplitOptions, None, {"trace_method": "fx"}, "f") == SplitOptions(
        trace_method="fx")
    both = given(SplitOptions, whole, {"partition_method": "uniform"}, "f")  # the field wins
    assert (both.trace_method, both.partition_method) == ("fx", "uniform")
    with pytest.raises(TypeError, match=r"f got unknown option\(s\) \['trace'\].*trace_method"):
        given(SplitOptions, None, {"trace": "fx"}, "f")
    with pytest.raises(TypeError, match="takes a SplitOptions as its options, got RuntimeOpt"):
        given(SplitOptions, RuntimeOptions(), {}, "f")


def test_options_check_their_own_values_when_made():
    with pytest.raises(ValueError, match="unknown trace_method 'jit'"):
        SplitOptions(trace_method="jit")
    with pytest.raises(ValueError, match="unknown partition_method 'even'"):
        SplitOptions(partition_method="even")
    with pytest.raises(ValueError, match="layer_split' needs custom_split_points"):
        SplitOptions(split_method="layer_split")
    with pytest.raises(ValueError, match="num_microbatches must be >= 1, got 0"):
        RuntimeOptions(num_microbatches=0)
    assert SplitOptions(custom_partition=[0, 2, 4]).custom_partition == (0, 2, 4)
    assert RuntimeOptions(recompute_ratio=[0.5, 1.0]).recompute_ratio == (0.5, 1.0)
    assert RuntimeOptions(schedule="zbv", num_model_chunks=4).chunks == 2  # a V: always 2
    assert RuntimeOptions(schedule="interleaved_1f1b", num_model_chunks=3).chunks == 3


def test_entry_points_take_the_object_or_its_fields():
    model = CustomMLP()
    inputs = batch("mlp", 0, 2)
    by_name = merak.auto_split(model, inputs, 2, partition_method="parameters")
    whole = merak.auto_split(CustomMLP(), inputs, 2, SplitOptions(partition_method="parameters"))
    assert by_name.blocks_of_stage == whole.blocks_of_stage
    with pytest.raises(TypeError, match=r"auto_split got unknown option\(s\) \['tp_plan'\]"):
        merak.auto_split(CustomMLP(), inputs, 2, tp_plan=None)
    with pytest.raises(TypeError, match="parallelize got unknown option.*TensorParallelOptions' "
                                        "fields .*plan.*SplitOptions'"):
        merak.parallelize(CustomMLP(), inputs, object(), tp_plan={})
    with pytest.raises(TypeError, match="apply_tensor_parallel got unknown option"):
        merak.apply_tensor_parallel(CustomMLP(), object(), overlap=1)


def test_engine_options_group_the_arguments_by_concern():
    args = MerakArguments(output_dir="out", use_cpu=True, report_to="none", bf16=True,
                          zero_stage=1, train_schedule="interleaved_1f1b", num_model_chunks=2,
                          gradient_accumulation_steps=4, partition_method="parameters",
                          parallel_vocab=True, activation_checkpointing=True,
                          checkpoint_num_layers=2, max_grad_norm=0.5, torch_compile=True)
    o = args.engine_options(pp=2, dp=2, leaf_modules=("head",))
    assert o.split == SplitOptions(partition_method="parameters", leaf_modules=("head",))
    assert o.tensor_parallel == TensorParallelOptions(parallel_vocab=True)
    assert o.pipeline == RuntimeOptions(schedule="interleaved_1f1b", num_microbatches=4,
                                        num_model_chunks=2,
                                        bucket_bytes=args.gradient_bucket_bytes,
                                        recompute_ratio=1.0, segment_size=2)
    assert (o.precision.autocast_dtype, o.precision.zero_stage) == (torch.bfloat16, 1)
    assert (o.compile.enabled, o.hooks.max_grad_norm) == (True, 0.5)
