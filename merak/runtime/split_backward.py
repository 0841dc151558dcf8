"""A backward in two halves, for zero-bubble schedules: input gradients now, weight gradients
later.

PyTorch's pipelining package already solves the hard part: after the input-gradient pass it
knows which autograd nodes lead to the weights and keeps the gradients flowing into them, so
the weight pass starts there instead of rerunning the whole backward
(`torch.distributed.pipelining._backward`, private but stable since 2.4; we use it rather than
copy it). This module adapts it to the interpreter's values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor],
                   weights: Sequence[torch.nn.Parameter]) -> tuple[list[torch.Tensor], object]:
    """Gradients of `inputs` (zeros where unused) from `roots` seeded with `grads` (None: the
    root is a scalar loss), and what `backward_weight` needs later.

    A stage whose inputs need no gradient (the first) has nothing to send upstream: its whole
    backward then runs in the weight half, which is off the critical path."""
    roots = list(roots)
    if not inputs or not roots:
        return [], ("whole", roots, list(grads))
    seeds = None if all(g is None for g in grads) else [
        torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]
    dinputs, groups = stage_backward_input(roots, seeds, list(inputs), iter(weights))
    dinputs = [torch.zeros_like(x) if d is None else d for x, d in zip(inputs, dinputs)]
    return dinputs, ("groups", groups)


def backward_weight(pending: object, weights: Sequence[torch.nn.Parameter]) -> None:
    """Accumulate the weight gradients left by `backward_input` into ``param.grad``."""
    if pending is None:
        raise RuntimeError("backward_weight of a micro-batch whose backward_input did not run")
    if pending[0] == "whole":
        _, roots, grads = pending
        if roots:
            torch.autograd.backward(roots, grads)
        return
    stage_backward_weight(iter(weights), pending[1])
