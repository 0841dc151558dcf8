"""fp16 loss scaling for the pipeline (DeepSpeed's semantics, checked across every rank).

The interpreter multiplies each micro-batch's loss by `scale` before backward, so the gradients
that travel between stages and accumulate in the fp32 master weights' `.grad` are scaled. Before
the optimizer step this hook divides them back and checks, over all ranks, for inf/nan; an
overflowing step is skipped (gradients dropped) on every rank.

The dynamic scale follows DeepSpeed's `DynamicLossScaler` (fp16 config `initial_scale_power`,
`loss_scale_window`, `hysteresis`, `consecutive_hysteresis`, `min_loss_scale`), so a job moved
from DeepSpeed keeps its scale history:

- it starts at 2^`initial_scale_power` (DeepSpeed's default 16, also `torch.amp.GradScaler`'s
  initial 65536, so the first fp16 steps are not spent skipping overflows of a 2^32 scale);
- an overflow halves the scale once `hysteresis` overflows have been absorbed: the first
  `hysteresis - 1` overflows only use up the allowance, and once it is used up every further
  overflow halves, down to `min_loss_scale`; an overflow with the scale already at
  `min_loss_scale` stops training (DeepSpeed raises there too: nothing smaller can be tried);
- a clean step preceded by a positive multiple of `loss_scale_window` consecutive clean steps
  (since the last overflow, or the start) doubles the scale and restores the allowance;
- with `consecutive_hysteresis` every clean step restores the allowance, so only `hysteresis`
  overflows in a row halve the scale.

A static scale (`loss_scale` > 0) never changes, but overflowing steps are still skipped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from merak.data_parallel.shards import local
from merak.distributed import liveness
from merak.distributed.parallel_context import ParallelContext
from merak.runtime.hooks import InstructionHook


class LossScaler(InstructionHook):
    """Unscales the gradients before the optimizer step, skips overflowing steps, and moves the
    dynamic scale by DeepSpeed's rule (see the module docstring).

    Bound to the interpreter with `bind` (`build_engine` does): the interpreter's `loss_scale`
    is what each micro-batch's loss is multiplied by, and its `skip_optimizer_step` is set on
    an overflow.

    Args:
        ctx: the parallel context (the overflow flag is all-reduced over its world).
        static_scale: a fixed scale; 0 for dynamic scaling.
        initial_scale_power: the dynamic scale starts at 2 ** this.
        window: consecutive clean steps before the scale doubles (DeepSpeed's `scale_window`).
        hysteresis: overflows absorbed before the first halving (DeepSpeed's `delayed_shift`).
        consecutive_hysteresis: restore the allowance on every clean step, not only when the
            scale grows.
        min_scale: the dynamic scale never goes below this.
    """

    def __init__(self, ctx: ParallelContext, *, static_scale: float = 0.0,
                 initial_scale_power: int = 16, window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0):
        self.engine, self.ctx = None, ctx
        self.dynamic = static_scale == 0
        self.scale = float(2 ** initial_scale_power) if self.dynamic else float(static_scale)
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self.consecutive_hysteresis = consecutive_hysteresis
        self._left = hysteresis  # overflows still absorbed before a halving (at least 1)
        self._clean_steps = 0  # consecutive clean steps since the last overflow (or the start)
        self.overflowed = False
        self.skipped_steps = 0

    def bind(self, engine) -> None:
        """Scale `engine`'s micro-batch losses from now on (the interpreter this hook is in)."""
        self.engine = engine
        engine.loss_scale = self.scale

    def on_instruction_begin(self, name: str, action) -> None:
        if name != "optimizer_step":
            return
        grads = [local(p.grad) for p in self.engine.stage.parameters() if p.grad is not None]
        bad = unscale_and_check(grads, self.scale, self.ctx.device)
        if self.ctx.world_size > 1:
            with liveness.waiting("the fp16 overflow all-reduce"):
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self.overflowed = bool(bad.item())
        self.engine.skip_optimizer_step = self.overflowed
        self.update(self.overflowed)

    def update(self, overflowed: bool) -> None:
        """Moves the scale after one optimizer step (`overflowed`: the step had inf/nan
        gradients on some rank); the same on every rank, since the flag is all-reduced."""
        if overflowed:
            self.skipped_steps += 1
            self._clean_steps = 0
            if self.dynamic:
                self._on_overflow()
        else:
            if self.dynamic:
                self._on_clean_step()
            self._clean_steps += 1
        self.engine.loss_scale = self.scale

    def _on_overflow(self) -> None:
        if self._left > 1:
            self._left -= 1  # absorbed: the scale stays
            return
        if self.scale <= self.min_scale:
            raise RuntimeError(
                f"fp16 gradients overflow with the loss scale already at min_loss_scale="
                f"{self.min_scale}: training has diverged (DeepSpeed stops here too). Lower "
                f"the learning rate, clip gradients (max_grad_norm), train in bf16, or lower "
                f"MerakArguments.min_loss_scale")
        self.scale = max(self.scale / 2, self.min_scale)

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self._left = self.hysteresis
        if self._clean_steps > 0 and self._clean_steps % self.window == 0:
            self.scale *= 2
            self._left = self.hysteresis

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
