"""The proof an inferred tensor-parallel plan (``TPPlan.check``) passes before it is used.

Before the model is sharded, `collect` keeps, for the first block of each structure, an
unsharded copy on the meta device and the shapes of its inputs (captured with the model's real
call signature on fake weights, `merak.tensor_parallel.tracing.trace`). Once this rank's stage is
materialized or loaded (`merak.parallelize`), `prove_plan` takes one block of each structure the
rank holds, builds the unsharded block from the same weights (sharded parameters gathered over
the tp group), and runs both on the same small random inputs, forward and backward, in eval mode
(no dropout): the outputs the model reads, a loss over them, the gradients of the floating inputs
and of every parameter (this rank's slice of a sharded one; the sum over tp of a partial one)
must agree within float tolerance. Every rank of the job learns every rank's verdict, so all
refuse together: a plan that fails raises `PlanRefused` naming the module and the reason, and is
never trained with.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from merak.distributed import liveness
from merak.distributed.host_objects import all_gather_objects
from merak.tensor_parallel.tracing.diagnose import explain_tp_failure
from merak.tensor_parallel.tracing.trace import (
    capture_blocks,
    fake_run,
    meta_copy,
    plain,
    signature,
)

RTOL = {torch.float32: 1e-3, torch.float64: 1e-6}  # else (bf16, fp16): 5e-2
ATOL = 1e-5


class PlanRefused(ValueError):
    """An inferred tensor-parallel plan failed its proof: the sharded block does not compute
    what the unsharded one does."""


@dataclass(frozen=True)
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool  # carries a gradient in training


@dataclass
class Example:
    """One block structure: its blocks, an unsharded meta copy, its inputs' shapes, and which of
    its flat outputs the model reads."""

    members: list[str]
    skeleton: nn.Module
    inputs: Any
    read: list[bool]


def collect(model: nn.Module, blocks: list[str], device="cpu") -> list[Example]:
    """What `prove_plan` needs, taken from `model` before it is sharded."""
    with fake_run(model, device) as ids:
        captured = capture_blocks(model, blocks, ids)
        specs = {name: pytree.tree_map(
            lambda t: _Spec(tuple(t.shape), t.dtype, t.requires_grad)
            if isinstance(t, torch.Tensor) else t,
            (args, kwargs)) for name, (args, kwargs, _) in captured.items()}
    kinds = {b: signature(model.get_submodule(b)) for b in blocks}
    return [Example([b for b in blocks if kinds[b] == kinds[name]],
                    meta_copy(model.get_submodule(name)), specs[name], read)
            for name, (_, _, read) in captured.items()]


def _inputs(spec, device, generator: torch.Generator):
    def make(leaf):
        if not isinstance(leaf, _Spec):
            return leaf
        if leaf.dtype.is_floating_point:
            t = torch.randn(leaf.shape, generator=generator) * 0.5
            return t.to(device=device, dtype=leaf.dtype).requires_grad_(leaf.requires_grad)
        if leaf.dtype == torch.bool:
            return torch.ones(leaf.shape, dtype=torch.bool, device=device)
        last = leaf.shape[-1] if leaf.shape else 1
        return torch.arange(last).expand(leaf.shape).to(device=device, dtype=leaf.dtype)
    return pytree.tree_map(make, spec)


def _leaves(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _fresh(inputs):
    """A copy of `inputs`: new leaves, requiring grad where the training inputs do."""
    return pytree.tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad)
                           if isinstance(t, torch.Tensor) else t, inputs)


def _full(param: torch.Tensor, group) -> torch.Tensor:
    spec = getattr(param, "tp_shard", None)
    if spec is None:
        return param.detach()
    shards = [torch.empty_like(param) for _ in range(spec.size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return spec.assemble(shards)


def _mismatch(mine: torch.Tensor | None, want: torch.Tensor | None, what: str) -> str | None:
    if (mine is None) != (want is None):
        return f"{what}: {'no gradient' if mine is None else 'a gradient'} where the unsharded " \
               f"block has {'one' if mine is None else 'none'}"
    if mine is None:
        return None
    if mine.shape != want.shape:
        return f"{what} has shape {list(mine.shape)}, the unsharded block's {list(want.shape)}"
    diff = (mine.float() - want.float()).abs().max().item() if mine.numel() else 0.0
    scale = want.float().abs().max().item() if want.numel() else 0.0
    if not diff <= ATOL + RTOL.get(want.dtype, 5e-2) * scale:
        return f"{what} differs by {diff:.2e} (largest {scale:.2e})"
    return None


def _prove_block(model: nn.Module, name: str, example: Example, ctx) -> list[str]:
    """The mismatches of block `name` against its unsharded copy (empty: it matches)."""
    block, group, device = model.get_submodule(name), ctx.tp_group, ctx.device
    reference = copy.deepcopy(example.skeleton).to_empty(device=device)
    with torch.no_grad():
        for pname, param in block.named_parameters():
            reference.get_parameter(pname).copy_(_full(param, group))
        for bname, buf in block.named_buffers():
            reference.get_buffer(bname).copy_(buf)
    generator = torch.Generator().manual_seed(20240611)
    inputs = _inputs(example.inputs, device, generator)
    ours, theirs = _fresh(inputs), _fresh(inputs)
    modes = [(m, m.training) for m in block.modules()]
    block.eval()
    reference.eval()
    problems: list[str] = []
    try:
        outs = _leaves(plain(block(*ours[0], **ours[1])))
        refs = _leaves(plain(reference(*theirs[0], **theirs[1])))
        loss = torch.zeros((), device=device)
        ref_loss = torch.zeros((), device=device)
        for i, (out, ref) in enumerate(zip(outs, refs)):
            if i < len(example.read) and not example.read[i] or not ref.is_floating_point():
                continue
            problems.append(_mismatch(out.detach(), ref.detach(), f"output {i}"))
            if out.shape == ref.shape and ref.requires_grad:
                weight = torch.randn(ref.shape, generator=generator).to(device, ref.dtype)
                loss = loss + (out.float() * weight.float()).sum()
                ref_loss = ref_loss + (ref.float() * weight.float()).sum()
        if ref_loss.requires_grad:
            ref_loss.backward()
            loss.backward()
        problems.append(_mismatch(loss.detach(), ref_loss.detach(), "the loss"))
        for i, (mine, want) in enumerate(zip(_leaves(ours), _leaves(theirs))):
            if want.requires_grad:
                problems.append(_mismatch(mine.grad, want.grad, f"the gradient of input {i}"))
        for pname, param in block.named_parameters():
            problems.append(_mismatch(_grad(param, group), _want(param, reference, pname),
                                      f"the gradient of {name}.{pname}"))
    finally:
        for module, mode in modes:
            module.train(mode)
        for param in block.parameters():
            param.grad = None
    return [p for p in problems if p]


def _grad(param: torch.Tensor, group) -> torch.Tensor | None:
    grad = param.grad
    if grad is not None and getattr(param, "tp_partial_grad", False):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
    return grad


def _want(param: torch.Tensor, reference: nn.Module, pname: str) -> torch.Tensor | None:
    grad = reference.get_parameter(pname).grad
    spec = getattr(param, "tp_shard", None)
    return spec.take(grad) if spec is not None and grad is not None else grad


def _materialized(block: nn.Module) -> bool:
    return not any(p.is_meta for p in block.parameters())


def prove_plan(model: nn.Module, examples: list[Example], ctx) -> None:
    """Check the sharded blocks this rank holds against their unsharded copies (see the module
    docstring); a collective of the whole job.

    Raises:
        PlanRefused: on every rank, when a block of any rank does not match.
    """
    found: list[str] = []
    for example in examples:
        name = next((b for b in example.members if _materialized(model.get_submodule(b))), None)
        if name is None:
            continue
        try:
            with torch.random.fork_rng(devices=[]):  # training's random stream untouched
                found += _prove_block(model, name, example, ctx)
        except Exception as error:  # noqa: BLE001 - a block that cannot run is refused too
            if not _same_on_every_rank(error):
                raise
            found.append(f"{name} fails to run sharded: "
                         + (explain_tp_failure(model, error) or f"{type(error).__name__}: "
                            f"{str(error).splitlines()[0][:300] if str(error) else ''}"))
    everyone = all_gather_objects(found) if dist.is_initialized() else [found]
    problems = list(dict.fromkeys(p for rank in everyone for p in rank))
    if problems:
        # the parameters' gradients name the modules: those first
        problems.sort(key=lambda p: not p.startswith("the gradient of")
                      or p.startswith("the gradient of input"))
        more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
        raise refusal(model, "fails its proof: " + "; ".join(problems[:2]) + more)


def _same_on_every_rank(error: BaseException) -> bool:
    """Whether `error` is the block's own (a shape or type error, met at the same point by
    every TP rank running the same code), not this rank's alone: an out-of-memory error or a
    failed wait strikes one rank, whose peers are then inside a collective it will never
    join. Those are raised, so the job fails naming the rank, rather than refused as a plan."""
    if isinstance(error, (torch.OutOfMemoryError, liveness.PeerFailureError)):
        return False
    return not liveness.is_peer_failure(error) and "out of memory" not in str(error).lower()


def refusal(model: nn.Module, reason: str) -> PlanRefused:
    """The error refusing `model`'s plan for `reason`, with what to do instead."""
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    return PlanRefused(
        f"the tensor-parallel plan inferred for {family} is refused, never used: it {reason}. "
        f"Print the plan with `merak tp-plan {family}`, correct it and pass it as "
        f"MerakArguments(tp_plan=...) / merak.parallelize(..., tp_plan=...), or use tp=1")
