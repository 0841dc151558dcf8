"""`partition_method='profile'`: time each block's forward + backward on this rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from merak.materialize.meta import has_meta_parameters
from merak.partition.graph_rewrite import prepare_inputs


def _time_fwd_bwd(module: nn.Module, args: tuple, kwargs: dict, repeats: int) -> float:
    def run() -> None:
        out = module(*args, **kwargs)
        tensors = [t for t in torch.utils._pytree.tree_leaves(out)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])

    run()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats


def _share_before_blocks(model: nn.Module, blocks: list[str], example_inputs: dict) -> float:
    """Fraction of the non-block forward time spent before the first block (embeddings) rather
    than after the last (head, loss): timestamps around the blocks in one forward."""
    marks: dict[str, float] = {}

    def mark(name: str):
        def hook(*_) -> None:  # returns None: hooks must not replace inputs or outputs
            marks.setdefault(name, time.perf_counter()) if name == "first" else \
                marks.__setitem__(name, time.perf_counter())
        return hook

    first, last = model.get_submodule(blocks[0]), model.get_submodule(blocks[-1])
    hooks = [first.register_forward_pre_hook(mark("first")),
             last.register_forward_hook(mark("last"))]
    try:
        with torch.no_grad():
            start = time.perf_counter()
            model(**example_inputs)
            end = time.perf_counter()
    finally:
        for hook in hooks:
            hook.remove()
    pre, post = marks["first"] - start, end - marks["last"]
    return pre / (pre + post) if pre + post > 0 else 0.5


def profile_blocks(model: nn.Module, blocks: list[str], example_inputs: dict,
                   repeats: int = 3) -> list[float]:
    """Seconds of forward+backward per block; the rest of the model (embeddings, head, loss) is
    split between the first and last block. On several ranks, rank 0's measurement is used by
    all, so every rank computes the same partition."""
    if has_meta_parameters(model):
        raise ValueError("partition_method='profile' runs the model, but its parameters are on "
                         "the meta device; use partition_method='parameters', or profile a "
                         "materialized copy")
    captured: dict[str, tuple[tuple, dict]] = {}
    hooks = [model.get_submodule(b).register_forward_pre_hook(
        lambda _m, args, kwargs, name=b: captured.setdefault(name, (args, kwargs)),
        with_kwargs=True) for b in blocks]
    example_inputs = prepare_inputs(model, example_inputs)  # use_cache=False: no KV cache
    try:
        with torch.no_grad():
            model(**example_inputs)
    finally:
        for hook in hooks:
            hook.remove()
    weights = []
    for b in blocks:
        args, kwargs = captured[b]
        args, kwargs = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()),
            (args, kwargs))
        weights.append(_time_fwd_bwd(model.get_submodule(b), args, kwargs, repeats))
    total = _time_fwd_bwd(model, (), example_inputs, repeats)
    glue = max(total - sum(weights), 0.0)
    before = _share_before_blocks(model, blocks, example_inputs)
    weights[0] += glue * before
    weights[-1] += glue * (1.0 - before)
    model.zero_grad(set_to_none=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        from merak.distributed.host_objects import broadcast_object

        weights = broadcast_object(weights, src=0)  # through host memory, not the GPU
    return weights
