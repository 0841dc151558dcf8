"""Data-parallel pieces on one process: ZeRO-2/3's mixed precision under bf16 (FSDP2 over a
1-rank gloo dp group) and the bucketed gradient buffers' zeroing. Their multi-rank behaviour
(dp averaging, reduce-scatters, parity with HF Trainer) is in test_pipeline_parity and
test_trainer."""

from __future__ import annotations

import pytest
import torch
from op_counter import OpCounter

import merak
from merak.data_parallel.grad_sync import _Bucket
from merak.data_parallel.zero import ZeroSharding
from merak.models.gpt import GPT, GPTConfig, gpt_pieces


def _step(zero: ZeroSharding, stage, seen: dict) -> None:
    """One training step's compute as the interpreter runs it: a micro-batch forward and
    backward (gradient sync off), the last one inside `last_backward`, then the tail's
    reduce-scatter."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for last in (False, True):
        with zero.last_backward(stage.stage_id) if last else torch.enable_grad():
            values = stage({("input_ids", -1): ids, ("labels", -1): ids})
            loss = next(v for (name, _), v in values.items() if name == "loss")
            loss.backward()
    zero.reduce_scatter()
    seen["grads"] = {n: p.grad for n, p in stage.named_parameters()}


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, None])
def test_zero3_gathers_bf16_and_keeps_fp32_shards_and_gradients(param_dtype):
    """Under bf16 the blocks' forward sees bf16 parameters (the all-gather moves half the
    bytes), while the shards the optimizer steps and their gradients, accumulated over two
    micro-batches and reduce-scattered, stay fp32. fp32 training (None) gathers fp32."""
    ctx = merak.init(dp=1, tp=1, pp=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_positions=16, hidden_size=16, num_layers=2,
                          num_heads=2, tie_word_embeddings=False))
    split = merak.manual_split(model, gpt_pieces(model), num_stages=1)
    stage = merak.PipelineStage(model, split, 0)
    zero = ZeroSharding(stage, ctx, 3, param_dtype=param_dtype)
    in_forward: set[torch.dtype] = set()
    for block in model.blocks:
        block.register_forward_pre_hook(
            lambda module, args: in_forward.update(p.dtype for p in module.parameters()))
    seen: dict = {}
    _step(zero, stage, seen)
    assert in_forward == {param_dtype or torch.float32}
    for name, param in stage.named_parameters():
        assert param.dtype == torch.float32, name  # the sharded master copy
        grad = seen["grads"][name]
        assert grad is not None and grad.dtype == torch.float32, (name, grad)
        assert torch.isfinite(grad.to_local()).all(), name


def test_a_bucket_is_zeroed_with_one_kernel_when_every_gradient_was_dropped():
    """At a step's start (the optimizer set every gradient to None) one `zero_` of the flat
    buffer, not one per parameter; the gradients are views of it and read zero. A gradient
    set by hand is copied in, and a gradient already a view keeps its value."""
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((3, 4), (5,), (2, 2, 2))]
    bucket = _Bucket(params)
    with OpCounter() as ops:
        bucket.attach()
    assert ops.names.count("zero_") == 1 and "copy_" not in ops.names, ops.names
    for p, view in zip(params, bucket.views()):
        assert p.grad.data_ptr() == view.data_ptr() and torch.equal(p.grad, torch.zeros_like(p))
    for p in params:
        p.grad.add_(1.0)  # backward accumulates into the views
    bucket.attach()  # every gradient already a view: nothing changes
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)
    params[0].grad, params[1].grad = None, torch.full((5,), 7.0)  # dropped; set by hand
    bucket.attach()
    assert torch.equal(params[0].grad, torch.zeros(3, 4))
    assert torch.equal(params[1].grad, torch.full((5,), 7.0))
    assert torch.equal(params[2].grad, torch.ones(2, 2, 2))  # kept
    assert bucket.buffer.data_ptr() == params[0].grad.data_ptr()
    for p in params:
        p.grad = None
    params[2].grad = torch.full((2, 2, 2), 3.0)  # held elsewhere, the rest dropped
    bucket.attach()
    assert torch.equal(bucket.buffer, torch.cat([torch.zeros(12), torch.zeros(5),
                                                 torch.full((8,), 3.0)]))
