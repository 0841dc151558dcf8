"""fp16 loss scaling for the pipeline (DeepSpeed's semantics, checked across every rank).

The interpreter multiplies each micro-batch's loss by `scale` before backward, so the gradients
that travel between stages and accumulate in the fp32 master weights' `.grad` are scaled. Before
the optimizer step this hook divides them back and checks, over all ranks, for inf/nan: on an
overflow the step is skipped (gradients dropped) and, once `hysteresis` overflows have been
seen, the scale is halved (never below `min_scale`); after `window` clean steps it doubles.
A static scale (`loss_scale` > 0) never changes, but overflowing steps are still skipped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from merak.data_parallel.shards import local
from merak.distributed.parallel_context import ParallelContext
from merak.runtime.hooks import InstructionHook


class LossScaler(InstructionHook):
    def __init__(self, engine, ctx: ParallelContext, *, static_scale: float = 0.0,
                 initial_scale_power: int = 32, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0):
        self.engine, self.ctx = engine, ctx
        self.dynamic = static_scale == 0
        self.scale = float(2 ** initial_scale_power) if self.dynamic else float(static_scale)
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self._left = hysteresis
        self._clean_steps = 0
        self.overflowed = False
        self.skipped_steps = 0
        engine.loss_scale = self.scale

    def on_instruction_begin(self, name: str, action) -> None:
        if name != "optimizer_step":
            return
        grads = [local(p.grad) for p in self.engine.stage.parameters() if p.grad is not None]
        bad = unscale_and_check(grads, self.scale, self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self.overflowed = bool(bad.item())
        self.engine.skip_optimizer_step = self.overflowed
        self._update()

    def _update(self) -> None:
        if self.overflowed:
            self.skipped_steps += 1
            self._clean_steps = 0
            if self.dynamic:
                self._left -= 1
                if self._left <= 0:
                    self.scale = max(self.scale / 2, self.min_scale)
                    self._left = self.hysteresis
        else:
            self._clean_steps += 1
            if self.dynamic and self._clean_steps % self.window == 0:
                self.scale *= 2
                self._left = self.hysteresis
        self.engine.loss_scale = self.scale

    def state_dict(self) -> dict:
        return {"scale": self.scale, "left": self._left, "clean": self._clean_steps,
                "skipped": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._left = state["scale"], state["left"]
        self._clean_steps, self.skipped_steps = state["clean"], state["skipped"]
        self.engine.loss_scale = self.scale


def unscale_and_check(grads: list[torch.Tensor], scale: float, device: torch.device
                      ) -> torch.Tensor:
    """Multiply every gradient by 1 / `scale` in place; returns a one-element tensor on
    `device`, 1.0 when any gradient holds an inf or nan. One fused kernel per (device, dtype)
    (`torch._amp_foreach_non_finite_check_and_unscale_`, what `torch.amp.GradScaler` runs), with
    no host synchronisation: the caller reads the flag once, after the all-reduce."""
    found = torch.zeros(1, device=device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (where, _), group in groups.items():
        flag = found if where == found.device else torch.zeros(1, device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, flag, torch.full((1,), 1.0 / scale, device=where))
        if flag is not found:
            found = torch.maximum(found, flag.to(device))
    return found
