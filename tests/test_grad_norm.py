"""The global grad-norm hook (`merak.engine.grad_norm.GradNormClipper`) on one process:
its local sum of squares against `torch.nn.utils.get_total_norm` and a hand computation in
fp64, over gradients of mixed dtypes, with the per-parameter weights of a tp layout, and the
number of ops it runs (a fixed number per dtype, whatever the number of parameters). The
multi-rank norms (tp, pp, tied weights, ZeRO shards) are compared with HF Trainer's in
test_trainer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from op_counter import OpCounter

from merak.engine.grad_norm import GradNormClipper

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _clipper(num_params: int, tp: int = 1, max_norm: float = 0.0, seed: int = 0):
    """A clipper over `num_params` parameters cycling through DTYPES (one with no gradient,
    one empty), every other one a tp shard (the rest replicated over `tp` ranks)."""
    g = torch.Generator().manual_seed(seed)
    named = []
    for i in range(num_params):
        dtype = DTYPES[i % len(DTYPES)]
        shape = (0,) if i == 5 else (3 + i % 4, 5)
        param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        if i != 2:
            param.grad = (torch.randn(shape, generator=g) * (i + 1)).to(dtype)
        if i % 2:
            param.tp_shard = 0
        named.append((f"p{i}", param))
    stage = SimpleNamespace(split=SimpleNamespace(tied_weights=[], num_stages=1),
                            named_parameters=lambda: iter(named))
    ctx = SimpleNamespace(pp_rank=0, pp=1, tp=tp, dp=1, replicas=1, world_size=1,
                          device=torch.device("cpu"))
    return GradNormClipper(stage, ctx, max_norm), [p for _, p in named]


@pytest.mark.parametrize("tp", [1, 2])
def test_sum_of_squares_matches_fp64_and_get_total_norm(tp):
    clipper, params = _clipper(12, tp=tp)
    total = clipper.local_sum_of_squares()
    assert total.dtype == torch.float64 and total.shape == (1,)
    by_hand = sum(p.grad.double().square().sum().item() * (1.0 if hasattr(p, "tp_shard") else
                                                            1.0 / tp)
                  for p in params if p.grad is not None)
    assert total.item() == pytest.approx(by_hand, rel=1e-6)
    if tp == 1:  # every weight 1: what clip_grad_norm_ computes (on fp32 copies: its own
        grads = [p.grad.float() for p in params if p.grad is not None]  # runs in each dtype)
        expected = torch.nn.utils.get_total_norm(grads).item()
        assert math.sqrt(total.item()) == pytest.approx(expected, rel=1e-6)


def test_clipping_scales_every_gradient_by_the_same_coefficient():
    clipper, params = _clipper(8, max_norm=1.0)
    before = [None if p.grad is None else p.grad.double().clone() for p in params]
    clipper.on_instruction_begin("optimizer_step", None)
    norm = math.sqrt(sum(b.square().sum().item() for b in before if b is not None))
    assert clipper.last_norm == pytest.approx(norm, rel=1e-6)
    coef = 1.0 / (norm + 1e-6)
    for p, b in zip(params, before):
        if b is not None:
            rtol = 1e-6 if p.dtype in (torch.float32, torch.float64) else 1e-2
            torch.testing.assert_close(p.grad.double(), b * coef, rtol=rtol, atol=1e-6)


def test_a_fixed_number_of_ops_per_dtype_whatever_the_number_of_parameters():
    """One `_foreach_norm` per (device, dtype) group and no per-parameter fp64 copies: the
    ops run for 40 parameters are those run for 8 (the same 4 dtypes)."""
    runs = []
    for count in (8, 40):
        clipper, _ = _clipper(count)
        with OpCounter() as ops:
            clipper.local_sum_of_squares()
        runs.append(ops.names)
    assert runs[0] == runs[1], runs
    assert runs[0].count("_foreach_norm") == len(DTYPES), runs[0]
