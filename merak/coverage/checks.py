"""One family's coverage checks, run on every rank of a small gloo job (see `worker`).

Each check builds the family's shrunken model on the meta device, goes through the same path
as a user's job (`merak.parallelize`: tensor parallelism, automatic split, materialization of
this rank's part; `PipelineInterpreter` with 1F1B), runs one training step of a few
micro-batches, and compares the loss and every gradient with the single-process model on the
same micro-batches (gradient accumulation, as HF Trainer does it: a family's auxiliary loss is
computed per micro-batch, so the reference must be too).
"""

from __future__ import annotations

import torch
from torch import nn

import merak
from merak.coverage.shrink import EXPERT_NAMES, SmallModel, example_batch
from merak.engine.assemble import build_engine
from merak.engine.options import EngineOptions
from merak.runtime.hooks import InstructionHook
from merak.runtime.options import RuntimeOptions

MICROBATCHES, ROWS = 2, 2
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-3, 1e-5


class ParityError(AssertionError):
    """The parallel model's loss or a gradient differs from the single-process model's."""


class _GradSnapshot(InstructionHook):
    """The stage's gradients as the first optimizer step is about to use them."""

    def __init__(self):
        self.stage: nn.Module | None = None  # set once the engine is built
        self.grads = None

    def on_instruction_begin(self, name, action):
        if name == "optimizer_step" and self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in self.stage.named_parameters()
                          if p.grad is not None}


def batches(dp: int) -> list[dict[str, torch.Tensor]]:
    """The step's micro-batches of every dp rank, rank-major (rank r: items r*M .. r*M+M-1)."""
    return [example_batch(ROWS, seed=k) for k in range(dp * MICROBATCHES)]


def reference(small: SmallModel, dp: int, model: nn.Module | None = None
              ) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (mean over micro-batches and dp ranks) and gradients of the single-process model
    (`small.build()`, or `model` when given: HF's own `from_pretrained` of a saved copy)."""
    model = small.build() if model is None else model
    model.train()
    parts = batches(dp)
    total = 0.0
    for mb in parts:
        loss = model(**mb).loss / len(parts)
        loss.backward()
        total += loss.item()
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return total, grads


def _concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def parallel_step(small: SmallModel, dp: int, tp: int, pp: int, build=None, ep: int = 1
                  ) -> tuple[float, dict[str, torch.Tensor], nn.Module]:
    """One 1F1B training step at (dp, tp, pp) and expert-parallel degree `ep`: its loss
    (averaged over dp), this rank's gradients before the optimizer step, and its stage. The
    model is `small.build()` on meta, or `build()` (e.g. `from_pretrained` of a saved
    directory, loaded per rank)."""
    ctx = merak.init(dp=dp, tp=tp, pp=pp, ep=ep)
    parts = batches(dp)
    mine = _concat(parts[ctx.dp_rank * MICROBATCHES:(ctx.dp_rank + 1) * MICROBATCHES])
    with merak.init_empty_weights():
        model = (build or small.build)()
    snapshot = _GradSnapshot()
    built = build_engine(model, parts[0], ctx,
                         EngineOptions(pipeline=RuntimeOptions(num_microbatches=MICROBATCHES)),
                         make_optimizer=lambda stage: torch.optim.SGD(stage.parameters(), lr=0.0),
                         hooks=[snapshot])
    snapshot.stage = built.stage
    loss = built.interpreter.train_step(mine)
    return loss, snapshot.grads or {}, built.stage


def split_in_process(small: SmallModel, stages: int) -> tuple[float, dict, nn.Module]:
    """The user's automatic split (meta build, fake-weight trace, seeded materialization) run
    stage after stage in this process on the micro-batches of one dp rank: loss and gradients
    by the model's own parameter names, and a module holding those names (for `compare`)."""
    from merak.materialize.meta import materialize_
    from merak.partition.auto import auto_split

    parts = batches(1)
    with merak.init_empty_weights():
        model = small.build()
    split = auto_split(model, parts[0], stages)
    materialize_(split.container)
    model.train()
    total = 0.0
    for mb in parts:
        loss = split(**mb).loss / len(parts)
        loss.backward()
        total += loss.item()
    own = nn.Module()  # the split's parameters under the model's names (tied ones once)
    grads = {}
    for name, param in split.container.named_parameters():
        plain = name.split(".", 1)[1]
        if plain not in grads and param.grad is not None:
            grads[plain] = param.grad
            own.register_parameter(plain.replace(".", "__"), param)
    return total, grads, _Named(own)


class _Named:
    """`named_parameters()` with dotted names (nn.Module forbids dots in parameter names)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def named_parameters(self):
        return ((n.replace("__", "."), p) for n, p in self.module.named_parameters())


def compare(loss: float, grads: dict[str, torch.Tensor], stage: nn.Module, ref_loss: float,
            ref_grads: dict[str, torch.Tensor]) -> None:
    """Raise `ParityError` naming the first difference."""
    if abs(loss - ref_loss) > LOSS_RTOL * max(1.0, abs(ref_loss)):
        raise ParityError(f"loss {loss:.6f} != single-process {ref_loss:.6f}")
    own = dict(stage.named_parameters())
    missing = [n for n in own if n in ref_grads and n not in grads]
    if missing:
        raise ParityError(f"no gradient for {missing[:3]}")
    for name, grad in grads.items():
        if name not in ref_grads:  # (zeros: dp's all-reduce fills a parameter nothing reached)
            if grad.any():
                raise ParityError(f"gradient for {name}, which the single-process model lacks")
            continue
        # this rank's piece: its experts (and their tp cut, which the ExpertSlice carries), or
        # its tensor-parallel slice
        spec = getattr(own[name], "ep_shard", None) or getattr(own[name], "tp_shard", None)
        want = spec.take(ref_grads[name]) if spec is not None else ref_grads[name]
        if grad.shape != want.shape:
            raise ParityError(f"gradient of {name} has shape {list(grad.shape)}, expected "
                              f"{list(want.shape)}")
        diff = (grad - want).abs().max().item()
        if diff > GRAD_ATOL + GRAD_RTOL * want.abs().max().item():
            raise ParityError(f"gradient of {name} differs by {diff:.2e} (max "
                              f"{want.abs().max().item():.2e})")


def is_moe(config) -> bool:
    configs = [config, *[v for v in vars(config).values() if hasattr(v, "to_dict")]]
    return any(isinstance(getattr(c, k, None), int) and getattr(c, k) > 1
               for c in configs for k in EXPERT_NAMES)


def has_tp_plan(config) -> bool:
    configs = [config, *[v for v in vars(config).values() if hasattr(v, "to_dict")]]
    return any(getattr(c, "base_model_tp_plan", None) for c in configs)
